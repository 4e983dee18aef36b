//! Phase 2, half load: an open loop at 50% of the measured ingest rate, latency measured from
//! each request's *scheduled* send time, so a stall is charged to every request it delays (no
//! coordinated omission); then the same at 10%, the machine's latency floor.

use crate::daemon::Daemon;
use crate::load::{accepted_fresh, ingest_make, open_loop, percentiles};
use crate::{Env, Report, ms, rate};

pub async fn run(env: &Env, daemon: &Daemon, report: &mut Report, ingest_rate: f64) {
    let plan = env.plan;
    let half = (ingest_rate * 0.5).max(1.0);
    eprintln!(
        "[2/8] half load: open loop at {} req/s for {} s",
        rate(half),
        plan.half_secs
    );
    let open = open_loop(
        daemon.addr,
        half,
        plan.half_secs,
        ingest_make(daemon.host(), format!("{}-h", env.run_tag)),
        accepted_fresh(),
    )
    .await;
    let p99 = open.hist.value_at_quantile(0.99);
    eprintln!(
        "  {}; service time {}",
        percentiles(&open.hist),
        percentiles(&open.service)
    );
    report.target(
        format!(
            "Half load ({} req/s open loop, {} achieved): latency from scheduled send",
            rate(half),
            rate(open.per_sec())
        ),
        format!(
            "p50 {} / p99 {}",
            ms(open.hist.value_at_quantile(0.5)),
            ms(p99)
        ),
        "p99 ≤ 5 ms",
        Some(!open.hist.is_empty() && p99 <= 5_000 && open.failed == 0),
    );
    report.row(
        "Half load: service time (from actual send)",
        percentiles(&open.service),
    );
    if open.failed > 0 {
        report.note(format!(
            "half load: {} requests failed ({})",
            open.failed,
            open.failures()
        ));
    }
    // The same at a tenth of the rate: the latency floor of this machine as it is (shared
    // cores, scheduler), to tell queueing at half load from noise that is there anyway.
    let tenth = (ingest_rate * 0.1).max(1.0);
    let low = open_loop(
        daemon.addr,
        tenth,
        plan.half_secs,
        ingest_make(daemon.host(), format!("{}-t", env.run_tag)),
        accepted_fresh(),
    )
    .await;
    eprintln!("  10% load: {}", percentiles(&low.hist));
    report.row(
        format!(
            "10% load ({} req/s open loop): latency from scheduled send",
            rate(tenth)
        ),
        percentiles(&low.hist),
    );
}
