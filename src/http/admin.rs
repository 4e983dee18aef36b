//! Operator routes: inspect messages and their attempts, list with filters and a stable
//! cursor, resend (like PayZu's `POST /user/callbacks/resend`, idempotent with `requestId`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use utoipa::{IntoParams, ToSchema};

use super::auth::{Role, require};
use super::views::{MessagePage, MessageView};
use super::{path_segment, raw_json, read_body};
use crate::app::App;
use crate::clock::{RFC3339_FORMS, parse_rfc3339};
use crate::digest::short_hash;
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::inbound;
use crate::metrics as m;
use crate::payment;
use crate::store::{
    HistoryEntry, ListFilter, MessageId, MessageState, OperationReservation, ResendEffect,
    ResendMark, StoreError, matches_filter,
};

const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;
/// Messages one resend request may touch; a larger selection answers `more: true` and the
/// operator narrows the window. Keeps memory and the answer bounded.
const MAX_RESEND: usize = 10_000;
pub const MAX_RESEND_IDS: usize = 1000;
/// Page size used to walk a resend selection.
const RESEND_BATCH: usize = 500;
/// How long a resend `requestId` is held while its resend runs: a walk of at most
/// [`MAX_RESEND`] messages takes seconds.
const RESEND_RESERVATION_SECS: u64 = 300;
/// Longest pause between attempts to record a resend's answer while the store refuses it.
const RECORD_RETRY_MAX: Duration = Duration::from_secs(5);

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
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<MessageView>, ApiError> {
    require(&app, &headers, Role::Admin)?;
    let id = path_segment(path)?;
    let not_found = || ApiError::NotFound(format!("no message `{id}`"));
    let parsed = MessageId::parse(&id).ok_or_else(not_found)?;
    let record = app.store.get(&parsed).await?.ok_or_else(not_found)?;
    Ok(Json(MessageView::from_record(record, true)))
}

#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
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

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidQuery, message)
}

/// The selection shared by listing and resend.
struct Selection {
    state: Option<String>,
    source: Option<String>,
    payment_id: Option<String>,
    transaction_id: Option<String>,
    created_at_from: Option<String>,
    created_at_to: Option<String>,
}

impl Selection {
    /// The store filter, or `None` when the filters contradict each other: a `paymentId`
    /// and a `transactionId` together select nothing (a message has one or the other), like
    /// any other filters that no message meets. Filters always combine; none is ignored.
    fn filter(&self, app: &App) -> Result<Option<ListFilter>, ApiError> {
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
        // A transaction id is a provider's, so it names one event stream per source: the
        // given source's, else every configured source's.
        let transaction_keys = self
            .transaction_id
            .as_ref()
            .map(|t| {
                if t.is_empty() {
                    return Err(bad("`transactionId` must not be empty"));
                }
                let sources: Vec<&String> = match &self.source {
                    Some(s) => vec![s],
                    None => app.settings.sources.keys().collect(),
                };
                Ok(sources
                    .into_iter()
                    .map(|source| inbound::accept::ordering_key(source, t))
                    .collect::<Vec<_>>())
            })
            .transpose()?;
        let ordering_keys = match (&self.payment_id, transaction_keys) {
            (Some(_), Some(_)) => return Ok(None),
            (Some(p), None) => Some(vec![payment::ordering_key(p)]),
            (None, keys) => keys,
        };
        Ok(Some(ListFilter {
            state,
            source: self.source.clone(),
            ordering_keys,
            created_from,
            created_to,
            after: None,
            limit: DEFAULT_LIMIT,
        }))
    }
}

