//! The delivery policy, pure (§1.4): what the result of one attempt means for its message,
//! and when the next attempt is. The dispatcher sends and records; this decides. Alerts and
//! metrics name its outcomes by their labels, each spelled once here.
//!
//! * [`classify`]: a 2xx is delivered; a 410 is dead at once ([`DeathReason::Gone`]); any
//!   other answer, or none (a timeout, a refused address...), is retried until the window's
//!   deadline, after which the message is dead ([`DeathReason::Expired`]).
//! * The schedule ([`next_attempt`]): delay(n) = min(max_backoff, initial × 2^n), jittered down
//!   by up to half ("equal jitter": retries of many messages that failed together spread out,
//!   and no delay is shorter than half its base). The store persists its result (the next
//!   attempt time), so a restart never forgets a retry, and tests walk seven days of it in
//!   microseconds.
//! * `Retry-After` from the target is a lower bound: it can push the next attempt later (up
//!   to [`MAX_RETRY_AFTER_MS`]) but never earlier than the schedule, so a receiver answering
//!   `Retry-After: 0` (or a date in the past) cannot turn retries into a hot loop.
//! * The window: no attempt is ever scheduled past the deadline; when the next one would be,
//!   the last attempt lands exactly at the deadline; after an attempt at or past the deadline,
//!   the message is dead.
//! * [`FailureClass`] sorts a failed attempt for the failures metric, from a fixed set so
//!   labels stay bounded.

use crate::clock::{Millis, parse_http_date};
use crate::store::{Completion, Lease, ReceiverAnswer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial_ms: u64,
    pub max_ms: u64,
}

/// The most a target's `Retry-After` may postpone the next attempt: a receiver asking for a
/// week of silence still gets one attempt a day until the deadline.
pub const MAX_RETRY_AFTER_MS: u64 = 24 * 3_600_000;

/// Why an attempt got no HTTP status. The label is what the attempt's history records as its
/// error, and its failure class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptError {
    /// No answer within `dispatch.request_timeout_secs`.
    Timeout,
    /// No connection to the target.
    Connect,
    /// The target resolves only to addresses deliveries may not reach (`ssrf.rs`).
    RefusedAddress,
    /// Any other failure of the request.
    Request,
    /// The stored target URL does not parse.
    BadUrl,
}

impl AttemptError {
    pub const ALL: [AttemptError; 5] = [
        AttemptError::Timeout,
        AttemptError::Connect,
        AttemptError::RefusedAddress,
        AttemptError::Request,
        AttemptError::BadUrl,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptError::Timeout => "timeout",
            AttemptError::Connect => "connect",
            AttemptError::RefusedAddress => "refused_address",
            AttemptError::Request => "request",
            AttemptError::BadUrl => "bad_url",
        }
    }
}

/// What one attempt produced.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptResult {
    pub status: Option<u16>,
    /// Why there was no HTTP status.
    pub error: Option<AttemptError>,
    pub retry_after: Option<RetryAfter>,
    /// The receiver's answer (bounded), when there was one.
    pub response: Option<ReceiverAnswer>,
}

/// A target's `Retry-After`, as it came: a delay, or an instant. An instant is resolved when
/// the attempt is classified, against the dispatcher's clock (not the host's: on a virtual
/// clock, or a host whose clock is off, the two differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    DelayMs(u64),
    At(Millis),
}

impl RetryAfter {
    /// The delay it asks for at `now`; an instant in the past asks for none.
    pub fn delay_ms(self, now: Millis) -> u64 {
        match self {
            RetryAfter::DelayMs(ms) => ms,
            RetryAfter::At(at) => u64::try_from(at.saturating_sub(now)).unwrap_or(0),
        }
    }
}

/// `Retry-After` as delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<RetryAfter> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(RetryAfter::DelayMs(secs.saturating_mul(1000)));
    }
    parse_http_date(value).map(RetryAfter::At)
}

