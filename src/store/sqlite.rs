//! SQLite backend: the embedded default (ARCHITECTURE.md, "The store seam"), the same contract as the Redis one.
//!
//! Why one writer thread: SQLite allows one writer at a time, and every durable commit costs an
//! fsync (`synchronous=FULL`). A dedicated thread owns the write connection; async callers send
//! it commands over a bounded channel and wait on a oneshot. The thread drains whatever is
//! queued, runs it all in ONE transaction (each command inside its own savepoint, so a failing
//! command rolls back only itself), commits once, and only then replies to every caller. Under
//! load many accepts share one fsync (group commit); alone, a command costs one commit, as it
//! would anyway. Nothing is acknowledged before its commit: a 2xx still means durable.
//!
//! Reads (`get`, `list`, `depth`, `payment_status`) use a second connection: in WAL mode
//! readers see the last committed state without waiting for the writer. It sits behind a std
//! `Mutex` used only inside `spawn_blocking`, so no SQLite call ever blocks the async runtime.
//!
//! One process per database: the file is guarded by an OS lock on `<db>.lock`, held for the
//! life of the store, so a second callbackd on the same file fails at start-up instead of
//! two dispatchers delivering the same queue.
//!
//! State mirrors the Redis layout (see `redis.rs` and `lua/*.lua`, which define the
//! semantics), one table per Redis structure:
//!
//! | table | Redis | holds |
//! |---|---|---|
//! | `claims` | `d:<hash>` | dedupe claims with their expiry |
//! | `payments` | `pay:<hash>` | payment status for the compare-and-set, with its expiry |
//! | `messages` | `m:<id>`, `due`, `lease`, `ix*` | record, mutable state, `due_at` (the due zset), `lease_until` (the lease zset) |
//! | `queue` | `q:<hash>` | unfinished ids per ordering key in order; only the head is due |
//! | `attempts` | `a:<id>` | history rows (JSON), in order: the first and the latest 100 |
//! | `seals` | `s:<hash>` | signature seals: the first answer to a signature, while valid |
//! | `operations` | `cb:op:<hash>` | resend request ids |
//!
//! Where Redis expires keys in real time, rows carry `expires_at` computed from the caller's
//! `now`, are ignored once past it, and are deleted in bounded batches by the writer.

use crate::clock::Millis;
use std::fs::{self, File, TryLockError};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::types::Value as SqlValue;
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, params, params_from_iter};
use tokio::sync::{mpsc, oneshot};

use super::{
    AcceptOutcome, AcceptRequest, Attempt, Completion, DEFAULT_PAYMENT_RETENTION_SECS,
    HISTORY_TAIL, Lease, ListFilter, MessageId, MessageRecord, MessageState, NewMessage,
    OperationReservation, Page, QueueDepth, ResendEffect, SWEEP_LIMIT, Store, StoreError,
    matches_filter,
};

/// Schema migrations, applied in order; `PRAGMA user_version` is how many have run.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE claims (
    key         TEXT PRIMARY KEY NOT NULL,
    fingerprint TEXT NOT NULL,
    response    TEXT NOT NULL,
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX claims_by_expiry ON claims (expires_at);

CREATE TABLE payments (
    payment_id TEXT PRIMARY KEY NOT NULL,
    status     TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX payments_by_expiry ON payments (expires_at);

CREATE TABLE messages (
    id           TEXT PRIMARY KEY NOT NULL,
    rec          TEXT NOT NULL,
    source       TEXT,
    ordering_key TEXT NOT NULL,
    state        TEXT NOT NULL,
    tries        INTEGER NOT NULL DEFAULT 0,
    rb           INTEGER NOT NULL DEFAULT 0,
    lease        INTEGER NOT NULL DEFAULT 0,
    deadline     INTEGER NOT NULL,
    resume       INTEGER NOT NULL DEFAULT 0,
    again        INTEGER NOT NULL DEFAULT 0,
    due_at       INTEGER,
    lease_until  INTEGER,
    expires_at   INTEGER
);
CREATE INDEX messages_due ON messages (due_at, id) WHERE due_at IS NOT NULL;
CREATE INDEX messages_leased ON messages (lease_until) WHERE lease_until IS NOT NULL;
CREATE INDEX messages_expiry ON messages (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX messages_by_state ON messages (state, id);
CREATE INDEX messages_by_source ON messages (source, id) WHERE source IS NOT NULL;
CREATE INDEX messages_by_key ON messages (ordering_key, id);

CREATE TABLE queue (
    pos          INTEGER PRIMARY KEY,
    ordering_key TEXT NOT NULL,
    id           TEXT NOT NULL UNIQUE
);
CREATE INDEX queue_by_key ON queue (ordering_key, pos);

CREATE TABLE attempts (
    seq        INTEGER PRIMARY KEY,
    message_id TEXT NOT NULL,
    row        TEXT NOT NULL
);
CREATE INDEX attempts_by_message ON attempts (message_id, seq);

CREATE TABLE operations (
    key        TEXT PRIMARY KEY NOT NULL,
    response   TEXT,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX operations_by_expiry ON operations (expires_at);
"#,
    r#"
CREATE TABLE seals (
    key        TEXT PRIMARY KEY NOT NULL,
    response   TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX seals_by_expiry ON seals (expires_at);

ALTER TABLE messages ADD COLUMN history_total INTEGER NOT NULL DEFAULT 0;
UPDATE messages SET history_total =
    (SELECT count(*) FROM attempts WHERE attempts.message_id = messages.id);

-- Version 1 kept every row: keep the first and the latest 100 of each message.
DELETE FROM attempts WHERE seq IN (
    SELECT seq FROM (
        SELECT seq,
               row_number() OVER (PARTITION BY message_id ORDER BY seq) AS n,
               count(*) OVER (PARTITION BY message_id) AS total
        FROM attempts
    ) WHERE n > 1 AND n <= total - 100
);
"#,
];

/// Most commands committed in one transaction: bounds the latency a command queued last in a
/// burst waits for, and the work lost to a batch-wide failure.
const MAX_BATCH: usize = 512;
/// Commands waiting for the writer; past it callers wait to enqueue (backpressure) instead of
/// growing memory without bound.
const QUEUE_CAPACITY: usize = 4096;

/// Knobs of [`SqliteStore::open_with`]; [`SqliteStore::open`] uses the defaults.
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// How long a statement waits for a lock held by another connection (a checkpoint, the
    /// read connection) before failing.
    pub busy_timeout: Duration,
    /// Caps the database size in pages (`PRAGMA max_page_count`); writes past it fail as if the
    /// disk were full. `None` keeps SQLite's default. Used by tests to exercise disk-full.
    pub max_page_count: Option<u64>,
    /// Longest a caller waits for an answer (`store.timeout_ms`): past it the call fails with
    /// `Unavailable` (a 503) instead of hanging on a stuck disk. A command the writer had not
    /// started by then never runs; one it had started may still commit (a slow fsync), and
    /// then the sender's retry gets the stored answer as a replay. Never both, never neither.
    pub timeout: Duration,
    /// How long a payment's status outlives its last transition (raised to the retention if
    /// shorter).
    pub payment_retention_secs: u64,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            busy_timeout: Duration::from_secs(5),
            max_page_count: None,
            timeout: Duration::from_secs(5),
            payment_retention_secs: DEFAULT_PAYMENT_RETENTION_SECS,
        }
    }
}

