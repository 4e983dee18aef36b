//! What the dispatcher announces beside delivering: a dead letter's alert (or its place in the
//! window's digest), the digests of windows that ended, and a host's breaker opening or
//! closing. Each is recorded as a durable alert message in the store, so an announcement
//! survives a crash like any other message; the decisions of what to announce are the alerts'
//! (`alerts.rs`) and the gates' (`gate.rs`).

use std::time::Duration;

use super::Dispatcher;
use super::gate::Transition;
use crate::clock::Millis;
use crate::metrics as m;
use crate::store::lifecycle::policy::{AttemptResult, DeathReason, Verdict};
use crate::store::{DeliveryAttempt, Lease};

/// How a death is announced.
pub(super) enum Announcement {
    /// Nothing to announce (not a death, an alert's death, no `[alerts]`), or its own alert is
    /// recorded: record the death.
    Done,
    /// Beyond the window's cap: record the death, then count it in the window's digest.
    Coalesce(DeathReason),
    /// Its alert could not be recorded: leave the death unrecorded.
    Failed,
}

impl Dispatcher {
    /// Records the digests of the alert windows over at `until` (all of them with `None`),
    /// each as a durable alert message. One that cannot be recorded is kept for the next call.
    pub(super) async fn send_digests(&self, until: Option<Millis>) {
        let Some(alerts) = &self.alerts else {
            return;
        };
        let due = match self.budget.lock() {
            Ok(mut budget) => budget.take_due(until),
            Err(_) => return,
        };
        for digest in due {
            let now = self.clock.now_ms();
            let request = alerts.digest(&digest, now, self.store.partitions());
            match self.store.accept(request, now).await {
                Ok(_) => {
                    metrics::counter!(m::ALERTS, "reason" => "digest").increment(1);
                    self.wake.notify_one();
                }
                Err(e) => {
                    tracing::warn!(error = %e, count = digest.count,
                        "cannot record the dead-letter digest yet");
                    if let Ok(mut budget) = self.budget.lock() {
                        budget.restore(digest);
                    }
                }
            }
        }
    }

    /// Logs a host's breaker opening or closing, and records its alert (one per change, not
    /// one per message). An alert that cannot be recorded is logged and not retried: the
    /// metrics still show the state.
    pub(super) async fn announce_host(
        &self,
        host: &str,
        transition: Transition,
        result: &AttemptResult,
        now: Millis,
    ) {
        match transition {
            Transition::Opened => tracing::warn!(
                host,
                status = result.status,
                error = result.error.map(|e| e.as_str()),
                "circuit breaker open: the host gets one probe per interval"
            ),
            Transition::Recovered => {
                tracing::info!(host, "circuit breaker closed: the host answered a probe")
            }
        }
        let Some(alerts) = &self.alerts else {
            return;
        };
        let request = alerts.host(
            host,
            transition == Transition::Opened,
            result,
            now,
            self.store.partitions(),
        );
        match self.store.accept(request, now).await {
            Ok(_) => {
                let [opened, recovered] = m::HOST_ALERT_REASONS;
                let reason = match transition {
                    Transition::Opened => opened,
                    Transition::Recovered => recovered,
                };
                metrics::counter!(m::ALERTS, "reason" => reason).increment(1);
                self.wake.notify_one();
            }
            Err(e) => tracing::warn!(error = %e, host, "cannot record the host's breaker alert"),
        }
    }

    /// Accepts the dead-letter alert for a message this attempt kills, before its death is
    /// recorded, or leaves it to the window's digest when the window's cap is reached.
    pub(super) async fn announce_death(
        &self,
        c: &Lease,
        attempt: &DeliveryAttempt,
        verdict: Verdict,
        now: i64,
    ) -> Announcement {
        let Verdict::Dead(reason) = verdict else {
            return Announcement::Done;
        };
        let Some(alert) = self
            .alerts
            .as_ref()
            .and_then(|a| a.dead_letter(c, attempt, reason, now, self.store.partitions()))
        else {
            return Announcement::Done;
        };
        let own_alert = self.budget.lock().map(|mut b| b.admit(now)).unwrap_or(true);
        if !own_alert {
            return Announcement::Coalesce(reason);
        }
        for backoff_ms in [0, 100, 500, 2_000] {
            tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
            match self.store.accept(alert.clone(), now).await {
                Ok(_) => {
                    metrics::counter!(m::ALERTS, "reason" => reason.as_str()).increment(1);
                    self.wake.notify_one();
                    return Announcement::Done;
                }
                Err(e) => tracing::warn!(error = %e, "cannot record the dead-letter alert yet"),
            }
        }
        Announcement::Failed
    }
}
