//! The message lifecycle, pure: what every store command does to a message, its ordering
//! queue, its lease and its lifetime, stated once. Both engines implement these rules (a Lua
//! script per rule on Redis, a transaction per rule on SQLite, each naming its rule), and
//! `tests/lifecycle_model.rs` holds both to this model with random sequences of operations.
//!
//! * [`accept`] claims the dedupe key and records the message `pending` at the tail of its
//!   ordering key's queue, or `recorded` when it has nowhere to go (never queued).
//! * Only the head of a queue is *due*, at its due time. [`claim`] leases due heads
//!   (`in_flight`) with a new token until `now + lease`, oldest due first.
//! * [`complete`] records the attempt; a retry keeps the message at the head, due at its
//!   time, while `delivered` and `dead` finish it and make the next message of the key due
//!   at once.
//! * [`release`] gives a lease back without an attempt. A lease that ran out makes its
//!   message due again ([`expire_lease`]); it stays `in_flight` with the old token until it
//!   is claimed again, so its worker may still finish it.
//! * [`resend`] orders one more delivery ([`ResendEffect`]).
//! * Lifetimes end by the caller's clock: a dedupe claim `ttl_secs` after it was made, a
//!   signature seal at its `expires_at` or with the claim it was sealed to, whichever ends
//!   first, a payment's status `payment_retention_ms` after its
//!   last transition, a finished message `retention_ms` after it finished (a recorded one
//!   after its acceptance). Past its end a thing counts as gone; [`sweep`] deletes it
//!   (docs/storage.md, "Retention").

pub mod policy;

use std::collections::{BTreeMap, VecDeque};

use super::{
    ANSWER_BODY_ROWS, AcceptOutcome, AcceptRequest, Completion, DeliveryAttempt, HISTORY_TAIL,
    HistoryEntry, Lease, MessageId, MessageRecord, MessageState, NewMessage, QueueDepth,
    ResendEffect, ResendMark,
};
use crate::clock::Millis;

/// How long what has nothing left to do is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    /// A finished or recorded message with its history (`store.dedupe_ttl_secs`).
    pub retention_ms: Millis,
    /// A payment's status after its last transition (`store.payment_retention_secs`).
    pub payment_retention_ms: Millis,
}

/// One message and its mutable state (`m:<id>` on Redis, a `messages` row on SQLite).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub message: NewMessage,
    pub state: MessageState,
    /// Delivery attempts recorded.
    pub attempts: u32,
    /// `attempts` when a resend last requeued the message: its backoff counts from there.
    pub backoff_from: u32,
    /// The last lease token handed out (0 before the first claim).
    pub token: u64,
    /// No attempt is scheduled after it; a resend of a finished message opens a new one.
    pub deadline: Millis,
    /// Set while the message is due: the head of its queue, or a lease that ran out.
    pub due_at: Option<Millis>,
    /// When the current lease runs out, until a claim finds it expired.
    pub lease_until: Option<Millis>,
    /// The scheduled time a resend brought forward: the retry of the expedited attempt
    /// resumes there, so an operator's resend neither shortens nor pushes back the schedule.
    pub resume_at: Option<Millis>,
    /// A resend arrived while in flight: one more attempt after the current one.
    pub again: bool,
    /// When a finished or recorded message ends; `None` while there is work left.
    pub ends_at: Option<Millis>,
    /// The first row and the latest [`HISTORY_TAIL`].
    pub history: Vec<HistoryEntry>,
    /// Rows ever recorded, kept or dropped.
    pub history_total: u64,
}

impl Message {
    fn new(message: NewMessage) -> Message {
        Message {
            state: MessageState::Pending,
            attempts: 0,
            backoff_from: 0,
            token: 0,
            deadline: message.deadline,
            due_at: None,
            lease_until: None,
            resume_at: None,
            again: false,
            ends_at: None,
            history: Vec::new(),
            history_total: 0,
            message,
        }
    }

    /// Past its retention: gone by the caller's clock, though a read may find it until
    /// [`sweep`] deletes it.
    pub fn ended(&self, now: Millis) -> bool {
        self.ends_at.is_some_and(|end| end <= now)
    }

    /// Failed attempts since the message was last (re)queued: the exponent of its backoff.
    pub fn backoff_step(&self) -> u32 {
        self.attempts.saturating_sub(self.backoff_from)
    }

    /// What `Store::get` answers for it.
    pub fn record(&self) -> MessageRecord {
        MessageRecord {
            message: self.message.clone(),
            state: self.state,
            deadline: self.deadline,
            next_attempt_at: self.due_at,
            history: self.history.clone(),
            history_total: self.history_total,
            delivery_attempts: self.attempts,
            ends_at: self.ends_at,
        }
    }

