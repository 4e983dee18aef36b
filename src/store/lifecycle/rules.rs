//! The rules, pure: each takes what it reads (a [`Snapshot`] of the message, the live claim,
//! seal and payment status of an accept) with its input and `now`, and returns its decision
//! ([`Effect`], [`AcceptDecision`]). Every engine, and the in-memory [`super::Model`], applies
//! these decisions and makes none.

use super::effect::{Changes, Effect, Field, Guard, QueueMove, Snapshot};
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::{
    AcceptOutcome, AcceptRequest, Completion, HistoryEntry, MessageState, ResendEffect, ResendMark,
};

/// How long what has nothing left to do is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    /// A finished or recorded message with its history (`store.dedupe_ttl_secs`).
    pub retention_ms: Millis,
    /// A payment's status after its last transition (`store.payment_retention_secs`).
    pub payment_retention_ms: Millis,
}

/// What `complete` reads: whether the lease still holds the message, and what a resend left
/// for the attempt's consequence.
const COMPLETE_READS: &[Field] = &[Field::State, Field::Token, Field::ResumeAt, Field::Again];
/// What `release` reads: whether the lease still holds the message.
const RELEASE_READS: &[Field] = &[Field::State, Field::Token];
/// What `resend` reads: everything its effect depends on.
const RESEND_READS: &[Field] = &[
    Field::State,
    Field::Token,
    Field::ResumeAt,
    Field::Again,
    Field::EndsAt,
    Field::DueAt,
];

fn plus_ms(now: Millis, ms: u64) -> Millis {
    now.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// The dedupe claim an accept found alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveClaim {
    pub fingerprint: Option<String>,
    pub response: String,
    pub ends_at: Millis,
}

/// What an accept reads before it decides, each only while alive at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptRead<'a> {
    /// The claim of the request's dedupe key.
    pub claim: Option<&'a LiveClaim>,
    /// The answer the request's signature was sealed to.
    pub seal: Option<&'a str>,
    /// The payment's status (`None`: never seen, or its state ended).
    pub payment: Option<PaymentStatus>,
}

/// What an accept that records writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptPlan {
    /// The dedupe claim ends then.
    pub claim_ends: Millis,
    /// The request's signature seal ends then: at its own end or with its claim.
    pub seal_ends: Option<Millis>,
    /// The payment's new status and when that state ends.
    pub payment: Option<(PaymentStatus, Millis)>,
    /// The message as it starts: `pending` to be queued, or `recorded` (nothing to deliver
    /// to) and ending with the message retention.
    pub message: Snapshot,
    pub queue: QueueMove,
}

/// The decision of an accept.
#[derive(Debug, Clone, PartialEq)]
pub enum AcceptDecision {
    /// Nothing is written: a conflict, a refused transition, a reused signature, or the
    /// replay a live seal answers.
    Answer(AcceptOutcome),
    /// The live claim's answer again; the request's signature is sealed to it until
    /// `seal_until` (with the claim at the latest).
    Replay {
        response: String,
        seal_until: Option<Millis>,
    },
    /// Claim the key, make the transition, seal the signature and record the message.
    Record(AcceptPlan),
}

/// What recording `req` at `now` writes, decided without any read: Redis feeds it to its one
/// accept script, which checks the claim, seal and payment as [`accept`] does.
pub fn accept_plan(req: &AcceptRequest, now: Millis, lifetimes: Lifetimes) -> AcceptPlan {
    let claim_ends = plus_ms(now, req.dedupe.ttl_secs.saturating_mul(1000));
    let mut message = Snapshot::new(req.message.deadline);
    let queue = if req.message.target_url.is_some() {
        QueueMove::Join { due_if_head: now }
    } else {
        message.state = MessageState::Recorded;
        message.ends_at = Some(now.saturating_add(lifetimes.retention_ms));
        QueueMove::Stay
    };
    AcceptPlan {
        claim_ends,
        seal_ends: req.seal.as_ref().map(|s| s.expires_at.min(claim_ends)),
        payment: req.payment.as_ref().map(|p| {
            let ends_at = now.saturating_add(lifetimes.payment_retention_ms);
            (p.to, ends_at)
        }),
        message,
        queue,
    }
}

