//! `POST /v1/callbacks/{source}`: verify, derive the dedupe key, claim and record in one
//! atomic store call, and only then answer 200.

use crate::clock::Millis;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::{path_segment, raw_json, read_body};
use crate::app::App;
use crate::digest::short_hash;
use crate::dispatch::delivery::EVENT_HEADER;
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::inbound::dedupe;
use crate::inbound::signature::Verified;
use crate::metrics as m;
use crate::store::{
    AcceptOutcome, AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, SignatureSeal,
};

/// Longest accepted `X-Callback-Event`: event names are short constants.
pub const MAX_EVENT_LEN: usize = 128;

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CallbackAccepted {
    pub message_id: String,
}

/// Receive a provider callback.
///
/// The signature is verified before anything is claimed (its headers depend on the source's
/// scheme: `X-Callback-Signature` for `payzu`, `webhook-*` for `standard-webhooks`). A request
/// with an `X-Callback-Event` header (registered webhooks) needs no `status`: the event takes
/// its place in the dedupe key (1 to 128 visible ASCII characters).
/// The first arrival of an event is
/// answered 200 once it is durably recorded; a duplicate gets the byte-identical first answer
/// and `Idempotent-Replayed: true`.
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
    let outcome = m::callback_outcome(result.as_ref().map(|(_, r)| *r).map_err(ApiError::code));
    // Unknown names are not labels: a scanner must not be able to grow the metric set.
    let label = if app.sources.contains_key(&source_name) {
        source_name
    } else {
        "unknown".to_string()
    };
    metrics::counter!(m::CALLBACKS, "source" => label, "outcome" => outcome).increment(1);
    metrics::histogram!(m::ACCEPT_SECONDS, "route" => "callbacks")
        .record(started.elapsed().as_secs_f64());
    let (response, replayed) = result?;
    Ok(raw_json(StatusCode::OK, response, replayed))
}

async fn accept(
    app: &App,
    source_name: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(String, bool), ApiError> {
    let source = app
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
    let event = event_header(headers)?;
    let key = dedupe::derive(&source.name, &json, event.as_deref(), &source.dedupe_fields)
        .map_err(|e| ApiError::bad_request(ErrorCode::InvalidCallback, e.to_string()))?;
    let now = app.clock.now_ms();
    let ordering_key = format!("src/{}/{}", source.name, key.transaction_id);
    let id = MessageId::generate(now, &ordering_key);
    let response = serde_json::to_string(&CallbackAccepted {
        message_id: id.to_string(),
    })
    .map_err(|e| ApiError::bad_request(ErrorCode::InvalidCallback, e.to_string()))?;
    let max_age_ms = app.config.dispatch.max_age_secs.saturating_mul(1000) as i64;
    let message = NewMessage {
        id,
        kind: MessageKind::Inbound,
        source: Some(source.name.clone()),
        payment_id: None,
        transaction_id: Some(key.transaction_id),
        ordering_key,
        event,
        target_url: source.forward_url.clone(),
        headers: {
            let mut stored = Default::default();
            crate::trace::carry(headers, &mut stored);
            stored
        },
        // Valid JSON is valid UTF-8, so this never fails after the parse above.
        body: String::from_utf8_lossy(&bytes).into_owned(),
        created_at: now,
        deadline: now.saturating_add(max_age_ms),
    };
    let request = AcceptRequest {
        dedupe: DedupeClaim {
            key: key.key,
            ttl_secs: app.config.store.dedupe_ttl_secs,
            fingerprint: String::new(),
            response: response.clone(),
        },
        seal: verified.map(|v| seal(&source.name, &v, now, app.config.store.dedupe_ttl_secs)),
        message,
        payment: None,
    };
    match app.store.accept(request, now).await? {
        AcceptOutcome::Accepted => {
            app.wake.notify_one();
            Ok((response, false))
        }
        AcceptOutcome::Replayed { response } => Ok((response, true)),
        AcceptOutcome::Conflict | AcceptOutcome::InvalidTransition { .. } => {
            Err(ApiError::Unavailable(crate::store::StoreError::Corrupt(
                "inbound claim answered like a notification".into(),
            )))
        }
    }
}

/// Makes a verified signature single-use for as long as it could verify again. A scheme with
/// a timestamp stops verifying after its tolerance; `hmac-sha256` never does, so its
/// signatures are remembered as long as dedupe claims.
fn seal(source: &str, verified: &Verified, now: Millis, dedupe_ttl_secs: u64) -> SignatureSeal {
    let expires_at = match verified.valid_until_secs {
        Some(secs) => secs.saturating_add(1).saturating_mul(1000).max(now + 1),
        None => now.saturating_add(i64::try_from(dedupe_ttl_secs).unwrap_or(i64::MAX) * 1000),
    };
    let scoped = serde_json::json!([source, hex::encode(&verified.signature)]);
    SignatureSeal {
        key: short_hash(scoped.to_string().as_bytes()),
        expires_at,
    }
}

fn event_header(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(EVENT_HEADER) else {
        return Ok(None);
    };
    super::header_text(value, MAX_EVENT_LEN)
        .map(|e| Some(e.to_string()))
        .ok_or_else(|| {
            ApiError::bad_request(
                ErrorCode::InvalidEventHeader,
                format!("X-Callback-Event must be 1 to {MAX_EVENT_LEN} visible ASCII characters"),
            )
        })
}
