//! Phase 5, queue scale: the claim/dispatch rate of due messages with and without many
//! messages scheduled a day ahead (created through the library's `Store::accept`). Two queues
//! in one Redis, db 0 empty and db 1 with the backlog; [`crate::memory`] measures what the
//! backlog costs in Redis memory.

use std::collections::HashMap;
use std::time::Duration;

use callbackd::clock::{Clock, SystemClock};
use callbackd::store::redis::RedisStore;

use crate::direct_store::{bulk_accept, drain, store_cycle, store_cycle_at};
use crate::machine::cpu_secs;
use crate::{DEDUPE_TTL_SECS, Env, Report, memory, rate};

pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    eprintln!(
        "[5/8] queue scale: {} due messages, empty queue vs {} scheduled a day ahead",
        plan.due_n, plan.future_n
    );
    // Two queues in one Redis: db 0 stays empty, db 1 holds the future-scheduled messages.
    // Measurements alternate between them, so background load (this machine is shared)
    // hits both sides alike instead of whichever ran second.
    let urls = [env.redis.url_db(0), env.redis.url_db(1)];
    let mut stores = Vec::new();
    for url in &urls {
        let store = RedisStore::connect(url, Duration::from_secs(10), DEDUPE_TTL_SECS)
            .await
            .map_err(|e| e.to_string())?;
        // Stamps the empty store with the layout version, as `callbackd serve` does at start:
        // an unstamped store with data is taken for the old layout, and the drain's process
        // would first upgrade every message the bench created.
        store
            .upgrade(SystemClock.now_ms())
            .await
            .map_err(|e| e.to_string())?;
        stores.push(store);
    }
    let target = env.sink_url.clone();
    let tag = &env.run_tag;
    // Warm-up: loads the scripts and the connections before anything is timed.
    for (i, store) in stores.iter().enumerate() {
        bulk_accept(store, &format!("{tag}-warm{i}"), 500, 0, &target).await?;
        store_cycle(store, 500).await?;
    }

    memory::backlog(env, &stores[1], &target, report).await?;
    memory::finished(env, &target, report).await?;

    // Store half of dispatching, no HTTP: 3 alternating rounds, median per side.
    let mut cycles: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut redis_cpu = [0.0f64; 2];
    let mut commands: [HashMap<String, (u64, u64)>; 2] = [HashMap::new(), HashMap::new()];
    let rounds = if plan.quick { 3 } else { 5 };
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let store = &stores[side];
            bulk_accept(
                store,
                &format!("{tag}-c{side}-{round}"),
                plan.due_n,
                0,
                &target,
            )
            .await?;
            env.redis.reset_stats().await?;
            let r0 = cpu_secs(Some(env.redis.pid())).unwrap_or(0.0);
            let (cycle, cycled) = store_cycle(store, plan.due_n).await?;
            let r1 = cpu_secs(Some(env.redis.pid())).unwrap_or(0.0);
            for (name, calls, usec) in env.redis.command_stats().await? {
                let e = commands[side].entry(name).or_insert((0, 0));
                e.0 += calls;
                e.1 += usec;
            }
            if cycled < plan.due_n {
                return Err(format!("store cycle claimed {cycled} of {}", plan.due_n));
            }
            cycles[side].push(cycle);
            redis_cpu[side] += r1 - r0;
        }
    }
    // The whole service: a callbackd process drains `due_n` due messages into the sink.
    // Each drain is about a second of a fresh process, so one round says little: the full
    // run takes four, two in each order.
    let drain_rounds = if plan.quick { 1 } else { 4 };
    let mut drains: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for round in 0..drain_rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let store = &stores[side];
            bulk_accept(
                store,
                &format!("{tag}-d{side}-{round}"),
                plan.due_n,
                0,
                &target,
            )
            .await?;
            let (rate_, got, repeats, _) = drain(
                env.dir.path(),
                &format!("drain-{side}-{round}"),
                &urls[side],
                &env.sink,
                plan.due_n,
                Duration::from_secs_f64(plan.drain_cap_secs),
            )
            .await?;
            eprintln!(
                "  drain, {}: {}/s ({got} of {} arrived, {repeats} repeats)",
                if side == 0 {
                    "empty queue"
                } else {
                    "with future messages"
                },
                rate(rate_),
                plan.due_n
            );
            drains[side].push(rate_);
            // Whatever the drain left (capped, or parked a second ahead for a busy host)
            // is swept so the next round starts from the same queue.
            store_cycle_at(store, plan.due_n, 10_000).await?;
        }
    }
    // Of an even count, the mean of the middle two: the upper one alone favours the side
    // whose best round was best.
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        if v.len().is_multiple_of(2) {
            (v[mid - 1] + v[mid]) / 2.0
        } else {
            v[mid]
        }
    };
    let list = |v: &[f64]| v.iter().map(|c| rate(*c)).collect::<Vec<_>>().join(", ");
    let label = if plan.quick { "100k" } else { "1M" };
    eprintln!(
        "  store claim+complete: empty {} / future {}",
        list(&cycles[0]),
        list(&cycles[1])
    );
    let (c0, c1) = (median(&mut cycles[0]), median(&mut cycles[1]));
    let (d0, d1) = (median(&mut drains[0]), median(&mut drains[1]));
    let cycle_ratio = c1 / c0;
    let drain_ratio = d1 / d0;
    report.target(
        format!(
            "Store claim+complete/s (claim_due 64 + complete, no HTTP), empty → {label} future-scheduled (median of {rounds}, alternating)"
        ),
        format!("{} → {} ({cycle_ratio:.3}×)", rate(c0), rate(c1)),
        "change < 10%",
        Some((cycle_ratio - 1.0).abs() < 0.10),
    );
    let cpu_per = |side: usize| redis_cpu[side] * 1e6 / (rounds as f64 * plan.due_n as f64);
    report.row(
        format!("Redis CPU per claimed + completed message, empty → {label} future-scheduled"),
        format!(
            "{:.1} µs → {:.1} µs ({:.3}×)",
            cpu_per(0),
            cpu_per(1),
            cpu_per(1) / cpu_per(0).max(1e-9)
        ),
    );
    // Which commands got slower: µs per message on each side, biggest growth first.
    let messages = rounds as f64 * plan.due_n as f64;
    let mut growth: Vec<(String, f64, f64, f64)> = commands[1]
        .iter()
        .map(|(name, (calls, usec))| {
            let before = commands[0].get(name).map(|c| c.1).unwrap_or(0) as f64 / messages;
            (
                name.clone(),
                *calls as f64 / messages,
                before,
                *usec as f64 / messages,
            )
        })
        .collect();
    growth.sort_by(|a, b| (b.3 - b.2).total_cmp(&(a.3 - a.2)));
    report.row(
        "Redis commands per claimed + completed message, empty → future (calls; µs; biggest growth first)",
        growth
            .iter()
            .take(6)
            .map(|(name, calls, a, b)| format!("{name} {calls:.2}× {a:.1} → {b:.1} µs"))
            .collect::<Vec<_>>()
            .join("; "),
    );
    report.target(
        format!(
            "callbackd drain deliveries/s, empty → {label} future-scheduled (median of {drain_rounds} alternating round(s))"
        ),
        format!(
            "{} → {} ({drain_ratio:.3}×; rounds: empty {} / future {})",
            rate(d0),
            rate(d1),
            list(&drains[0]),
            list(&drains[1])
        ),
        "change < 10%",
        Some((drain_ratio - 1.0).abs() < 0.10),
    );

    memory::dedupe_keys(env, report).await?;
    env.redis.flushall().await?;
    Ok(())
}