/// Claims the dedupe key and records the message, with the payment's compare-and-set, in one
/// step. A live signature seal answers first: a replay of its answer when the request's
/// dedupe key is the one the signature was accepted under (its live claim holds that answer,
/// which names the claim's own message), else `SignatureReused`, recording nothing (the same
/// signed bytes under another unsigned header). A live claim answers with its stored response
/// (and seals this signature to it) or, for another fingerprint, is a conflict. A refused
/// transition records nothing and burns no key. A dedupe key, a seal and a payment always
/// come with the same ordering key (Redis keeps them in its partition).
pub fn accept(
    read: AcceptRead<'_>,
    req: &AcceptRequest,
    now: Millis,
    lifetimes: Lifetimes,
) -> AcceptDecision {
    if let Some(first) = read.seal.filter(|_| req.seal.is_some()) {
        return AcceptDecision::Answer(match read.claim {
            Some(claim) if claim.response == first => AcceptOutcome::Replayed {
                response: first.to_string(),
            },
            _ => AcceptOutcome::SignatureReused,
        });
    }
    if let Some(claim) = read.claim {
        if claim.fingerprint != req.dedupe.fingerprint {
            return AcceptDecision::Answer(AcceptOutcome::Conflict);
        }
        return AcceptDecision::Replay {
            response: claim.response.clone(),
            seal_until: req.seal.as_ref().map(|s| s.expires_at.min(claim.ends_at)),
        };
    }
    if let Some(p) = &req.payment {
        // A payment the store does not know (never seen, or its state ended) is `undefined`.
        let current = read.payment.unwrap_or(PaymentStatus::Undefined);
        if !p.allowed_from.contains(&current) {
            return AcceptDecision::Answer(AcceptOutcome::InvalidTransition {
                from: current.to_string(),
            });
        }
    }
    AcceptDecision::Record(accept_plan(req, now, lifetimes))
}

/// Claiming a due message: `in_flight` under its next token, leased until `lease_until`.
/// Which messages are due is the engine's query: `due_at <= now`, earliest first (ties by
/// id), after [`expire_lease`]; an engine with several partitions shares the limit among
/// them.
pub fn claim(message: &Snapshot, lease_until: Millis) -> Effect {
    let after = Snapshot {
        state: MessageState::InFlight,
        token: message.token.saturating_add(1),
        due_at: None,
        ..*message
    };
    let mut changes = Changes::between(message, &after);
    changes.lease_until = Some(Some(lease_until));
    Effect {
        guard: Guard {
            expected: *message,
            fields: &[Field::DueAt],
        },
        changes,
        history: None,
        queue: QueueMove::Stay,
    }
}

/// A lease that ran out: its message is due again at `now`. It stays `in_flight` with its
/// token until claimed again: a worker that was only slow may still finish its attempt, and
/// that is final.
pub fn expire_lease(message: &Snapshot, now: Millis) -> Effect {
    Effect {
        guard: Guard {
            expected: *message,
            fields: &[],
        },
        changes: Changes {
            due_at: Some(Some(now)),
            lease_until: Some(None),
            ..Changes::default()
        },
        history: None,
        queue: QueueMove::Stay,
    }
}

/// Where an attempt leaves its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterAttempt {
    /// Still the head of its queue, `pending`, due at this time.
    DueAt(Millis),
    /// Finished in this state (`delivered` or `dead`): off its queue.
    Finished(MessageState),
}

/// The decision of [`complete`]: a retry is due when asked, unless a resend brought this
/// attempt forward from a time not passed yet (the schedule resumes there); a resend that
/// arrived during the attempt (`again`) delivers once more, now, even if the attempt ended
/// the message (the resend gave it a fresh window).
pub fn after_attempt(
    completion: Completion,
    resume_at: Option<Millis>,
    again: bool,
    now: Millis,
) -> AfterAttempt {
    match (completion, resume_at) {
        (Completion::Retry { .. }, Some(resume)) if resume >= now => AfterAttempt::DueAt(resume),
        (Completion::Retry { next_at }, _) => AfterAttempt::DueAt(next_at),
        (Completion::Delivered | Completion::Dead, _) if again => AfterAttempt::DueAt(now),
        (Completion::Delivered, _) => AfterAttempt::Finished(MessageState::Delivered),
        (Completion::Dead, _) => AfterAttempt::Finished(MessageState::Dead),
    }
}

/// Whether the lease `token` still holds `message`: in flight under that token.
pub fn holds(message: &Snapshot, token: u64) -> bool {
    message.state == MessageState::InFlight && message.token == token
}

