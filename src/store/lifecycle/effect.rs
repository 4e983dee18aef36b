//! What a rule reads of a message ([`Snapshot`]) and what it decides ([`Effect`]): the
//! vocabulary between the rules, which decide, and the engines, which apply. An engine reads
//! a snapshot, calls the rule, and writes the effect's changes as they are; it chooses no
//! state, time or lifetime of its own.

use super::super::{HistoryEntry, MessageState};
use crate::clock::Millis;

/// The mutable state of one message, as a rule reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    pub state: MessageState,
    /// The last lease token handed out (0 before the first claim).
    pub token: u64,
    /// Delivery attempts recorded.
    pub attempts: u32,
    /// `attempts` when a resend last requeued the message: its backoff counts from there.
    pub backoff_from: u32,
    /// No attempt is scheduled after it; a resend of a finished message opens a new one.
    pub deadline: Millis,
    /// Set while the message is due: the head of its queue, or a lease that ran out.
    pub due_at: Option<Millis>,
    /// The scheduled time a resend brought forward: the retry of the expedited attempt
    /// resumes there, so an operator's resend neither shortens nor pushes back the schedule.
    pub resume_at: Option<Millis>,
    /// A resend arrived while in flight: one more attempt after the current one.
    pub again: bool,
    /// When a finished or recorded message ends; `None` while there is work left.
    pub ends_at: Option<Millis>,
}

impl Snapshot {
    /// A message just accepted with `deadline`, before its rule placed it.
    pub fn new(deadline: Millis) -> Snapshot {
        Snapshot {
            state: MessageState::Pending,
            token: 0,
            attempts: 0,
            backoff_from: 0,
            deadline,
            due_at: None,
            resume_at: None,
            again: false,
            ends_at: None,
        }
    }

    /// Past its retention: gone by the caller's clock, though a read may find it until the
    /// sweep deletes it.
    pub fn ended(&self, now: Millis) -> bool {
        self.ends_at.is_some_and(|end| end <= now)
    }

    /// Failed attempts since the message was last (re)queued: the exponent of its backoff.
    pub fn backoff_step(&self) -> u32 {
        self.attempts.saturating_sub(self.backoff_from)
    }
}

/// A field of a [`Snapshot`] a rule's decision depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    State,
    Token,
    ResumeAt,
    Again,
    EndsAt,
    DueAt,
}

/// What a decision was made from. An engine that applies an effect in the same transaction
/// as its read (SQLite) holds it by construction; one that reads and writes in two steps
/// (Redis) applies the effect only while every field listed still has its value in
/// `expected`, and otherwise reads again and asks the rule again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    pub expected: Snapshot,
    pub fields: &'static [Field],
}

/// The writes of an effect: `None` leaves a field as it is; `Some(v)` makes it `v` (for the
/// optional fields, `Some(None)` clears it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Changes {
    pub state: Option<MessageState>,
    pub token: Option<u64>,
    pub attempts: Option<u32>,
    pub backoff_from: Option<u32>,
    pub deadline: Option<Millis>,
    pub due_at: Option<Option<Millis>>,
    /// When the lease runs out (`Some(None)`: the message is no longer leased). Rules never
    /// read it: a lease that ran out shows as `due_at` ([`super::expire_lease`]).
    pub lease_until: Option<Option<Millis>>,
    pub resume_at: Option<Option<Millis>>,
    pub again: Option<bool>,
    pub ends_at: Option<Option<Millis>>,
}

impl Changes {
    /// The writes that turn `before` into `after`, and nothing else.
    pub fn between(before: &Snapshot, after: &Snapshot) -> Changes {
        fn changed<T: PartialEq + Copy>(before: T, after: T) -> Option<T> {
            (before != after).then_some(after)
        }
        Changes {
            state: changed(before.state, after.state),
            token: changed(before.token, after.token),
            attempts: changed(before.attempts, after.attempts),
            backoff_from: changed(before.backoff_from, after.backoff_from),
            deadline: changed(before.deadline, after.deadline),
            due_at: changed(before.due_at, after.due_at),
            lease_until: None,
            resume_at: changed(before.resume_at, after.resume_at),
            again: changed(before.again, after.again),
            ends_at: changed(before.ends_at, after.ends_at),
        }
    }

    /// `snapshot` with these changes written.
    pub fn applied_to(&self, snapshot: &Snapshot) -> Snapshot {
        Snapshot {
            state: self.state.unwrap_or(snapshot.state),
            token: self.token.unwrap_or(snapshot.token),
            attempts: self.attempts.unwrap_or(snapshot.attempts),
            backoff_from: self.backoff_from.unwrap_or(snapshot.backoff_from),
            deadline: self.deadline.unwrap_or(snapshot.deadline),
            due_at: self.due_at.unwrap_or(snapshot.due_at),
            resume_at: self.resume_at.unwrap_or(snapshot.resume_at),
            again: self.again.unwrap_or(snapshot.again),
            ends_at: self.ends_at.unwrap_or(snapshot.ends_at),
        }
    }
}

/// Where an effect moves a message in its ordering key's queue. Only the head of a queue is
/// due; what else becomes due with a move is decided here, in the times given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueMove {
    Stay,
    /// To the tail; alone there, it is the head, due at `due_if_head`.
    Join {
        due_if_head: Millis,
    },
    /// Off the queue; the message behind it, if any, becomes the head, due at `next_due_at`.
    Leave {
        next_due_at: Millis,
    },
}

/// A rule's decision about one message.
#[derive(Debug, Clone, PartialEq)]
pub struct Effect {
    pub guard: Guard,
    pub changes: Changes,
    /// A row to append to the history (which keeps the first and the latest rows).
    pub history: Option<HistoryEntry>,
    pub queue: QueueMove,
}
