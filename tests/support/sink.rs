//! A real HTTP receiver on 127.0.0.1 that records every request and answers as told.

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

type Responder = dyn Fn(&Received, usize) -> Answer + Send + Sync;

struct Inner {
    received: Mutex<Vec<Received>>,
    responder: Box<Responder>,
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
        let inner = Arc::new(Inner {
            received: Mutex::new(Vec::new()),
            responder: Box::new(responder),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
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
        self.inner.received.lock().unwrap().len()
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
    };
    let index = {
        let mut all = inner.received.lock().unwrap();
        all.push(received.clone());
        all.len() - 1
    };
    let Answer {
        reply,
        content_type,
        body,
    } = (inner.responder)(&received, index);
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
