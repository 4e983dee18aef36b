//! Phase 4, dispatch: notifications handed off to an ingest-only process, then drained into
//! the sink by a second process with dispatch on; then acceptance-to-first-attempt latency at
//! a moderate open-loop hand-off rate.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::client::{json_field, notification_body, notification_request};
use crate::daemon::Daemon;
use crate::load::{LoadResult, closed_loop, new_hist, open_loop, percentiles};
use crate::machine::{cpu_secs, peak_rss_mib};
use crate::{Env, Report, ms, rate, redis_stats, wrk};

pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    let n = plan.dispatch_n;
    eprintln!("[4/8] dispatch: hand off {n} notifications to an ingest-only process");
    let store_url = env.redis.url();
    let handoff = hand_off(env, &store_url, "handoff", "d", &[]).await?;
    eprintln!(
        "  {} hand-offs/s, {}",
        rate(handoff.per_sec()),
        percentiles(&handoff.hist)
    );
    report.row(
        "Notification hand-off/s (POST /v1/notifications, dispatch off)",
        rate(handoff.per_sec()),
    );
    report.row("Notification hand-off latency", percentiles(&handoff.hist));
    if handoff.failed > 0 {
        report.note(format!(
            "hand-off: {} requests failed ({})",
            handoff.failed,
            handoff.failures()
        ));
    }
    if env.sink.unique() > 0 {
        report.note("deliveries arrived while dispatch was disabled");
    }

    eprintln!("  draining {} with a dispatching process", handoff.ok);
    env.redis.reset_stats().await?;
    let redis_cpu = cpu_secs(Some(env.redis.pid()));
    let self_cpu = cpu_secs(None);
    let (mut dispatcher, Drained { got, per_sec }) =
        drain(env, &store_url, "dispatch", handoff.ok, &[]).await?;
    if let (Some(r0), Some(r1), Some(d), Some(s0), Some(s1)) = (
        redis_cpu,
        cpu_secs(Some(env.redis.pid())),
        cpu_secs(Some(dispatcher.pid)),
        self_cpu,
        cpu_secs(None),
    ) {
        let per = |secs: f64| secs * 1e6 / got.max(1) as f64;
        if let Ok(stats) = env.redis.command_stats().await {
            report.row(
                "Dispatch drain: Redis commands per delivery (calls, µs)",
                redis_stats::per_op(&stats, got as u64),
            );
        }
        report.row(
            "Dispatch drain: CPU per delivery",
            format!(
                "callbackd {:.0} µs / redis {:.0} µs / sink {:.0} µs",
                per(d),
                per(r1 - r0),
                per(s1 - s0)
            ),
        );
    }
    eprintln!("  {} deliveries/s ({got} delivered)", rate(per_sec));
    report.target(
        format!(
            "Dispatch drain: deliveries/s ({got}/{} delivered, first to last arrival)",
            handoff.ok
        ),
        rate(per_sec),
        "≥ 10,000/s",
        Some(per_sec >= 10_000.0),
    );
    let repeats = env.sink.repeats.load(Ordering::Relaxed);
    if repeats > 0 {
        report.note(format!("dispatch drain: {repeats} repeated deliveries"));
    }
    if let Some(mib) = peak_rss_mib(dispatcher.pid) {
        report.row(
            "Peak RSS of callbackd during the drain",
            format!("{mib:.1} MiB"),
        );
    }

    if (got as u64) < handoff.ok {
        report.note(format!(
            "dispatch drain: watched for {} s at most; {got} of {} arrived by then",
            plan.drain_cap_secs, handoff.ok
        ));
    }
    // A fresh process on an empty queue, so a backlog left by a capped drain does not
    // compete with the latency measurement.
    dispatcher.stop();
    env.redis.flushall().await?;
    // With the drain's process stopped, so that a capped drain does not deliver beside wrk.
    eprintln!(
        "  wrk: raw POSTs into the same sink for {} s",
        plan.wrk_secs
    );
    let body = notification_body(&format!("pay-{}-wrk", env.run_tag), &env.sink_url);
    match wrk::raw_post_rate(&env.sink_url, &body, plan.wrk_secs, env.dir.path()).await {
        Ok(raw) => {
            report.row(
                "Raw POSTs/s into the same sink (wrk, 1 thread, 16 connections)",
                rate(raw),
            );
            report.row(
                "Dispatch drain / wrk's raw POST rate",
                format!("{:.3}×", per_sec / raw.max(1.0)),
            );
        }
        Err(e) => report.note(format!(
            "wrk: not measured ({e}); Debian: apt-get install wrk"
        )),
    }
    let mut dispatcher =
        Daemon::start(env.dir.path(), "first-attempt", &env.redis.url(), true).await?;

    first_attempt(env, &dispatcher, "f", "", report).await;
    // Accepted by a second process with dispatch off: the dispatcher is woken through Redis
    // (the accept script's publish), not by its own accept.
    let mut front = Daemon::start(
        env.dir.path(),
        "first-attempt-front",
        &env.redis.url(),
        false,
    )
    .await?;
    first_attempt(env, &front, "g", ", accepted by another process", report).await;
    front.stop();
    dispatcher.stop();
    env.redis.flushall().await?;
    Ok(())
}