/// List messages, oldest first, with a cursor that stays stable while new messages arrive.
#[utoipa::path(
    get,
    path = "/v1/messages",
    params(ListQuery),
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
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<MessagePage>, ApiError> {
    require(&app, &headers, Role::Admin)?;
    let Query(q) = query.map_err(|e| bad(e.body_text()))?;
    let filter = Selection {
        state: q.state,
        source: q.source,
        payment_id: q.payment_id,
        transaction_id: q.transaction_id,
        created_at_from: q.created_at_from,
        created_at_to: q.created_at_to,
    }
    .filter(&app)?;
    let limit = match q.limit {
        None => DEFAULT_LIMIT,
        Some(n) if (1..=MAX_LIMIT).contains(&n) => n,
        Some(_) => return Err(bad(format!("`limit` must be 1 to {MAX_LIMIT}"))),
    };
    let after = q
        .cursor
        .as_deref()
        .map(|c| {
            MessageId::parse(c)
                .ok_or_else(|| bad(format!("`cursor`: `{c}` is not a `nextCursor` of this API")))
        })
        .transpose()?;
    let Some(filter) = filter else {
        return Ok(Json(MessagePage {
            messages: Vec::new(),
            next_cursor: None,
        }));
    };
    let page = app
        .store
        .list(&ListFilter {
            limit,
            after,
            ..filter
        })
        .await?;
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

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResendAnswer {
    pub resent: usize,
    pub message_ids: Vec<String>,
    /// True when the selection had more than one request may resend: narrow it and repeat.
    pub more: bool,
    /// True when the resend stopped part-way on a store error (the request itself got a 503):
    /// the messages listed were resent, the rest of the selection was not. This is the answer
    /// its `requestId` keeps; resend the rest with a new `requestId`.
    pub incomplete: bool,
}

/// A resend `requestId`, with the fingerprint of the request that uses it.
struct Operation {
    key: String,
    request_id: String,
    fingerprint: String,
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
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    require(&app, &headers, Role::Admin)?;
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
    let targets = ResendTarget::of(&app, &req)?;
    if req.dry_run == Some(true) {
        let (ids, filter) = match &targets {
            ResendTarget::Ids(ids, filter) => (Some(ids.as_slice()), filter.clone()),
            ResendTarget::Selection(filter) => (None, filter.clone()),
            ResendTarget::Nothing => (Some(&[][..]), ListFilter::default()),
        };
        let counted =
            super::resend_count::count(&app, ids, filter, MAX_RESEND, RESEND_BATCH).await?;
        return Ok(Json(counted).into_response());
    }
    let operation = req.request_id.clone().map(|request_id| Operation {
        key: format!("resend\n{request_id}"),
        fingerprint: fingerprint(&req),
        request_id,
    });

    let (answer, walked) = oneshot::channel();
    tokio::spawn(run_resend(app.clone(), targets, operation, answer));
    let (body, replayed) = walked.await.map_err(|_| {
        ApiError::Unavailable(StoreError::Unavailable(
            "the resend ended without an answer".into(),
        ))
    })??;
    Ok(raw_json(StatusCode::OK, body, replayed))
}

/// Hash of the request as it selects: ids as a set, times as instants, `requestId` left out,
/// so the same selection written differently is the same request.
fn fingerprint(req: &ResendRequest) -> String {
    let ids = req
        .message_ids
        .as_ref()
        .map(|ids| ids.iter().collect::<BTreeSet<_>>());
    let normalised = serde_json::json!({
        "messageIds": ids,
        "paymentId": req.payment_id,
        "transactionId": req.transaction_id,
        "source": req.source,
        "state": req.state,
        "createdFrom": req.created_at_from.as_deref().and_then(parse_rfc3339),
        "createdTo": req.created_at_to.as_deref().and_then(parse_rfc3339),
    });
    short_hash(normalised.to_string().as_bytes())
}

type ResendResult = Result<(String, bool), ApiError>;

/// Reserves the `requestId`, walks the targets and records the answer, sending the request
/// its answer once the first attempt to record it is made. It runs to the end whether or not
/// anyone still waits for that answer.
async fn run_resend(
    app: Arc<App>,
    targets: ResendTarget,
    operation: Option<Operation>,
    answer: oneshot::Sender<ResendResult>,
) {
    if let Some(op) = &operation {
        let reserved = app
            .store
            .reserve_operation(&op.key, &op.fingerprint, RESEND_RESERVATION_SECS)
            .await;
        let early = match reserved {
            Ok(OperationReservation::Fresh) => None,
            Ok(OperationReservation::Done(recorded)) => Some(Ok((recorded, true))),
            Ok(OperationReservation::InProgress) => Some(Err(ApiError::Conflict(
                "a resend with this requestId is still running".into(),
            ))),
            Ok(OperationReservation::Mismatch) => Some(Err(ApiError::IdempotencyMismatch)),
            Err(e) => Some(Err(ApiError::Unavailable(e))),
        };
        if let Some(early) = early {
            let _ = answer.send(early);
            return;
        }
    }

    let request_id = operation.as_ref().map(|op| op.request_id.as_str());
    let mut resent = Vec::new();
    let walked = match targets {
        ResendTarget::Ids(ids, filter) => resend_ids(&app, &ids, &filter, request_id, &mut resent)
            .await
            .map(|()| false),
        ResendTarget::Selection(filter) => {
            resend_selection(&app, filter, request_id, &mut resent).await
        }
        ResendTarget::Nothing => Ok(false),
    };
    if !resent.is_empty() {
        app.wake.notify_one();
    }
    let result = ResendAnswer {
        resent: resent.len(),
        message_ids: resent,
        more: walked.as_ref().is_ok_and(|more| *more),
        incomplete: walked.is_err(),
    };
    let body = match serde_json::to_string(&result) {
        Ok(body) => body,
        Err(e) => {
            let _ = answer.send(Err(ApiError::bad_request(
                ErrorCode::InvalidRequest,
                e.to_string(),
            )));
            return;
        }
    };
    let Some(op) = operation else {
        let _ = answer.send(walked.map(|_| (body, false)));
        return;
    };
    // The store counts retention in whole seconds.
    let ttl = app.settings.store.dedupe_ttl.as_secs();
    match app
        .store
        .finish_operation(&op.key, &op.fingerprint, &body, ttl)
        .await
    {
        Ok(()) => {
            let _ = answer.send(walked.map(|_| (body, false)));
        }
        Err(e) => {
            // The client is told to retry now; its retry gets 409 until the answer is in.
            let _ = answer.send(Err(ApiError::Unavailable(e)));
            keep_recording(&app, &op, &body, ttl).await;
        }
    }
}

/// Retries recording a resend's answer while its reservation lasts. If the store stays down
/// longer, the reservation lapses and a repeat walks again, but every message this walk
/// resent carries its `requestId` mark, and `resend_one` does not resend those twice.
async fn keep_recording(app: &App, op: &Operation, body: &str, ttl: u64) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(RESEND_RESERVATION_SECS);
    let mut delay = Duration::from_millis(100);
    while tokio::time::Instant::now() < give_up {
        tokio::time::sleep(delay).await;
        match app
            .store
            .finish_operation(&op.key, &op.fingerprint, body, ttl)
            .await
        {
            Ok(()) => return,
            Err(e) => tracing::warn!(error = %e, "cannot record the resend's answer yet"),
        }
        delay = (delay * 2).min(RECORD_RETRY_MAX);
    }
    tracing::error!(
        request_id = %op.request_id,
        "gave up recording the resend's answer; a repeat of this requestId walks again but \
         skips the messages it already resent"
    );
}

