//! Deletes what has expired, on a timer: the store's `sweep`, called every
//! `store.sweep_interval_secs` (at most a minute), so a finished message, a dedupe claim or a
//! payment state is gone at most one interval after its lifetime ends, with or without traffic.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Store;
use crate::clock::Clock;

/// Sweep calls per tick at most: a huge backlog drains over several ticks instead of keeping
/// the store busy.
const MAX_CALLS_PER_TICK: usize = 100;

pub async fn run(
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        for _ in 0..MAX_CALLS_PER_TICK {
            match store.sweep(clock.now_ms()).await {
                Ok(0) => break,
                Ok(swept) => tracing::debug!(swept, "swept expired keys"),
                Err(e) => {
                    tracing::warn!(error = %e, "sweep failed; trying again next interval");
                    break;
                }
            }
        }
    }
}