/// Hands off notifications through `front` at the plan's open-loop rate (payment ids
/// `pay-<run tag>-<id_tag><i>`) and reports the time from each 202 to its first arrival at
/// the sink, delivered by whichever process dispatches.
async fn first_attempt(env: &Env, front: &Daemon, id_tag: &str, label: &str, report: &mut Report) {
    let plan = env.plan;
    eprintln!(
        "  first-attempt latency: open-loop hand-off at {}/s for {} s",
        plan.first_rate, plan.first_secs
    );
    env.sink.reset();
    let accepted_at: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let (host, url, prefix) = (
        front.host(),
        env.sink_url.clone(),
        format!("pay-{}-{id_tag}", env.run_tag),
    );
    let record = accepted_at.clone();
    let handoffs = open_loop(
        front.addr,
        plan.first_rate,
        plan.first_secs,
        Arc::new(move |i| notification_request(&host, &format!("{prefix}{i}"), &url)),
        Arc::new(move |_, r| {
            let now = Instant::now();
            match (r.status, json_field(&r.body, "notificationId")) {
                (202, Some(id)) => {
                    if let Ok(mut m) = record.lock() {
                        m.insert(id, now);
                    }
                    true
                }
                _ => false,
            }
        }),
    )
    .await;
    let accepted = accepted_at.lock().map(|m| m.clone()).unwrap_or_default();
    let got = env
        .sink
        .wait_for(
            accepted.len(),
            Duration::from_secs(10),
            Duration::from_secs(30),
        )
        .await;
    let arrivals = env.sink.snapshot();
    let mut hist = new_hist();
    let mut early = 0;
    for (id, at) in &accepted {
        if let Some(arrived) = arrivals.get(id) {
            if arrived < at {
                early += 1;
            }
            hist.saturating_record(arrived.saturating_duration_since(*at).as_micros() as u64);
        }
    }
    let p99 = hist.value_at_quantile(0.99);
    eprintln!("  first attempt{label} {}", percentiles(&hist));
    report.target(
        format!(
            "First attempt after acceptance{label} ({}/s hand-off, {got}/{} delivered)",
            plan.first_rate,
            accepted.len()
        ),
        format!("p50 {} / p99 {}", ms(hist.value_at_quantile(0.5)), ms(p99)),
        "p99 ≤ 100 ms",
        Some(!hist.is_empty() && p99 <= 100_000 && got == accepted.len()),
    );
    if early > 0 {
        report.note(format!(
            "first attempt{label}: {early} deliveries reached the sink before the client had read the 202 (counted as 0 ms)"
        ));
    }
    if handoffs.failed > 0 {
        report.note(format!(
            "first-attempt hand-off{label}: {} requests failed ({})",
            handoffs.failed,
            handoffs.failures()
        ));
    }
}

/// Hands off the plan's `dispatch_n` notifications (payment ids `pay-<run tag>-<id_tag><i>`)
/// to a process named `name` on `store_url` with dispatch off, closed loop; the process is
/// stopped before this returns. The sink is reset first, so whatever reaches it meanwhile was
/// delivered by a process that should not have.
pub async fn hand_off(
    env: &Env,
    store_url: &str,
    name: &str,
    id_tag: &str,
    settings: &[(&str, &str)],
) -> Result<LoadResult, String> {
    env.sink.reset();
    let mut ingest_only =
        Daemon::start_with_env(env.dir.path(), name, store_url, false, settings).await?;
    let (host, url, prefix) = (
        ingest_only.host(),
        env.sink_url.clone(),
        format!("pay-{}-{id_tag}", env.run_tag),
    );
    let handoff = closed_loop(
        ingest_only.addr,
        120.0,
        env.plan.dispatch_n,
        Arc::new(move |i| notification_request(&host, &format!("{prefix}{i}"), &url)),
        Arc::new(|_, r| r.status == 202 && !r.replayed),
    )
    .await;
    ingest_only.stop();
    Ok(handoff)
}

/// What a drain delivered: distinct messages, and their rate from first to last arrival.
pub struct Drained {
    pub got: usize,
    pub per_sec: f64,
}

/// Starts a dispatching process named `name` on `store_url` and watches the sink until
/// `expected` distinct deliveries arrived, nothing new came for 15 s, or the plan's drain cap
/// passed. The process is returned still running, for the caller's CPU and memory readings.
pub async fn drain(
    env: &Env,
    store_url: &str,
    name: &str,
    expected: u64,
    settings: &[(&str, &str)],
) -> Result<(Daemon, Drained), String> {
    env.sink.reset();
    let dispatcher =
        Daemon::start_with_env(env.dir.path(), name, store_url, true, settings).await?;
    let got = env
        .sink
        .wait_for(
            expected as usize,
            Duration::from_secs(15),
            Duration::from_secs_f64(env.plan.drain_cap_secs),
        )
        .await;
    let (first, last) = env.sink.span().ok_or("nothing was delivered")?;
    let secs = last.duration_since(first).as_secs_f64().max(1e-6);
    let per_sec = (got as f64 - 1.0).max(1.0) / secs;
    Ok((dispatcher, Drained { got, per_sec }))
}