/// What a resend selects, checked in full before anything is reserved or resent.
enum ResendTarget {
    /// These ids, each resent only if it meets every other filter given.
    Ids(Vec<MessageId>, ListFilter),
    /// Every message the filter lists.
    Selection(ListFilter),
    /// Filters that contradict each other: nothing.
    Nothing,
}

impl ResendTarget {
    fn of(app: &App, req: &ResendRequest) -> Result<ResendTarget, ApiError> {
        let ids = req
            .message_ids
            .as_ref()
            .map(|ids| {
                if ids.len() > MAX_RESEND_IDS {
                    return Err(bad(format!(
                        "at most {MAX_RESEND_IDS} `messageIds` per request"
                    )));
                }
                ids.iter()
                    .enumerate()
                    .map(|(i, id)| {
                        MessageId::parse(id).ok_or_else(|| {
                            bad(format!("`messageIds[{i}]`: `{id}` is not a message id"))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        let filter = Selection {
            state: req.state.clone(),
            source: req.source.clone(),
            payment_id: req.payment_id.clone(),
            transaction_id: req.transaction_id.clone(),
            created_at_from: req.created_at_from.clone(),
            created_at_to: req.created_at_to.clone(),
        }
        .filter(app)?;
        let has_selector = ids.is_some()
            || req.payment_id.is_some()
            || req.transaction_id.is_some()
            || req.created_at_from.is_some()
            || req.created_at_to.is_some();
        if !has_selector {
            return Err(ApiError::bad_request(
                ErrorCode::NoSelector,
                "give `messageIds`, `paymentId`, `transactionId` or a `createdAtFrom`/`createdAtTo` window",
            ));
        }
        Ok(match (ids, filter) {
            (_, None) => ResendTarget::Nothing,
            (Some(ids), Some(filter)) => ResendTarget::Ids(ids, filter),
            (None, Some(filter)) => ResendTarget::Selection(filter),
        })
    }
}

async fn resend_one(app: &App, id: &MessageId, request_id: Option<&str>) -> Result<bool, ApiError> {
    if let Some(request_id) = request_id {
        // A walk of this requestId whose answer was never recorded (its process died, or the
        // store stayed down past the reservation) may have resent this one already.
        let already = app.store.get(id).await?.is_some_and(|record| {
            record
                .history
                .iter()
                .any(|row| matches!(row, HistoryEntry::Resend(mark) if mark.request_id.as_deref() == Some(request_id)))
        });
        if already {
            return Ok(true);
        }
    }
    let now = app.clock.now_ms();
    let mark = ResendMark {
        at: now,
        request_id: request_id.map(str::to_string),
    };
    let fresh_deadline = app.settings.dispatch.deadline(now);
    let effect = app.store.resend(id, mark, fresh_deadline, now).await?;
    metrics::counter!(m::RESENDS, "effect" => m::resend_effect(effect)).increment(1);
    Ok(effect != ResendEffect::Skipped)
}

/// Resends `ids` in order, pushing each one resent onto `resent` as it goes, so a failure
/// part-way leaves the list of what was done.
async fn resend_ids(
    app: &App,
    ids: &[MessageId],
    filter: &ListFilter,
    request_id: Option<&str>,
    resent: &mut Vec<String>,
) -> Result<(), ApiError> {
    let narrowed = filter.state.is_some()
        || filter.source.is_some()
        || filter.ordering_keys.is_some()
        || filter.created_from.is_some()
        || filter.created_to.is_some();
    for id in ids {
        if narrowed {
            let record = app.store.get(id).await?;
            if !record.is_some_and(|r| matches_filter(&r, filter)) {
                continue;
            }
        }
        if resend_one(app, id, request_id).await? {
            resent.push(id.to_string());
        }
    }
    Ok(())
}

/// Like [`resend_ids`] over a selection; returns whether it stopped at [`MAX_RESEND`].
async fn resend_selection(
    app: &App,
    mut filter: ListFilter,
    request_id: Option<&str>,
    resent: &mut Vec<String>,
) -> Result<bool, ApiError> {
    filter.limit = RESEND_BATCH;
    loop {
        let page = app.store.list(&filter).await?;
        for record in page.messages {
            if resent.len() >= MAX_RESEND {
                return Ok(true);
            }
            if resend_one(app, &record.message.id, request_id).await? {
                resent.push(record.message.id.to_string());
            }
        }
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => return Ok(false),
        }
    }
}
