//! A message's history as it is stored, and how it is bounded: the first row and the latest
//! [`HISTORY_TAIL`], bodies kept only in the latest [`ANSWER_BODY_ROWS`], each answer cut to
//! its [`KEPT_BODY_BYTES`].

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::clock::Millis;

/// The first history row and this many of the latest are kept per message; the rest are
/// dropped (and counted), so a receiver that fails forever cannot grow a message without bound.
pub const HISTORY_TAIL: usize = 100;

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
