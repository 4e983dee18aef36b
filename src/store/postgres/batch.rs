//! Group commit: concurrent writes of one kind share one transaction and one commit, so a
//! busy process pays one WAL flush (and one round trip to a synchronous standby) per batch
//! rather than per request, as on SQLite (`store/sqlite/writer.rs`). Accepts are batched
//! (`accept.rs`), and so are completions, the write every delivery ends with (`commands.rs`).
//!
//! Why it is built this way:
//!
//! - **No timer.** A worker takes whatever is queued the moment it is free: a write alone
//!   runs at once, in a transaction of its own, as it would without batching; under load,
//!   what queued while the previous batches were committing goes in the next.
//! - **A few workers.** A batch runs on one connection; [`WORKERS`] batches run side by side
//!   on the pool, so one batch waiting for a lock (a key another process holds) does not hold
//!   up every write. Their locks are taken in one order (`locks.rs`), so batches never
//!   deadlock each other.
//! - **Durable before any answer.** A caller hears its outcome only once the batch committed;
//!   when the batch fails, every caller of it hears the failure, and nothing of it was
//!   recorded (no dedupe key is burnt). A write that fails alone (the batch is run again one
//!   write at a time, `accept.rs`, `commands.rs`) fails only its caller.
//! - **Bounded.** The queue holds [`QUEUE_CAPACITY`] writes; past it a caller waits for room
//!   within the store timeout, then is answered `Unavailable` (a 503, the sender retries).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_postgres::Client;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::sync::{Mutex, mpsc, oneshot};

use super::connection::Database;
use super::days::Days;
use crate::store::StoreError;

/// Most writes in one transaction: bounds how long a batch holds its locks, and how much a
/// batch-wide failure fails at once. At a few round trips each, a full batch stays well
/// within a store timeout.
const MAX_BATCH: usize = 64;
/// Batches of one kind that may run at once, each on its own pooled connection. Two, not
/// more: a batch's own statements (begin, locks, read, writes, commit) cost the server about
/// as much as its messages do, so fewer, larger batches are cheaper per write (BENCHMARKS.md
/// measured 290 and 385 µs of server CPU per delivery with two, 395 µs with four), and a
/// second worker still runs while the first waits for a lock or its commit.
pub const WORKERS: usize = 2;
/// Writes waiting for a worker; past it callers wait for room (backpressure).
const QUEUE_CAPACITY: usize = 1024;

/// A committed batch: each write's own outcome, in order (a write that failed wrote
/// nothing, alone), and whether the batch had to be run one write at a time.
pub(super) struct Committed<O> {
    pub outcomes: Vec<Result<O, StoreError>>,
    pub one_by_one: bool,
}

/// Runs one batch in one transaction on `client` and commits it.
pub(super) type RunBatch<T, O> = for<'a> fn(
    &'a mut Client,
    &'a Days,
    &'a [T],
) -> BoxFuture<'a, Result<Committed<O>, StoreError>>;

/// What the group-commit tests count.
#[derive(Default)]
struct Counts {
    /// Batches committed.
    commits: AtomicU64,
    /// Batches the server refused as sets, run one accept at a time.
    one_by_one: AtomicU64,
}

struct Job<T, O> {
    write: T,
    reply: oneshot::Sender<Result<O, StoreError>>,
}

/// The store's handle on one kind's batch workers, which stop once it is dropped (their queue
/// closes).
pub(super) struct Batcher<T, O> {
    /// What the writes are, for errors: "accepts", "completions".
    what: &'static str,
    queue: mpsc::Sender<Job<T, O>>,
    counts: Arc<Counts>,
    timeout: Duration,
}

impl<T: Send + Sync + 'static, O: Send + 'static> Batcher<T, O> {
    /// Starts the workers on the current runtime.
    pub(super) fn start(
        what: &'static str,
        db: Arc<Database>,
        days: Arc<Days>,
        run: RunBatch<T, O>,
    ) -> Batcher<T, O> {
        let (queue, jobs) = mpsc::channel(QUEUE_CAPACITY);
        let jobs = Arc::new(Mutex::new(jobs));
        let counts = Arc::new(Counts::default());
        let timeout = db.timeout();
        for _ in 0..WORKERS {
            tokio::spawn(work(
                Arc::clone(&jobs),
                Arc::clone(&db),
                Arc::clone(&days),
                Arc::clone(&counts),
                run,
            ));
        }
        Batcher {
            what,
            queue,
            counts,
            timeout,
        }
    }

    /// Queues one write and waits for its batch to commit.
    ///
    /// A caller that gives up (its future dropped, e.g. a client that hung up) before its
    /// batch starts is left out of it; one that gives up later may still see its write
    /// committed (an accept's retry is then answered as a replay).
    pub(super) async fn submit(&self, write: T) -> Result<O, StoreError> {
        let (reply, answer) = oneshot::channel();
        let job = Job { write, reply };
        let what = self.what;
        match tokio::time::timeout(self.timeout, self.queue.send(job)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(stopped(what)),
            Err(_) => {
                return Err(StoreError::Unavailable(format!(
                    "{QUEUE_CAPACITY} {what} are already waiting for PostgreSQL and none \
                     left the queue within {:?}",
                    self.timeout
                )));
            }
        }
        // One batch may be ahead of this one on its worker, and this one's own: each is
        // bounded by the store timeout (`Database::call`).
        match tokio::time::timeout(self.timeout * 2, answer).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => Err(stopped(what)),
            Err(_) => Err(StoreError::Unavailable(format!(
                "PostgreSQL did not commit the batch of {what} within {:?}; it may still commit",
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

fn stopped(what: &str) -> StoreError {
    StoreError::Unavailable(format!("the PostgreSQL workers of {what} have stopped"))
}

/// One worker: takes what is queued (up to [`MAX_BATCH`]), runs it as one transaction,
/// answers each caller; until the queue closes.
async fn work<T: Send + Sync + 'static, O: Send + 'static>(
    jobs: Arc<Mutex<mpsc::Receiver<Job<T, O>>>>,
    db: Arc<Database>,
    days: Arc<Days>,
    counts: Arc<Counts>,
    run: RunBatch<T, O>,
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
        let (writes, replies): (Vec<T>, Vec<_>) =
            batch.into_iter().map(|job| (job.write, job.reply)).unzip();
        let days = Arc::clone(&days);
        let outcome = db
            .call(move |client| async move { run(client, &days, &writes).await }.boxed())
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
