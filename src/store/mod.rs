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

pub mod ids;
pub mod lifecycle;
pub mod partitions;
pub mod postgres;
pub mod redis;
pub mod sqlite;
pub mod sweeper;

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use ids::MessageId;
pub use partitions::Partitions;

use crate::clock::Millis;

/// How long a payment's status outlives its last transition when the config says nothing:
/// 400 days, past any refund or chargeback window, so a refund on day 31 still finds the
/// payment `settled` after its dedupe claims are long gone.
pub const DEFAULT_PAYMENT_RETENTION_SECS: u64 = 400 * 86_400;

/// The first history row and this many of the latest are kept per message; the rest are
/// dropped (and counted), so a receiver that fails forever cannot grow a message without bound.
pub const HISTORY_TAIL: usize = 100;

/// Expired keys or rows removed per partition and sweep call: a sweep never stalls writers.
pub const SWEEP_LIMIT: usize = 1000;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached, refused the write, or did not answer within
    /// `store.timeout_ms`: the caller answers 503 and the sender retries. A store that refused
    /// recorded nothing; one that was only slow may still apply the write after the answer
    /// (a paused Redis, a hung fsync), and then the retry finds it and is answered as a replay.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store is out of space (Redis at `maxmemory` with `noeviction`, SQLite at its size
    /// cap or on a full disk) and refuses every write that would grow it, whole: nothing was
    /// recorded. Deletions (the sweeper) still run, so it recovers as retention ends or an
    /// operator frees space. A 503 like `Unavailable`, told apart so that `/readyz` and the
    /// answer name the cause an operator must fix.
    #[error("store full: {0}")]
    Full(String),
    /// No connection to the store could be opened: refused, dropped, silent past
    /// `store.timeout_ms`, or a server still loading its data. Only opening a store says this,
    /// so that `serve` can wait for a store that is not up yet (a crash loop under an
    /// orchestrator otherwise) while a store that answers with a refusal (a wrong password, a
    /// TLS error) stops it at once.
    #[error("store unreachable: {0}")]
    Unreachable(String),
    /// The store answered something this version does not understand (a bug or a foreign
    /// writer). Also mapped to 503 rather than risking a wrong 2xx.
    #[error("store data corrupt: {0}")]
    Corrupt(String),
    /// The store was set up in a way the configuration contradicts (`store.partitions`): it
    /// refuses to start rather than serve a store it would damage.
    #[error("{0}")]
    Incompatible(String),
}

/// Inbound callback from a provider, or outbound notification from a connector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageKind {
    Inbound,
    Notification,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MessageState {
    /// Waiting for its next attempt (or for earlier messages of its ordering key).
    Pending,
    /// Leased by a worker that is delivering it now.
    InFlight,
    Delivered,
    /// Gave up (410 Gone, or the delivery window ran out). Can be resent.
    Dead,
    /// Accepted from a source without `forward_url`: kept and listable, nothing to deliver.
    Recorded,
}

impl MessageState {
    pub const ALL: [MessageState; 5] = [
        MessageState::Pending,
        MessageState::InFlight,
        MessageState::Delivered,
        MessageState::Dead,
        MessageState::Recorded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MessageState::Pending => "pending",
            MessageState::InFlight => "in_flight",
            MessageState::Delivered => "delivered",
            MessageState::Dead => "dead",
            MessageState::Recorded => "recorded",
        }
    }

    pub fn parse(s: &str) -> Option<MessageState> {
        MessageState::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

/// The immutable part of a message, fixed at acceptance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewMessage {
    pub id: MessageId,
    pub kind: MessageKind,
    /// Source name for inbound callbacks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Payment id for notifications.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_id: Option<String>,
    /// Provider transaction id for inbound callbacks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transaction_id: Option<String>,
    /// Messages with equal ordering keys are delivered in acceptance order. Already scoped
    /// (source + transaction id inbound, paymentId outbound), so it is unique across kinds.
    pub ordering_key: String,
    /// `X-Callback-Event` of the original request, forwarded as is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// Where it is delivered; `None` for a source without `forward_url` (state `recorded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_url: Option<String>,
    /// Static headers sent with every attempt.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// The JSON body delivered, byte for byte.
    pub body: String,
    pub created_at: Millis,
    /// No attempt is scheduled after this instant.
    pub deadline: Millis,
}

