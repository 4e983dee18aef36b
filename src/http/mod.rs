//! HTTP routes. A handler authenticates (`auth.rs`'s extractors), reads and parses its input,
//! calls one use case below it (`inbound::accept` for a callback, `handoff` for a
//! notification, `operations` for the admin routes) and shapes the answer: both accept routes
//! end in `record.rs`, the admin routes' selections are parsed in `query.rs`, the API's shapes
//! of stored rows are in `views.rs`, and every error is mapped to HTTP in `error.rs`. Nothing
//! below `http` knows it.

pub mod admin;
pub mod auth;
pub mod callbacks;
pub mod console;
pub mod error;
pub mod health;
pub mod notifications;
mod numbers;
pub mod openapi;
pub mod query;
pub mod record;
pub mod recoveries;
pub mod server;
pub mod views;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::handler::Handler;
use axum::http::{HeaderMap, HeaderValue, Method, Request, header};
use axum::routing::{MethodFilter, MethodRouter, get, on};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::app::App;
use crate::http::error::{ApiError, ErrorCode};
use crate::store::StoreError;

pub const REQUEST_ID_HEADER: &str = "x-request-id";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// One route of the API. The router's API routes come from [`routes`] and from nothing else,
/// so the list the OpenAPI test walks is the router's own (axum cannot list a built router's
/// routes). The console's pages and overview (`console::routes`) are merged beside them and
/// are not part of the API document.
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    handler: MethodRouter<Arc<App>>,
}

fn route<H, T>(method: Method, path: &'static str, handler: H) -> Route
where
    H: Handler<T, Arc<App>>,
    T: 'static,
{
    let filter = MethodFilter::try_from(method.clone())
        .unwrap_or_else(|_| panic!("{method} is not a method axum routes"));
    Route {
        method,
        path,
        handler: on(filter, handler),
    }
}

/// Every API route.
pub fn routes() -> Vec<Route> {
    vec![
        route(Method::POST, "/v1/callbacks/{source}", callbacks::receive),
        route(Method::POST, "/v1/notifications", notifications::hand_off),
        route(Method::GET, "/v1/messages", admin::list_messages),
        route(Method::GET, "/v1/messages/{id}", admin::get_message),
        route(Method::POST, "/v1/admin/resend", admin::resend),
        route(Method::GET, "/v1/admin/hosts", admin::held_hosts),
        route(Method::POST, "/v1/admin/recoveries", recoveries::start),
        route(Method::GET, "/v1/admin/recoveries", recoveries::list),
        route(Method::GET, "/v1/admin/recoveries/{id}", recoveries::get),
        route(Method::GET, "/healthz", health::healthz),
        route(Method::GET, "/readyz", health::readyz),
        route(Method::GET, "/metrics", health::metrics),
        route(Method::GET, "/openapi.json", openapi::spec),
        route(Method::GET, "/", health::index),
    ]
}

pub fn router(app: Arc<App>) -> Router {
    routes()
        .into_iter()
        .fold(Router::new(), |router, r| router.route(r.path, r.handler))
        .merge(console::routes())
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async {
            ApiError::MethodNotAllowed("this route does not take that method".into())
        })
        // After the fallbacks, so 404s and 405s carry it too.
        .layer(axum::middleware::map_response(no_sniff))
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

/// What is served while `callbackd serve` waits for its store (`crate::run`): alive, not
/// ready, and 503 `store_unavailable` for every other route, so senders retry.
pub fn starting_router() -> Router {
    let not_yet = || async {
        ApiError::Unavailable(StoreError::Unreachable(
            "callbackd is starting: its store is not reachable yet".into(),
        ))
    };
    Router::new()
        .route("/healthz", get(|| async { health::alive() }))
        .fallback(not_yet)
        .layer(axum::middleware::map_response(no_sniff))
}

/// Every answer, errors included, is declared JSON or text: a browser that is handed one
/// (an API URL opened in a tab, or loaded by another page) must not sniff it into HTML or a
/// script.
async fn no_sniff(mut response: axum::response::Response) -> axum::response::Response {
    response.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
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

/// How long a body waits for its share of `server.max_buffered_bytes` before the request is
/// answered 503 + `Retry-After`: long enough to ride out a burst, short enough that a client
/// is told to come back rather than held.
const BUDGET_WAIT: Duration = Duration::from_secs(1);

/// A request body in memory, holding its share of `server.max_buffered_bytes` until the
/// handler drops it.
#[derive(Debug)]
pub struct BufferedBody {
    bytes: Vec<u8>,
    _share: Share,
}

impl std::ops::Deref for BufferedBody {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

/// Bytes taken from the global body budget; given back on drop.
#[derive(Debug, Default)]
struct Share(Option<OwnedSemaphorePermit>);

impl Share {
    fn size(&self) -> usize {
        self.0.as_ref().map_or(0, |p| p.num_permits())
    }

    /// Grows the share to at least `bytes`, waiting up to [`BUDGET_WAIT`].
    async fn grow_to(&mut self, budget: &Arc<Semaphore>, bytes: usize) -> Result<(), ApiError> {
        let missing = bytes.saturating_sub(self.size());
        if missing == 0 {
            return Ok(());
        }
        // Config validation keeps the whole budget, hence any share of it, within u32.
        let missing = u32::try_from(missing).map_err(|_| ApiError::Busy)?;
        let more = tokio::time::timeout(BUDGET_WAIT, budget.clone().acquire_many_owned(missing))
            .await
            .map_err(|_| ApiError::Busy)?
            .map_err(|_| ApiError::Busy)?;
        match &mut self.0 {
            Some(permit) => permit.merge(more),
            None => self.0 = Some(more),
        }
        Ok(())
    }
}

/// Reads a request body up to `server.max_body_bytes`: a declared or actual larger body is a
/// 413 with a JSON error, and nothing is buffered past the limit. A body that trickles in
/// slower than `server.request_timeout_secs` is a 408, so a slow client holds no handler.
///
/// Every byte held takes a permit of the global `server.max_buffered_bytes` budget first (the
/// whole declared `Content-Length` at once, else chunk by chunk), so many connections times
/// many HTTP/2 streams cannot buffer more than that together; a body that cannot get its
/// share in time is answered 503 `server_busy` + `Retry-After`.
pub async fn read_body(
    app: &App,
    body: Body,
    headers: &HeaderMap,
) -> Result<BufferedBody, ApiError> {
    let limit = app.settings.server.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::TooLarge(limit));
    }
    // Bounded by `limit` just above.
    let declared = declared.map_or(0, |len| len as usize);
    let timeout = app.settings.server.request_timeout;
    tokio::time::timeout(timeout, collect(&app.body_budget, body, limit, declared))
        .await
        .map_err(|_| ApiError::RequestTimeout(timeout.as_secs()))?
}

async fn collect(
    budget: &Arc<Semaphore>,
    mut body: Body,
    limit: usize,
    declared: usize,
) -> Result<BufferedBody, ApiError> {
    let mut share = Share::default();
    share.grow_to(budget, declared).await?;
    let mut bytes = Vec::with_capacity(declared);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::bad_request(
                ErrorCode::UnreadableBody,
                format!("cannot read the body: {e}"),
            )
        })?;
        // Trailers carry nothing the API reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = bytes.len() + data.len();
        if len > limit {
            return Err(ApiError::TooLarge(limit));
        }
        share.grow_to(budget, len).await?;
        bytes.extend_from_slice(&data);
    }
    Ok(BufferedBody {
        bytes,
        _share: share,
    })
}

