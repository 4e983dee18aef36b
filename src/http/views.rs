//! The API's shapes of stored data. A stored row keeps its serde names for as long as data
//! written by an old release must be read; what a client reads is built from it here, so
//! either can change without the other. The JSON of each view is what the stored row's was
//! when it was both (the console and the tests read it).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::clock::{Millis, format_iso};
use crate::redact::display_url;
use crate::store::{
    DeliveryAttempt, HistoryEntry, MessageKind, MessageRecord, MessageState, ReceiverAnswer,
    ResendMark,
};

/// A message as operators see it. Header values and the target's query values are redacted:
/// they carry gateway tokens and signatures.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageView {
    pub id: String,
    pub kind: MessageKind,
    pub state: MessageState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payment_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transaction_id: Option<String>,
    pub ordering_key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event: Option<String>,
    /// Where it is delivered, every query value shown as `[redacted]` (a gateway signs its
    /// `callbackUrl` in the query); deliveries use the URL as stored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_url: Option<String>,
    pub headers: BTreeMap<String, String>,
    pub created_at: String,
    pub deadline: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<String>,
    /// Delivery attempts made.
    pub attempt_count: u32,
    /// Delivery attempts and resend marks, oldest first (`at` in ms since the epoch): the
    /// first row and the latest 100. Only on the detail view.
    pub attempts: Vec<AttemptView>,
    /// History rows ever recorded, including those no longer kept in `attempts`.
    pub history_total: u64,
    #[schema(value_type = Object)]
    pub body: Value,
}

impl MessageView {
    pub fn from_record(record: MessageRecord, with_attempts: bool) -> MessageView {
        let m = record.message;
        MessageView {
            id: m.id.to_string(),
            kind: m.kind,
            state: record.state,
            source: m.source.map(String::from),
            payment_id: m.payment_id.map(String::from),
            transaction_id: m.transaction_id.map(String::from),
            ordering_key: m.ordering_key,
            event: m.event,
            target_url: m.target_url.as_deref().map(display_url),
            headers: m
                .headers
                .into_keys()
                .map(|k| (k, "[redacted]".to_string()))
                .collect(),
            created_at: format_iso(m.created_at),
            deadline: format_iso(record.deadline),
            next_attempt_at: record.next_attempt_at.map(format_iso),
            attempt_count: record.delivery_attempts,
            history_total: record.history_total,
            attempts: if with_attempts {
                record.history.into_iter().map(AttemptView::from).collect()
            } else {
                Vec::new()
            },
            body: serde_json::from_str(&m.body).unwrap_or(Value::String(m.body)),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessagePage {
    pub messages: Vec<MessageView>,
    /// Pass as `cursor` for the next page (the last id of this one); absent at the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// One row of a message's history: a delivery attempt or an operator's resend.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = Attempt)]
pub struct AttemptView {
    /// `delivery` or `resend`.
    pub kind: String,
    /// Attempt number for deliveries (1-based), 0 for resend marks.
    pub attempt: u32,
    pub at: Millis,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Error class when no HTTP status came back: `timeout`, `connect`, `refused_address`...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// The resend request id, for resend marks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// What the receiver answered, for deliveries that got an HTTP status. Absent in rows
    /// written before it was kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response: Option<AnswerView>,
}

impl From<HistoryEntry> for AttemptView {
    fn from(row: HistoryEntry) -> AttemptView {
        let kind = row.kind().to_string();
        match row {
            HistoryEntry::Delivery(DeliveryAttempt {
                attempt,
                at,
                status,
                error,
                latency_ms,
                response,
            }) => AttemptView {
                kind,
                attempt,
                at,
                status,
                error,
                latency_ms,
                request_id: None,
                response: response.map(AnswerView::from),
            },
            HistoryEntry::Resend(ResendMark { at, request_id }) => AttemptView {
                kind,
                attempt: 0,
                at,
                status: None,
                error: None,
                latency_ms: None,
                request_id,
                response: None,
            },
        }
    }
}

/// The receiver's answer to one attempt, bounded.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
#[schema(as = ReceiverAnswer)]
pub struct AnswerView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// `Retry-After` as sent (seconds or an HTTP date).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// The start of the body as text, at most 2 KB as stored (invalid UTF-8 replaced).
    #[schema(required = false)]
    pub body: String,
    /// True when the body was longer than what is kept.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub body_truncated: bool,
    /// True when the body is no longer kept: only the first row and the latest 5 keep theirs.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub body_dropped: bool,
}

impl From<ReceiverAnswer> for AnswerView {
    fn from(answer: ReceiverAnswer) -> AnswerView {
        let ReceiverAnswer {
            content_type,
            retry_after,
            body,
            body_truncated,
            body_dropped,
        } = answer;
        AnswerView {
            content_type,
            retry_after,
            body,
            body_truncated,
            body_dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The view is the API's promise: the JSON clients have always read, whatever shape the
    /// stored rows take.
    #[test]
    fn history_views_write_the_api_json() {
        let delivery = HistoryEntry::Delivery(DeliveryAttempt {
            attempt: 2,
            at: 1_764_460_800_000,
            status: Some(503),
            error: None,
            latency_ms: Some(12),
            response: Some(ReceiverAnswer::new(
                Some("text/plain"),
                Some("30"),
                b"busy",
                true,
            )),
        });
        let resend = HistoryEntry::Resend(ResendMark {
            at: 1_764_460_900_000,
            request_id: Some("r-1".into()),
        });
        let failed = HistoryEntry::Delivery(DeliveryAttempt {
            attempt: 3,
            at: 1_764_460_900_000,
            status: None,
            error: Some("timeout".into()),
            latency_ms: None,
            response: Some(ReceiverAnswer::default()),
        });
        let expected = [
            r#"{"kind":"delivery","attempt":2,"at":1764460800000,"status":503,"latencyMs":12,"response":{"contentType":"text/plain","retryAfter":"30","body":"busy","bodyTruncated":true}}"#,
            r#"{"kind":"resend","attempt":0,"at":1764460900000,"requestId":"r-1"}"#,
            r#"{"kind":"delivery","attempt":3,"at":1764460900000,"error":"timeout","response":{"body":""}}"#,
        ];
        for (row, json) in [delivery, resend, failed].into_iter().zip(expected) {
            assert_eq!(
                serde_json::to_string(&AttemptView::from(row)).unwrap(),
                json
            );
        }
    }
}
