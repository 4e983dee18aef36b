//! The HTTP accept loop. `axum::serve` has no header read timeout and no connection limit,
//! and a payment endpoint on the internet needs both: a slowloris client that trickles its
//! headers must be cut off, and a flood of idle connections must not cost unbounded memory.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// A client must send its request headers within this time.
    pub header_timeout: Duration,
    /// Connections served at once; further ones wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// After shutdown, how long open connections get to finish their requests.
    pub grace: Duration,
}

/// Serves `router` until `shutdown`, then stops accepting and lets open requests finish
/// within `limits.grace`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
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
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
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
        let service = TowerToHyperService::new(router.clone());
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the grace period; closing them");
    }
}