/// Longest key a client chooses to make a request idempotent: `Idempotency-Key` and a
/// resend's `requestId`. Each is stored with what it claims, so it is bounded.
pub const MAX_KEY_LEN: usize = 256;

/// Text a client chooses as a key or a header value: 1 to `max` characters, visible ASCII
/// with inner spaces, none at either end (the document's `HEADER_TEXT` pattern).
pub fn is_visible_text(text: &str, max: usize) -> bool {
    let visible = text.bytes().all(|b| (b' '..=b'~').contains(&b));
    visible
        && !text.is_empty()
        && text.len() <= max
        && !text.starts_with(' ')
        && !text.ends_with(' ')
}

/// The 400 for text that is not [`is_visible_text`], naming it as `shown`.
pub fn not_visible_text(shown: &str, max: usize, code: ErrorCode) -> ApiError {
    ApiError::bad_request(
        code,
        format!("{shown} must be 1 to {max} visible ASCII characters"),
    )
}

/// A header holding text: trimmed (as HTTP allows), then [`is_visible_text`]. `None` for
/// anything else.
pub fn header_text(value: &HeaderValue, max: usize) -> Option<&str> {
    let text = value.to_str().ok()?.trim_matches([' ', '\t']);
    is_visible_text(text, max).then_some(text)
}

/// An optional header that, when present, must be [`header_text`] of at most `max` bytes; a
/// malformed one is a 400 with `code`, naming the header as `shown`.
pub fn optional_header(
    headers: &HeaderMap,
    name: &str,
    shown: &str,
    max: usize,
    code: ErrorCode,
) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get(name) else {
        return Ok(None);
    };
    header_text(value, max)
        .map(|text| Some(text.to_string()))
        .ok_or_else(|| not_visible_text(shown, max, code))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(sizes: &[usize]) -> Body {
        let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
            sizes.iter().map(|&n| Ok(vec![b'x'; n])).collect();
        Body::from_stream(futures::stream::iter(chunks))
    }

    #[tokio::test]
    async fn a_body_without_length_takes_its_share_chunk_by_chunk() {
        let budget = Arc::new(Semaphore::new(1000));
        let body = collect(&budget, chunked(&[400, 400]), 1000, 0)
            .await
            .unwrap();
        assert_eq!(body.len(), 800);
        assert_eq!(budget.available_permits(), 200, "held while the body lives");
        drop(body);
        assert_eq!(budget.available_permits(), 1000);
    }

    #[tokio::test]
    async fn a_body_that_outgrows_the_budget_is_busy_and_gives_its_share_back() {
        let budget = Arc::new(Semaphore::new(1000));
        let other = budget.clone().acquire_many_owned(500).await.unwrap();
        let result = collect(&budget, chunked(&[400, 400]), 1000, 0).await;
        assert!(matches!(result, Err(ApiError::Busy)), "{result:?}");
        assert_eq!(
            budget.available_permits(),
            500,
            "the first chunk's share is back"
        );
        drop(other);
        // A declared length is taken whole before a byte is read.
        let held = collect(&budget, chunked(&[10]), 1000, 900).await.unwrap();
        assert_eq!(budget.available_permits(), 100);
        drop(held);
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_too_large() {
        let budget = Arc::new(Semaphore::new(10_000));
        let result = collect(&budget, chunked(&[600, 600]), 1000, 0).await;
        assert!(
            matches!(result, Err(ApiError::TooLarge(1000))),
            "{result:?}"
        );
        assert_eq!(budget.available_permits(), 10_000);
    }
}
