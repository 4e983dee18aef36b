//! The Store trait: the only way the rest of callbackd reaches storage.
//!
//! Every method is one atomic step on the backend (a Lua script on Redis, a transaction on
//! SQLite), and none reads the clock: `now` always comes from the caller, so tests can run
//! seven days of retries on a virtual clock.
//!
//! Message lifecycle: `accept` records a message as `pending` and appends it to the queue of
//! its ordering key. Only the head of each ordering queue is ever *due*, which is how
//! per-payment order is kept while other keys flow freely. `claim_due` leases due messages
//! (`in_flight`); `complete` records the attempt and either finishes the message (`delivered`,
//! `dead`, which promotes the next message of the same key) or schedules its next attempt.
//! What each step does is decided once, in [`lifecycle`]; the engines apply it.
//!
//! The vocabulary the trait speaks has a file per concern: `message.rs` (messages, states,
//! reads), `accept.rs` (what an accept carries and answers), `history.rs` (history rows and
//! their bounds), `delivery.rs` (leases, completions, resends), `counts.rs` (attempts per
//! minute), `operations.rs` (resend operation records), `recoveries.rs` (provider-side
//! recoveries and the inbound accepts per source and minute they report), `error.rs`.

mod accept;
pub mod counts;
mod delivery;
mod error;
mod history;
pub mod ids;
pub mod lifecycle;
mod message;
mod operations;
pub mod partitions;
pub mod postgres;
mod record;
pub mod recoveries;
pub mod redis;
pub mod retention;
pub mod sqlite;
pub mod sweeper;

use async_trait::async_trait;

pub use accept::{
    AcceptOutcome, AcceptRequest, DedupeClaim, PaymentTransition, SignatureSeal,
    fingerprint_from_stored,
};
pub use counts::MinuteCount;
pub use delivery::{Completion, Lease, ResendEffect};
pub use error::StoreError;
pub use history::{
    ANSWER_BODY_ROWS, DeliveryAttempt, HISTORY_TAIL, HistoryEntry, KEPT_BODY_BYTES,
    KEPT_HEADER_CHARS, ReceiverAnswer, ResendMark,
};
pub use ids::{MessageId, PaymentId, SourceName, TransactionId};
pub use message::{
    ListFilter, MessageKind, MessageRecord, MessageState, NewMessage, Page, QueueDepth,
    matches_filter,
};
pub use operations::{
    OperationReservation, decode_operation, encode_finished_operation, encode_running_operation,
};
pub use partitions::Partitions;
pub use recoveries::{Arrival, InboundCount, Recovery, RecoveryWindow, WindowState};
pub use retention::DEFAULT_PAYMENT_RETENTION_SECS;

use crate::clock::Millis;

