//! A real HTTP receiver on 127.0.0.1 that records every request and answers as told.
//!
//! A reply can be held until the test opens a [`Gate`], so a test knows a delivery is still in
//! flight without guessing how long it takes. The sink also counts the requests it is holding
//! open and the highest number it ever held at once (a concurrency measure, not a rate).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone)]
pub struct Received {
    /// Path and query exactly as they arrived.
    pub uri: String,
    pub headers: HeaderMap,
    pub body: String,
    /// When it arrived (headers and body read).
    pub at: std::time::Instant,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).expect("sink got JSON")
    }
}

#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub retry_after: Option<String>,
    pub delay: Duration,
}

impl Reply {
    pub fn status(status: u16) -> Reply {
        Reply {
            status,
            retry_after: None,
            delay: Duration::ZERO,
        }
    }
}

/// A reply with a body, for tests that look at what the receiver answered.
#[derive(Debug, Clone)]
pub struct Answer {
    pub reply: Reply,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// Holds replies until opened; once open it stays open.
#[derive(Clone)]
pub struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Gate {
    pub fn new() -> Gate {
        Gate(Arc::new(tokio::sync::watch::channel(false).0))
    }

    pub fn open(&self) {
        self.0.send_replace(true);
    }

    pub async fn wait(&self) {
        let mut open = self.0.subscribe();
        let _ = open.wait_for(|o| *o).await;
    }
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

pub type ReplyFuture = Pin<Box<dyn Future<Output = Reply> + Send>>;
type AnswerFuture = Pin<Box<dyn Future<Output = Answer> + Send>>;
type Responder = dyn Fn(&Received, usize) -> AnswerFuture + Send + Sync;

struct Inner {
    received: Mutex<Vec<Received>>,
    /// False for [`Sink::start_unrecorded`]: `received` stays empty and `unrecorded` counts.
    record: bool,
    unrecorded: AtomicUsize,
    responder: Box<Responder>,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
}

/// Counts a request as in flight until its reply is sent or the client goes away.
struct InFlight<'a>(&'a Inner);

impl<'a> InFlight<'a> {
    fn enter(inner: &'a Inner) -> InFlight<'a> {
        let now = inner.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        inner.peak.fetch_max(now, Ordering::SeqCst);
        InFlight(inner)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
pub struct Sink {
    pub url: String,
    inner: Arc<Inner>,
}

impl Sink {
    /// A sink that answers 204 to everything.
    pub async fn ok() -> Sink {
        Sink::start(|_, _| Reply::status(204)).await
    }

    /// `responder(request, index)` decides each answer; index counts every request from 0.
    pub async fn start(
        responder: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static,
    ) -> Sink {
        Sink::answering(move |r, n| Answer {
            reply: responder(r, n),
            content_type: None,
            body: Vec::new(),
        })
        .await
    }

    /// Like [`Sink::start`], with a body and its content type in each answer.
    pub async fn answering(
        responder: impl Fn(&Received, usize) -> Answer + Send + Sync + 'static,
    ) -> Sink {
        Sink::serve(
            Box::new(move |r, n| {
                let answer = responder(r, n);
                Box::pin(async move { answer })
            }),
            true,
        )
        .await
    }

    /// Like [`Sink::start`], but keeps nothing of what arrives (`received()` stays empty,
    /// `count()` still counts): for a long run, such as the load bench's, whose responder
    /// keeps only what it measures, so the sink neither grows nor spends time copying.
    pub async fn start_unrecorded(
        responder: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static,
    ) -> Sink {
        Sink::serve(plain(responder), false).await
    }

    /// Like [`Sink::start`], but the answer is a future: it may wait for a [`Gate`].
    pub async fn start_async(
        responder: impl Fn(&Received, usize) -> ReplyFuture + Send + Sync + 'static,
    ) -> Sink {
        Sink::serve(
            Box::new(move |r, n| {
                let reply = responder(r, n);
                Box::pin(async move {
                    Answer {
                        reply: reply.await,
                        content_type: None,
                        body: Vec::new(),
                    }
                })
            }),
            true,
        )
        .await
    }

    /// Like [`Sink::start`], on a port chosen by the test (one that refused connections until
    /// now, say).
    pub async fn start_on(
        port: u16,
        responder: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static,
    ) -> Sink {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the chosen port is free");
        Sink::serve_on(listener, plain(responder), true).await
    }

    async fn serve(responder: Box<Responder>, record: bool) -> Sink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Sink::serve_on(listener, responder, record).await
    }

    async fn serve_on(
        listener: tokio::net::TcpListener,
        responder: Box<Responder>,
        record: bool,
    ) -> Sink {
        let inner = Arc::new(Inner {
            received: Mutex::new(Vec::new()),
            record,
            unrecorded: AtomicUsize::new(0),
            responder,
            in_flight: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        });
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(inner.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Sink { url, inner }
    }

    pub fn received(&self) -> Vec<Received> {
        self.inner.received.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        if self.inner.record {
            self.inner.received.lock().unwrap().len()
        } else {
            self.inner.unrecorded.load(Ordering::SeqCst)
        }
    }

    /// Requests whose reply has not been sent yet.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests this sink ever had open at once.
    pub fn peak_in_flight(&self) -> usize {
        self.inner.peak.load(Ordering::SeqCst)
    }
}

async fn handle(
    State(inner): State<Arc<Inner>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = Received {
        uri: uri.to_string(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
        at: std::time::Instant::now(),
    };
    let _in_flight = InFlight::enter(&inner);
    let index = if inner.record {
        let mut all = inner.received.lock().unwrap();
        all.push(received.clone());
        all.len() - 1
    } else {
        inner.unrecorded.fetch_add(1, Ordering::SeqCst)
    };
    let Answer {
        reply,
        content_type,
        body,
    } = (inner.responder)(&received, index).await;
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut response = (StatusCode::from_u16(reply.status).unwrap(), body).into_response();
    match content_type {
        Some(ct) => {
            response
                .headers_mut()
                .insert("content-type", ct.parse().unwrap());
        }
        None => {
            response.headers_mut().remove("content-type");
        }
    }
    if let Some(ra) = reply.retry_after {
        response
            .headers_mut()
            .insert("retry-after", ra.parse().unwrap());
    }
    response
}

/// A responder that answers `responder`'s reply with an empty body.
fn plain(responder: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) -> Box<Responder> {
    Box::new(move |r, n| {
        let answer = Answer {
            reply: responder(r, n),
            content_type: None,
            body: Vec::new(),
        };
        Box::pin(async move { answer })
    })
}
