//! The PostgreSQL phase's retention run (issue 26): "a month of finished callbacks must go
//! away without a DELETE that scans the table or leaves it bloated; sweeping a day of expired
//! messages costs no more than writing them did; the table size stays flat across retention
//! periods."
//!
//! The store takes `now` from its caller, so a virtual clock runs [`DAYS`] days (three
//! retention periods of [`RETENTION_DAYS`]) in minutes: each day, `per_day` callbacks are
//! accepted through `Store::accept` in its first half (dedupe claims kept as long as the
//! messages), claimed and completed with one delivery attempt at midday, and the day ends
//! with the sweep at its last millisecond, called until it has nothing left. From day
//! [`RETENTION_DAYS`] on, each sweep deletes a day of dedupe claims and drops a day's
//! partitions of messages and history. Printed each day: the total relation size of the
//! database, and the time and server CPU of writing the day against sweeping it.
//!
//! Each virtual day ends with a plain `VACUUM` (no `FULL`), timed on its own: a real day gives
//! autovacuum over a thousand visits (its naptime is a minute; the hot tables are vacuumed at
//! 2% dead rows), where a virtual day lasts a tenth of a second here and would see none. The
//! dead rows of the live partitions and of the deleted claims are made reusable as a real
//! server's autovacuum would; nothing is compacted or returned.

use std::time::{Duration, Instant};

use callbackd::clock::{Clock, SystemClock};
use callbackd::store::postgres::PostgresStore;
use callbackd::store::{Completion, DeliveryAttempt, Store};
use futures::stream::{self, StreamExt};

use crate::direct_store::inbound_accept_for;
use crate::pg_server::{Pg, Sizes, connect, mib, sizes};
use crate::{CONCURRENCY, DAY_MS, Env, Report, rate};

/// Retention of finished messages and of dedupe claims: a month.
const RETENTION_DAYS: i64 = 30;
/// Three retention periods.
const DAYS: i64 = 3 * RETENTION_DAYS;
/// Claimers running at once while a day's messages are finished.
const CLAIMERS: usize = 4;

struct Day {
    size: Sizes,
    write: f64,
    write_cpu: f64,
    sweep: f64,
    sweep_cpu: f64,
    swept: usize,
    vacuum: f64,
    vacuum_cpu: f64,
}

