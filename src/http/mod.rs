//! HTTP routers. Handlers are thin: parse and check input, call pure logic, make one store
//! call, shape the answer. Errors are mapped to HTTP in `crate::error`.

pub mod admin;
pub mod auth;
pub mod callbacks;
pub mod health;
pub mod notifications;
pub mod openapi;
pub mod server;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, Request, header};
use axum::routing::{get, post};
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::app::App;
use crate::error::ApiError;

pub const REQUEST_ID_HEADER: &str = "x-request-id";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Every route, as `(method, path)`: the OpenAPI test checks each one is documented.
pub const ROUTES: [(&str, &str); 10] = [
    ("post", "/v1/callbacks/{source}"),
    ("post", "/v1/notifications"),
    ("get", "/v1/messages"),
    ("get", "/v1/messages/{id}"),
    ("post", "/v1/admin/resend"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/"),
];

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/callbacks/{source}", post(callbacks::receive))
        .route("/v1/notifications", post(notifications::hand_off))
        .route("/v1/messages", get(admin::list_messages))
        .route("/v1/messages/{id}", get(admin::get_message))
        .route("/v1/admin/resend", post(admin::resend))
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(health::metrics))
        .route("/openapi.json", get(openapi::spec))
        .route("/", get(health::index))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async {
            ApiError::MethodNotAllowed("this route does not take that method".into())
        })
        // Bodies are read by `read_body`, which enforces `max_body_bytes` with a JSON 413.
        .layer(DefaultBodyLimit::disable())
        .layer(
            TraceLayer::new_for_http().make_span_with(|req: &Request<Body>| {
                let id = req
                    .headers()
                    .get(REQUEST_ID_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("-");
                tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id)
            }),
        )
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(SequentialRequestId::default()))
        .with_state(app)
}

/// Request ids: a per-process random prefix and a counter, cheap and unique enough to follow
/// one request through the logs.
#[derive(Clone)]
struct SequentialRequestId {
    prefix: u32,
    next: Arc<AtomicU64>,
}

impl Default for SequentialRequestId {
    fn default() -> Self {
        SequentialRequestId {
            prefix: rand::random(),
            next: Arc::new(AtomicU64::new(1)),
        }
    }
}

impl MakeRequestId for SequentialRequestId {
    fn make_request_id<B>(&mut self, _: &Request<B>) -> Option<RequestId> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        HeaderValue::from_str(&format!("req_{:08x}{n:08x}", self.prefix))
            .ok()
            .map(RequestId::new)
    }
}

/// Reads a request body up to `server.max_body_bytes`: a declared or actual larger body is a
/// 413 with a JSON error, and nothing is buffered past the limit. A body that trickles in
/// slower than `server.request_timeout_secs` is a 408, so a slow client holds no handler.
pub async fn read_body(app: &App, body: Body, headers: &HeaderMap) -> Result<Bytes, ApiError> {
    let limit = app.config.server.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::TooLarge(limit));
    }
    let timeout_secs = app.config.server.request_timeout_secs;
    let read = tokio::time::timeout(
        Duration::from_secs(timeout_secs),
        axum::body::to_bytes(body, limit),
    )
    .await
    .map_err(|_| ApiError::RequestTimeout(timeout_secs))?;
    read.map_err(|e| {
        let inner = e.into_inner();
        if inner
            .downcast_ref::<http_body_util::LengthLimitError>()
            .is_some()
        {
            ApiError::TooLarge(limit)
        } else {
            ApiError::bad_request("unreadable_body", format!("cannot read the body: {inner}"))
        }
    })
}

/// Maps axum's path extraction failure (e.g. a segment that is not UTF-8) to our JSON error.
pub fn path_segment(
    path: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<String, ApiError> {
    path.map(|p| p.0)
        .map_err(|e| ApiError::NotFound(format!("bad path: {}", e.body_text())))
}

/// A JSON answer with an exact body (stored responses are replayed byte for byte).
pub fn raw_json(
    status: axum::http::StatusCode,
    body: String,
    replayed: bool,
) -> axum::response::Response {
    let mut response = axum::response::Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}