    /// Appends a history row, keeping the first and the latest [`HISTORY_TAIL`]; the row that
    /// leaves the latest [`ANSWER_BODY_ROWS`] (unless it is the first) drops its answer's body.
    fn append_history(&mut self, row: HistoryEntry) {
        self.history.push(row);
        self.history_total += 1;
        if self.history.len() > HISTORY_TAIL + 1 {
            self.history.remove(1);
        }
        if let Some(older) = self.history.len().checked_sub(ANSWER_BODY_ROWS + 1)
            && older >= 1
        {
            self.history[older].drop_answer_body();
        }
    }

    fn lease(&self) -> Lease {
        Lease {
            message: self.message.clone(),
            token: self.token,
            attempts: self.attempts,
            backoff_step: self.backoff_step(),
            deadline: self.deadline,
        }
    }
}

/// A value that lives until `ends_at` (exclusive) by the caller's clock.
#[derive(Debug, Clone, PartialEq)]
struct Expiring<T> {
    value: T,
    ends_at: Millis,
}

/// What a dedupe claim keeps: the fingerprint a replay must match, and the first answer.
#[derive(Debug, Clone, PartialEq)]
struct StoredClaim {
    fingerprint: String,
    response: String,
}

fn live<'a, T>(map: &'a BTreeMap<String, Expiring<T>>, key: &str, now: Millis) -> Option<&'a T> {
    map.get(key).filter(|e| e.ends_at > now).map(|e| &e.value)
}

fn plus_ms(now: Millis, ms: u64) -> Millis {
    now.saturating_add(i64::try_from(ms).unwrap_or(i64::MAX))
}

/// Everything the store holds, in memory: the state the rules below act on.
#[derive(Debug, Clone)]
pub struct Model {
    lifetimes: Lifetimes,
    messages: BTreeMap<MessageId, Message>,
    /// Unfinished messages of each ordering key in delivery order; only the head is due.
    queues: BTreeMap<String, VecDeque<MessageId>>,
    claims: BTreeMap<String, Expiring<StoredClaim>>,
    seals: BTreeMap<String, Expiring<String>>,
    payments: BTreeMap<String, Expiring<String>>,
}

impl Model {
    pub fn new(lifetimes: Lifetimes) -> Model {
        Model {
            lifetimes,
            messages: BTreeMap::new(),
            queues: BTreeMap::new(),
            claims: BTreeMap::new(),
            seals: BTreeMap::new(),
            payments: BTreeMap::new(),
        }
    }

    /// A message not swept yet (possibly [`Message::ended`]).
    pub fn message(&self, id: &MessageId) -> Option<&Message> {
        self.messages.get(id)
    }

    pub fn messages(&self) -> impl Iterator<Item = &Message> {
        self.messages.values()
    }

