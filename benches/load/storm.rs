//! Phase 3, duplicate storm: one callback, byte for byte, from all 64 connections; an answer
//! counts only as a byte-identical replay.

use std::sync::Arc;

use crate::client::{Conn, callback_request, payzu_body};
use crate::daemon::Daemon;
use crate::load::{closed_loop, percentiles};
use crate::{CONCURRENCY, Env, Report, rate};

pub async fn run(env: &Env, daemon: &Daemon, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    eprintln!(
        "[3/8] duplicate storm: one callback from {} connections for {} s",
        CONCURRENCY, plan.dup_secs
    );
    let body = payzu_body(&format!("tx-{}-dup", env.run_tag));
    let request = callback_request(&daemon.host(), &body);
    let first = Conn::new(daemon.addr)
        .send(&request)
        .await
        .map_err(|e| e.to_string())?;
    if first.status != 200 {
        return Err(format!(
            "duplicate storm: first send answered {}",
            first.status
        ));
    }
    let request = Arc::new(request);
    let storm = closed_loop(
        daemon.addr,
        plan.dup_secs,
        u64::MAX,
        Arc::new(move |_| request.as_ref().clone()),
        Arc::new(move |_, r| r.status == 200 && r.replayed && r.body == first.body),
    )
    .await;
    eprintln!("  {} replays/s", rate(storm.per_sec()));
    report.row(
        "Duplicate storm: replays/s (same callback, 64 conns)",
        rate(storm.per_sec()),
    );
    report.row("Duplicate storm: latency", percentiles(&storm.hist));
    if storm.failed > 0 {
        report.note(format!(
            "duplicate storm: {} answers were not byte-identical replays ({})",
            storm.failed,
            storm.failures()
        ));
    }
    Ok(())
}
