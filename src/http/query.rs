//! The admin routes' selections, parsed: a listing's query string ([`ListQuery`], an
//! extractor) and the filters a listing and a resend share ([`Filters`]). A malformed one is
//! a 400 `invalid_query` naming its field as the client wrote it; what the parsed filters
//! select is `operations::messages`'.

use axum::extract::{FromRequestParts, Query};
use axum::http::request::Parts;
use serde::Deserialize;
use utoipa::IntoParams;

use crate::clock::{RFC3339_FORMS, parse_rfc3339};
use crate::http::error::{ApiError, ErrorCode};
use crate::operations::messages::MessageQuery;
use crate::operations::resend;
use crate::store::{MessageId, MessageState};

const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidQuery, message)
}

/// `GET /v1/messages`' query string as written: the document's parameters.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct ListParams {
    #[param(value_type = Option<MessageState>)]
    pub state: Option<String>,
    pub source: Option<String>,
    /// The payment's notifications. Filters combine: with `transactionId` too the page is
    /// empty (no message has both).
    pub payment_id: Option<String>,
    /// Provider transaction id: its events in `source`, or in every configured source.
    #[param(min_length = 1)]
    pub transaction_id: Option<String>,
    /// RFC 3339 with an offset (`2026-11-30T00:00:00-03:00`), inclusive.
    #[param(format = DateTime)]
    pub created_at_from: Option<String>,
    /// RFC 3339 with an offset (`2026-11-30T00:00:00-03:00`), inclusive.
    #[param(format = DateTime)]
    pub created_at_to: Option<String>,
    /// 1 to 1000, default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// `nextCursor` of the previous page: the last message id it listed.
    pub cursor: Option<String>,
}

/// A listing's query string, parsed: the filters, the page size and the cursor.
#[derive(Debug)]
pub struct ListQuery {
    pub query: MessageQuery,
    pub limit: usize,
    /// List the messages after this one.
    pub after: Option<MessageId>,
}

impl<S: Send + Sync> FromRequestParts<S> for ListQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<ListQuery, ApiError> {
        let Query(params) = Query::<ListParams>::from_request_parts(parts, state)
            .await
            .map_err(|e| bad(e.body_text()))?;
        let query = Filters {
            state: params.state,
            source: params.source,
            payment_id: params.payment_id,
            transaction_id: params.transaction_id,
            created_at_from: params.created_at_from,
            created_at_to: params.created_at_to,
        }
        .parse()?;
        let limit = match params.limit {
            None => DEFAULT_LIMIT,
            Some(n) if (1..=MAX_LIMIT).contains(&n) => n,
            Some(_) => return Err(bad(format!("`limit` must be 1 to {MAX_LIMIT}"))),
        };
        let after = params
            .cursor
            .as_deref()
            .map(|c| {
                MessageId::parse(c).ok_or_else(|| {
                    bad(format!("`cursor`: `{c}` is not a `nextCursor` of this API"))
                })
            })
            .transpose()?;
        Ok(ListQuery {
            query,
            limit,
            after,
        })
    }
}

/// The filters shared by a listing and a resend, as written.
pub struct Filters {
    pub state: Option<String>,
    pub source: Option<String>,
    pub payment_id: Option<String>,
    pub transaction_id: Option<String>,
    pub created_at_from: Option<String>,
    pub created_at_to: Option<String>,
}

impl Filters {
    pub fn parse(self) -> Result<MessageQuery, ApiError> {
        let state = self
            .state
            .as_deref()
            .map(|s| {
                MessageState::parse(s).ok_or_else(|| {
                    bad(format!(
                        "`state`: `{s}` is not pending, in_flight, delivered, dead or recorded"
                    ))
                })
            })
            .transpose()?;
        let time = |field: &str, v: &Option<String>| {
            v.as_deref()
                .map(|s| {
                    parse_rfc3339(s).ok_or_else(|| {
                        bad(format!(
                            "`{field}`: `{s}` is not a time; give {RFC3339_FORMS}"
                        ))
                    })
                })
                .transpose()
        };
        let created_from = time("createdAtFrom", &self.created_at_from)?;
        let created_to = time("createdAtTo", &self.created_at_to)?;
        if self.transaction_id.as_ref().is_some_and(String::is_empty) {
            return Err(bad("`transactionId` must not be empty"));
        }
        Ok(MessageQuery {
            state,
            source: self.source,
            payment_id: self.payment_id,
            transaction_id: self.transaction_id,
            created_from,
            created_to,
        })
    }
}

/// A resend's `messageIds`: at most [`resend::MAX_IDS`], each a message id.
pub fn message_ids(ids: Option<Vec<String>>) -> Result<Option<Vec<MessageId>>, ApiError> {
    ids.map(|ids| {
        if ids.len() > resend::MAX_IDS {
            return Err(bad(format!(
                "at most {} `messageIds` per request",
                resend::MAX_IDS
            )));
        }
        ids.iter()
            .enumerate()
            .map(|(i, id)| {
                MessageId::parse(id)
                    .ok_or_else(|| bad(format!("`messageIds[{i}]`: `{id}` is not a message id")))
            })
            .collect()
    })
    .transpose()
}