pub struct SqliteStore {
    /// Commands to the writer thread; `None` only while dropping.
    writer: Option<mpsc::Sender<Box<dyn Job>>>,
    thread: Option<JoinHandle<()>>,
    /// Why a std `Mutex`: it is only locked inside `spawn_blocking`, never across an await.
    reader: Arc<Mutex<Connection>>,
    /// Transactions committed by the writer (observability, and the group-commit tests).
    commits: Arc<AtomicU64>,
    /// Fault injection: holds the writer before its commits while armed.
    stall: Arc<CommitGate>,
    /// How long finished messages and their history are kept.
    retention_ms: i64,
    payment_retention_ms: i64,
    timeout: Duration,
    path: PathBuf,
    /// Held until the store is gone. Declared last: fields drop after `Drop::drop` has joined
    /// the writer, so the lock is released only once the write connection is closed.
    _lock: File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------
// Errors

/// Maps SQLite failures onto the store's: a damaged file is `Corrupt`, anything else (disk
/// full, read-only file, I/O error, busy) is `Unavailable`. Both become a 503, never a 2xx.
fn db_error(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
            StoreError::Corrupt(e.to_string())
        }
        Some(_) => StoreError::Unavailable(e.to_string()),
        None => match e {
            rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
            | rusqlite::Error::InvalidColumnType(..) => StoreError::Corrupt(e.to_string()),
            other => StoreError::Unavailable(other.to_string()),
        },
    }
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// `?` on rusqlite results inside functions returning `StoreError`, without a crate-wide
/// `From` impl that would hide which backend an error came from.
trait Db<T> {
    fn db(self) -> Result<T, StoreError>;
}

impl<T> Db<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T, StoreError> {
        self.map_err(db_error)
    }
}

fn writer_gone() -> StoreError {
    StoreError::Unavailable("the SQLite writer thread has stopped".into())
}

// ---------------------------------------------------------------------------------------
// Opening

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, with default options.
    pub fn open(path: &Path, retention_secs: u64) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with(path, retention_secs, SqliteOptions::default())
    }

    pub fn open_with(
        path: &Path,
        retention_secs: u64,
        options: SqliteOptions,
    ) -> Result<SqliteStore, StoreError> {
        let unavailable =
            |what: &str, e: &dyn std::fmt::Display| StoreError::Unavailable(format!("{what}: {e}"));
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent).map_err(|e| {
                unavailable(&format!("cannot create directory {}", parent.display()), &e)
            })?;
        }
        let lock = lock_exclusively(path)?;

        let writer = Connection::open(path)
            .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
        configure(&writer, &options).map_err(|e| context(path, e))?;
        let retention_ms = secs_to_ms(retention_secs);
        let payment_retention_ms = secs_to_ms(options.payment_retention_secs.max(retention_secs));
        migrate(&writer, payment_retention_ms - retention_ms).map_err(|e| context(path, e))?;

        // Read-only: the reader can never write by mistake.
        let reader = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
        reader
            .busy_timeout(options.busy_timeout)
            .map_err(|e| context(path, db_error(e)))?;

        let commits = Arc::new(AtomicU64::new(0));
        let stall = Arc::new(CommitGate::default());
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let thread = {
            let commits = Arc::clone(&commits);
            let stall = Arc::clone(&stall);
            std::thread::Builder::new()
                .name("callbackd-sqlite-writer".into())
                .spawn(move || writer_loop(writer, rx, commits, stall))
                .map_err(|e| unavailable("cannot start the SQLite writer thread", &e))?
        };
        Ok(SqliteStore {
            writer: Some(tx),
            thread: Some(thread),
            reader: Arc::new(Mutex::new(reader)),
            commits,
            stall,
            retention_ms,
            payment_retention_ms,
            timeout: options.timeout,
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Transactions committed so far by the writer.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Changes `PRAGMA max_page_count` of the write connection and returns the value now in
    /// force (SQLite never sets it below the current size). A fault-injection hook: a cap at
    /// the current size makes the next growing write fail as on a full disk.
    pub async fn set_max_page_count(&self, pages: u64) -> Result<u64, StoreError> {
        let pages = i64::try_from(pages).unwrap_or(i64::MAX);
        self.write(None, move |conn| {
            conn.pragma_update_and_check(None, "max_page_count", pages, |r| r.get::<_, i64>(0))
                .db()
                .map(|n| n.max(0) as u64)
        })
        .await
    }

    /// Fault injection, for tests and drills: until the returned guard is dropped, the writer
    /// stops before each commit, as on a disk whose fsync hangs. The commands of the held
    /// batch have run but are not committed; later commands wait in the queue.
    pub fn stall_commits(&self) -> CommitStall {
        self.stall.arm();
        CommitStall {
            gate: Arc::clone(&self.stall),
        }
    }

    /// Commands waiting for the writer (not counting the batch it is running).
    pub fn queued(&self) -> usize {
        self.writer
            .as_ref()
            .map_or(0, |w| QUEUE_CAPACITY - w.capacity())
    }

    /// Sends one command to the writer and waits until it is committed (or failed).
    ///
    /// A caller that gives up (`timeout`, or its future is dropped, e.g. a client that hung
    /// up) withdraws a command the writer has not started: it never runs, so its failure
    /// means nothing was written. A command already started may still commit, like a Redis
    /// script whose reply nobody reads; the caller's retry then finds its effect.
    async fn write<T, F>(&self, now: Option<Millis>, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let writer = self.writer.as_ref().ok_or_else(writer_gone)?;
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
            writer.send(job).await.map_err(|_| writer_gone())?;
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

    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Unavailable(format!(
                    "SQLite did not answer within {:?}",
                    self.timeout
                )))
            })
    }

    /// Runs a read on the read connection, off the async runtime.
    async fn read<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let reader = Arc::clone(&self.reader);
        let task = tokio::task::spawn_blocking(move || {
            // A panic while the lock was held left no transaction open (statements and
            // transactions roll back when dropped during unwinding), so the connection is
            // still sound: take it back rather than failing every later read.
            let conn = reader.lock().unwrap_or_else(PoisonError::into_inner);
            op(&conn)
        });
        self.bounded(async {
            task.await
                .map_err(|e| StoreError::Unavailable(format!("SQLite read task failed: {e}")))?
        })
        .await
    }
}

