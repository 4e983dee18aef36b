//! Operator routes: inspect messages and their attempts, list with filters and a stable
//! cursor, resend (like PayZu's `POST /user/callbacks/resend`, idempotent with `requestId`).
//! Each handler parses its request (`query.rs`), calls its use case in `operations` and
//! shapes the answer.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Admin;
use super::query::{Filters, ListParams, ListQuery, message_ids};
use super::views::{MessagePage, MessageView};
use super::{path_segment, raw_json, read_body};
use crate::app::App;
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::operations::messages;
use crate::operations::resend::{self, Resend, ResendAnswer};
use crate::store::{MessageId, MessageState};

/// Inspect one message and every attempt.
#[utoipa::path(
    get,
    path = "/v1/messages/{id}",
    params(("id" = String, Path, description = "Message id (msg_...)")),
    responses(
        (status = 200, description = "The message and its attempts", body = MessageView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn get_message(
    _: Admin,
    State(app): State<Arc<App>>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<MessageView>, ApiError> {
    let id = path_segment(path)?;
    let not_found = || ApiError::NotFound(format!("no message `{id}`"));
    let parsed = MessageId::parse(&id).ok_or_else(not_found)?;
    let record = app.store.get(&parsed).await?.ok_or_else(not_found)?;
    Ok(Json(MessageView::from_record(record, true)))
}

/// List messages, oldest first, with a cursor that stays stable while new messages arrive.
#[utoipa::path(
    get,
    path = "/v1/messages",
    params(ListParams),
    responses(
        (status = 200, description = "A page of messages", body = MessagePage),
        (status = 400, description = "Bad filter", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn list_messages(
    _: Admin,
    State(app): State<Arc<App>>,
    list: ListQuery,
) -> Result<Json<MessagePage>, ApiError> {
    let page = messages::list(&app, &list.query, list.limit, list.after).await?;
    Ok(Json(MessagePage {
        messages: page
            .messages
            .into_iter()
            .map(|r| MessageView::from_record(r, false))
            .collect(),
        next_cursor: page.next_after.map(|id| id.to_string()),
    }))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResendRequest {
    /// Resend these messages (at most 1000), each only if it meets every other filter
    /// given. A malformed id is a 400 naming it.
    pub message_ids: Option<Vec<String>>,
    /// The payment's notifications. With `transactionId` too: nothing (no message has both).
    pub payment_id: Option<String>,
    /// The transaction's provider events: in `source`, or in every configured source.
    #[schema(min_length = 1)]
    pub transaction_id: Option<String>,
    /// Window start, RFC 3339 with an offset (PayZu's name).
    #[schema(format = DateTime)]
    pub created_at_from: Option<String>,
    /// Window end, RFC 3339 with an offset.
    #[schema(format = DateTime)]
    pub created_at_to: Option<String>,
    /// Narrows the selection, `messageIds` included.
    pub source: Option<String>,
    /// Narrows the selection, `messageIds` included.
    #[schema(value_type = Option<MessageState>)]
    pub state: Option<String>,
    /// Makes the resend idempotent: the same id returns the recorded answer and resends
    /// nothing; reused with a different selection it is a 422. 1 to 256 visible ASCII
    /// characters, as `Idempotency-Key`.
    pub request_id: Option<String>,
    /// Only count what would be resent (answer: `dryRun`, `wouldResend`, `more`); resends
    /// nothing and does not use `requestId`.
    pub dry_run: Option<bool>,
}

/// Resend messages: deliver them once more (a finished one gets a fresh window; a pending one
/// keeps its schedule). Every resend is recorded in the message's attempts.
///
/// The walk runs detached from the request: a client that hangs up does not leave it
/// half-done. With a `requestId`, its answer (final, or partial after a store error) is
/// recorded on every path, so the same `requestId` never resends anything twice.
#[utoipa::path(
    post,
    path = "/v1/admin/resend",
    request_body = ResendRequest,
    responses(
        (status = 200, description = "What was resent", body = ResendAnswer,
         headers(("Idempotent-Replayed" = String, description = "`true` for a repeated requestId"))),
        (status = 400, description = "No selector (`no_selector`), or a malformed one (`invalid_query`, naming it)", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 409, description = "The same requestId is still running", body = ErrorBody),
        (status = 422, description = "The requestId was used with a different request body", body = ErrorBody),
        (status = 503, description = "The store failed; with a requestId, repeat it to get what was resent", body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn resend(
    _: Admin,
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(&app, body, &headers).await?;
    let req: ResendRequest = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(ErrorCode::InvalidRequest, format!("resend body: {e}"))
    })?;
    drop(bytes);
    // Copied into every resend mark it makes: unbounded, one request could fill the store.
    if let Some(request_id) = &req.request_id
        && !super::is_visible_text(request_id, super::MAX_KEY_LEN)
    {
        return Err(super::not_visible_text(
            "`requestId`",
            super::MAX_KEY_LEN,
            ErrorCode::InvalidRequest,
        ));
    }
    let ids = message_ids(req.message_ids)?;
    let query = Filters {
        state: req.state,
        source: req.source,
        payment_id: req.payment_id,
        transaction_id: req.transaction_id,
        created_at_from: req.created_at_from,
        created_at_to: req.created_at_to,
    }
    .parse()?;
    let asked = Resend {
        ids,
        query,
        request_id: req.request_id,
    };
    if req.dry_run == Some(true) {
        let counted = resend::dry_run::count(&app, asked).await?;
        return Ok(Json(counted).into_response());
    }
    let reply = resend::run(app, asked).await?;
    Ok(raw_json(StatusCode::OK, reply.body, reply.replayed))
}

/// A host this process holds back.
#[derive(Debug, serde::Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeldHostView {
    /// `host:port`.
    pub host: String,
    /// `open` (its circuit breaker), `throttled` (it asked for a pause), or both.
    pub state: Vec<String>,
    /// When its breaker opened (RFC 3339), if open.
    pub open_since: Option<String>,
    /// When its pause began and ends (RFC 3339), if throttled.
    pub throttled_since: Option<String>,
    pub throttled_until: Option<String>,
    /// Consecutive failed attempts (no answer, a 5xx).
    pub consecutive_failures: u32,
    /// Distinct messages held back for it since it was held (counted up to 100000).
    pub waiting: usize,
}

/// The hosts held back.
#[derive(Debug, serde::Serialize, ToSchema)]
pub struct HeldHosts {
    pub hosts: Vec<HeldHostView>,
}

/// List the hosts this process holds back now: its circuit breaker open, or throttled by a
/// `429` / `Retry-After`. Each process keeps its own; an ingest-only process lists none.
#[utoipa::path(
    get,
    path = "/v1/admin/hosts",
    responses(
        (status = 200, description = "The hosts held back", body = HeldHosts),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn held_hosts(_: Admin, State(app): State<Arc<App>>) -> Json<HeldHosts> {
    let iso = |at: Option<crate::clock::Millis>| at.map(crate::clock::format_iso);
    let hosts = app
        .held_hosts
        .list()
        .into_iter()
        .map(|h| HeldHostView {
            state: [
                h.open_since.map(|_| "open".to_string()),
                h.throttled_until.map(|_| "throttled".to_string()),
            ]
            .into_iter()
            .flatten()
            .collect(),
            host: h.host,
            open_since: iso(h.open_since),
            throttled_since: iso(h.throttled_since),
            throttled_until: iso(h.throttled_until),
            consecutive_failures: h.failures,
            waiting: h.waiting,
        })
        .collect();
    Json(HeldHosts { hosts })
}
