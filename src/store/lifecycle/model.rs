//! The store in memory: the rules' decisions applied to maps. It is the reference the
//! engines are held to (`tests/lifecycle_model.rs`): each engine applies the same decisions
//! to its own storage, and after every step all must read alike.

use std::collections::{BTreeMap, VecDeque};

use super::effect::{Changes, Effect, QueueMove, Snapshot};
use super::rules::{self, AcceptDecision, AcceptRead, Lifetimes, LiveClaim};
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::{
    ANSWER_BODY_ROWS, AcceptOutcome, AcceptRequest, Completion, DeliveryAttempt, HISTORY_TAIL,
    HistoryEntry, Lease, MessageId, MessageRecord, MessageState, NewMessage, QueueDepth,
    ResendEffect, ResendMark,
};

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
    /// When the current lease runs out (by the lease clock), until a claim finds it expired.
    pub lease_until: Option<Millis>,
    /// The scheduled time a resend brought forward ([`Snapshot::resume_at`]).
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
    fn new(message: NewMessage, start: Snapshot) -> Message {
        let mut m = Message {
            state: start.state,
            attempts: 0,
            backoff_from: 0,
            token: 0,
            deadline: start.deadline,
            due_at: None,
            lease_until: None,
            resume_at: None,
            again: false,
            ends_at: None,
            history: Vec::new(),
            history_total: 0,
            message,
        };
        m.write(&Changes::between(&m.snapshot(), &start));
        m
    }

    /// What the rules read of it.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            state: self.state,
            token: self.token,
            attempts: self.attempts,
            backoff_from: self.backoff_from,
            deadline: self.deadline,
            due_at: self.due_at,
            resume_at: self.resume_at,
            again: self.again,
            ends_at: self.ends_at,
        }
    }

    /// Past its retention: gone by the caller's clock, though a read may find it until
    /// [`Model::sweep`] deletes it.
    pub fn ended(&self, now: Millis) -> bool {
        self.snapshot().ended(now)
    }

    /// Failed attempts since the message was last (re)queued: the exponent of its backoff.
    pub fn backoff_step(&self) -> u32 {
        self.snapshot().backoff_step()
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

    fn write(&mut self, changes: &Changes) {
        let after = changes.applied_to(&self.snapshot());
        self.state = after.state;
        self.token = after.token;
        self.attempts = after.attempts;
        self.backoff_from = after.backoff_from;
        self.deadline = after.deadline;
        self.due_at = after.due_at;
        self.resume_at = after.resume_at;
        self.again = after.again;
        self.ends_at = after.ends_at;
        if let Some(lease_until) = changes.lease_until {
            self.lease_until = lease_until;
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
        Lease::of(self.message.clone(), &self.snapshot())
    }
}

/// A value that lives until `ends_at` (exclusive) by the caller's clock.
#[derive(Debug, Clone, PartialEq)]
struct Expiring<T> {
    value: T,
    ends_at: Millis,
}

fn live<'a, T>(map: &'a BTreeMap<String, Expiring<T>>, key: &str, now: Millis) -> Option<&'a T> {
    map.get(key).filter(|e| e.ends_at > now).map(|e| &e.value)
}

