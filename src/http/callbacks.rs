//! `POST /v1/callbacks/{source}`: verify, derive the dedupe key, claim and record in one
//! atomic store call, and only then answer 200. What is recorded is decided by
//! `inbound::accept`; this reads the request and maps the outcome.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::Value;

use super::record::{Recorded, Route, answer, record};
use super::{path_segment, read_body};
use crate::app::App;
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::inbound;
use crate::inbound::accept::{Callback, CallbackAccepted, accept_request};
use crate::webhook::EVENT_HEADER;

/// Longest accepted `X-Callback-Event`: event names are short constants.
pub const MAX_EVENT_LEN: usize = 128;

/// Receive a provider callback.
///
/// The signature is verified before anything is claimed (its headers depend on the source's
/// scheme: `X-Callback-Signature` for `payzu`, `webhook-*` for `standard-webhooks`). A request
/// with an `X-Callback-Event` header (registered webhooks) needs no `status`: the event takes
/// its place in the dedupe key (1 to 128 visible ASCII characters).
/// The first arrival of an event is
/// answered 200 once it is durably recorded; a duplicate gets the byte-identical first answer
/// and `Idempotent-Replayed: true`. A signature is single-use: re-posted with another
/// `X-Callback-Event` (another dedupe key) it is a 409 `signature_reused` that records
/// nothing, and the provider's retry, signed again, gets through.
#[utoipa::path(
    post,
    path = "/v1/callbacks/{source}",
    params(("source" = String, Path, description = "Configured source name")),
    request_body(content = Object, description = "The provider's JSON callback, signed"),
    responses(
        (status = 200, description = "Accepted (or replayed)", body = CallbackAccepted,
         headers(("Idempotent-Replayed" = String, description = "`true` on a duplicate"))),
        (status = 400, description = "Not a JSON object, no `id`, no `status`", body = ErrorBody),
        (status = 401, description = "Missing, bad or stale signature", body = ErrorBody),
        (status = 404, description = "Unknown source", body = ErrorBody),
        (status = 409, description = "The signature was accepted before with another dedupe key (`signature_reused`); nothing recorded", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 503, description = "Cannot record durably now; retry", body = ErrorBody,
         headers(("Retry-After" = String))),
    ),
    tag = "providers"
)]
pub async fn receive(
    State(app): State<Arc<App>>,
    path: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let source_name = path_segment(path)?;
    let result = accept(&app, &source_name, &headers, body).await;
    // Unknown names are not labels: a scanner must not be able to grow the metric set.
    let source = if app.settings.sources.contains_key(&source_name) {
        source_name
    } else {
        "unknown".to_string()
    };
    answer(Route::Callbacks { source }, started, result)
}

async fn accept(
    app: &App,
    source_name: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Recorded, ApiError> {
    let source = app
        .settings
        .sources
        .get(source_name)
        .ok_or_else(|| ApiError::UnknownSource(source_name.to_string()))?;
    let bytes = read_body(app, body, headers).await?;
    let verified = source
        .verifier
        .verify_signature(headers, &bytes, app.clock.now_secs())
        .map_err(|e| ApiError::BadSignature(e.to_string()))?;
    let json: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(
            ErrorCode::InvalidJson,
            format!("body is not valid JSON: {e}"),
        )
    })?;
    let mut carried = BTreeMap::new();
    crate::trace::carry(headers, &mut carried);
    let callback = Callback {
        body: &bytes,
        json: &json,
        event: event_header(headers)?,
        verified,
        headers: carried,
    };
    let settings = inbound::accept::Settings {
        name: &source.name,
        dedupe_fields: &source.dedupe_fields,
        forward_url: source.forward_url.as_deref(),
        window: app.settings.dispatch.max_age,
        dedupe_ttl: app.settings.store.dedupe_ttl,
        partitions: app.store.partitions(),
    };
    let now = app.clock.now_ms();
    let request = accept_request(&settings, callback, now)?;
    record(app, request, now).await
}

fn event_header(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    super::optional_header(
        headers,
        EVENT_HEADER,
        "X-Callback-Event",
        MAX_EVENT_LEN,
        ErrorCode::InvalidEventHeader,
    )
}
