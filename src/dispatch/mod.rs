//! The dispatcher: claim due messages with a lease, deliver each by HTTP, then ack,
//! reschedule or dead-letter it in one store call, as the delivery policy
//! (`store/lifecycle/policy.rs`) judges the attempt.
//!
//! Nothing about a retry lives only in memory: the next attempt time is in the store, so a
//! crash or restart loses nothing, and a worker that dies mid-delivery loses only its lease.
//! Backpressure: a global semaphore (`dispatch.concurrency`) bounds in-flight deliveries, and
//! per-host slots (`hosts.rs`) keep a slow gateway from taking them: a claimed message takes a
//! global permit only once it holds a slot to its host. A claim takes at most one host's
//! worth of messages, and no more than the waiting room for slots can hold.

mod announce;
pub mod board;
pub mod delivery;
pub mod gate;
mod guards;
pub mod host_key;
mod hosts;

pub use board::{HeldHost, HostBoard};
pub use gate::{GateState, HoldReason};

use crate::clock::Millis;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::alerts::{AlertBudget, Alerts, is_alert};
use crate::app::{DispatchSettings, ForwardSettings, Settings, Sources};
use crate::clock::millis;
use crate::clock::{Clock, format_delay, format_iso};
use crate::metrics as m;
use crate::store::lifecycle::policy::{
    self, AttemptResult, DeathReason, FailureClass, Held, Verdict,
};
use crate::store::{Completion, DeliveryAttempt, Lease, MessageKind, Store};
use announce::Announcement;
use guards::{Guards, Ticket};
use hosts::{Admission, HOST_WAIT, Hosts, Slot};

/// How long an idle worker waits before polling the store again. Work accepted by this
/// process wakes it at once; this only bounds the delay for work accepted by other processes
/// sharing the store, and for retries coming due.
const IDLE_POLL: Duration = Duration::from_millis(100);
/// The same, on a store whose work signal ([`Store::work_signal`]) wakes the worker for work
/// other processes accept. The poll then only finds what no process announces: a retry that
/// another process scheduled (which that process delivers itself while it lives) and a lease
/// that ran out because its process died (after the lease, tens of seconds). A few seconds
/// more on either is nothing, while each poll counts every partition: at 5 s an idle worker
/// costs a 3-master cluster's masters about 0.4 ms of CPU a second, where a 2 s poll cost
/// about 1 ms (BENCHMARKS.md, "An idle dispatcher in alternating windows").
pub const SIGNALLED_IDLE_POLL: Duration = Duration::from_secs(5);
/// Most messages leased in one claim.
const CLAIM_BATCH: usize = 256;
/// Most distinct retry times a dispatcher keeps to wake for (`next_retries`): 8 bytes each in
/// a B-tree, so a burst of failures costs a bounded few tens of KB; a retry past them waits
/// for the idle poll at most.
const NOTED_RETRIES: usize = 4096;

pub struct Dispatcher {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    /// The SSRF guard is in each client's resolver: one refuses internal addresses, the other
    /// lets a target that is allowed them through. Each message picks by its kind and source.
    guarded: reqwest::Client,
    open: reqwest::Client,
    settings: DispatchSettings,
    /// One host's worth: the largest per-host concurrency configured.
    claim_size: usize,
    /// Set when a claimed message is not sent at once for its host's sake (held, over its
    /// rate, or sent back for want of a slot): the next claim takes one host's worth. Clear,
    /// a claim takes what the free permits and the waiting room hold.
    sent_back: AtomicBool,
    permits: Arc<Semaphore>,
    hosts: Hosts,
    /// Each host's throttle, breaker and rate (`gate.rs`): whether a claimed message may go.
    guards: Arc<Guards>,
    /// Each source's forward headers, signing key and SSRF policy.
    sources: Sources,
    /// Claims being delivered, so shutdown can hand their leases back.
    in_flight: Mutex<HashMap<String, Lease>>,
    wake: Arc<Notify>,
    /// When the retries this process scheduled (or gave back) come due, earliest first: on a
    /// signalled store, whose idle poll is slow, the worker wakes for each on time rather than
    /// up to a poll late. At most [`NOTED_RETRIES`] distinct times are kept, the earliest;
    /// retries past them, and those other processes schedule, are found by the poll.
    next_retries: Mutex<BTreeSet<Millis>>,
    /// Where dead letters are announced (`[alerts]`), if anywhere.
    alerts: Option<Alerts>,
    /// This process's count of deaths per alert window: which get an alert of their own, and
    /// the digests of the rest.
    budget: Mutex<AlertBudget>,
}

