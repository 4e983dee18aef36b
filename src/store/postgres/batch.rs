//! Group commit of accepts: concurrent accepts share one transaction and one commit, so a
//! busy process pays one WAL flush (and one round trip to a synchronous standby) per batch
//! rather than per request, as on SQLite (`store/sqlite/writer.rs`).
//!
//! Why it is built this way:
//!
//! - **No timer.** A worker takes whatever is queued the moment it is free: an accept alone
//!   runs at once, in a transaction of its own, as it would without batching; under load,
//!   what queued while the previous batches were committing goes in the next.
//! - **A few workers.** A batch runs its statements one after the other on one connection;
//!   [`ACCEPT_WORKERS`] batches run side by side on the pool, so one batch waiting for a lock (a key
//!   another process holds) does not hold up every accept. Their locks are taken in one order
//!   (`locks.rs`), so batches never deadlock each other.
//! - **Durable before any answer.** A caller hears its outcome only once the batch committed;
//!   when the batch fails, every caller of it hears the failure, and nothing of it was
//!   recorded (no dedupe key is burnt). One accept that fails alone (its savepoint rolled
//!   back, `accept.rs`) fails only its caller.
//! - **Bounded.** The queue holds [`QUEUE_CAPACITY`] accepts; past it a caller waits for
//!   room within the store timeout, then is answered `Unavailable` (a 503, the sender retries).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::accept::{Queued, accept_batch};
use super::connection::Database;
use super::days::Days;
use crate::clock::Millis;
use crate::store::lifecycle::Lifetimes;
use crate::store::{AcceptOutcome, AcceptRequest, StoreError};

/// Most accepts in one transaction: bounds how long a batch holds its locks, and how much a
/// batch-wide failure fails at once. At a few round trips each, a full batch stays well
/// within a store timeout.
const MAX_BATCH: usize = 64;
/// Batches that may run at once, each on its own pooled connection.
pub const ACCEPT_WORKERS: usize = 4;
/// Accepts waiting for a worker; past it callers wait for room (backpressure).
const QUEUE_CAPACITY: usize = 1024;

/// What the group-commit tests count.
#[derive(Default)]
struct Counts {
    /// Batches committed.
    commits: AtomicU64,
    /// Batches the server refused as sets, run one accept at a time.
    one_by_one: AtomicU64,
}

struct Job {
    queued: Queued,
    reply: oneshot::Sender<Result<AcceptOutcome, StoreError>>,
}

/// The store's handle on its batch workers, which stop once it is dropped (their queue closes).
pub(super) struct Batcher {
    queue: mpsc::Sender<Job>,
    counts: Arc<Counts>,
    timeout: Duration,
}

impl Batcher {
    /// Starts the workers on the current runtime.
    pub(super) fn start(db: Arc<Database>, days: Arc<Days>) -> Batcher {
        let (queue, jobs) = mpsc::channel(QUEUE_CAPACITY);
        let jobs = Arc::new(Mutex::new(jobs));
        let counts = Arc::new(Counts::default());
        let timeout = db.timeout();
        for _ in 0..ACCEPT_WORKERS {
            tokio::spawn(work(
                Arc::clone(&jobs),
                Arc::clone(&db),
                Arc::clone(&days),
                Arc::clone(&counts),
            ));
        }
        Batcher {
            queue,
            counts,
            timeout,
        }
    }

    /// Queues one accept and waits for its batch to commit.
    ///
    /// A caller that gives up (its future dropped, e.g. a client that hung up) before its
    /// batch starts is left out of it; one that gives up later may still see its accept
    /// committed, and its retry is then answered as a replay.
    pub(super) async fn accept(
        &self,
        req: AcceptRequest,
        now: Millis,
        lifetimes: Lifetimes,
    ) -> Result<AcceptOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            queued: Queued {
                req,
                now,
                lifetimes,
            },
            reply,
        };
        match tokio::time::timeout(self.timeout, self.queue.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(stopped()),
            Err(_) => {
                return Err(StoreError::Unavailable(format!(
                    "{QUEUE_CAPACITY} accepts are already waiting for PostgreSQL and none \
                     left the queue within {:?}",
                    self.timeout
                )));
            }
        }
        // One batch may be ahead of this one on its worker, and this one's own: each is
        // bounded by the store timeout (`Database::call`).
        match tokio::time::timeout(self.timeout * 2, answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err(stopped()),
            Err(_) => Err(StoreError::Unavailable(format!(
                "PostgreSQL did not commit the accept within {:?}; it may still commit",
                self.timeout * 2
            ))),
        }
    }

    pub(super) fn commits(&self) -> u64 {
        self.counts.commits.load(Ordering::Relaxed)
    }

    pub(super) fn one_by_one(&self) -> u64 {
        self.counts.one_by_one.load(Ordering::Relaxed)
    }
}

fn stopped() -> StoreError {
    StoreError::Unavailable("the PostgreSQL accept workers have stopped".to_string())
}

/// One worker: takes what is queued (up to [`MAX_BATCH`]), runs it as one transaction,
/// answers each caller; until the queue closes.
async fn work(
    jobs: Arc<Mutex<mpsc::Receiver<Job>>>,
    db: Arc<Database>,
    days: Arc<Days>,
    counts: Arc<Counts>,
) {
    loop {
        let mut batch = Vec::new();
        {
            let mut jobs = jobs.lock().await;
            match jobs.recv().await {
                Some(job) => batch.push(job),
                None => return,
            }
            while batch.len() < MAX_BATCH {
                match jobs.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
        }
        // Callers that gave up are left out: nothing is written for nobody.
        batch.retain(|job| !job.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let (queued, replies): (Vec<Queued>, Vec<_>) =
            batch.into_iter().map(|job| (job.queued, job.reply)).unzip();
        let days = Arc::clone(&days);
        let outcome = db
            .call(move |client| async move { accept_batch(client, &days, &queued).await }.boxed())
            .await;
        match outcome {
            Ok(committed) => {
                counts.commits.fetch_add(1, Ordering::Relaxed);
                if committed.one_by_one {
                    counts.one_by_one.fetch_add(1, Ordering::Relaxed);
                }
                for (reply, outcome) in replies.into_iter().zip(committed.outcomes) {
                    // A caller that gave up meanwhile hears nothing; its retry finds the record.
                    let _ = reply.send(outcome);
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.clone()));
                }
            }
        }
    }
}