/// Everything the store holds, in memory.
#[derive(Debug, Clone)]
pub struct Model {
    lifetimes: Lifetimes,
    messages: BTreeMap<MessageId, Message>,
    /// Unfinished messages of each ordering key in delivery order; only the head is due.
    queues: BTreeMap<String, VecDeque<MessageId>>,
    /// Each dedupe claim's fingerprint and first answer.
    claims: BTreeMap<String, Expiring<(Option<String>, String)>>,
    seals: BTreeMap<String, Expiring<String>>,
    payments: BTreeMap<String, Expiring<PaymentStatus>>,
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
        live(&self.payments, payment_id, now).map(|status| status.to_string())
    }

    /// Writes `effect` to message `id`: its changes, its history row, its move in its queue.
    fn apply(&mut self, id: &MessageId, effect: Effect) {
        let Some(m) = self.messages.get_mut(id) else {
            return;
        };
        m.write(&effect.changes);
        if let Some(row) = effect.history {
            m.append_history(row);
        }
        let ordering_key = m.message.ordering_key.clone();
        match effect.queue {
            QueueMove::Stay => {}
            QueueMove::Join { due_if_head } => self.enqueue(&ordering_key, id, due_if_head),
            QueueMove::Leave { next_due_at } => self.dequeue(&ordering_key, id, next_due_at),
        }
    }

    fn enqueue(&mut self, ordering_key: &str, id: &MessageId, due_if_head: Millis) {
        let queue = self.queues.entry(ordering_key.to_string()).or_default();
        queue.push_back(id.clone());
        if queue.len() == 1
            && let Some(m) = self.messages.get_mut(id)
        {
            m.due_at = Some(due_if_head);
        }
    }

    fn dequeue(&mut self, ordering_key: &str, id: &MessageId, next_due_at: Millis) {
        let Some(queue) = self.queues.get_mut(ordering_key) else {
            return;
        };
        queue.retain(|queued| queued != id);
        match queue.front() {
            Some(head) => {
                if let Some(m) = self.messages.get_mut(head) {
                    m.due_at = Some(next_due_at);
                }
            }
            None => {
                self.queues.remove(ordering_key);
            }
        }
    }

    fn seal(&mut self, req: &AcceptRequest, response: &str, until: Option<Millis>) {
        if let (Some(seal), Some(ends_at)) = (&req.seal, until) {
            let value = response.to_string();
            self.seals
                .insert(seal.key.clone(), Expiring { value, ends_at });
        }
    }

    /// [`rules::accept`] on what the model holds at `now`.
    pub fn accept(&mut self, req: &AcceptRequest, now: Millis) -> AcceptOutcome {
        let claim = self
            .claims
            .get(&req.dedupe.key)
            .filter(|c| c.ends_at > now)
            .map(|c| LiveClaim {
                fingerprint: c.value.0.clone(),
                response: c.value.1.clone(),
                ends_at: c.ends_at,
            });
        let seal = req
            .seal
            .as_ref()
            .and_then(|s| live(&self.seals, &s.key, now));
        let payment = req
            .payment
            .as_ref()
            .and_then(|p| live(&self.payments, &p.payment_id, now));
        let read = AcceptRead {
            claim: claim.as_ref(),
            seal: seal.map(String::as_str),
            payment: payment.copied(),
        };
        match rules::accept(read, req, now, self.lifetimes) {
            AcceptDecision::Answer(outcome) => outcome,
            AcceptDecision::Replay {
                response,
                seal_until,
            } => {
                self.seal(req, &response, seal_until);
                AcceptOutcome::Replayed { response }
            }
            AcceptDecision::Record(plan) => {
                if let (Some(p), Some((status, ends_at))) = (&req.payment, plan.payment) {
                    let value = status;
                    self.payments
                        .insert(p.payment_id.to_string(), Expiring { value, ends_at });
                }
                let value = (req.dedupe.fingerprint.clone(), req.dedupe.response.clone());
                let ends_at = plan.claim_ends;
                self.claims
                    .insert(req.dedupe.key.clone(), Expiring { value, ends_at });
                self.seal(req, &req.dedupe.response, plan.seal_ends);
                let id = req.message.id.clone();
                let message = Message::new(req.message.clone(), plan.message);
                self.messages.insert(id.clone(), message);
                if let QueueMove::Join { due_if_head } = plan.queue {
                    self.enqueue(&req.message.ordering_key, &id, due_if_head);
                }
                AcceptOutcome::Accepted
            }
        }
    }

    /// Makes up to `limit` leases that ran out by `lease_now` (the lease clock; the earliest
    /// first) due again at `now` ([`rules::expire_lease`]). Returns how many expired.
    pub fn expire_lease(&mut self, now: Millis, lease_now: Millis, limit: usize) -> usize {
        let mut expired: Vec<(Millis, MessageId)> = self
            .messages
            .values()
            .filter_map(|m| m.lease_until.map(|at| (at, m.message.id.clone())))
            .filter(|(at, _)| *at <= lease_now)
            .collect();
        expired.sort();
        expired.truncate(limit);
        for (_, id) in &expired {
            if let Some(m) = self.messages.get(id) {
                let effect = rules::expire_lease(&m.snapshot(), now);
                self.apply(id, effect);
            }
        }
        expired.len()
    }

    /// Leases up to `limit` due messages until `lease_now + lease_ms`, earliest due first
    /// (ties by id), after [`Model::expire_lease`] with the same limit ([`rules::claim`]).
    /// Leases are timed by the lease clock `lease_now` (Redis' `TIME` in production), due
    /// times by the caller's `now`.
    pub fn claim(
        &mut self,
        now: Millis,
        lease_now: Millis,
        limit: usize,
        lease_ms: u64,
    ) -> Vec<Lease> {
        if limit == 0 {
            return Vec::new();
        }
        self.expire_lease(now, lease_now, limit);
        let mut due: Vec<(Millis, MessageId)> = self
            .messages
            .values()
            .filter_map(|m| m.due_at.map(|at| (at, m.message.id.clone())))
            .filter(|(at, _)| *at <= now)
            .collect();
        due.sort();
        due.truncate(limit);
        let lease_until = lease_now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
        let mut leases = Vec::with_capacity(due.len());
        for (_, id) in due {
            if let Some(m) = self.messages.get(&id) {
                let effect = rules::claim(&m.snapshot(), lease_until);
                self.apply(&id, effect);
            }
            if let Some(m) = self.messages.get(&id) {
                leases.push(m.lease());
            }
        }
        leases
    }

    /// [`rules::complete`]: false, changing nothing, when the lease no longer holds the
    /// message.
    pub fn complete(
        &mut self,
        lease: &Lease,
        attempt: DeliveryAttempt,
        completion: Completion,
        now: Millis,
    ) -> bool {
        let id = &lease.message.id;
        let Some(m) = self.messages.get(id) else {
            return false;
        };
        let row = HistoryEntry::Delivery(attempt);
        match rules::complete(
            &m.snapshot(),
            lease.token,
            row,
            completion,
            now,
            self.lifetimes,
        ) {
            Some(effect) => {
                self.apply(id, effect);
                true
            }
            None => false,
        }
    }

    /// [`rules::release`]: false when the lease no longer holds the message.
    pub fn release(&mut self, lease: &Lease, next_at: Millis) -> bool {
        let id = &lease.message.id;
        let Some(m) = self.messages.get(id) else {
            return false;
        };
        match rules::release(&m.snapshot(), lease.token, next_at) {
            Some(effect) => {
                self.apply(id, effect);
                true
            }
            None => false,
        }
    }

    /// [`rules::resend`].
    pub fn resend(
        &mut self,
        id: &MessageId,
        mark: ResendMark,
        fresh_deadline: Millis,
        now: Millis,
    ) -> ResendEffect {
        let snapshot = self.messages.get(id).map(Message::snapshot);
        let (outcome, effect) = rules::resend(snapshot.as_ref(), mark, fresh_deadline, now);
        if let Some(effect) = effect {
            self.apply(id, effect);
        }
        outcome
    }

    /// Deletes everything gone by `now` ([`rules::sweep`]): dedupe claims, seals, payment
    /// states, and finished or recorded messages with their history. Returns how many things
    /// went (engines count in their own units: keys, rows).
    pub fn sweep(&mut self, now: Millis) -> usize {
        let before = self.claims.len() + self.seals.len() + self.payments.len();
        self.claims
            .retain(|_, c| !rules::sweep(Some(c.ends_at), now));
        self.seals
            .retain(|_, s| !rules::sweep(Some(s.ends_at), now));
        self.payments
            .retain(|_, p| !rules::sweep(Some(p.ends_at), now));
        let kept = self.claims.len() + self.seals.len() + self.payments.len();
        let messages = self.messages.len();
        self.messages.retain(|_, m| !rules::sweep(m.ends_at, now));
        before - kept + messages - self.messages.len()
    }
}
