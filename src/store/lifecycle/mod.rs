//! The message lifecycle, decided once, in pure Rust: what every store command does to a
//! message, its ordering queue, its lease and its lifetime. Each rule ([`rules`]) reads a
//! [`Snapshot`] of what it depends on and returns its decision, an [`Effect`]; the engines
//! (SQLite's transactions, Redis' apply script, PostgreSQL) and the in-memory [`Model`] apply
//! effects and decide nothing. `tests/lifecycle_model.rs` holds every engine to the model with
//! random sequences of operations.
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
//! * [`resend`] orders one more delivery ([`ResendEffect`](super::ResendEffect)).
//! * Lifetimes end by the caller's clock: a dedupe claim `ttl_secs` after it was made, a
//!   signature seal at its `expires_at` or with the claim it was sealed to, whichever ends
//!   first, a payment's status `payment_retention_ms` after its
//!   last transition, a finished message `retention_ms` after it finished (a recorded one
//!   after its acceptance). Past its end a thing counts as gone; [`sweep`] says so, and the
//!   engines delete it (docs/storage.md, "Retention").
//! * [`policy`] decides what the receiver's answer means for the attempt: delivered, retried
//!   when, or dead, and why.

mod effect;
mod model;
pub mod policy;
mod rules;

pub use effect::{Changes, Effect, Field, Guard, QueueMove, Snapshot};
pub use model::{Message, Model};
pub use rules::{
    AcceptDecision, AcceptPlan, AcceptRead, AfterAttempt, Lifetimes, LiveClaim, accept,
    accept_plan, after_attempt, claim, complete, expire_lease, holds, release, resend,
    resend_skips, sweep,
};

#[cfg(test)]
mod tests;
