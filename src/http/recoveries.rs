//! Provider-side recoveries (issue #27): start one, list them, show one. Each handler parses
//! its request, calls `operations::recover` and shapes the answer.

use std::sync::Arc;

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use serde::Deserialize;
use utoipa::ToSchema;

use super::auth::Admin;
use super::numbers::whole_seconds;
use super::{path_segment, read_body};
use crate::app::App;
use crate::clock::{RFC3339_FORMS, parse_rfc3339};
use crate::http::error::{ApiError, ErrorBody, ErrorCode};
use crate::operations::recover::{self, RecoverRequest, RecoveryList, RecoveryView};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RecoveryRequest {
    /// A configured source with `provider_api_url` and `provider_api_token`.
    #[schema(min_length = 1)]
    pub source: String,
    /// Start of the range whose callbacks the provider resends (inclusive), RFC 3339 with an
    /// offset; at most 30 days back.
    #[schema(format = DateTime)]
    pub from: String,
    /// End of the range (exclusive), RFC 3339 with an offset; not in the future.
    #[schema(format = DateTime)]
    pub to: String,
    /// How long the source's arrivals are counted for the report, 1 to 86400 seconds
    /// (default 3600).
    #[serde(default, deserialize_with = "whole_seconds")]
    #[schema(minimum = 1, maximum = 86400)]
    pub count_secs: Option<u64>,
}

fn time(field: &'static str, value: &str) -> Result<i64, ApiError> {
    parse_rfc3339(value).ok_or_else(|| {
        ApiError::bad_request(
            ErrorCode::InvalidRecovery,
            format!("`{field}` is not a time: {RFC3339_FORMS}"),
        )
    })
}

/// Start a recovery: ask the source's provider to resend its callbacks of `[from, to)`, in
/// windows of at most 7 days (`POST {provider_api_url}/v1/user/callbacks/resend` each), and
/// count the callbacks of the source that arrive, new and replayed, for `countSecs`.
///
/// Answers once every window was sent (each retried on a 5xx or a connection failure); a
/// window the provider refused is recorded with its error and the others are still sent.
#[utoipa::path(
    post,
    path = "/v1/admin/recoveries",
    request_body = RecoveryRequest,
    responses(
        (status = 201, description = "The recovery, its windows and its figures so far", body = RecoveryView),
        (status = 400, description = "A body that is not a recovery request (`invalid_request`)", body = ErrorBody),
        (status = 422, description = "A refused request (`invalid_recovery`, naming the field and the limit: a source that is not configured for recovery, a time out of the limits); nothing was sent or recorded", body = ErrorBody),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn start(
    _: Admin,
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<RecoveryView>), ApiError> {
    let bytes = read_body(&app, body, &headers).await?;
    let req: RecoveryRequest = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(ErrorCode::InvalidRequest, format!("recovery body: {e}"))
    })?;
    let asked = RecoverRequest {
        from: time("from", &req.from)?,
        to: time("to", &req.to)?,
        source: req.source,
        count_secs: req.count_secs,
    };
    let report = recover::start(app, asked).await?;
    Ok((StatusCode::CREATED, Json(report.into())))
}

/// List the recoveries kept (the newest 100 of the last 30 days), newest first, with their
/// figures.
#[utoipa::path(
    get,
    path = "/v1/admin/recoveries",
    responses(
        (status = 200, description = "The recoveries", body = RecoveryList),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn list(_: Admin, State(app): State<Arc<App>>) -> Result<Json<RecoveryList>, ApiError> {
    let recoveries = recover::list(&app).await?;
    Ok(Json(RecoveryList {
        recoveries: recoveries.into_iter().map(RecoveryView::from).collect(),
    }))
}

/// Show one recovery: its windows, the provider's totals, and the source's new and replayed
/// callbacks counted since it started.
#[utoipa::path(
    get,
    path = "/v1/admin/recoveries/{id}",
    params(("id" = String, Path, description = "Recovery id (rec_...)")),
    responses(
        (status = 200, description = "The recovery", body = RecoveryView),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, description = "Unknown id", body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("admin" = [])),
    tag = "ops"
)]
pub async fn get(
    _: Admin,
    State(app): State<Arc<App>>,
    path: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<RecoveryView>, ApiError> {
    let id = path_segment(path)?;
    let report = recover::get(&app, &id)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no recovery `{id}`")))?;
    Ok(Json(report.into()))
}