pub async fn run(env: &Env, pg: &Pg, report: &mut Report) -> Result<(), String> {
    let total = env.plan.pg_retention_n;
    let per_day = (total / DAYS as u64).max(1);
    eprintln!(
        "  retention: {DAYS} virtual days, {RETENTION_DAYS}-day retention, {per_day} callbacks a day ({} in all)",
        per_day * DAYS as u64
    );
    let url = pg.create_db("retention")?;
    let retention_secs = (RETENTION_DAYS * DAY_MS / 1000) as u64;
    let mut store = PostgresStore::connect(&url, Duration::from_secs(60), retention_secs)
        .await
        .map_err(|e| format!("retention: {e}"))?
        .with_caller_clock_leases();
    store
        .migrate()
        .await
        .map_err(|e| format!("retention: {e}"))?;
    let client = connect(&url).await?;
    let midnight = SystemClock.now_ms() / DAY_MS * DAY_MS;
    let mut days: Vec<Day> = Vec::new();
    let mut failed_claims = 0u64;
    for day in 0..DAYS {
        let start = midnight + day * DAY_MS;
        let s0 = pg.cpu_secs().unwrap_or(0.0);
        let t0 = Instant::now();
        accept_day(&store, env, day, per_day, start, retention_secs).await?;
        let (finished, failed) = finish_day(&store, start + DAY_MS / 2).await?;
        failed_claims += failed;
        if finished < per_day {
            return Err(format!(
                "retention day {day}: finished {finished} of {per_day}"
            ));
        }
        let write = t0.elapsed().as_secs_f64();
        let s1 = pg.cpu_secs().unwrap_or(0.0);
        let t1 = Instant::now();
        let mut swept = 0;
        for _ in 0..10_000 {
            let n = store
                .sweep(start + DAY_MS - 1)
                .await
                .map_err(|e| format!("sweep: {e}"))?;
            if n == 0 {
                break;
            }
            swept += n;
        }
        let sweep = t1.elapsed().as_secs_f64();
        let s2 = pg.cpu_secs().unwrap_or(0.0);
        let t2 = Instant::now();
        client
            .batch_execute("VACUUM")
            .await
            .map_err(|e| format!("VACUUM: {e}"))?;
        let vacuum = t2.elapsed().as_secs_f64();
        let s3 = pg.cpu_secs().unwrap_or(0.0);
        let size = sizes(&client).await?;
        eprintln!(
            "    day {:>2}: {} (finished days {}, claims {}, live {}); write {write:.2} s, sweep {sweep:.2} s ({swept} rows and days)",
            day + 1,
            mib(size.total()),
            mib(size.finished),
            mib(size.claims),
            mib(size.live),
        );
        days.push(Day {
            size,
            write,
            write_cpu: s1 - s0,
            sweep,
            sweep_cpu: s2 - s1,
            swept,
            vacuum,
            vacuum_cpu: s3 - s2,
        });
    }

    // From the first day whose sweep dropped a day on, the store holds one retention period.
    let first = RETENTION_DAYS as usize; // day 31 (index 30)
    let plateau = &days[first - 1..];
    let base = plateau[0].size.total();
    let max = plateau.iter().map(|d| d.size.total()).max().unwrap_or(base);
    let last = plateau.last().map(|d| d.size.total()).unwrap_or(base);
    let shown: Vec<String> = days
        .iter()
        .enumerate()
        .filter(|(i, _)| (i + 1) % 10 == 0 || *i == 0)
        .map(|(i, d)| format!("day {} {}", i + 1, mib(d.size.total())))
        .collect();
    report.row(
        format!(
            "PostgreSQL retention run ({DAYS} virtual days, {RETENTION_DAYS}-day retention, {} a day, {} in all): total relation size at the end of a day",
            rate(per_day as f64),
            rate((per_day * DAYS as u64) as f64)
        ),
        shown.join(", "),
    );
    let growth = max as f64 / base.max(1) as f64;
    report.target(
        format!(
            "PostgreSQL retention: size over days {RETENTION_DAYS}–{DAYS} (after each sweep) against day {RETENTION_DAYS}"
        ),
        format!(
            "day {RETENTION_DAYS} {}, max {} ({growth:.3}×), day {DAYS} {} ({:.3}×)",
            mib(base),
            mib(max),
            mib(last),
            last as f64 / base.max(1) as f64
        ),
        "flat (≤ 1.10×)",
        Some(growth <= 1.10),
    );
    // Against day 30 alone, a first period written with less bloat than the live partitions
    // reach later reads as growth: the largest size of each later period, and what the tables
    // held then, say whether the size keeps growing or has levelled off.
    let periods: Vec<String> = days[first..]
        .chunks(RETENTION_DAYS as usize)
        .enumerate()
        .filter_map(|(n, period)| {
            let (i, top) = period
                .iter()
                .enumerate()
                .max_by_key(|(_, d)| d.size.total())?;
            let day = first + n * RETENTION_DAYS as usize + i + 1;
            Some(format!(
                "days {}–{}: max {} on day {day} (finished days {}, live partitions and queue {}, dedupe claims {}, other {})",
                first + n * RETENTION_DAYS as usize + 1,
                first + n * RETENTION_DAYS as usize + period.len(),
                mib(top.size.total()),
                mib(top.size.finished),
                mib(top.size.live),
                mib(top.size.claims),
                mib(top.size.other)
            ))
        })
        .collect();
    report.row(
        "PostgreSQL retention: the largest size in each retention period after the first",
        periods.join("; "),
    );
    // What a month of callbacks costs on disk at this size, its live partitions at the
    // backlog a day's work leaves and not at a small run's share: the largest size once the
    // store holds one retention period, over the callbacks a period keeps.
    if let Some(top) = plateau.iter().max_by_key(|d| d.size.total()) {
        let kept = (RETENTION_DAYS as u64 * per_day) as f64;
        let per = |bytes: i64| bytes as f64 / kept;
        let total = per(top.size.total());
        report.target(
            format!(
                "PostgreSQL bytes on disk per retained callback (one attempt), the largest size over days {RETENTION_DAYS}–{DAYS} over the {} callbacks a retention period keeps",
                rate(kept)
            ),
            format!(
                "{total:.0} B (finished days {:.0} + dedupe claims {:.0} + live partitions and queue {:.0} + other {:.0})",
                per(top.size.finished),
                per(top.size.claims),
                per(top.size.live),
                per(top.size.other)
            ),
            "≤ 1 KB",
            Some(total <= 1024.0),
        );
    }
    // The sweeps that had a day to take: from day 31 on.
    let swept = &days[first..];
    let median = |f: &dyn Fn(&Day) -> f64| {
        let mut v: Vec<f64> = swept.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (write, write_cpu) = (median(&|d| d.write), median(&|d| d.write_cpu));
    let (sweep, sweep_cpu) = (median(&|d| d.sweep), median(&|d| d.sweep_cpu));
    let rows = median(&|d| d.swept as f64);
    let (sum_write, sum_sweep): (f64, f64) = swept
        .iter()
        .fold((0.0, 0.0), |(w, s), d| (w + d.write_cpu, s + d.sweep_cpu));
    report.target(
        format!(
            "PostgreSQL retention: a day's sweep against writing the day (median over days {}–{DAYS}; writing = accept + claim + complete)",
            RETENTION_DAYS + 1
        ),
        format!(
            "sweep {sweep:.3} s, {sweep_cpu:.3} s postgres CPU ({rows:.0} rows deleted + days dropped per day) vs write {write:.2} s, {write_cpu:.2} s postgres CPU; all days: postgres CPU sweeping {sum_sweep:.2} s vs writing {sum_write:.1} s"
        ),
        "sweep ≤ write",
        Some(sweep <= write && sweep_cpu <= write_cpu.max(0.01)),
    );
    let (vacuum, vacuum_cpu) = (median(&|d| d.vacuum), median(&|d| d.vacuum_cpu));
    report.row(
        format!(
            "PostgreSQL retention: the day's VACUUM, standing in for autovacuum's visits over a real day (median over days {}–{DAYS})",
            RETENTION_DAYS + 1
        ),
        format!("{vacuum:.3} s, {vacuum_cpu:.3} s postgres CPU"),
    );
    if failed_claims > 0 {
        report.note(format!(
            "postgres retention run: {failed_claims} claims failed and were tried again ({CLAIMERS} claimers at once; the engine itself retries a claim that meets a row a concurrent complete moved, so any failure here is something else)"
        ));
    }
    Ok(())
}

/// Accepts `n` callbacks of day `day` at times spread over its first half.
async fn accept_day(
    store: &PostgresStore,
    env: &Env,
    day: i64,
    n: u64,
    start: i64,
    ttl_secs: u64,
) -> Result<(), String> {
    let partitions = store.partitions();
    let step = (DAY_MS / 2) / n.max(1) as i64;
    let failures: Vec<String> = stream::iter(0..n)
        .map(|i| async move {
            let now = start + i as i64 * step;
            let req = inbound_accept_for(
                &format!("tx-{}-r{day}-{i}", env.run_tag),
                now,
                &env.sink_url,
                partitions,
                ttl_secs,
            );
            store.accept(req, now).await
        })
        .buffer_unordered(256)
        .filter_map(|r| async move {
            match r {
                Ok(callbackd::store::AcceptOutcome::Accepted) => None,
                Ok(other) => Some(format!("{other:?}")),
                Err(e) => Some(e.to_string()),
            }
        })
        .collect()
        .await;
    match failures.first() {
        None => Ok(()),
        Some(first) => Err(format!(
            "retention day {day}: {} accepts failed, first: {first}",
            failures.len()
        )),
    }
}

/// Claims and completes (one delivery attempt, delivered) what is due at `now`, with
/// [`CLAIMERS`] claim loops at once; returns how many.
///
/// A claim that fails is tried again, as a dispatcher tries at its next turn, and counted, so
/// that a failure shows in the report rather than ending the run. Returns how many were
/// finished and how many claims failed.
async fn finish_day(store: &PostgresStore, now: i64) -> Result<(u64, u64), String> {
    let loops = (0..CLAIMERS).map(|_| async move {
        let (mut done, mut failed) = (0u64, 0u64);
        loop {
            let batch = match store.claim_due(now, CONCURRENCY, 60_000).await {
                Ok(batch) => batch,
                Err(e) if failed < 1_000 => {
                    failed += 1;
                    if failed == 1 {
                        eprintln!("    a claim failed, tried again: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                Err(e) => return Err(e.to_string()),
            };
            if batch.is_empty() {
                return Ok::<(u64, u64), String>((done, failed));
            }
            let completions = batch.iter().map(|lease| {
                let attempt = DeliveryAttempt {
                    attempt: lease.attempts + 1,
                    at: now,
                    status: Some(204),
                    error: None,
                    latency_ms: Some(1),
                    response: None,
                };
                store.complete(lease, attempt, Completion::Delivered, now)
            });
            for r in futures::future::join_all(completions).await {
                r.map_err(|e| e.to_string())?;
            }
            done += batch.len() as u64;
        }
    });
    let (mut done, mut failed) = (0, 0);
    for r in futures::future::join_all(loops).await {
        let (d, f) = r?;
        done += d;
        failed += f;
    }
    Ok((done, failed))
}
