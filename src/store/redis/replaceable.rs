//! A connection that is replaced once it stops answering.
//!
//! The redis crate reconnects only after errors it deems fatal, and a response timeout is not
//! one: a flow that a partition or a NAT dropped without a FIN or RST would fail every call
//! with a timeout until the kernel gave up on the socket, about 15 minutes, and a reply cut
//! mid-frame leaves one server's manager answering every later call with that parse error. So
//! a failure that says the connection itself may be broken opens a new connection beside it,
//! one at a time however many calls failed together (no stampede), and calls move to the new
//! one as soon as it answers. A failed attempt is tried again at the next such failure.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use redis::{RedisError, RedisResult};

type Open<C> = Box<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>;

/// Clones share the connection and its replacement.
pub(super) struct Replaceable<C> {
    shared: Arc<Shared<C>>,
}

impl<C> Clone for Replaceable<C> {
    fn clone(&self) -> Self {
        Replaceable {
            shared: self.shared.clone(),
        }
    }
}

struct Shared<C> {
    current: RwLock<C>,
    replacing: AtomicBool,
    /// How long opening the new connection may take.
    timeout: Duration,
    open: Open<C>,
    /// Which failures mean the connection may be broken.
    broken: fn(&RedisError) -> bool,
    what: &'static str,
}

impl<C: Clone + Send + Sync + 'static> Replaceable<C> {
    /// `first`, replaced by what `open` makes when a call fails in a way `broken` accepts.
    pub(super) fn new<F>(
        first: C,
        what: &'static str,
        timeout: Duration,
        broken: fn(&RedisError) -> bool,
        open: impl Fn() -> F + Send + Sync + 'static,
    ) -> Replaceable<C>
    where
        F: Future<Output = RedisResult<C>> + Send + 'static,
    {
        Replaceable {
            shared: Arc::new(Shared {
                current: RwLock::new(first),
                replacing: AtomicBool::new(false),
                timeout,
                open: Box::new(move || Box::pin(open())),
                broken,
                what,
            }),
        }
    }

    /// The connection to send a call on; give its reply to [`Replaceable::check`].
    pub(super) fn get(&self) -> C {
        self.shared
            .current
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    /// Starts the replacement when `reply` says the connection may be broken.
    pub(super) fn check<T>(&self, reply: &RedisResult<T>) {
        if let Err(e) = reply
            && (self.shared.broken)(e)
        {
            self.replace(e);
        }
    }

    fn replace(&self, cause: &RedisError) {
        if self.shared.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(error = %cause, "the {} connection failed: opening a new one", self.shared.what);
        let shared = self.shared.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(shared.timeout, (shared.open)()).await {
                Ok(Ok(fresh)) => {
                    *shared
                        .current
                        .write()
                        .unwrap_or_else(|poisoned| poisoned.into_inner()) = fresh;
                    tracing::info!("replaced the {} connection", shared.what);
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot replace the {} connection yet", shared.what)
                }
                Err(_) => tracing::warn!(
                    "cannot replace the {} connection yet: no answer within {:?}",
                    shared.what,
                    shared.timeout
                ),
            }
            shared.replacing.store(false, Ordering::Release);
        });
    }
}

/// One server's manager: no answer in time, a reply it cannot parse, an I/O error.
pub(super) fn broken_server_connection(e: &RedisError) -> bool {
    e.is_timeout() || matches!(e.kind(), redis::ErrorKind::Parse | redis::ErrorKind::Io)
}

/// A cluster's: no answer in time. The cluster client reconnects a node itself after a cut
/// reply or a dropped connection, but not after a silent one.
pub(super) fn broken_cluster_connection(e: &RedisError) -> bool {
    e.is_timeout()
}