/// A dedupe claim: the key is already hashed and scoped, and the response is what every
/// replay of this key gets back, byte for byte.
#[derive(Debug, Clone, PartialEq)]
pub struct DedupeClaim {
    /// Lives in the partition of the message's ordering key (on Redis, its hash slot), so a
    /// key must always come with the same ordering key: true for callbacks (the id is in
    /// both) and for notifications (keys are scoped to the payment).
    pub key: String,
    pub ttl_secs: u64,
    /// Hash of the request; a replay with a different one is a conflict (422). Empty for
    /// inbound callbacks, whose key is derived from the body itself.
    pub fingerprint: String,
    pub response: String,
}

/// The payment status compare-and-set that goes with a notification.
#[derive(Debug, Clone, PartialEq)]
pub struct PaymentTransition {
    pub payment_id: String,
    pub to: String,
    /// Statuses the payment may be in for the transition to apply; a payment never seen is
    /// `undefined`.
    pub allowed_from: Vec<String>,
}

/// A verified provider signature, single-use while its timestamp is inside the tolerance
/// window. The seal keeps the answer of the claim the signature was accepted under: the same
/// signature with the same dedupe key is a replay of it; with another dedupe key (the same
/// signed bytes under another unsigned `X-Callback-Event`) it is
/// [`AcceptOutcome::SignatureReused`], so a captured request is not a new event, while a
/// provider's real second event, signed again, gets through.
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureSeal {
    /// Hash of the source and the signature bytes; in the partition of the message.
    pub key: String,
    /// Until when the signature could still be accepted, so until when it is remembered (at
    /// most as long as the claim it is sealed to).
    pub expires_at: Millis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AcceptRequest {
    pub dedupe: DedupeClaim,
    pub message: NewMessage,
    pub payment: Option<PaymentTransition>,
    /// Inbound callbacks of a signed source; `None` for notifications and unsigned sources.
    pub seal: Option<SignatureSeal>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AcceptOutcome {
    /// Lease and recorded now.
    Accepted,
    /// The key was claimed before: the stored response, unchanged.
    Replayed { response: String },
    /// The key was claimed before by a request with another fingerprint.
    Conflict,
    /// The payment is in `from`, which does not allow the transition. Nothing was recorded.
    InvalidTransition { from: String },
    /// The request's signature is sealed to another dedupe key's answer. Nothing was
    /// recorded and no key claimed.
    SignatureReused,
}

/// One row of a message's history as it is stored: a delivery attempt or an operator's
/// resend. The API shows it through its own view (`http/views.rs`), so the stored shape can
/// change without changing the API, and the reverse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum HistoryEntry {
    Delivery(DeliveryAttempt),
    /// Rows written before marks had their own type carry `"attempt": 0`, which is ignored.
    Resend(ResendMark),
}

impl HistoryEntry {
    /// `delivery` or `resend`, as stored and as the API shows it.
    pub fn kind(&self) -> &'static str {
        match self {
            HistoryEntry::Delivery(_) => "delivery",
            HistoryEntry::Resend(_) => "resend",
        }
    }

    pub fn at(&self) -> Millis {
        match self {
            HistoryEntry::Delivery(attempt) => attempt.at,
            HistoryEntry::Resend(mark) => mark.at,
        }
    }

    /// The delivery attempt this row records, if it is one.
    pub fn delivery(&self) -> Option<&DeliveryAttempt> {
        match self {
            HistoryEntry::Delivery(attempt) => Some(attempt),
            HistoryEntry::Resend(_) => None,
        }
    }

    /// The resend this row records, if it is one.
    pub fn resend(&self) -> Option<&ResendMark> {
        match self {
            HistoryEntry::Delivery(_) => None,
            HistoryEntry::Resend(mark) => Some(mark),
        }
    }
}

impl From<DeliveryAttempt> for HistoryEntry {
    fn from(attempt: DeliveryAttempt) -> HistoryEntry {
        HistoryEntry::Delivery(attempt)
    }
}

impl From<ResendMark> for HistoryEntry {
    fn from(mark: ResendMark) -> HistoryEntry {
        HistoryEntry::Resend(mark)
    }
}

/// One delivery attempt and what came of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryAttempt {
    /// 1-based.
    pub attempt: u32,
    pub at: Millis,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Error class when no HTTP status came back: `timeout`, `connect`, `refused_address`...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// What the receiver answered, for deliveries that got an HTTP status. Absent in rows
    /// written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<ReceiverAnswer>,
}

/// An operator's resend, recorded in the history of the message it resent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResendMark {
    pub at: Millis,
    /// The resend request id, when the operator gave one: a repeated walk of the same id
    /// finds its mark and does not resend twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

