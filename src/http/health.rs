//! Liveness, readiness, metrics and a small index.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::app::App;
use crate::http::error::{ApiError, ErrorBody};
use crate::metrics as m;
use crate::store::StoreError;

/// Liveness: the process is up and serving HTTP, and its store has answered within
/// `store.healthz_fails_after_secs`. A store silent for that long is failed here so that an
/// orchestrator restarts the process, with every connection new.
#[utoipa::path(get, path = "/healthz", responses(
    (status = 200, description = "Alive", body = Object),
    (status = 503, description = "The store has not answered for `store.healthz_fails_after_secs` (`store_unavailable`)", body = ErrorBody),
), tag = "ops")]
pub async fn healthz(State(app): State<Arc<App>>) -> Result<Json<Value>, ApiError> {
    if let Some(silent) = app.store_silent_for() {
        return Err(ApiError::Unavailable(StoreError::Unreachable(format!(
            "the store has not answered for {} s (store.healthz_fails_after_secs): restart \
             this process to replace every connection",
            silent.as_secs()
        ))));
    }
    Ok(alive())
}

/// What `/healthz` answers when the process is alive.
pub fn alive() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Readiness: not shutting down, and the store answers and has room to write.
#[utoipa::path(get, path = "/readyz", responses(
    (status = 200, description = "Store reachable", body = Object),
    (status = 503, description = "Shutting down (`shutting_down`), store unreachable (`store_unavailable`) or out of memory or disk (`store_full`)", body = ErrorBody),
), tag = "ops")]
pub async fn readyz(State(app): State<Arc<App>>) -> Result<Json<Value>, ApiError> {
    // Before the store: a draining process must leave the load balancer whatever its store says.
    if app.shutting_down.is_cancelled() {
        return Err(ApiError::ShuttingDown);
    }
    app.store.ping().await?;
    Ok(Json(json!({"status": "ready"})))
}

/// Prometheus text exposition. Queue depth is read from the store at scrape time (a few
/// counters per partition, cheap), buffered body bytes from the budget.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text", content_type = "text/plain")), tag = "ops")]
pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    let depth = app.store.depth().await;
    if let Ok(depth) = &depth {
        for (state, n) in [
            ("pending", depth.pending),
            ("in_flight", depth.in_flight),
            ("dead", depth.dead),
        ] {
            metrics::gauge!(m::QUEUE_DEPTH, "state" => state).set(n as f64);
        }
    }
    let oldest = app.store.oldest_unfinished().await;
    if let Ok(oldest) = &oldest {
        let now = app.clock.now_ms();
        let age_ms = oldest
            .as_ref()
            .map_or(0, |id| (now - id.created_at()).max(0));
        metrics::gauge!(m::OLDEST_PENDING_AGE).set(age_ms as f64 / 1000.0);
    }
    let up = depth.is_ok() && oldest.is_ok();
    metrics::gauge!(m::STORE_UP).set(if up { 1.0 } else { 0.0 });
    metrics::gauge!(m::BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    let held = app.settings.server.max_buffered_bytes - app.body_budget.available_permits();
    metrics::gauge!(m::BUFFERED_BYTES).set(held as f64);
    let mut response = app.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    response
}

/// Where to start.
#[utoipa::path(get, path = "/", responses((status = 200, description = "Service index", body = Object)), tag = "ops")]
pub async fn index() -> Json<Value> {
    Json(json!({
        "service": "callbackd",
        "version": env!("CARGO_PKG_VERSION"),
        "openapi": "/openapi.json",
        "health": "/healthz",
        "ready": "/readyz",
        "metrics": "/metrics",
    }))
}
