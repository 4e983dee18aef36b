//! The vocabulary of messages: what a message is, the states it goes through, what a read
//! answers and how a listing selects.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{HistoryEntry, MessageId, PaymentId, SourceName, TransactionId};
use crate::clock::Millis;

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
    pub source: Option<SourceName>,
    /// Payment id for notifications.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payment_id: Option<PaymentId>,
    /// Provider transaction id for inbound callbacks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transaction_id: Option<TransactionId>,
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueDepth {
    pub pending: u64,
    pub in_flight: u64,
    pub dead: u64,
}

/// Whether a record passes every filter of a listing (the parts an index did not answer).
pub fn matches_filter(record: &MessageRecord, filter: &ListFilter) -> bool {
    let m = &record.message;
    filter.state.is_none_or(|s| s == record.state)
        && filter
            .source
            .as_ref()
            .is_none_or(|s| m.source.as_deref() == Some(s.as_str()))
        && filter
            .ordering_keys
            .as_ref()
            .is_none_or(|keys| keys.contains(&m.ordering_key))
        && filter.created_from.is_none_or(|f| m.created_at >= f)
        && filter.created_to.is_none_or(|t| m.created_at <= t)
}