/// Why a message went dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathReason {
    /// The receiver answered 410 Gone.
    Gone,
    /// The delivery window ran out.
    Expired,
    /// The window ran out while its host's circuit breaker was open: held back, not tried.
    BreakerOpen,
    /// The window ran out while its host asked to be left alone (`429`, `Retry-After`).
    Throttled,
}

impl DeathReason {
    pub const ALL: [DeathReason; 4] = [
        DeathReason::Gone,
        DeathReason::Expired,
        DeathReason::BreakerOpen,
        DeathReason::Throttled,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            DeathReason::Gone => "gone",
            DeathReason::Expired => "expired",
            DeathReason::BreakerOpen => "breaker_open",
            DeathReason::Throttled => "throttled",
        }
    }
}

/// What the store should do after an attempt, and why (for alerts and metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Delivered,
    Retry(Millis),
    Dead(DeathReason),
}

impl Verdict {
    pub fn completion(self) -> Completion {
        match self {
            Verdict::Delivered => Completion::Delivered,
            Verdict::Retry(next_at) => Completion::Retry { next_at },
            Verdict::Dead(_) => Completion::Dead,
        }
    }
}

/// 2xx delivered; 410 dead at once; anything else retried until the deadline.
pub fn classify(
    result: &AttemptResult,
    backoff: Backoff,
    claimed: &Lease,
    now: Millis,
    jitter: f64,
) -> Verdict {
    match result.status {
        Some(s) if (200..300).contains(&s) => Verdict::Delivered,
        Some(410) => Verdict::Dead(DeathReason::Gone),
        _ => match next_attempt(
            backoff,
            claimed.backoff_step,
            now,
            claimed.deadline,
            jitter,
            result.retry_after.map(|r| r.delay_ms(now)),
        ) {
            Next::RetryAt(at) => Verdict::Retry(at),
            Next::GiveUp => Verdict::Dead(DeathReason::Expired),
        },
    }
}

/// What an attempt says about its host, for the host's gate (`dispatch/gate.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostSignal {
    /// The host answered and is not overloaded (a 2xx, a 4xx other than 429, ...): it is up.
    Answered,
    /// No answer (timeout, refused connection...) or a 5xx: counts towards opening its breaker.
    Failed,
    /// It asked to be left alone until then: a `429`, or a `503` with `Retry-After`.
    Throttled(Millis),
}

/// How long a `429` without `Retry-After` pauses its host: it asked for less traffic without
/// saying for how long.
pub const THROTTLE_WITHOUT_RETRY_AFTER_MS: u64 = 1_000;

/// What `result`, at `now`, says about its host. `Retry-After` is capped as for the message
/// ([`MAX_RETRY_AFTER_MS`]); a date in the past pauses nothing beyond `now`.
pub fn host_signal(result: &AttemptResult, now: Millis) -> HostSignal {
    let asked = result.retry_after.map(|r| r.delay_ms(now));
    let pause = |ms: u64| {
        HostSignal::Throttled(
            now.saturating_add(i64::try_from(ms.min(MAX_RETRY_AFTER_MS)).unwrap_or(i64::MAX)),
        )
    };
    match (result.status, asked) {
        (Some(429), asked) => pause(asked.unwrap_or(THROTTLE_WITHOUT_RETRY_AFTER_MS)),
        (Some(503), Some(ms)) => pause(ms),
        (Some(s), _) if s >= 500 => HostSignal::Failed,
        (Some(_), _) => HostSignal::Answered,
        // A URL that does not parse or an address refused by the SSRF guard never reached the
        // host: it says nothing about it.
        (None, _) => match result.error {
            Some(AttemptError::BadUrl | AttemptError::RefusedAddress) => HostSignal::Answered,
            _ => HostSignal::Failed,
        },
    }
}

/// What becomes of a message its host's gate holds back until `until` (no attempt made):
/// back in the queue until then, never past its deadline; at the deadline it is dead, for
/// `reason` (the breaker, the throttle), or as expired when only the rate held it.
pub fn hold(deadline: Millis, now: Millis, until: Millis, reason: Option<DeathReason>) -> Held {
    if now >= deadline {
        return Held::Dead(reason.unwrap_or(DeathReason::Expired));
    }
    Held::Until(until.min(deadline))
}

