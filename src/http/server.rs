//! The HTTP accept loop. `axum::serve` has no header read timeout and no connection limit,
//! and a payment endpoint on the internet needs both: a slowloris client that trickles its
//! headers must be cut off, and a flood of idle connections must not cost unbounded memory.
//!
//! A connection is idle when it has no request in flight, whatever frames still cross it: an
//! HTTP/2 client that only sends or answers PINGs (or SETTINGS, WINDOW_UPDATEs) holds a
//! connection slot, so idleness is judged by requests, not bytes, and such a connection is
//! closed after the same limit as a silent one.

use std::borrow::Borrow;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A client must send its request headers within this time, the first request's counted
    /// from the connection's accept.
    pub header_timeout: Duration,
    /// A connection with no request in flight for this long is closed, so one that never
    /// sends a byte, idles after a response, or only exchanges HTTP/2 PINGs cannot hold a
    /// slot forever.
    pub idle_timeout: Duration,
    /// Connections served at once; further ones wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// HTTP/2 streams (requests) open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS;
    /// a client opening more gets REFUSED_STREAM).
    pub max_streams_per_connection: u32,
    /// After shutdown, how long open connections get to finish their requests.
    pub grace: Duration,
}

/// Serves `router`. At `stop_accepting` the listener closes (when given by value; a borrowed
/// one is left open for its owner to serve on), so new connections are refused (a load
/// balancer moves on), while open connections are still served: on them `/readyz`
/// answers 503 and in-flight work completes. At `shutdown` open connections are asked to
/// close and get `limits.grace` to finish their requests; those still open then are dropped.
pub async fn serve(
    listener: impl Borrow<TcpListener>,
    router: Router,
    stop_accepting: CancellationToken,
    shutdown: CancellationToken,
    limits: Limits,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams_per_connection)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let connections = TaskTracker::new();
    let force_close = CancellationToken::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = stop_accepting.cancelled() => break,
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = stop_accepting.cancelled() => break,
            _ = shutdown.cancelled() => break,
            accepted = listener.borrow().accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        // Hyper's header timer starts only once the first bytes have told HTTP/1 from
        // HTTP/2, so a socket that never sends one would be held until the idle limit.
        let headers_due = Instant::now() + limits.header_timeout;
        let first_request = CancellationToken::new();
        let (in_flight, requests) = watch::channel(0usize);
        let service = Tracked {
            inner: TowerToHyperService::new(router.clone()),
            in_flight: Arc::new(in_flight),
            first_request: first_request.clone(),
        };
        let stream = IdleTimeout::new(stream, limits.idle_timeout);
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let shutdown = shutdown.clone();
        let force_close = force_close.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            let mut requests = requests;
            let mut closing = false;
            // After an idle close begins, an HTTP/2 client that never completes the GOAWAY
            // handshake must not keep the connection open past one more idle limit.
            let mut give_up: Option<Pin<Box<Sleep>>> = None;
            loop {
                tokio::select! {
                    result = connection.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    // Shutdown bounds the close with `grace`, then `force_close`.
                    _ = shutdown.cancelled(), if !closing => {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    _ = idle_for(&mut requests, limits.idle_timeout), if !closing => {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                        give_up = Some(Box::pin(tokio::time::sleep(limits.idle_timeout)));
                    }
                    _ = async {
                        match give_up.as_mut() {
                            Some(deadline) => deadline.await,
                            None => std::future::pending().await,
                        }
                    } => break,
                    _ = force_close.cancelled() => break,
                    () = no_request_by(&first_request, headers_due) => {
                        tracing::debug!("no request headers within the header timeout");
                        break;
                    }
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    connections.close();
    shutdown.cancelled().await;
    if tokio::time::timeout(limits.grace, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the grace period; closing them");
        force_close.cancel();
        connections.wait().await;
    }
}

/// Returns once no request has been in flight on the connection for `limit`. Every request
/// that starts or ends restarts the count.
async fn idle_for(requests: &mut watch::Receiver<usize>, limit: Duration) {
    loop {
        let busy = *requests.borrow_and_update() > 0;
        let changed = async {
            if requests.changed().await.is_err() {
                // The service is gone, so is the connection: its own future ends the loop.
                std::future::pending::<()>().await;
            }
        };
        if busy {
            changed.await;
        } else {
            tokio::select! {
                _ = tokio::time::sleep(limit) => return,
                _ = changed => {}
            }
        }
    }
}

/// Returns at `deadline` if the connection's first request has not arrived by then; never
/// once it has.
async fn no_request_by(first_request: &CancellationToken, deadline: Instant) {
    tokio::select! {
        biased;
        _ = first_request.cancelled() => std::future::pending::<()>().await,
        _ = tokio::time::sleep_until(deadline) => {}
    }
}

/// The router, counting the requests in flight on its connection for [`idle_for`], and
/// telling [`no_request_by`] that the first one came.
#[derive(Clone)]
struct Tracked {
    inner: TowerToHyperService<Router>,
    in_flight: Arc<watch::Sender<usize>>,
    first_request: CancellationToken,
}

/// Counts a request as in flight until its handler answers (or is dropped).
struct InFlight(Arc<watch::Sender<usize>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.in_flight.send_modify(|n| *n += 1);
        self.first_request.cancel();
        let guard = InFlight(self.in_flight.clone());
        let future = self.inner.call(req);
        Box::pin(async move {
            let response = future.await;
            drop(guard);
            response
        })
    }
}

/// Fails reads once the connection has been silent in both directions for `timeout`: the
/// backstop for a request stuck with a peer that neither sends nor reads.
struct IdleTimeout<S> {
    inner: S,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> IdleTimeout<S> {
    fn new(inner: S, timeout: Duration) -> IdleTimeout<S> {
        IdleTimeout {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    fn touch(&mut self) {
        self.deadline.as_mut().reset(Instant::now() + self.timeout);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(result) => {
                this.touch();
                Poll::Ready(result)
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection idle",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.inner).poll_write(cx, buf);
        if result.is_ready() {
            this.touch();
        }
        result
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