impl Drop for SqliteStore {
    /// Closes the command channel and waits for the writer to finish what was queued, so the
    /// database is closed and the lock released when the store is gone (a reopen right after
    /// a drop must not find its own lock). This blocks for at most one batch.
    fn drop(&mut self) {
        drop(self.writer.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn context(path: &Path, e: StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => {
            StoreError::Unavailable(format!("SQLite database {}: {m}", path.display()))
        }
        StoreError::Corrupt(m) => {
            StoreError::Corrupt(format!("SQLite database {}: {m}", path.display()))
        }
    }
}

/// Takes an exclusive OS lock on `<db>.lock`. Why a side file and not SQLite's own
/// `locking_mode=EXCLUSIVE`: the latter would also shut out our own read connection. The
/// lock is per open file, so it also refuses a second store in the same process.
fn lock_exclusively(path: &Path) -> Result<File, StoreError> {
    let mut lock_path = path.as_os_str().to_owned();
    lock_path.push(".lock");
    let lock_path = PathBuf::from(lock_path);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| {
            StoreError::Unavailable(format!(
                "cannot create lock file {}: {e}",
                lock_path.display()
            ))
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Unavailable(format!(
            "another callbackd process has the database {} open (lock file {} is held); \
             only one process may use a SQLite store",
            path.display(),
            lock_path.display()
        ))),
        Err(TryLockError::Error(e)) => Err(StoreError::Unavailable(format!(
            "cannot lock {}: {e}",
            lock_path.display()
        ))),
    }
}

fn configure(conn: &Connection, options: &SqliteOptions) -> Result<(), StoreError> {
    conn.busy_timeout(options.busy_timeout).db()?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))
        .db()?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Unavailable(format!(
            "WAL journal mode unavailable (got `{mode}`): the file system may not support it"
        )));
    }
    // FULL: a commit is on disk (WAL fsynced) before `accept` answers, so a 2xx is durable
    // even across a power loss, not only a process crash.
    conn.pragma_update(None, "synchronous", "FULL").db()?;
    if let Some(pages) = options.max_page_count {
        let pages = i64::try_from(pages).unwrap_or(i64::MAX);
        conn.pragma_update(None, "max_page_count", pages).db()?;
    }
    Ok(())
}

/// Brings the schema to the latest version, each migration in its own transaction.
/// `payment_extension_ms`: how much longer payment states live now than in version 1, where
/// they expired with the dedupe claims.
fn migrate(conn: &Connection, payment_extension_ms: i64) -> Result<(), StoreError> {
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .db()?;
    let latest = MIGRATIONS.len() as i64;
    if version > latest {
        return Err(StoreError::Unavailable(format!(
            "schema version {version} is newer than this callbackd understands ({latest}); \
             run a newer callbackd"
        )));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version.max(0) as usize) {
        let tx = conn.unchecked_transaction().db()?;
        tx.execute_batch(sql).db()?;
        if i == 1 {
            tx.execute(
                "UPDATE payments SET expires_at = expires_at + ?1",
                params![payment_extension_ms],
            )
            .db()?;
        }
        tx.pragma_update(None, "user_version", i as i64 + 1).db()?;
        tx.commit().db()?;
    }
    Ok(())
}

fn secs_to_ms(secs: u64) -> i64 {
    i64::try_from(secs).unwrap_or(i64::MAX).saturating_mul(1000)
}

/// Wall-clock milliseconds, used only for the expiry of operation reservations: those
/// methods get no `now` from their caller (Redis uses its own clock for them too).
fn wall_clock_ms() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
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

/// Shared by the store and its writer thread; see [`SqliteStore::stall_commits`].
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
// The writer: group commit