/// Bytes a receiver's kept body may take as stored (JSON): enough to read why it refused,
/// bounded so a chatty receiver cannot grow a message's history. A control character counts
/// as its JSON escape (`\u0000` is 6 bytes), an invalid UTF-8 byte as the U+FFFD it becomes
/// (3), so a body of NULs or binary costs no more than text; a quote or backslash is counted
/// as one byte, though JSON stores it as two.
pub const KEPT_BODY_BYTES: usize = 2048;
/// History rows, besides the first, that keep their answer's body: the latest ones. An older
/// row keeps its status, headers and latency but drops the body (`body_dropped`), so a message
/// retried for days stores a handful of bodies, not one per row.
pub const ANSWER_BODY_ROWS: usize = 5;
/// Characters of a kept response header value.
pub const KEPT_HEADER_CHARS: usize = 256;

/// The receiver's answer to one attempt, bounded.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReceiverAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// `Retry-After` as sent (seconds or an HTTP date).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// The start of the body as text, within [`KEPT_BODY_BYTES`] as stored (invalid UTF-8
    /// replaced).
    #[serde(default)]
    pub body: String,
    /// True when the body was longer than what is kept.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_truncated: bool,
    /// True when the body was dropped because the row is neither the first nor one of the
    /// latest [`ANSWER_BODY_ROWS`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_dropped: bool,
}

impl ReceiverAnswer {
    /// Keeps the start of `body` within [`KEPT_BODY_BYTES`] as stored (cut on a character
    /// boundary) and bounded header values.
    pub fn new(
        content_type: Option<&str>,
        retry_after: Option<&str>,
        body: &[u8],
        truncated: bool,
    ) -> ReceiverAnswer {
        let mut text = String::new();
        let mut stored = 0;
        let mut complete = true;
        'kept: for chunk in body.utf8_chunks() {
            let invalid = (!chunk.invalid().is_empty()).then_some(char::REPLACEMENT_CHARACTER);
            for c in chunk.valid().chars().chain(invalid) {
                let cost = stored_bytes(c);
                if stored + cost > KEPT_BODY_BYTES {
                    complete = false;
                    break 'kept;
                }
                stored += cost;
                text.push(c);
            }
        }
        let header = |v: Option<&str>| v.map(|v| v.chars().take(KEPT_HEADER_CHARS).collect());
        ReceiverAnswer {
            content_type: header(content_type),
            retry_after: header(retry_after),
            body: text,
            body_truncated: truncated || !complete,
            body_dropped: false,
        }
    }
}

/// Bytes `c` takes in a JSON string, escapes included (quotes and backslashes aside, see
/// [`KEPT_BODY_BYTES`]).
fn stored_bytes(c: char) -> usize {
    match c {
        '\u{8}' | '\t' | '\n' | '\u{c}' | '\r' => 2,
        c if u32::from(c) < 0x20 => 6,
        c => c.len_utf8(),
    }
}

impl HistoryEntry {
    /// Drops the body of the receiver's answer this row keeps, if any: the row has left the
    /// latest [`ANSWER_BODY_ROWS`]. True when something was dropped.
    pub fn drop_answer_body(&mut self) -> bool {
        match self {
            HistoryEntry::Delivery(DeliveryAttempt {
                response: Some(answer),
                ..
            }) if !answer.body.is_empty() => {
                answer.body = String::new();
                answer.body_dropped = true;
                true
            }
            _ => false,
        }
    }
}

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

