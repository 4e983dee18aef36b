//! What delivering works with: a lease on a message, how its attempt ended, and what a
//! resend did.

use serde::Serialize;
use utoipa::ToSchema;

use super::{MessageState, NewMessage, lifecycle};
use crate::clock::Millis;

/// A message leased to a worker.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub message: NewMessage,
    /// Lease token: `complete` and `release` with a stale token are ignored, so a worker whose
    /// lease expired cannot overwrite the outcome of the worker that took over.
    pub token: u64,
    /// Delivery attempts already recorded (the one about to be made is `attempts + 1`).
    pub attempts: u32,
    /// Failed attempts since the message was last (re)queued: the exponent of its backoff.
    /// A resend of a finished message starts its backoff over.
    pub backoff_step: u32,
    /// Current deadline (a resend of a finished message opens a fresh window).
    pub deadline: Millis,
    /// What a resend left when the message was claimed: the time its schedule resumes at,
    /// and one more attempt after this one. The completion's rule decides from them; a resend
    /// that comes during the attempt is seen when the completion is applied (the engine's
    /// guard, `lifecycle::Guard`).
    pub resume_at: Option<Millis>,
    pub again: bool,
}

impl Lease {
    /// The lease of `message`, just claimed as `snapshot` says.
    pub fn of(message: NewMessage, snapshot: &lifecycle::Snapshot) -> Lease {
        Lease {
            message,
            token: snapshot.token,
            attempts: snapshot.attempts,
            backoff_step: snapshot.backoff_step(),
            deadline: snapshot.deadline,
            resume_at: snapshot.resume_at,
            again: snapshot.again,
        }
    }

    /// The message as its claim left it: in flight under this lease.
    pub fn snapshot(&self) -> lifecycle::Snapshot {
        lifecycle::Snapshot {
            state: MessageState::InFlight,
            token: self.token,
            attempts: self.attempts,
            backoff_from: self.attempts.saturating_sub(self.backoff_step),
            deadline: self.deadline,
            due_at: None,
            resume_at: self.resume_at,
            again: self.again,
            ends_at: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Completion {
    Delivered,
    Retry { next_at: Millis },
    Dead,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResendEffect {
    /// Finished (delivered or dead): pending again with a fresh window.
    Requeued,
    /// Pending and due: its next attempt was brought forward; its schedule then goes on.
    Expedited,
    /// Pending behind an earlier message of its key: it is delivered in its turn.
    Queued,
    /// In flight: delivered once more after the current attempt.
    AfterCurrent,
    /// Nothing to deliver to (`recorded`), or unknown id.
    Skipped,
}
