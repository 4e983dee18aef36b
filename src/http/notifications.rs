//! `POST /v1/notifications`: a connector hands off an async payment notification (a Pix or
//! Boleto confirmation) for delivery to the gateway's `callbackUrl`.
//!
//! The idempotency key is `paymentId + status`, or the `Idempotency-Key` header (scoped to
//! the payment). A repeat returns the stored answer byte for byte and creates nothing; the
//! same key with another body is a 422. The payment status moves by compare-and-set in the
//! same atomic step that records the notification. The checks and what is recorded are
//! `handoff`'s; this parses the request and maps the outcome.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::auth::Connector;
use super::numbers::whole_seconds;
use super::read_body;
use super::record::{Recorded, Route, answer, record};
use crate::app::App;
use crate::handoff::{self, HandOff, NotificationAccepted};
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::payment::PaymentStatus;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NotificationRequest {
    #[schema(min_length = 1, max_length = 256)]
    pub payment_id: String,
    /// Target payment status: approved, denied, settled, cancelled, refunded.
    #[schema(value_type = PaymentStatus)]
    pub status: String,
    /// Where to deliver, used byte for byte (keep the gateway's `X-VTEX-signature`).
    #[schema(
        pattern = "^https?://",
        example = "https://gateway.example.com/api/pvt/payments/p1/callback?X-VTEX-signature=abc"
    )]
    pub callback_url: String,
    /// Body to deliver; defaults to `{"paymentId", "status"}`.
    #[serde(default)]
    pub payload: Option<Map<String, Value>>,
    /// Static headers for every attempt (e.g. `X-VTEX-API-AppKey`, `X-VTEX-API-AppToken`).
    #[serde(default)]
    pub headers: Option<BTreeMap<String, String>>,
    /// Shortens the delivery window for this notification (at most `dispatch.max_age_secs`).
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 604800)]
    pub max_age_secs: Option<u64>,
}

/// Hand off a payment notification.
#[utoipa::path(
    post,
    path = "/v1/notifications",
    request_body = NotificationRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "Overrides paymentId + status")),
    responses(
        (status = 202, description = "Accepted (or replayed: the stored body)", body = NotificationAccepted,
         headers(("Idempotent-Replayed" = String, description = "`true` on a repeat"))),
        (status = 400, description = "Malformed request", body = ErrorBody),
        (status = 401, description = "Missing or unknown token", body = ErrorBody),
        (status = 403, description = "Not a connector token", body = ErrorBody),
        (status = 409, description = "Invalid payment state transition", body = ErrorBody),
        (status = 413, description = "Body too large", body = ErrorBody),
        (status = 422, description = "Idempotency key reused with another body", body = ErrorBody),
        (status = 503, description = "Store unavailable; retry", body = ErrorBody),
    ),
    security(("connector" = [])),
    tag = "connectors"
)]
pub async fn hand_off(
    connector: Result<Connector, ApiError>,
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    // Refused tokens are counted and timed like any other refusal of this route.
    let result = match connector {
        Ok(Connector) => accept(&app, &headers, body).await,
        Err(refused) => Err(refused),
    };
    answer(Route::Notifications, started, result)
}

async fn accept(app: &App, headers: &HeaderMap, body: Body) -> Result<Recorded, ApiError> {
    let bytes = read_body(app, body, headers).await?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(
            ErrorCode::InvalidJson,
            format!("body is not valid JSON: {e}"),
        )
    })?;
    let req: NotificationRequest = serde_path_to_error::deserialize(&value).map_err(|e| {
        ApiError::bad_request(
            ErrorCode::InvalidRequest,
            format!("`{}`: {}", e.path(), e.inner()),
        )
    })?;
    let hand_off = HandOff {
        payment_id: req.payment_id,
        status: req.status,
        callback_url: req.callback_url,
        payload: req.payload,
        headers: req.headers,
        max_age_secs: req.max_age_secs,
        request: value,
    };
    let settings = handoff::Settings {
        max_window: app.settings.dispatch.max_age,
        dedupe_ttl: app.settings.store.dedupe_ttl,
        partitions: app.store.partitions(),
        callback_ssrf: app.settings.dispatch.callback_ssrf,
    };
    let notification = handoff::check(&settings, hand_off).await?;
    // After the fields, as the document lists them: a request wrong in both names the field.
    let key = idempotency_key(headers)?;
    let now = app.clock.now_ms();
    let request = handoff::accept(&settings, notification, key, headers, now)?;
    record(app, request, now).await
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    super::optional_header(
        headers,
        "idempotency-key",
        "Idempotency-Key",
        super::MAX_KEY_LEN,
        ErrorCode::InvalidRequest,
    )
}