#[derive(Debug, Clone, PartialEq)]
pub struct MessageRecord {
    pub message: NewMessage,
    pub state: MessageState,
    pub deadline: Millis,
    /// Next attempt time while the message is due (head of its ordering queue).
    pub next_attempt_at: Option<Millis>,
    /// The first row and the latest [`HISTORY_TAIL`] rows; empty on list pages, which never
    /// load histories.
    pub history: Vec<HistoryEntry>,
    /// Rows ever recorded, kept or dropped.
    pub history_total: u64,
    /// Delivery attempts made so far.
    pub delivery_attempts: u32,
    /// When a finished or recorded message ends: from then on it is gone, swept or not.
    pub ends_at: Option<Millis>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListFilter {
    pub state: Option<MessageState>,
    pub source: Option<String>,
    /// Exact ordering keys (a payment's, or a transaction's in one or several sources): a
    /// message with any of them. An empty list selects nothing.
    pub ordering_keys: Option<Vec<String>>,
    pub created_from: Option<Millis>,
    pub created_to: Option<Millis>,
    /// Return ids strictly greater than this one (ascending id = acceptance order).
    pub after: Option<MessageId>,
    pub limit: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub messages: Vec<MessageRecord>,
    /// Pass as `after` for the next page; `None` when the scan reached the end.
    pub next_after: Option<MessageId>,
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

/// What `reserve_operation` found for a resend `requestId`, so a repeated resend returns the
/// recorded answer and resends nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum OperationReservation {
    /// Reserved now, for the caller.
    Fresh,
    /// Finished (completely or part-way): its recorded answer.
    Done(String),
    /// Reserved by a request with the same fingerprint that has not finished.
    InProgress,
    /// Reserved or finished by a request with a different fingerprint.
    Mismatch,
}

/// An operation as both backends store it, one string: `P<fingerprint>` while it runs,
/// `D<fingerprint>\n<answer>` once finished. Fingerprints are [`crate::digest::short_hash`]es,
/// so they hold no newline.
pub fn encode_running_operation(fingerprint: &str) -> String {
    format!("P{fingerprint}")
}

/// See [`encode_running_operation`].
pub fn encode_finished_operation(fingerprint: &str, answer: &str) -> String {
    format!("D{fingerprint}\n{answer}")
}

/// Reads a stored operation for a request with `fingerprint`. Records written before
/// fingerprints were stored (`P`, `D<answer>`, or an answer alone) match any fingerprint.
pub fn decode_operation(stored: &str, fingerprint: &str) -> OperationReservation {
    let matches = |recorded: &str| recorded.is_empty() || recorded == fingerprint;
    if let Some(recorded) = stored.strip_prefix('P') {
        return if matches(recorded) {
            OperationReservation::InProgress
        } else {
            OperationReservation::Mismatch
        };
    }
    let done = stored.strip_prefix('D').unwrap_or(stored);
    match done.split_once('\n') {
        Some((recorded, answer)) if matches(recorded) => {
            OperationReservation::Done(answer.to_string())
        }
        Some(_) => OperationReservation::Mismatch,
        None => OperationReservation::Done(done.to_string()),
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepth {
    pub pending: u64,
    pub in_flight: u64,
    pub dead: u64,
}

#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the dedupe key and records the message (and the payment transition) in one
    /// atomic step. Either all of it is durable when this returns `Accepted`, or none of it.
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

    /// Records a delivery attempt and its consequence. Returns false when the lease was lost
    /// (token stale), in which case nothing changed.
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

    /// The payment's status at `now`, `None` when never seen or past its retention.
    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError>;

    async fn depth(&self) -> Result<QueueDepth, StoreError>;

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
}

/// Whether a record passes every filter of a listing (the parts an index did not answer).
pub fn matches_filter(record: &MessageRecord, filter: &ListFilter) -> bool {
    let m = &record.message;
    filter.state.is_none_or(|s| s == record.state)
        && filter
            .source
            .as_ref()
            .is_none_or(|s| m.source.as_ref() == Some(s))
        && filter
            .ordering_keys
            .as_ref()
            .is_none_or(|keys| keys.contains(&m.ordering_key))
        && filter.created_from.is_none_or(|f| m.created_at >= f)
        && filter.created_to.is_none_or(|t| m.created_at <= t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_round_trip_with_their_fingerprint() {
        let running = encode_running_operation("fp1");
        assert_eq!(
            decode_operation(&running, "fp1"),
            OperationReservation::InProgress
        );
        assert_eq!(
            decode_operation(&running, "fp2"),
            OperationReservation::Mismatch
        );
        let done = encode_finished_operation("fp1", r#"{"resent":1}"#);
        assert_eq!(
            decode_operation(&done, "fp1"),
            OperationReservation::Done(r#"{"resent":1}"#.into())
        );
        assert_eq!(
            decode_operation(&done, "fp2"),
            OperationReservation::Mismatch
        );
    }

    #[test]
    fn records_without_a_fingerprint_match_any_request() {
        assert_eq!(
            decode_operation("P", "fp"),
            OperationReservation::InProgress
        );
        for stored in [r#"D{"resent":1}"#, r#"{"resent":1}"#] {
            assert_eq!(
                decode_operation(stored, "fp"),
                OperationReservation::Done(r#"{"resent":1}"#.into()),
                "{stored}"
            );
        }
    }
}
