//! The group-commit engine: one thread owns the write connection and commits whatever is
//! queued in one transaction, each command in its own savepoint. It knows nothing of messages:
//! a command is any closure over the connection, and the only hook is the housekeeping run
//! before a batch (the expiry sweep, given by the store).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::clock::Millis;
use crate::store::StoreError;

/// Most commands committed in one transaction: bounds the latency a command queued last in a
/// burst waits for, and the work lost to a batch-wide failure.
const MAX_BATCH: usize = 512;
/// Commands waiting for the writer; past it callers wait to enqueue (backpressure) instead of
/// growing memory without bound.
const QUEUE_CAPACITY: usize = 4096;

/// Run first in every batch that carries a caller's time, with the latest of those times, in
/// a savepoint of its own: a failure is ignored (housekeeping is retried with the next batch).
pub(super) type Housekeeping = fn(&Connection, Millis) -> Result<(), StoreError>;

/// The store's handle on its writer thread.
pub(super) struct Writer {
    /// `None` only while dropping.
    commands: Option<mpsc::Sender<Box<dyn Job>>>,
    thread: Option<JoinHandle<()>>,
    /// Transactions committed (observability, and the group-commit tests).
    commits: Arc<AtomicU64>,
    /// Fault injection: holds the writer before its commits while armed.
    gate: Arc<CommitGate>,
    timeout: Duration,
}

fn writer_gone() -> StoreError {
    StoreError::Unavailable("the SQLite writer thread has stopped".into())
}

impl Writer {
    /// Starts the thread that owns `conn`. `timeout`: the longest a caller waits for an answer.
    pub(super) fn start(
        conn: Connection,
        timeout: Duration,
        housekeeping: Housekeeping,
    ) -> std::io::Result<Writer> {
        let commits = Arc::new(AtomicU64::new(0));
        let gate = Arc::new(CommitGate::default());
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let thread = {
            let commits = Arc::clone(&commits);
            let gate = Arc::clone(&gate);
            std::thread::Builder::new()
                .name("callbackd-sqlite-writer".into())
                .spawn(move || writer_loop(conn, rx, commits, gate, housekeeping))?
        };
        Ok(Writer {
            commands: Some(tx),
            thread: Some(thread),
            commits,
            gate,
            timeout,
        })
    }

    /// Sends one command to the writer and waits until it is committed (or failed). `now`,
    /// when the command has one, makes its batch run the housekeeping first.
    ///
    /// A caller that gives up (`timeout`, or its future is dropped, e.g. a client that hung
    /// up) withdraws a command the writer has not started: it never runs, so its failure
    /// means nothing was written. A command already started may still commit, like a Redis
    /// script whose reply nobody reads; the caller's retry then finds its effect.
    pub(super) async fn commit<T, F>(&self, now: Option<Millis>, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let commands = self.commands.as_ref().ok_or_else(writer_gone)?;
        let (reply, answer) = oneshot::channel();
        let ticket = Ticket::default();
        let job = Box::new(Op {
            now,
            op: Some(op),
            ticket: ticket.clone(),
            outcome: None,
            reply,
        });
        let _withdraw_if_dropped = ticket.withdraw_on_drop();
        let call = async {
            commands.send(job).await.map_err(|_| writer_gone())?;
            answer.await.map_err(|_| writer_gone())?
        };
        match tokio::time::timeout(self.timeout, call).await {
            Ok(outcome) => outcome,
            Err(_) if ticket.withdraw() => Err(StoreError::Unavailable(format!(
                "SQLite did not start the write within {:?}; it was withdrawn",
                self.timeout
            ))),
            Err(_) => Err(StoreError::Unavailable(format!(
                "SQLite did not commit within {:?}; the write may still commit",
                self.timeout
            ))),
        }
    }

    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Commands waiting for the writer (not counting the batch it is running).
    pub(super) fn queued(&self) -> usize {
        self.commands
            .as_ref()
            .map_or(0, |c| QUEUE_CAPACITY - c.capacity())
    }

    /// Holds the writer before each commit until the returned guard is dropped.
    pub(super) fn stall(&self) -> CommitStall {
        self.gate.arm();
        CommitStall {
            gate: Arc::clone(&self.gate),
        }
    }
}

