//! What the idle-dispatcher measurements of the Redis Cluster and PostgreSQL phases share:
//! pairs of windows, one with the dispatcher running and one with it stopped (`SIGSTOP`, so
//! it keeps its connections and sends nothing), whose differences are the dispatcher's cost.
//!
//! Why pairs: a server's own idle work (Redis' serverCron, the AOF's fsync, a cluster's bus;
//! PostgreSQL's checkpointer, WAL writer and autovacuum) costs several times more than an idle
//! dispatcher, and the machine drifts between two windows by more than the dispatcher costs.
//! One window with it and one without measured the drift as much as the dispatcher.

use std::time::Duration;

use callbackd::dispatch::SIGNALLED_IDLE_POLL;

/// Pairs of windows in an idle measurement.
pub const IDLE_PAIRS: usize = 5;

/// A window of an idle measurement: at least `secs`, rounded up to whole idle polls, so that
/// every window holds the same number of polls. A window shorter than the poll would hold one
/// or none by chance.
pub fn idle_window(secs: f64) -> Duration {
    let poll = SIGNALLED_IDLE_POLL.as_secs_f64();
    Duration::from_secs_f64((secs / poll).ceil().max(1.0) * poll)
}

/// How long a resumed dispatcher is left before its window is measured: half its idle poll.
/// On waking it makes at once the poll it missed while stopped, which would otherwise count in
/// the window; after it, the polls come a whole poll apart, so a window of whole polls
/// starting half-way between two holds exactly its number of them.
pub fn settle_after_resume() -> Duration {
    SIGNALLED_IDLE_POLL / 2
}

/// Stops (`-STOP`) or resumes (`-CONT`) process `pid`.
pub fn signal(pid: u32, which: &str) -> Result<(), String> {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .map_err(|e| format!("kill {which} {pid}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill {which} {pid}: {status}"))
    }
}

/// Median, mean and each value of a few per-second figures: the median, because one window
/// may take in a server's own burst (a checkpoint, an autovacuum) that the mean would carry.
pub fn spread(values: &[f64]) -> String {
    if values.is_empty() {
        return "n/a".into();
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let each: Vec<String> = values.iter().map(|v| format!("{v:.2}")).collect();
    format!("median {median:.2}, mean {mean:.2} ({})", each.join(", "))
}
