//! The wake-up across processes: a write that makes a message due now also sends
//! `pg_notify(CHANNEL, '')` in its transaction (so it fires only once committed), and every
//! store whose dispatcher runs holds one dedicated connection that `LISTEN`s on the channel
//! and turns each notification into a change of its [`WorkSignal`](crate::store::WorkSignal).
//!
//! Why it is built this way:
//!
//! - **A dedicated connection, not a pooled one.** `LISTEN` belongs to a session; a pooled
//!   connection is dropped after any failure and serves other calls in between. The listener
//!   only reads: it costs the server one idle session and no transactions.
//! - **Lost notifications are assumed.** A connection that drops (a restart, a failover,
//!   `pg_terminate_backend`) is opened again with backoff, and the moment it listens again
//!   counts as a wake: what was notified while it was gone is claimed then. The dispatcher's
//!   slow poll stays as the last bound.
//! - **The payload is empty.** PostgreSQL folds identical notifications of one transaction
//!   into one, so a group-committed batch of accepts (`batch.rs`) wakes each listener once.
//! - **Started lazily.** Only a store whose dispatcher asks for the signal opens the
//!   connection; stores opened by tools and tests that never dispatch do not.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;
use tokio_postgres::config::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::store::WorkSignal;

/// The channel writes notify and listeners listen on. Notifications are per database, so
/// deployments on other databases of one server never wake each other.
pub(super) const CHANNEL: &str = "callbackd_work";

/// The first wait before opening a lost listening connection again, doubled up to
/// [`MAX_BACKOFF`] while it keeps failing: a server that is down is not hammered.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How to open the listening connection: the pool's config and TLS (`connection.rs`), and
/// the bound on opening it and on `LISTEN`.
#[derive(Clone)]
pub(super) struct ListenConfig {
    pub config: Config,
    pub tls: MakeRustlsConnect,
    pub timeout: Duration,
    pub shown_url: String,
}

/// The running listener: its task ends when the store (which owns this) is dropped.
pub(super) struct Listener {
    signal: Arc<watch::Sender<u64>>,
    task: JoinHandle<()>,
}

impl Listener {
    /// Starts listening in a task of the current runtime.
    pub(super) fn start(config: ListenConfig) -> Listener {
        let signal = Arc::new(watch::Sender::new(0));
        let task = tokio::spawn(run(config, Arc::clone(&signal)));
        Listener { signal, task }
    }

    pub(super) fn subscribe(&self) -> WorkSignal {
        self.signal.subscribe()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Listens for as long as the task lives, opening the connection again after each loss.
async fn run(config: ListenConfig, signal: Arc<watch::Sender<u64>>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let lost = listen(&config, &signal, &mut backoff).await;
        tracing::warn!(store = %config.shown_url, error = %lost, retry_in = ?backoff,
            "the PostgreSQL wake-up connection is lost; other processes' work is found by polling until it is back");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn wake(signal: &watch::Sender<u64>) {
    signal.send_modify(|n| *n = n.wrapping_add(1));
}

/// Opens one connection, listens, and signals each notification until the connection is
/// lost; returns why. `backoff` goes back to its start once listening works.
async fn listen(
    config: &ListenConfig,
    signal: &watch::Sender<u64>,
    backoff: &mut Duration,
) -> String {
    let opened = tokio::time::timeout(config.timeout, config.config.connect(config.tls.clone()));
    let (client, mut connection) = match opened.await {
        Ok(Ok(opened)) => opened,
        Ok(Err(e)) => return e.to_string(),
        Err(_) => return format!("not opened within {:?}", config.timeout),
    };
    // The connection delivers notifications only to whoever polls it, so it is polled here,
    // also while `LISTEN` runs.
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let statement = format!("LISTEN {CHANNEL}");
    let listening = tokio::time::timeout(config.timeout, async {
        let listen = client.batch_execute(&statement);
        tokio::pin!(listen);
        loop {
            tokio::select! {
                done = &mut listen => return done.map_err(|e| e.to_string()),
                message = messages.next() => match message {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.to_string()),
                    None => return Err("the connection closed".to_string()),
                },
            }
        }
    });
    match listening.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return e,
        Err(_) => return format!("LISTEN did not answer within {:?}", config.timeout),
    }
    *backoff = MIN_BACKOFF;
    tracing::debug!(store = %config.shown_url, "listening for work of other processes");
    // Whatever was notified while no connection listened is claimed now.
    wake(signal);
    // No timeout on waiting: an idle session is the point. A peer that vanished is found by
    // TCP keepalives and `tcp_user_timeout` (`connection.rs`), which end the stream.
    loop {
        match messages.next().await {
            Some(Ok(AsyncMessage::Notification(_))) => wake(signal),
            Some(Ok(_)) => {}
            Some(Err(e)) => return e.to_string(),
            None => return "the connection closed".to_string(),
        }
    }
    // `client` lives until here: dropping it would end the session.
}