impl Drop for Writer {
    /// Closes the command channel and waits for the writer to finish what was queued, so the
    /// connection is closed when the writer is gone. This blocks for at most one batch.
    fn drop(&mut self) {
        drop(self.commands.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Giving up on a write, and holding commits (fault injection)

const WAITING: u8 = 0;
const STARTED: u8 = 1;
const WITHDRAWN: u8 = 2;

/// Who decides a queued command's fate: the writer starts it, or its caller withdraws it,
/// whichever comes first. After a withdrawal the command never runs.
#[derive(Clone, Default)]
struct Ticket(Arc<AtomicU8>);

impl Ticket {
    /// The writer's side: true when the command may run.
    fn start(&self) -> bool {
        self.0
            .compare_exchange(WAITING, STARTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The caller's side: true when the command will never run.
    fn withdraw(&self) -> bool {
        match self
            .0
            .compare_exchange(WAITING, WITHDRAWN, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(state) => state == WITHDRAWN,
        }
    }

    fn withdraw_on_drop(&self) -> WithdrawOnDrop {
        WithdrawOnDrop(self.clone())
    }
}

/// Withdraws a command whose caller's future is dropped before the writer starts it. After
/// the answer came the command has started, so this does nothing.
struct WithdrawOnDrop(Ticket);

impl Drop for WithdrawOnDrop {
    fn drop(&mut self) {
        self.0.withdraw();
    }
}

/// Shared by the store and its writer thread; see `SqliteStore::stall_commits`.
#[derive(Default)]
struct CommitGate {
    armed: Mutex<bool>,
    resume: Condvar,
    /// True while the writer is held before a commit.
    holding: tokio::sync::watch::Sender<bool>,
}

impl CommitGate {
    fn arm(&self) {
        *self.armed.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }

    fn release(&self) {
        *self.armed.lock().unwrap_or_else(PoisonError::into_inner) = false;
        self.resume.notify_all();
    }

    /// Called by the writer before each commit: waits while the gate is armed.
    fn pass(&self) {
        let mut armed = self.armed.lock().unwrap_or_else(PoisonError::into_inner);
        if !*armed {
            return;
        }
        self.holding.send_replace(true);
        while *armed {
            armed = self
                .resume
                .wait(armed)
                .unwrap_or_else(PoisonError::into_inner);
        }
        self.holding.send_replace(false);
    }
}

/// Holds the SQLite writer before its commits until dropped.
pub struct CommitStall {
    gate: Arc<CommitGate>,
}

impl CommitStall {
    /// Waits until the writer is held before a commit (a batch has run, uncommitted).
    pub async fn holding(&self) {
        let mut holding = self.gate.holding.subscribe();
        let _ = holding.wait_for(|h| *h).await;
    }
}

impl Drop for CommitStall {
    fn drop(&mut self) {
        self.gate.release();
    }
}

// ---------------------------------------------------------------------------------------
// The writer thread: group commit

/// One write command, type-erased so different commands share one channel and one batch.
trait Job: Send {
    /// The caller's time, if the command has one (it drives the housekeeping).
    fn now(&self) -> Option<Millis>;
    /// Claims the command for running; false (and an error answer) when its caller has
    /// withdrawn it.
    fn begin(&mut self) -> bool;
    /// Runs the command inside the batch transaction; false when it failed.
    fn run(&mut self, conn: &Connection) -> bool;
    /// The command's effect did not commit: its answer becomes this error (a command that
    /// already failed keeps its own error).
    fn abort(&mut self, why: &str);
    fn reply(self: Box<Self>);
}

struct Op<T, F> {
    now: Option<Millis>,
    op: Option<F>,
    ticket: Ticket,
    outcome: Option<Result<T, StoreError>>,
    reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> Job for Op<T, F>
where
    T: Send,
    F: FnOnce(&Connection) -> Result<T, StoreError> + Send,
{
    fn now(&self) -> Option<Millis> {
        self.now
    }

    fn begin(&mut self) -> bool {
        let started = self.ticket.start();
        if !started {
            self.outcome = Some(Err(StoreError::Unavailable(
                "withdrawn by its caller before it ran".into(),
            )));
        }
        started
    }

    fn run(&mut self, conn: &Connection) -> bool {
        let outcome = match self.op.take() {
            // A bug in one command must not take the writer thread (and every later write)
            // down with it: the panic fails that command and its savepoint is rolled back.
            Some(op) => std::panic::catch_unwind(AssertUnwindSafe(|| op(conn)))
                .unwrap_or_else(|_| Err(StoreError::Unavailable("store command panicked".into()))),
            None => Err(StoreError::Unavailable("command ran twice".into())),
        };
        let ok = outcome.is_ok();
        self.outcome = Some(outcome);
        ok
    }

    fn abort(&mut self, why: &str) {
        if !matches!(self.outcome, Some(Err(_))) {
            self.outcome = Some(Err(StoreError::Unavailable(why.to_string())));
        }
    }

    fn reply(self: Box<Self>) {
        let outcome = self
            .outcome
            .unwrap_or_else(|| Err(StoreError::Unavailable("command was not run".into())));
        // The caller may be gone (a cancelled request); the effect stays committed.
        let _ = self.reply.send(outcome);
    }
}

fn writer_loop(
    conn: Connection,
    mut commands: mpsc::Receiver<Box<dyn Job>>,
    commits: Arc<AtomicU64>,
    gate: Arc<CommitGate>,
    housekeeping: Housekeeping,
) {
    // `blocking_recv` returns the queued commands after the store is dropped, then `None`:
    // nothing already sent is abandoned.
    while let Some(first) = commands.blocking_recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match commands.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        if run_batch(&conn, &mut batch, &gate, housekeeping) {
            commits.fetch_add(1, Ordering::Relaxed);
        }
        for job in batch {
            job.reply();
        }
    }
}

fn exec(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}

/// Runs a batch in one transaction; true when it committed. Every job ends with an outcome
/// that is either committed or an error.
fn run_batch(
    conn: &Connection,
    batch: &mut [Box<dyn Job>],
    gate: &CommitGate,
    housekeeping: Housekeeping,
) -> bool {
    let abort_all = |batch: &mut [Box<dyn Job>], why: &str| {
        for job in batch.iter_mut() {
            job.abort(why);
        }
    };
    if let Err(e) = exec(conn, "BEGIN IMMEDIATE") {
        abort_all(batch, &format!("cannot begin a transaction: {e}"));
        return false;
    }
    if let Some(now) = batch.iter().filter_map(|j| j.now()).max() {
        let done = in_savepoint(conn, |c| housekeeping(c, now));
        if !done
            && conn.is_autocommit()
            && let Err(e) = exec(conn, "BEGIN IMMEDIATE")
        {
            abort_all(batch, &format!("cannot begin a transaction: {e}"));
            return false;
        }
    }
    // Jobs from `first_live` on belong to the open transaction.
    let mut first_live = 0;
    for i in 0..batch.len() {
        let job = &mut batch[i];
        if !job.begin() {
            continue;
        }
        let ok = in_savepoint(conn, |c| if job.run(c) { Ok(()) } else { Err(()) });
        if !ok && conn.is_autocommit() {
            // SQLite rolled the whole transaction back (it may, on I/O or disk-full errors):
            // the commands before this one are lost with it. They fail (the callers retry);
            // the rest of the batch goes on in a new transaction.
            abort_all(
                &mut batch[first_live..i],
                "transaction rolled back after another command's I/O error",
            );
            batch[i].abort("transaction rolled back");
            first_live = i + 1;
            if let Err(e) = exec(conn, "BEGIN IMMEDIATE") {
                abort_all(
                    &mut batch[first_live..],
                    &format!("cannot begin a transaction: {e}"),
                );
                return false;
            }
        }
    }
    gate.pass();
    match exec(conn, "COMMIT") {
        Ok(()) => true,
        Err(e) => {
            if !conn.is_autocommit() {
                let _ = exec(conn, "ROLLBACK");
            }
            abort_all(&mut batch[first_live..], &format!("commit failed: {e}"));
            false
        }
    }
}

/// Runs `f` in a savepoint, rolled back to if `f` fails; true when `f` succeeded and its
/// effect is part of the transaction.
fn in_savepoint<E>(conn: &Connection, f: impl FnOnce(&Connection) -> Result<(), E>) -> bool {
    if exec(conn, "SAVEPOINT cmd").is_err() {
        return false;
    }
    match f(conn) {
        Ok(()) => exec(conn, "RELEASE cmd").is_ok(),
        Err(_) => {
            if !conn.is_autocommit() {
                let _ = exec(conn, "ROLLBACK TO cmd");
                let _ = exec(conn, "RELEASE cmd");
            }
            false
        }
    }
}