    /// The ids of an ordering key's unfinished messages, head first.
    pub fn queue(&self, ordering_key: &str) -> Vec<MessageId> {
        self.queues
            .get(ordering_key)
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Counts by state of every message not swept yet.
    pub fn depth(&self) -> QueueDepth {
        let mut depth = QueueDepth::default();
        for m in self.messages.values() {
            match m.state {
                MessageState::Pending => depth.pending += 1,
                MessageState::InFlight => depth.in_flight += 1,
                MessageState::Dead => depth.dead += 1,
                MessageState::Delivered | MessageState::Recorded => {}
            }
        }
        depth
    }

    /// The oldest message not finished yet (ids sort by creation time).
    pub fn oldest_unfinished(&self) -> Option<MessageId> {
        self.messages
            .values()
            .find(|m| matches!(m.state, MessageState::Pending | MessageState::InFlight))
            .map(|m| m.message.id.clone())
    }

    pub fn payment_status(&self, payment_id: &str, now: Millis) -> Option<String> {
        live(&self.payments, payment_id, now).cloned()
    }

    /// The message of `lease` while that lease still holds it (in flight, same token).
    fn held(&mut self, lease: &Lease) -> Option<&mut Message> {
        self.messages
            .get_mut(&lease.message.id)
            .filter(|m| m.state == MessageState::InFlight && m.token == lease.token)
    }

    /// Appends to the tail of its ordering queue; alone there, it is the head and due now.
    fn enqueue(&mut self, id: &MessageId, now: Millis) {
        let Some(m) = self.messages.get_mut(id) else {
            return;
        };
        let queue = self
            .queues
            .entry(m.message.ordering_key.clone())
            .or_default();
        queue.push_back(id.clone());
        if queue.len() == 1 {
            m.due_at = Some(now);
        }
    }

    /// Takes a finished message off its queue; the next one becomes the head, due now.
    fn dequeue(&mut self, ordering_key: &str, id: &MessageId, now: Millis) {
        let Some(queue) = self.queues.get_mut(ordering_key) else {
            return;
        };
        queue.retain(|queued| queued != id);
        match queue.front() {
            Some(head) => {
                if let Some(m) = self.messages.get_mut(head) {
                    m.due_at = Some(now);
                }
            }
            None => {
                self.queues.remove(ordering_key);
            }
        }
    }

    /// Seals the request's signature to `response`, the answer of the claim it was accepted
    /// under, which ends at `claim_ends`: a seal never outlives that claim, so while a seal
    /// lives, so does the claim whose answer it holds.
    fn remember_seal(&mut self, req: &AcceptRequest, response: &str, claim_ends: Millis) {
        if let Some(seal) = &req.seal {
            let value = response.to_string();
            let ends_at = seal.expires_at.min(claim_ends);
            self.seals
                .insert(seal.key.clone(), Expiring { value, ends_at });
        }
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
pub fn accept(model: &mut Model, req: &AcceptRequest, now: Millis) -> AcceptOutcome {
    let claim = model
        .claims
        .get(&req.dedupe.key)
        .filter(|c| c.ends_at > now)
        .cloned();
    if let Some(seal) = &req.seal
        && let Some(first) = live(&model.seals, &seal.key, now)
    {
        return match &claim {
            Some(claim) if claim.value.response == *first => AcceptOutcome::Replayed {
                response: first.clone(),
            },
            _ => AcceptOutcome::SignatureReused,
        };
    }
    if let Some(claim) = claim {
        if claim.value.fingerprint != req.dedupe.fingerprint {
            return AcceptOutcome::Conflict;
        }
        let response = claim.value.response;
        model.remember_seal(req, &response, claim.ends_at);
        return AcceptOutcome::Replayed { response };
    }
    if let Some(p) = req.payment.as_ref().filter(|p| !p.to.is_empty()) {
        let current = live(&model.payments, &p.payment_id, now)
            .cloned()
            .unwrap_or_else(|| "undefined".to_string());
        if !p.allowed_from.contains(&current) {
            return AcceptOutcome::InvalidTransition { from: current };
        }
        let ends_at = now.saturating_add(model.lifetimes.payment_retention_ms);
        model.payments.insert(
            p.payment_id.clone(),
            Expiring {
                value: p.to.clone(),
                ends_at,
            },
        );
    }
    let claim = StoredClaim {
        fingerprint: req.dedupe.fingerprint.clone(),
        response: req.dedupe.response.clone(),
    };
    let ends_at = plus_ms(now, req.dedupe.ttl_secs.saturating_mul(1000));
    model.claims.insert(
        req.dedupe.key.clone(),
        Expiring {
            value: claim,
            ends_at,
        },
    );
    model.remember_seal(req, &req.dedupe.response, ends_at);

    let id = req.message.id.clone();
    let mut message = Message::new(req.message.clone());
    let deliverable = message.message.target_url.is_some();
    if !deliverable {
        message.state = MessageState::Recorded;
        message.ends_at = Some(now.saturating_add(model.lifetimes.retention_ms));
    }
    model.messages.insert(id.clone(), message);
    if deliverable {
        model.enqueue(&id, now);
    }
    AcceptOutcome::Accepted
}

/// Makes up to `limit` leases that ran out by `now` (the earliest first) due again, now. The
/// messages stay `in_flight` with their token until claimed again: a worker that was only
/// slow may still finish its attempt, and that is final. Returns how many expired.
pub fn expire_lease(model: &mut Model, now: Millis, limit: usize) -> usize {
    let mut expired: Vec<(Millis, MessageId)> = model
        .messages
        .values()
        .filter_map(|m| m.lease_until.map(|at| (at, m.message.id.clone())))
        .filter(|(at, _)| *at <= now)
        .collect();
    expired.sort();
    expired.truncate(limit);
    for (_, id) in &expired {
        if let Some(m) = model.messages.get_mut(id) {
            m.lease_until = None;
            m.due_at = Some(now);
        }
    }
    expired.len()
}

/// Leases up to `limit` due messages until `now + lease_ms`, earliest due first (ties by id),
/// after [`expire_lease`] with the same limit. Each lease gets the message's next token. Which
/// messages a limit smaller than what is due leaves behind is the engine's choice where it
/// has several partitions (Redis shares the limit among them); within one, it is this order.
pub fn claim(model: &mut Model, now: Millis, limit: usize, lease_ms: u64) -> Vec<Lease> {
    if limit == 0 {
        return Vec::new();
    }
    expire_lease(model, now, limit);
    let mut due: Vec<(Millis, MessageId)> = model
        .messages
        .values()
        .filter_map(|m| m.due_at.map(|at| (at, m.message.id.clone())))
        .filter(|(at, _)| *at <= now)
        .collect();
    due.sort();
    due.truncate(limit);
    let lease_until = plus_ms(now, lease_ms);
    let mut leases = Vec::with_capacity(due.len());
    for (_, id) in due {
        if let Some(m) = model.messages.get_mut(&id) {
            m.token += 1;
            m.state = MessageState::InFlight;
            m.due_at = None;
            m.lease_until = Some(lease_until);
            leases.push(m.lease());
        }
    }
    leases
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

/// Records an attempt under `lease` and its consequence ([`after_attempt`]). A finished
/// message ends `retention_ms` later, and the next message of its key is due now. Returns
/// false, changing nothing, when the lease no longer holds the message (stale token, or the
/// message is not in flight).
pub fn complete(
    model: &mut Model,
    lease: &Lease,
    attempt: DeliveryAttempt,
    completion: Completion,
    now: Millis,
) -> bool {
    let retention_ms = model.lifetimes.retention_ms;
    let Some(m) = model.held(lease) else {
        return false;
    };
    m.lease_until = None;
    m.append_history(HistoryEntry::Delivery(attempt));
    m.attempts += 1;
    let next = after_attempt(completion, m.resume_at, m.again, now);
    m.resume_at = None;
    m.again = false;
    match next {
        AfterAttempt::DueAt(at) => {
            m.state = MessageState::Pending;
            m.due_at = Some(at);
        }
        AfterAttempt::Finished(state) => {
            m.state = state;
            m.due_at = None;
            m.ends_at = Some(now.saturating_add(retention_ms));
            let ordering_key = m.message.ordering_key.clone();
            model.dequeue(&ordering_key, &lease.message.id, now);
        }
    }
    true
}

/// Gives `lease` back without an attempt: `pending`, still the head, due at `next_at`. False
/// when the lease no longer holds the message.
pub fn release(model: &mut Model, lease: &Lease, next_at: Millis) -> bool {
    let Some(m) = model.held(lease) else {
        return false;
    };
    m.state = MessageState::Pending;
    m.lease_until = None;
    m.due_at = Some(next_at);
    true
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
/// * `recorded`, unknown, or past its retention: nothing, no mark ([`ResendEffect::Skipped`]).
pub fn resend(
    model: &mut Model,
    id: &MessageId,
    mark: ResendMark,
    fresh_deadline: Millis,
    now: Millis,
) -> ResendEffect {
    let Some(m) = model.messages.get_mut(id) else {
        return ResendEffect::Skipped;
    };
    if resend_skips(m.state, m.ends_at, now) {
        return ResendEffect::Skipped;
    }
    m.append_history(HistoryEntry::Resend(mark));
    match (m.state, m.due_at) {
        (MessageState::Delivered | MessageState::Dead, _) => {
            m.state = MessageState::Pending;
            m.deadline = fresh_deadline;
            m.backoff_from = m.attempts;
            m.ends_at = None;
            model.enqueue(id, now);
            ResendEffect::Requeued
        }
        (MessageState::Pending, None) => ResendEffect::Queued,
        (MessageState::Pending, Some(due)) => {
            if due > now {
                m.resume_at.get_or_insert(due);
                m.due_at = Some(now);
            }
            ResendEffect::Expedited
        }
        (MessageState::InFlight, _) => {
            m.again = true;
            m.deadline = fresh_deadline;
            ResendEffect::AfterCurrent
        }
        (MessageState::Recorded, _) => ResendEffect::Skipped,
    }
}

/// Deletes everything whose lifetime ended by `now`: dedupe claims, seals, payment states,
/// and finished or recorded messages with their history. Unfinished messages never end.
/// Returns how many things went (engines count in their own units: keys, rows).
pub fn sweep(model: &mut Model, now: Millis) -> usize {
    let before = model.claims.len() + model.seals.len() + model.payments.len();
    model.claims.retain(|_, c| c.ends_at > now);
    model.seals.retain(|_, s| s.ends_at > now);
    model.payments.retain(|_, p| p.ends_at > now);
    let kept = model.claims.len() + model.seals.len() + model.payments.len();
    let messages = model.messages.len();
    model.messages.retain(|_, m| !m.ended(now));
    before - kept + messages - model.messages.len()
}

#[cfg(test)]
mod tests;