impl Dispatcher {
    pub fn new(
        settings: &Settings,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        wake: Arc<Notify>,
    ) -> Result<Dispatcher, reqwest::Error> {
        let d = &settings.dispatch;
        let client = |allow_private: bool| {
            reqwest::Client::builder()
                // reqwest honours HTTP(S)_PROXY / ALL_PROXY by default: the guard would then
                // vet the proxy's address, and the proxy would resolve the target's name
                // unchecked.
                .no_proxy()
                .timeout(d.request_timeout)
                .connect_timeout(d.request_timeout.min(Duration::from_secs(5)))
                .redirect(reqwest::redirect::Policy::none())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(d.per_host_concurrency)
                .dns_resolver(crate::ssrf::SsrfGuard { allow_private }.resolver())
                .user_agent(concat!("callbackd/", env!("CARGO_PKG_VERSION")))
                .build()
        };
        let alerts = settings
            .alerts
            .as_ref()
            .map(|a| Alerts::new(a, d.max_age, settings.store.dedupe_ttl));
        Ok(Dispatcher {
            store,
            clock,
            guarded: client(false)?,
            open: client(true)?,
            permits: Arc::new(Semaphore::new(d.concurrency)),
            settings: d.clone(),
            claim_size: d
                .hosts
                .values()
                .filter_map(|h| h.concurrency)
                .fold(d.per_host_concurrency, usize::max),
            sent_back: AtomicBool::new(false),
            hosts: Hosts::new(
                d.per_host_concurrency,
                d.concurrency,
                d.hosts
                    .iter()
                    .filter_map(|(k, h)| h.concurrency.map(|c| (k.clone(), c)))
                    .collect(),
            ),
            guards: Arc::new(Guards::new(d)),
            sources: settings.sources.clone(),
            in_flight: Mutex::new(HashMap::new()),
            wake,
            next_retries: Mutex::new(BTreeSet::new()),
            budget: Mutex::new(
                alerts
                    .as_ref()
                    .map(Alerts::budget)
                    .unwrap_or_else(|| AlertBudget::new(1, 0)),
            ),
            alerts,
        })
    }

    /// The hosts this process holds back now (breaker open, or throttled).
    pub fn held_hosts(&self) -> Vec<HeldHost> {
        self.guards.held(self.clock.now_ms())
    }

    /// Shows this dispatcher's held hosts on `board` (the admin API's).
    pub fn with_board(self, board: &HostBoard) -> Dispatcher {
        let (guards, clock) = (Arc::clone(&self.guards), Arc::clone(&self.clock));
        board.publish(move || guards.held(clock.now_ms()));
        self
    }