/// One write command, type-erased so different commands share one channel and one batch.
trait Job: Send {
    /// The caller's time, if the command has one (it drives the expiry sweep).
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
    stall: Arc<CommitGate>,
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
        if run_batch(&conn, &mut batch, &stall) {
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
fn run_batch(conn: &Connection, batch: &mut [Box<dyn Job>], stall: &CommitGate) -> bool {
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
        // Housekeeping only: a failed sweep is retried with the next batch.
        let swept = in_savepoint(conn, |c| sweep(c, now).map(|_| ()).db());
        if !swept
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
    stall.pass();
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

/// Deletes up to [`SWEEP_LIMIT`] expired rows of each kind. `now` is the latest caller time
/// of the batch; operation reservations expire on the wall clock they were set with.
fn sweep(conn: &Connection, now: Millis) -> rusqlite::Result<usize> {
    let mut deleted = 0;
    for (sql, at) in [
        (
            "DELETE FROM claims WHERE key IN \
             (SELECT key FROM claims WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM payments WHERE payment_id IN \
             (SELECT payment_id FROM payments WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM seals WHERE key IN \
             (SELECT key FROM seals WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM operations WHERE key IN \
             (SELECT key FROM operations WHERE expires_at <= ?1 LIMIT ?2)",
            wall_clock_ms(),
        ),
        // History first, then the messages: the same subquery picks the same rows twice.
        (
            "DELETE FROM attempts WHERE message_id IN \
             (SELECT id FROM messages WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM messages WHERE id IN \
             (SELECT id FROM messages WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
            now,
        ),
    ] {
        deleted += conn
            .prepare_cached(sql)?
            .execute(params![at, SWEEP_LIMIT as i64])?;
    }
    Ok(deleted)
}

// ---------------------------------------------------------------------------------------
// Commands (each runs inside the writer's transaction; see the Lua script of the same name)

/// Remembers a signature's first answer until the signature could no longer be accepted.
fn seal(conn: &Connection, req: &AcceptRequest, response: &str) -> Result<(), StoreError> {
    if let Some(seal) = &req.seal {
        conn.prepare_cached(
            "INSERT OR REPLACE INTO seals (key, response, expires_at) VALUES (?1, ?2, ?3)",
        )
        .db()?
        .execute(params![seal.key, response, seal.expires_at])
        .db()?;
    }
    Ok(())
}

/// accept.lua
fn accept_tx(
    conn: &Connection,
    req: &AcceptRequest,
    now: Millis,
    payment_retention_ms: i64,
) -> Result<AcceptOutcome, StoreError> {
    if let Some(seal) = &req.seal {
        let first: Option<String> = conn
            .prepare_cached("SELECT response FROM seals WHERE key = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![seal.key, now], |r| r.get(0))
            .optional()
            .db()?;
        if let Some(response) = first {
            return Ok(AcceptOutcome::Replayed { response });
        }
    }
    let claim = &req.dedupe;
    let existing: Option<(String, String)> = conn
        .prepare_cached(
            "SELECT fingerprint, response FROM claims WHERE key = ?1 AND expires_at > ?2",
        )
        .db()?
        .query_row(params![claim.key, now], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()
        .db()?;
    if let Some((fingerprint, response)) = existing {
        if fingerprint != claim.fingerprint {
            return Ok(AcceptOutcome::Conflict);
        }
        seal(conn, req, &response)?;
        return Ok(AcceptOutcome::Replayed { response });
    }
    let expires_at = now.saturating_add(secs_to_ms(claim.ttl_secs));
    if let Some(p) = req.payment.as_ref().filter(|p| !p.to.is_empty()) {
        let current: String = conn
            .prepare_cached("SELECT status FROM payments WHERE payment_id = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![p.payment_id, now], |r| r.get(0))
            .optional()
            .db()?
            .unwrap_or_else(|| "undefined".to_string());
        if !p.allowed_from.contains(&current) {
            return Ok(AcceptOutcome::InvalidTransition { from: current });
        }
        conn.prepare_cached(
            "INSERT INTO payments (payment_id, status, expires_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT (payment_id) DO UPDATE SET status = excluded.status, \
             expires_at = excluded.expires_at",
        )
        .db()?
        .execute(params![
            p.payment_id,
            p.to,
            now.saturating_add(payment_retention_ms)
        ])
        .db()?;
    }
    // REPLACE: an expired claim of the same key may still be there, not yet swept.
    conn.prepare_cached(
        "INSERT OR REPLACE INTO claims (key, fingerprint, response, expires_at) \
         VALUES (?1, ?2, ?3, ?4)",
    )
    .db()?
    .execute(params![
        claim.key,
        claim.fingerprint,
        claim.response,
        expires_at
    ])
    .db()?;
    seal(conn, req, &claim.response)?;

    let msg = &req.message;
    let pending = msg.target_url.is_some();
    let state = if pending {
        MessageState::Pending
    } else {
        MessageState::Recorded
    };
    let rec = serde_json::to_string(msg).map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT INTO messages (id, rec, source, ordering_key, state, deadline, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .db()?
    .execute(params![
        msg.id.as_str(),
        rec,
        msg.source,
        msg.ordering_key,
        state.as_str(),
        msg.deadline,
        // A recorded message has nothing left to do: it is kept as long as its claim.
        (!pending).then_some(expires_at),
    ])
    .db()?;
    if pending {
        push_to_queue(conn, &msg.ordering_key, msg.id.as_str(), now)?;
    }
    Ok(AcceptOutcome::Accepted)
}

/// Appends a message to its ordering queue; alone there, it is the head and due at `now`.
fn push_to_queue(
    conn: &Connection,
    ordering_key: &str,
    id: &str,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT INTO queue (ordering_key, id) VALUES (?1, ?2)")
        .db()?
        .execute(params![ordering_key, id])
        .db()?;
    let others: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM queue WHERE ordering_key = ?1 AND id <> ?2)")
        .db()?
        .query_row(params![ordering_key, id], |r| r.get(0))
        .db()?;
    if !others {
        conn.prepare_cached("UPDATE messages SET due_at = ?2 WHERE id = ?1")
            .db()?
            .execute(params![id, now])
            .db()?;
    }
    Ok(())
}

/// claim.lua
fn claim_tx(
    conn: &Connection,
    now: Millis,
    limit: usize,
    lease_ms: u64,
) -> Result<Vec<Lease>, StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let lease_until = now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    // Expired leases (their worker died) are due again, now. They stay `in_flight` until
    // re-leased: the old worker may still finish them with its token, as on Redis.
    conn.prepare_cached(
        "UPDATE messages SET due_at = ?1, lease_until = NULL WHERE id IN \
         (SELECT id FROM messages WHERE lease_until <= ?1 ORDER BY lease_until LIMIT ?2)",
    )
    .db()?
    .execute(params![now, limit])
    .db()?;
    let rows: Vec<(String, String, u32, u32, Millis, i64)> = conn
        .prepare_cached(
            "SELECT id, rec, tries, rb, deadline, lease FROM messages \
             WHERE due_at <= ?1 ORDER BY due_at, id LIMIT ?2",
        )
        .db()?
        .query_map(params![now, limit], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    let mut lease = conn
        .prepare_cached(
            "UPDATE messages SET lease = ?2, state = 'in_flight', due_at = NULL, \
             lease_until = ?3 WHERE id = ?1",
        )
        .db()?;
    let mut claimed = Vec::with_capacity(rows.len());
    for (id, rec, tries, rb, deadline, token) in rows {
        let token = token.saturating_add(1);
        lease.execute(params![id, token, lease_until]).db()?;
        let message: NewMessage = serde_json::from_str(&rec).map_err(corrupt)?;
        claimed.push(Lease {
            message,
            token: u64::try_from(token).map_err(corrupt)?,
            attempts: tries,
            backoff_step: tries.saturating_sub(rb),
            deadline,
        });
    }
    Ok(claimed)
}

/// The mutable state `complete`, `release` and `resend` look at.
struct Current {
    state: String,
    /// Lease token (SQLite integers are signed; tokens start at 1 and only grow).
    lease: i64,
    resume: Millis,
    again: bool,
    tries: i64,
    due_at: Option<Millis>,
    ordering_key: String,
}

fn current(conn: &Connection, id: &str) -> Result<Option<Current>, StoreError> {
    conn.prepare_cached(
        "SELECT state, lease, resume, again, tries, due_at, ordering_key \
         FROM messages WHERE id = ?1",
    )
    .db()?
    .query_row(params![id], |r| {
        Ok(Current {
            state: r.get(0)?,
            lease: r.get(1)?,
            resume: r.get(2)?,
            again: r.get(3)?,
            tries: r.get(4)?,
            due_at: r.get(5)?,
            ordering_key: r.get(6)?,
        })
    })
    .optional()
    .db()
}

/// Appends a history row, keeping the first row and the latest [`HISTORY_TAIL`] (history.lua).
fn record_history(conn: &Connection, id: &str, row: &str) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT INTO attempts (message_id, row) VALUES (?1, ?2)")
        .db()?
        .execute(params![id, row])
        .db()?;
    conn.prepare_cached("UPDATE messages SET history_total = history_total + 1 WHERE id = ?1")
        .db()?
        .execute(params![id])
        .db()?;
    conn.prepare_cached(
        "DELETE FROM attempts WHERE seq IN (SELECT seq FROM attempts WHERE message_id = ?1 \
         ORDER BY seq LIMIT 1 OFFSET 1) \
         AND (SELECT count(*) FROM attempts WHERE message_id = ?1) > ?2",
    )
    .db()?
    .execute(params![id, HISTORY_TAIL as i64 + 1])
    .db()
    .map(|_| ())
}

/// complete.lua
fn complete_tx(
    conn: &Connection,
    claimed: &Lease,
    attempt: &str,
    completion: Completion,
    now: Millis,
    retention_ms: i64,
) -> Result<bool, StoreError> {
    let id = claimed.message.id.as_str();
    let Some(cur) = current(conn, id)? else {
        return Ok(false);
    };
    if cur.state != MessageState::InFlight.as_str()
        || u64::try_from(cur.lease).ok() != Some(claimed.token)
    {
        return Ok(false);
    }
    record_history(conn, id, attempt)?;
    let stays_queued = match completion {
        // An operator's resend brought this attempt forward: the automatic schedule resumes
        // where it was, neither shortened nor pushed back (unless that time has passed).
        Completion::Retry { .. } if cur.resume != 0 && cur.resume >= now => Some(cur.resume),
        Completion::Retry { next_at } => Some(next_at),
        // A resend arrived while this attempt was in flight: deliver once more, now, even if
        // this attempt ended the message (the resend gave it a fresh window).
        Completion::Delivered | Completion::Dead if cur.again => Some(now),
        Completion::Delivered | Completion::Dead => None,
    };
    if let Some(next_at) = stays_queued {
        conn.prepare_cached(
            "UPDATE messages SET tries = tries + 1, state = 'pending', resume = 0, again = 0, \
             due_at = ?2, lease_until = NULL WHERE id = ?1",
        )
        .db()?
        .execute(params![id, next_at])
        .db()?;
        return Ok(true);
    }
    let state = match completion {
        Completion::Dead => MessageState::Dead,
        _ => MessageState::Delivered,
    };
    conn.prepare_cached(
        "UPDATE messages SET tries = tries + 1, state = ?2, resume = 0, again = 0, \
         due_at = NULL, lease_until = NULL, expires_at = ?3 WHERE id = ?1",
    )
    .db()?
    .execute(params![
        id,
        state.as_str(),
        now.saturating_add(retention_ms)
    ])
    .db()?;
    conn.prepare_cached("DELETE FROM queue WHERE id = ?1")
        .db()?
        .execute(params![id])
        .db()?;
    // The next message of the same key becomes the head, due now.
    conn.prepare_cached(
        "UPDATE messages SET due_at = ?2 WHERE id = \
         (SELECT id FROM queue WHERE ordering_key = ?1 ORDER BY pos LIMIT 1)",
    )
    .db()?
    .execute(params![cur.ordering_key, now])
    .db()?;
    Ok(true)
}

/// release.lua
fn release_tx(conn: &Connection, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
    let id = claimed.message.id.as_str();
    let Some(cur) = current(conn, id)? else {
        return Ok(false);
    };
    if cur.state != MessageState::InFlight.as_str()
        || u64::try_from(cur.lease).ok() != Some(claimed.token)
    {
        return Ok(false);
    }
    conn.prepare_cached(
        "UPDATE messages SET state = 'pending', due_at = ?2, lease_until = NULL WHERE id = ?1",
    )
    .db()?
    .execute(params![id, next_at])
    .db()?;
    Ok(true)
}

/// resend.lua
fn resend_tx(
    conn: &Connection,
    id: &str,
    mark: &str,
    fresh_deadline: Millis,
    now: Millis,
) -> Result<ResendEffect, StoreError> {
    let Some(cur) = current(conn, id)? else {
        return Ok(ResendEffect::Skipped);
    };
    let state = MessageState::parse(&cur.state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{}`", cur.state)))?;
    if state == MessageState::Recorded {
        return Ok(ResendEffect::Skipped);
    }
    record_history(conn, id, mark)?;
    match state {
        MessageState::Delivered | MessageState::Dead => {
            // A fresh window, and the backoff starts over (`backoff_step = tries - rb`).
            conn.prepare_cached(
                "UPDATE messages SET state = 'pending', deadline = ?2, rb = ?3, \
                 expires_at = NULL WHERE id = ?1",
            )
            .db()?
            .execute(params![id, fresh_deadline, cur.tries])
            .db()?;
            push_to_queue(conn, &cur.ordering_key, id, now)?;
            Ok(ResendEffect::Requeued)
        }
        MessageState::Pending => match cur.due_at {
            None => Ok(ResendEffect::Queued),
            Some(due) if due > now => {
                // Remember the original time (only the first time) so a failed expedited
                // attempt does not pull the rest of the schedule forward.
                let resume = if cur.resume == 0 { due } else { cur.resume };
                conn.prepare_cached("UPDATE messages SET due_at = ?2, resume = ?3 WHERE id = ?1")
                    .db()?
                    .execute(params![id, now, resume])
                    .db()?;
                Ok(ResendEffect::Expedited)
            }
            Some(_) => Ok(ResendEffect::Expedited),
        },
        MessageState::InFlight => {
            conn.prepare_cached("UPDATE messages SET again = 1, deadline = ?2 WHERE id = ?1")
                .db()?
                .execute(params![id, fresh_deadline])
                .db()?;
            Ok(ResendEffect::AfterCurrent)
        }
        MessageState::Recorded => Ok(ResendEffect::Skipped),
    }
}

fn reserve_tx(
    conn: &Connection,
    key: &str,
    fingerprint: &str,
    ttl_secs: u64,
) -> Result<OperationReservation, StoreError> {
    let now = wall_clock_ms();
    let existing: Option<Option<String>> = conn
        .prepare_cached("SELECT response FROM operations WHERE key = ?1 AND expires_at > ?2")
        .db()?
        .query_row(params![key, now], |r| r.get(0))
        .optional()
        .db()?;
    match existing {
        Some(Some(stored)) => Ok(super::decode_operation(&stored, fingerprint)),
        // A reservation written before fingerprints were stored.
        Some(None) => Ok(OperationReservation::InProgress),
        None => {
            conn.prepare_cached(
                "INSERT OR REPLACE INTO operations (key, response, expires_at) \
                 VALUES (?1, ?2, ?3)",
            )
            .db()?
            .execute(params![
                key,
                super::encode_running_operation(fingerprint),
                now.saturating_add(secs_to_ms(ttl_secs))
            ])
            .db()?;
            Ok(OperationReservation::Fresh)
        }
    }
}

// ---------------------------------------------------------------------------------------
// Reads

const RECORD_COLUMNS: &str = "id, rec, state, deadline, due_at, history_total, tries";

/// A record from a row of [`RECORD_COLUMNS`]; its history only when a connection is given
/// (list pages never load histories).
fn record_from_row(
    conn: Option<&Connection>,
    row: &rusqlite::Row<'_>,
) -> Result<MessageRecord, StoreError> {
    let id: String = row.get(0).db()?;
    let rec: String = row.get(1).db()?;
    let state: String = row.get(2).db()?;
    let message: NewMessage = serde_json::from_str(&rec).map_err(corrupt)?;
    let state = MessageState::parse(&state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{state}`")))?;
    Ok(MessageRecord {
        message,
        state,
        deadline: row.get(3).db()?,
        next_attempt_at: row.get(4).db()?,
        history: match conn {
            Some(conn) => history(conn, &id)?,
            None => Vec::new(),
        },
        history_total: row.get::<_, i64>(5).db()?.max(0) as u64,
        delivery_attempts: row.get(6).db()?,
    })
}

fn history(conn: &Connection, id: &str) -> Result<Vec<Attempt>, StoreError> {
    let rows: Vec<String> = conn
        .prepare_cached("SELECT row FROM attempts WHERE message_id = ?1 ORDER BY seq")
        .db()?
        .query_map(params![id], |r| r.get(0))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    rows.iter()
        .map(|row| serde_json::from_str(row).map_err(corrupt))
        .collect()
}

fn get_tx(conn: &Connection, id: &str) -> Result<Option<MessageRecord>, StoreError> {
    // One read transaction: the record and its history come from the same commit.
    let tx = conn.unchecked_transaction().db()?;
    let mut stmt = tx
        .prepare_cached(&format!(
            "SELECT {RECORD_COLUMNS} FROM messages WHERE id = ?1"
        ))
        .db()?;
    let mut rows = stmt.query(params![id]).db()?;
    match rows.next().db()? {
        Some(row) => record_from_row(Some(&tx), row).map(Some),
        None => Ok(None),
    }
}

/// Every filter is answered by SQL on an indexed column (ids sort by creation time, so the
/// time window is an id range), so a page reads `limit + 1` rows whatever the filter; the
/// extra row only tells whether the scan reached the end.
fn list_tx(conn: &Connection, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.clamp(1, 100_000);
    let mut sql = format!("SELECT {RECORD_COLUMNS} FROM messages WHERE 1 = 1");
    let mut args: Vec<SqlValue> = Vec::new();
    let mut bind = |sql: &mut String, clause: &str, value: SqlValue| {
        args.push(value);
        sql.push_str(&format!(" AND {clause} ?{}", args.len()));
    };
    if let Some(after) = &filter.after {
        bind(&mut sql, "id >", SqlValue::Text(after.to_string()));
    }
    if let Some(from) = filter.created_from {
        let bound = MessageId::lower_bound(from).to_string();
        bind(&mut sql, "id >=", SqlValue::Text(bound));
    }
    if let Some(to) = filter.created_to {
        let bound = MessageId::lower_bound(to.saturating_add(1)).to_string();
        bind(&mut sql, "id <", SqlValue::Text(bound));
    }
    if let Some(state) = filter.state {
        bind(
            &mut sql,
            "state =",
            SqlValue::Text(state.as_str().to_string()),
        );
    }
    if let Some(source) = &filter.source {
        bind(&mut sql, "source =", SqlValue::Text(source.clone()));
    }
    if let Some(key) = &filter.ordering_key {
        bind(&mut sql, "ordering_key =", SqlValue::Text(key.clone()));
    }
    args.push(SqlValue::Integer(limit as i64 + 1));
    sql.push_str(&format!(" ORDER BY id LIMIT ?{}", args.len()));

    let tx = conn.unchecked_transaction().db()?;
    let mut stmt = tx.prepare(&sql).db()?;
    let mut rows = stmt.query(params_from_iter(args)).db()?;
    let mut messages = Vec::new();
    let mut scanned = 0;
    let mut last_scanned = None;
    let mut more = false;
    while let Some(row) = rows.next().db()? {
        if scanned == limit {
            more = true;
            break;
        }
        scanned += 1;
        let record = record_from_row(None, row)?;
        last_scanned = Some(record.message.id.clone());
        // SQL already applied every filter, with the id range standing for the creation
        // window; this applies the record's own `created_at`, as the Redis backend does.
        if matches_filter(&record, filter) {
            messages.push(record);
        }
    }
    // The cursor is the last row read, matched or not, so the next page goes on from there.
    let next_after = if more { last_scanned } else { None };
    Ok(Page {
        messages,
        next_after,
    })
}

fn depth_tx(conn: &Connection) -> Result<QueueDepth, StoreError> {
    let mut depth = QueueDepth::default();
    let mut stmt = conn
        .prepare_cached(
            "SELECT state, count(*) FROM messages \
             WHERE state IN ('pending', 'in_flight', 'dead') GROUP BY state",
        )
        .db()?;
    let counts = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .db()?;
    for count in counts {
        let (state, n) = count.db()?;
        let n = u64::try_from(n).unwrap_or(0);
        match state.as_str() {
            "pending" => depth.pending = n,
            "in_flight" => depth.in_flight = n,
            "dead" => depth.dead = n,
            _ => {}
        }
    }
    Ok(depth)
}

#[async_trait]
impl Store for SqliteStore {
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError> {
        let payment_retention_ms = self.payment_retention_ms;
        self.write(Some(now), move |conn| {
            accept_tx(conn, &req, now, payment_retention_ms)
        })
        .await
    }

    async fn claim_due(
        &self,
        now: Millis,
        limit: usize,
        lease_ms: u64,
    ) -> Result<Vec<Lease>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        self.write(Some(now), move |conn| claim_tx(conn, now, limit, lease_ms))
            .await
    }

    async fn complete(
        &self,
        claimed: &Lease,
        attempt: Attempt,
        completion: Completion,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let attempt = serde_json::to_string(&attempt).map_err(corrupt)?;
        let claimed = claimed.clone();
        let retention_ms = self.retention_ms;
        self.write(Some(now), move |conn| {
            complete_tx(conn, &claimed, &attempt, completion, now, retention_ms)
        })
        .await
    }

    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
        let claimed = claimed.clone();
        self.write(None, move |conn| release_tx(conn, &claimed, next_at))
            .await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError> {
        let id = id.to_string();
        self.read(move |conn| get_tx(conn, &id)).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let filter = filter.clone();
        self.read(move |conn| list_tx(conn, &filter)).await
    }

    async fn resend(
        &self,
        id: &MessageId,
        mark: Attempt,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError> {
        let id = id.to_string();
        let mark = serde_json::to_string(&mark).map_err(corrupt)?;
        self.write(Some(now), move |conn| {
            resend_tx(conn, &id, &mark, fresh_deadline, now)
        })
        .await
    }

    async fn reserve_operation(
        &self,
        key: &str,
        fingerprint: &str,
        ttl_secs: u64,
    ) -> Result<OperationReservation, StoreError> {
        let key = key.to_string();
        let fingerprint = fingerprint.to_string();
        self.write(None, move |conn| {
            reserve_tx(conn, &key, &fingerprint, ttl_secs)
        })
        .await
    }

    async fn finish_operation(
        &self,
        key: &str,
        fingerprint: &str,
        response: &str,
        ttl_secs: u64,
    ) -> Result<(), StoreError> {
        let key = key.to_string();
        let stored = super::encode_finished_operation(fingerprint, response);
        self.write(None, move |conn| {
            let expires_at = wall_clock_ms().saturating_add(secs_to_ms(ttl_secs));
            conn.prepare_cached(
                "INSERT OR REPLACE INTO operations (key, response, expires_at) \
                 VALUES (?1, ?2, ?3)",
            )
            .db()?
            .execute(params![key, stored, expires_at])
            .db()
            .map(|_| ())
        })
        .await
    }

    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError> {
        let payment_id = payment_id.to_string();
        self.read(move |conn| {
            conn.prepare_cached(
                "SELECT status FROM payments WHERE payment_id = ?1 AND expires_at > ?2",
            )
            .db()?
            .query_row(params![payment_id, now], |r| r.get(0))
            .optional()
            .db()
        })
        .await
    }

    async fn depth(&self) -> Result<QueueDepth, StoreError> {
        self.read(depth_tx).await
    }

    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError> {
        self.read(|conn| {
            // Two lookups on the (state, id) index instead of a scan of both states.
            let oldest: Option<String> = conn
                .query_row(
                    "SELECT min(id) FROM (\
                       SELECT min(id) AS id FROM messages WHERE state = 'pending' \
                       UNION ALL \
                       SELECT min(id) FROM messages WHERE state = 'in_flight')",
                    [],
                    |r| r.get(0),
                )
                .db()?;
            oldest
                .map(|id| {
                    MessageId::parse(&id)
                        .ok_or_else(|| StoreError::Corrupt(format!("message id `{id}`")))
                })
                .transpose()
        })
        .await
    }

    /// A command of its own with no `now`, so its batch does not sweep first and the count
    /// is what this call removed.
    async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        self.write(None, move |conn| sweep(conn, now).db()).await
    }

    /// Goes through the writer: ready means commands are being committed, not merely that
    /// the file can be read.
    async fn ping(&self) -> Result<(), StoreError> {
        self.write(None, |conn| {
            conn.query_row("SELECT 1", [], |r| r.get::<_, i64>(0))
                .db()
                .map(|_| ())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_764_460_800_000;

    fn open() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(&dir.path().join("cb.db"), 3600).expect("open");
        (dir, store)
    }

    fn count(store: &SqliteStore, sql: &str) -> i64 {
        let conn = store.reader.lock().unwrap();
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    /// Occupies the writer until the returned sender fires, so the commands sent meanwhile
    /// queue up and go into one batch.
    async fn hold_writer(
        store: &Arc<SqliteStore>,
    ) -> (
        std::sync::mpsc::Sender<()>,
        tokio::task::JoinHandle<Result<(), StoreError>>,
    ) {
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let (started, running) = oneshot::channel::<()>();
        let holder = {
            let store = Arc::clone(store);
            tokio::spawn(async move {
                store
                    .write(None, move |_| {
                        let _ = started.send(());
                        let _ = wait.recv();
                        Ok(())
                    })
                    .await
            })
        };
        running.await.expect("the writer picked up the holder");
        (release, holder)
    }

    async fn until_queued(store: &SqliteStore, n: usize) {
        let writer = store.writer.as_ref().unwrap();
        while QUEUE_CAPACITY - writer.capacity() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn insert_claim(
        key: &str,
    ) -> impl FnOnce(&Connection) -> Result<(), StoreError> + Send + use<> {
        let key = key.to_string();
        move |conn| {
            conn.execute(
                "INSERT INTO claims (key, fingerprint, response, expires_at) \
                 VALUES (?1, '', '', ?2)",
                params![key, i64::MAX],
            )
            .db()
            .map(|_| ())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_commands_share_one_commit() {
        let (_dir, store) = open();
        let store = Arc::new(store);
        let (release, holder) = hold_writer(&store).await;
        let before = store.commits();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..50 {
            let store = Arc::clone(&store);
            tasks.spawn(async move { store.write(Some(T0), insert_claim(&format!("k{i}"))).await });
        }
        until_queued(&store, 50).await;
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        while let Some(done) = tasks.join_next().await {
            done.unwrap().unwrap();
        }
        // One commit for the holder's batch, one for the fifty.
        assert_eq!(store.commits() - before, 2);
        assert_eq!(count(&store, "SELECT count(*) FROM claims"), 50);
    }

    type Command = Box<dyn FnOnce(&Connection) -> Result<(), StoreError> + Send>;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_command_rolls_back_only_itself() {
        let (_dir, store) = open();
        let store = Arc::new(store);
        let (release, holder) = hold_writer(&store).await;
        let spawn = |op: Command| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.write(None, op).await })
        };
        let a = spawn(Box::new(insert_claim("a")));
        until_queued(&store, 1).await;
        let b = spawn(Box::new(|conn: &Connection| {
            insert_claim("b")(conn)?;
            Err(StoreError::Corrupt("b changed its mind".into()))
        }));
        until_queued(&store, 2).await;
        let c = spawn(Box::new(|conn: &Connection| {
            insert_claim("c")(conn)?;
            // Printed by the panic hook on the writer thread; caught there.
            panic!("a bug in c (expected in the test output)")
        }));
        until_queued(&store, 3).await;
        let d = spawn(Box::new(insert_claim("d")));
        until_queued(&store, 4).await;
        let before = store.commits();
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();

        a.await.unwrap().unwrap();
        assert!(matches!(b.await.unwrap(), Err(StoreError::Corrupt(_))));
        assert!(matches!(c.await.unwrap(), Err(StoreError::Unavailable(_))));
        d.await.unwrap().unwrap();
        // The holder's batch, then one batch for the four.
        assert_eq!(store.commits() - before, 2);
        assert_eq!(claim_keys(&store), ["a", "d"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stuck_writer_answers_unavailable_within_the_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteOptions {
            timeout: Duration::from_millis(50),
            ..SqliteOptions::default()
        };
        let store =
            Arc::new(SqliteStore::open_with(&dir.path().join("cb.db"), 60, options).unwrap());
        let (release, holder) = hold_writer(&store).await;
        let err = store.ping().await.unwrap_err();
        assert!(
            matches!(&err, StoreError::Unavailable(m) if m.contains("within")),
            "{err:?}"
        );
        // Reads do not wait for the writer.
        assert_eq!(store.depth().await.unwrap(), QueueDepth::default());
        release.send(()).unwrap();
        // The holder's own call may have timed out as well (its command ran either way).
        let _ = holder.await.unwrap();
        store.ping().await.unwrap();
    }

    fn claim_keys(store: &SqliteStore) -> Vec<String> {
        let conn = store.reader.lock().unwrap();
        conn.prepare("SELECT key FROM claims ORDER BY key")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// A caller that gives up on a write the writer had not started withdraws it: it never
    /// runs. One the writer had started (here: run, its commit held) commits after its caller
    /// gave up, so a retry finds it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_given_up_write_runs_only_if_it_had_started() {
        let dir = tempfile::tempdir().unwrap();
        let options = SqliteOptions {
            timeout: Duration::from_millis(200),
            ..SqliteOptions::default()
        };
        let store =
            Arc::new(SqliteStore::open_with(&dir.path().join("cb.db"), 60, options).unwrap());
        let stall = store.stall_commits();
        let (ran, has_run) = oneshot::channel();
        let started = tokio::spawn({
            let store = Arc::clone(&store);
            async move {
                store
                    .write(None, move |conn| {
                        let _ = ran.send(());
                        insert_claim("started")(conn)
                    })
                    .await
            }
        });
        has_run.await.unwrap();
        started.abort();
        let _ = started.await;
        // Queued behind the held commit, it cannot start before its caller's timeout.
        let not_started = store.write(None, insert_claim("not-started")).await;
        assert!(
            matches!(&not_started, Err(StoreError::Unavailable(m)) if m.contains("withdrawn")),
            "{not_started:?}"
        );
        drop(stall);
        store.ping().await.unwrap();
        assert_eq!(claim_keys(&store), ["started"]);
    }

    /// A caller whose future is dropped (a client that hung up) withdraws its queued write.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_caller_withdraws_its_queued_write() {
        let (_dir, store) = open();
        let store = Arc::new(store);
        let stall = store.stall_commits();
        let first = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.write(None, insert_claim("first")).await }
        });
        stall.holding().await;
        let dropped = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.write(None, insert_claim("dropped")).await }
        });
        until_queued(&store, 1).await;
        dropped.abort();
        assert!(dropped.await.unwrap_err().is_cancelled());
        drop(stall);
        first.await.unwrap().unwrap();
        store.ping().await.unwrap();
        assert_eq!(claim_keys(&store), ["first"]);
    }

    #[tokio::test]
    async fn expired_rows_are_swept_in_bounded_batches() {
        let (_dir, store) = open();
        store
            .write(None, |conn| {
                let mut insert = conn
                    .prepare(
                        "INSERT INTO claims (key, fingerprint, response, expires_at) \
                         VALUES (?1, '', '', ?2)",
                    )
                    .db()?;
                for i in 0..2_500 {
                    insert.execute(params![format!("old{i}"), T0 + i]).db()?;
                }
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(count(&store, "SELECT count(*) FROM claims"), 2_500);
        let later = T0 + 10_000;
        for remaining in [1_500, 500, 0] {
            store.write(Some(later), |_| Ok(())).await.unwrap();
            assert_eq!(count(&store, "SELECT count(*) FROM claims"), remaining);
        }
    }

    #[tokio::test]
    async fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cb.db");
        drop(SqliteStore::open(&path, 60).unwrap());
        {
            let conn = Connection::open(&path).unwrap();
            assert_eq!(
                conn.pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))
                    .unwrap(),
                MIGRATIONS.len() as i64
            );
            conn.pragma_update(None, "user_version", 99).unwrap();
        }
        let err = SqliteStore::open(&path, 60).unwrap_err();
        assert!(err.to_string().contains("newer"), "{err}");
    }
}