/// Expired keys or rows removed per partition and sweep call: a sweep never stalls writers.
pub const SWEEP_LIMIT: usize = 1000;

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the dedupe key and records the message (and the payment transition) in one
    /// atomic step. Either all of it is durable when this returns `Accepted`, or none of it.
    /// An inbound callback that is recorded or replayed is counted in its source's minute at
    /// `now` ([`Arrival`], `recoveries.rs`) in the same step.
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError>;

    /// Leases up to `limit` due messages until `now + lease_ms`; messages whose lease expired
    /// (their worker died) are due again. What this store's own writes made due is seen at
    /// once; what another process wrote may be seen up to a short while later (Redis: 50 ms,
    /// `store/redis/claim.rs`).
    async fn claim_due(
        &self,
        now: Millis,
        limit: usize,
        lease_ms: u64,
    ) -> Result<Vec<Lease>, StoreError>;

    /// Records a delivery attempt and its consequence, and counts it in `now`'s minute
    /// ([`counts::Tally`]) in the same atomic step. Returns false when the lease was lost
    /// (token stale), in which case nothing changed and nothing was counted.
    async fn complete(
        &self,
        claimed: &Lease,
        attempt: DeliveryAttempt,
        completion: Completion,
        now: Millis,
    ) -> Result<bool, StoreError>;

    /// Gives a lease back without recording an attempt (shutdown, or the host is busy): the
    /// message is due again at `next_at`.
    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError>;

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError>;

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError>;

    /// Orders one more delivery of a message (see [`ResendEffect`]) and records the mark.
    async fn resend(
        &self,
        id: &MessageId,
        mark: ResendMark,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError>;

    /// Reserves an operation id (a resend `requestId`) for `ttl_secs` while it runs, with the
    /// fingerprint of its request; or reports what an earlier request left under that id.
    async fn reserve_operation(
        &self,
        key: &str,
        fingerprint: &str,
        ttl_secs: u64,
    ) -> Result<OperationReservation, StoreError>;

    /// Records the answer of an operation (final, or partial after a failure part-way) for
    /// `ttl_secs`, replacing its reservation, or creating the record if the reservation lapsed.
    async fn finish_operation(
        &self,
        key: &str,
        fingerprint: &str,
        response: &str,
        ttl_secs: u64,
    ) -> Result<(), StoreError>;

    async fn depth(&self) -> Result<QueueDepth, StoreError>;

    /// What every process's `complete` counted, one row per minute with counts, oldest first,
    /// from `since`'s minute to `now`'s ([`counts::window`]). A minute's counts are gone
    /// [`counts::COUNT_LIFETIME_MS`] after it starts (then the sweep, or Redis' TTL, deletes
    /// them), so no read reaches further back.
    async fn minute_counts(
        &self,
        since: Millis,
        now: Millis,
    ) -> Result<Vec<MinuteCount>, StoreError>;

    /// What every process's `accept` counted of `source`'s callbacks ([`Arrival`]), summed
    /// over the minutes from `since`'s to `until`'s (or `now`'s, when earlier); minutes past
    /// [`recoveries::INBOUND_COUNT_LIFETIME_MS`] are gone ([`recoveries::count_window`]).
    async fn inbound_counts(
        &self,
        source: &str,
        since: Millis,
        until: Millis,
        now: Millis,
    ) -> Result<InboundCount, StoreError>;

    /// Records a recovery, or replaces the one with its id; then drops what
    /// [`recoveries::to_drop`] names, so at most [`recoveries::MAX_RECOVERIES`] are kept, none
    /// past its lifetime.
    async fn save_recovery(&self, recovery: &Recovery, now: Millis) -> Result<(), StoreError>;

    /// The recoveries kept at `now`, newest first.
    async fn recoveries(&self, now: Millis) -> Result<Vec<Recovery>, StoreError>;

    /// One recovery, if kept at `now`.
    async fn recovery(&self, id: &str, now: Millis) -> Result<Option<Recovery>, StoreError>;

    /// The id of the oldest message not finished yet (`pending` or `in_flight`), whose
    /// creation time is in the id: how far behind delivery is.
    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError>;

    /// Deletes up to [`SWEEP_LIMIT`] expired keys or rows per partition: messages finished
    /// more than the retention ago (with their history and index entries), dedupe claims,
    /// signature seals and payment states past their lifetimes. Returns how many went; the
    /// sweeper calls again at once while a call was full.
    async fn sweep(&self, now: Millis) -> Result<usize, StoreError>;

    /// Readiness: the store answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The store's partition count, fixed when it was first used: new message ids are
    /// generated for it ([`MessageId::generate`]).
    fn partitions(&self) -> Partitions;

    /// A signal that changes when work may have become due through another process sharing
    /// this store (PostgreSQL: `LISTEN`), so an idle dispatcher claims at once instead of at
    /// its next poll, and can poll rarely. `None` (the default) when the engine has no such
    /// signal: the dispatcher then polls often. Work this process accepts wakes it anyway
    /// (`App::wake`). A signal is a hint: the dispatcher still polls, only less often.
    fn work_signal(&self) -> Option<WorkSignal> {
        None
    }
}

/// See [`Store::work_signal`]: `changed()` returns when work may be due; an error means the
/// engine stopped signalling (the dispatcher then falls back to polling often).
pub type WorkSignal = tokio::sync::watch::Receiver<u64>;

/// What tests read of a store that production never does: the [`Store`] trait keeps only what
/// the service calls (a payment's status is read inside `accept`, in the same atomic step).
#[async_trait]
pub trait PaymentStatusRead: Send + Sync {
    /// The payment's status at `now`, `None` when never seen or past its retention.
    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError>;
}

/// A store tests can also read payment statuses of: every engine is one, and a
/// `dyn Inspectable` is a `dyn Store` wherever one is asked for.
pub trait Inspectable: Store + PaymentStatusRead {}

impl<S: Store + PaymentStatusRead> Inspectable for S {}