    /// Claims what is due now (up to the free permits) and starts delivering it in `tasks`.
    /// Returns how many messages were claimed.
    async fn claim_and_spawn(self: &Arc<Self>, tasks: &mut JoinSet<()>) -> usize {
        // A window's digest is due when the window ends, however busy the workers are.
        self.send_digests(Some(self.clock.now_ms())).await;
        // One host's worth per claim once a claimed message went back unsent: when every due
        // message goes to the same busy gateway (the common case), a bigger claim would only
        // lease messages that go back to the queue. While none did, the hosts take what they
        // are sent or free a slot within the wait, and a claim takes more: a claim is a
        // durable commit, and one host's worth per commit would cap a fast host below what
        // it takes. Never more than the waiting room for slots holds, so that a busy host's
        // backlog stays in the store.
        let size = if self.sent_back.swap(false, Ordering::Relaxed) {
            self.claim_size
        } else {
            CLAIM_BATCH
        };
        let free = self
            .permits
            .available_permits()
            .min(self.hosts.room())
            .min(size);
        if free == 0 {
            return 0;
        }
        let now = self.clock.now_ms();
        let claimed = match self
            .store
            .claim_due(now, free, millis(self.settings.lease))
            .await
        {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot claim due messages");
                return 0;
            }
        };
        let count = claimed.len();
        for c in claimed {
            let Some(url) = c.message.target_url.clone() else {
                continue;
            };
            self.track(&c);
            let this = Arc::clone(self);
            let span = tracing::info_span!("delivery", message_id = %c.message.id, attempt = c.attempts + 1);
            let host = host_key::of_url(&url).unwrap_or_default();
            // The host's gate first: a throttled or open host, or one over its rate, gets no
            // attempt, and its message waits in the store.
            let (ticket, wait_ms) = match self.guards.admit(&host, c.message.id.as_str(), now) {
                Ok(go) => go,
                Err((until, reason)) => {
                    self.sent_back.store(true, Ordering::Relaxed);
                    tasks.spawn(async move { this.hold(&c, until, reason).await }.instrument(span));
                    continue;
                }
            };
            // Admitted here, not in the task: the permits and the waiting room it takes must
            // be gone before the next claim is sized by them. A message waiting for its rate
            // token takes neither until its token is due.
            let admission = (wait_ms == 0).then(|| self.hosts.admit(&url));
            // Known before the next claim is sized, which may come before this task runs:
            // a message that waits for its host's rate, or goes back for its host's slots.
            if matches!(admission, None | Some(Admission::Defer(_))) {
                self.sent_back.store(true, Ordering::Relaxed);
            }
            let permit = match &admission {
                Some(Admission::Send(_)) => self.permits.clone().try_acquire_owned().ok(),
                _ => None,
            };
            let work = async move {
                let admission = match admission {
                    Some(admission) => admission,
                    None => {
                        tokio::time::sleep(Duration::from_millis(wait_ms as u64)).await;
                        this.hosts.admit(&url)
                    }
                };
                let slot = match admission {
                    Admission::Send(slot) => slot,
                    Admission::Wait(waiter) => match waiter.slot(HOST_WAIT).await {
                        Ok(slot) => slot,
                        Err(delay) => return this.send_back(&c, delay).await,
                    },
                    Admission::Defer(delay) => return this.send_back(&c, delay).await,
                };
                // Claims ask for at most the free permits, so one is free unless waiters
                // that got their slots took it first.
                let permit = match permit {
                    Some(permit) => permit,
                    None => match this.permits.clone().acquire_owned().await {
                        Ok(permit) => permit,
                        Err(_) => return this.untrack(&c),
                    },
                };
                this.deliver(c, url, permit, slot, ticket).await;
            };
            tasks.spawn(work.instrument(span));
        }
        count
    }

    /// A message its host's gate holds back: back to the queue until `until`, no attempt made
    /// or recorded; or, its window over, dead for the reason its host was held.
    async fn hold(&self, c: &Lease, until: Millis, reason: HoldReason) {
        let now = self.clock.now_ms();
        let death = match reason {
            HoldReason::Open => Some(DeathReason::BreakerOpen),
            HoldReason::Throttled => Some(DeathReason::Throttled),
            HoldReason::Ramp | HoldReason::Rate => None,
        };
        match policy::hold(c.deadline, now, until, death) {
            Held::Until(due) => {
                match self.store.release(c, due).await {
                    // A signalled worker polls seldom: it wakes for this itself.
                    Ok(_) => self.retry_at(due),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot give back a held lease; it expires by itself")
                    }
                }
                self.untrack(c);
            }
            Held::Dead(reason) => {
                // No request was made: the history's row says why the message died unsent.
                let attempt = DeliveryAttempt {
                    attempt: c.attempts + 1,
                    at: now,
                    status: None,
                    error: Some(reason.as_str().to_string()),
                    latency_ms: None,
                    response: None,
                };
                metrics::counter!(m::DEAD_LETTERS, "kind" => m::kind(c.message.kind), "reason" => reason.as_str())
                    .increment(1);
                tracing::info!(outcome = %"dead", reason = %reason.as_str(), "held back until its deadline");
                self.finish(c, attempt, Verdict::Dead(reason), now).await;
                self.untrack(c);
            }
        }
    }

    /// Gives a lease back whose host has no slot for it, due again after `delay`.
    async fn send_back(&self, c: &Lease, delay: Duration) {
        self.sent_back.store(true, Ordering::Relaxed);
        let due = self.clock.now_ms() + delay.as_millis() as i64;
        match self.store.release(c, due).await {
            Ok(_) => self.retry_at(due),
            Err(e) => {
                tracing::warn!(error = %e, "cannot give back a lease for a busy host; it expires by itself")
            }
        }
        self.untrack(c);
    }

    /// Notes that a message this process gave back or rescheduled is due at `at`.
    fn retry_at(&self, at: Millis) {
        if let Ok(mut next) = self.next_retries.lock() {
            next.insert(at);
            if next.len() > NOTED_RETRIES {
                next.pop_last();
            }
        }
    }

    /// How long until the earliest retry this process scheduled; zero (once for all that
    /// came due) when one is due, since the claim just made may have run a moment before it.
    fn until_next_retry(&self) -> Duration {
        let Ok(mut next) = self.next_retries.lock() else {
            return Duration::ZERO;
        };
        let now = self.clock.now_ms();
        let later = next.split_off(&now.saturating_add(1));
        let any_due = !next.is_empty();
        *next = later;
        if any_due {
            return Duration::ZERO;
        }
        next.first().map_or(Duration::MAX, |at| {
            Duration::from_millis(u64::try_from(at - now).unwrap_or(u64::MAX))
        })
    }

    /// Claims and delivers everything due at the clock's current time, and waits for it.
    /// Tests drive the dispatcher with this on a virtual clock.
    pub async fn tick(self: &Arc<Self>) -> usize {
        let mut tasks = JoinSet::new();
        let mut total = 0;
        loop {
            let n = self.claim_and_spawn(&mut tasks).await;
            total += n;
            if n == 0 {
                break;
            }
            while tasks.join_next().await.is_some() {}
        }
        while tasks.join_next().await.is_some() {}
        total
    }

    /// Runs until `shutdown`, then waits up to `grace` for in-flight deliveries and gives
    /// the leases of unfinished ones back, so another process can take them at once.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken, grace: Duration) {
        let mut tasks = JoinSet::new();
        let mut signal = self.store.work_signal();
        while !shutdown.is_cancelled() {
            let claimed = self.claim_and_spawn(&mut tasks).await;
            while tasks.try_join_next().is_some() {}
            if claimed > 0 && self.permits.available_permits() > 0 {
                continue;
            }
            let poll = if signal.is_some() {
                self.until_next_retry().min(SIGNALLED_IDLE_POLL)
            } else {
                IDLE_POLL
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(poll) => {}
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                changed = async {
                    match signal.as_mut() {
                        Some(s) => s.changed().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if changed.is_err() {
                        // The engine stopped signalling: poll often again.
                        signal = None;
                    }
                }
            }
        }
        let drained =
            tokio::time::timeout(grace, async { while tasks.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
        }
        self.release_unfinished().await;
        // Windows still open are announced now: their counts live only in this process.
        self.send_digests(None).await;
    }

    async fn release_unfinished(&self) {
        let unfinished: Vec<Lease> = self
            .in_flight
            .lock()
            .map(|mut m| m.drain().map(|(_, c)| c).collect())
            .unwrap_or_default();
        let now = self.clock.now_ms();
        for c in unfinished {
            match self.store.release(&c, now).await {
                Ok(_) => tracing::info!(message_id = %c.message.id, "lease released at shutdown"),
                Err(e) => tracing::warn!(message_id = %c.message.id, error = %e,
                    "cannot release lease; it expires by itself"),
            }
        }
    }

    fn track(&self, c: &Lease) {
        if let Ok(mut m) = self.in_flight.lock() {
            m.insert(c.message.id.to_string(), c.clone());
        }
    }

    fn untrack(&self, c: &Lease) {
        if let Ok(mut m) = self.in_flight.lock() {
            m.remove(c.message.id.as_str());
        }
    }

    /// Delivers `c` to `url` and records the outcome, holding a slot to the host while the
    /// request runs and a global permit until the outcome is recorded.
    async fn deliver(
        &self,
        c: Lease,
        url: String,
        _permit: OwnedSemaphorePermit,
        slot: Slot,
        ticket: Ticket,
    ) {
        let alert_target = self.alerts.as_ref().filter(|_| is_alert(&c.message));
        let forward = match alert_target {
            // Alerts are signed with the alert secret, so the receiver can trust them, and go
            // by their own SSRF switch (`alerts.allow_private_webhook_url`).
            Some(alerts) => ForwardSettings {
                signing_secret: Some(alerts.secret().to_vec()),
                ssrf: alerts.ssrf(),
                ..ForwardSettings::default()
            },
            None => c
                .message
                .source
                .as_deref()
                .and_then(|s| self.sources.get(s))
                .map(|s| s.forward.clone())
                .unwrap_or_default(),
        };
        let at = self.clock.now_ms();
        let headers = delivery::build_headers(
            &c,
            &forward.headers,
            forward.signing_secret.as_deref(),
            self.clock.now_secs(),
        );
        // Connectors' notifications go by `dispatch.allow_private_networks`; a source's
        // forwards and the alerts by their own switches.
        let allow_private = match c.message.kind {
            MessageKind::Notification if alert_target.is_none() => self.settings.callback_ssrf,
            _ => forward.ssrf,
        }
        .allow_private;
        let client = if allow_private {
            &self.open
        } else {
            &self.guarded
        };
        let started = Instant::now();
        let result =
            delivery::send(client, &url, headers, c.message.body.clone(), allow_private).await;
        let latency = started.elapsed();
        // The host's slot bounds requests to the host, and its hold time tells a slow host
        // from a fast one: recording the outcome (a commit on the store) is neither, and
        // holding the slot through it would cap a fast host at its slots per commit.
        drop(slot);
        let now = self.clock.now_ms();
        let verdict = policy::classify(
            &result,
            self.settings.backoff,
            &c,
            now,
            rand::random::<f64>(),
        );
        let host = ticket.host.clone();
        if let Some(transition) = ticket.record(policy::host_signal(&result, now), now) {
            self.announce_host(&host, transition, &result, now).await;
        }
        self.record_metrics(&c, &result, verdict, latency);
        log_failure(&result, verdict, now);
        let attempt = DeliveryAttempt {
            attempt: c.attempts + 1,
            at,
            status: result.status,
            error: result.error.map(|e| e.as_str().to_string()),
            latency_ms: Some(latency.as_millis() as u64),
            response: result.response.clone(),
        };
        self.finish(&c, attempt, verdict, now).await;
        self.untrack(&c);
    }

    /// Announces a death (if it is one), then records the outcome.
    async fn finish(&self, c: &Lease, attempt: DeliveryAttempt, verdict: Verdict, now: Millis) {
        match self.announce_death(c, &attempt, verdict, now).await {
            // Not recorded: the lease runs out and the attempt is made again, so the death
            // is announced then rather than never.
            Announcement::Failed => {}
            Announcement::Done => {
                self.settle(c, attempt, verdict, now).await;
            }
            // Counted once recorded, so an attempt made again after a lost lease is not
            // counted twice.
            Announcement::Coalesce(reason) => {
                if self.settle(c, attempt, verdict, now).await
                    && let Ok(mut budget) = self.budget.lock()
                {
                    budget.coalesce(now, &c.message.id, reason);
                }
            }
        }
    }

    /// Records the outcome. A store error is retried briefly; if it persists, the lease
    /// expires and the message is delivered again (at-least-once), never lost. True when the
    /// outcome was recorded.
    async fn settle(
        &self,
        c: &Lease,
        attempt: DeliveryAttempt,
        verdict: Verdict,
        now: i64,
    ) -> bool {
        for backoff_ms in [0, 100, 500, 2_000] {
            tokio::time::sleep(Duration::from_millis(backoff_ms)).await;
            match self
                .store
                .complete(c, attempt.clone(), verdict.completion(), now)
                .await
            {
                Ok(true) => {
                    tracing::debug!(status = attempt.status, "attempt recorded");
                    if let Completion::Retry { next_at } = verdict.completion() {
                        self.retry_at(next_at);
                    }
                    return true;
                }
                Ok(false) => {
                    tracing::warn!("lease lost before the outcome was recorded");
                    return false;
                }
                Err(e) => tracing::warn!(error = %e, "cannot record the outcome yet"),
            }
        }
        false
    }

    fn record_metrics(
        &self,
        c: &Lease,
        result: &AttemptResult,
        verdict: Verdict,
        latency: Duration,
    ) {
        let kind = m::kind(c.message.kind);
        let outcome = if verdict == Verdict::Delivered {
            "success"
        } else {
            "failure"
        };
        metrics::counter!(m::DELIVERIES, "kind" => kind, "outcome" => outcome).increment(1);
        metrics::histogram!(m::DELIVERY_SECONDS, "kind" => kind).record(latency.as_secs_f64());
        match verdict {
            Verdict::Retry(_) => metrics::counter!(m::RETRIES, "kind" => kind).increment(1),
            Verdict::Dead(reason) => {
                metrics::counter!(m::DEAD_LETTERS, "kind" => kind, "reason" => reason.as_str())
                    .increment(1)
            }
            Verdict::Delivered => {}
        }
        if let Some(class) = FailureClass::of(result) {
            metrics::counter!(m::DELIVERY_FAILURES, "kind" => kind, "class" => class.as_str())
                .increment(1);
        }
    }
}

/// Logs a failed attempt in values a person reads: `status=503` or `error=connect` (an
/// absent one is no field at all), then what happens next: `outcome=retry` with the next
/// attempt as a time and a delay, or `outcome=dead` with the reason.
fn log_failure(result: &AttemptResult, verdict: Verdict, now: Millis) {
    let status = result.status;
    let error = result.error.map(|e| tracing::field::display(e.as_str()));
    match verdict {
        Verdict::Delivered => {}
        Verdict::Retry(at) => tracing::info!(
            status,
            error,
            outcome = %"retry",
            next_attempt_at = %format_iso(at),
            retry_in = %format_delay(at.saturating_sub(now)),
            "delivery failed"
        ),
        Verdict::Dead(reason) => tracing::info!(
            status,
            error,
            outcome = %"dead",
            reason = %reason.as_str(),
            "delivery failed"
        ),
    }
}
