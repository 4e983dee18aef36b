//! Phase 6, SQLite: the ingest phase against the embedded store (`store.url =
//! "sqlite://..."`).

use crate::daemon::Daemon;
use crate::load::{accepted_fresh, ingest_make};
use crate::load::{closed_loop, percentiles};
use crate::machine::{CpuSnapshot, peak_rss_mib};
use crate::{Env, Report, rate};

/// Issue 13's target for the embedded store at `synchronous = FULL`.
const TARGET_PER_SEC: f64 = 10_000.0;
const TARGET: &str = "≥ 10,000/s (synchronous = FULL)";

pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    eprintln!(
        "[6/8] ingest with the embedded SQLite store, {} s",
        plan.sqlite_secs
    );
    let db = env.dir.path().join("sqlite").join("cb.db");
    let _ = std::fs::create_dir_all(db.parent().expect("has a parent"));
    let url = format!("sqlite://{}", db.display());
    let mut daemon = match Daemon::start(env.dir.path(), "sqlite", &url, true).await {
        Ok(d) => d,
        Err(e) => {
            eprintln!("  sqlite: not available ({e})");
            report.target(
                "SQLite ingest",
                format!("sqlite: not available ({e})"),
                TARGET,
                None,
            );
            return Ok(());
        }
    };
    let mut before = CpuSnapshot::take(daemon.pid, env.redis.pid());
    before.redis = None;
    let ingest = closed_loop(
        daemon.addr,
        plan.sqlite_secs,
        u64::MAX,
        ingest_make(daemon.host(), format!("{}-s", env.run_tag)),
        accepted_fresh(),
    )
    .await;
    let mut after = CpuSnapshot::take(daemon.pid, env.redis.pid());
    after.redis = None;
    let rss = peak_rss_mib(daemon.pid);
    eprintln!(
        "  {} accepted/s, {}",
        rate(ingest.per_sec()),
        percentiles(&ingest.hist)
    );
    report.target(
        "SQLite ingest: accepted callbacks/s (64 conns, closed loop)",
        rate(ingest.per_sec()),
        TARGET,
        Some(ingest.per_sec() >= TARGET_PER_SEC && ingest.ok > 0),
    );
    report.row("SQLite ingest: latency", percentiles(&ingest.hist));
    report.row(
        "SQLite ingest: CPU per accepted callback",
        before.per_op(&after, ingest.ok),
    );
    report.row("SQLite ingest: CPU in use", before.describe(&after));
    if let Some(mib) = rss {
        report.row(
            "Peak RSS of callbackd under SQLite ingest",
            format!("{mib:.1} MiB"),
        );
    }
    if ingest.failed > 0 {
        report.note(format!(
            "sqlite ingest: {} requests failed ({})",
            ingest.failed,
            ingest.failures()
        ));
    }
    let logged = daemon.errors_logged();
    if logged > 0 {
        report.note(format!(
            "sqlite process logged {logged} WARN/ERROR lines, last: {}",
            daemon.log_tail()
        ));
    }
    daemon.stop();
    Ok(())
}
