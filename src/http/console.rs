//! The operator's console: static pages compiled into the binary (no Node toolchain to build
//! or run callbackd) and the small JSON endpoint behind its overview.
//!
//! The pages carry no data and need no token: they are the same shell for every URL, and the
//! JavaScript asks the admin API with the token the operator typed (kept in sessionStorage,
//! sent as a Bearer header; no cookie, so no CSRF). A strict CSP allows only this origin's
//! scripts and styles, none inline, and the pages cannot be framed.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;

use super::auth::Admin;
use crate::app::App;
use crate::clock::format_iso;
use crate::http::error::ApiError;
use crate::store::MinuteCount;
use crate::store::counts;

pub const CSP: &str = "default-src 'self'; base-uri 'none'; form-action 'self'; \
                       frame-ancestors 'none'; object-src 'none'";

const INDEX: &str = include_str!("../../console/index.html");

/// `(file, content type, content)` of every asset under `/console/assets/`.
const ASSETS: [(&str, &str, &str); 6] = [
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("../../console/app.js"),
    ),
    (
        "api.js",
        "text/javascript; charset=utf-8",
        include_str!("../../console/api.js"),
    ),
    (
        "dom.js",
        "text/javascript; charset=utf-8",
        include_str!("../../console/dom.js"),
    ),
    (
        "chart.js",
        "text/javascript; charset=utf-8",
        include_str!("../../console/chart.js"),
    ),
    (
        "console.css",
        "text/css; charset=utf-8",
        include_str!("../../console/console.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_str!("../../console/favicon.svg"),
    ),
];

/// The console's pages and assets, and `/v1/console/overview`.
pub fn routes() -> Router<Arc<App>> {
    Router::new()
        .route("/console", get(page))
        .route("/console/messages", get(page))
        .route("/console/messages/{id}", get(page))
        .route("/console/assets/{file}", get(asset))
        .route("/v1/console/overview", get(overview))
        .layer(axum::middleware::map_response(secure))
}

/// Headers on everything the console serves: only this origin's scripts and styles, never
/// in a frame (clickjacking a Resend button), no content sniffing, no referrer leaking ids.
async fn secure(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-cache"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

fn with_type(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    response.headers_mut().insert(
        HeaderName::from_static("content-type"),
        HeaderValue::from_static(content_type),
    );
    response
}

/// Every page is the same shell; the script renders the one its URL names.
async fn page() -> Response {
    with_type("text/html; charset=utf-8", INDEX)
}

async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    ASSETS
        .iter()
        .find(|(name, _, _)| *name == file)
        .map(|(_, content_type, body)| with_type(content_type, body))
        .ok_or_else(|| ApiError::NotFound(format!("no console asset `{file}`")))
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Overview {
    pub now: String,
    pub depth: Depth,
    /// The oldest message not delivered yet, absent when nothing is waiting.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oldest_pending: Option<Oldest>,
    /// The last 60 minutes of the whole deployment, oldest first: what every process
    /// recorded, as the store counted it.
    pub per_minute: Vec<MinuteCount>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Depth {
    pub pending: u64,
    pub in_flight: u64,
    pub dead: u64,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Oldest {
    pub id: String,
    pub created_at: String,
    pub age_seconds: i64,
}

/// The overview: queue depth by state, the oldest pending message, and deliveries, failures
/// and dead letters per minute over the last hour, all read from the store, so every
/// process shows the same. Admin token required.
async fn overview(_: Admin, State(app): State<Arc<App>>) -> Result<Json<Overview>, ApiError> {
    let now = app.clock.now_ms();
    let depth = app.store.depth().await?;
    let oldest = app.store.oldest_unfinished().await?;
    let per_minute = app
        .store
        .minute_counts(counts::first_shown(now), now)
        .await?;
    Ok(Json(Overview {
        now: format_iso(now),
        depth: Depth {
            pending: depth.pending,
            in_flight: depth.in_flight,
            dead: depth.dead,
        },
        oldest_pending: oldest.map(|id| Oldest {
            created_at: format_iso(id.created_at()),
            age_seconds: (now - id.created_at()).max(0) / 1000,
            id: id.to_string(),
        }),
        per_minute: counts::last_hour(now, per_minute),
    }))
}