/// Records an attempt made under lease `token` and its consequence ([`after_attempt`]). A
/// finished message ends `retention_ms` later, and the next message of its key is due now.
/// `None` when the lease no longer holds the message: nothing changes.
pub fn complete(
    message: &Snapshot,
    token: u64,
    attempt: HistoryEntry,
    completion: Completion,
    now: Millis,
    lifetimes: Lifetimes,
) -> Option<Effect> {
    if !holds(message, token) {
        return None;
    }
    let mut after = Snapshot {
        attempts: message.attempts.saturating_add(1),
        resume_at: None,
        again: false,
        ..*message
    };
    let queue = match after_attempt(completion, message.resume_at, message.again, now) {
        AfterAttempt::DueAt(at) => {
            after.state = MessageState::Pending;
            after.due_at = Some(at);
            QueueMove::Stay
        }
        AfterAttempt::Finished(state) => {
            after.state = state;
            after.due_at = None;
            after.ends_at = Some(now.saturating_add(lifetimes.retention_ms));
            QueueMove::Leave { next_due_at: now }
        }
    };
    let mut changes = Changes::between(message, &after);
    // Written whatever the snapshot says: a lease that ran out made the message due behind
    // its worker's back (it may still finish), and a finished message must not stay due.
    changes.due_at = Some(after.due_at);
    changes.lease_until = Some(None);
    Some(Effect {
        guard: Guard {
            expected: *message,
            fields: COMPLETE_READS,
        },
        changes,
        history: Some(attempt),
        queue,
    })
}

/// Gives lease `token` back without an attempt: `pending`, still the head, due at `next_at`.
/// `None` when the lease no longer holds the message.
pub fn release(message: &Snapshot, token: u64, next_at: Millis) -> Option<Effect> {
    if !holds(message, token) {
        return None;
    }
    let after = Snapshot {
        state: MessageState::Pending,
        due_at: Some(next_at),
        ..*message
    };
    let mut changes = Changes::between(message, &after);
    changes.due_at = Some(Some(next_at));
    changes.lease_until = Some(None);
    Some(Effect {
        guard: Guard {
            expected: *message,
            fields: RELEASE_READS,
        },
        changes,
        history: None,
        queue: QueueMove::Stay,
    })
}

/// Whether a resend at `now` skips a message: it has nothing to deliver to (`recorded`), or
/// it finished and its retention ended, which makes it gone, swept or not. The resend dry run
/// counts by this same rule.
pub fn resend_skips(state: MessageState, ends_at: Option<Millis>, now: Millis) -> bool {
    state == MessageState::Recorded || ends_at.is_some_and(|end| end <= now)
}

/// Orders one more delivery and records the operator's `mark` in the history:
///
/// * `delivered` / `dead`: `pending` again at the tail of its queue (due now if alone there),
///   with `fresh_deadline`, its backoff starting over and its attempt count going on;
///   it no longer ends ([`ResendEffect::Requeued`]);
/// * `pending` and due later: due now, and the scheduled time is kept to resume at (the
///   first one, if resent again before the attempt); due already: unchanged
///   ([`ResendEffect::Expedited`]);
/// * `pending` behind another message of its key: delivered in its turn ([`ResendEffect::Queued`]);
/// * `in_flight`: once more after the current attempt, with `fresh_deadline`
///   ([`ResendEffect::AfterCurrent`]);
/// * `recorded`, unknown (`None`), or past its retention: nothing, no mark
///   ([`ResendEffect::Skipped`]).
pub fn resend(
    message: Option<&Snapshot>,
    mark: ResendMark,
    fresh_deadline: Millis,
    now: Millis,
) -> (ResendEffect, Option<Effect>) {
    let Some(message) = message else {
        return (ResendEffect::Skipped, None);
    };
    if resend_skips(message.state, message.ends_at, now) {
        return (ResendEffect::Skipped, None);
    }
    let mut after = *message;
    let mut queue = QueueMove::Stay;
    let outcome = match (message.state, message.due_at) {
        (MessageState::Delivered | MessageState::Dead, _) => {
            after.state = MessageState::Pending;
            after.deadline = fresh_deadline;
            after.backoff_from = message.attempts;
            after.ends_at = None;
            queue = QueueMove::Join { due_if_head: now };
            ResendEffect::Requeued
        }
        (MessageState::Pending, None) => ResendEffect::Queued,
        (MessageState::Pending, Some(due)) => {
            if due > now {
                after.resume_at = message.resume_at.or(Some(due));
                after.due_at = Some(now);
            }
            ResendEffect::Expedited
        }
        (MessageState::InFlight, _) => {
            after.again = true;
            after.deadline = fresh_deadline;
            ResendEffect::AfterCurrent
        }
        (MessageState::Recorded, _) => return (ResendEffect::Skipped, None),
    };
    let effect = Effect {
        guard: Guard {
            expected: *message,
            fields: RESEND_READS,
        },
        changes: Changes::between(message, &after),
        history: Some(HistoryEntry::Resend(mark)),
        queue,
    };
    (outcome, Some(effect))
}

/// Whether something that ends at `ends_at` is gone at `now`: the sweep deletes it. Dedupe
/// claims, seals and payment states always end; unfinished messages never do (`None`).
pub fn sweep(ends_at: Option<Millis>, now: Millis) -> bool {
    ends_at.is_some_and(|end| end <= now)
}