/// See [`hold`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    Until(Millis),
    Dead(DeathReason),
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    RetryAt(Millis),
    GiveUp,
}

/// Base delay before retry number `step + 1` (step = failures so far, minus one).
pub fn base_delay_ms(backoff: Backoff, step: u32) -> u64 {
    let factor = 1u64.checked_shl(step.min(63)).unwrap_or(u64::MAX);
    backoff
        .initial_ms
        .saturating_mul(factor)
        .min(backoff.max_ms)
}

/// Decides the next attempt after a failure at `now`.
///
/// * `step` — failed attempts before this one (0 after the first failure);
/// * `jitter` — a number in `[0, 1)` from the caller's RNG (0 = no jitter);
/// * `retry_after_ms` — the target's `Retry-After` (already resolved against the caller's
///   clock), when it sent one: the delay is `max(scheduled, min(retry_after, 24 h))`.
pub fn next_attempt(
    backoff: Backoff,
    step: u32,
    now: Millis,
    deadline: Millis,
    jitter: f64,
    retry_after_ms: Option<u64>,
) -> Next {
    if now >= deadline {
        return Next::GiveUp;
    }
    let base = base_delay_ms(backoff, step);
    let scheduled = base - (base as f64 * jitter.clamp(0.0, 1.0) / 2.0) as u64;
    // Capping Retry-After (not the sum) keeps a configured `max_backoff` above 24 h intact.
    let asked = retry_after_ms.map_or(0, |ms| ms.min(MAX_RETRY_AFTER_MS));
    let delay = scheduled.max(asked);
    let at = now.saturating_add(i64::try_from(delay).unwrap_or(i64::MAX));
    Next::RetryAt(at.min(deadline))
}

/// The class of a failed attempt, for the failures metric: the status class when the receiver
/// answered, else why it did not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    /// `1xx`.
    Informational,
    /// `3xx`: redirects are not followed.
    Redirection,
    /// `4xx`.
    ClientError,
    /// `5xx`, and any status outside the classes above.
    ServerError,
    /// No status: the error's label.
    NoAnswer(AttemptError),
}

impl FailureClass {
    /// The classes of an answer's status, in order.
    const STATUS_CLASSES: [FailureClass; 4] = [
        FailureClass::Informational,
        FailureClass::Redirection,
        FailureClass::ClientError,
        FailureClass::ServerError,
    ];

    /// The statuses' classes, then every [`AttemptError`]: built from both, so a new error
    /// cannot be left out.
    pub const ALL: [FailureClass; FailureClass::STATUS_CLASSES.len() + AttemptError::ALL.len()] = {
        let mut all = [FailureClass::ServerError;
            FailureClass::STATUS_CLASSES.len() + AttemptError::ALL.len()];
        let mut i = 0;
        while i < all.len() {
            all[i] = if i < FailureClass::STATUS_CLASSES.len() {
                FailureClass::STATUS_CLASSES[i]
            } else {
                FailureClass::NoAnswer(AttemptError::ALL[i - FailureClass::STATUS_CLASSES.len()])
            };
            i += 1;
        }
        all
    };

    pub const fn as_str(self) -> &'static str {
        match self {
            FailureClass::Informational => "1xx",
            FailureClass::Redirection => "3xx",
            FailureClass::ClientError => "4xx",
            FailureClass::ServerError => "5xx",
            FailureClass::NoAnswer(error) => error.as_str(),
        }
    }

    /// The class of `result`; none for a 2xx, which is no failure.
    pub fn of(result: &AttemptResult) -> Option<FailureClass> {
        let Some(status) = result.status else {
            return Some(FailureClass::NoAnswer(
                result.error.unwrap_or(AttemptError::Request),
            ));
        };
        match status / 100 {
            1 => Some(FailureClass::Informational),
            2 => None,
            3 => Some(FailureClass::Redirection),
            4 => Some(FailureClass::ClientError),
            _ => Some(FailureClass::ServerError),
        }
    }
}

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
