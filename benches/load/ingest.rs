//! Phase 1, ingest: 64 connections post unique, validly signed PayZu callbacks in a closed
//! loop; then `redis-benchmark` runs unpipelined `SET NX EX` against the same Redis for the
//! ratio. The same process then serves phases 2 (half load) and 3 (duplicate storm).

use std::process::Command;
use std::time::Duration;

use crate::daemon::Daemon;
use crate::load::{accepted_fresh, closed_loop, ingest_make, percentiles};
use crate::machine::{CpuSnapshot, cpu_secs, peak_rss_mib, run_bounded};
use crate::{CONCURRENCY, Env, Report, half_load, naive, rate, redis_stats, storm};

/// Phases 1-3 against one Redis-backed process.
pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    eprintln!(
        "[1/8] ingest: {} connections, {} s, Redis store",
        CONCURRENCY, env.plan.ingest_secs
    );
    let mut daemon = Daemon::start(env.dir.path(), "ingest", &env.redis.url(), true).await?;
    let (ingest_rate, redis_us_per_accept) = ingest(env, &daemon, report).await?;
    raw_redis(env, report, ingest_rate, redis_us_per_accept);
    naive::run(env, report, ingest_rate).await?;
    half_load::run(env, &daemon, report, ingest_rate).await;
    storm::run(env, &daemon, report).await?;
    if let Some(mib) = peak_rss_mib(daemon.pid) {
        report.row(
            "Peak RSS of callbackd after ingest + half load + storm",
            format!("{mib:.1} MiB"),
        );
    }
    let logged = daemon.errors_logged();
    if logged > 0 {
        report.note(format!(
            "ingest process logged {logged} WARN/ERROR lines, last: {}",
            daemon.log_tail()
        ));
    }
    daemon.stop();
    env.redis.flushall().await?;
    Ok(())
}

/// Returns the accepted callbacks per second and the Redis CPU µs per accepted callback.
async fn ingest(
    env: &Env,
    daemon: &Daemon,
    report: &mut Report,
) -> Result<(f64, Option<f64>), String> {
    let plan = env.plan;
    env.redis.reset_stats().await?;
    let before = CpuSnapshot::take(daemon.pid, env.redis.pid());
    let ingest = closed_loop(
        daemon.addr,
        plan.ingest_secs,
        u64::MAX,
        ingest_make(daemon.host(), format!("{}-i", env.run_tag)),
        accepted_fresh(),
    )
    .await;
    let after = CpuSnapshot::take(daemon.pid, env.redis.pid());
    let rss = peak_rss_mib(daemon.pid);
    let ingest_rate = ingest.per_sec();
    eprintln!(
        "  {} accepted/s, {}",
        rate(ingest_rate),
        percentiles(&ingest.hist)
    );
    report.row(
        "Ingest, Redis: accepted callbacks/s (64 conns, closed loop)",
        rate(ingest_rate),
    );
    report.row("Ingest, Redis: latency", percentiles(&ingest.hist));
    report.row("Ingest, Redis: CPU in use", before.describe(&after));
    report.row(
        "Ingest, Redis: CPU per accepted callback",
        before.per_op(&after, ingest.ok),
    );
    let redis_us_per_accept = match (before.redis, after.redis) {
        (Some(a), Some(b)) => Some((b - a) * 1e6 / ingest.ok.max(1) as f64),
        _ => None,
    };
    if let Ok(stats) = env.redis.command_stats().await {
        report.row(
            "Ingest, Redis: commands per accepted callback (INFO commandstats: calls, µs; commands run inside scripts are also inside evalsha)",
            redis_stats::per_op(&stats, ingest.ok),
        );
    }
    if ingest.failed > 0 {
        report.note(format!(
            "ingest: {} requests failed ({})",
            ingest.failed,
            ingest.failures()
        ));
    }
    match rss {
        Some(mib) => report.target(
            "Peak RSS of callbackd under ingest (VmHWM)",
            format!("{mib:.1} MiB"),
            "≤ 64 MB",
            Some(mib <= 64.0),
        ),
        None => report.target(
            "Peak RSS of callbackd under ingest",
            "unreadable",
            "≤ 64 MB",
            None,
        ),
    }
    Ok((ingest_rate, redis_us_per_accept))
}

fn raw_redis(env: &Env, report: &mut Report, ingest_rate: f64, redis_us_per_accept: Option<f64>) {
    let plan = env.plan;
    eprintln!(
        "[1/8] raw Redis: redis-benchmark -c 64 -n {} SET NX EX (unpipelined)",
        plan.redis_bench_n
    );
    let mut cmd = Command::new("redis-benchmark");
    cmd.args([
        "-h",
        "127.0.0.1",
        "-p",
        &env.redis.port().to_string(),
        "-c",
        "64",
        "-n",
        &plan.redis_bench_n.to_string(),
        "-r",
        "100000000",
        "--csv",
        "SET",
        "key:__rand_int__",
        "v",
        "EX",
        "2592000",
        "NX",
    ]);
    let redis_cpu_before = cpu_secs(Some(env.redis.pid()));
    let raw = run_bounded(
        cmd,
        Duration::from_secs(120),
        &env.dir.path().join("redis-benchmark.csv"),
    )
    .and_then(|out| {
        out.lines()
            .find(|l| l.starts_with("\"SET"))
            .and_then(|l| l.split(',').nth(1))
            .and_then(|v| v.trim_matches('"').parse::<f64>().ok())
            .ok_or_else(|| format!("cannot read requests/s from redis-benchmark output: {out:?}"))
    });
    match raw {
        Ok(raw) => {
            eprintln!("  raw Redis {} SET NX/s", rate(raw));
            report.row(
                "Raw Redis SET NX EX/s (redis-benchmark -c 64, unpipelined, same Redis)",
                rate(raw),
            );
            if let (Some(a), Some(b), Some(per_accept)) = (
                redis_cpu_before,
                cpu_secs(Some(env.redis.pid())),
                redis_us_per_accept,
            ) {
                let per_set = (b - a) * 1e6 / plan.redis_bench_n as f64;
                report.row(
                    "Redis CPU per accepted callback vs per raw SET NX",
                    format!(
                        "{per_accept:.1} µs vs {per_set:.1} µs ({:.1}×)",
                        per_accept / per_set
                    ),
                );
            }
            let ratio = ingest_rate / raw;
            report.target(
                "Ingest / raw Redis SET NX",
                format!("{ratio:.3}×"),
                "≥ 0.5×",
                Some(ratio >= 0.5),
            );
        }
        Err(e) => {
            report.target(
                "Ingest / raw Redis SET NX",
                format!("n/a ({e})"),
                "≥ 0.5×",
                None,
            );
        }
    }
}
