//! SQLite backend: the embedded default (ARCHITECTURE.md, "The store seam"), the same contract
//! as the Redis one.
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
//! Where Redis expires keys in real time, rows carry `expires_at` computed from the caller's
//! `now`, are ignored once past it, and are deleted in bounded batches by the writer.
//!
//! | file | holds |
//! |---|---|
//! | `writer.rs` | the group-commit engine, with no domain logic |
//! | `accept.rs`, `commands.rs` | the lifecycle transactions; each reads a row, asks its `store::lifecycle` rule and applies the effect |
//! | `reads.rs` | the reads |
//! | `schema.sql`, `migrate.rs` | the tables and what each column holds; upgrades of older layouts; the recorded partition count |

mod accept;
mod commands;
mod error;
mod migrate;
mod reads;
#[cfg(test)]
mod tests;
mod writer;

use std::fs::{self, File, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rusqlite::{Connection, OpenFlags};

pub use writer::CommitStall;

use self::error::{Db, context, db_error};
use self::writer::Writer;
use super::{
    AcceptOutcome, AcceptRequest, Completion, DEFAULT_PAYMENT_RETENTION_SECS, DeliveryAttempt,
    HistoryEntry, InboundCount, Lease, ListFilter, MessageId, MessageRecord, MinuteCount,
    OperationReservation, Page, Partitions, PaymentStatusRead, QueueDepth, Recovery, ResendEffect,
    ResendMark, Store, StoreError,
};
use crate::clock::Millis;
use crate::store::lifecycle::Lifetimes;

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
    /// `store.partitions` when set: a new database records it, an existing one must agree
    /// with its own. `None` keeps what the database has (the default for a new one).
    pub partitions: Option<Partitions>,
}

impl Default for SqliteOptions {
    fn default() -> Self {
        SqliteOptions {
            busy_timeout: Duration::from_secs(5),
            max_page_count: None,
            timeout: Duration::from_secs(5),
            payment_retention_secs: DEFAULT_PAYMENT_RETENTION_SECS,
            partitions: None,
        }
    }
}

/// Fields drop in order: the writer (joined, so the write connection is closed) and the
/// reader go before the lock, so the lock is released only once the database is closed (a
/// reopen right after a drop must not find its own lock).
pub struct SqliteStore {
    writer: Writer,
    /// Why a std `Mutex`: it is only locked inside `spawn_blocking`, never across an await.
    reader: Arc<Mutex<Connection>>,
    /// How long finished messages and their history are kept.
    lifetimes: Lifetimes,
    timeout: Duration,
    /// The partition count the database records. SQLite itself has one queue; the count is
    /// kept so that ids stay what they would be on any engine.
    partitions: Partitions,
    path: PathBuf,
    _lock: File,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

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
        let found_version = migrate::migrate(&writer, payment_retention_ms - retention_ms)
            .map_err(|e| context(path, e))?;
        let partitions = migrate::settle_partitions(&writer, options.partitions, found_version)
            .map_err(|e| context(path, e))?;

        // Read-only: the reader can never write by mistake.
        let reader = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
        reader
            .busy_timeout(options.busy_timeout)
            .map_err(|e| context(path, db_error(e)))?;

        // Housekeeping before each batch; a failed sweep is retried with the next one.
        let writer = Writer::start(writer, options.timeout, |conn, now| {
            commands::sweep(conn, now).map(|_| ())
        })
        .map_err(|e| unavailable("cannot start the SQLite writer thread", &e))?;
        Ok(SqliteStore {
            writer,
            reader: Arc::new(Mutex::new(reader)),
            lifetimes: Lifetimes {
                retention_ms,
                payment_retention_ms,
            },
            timeout: options.timeout,
            partitions,
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Transactions committed so far by the writer.
    pub fn commits(&self) -> u64 {
        self.writer.commits()
    }

    /// Changes `PRAGMA max_page_count` of the write connection and returns the value now in
    /// force (SQLite never sets it below the current size). A fault-injection hook: a cap at
    /// the current size makes the next growing write fail as on a full disk.
    pub async fn set_max_page_count(&self, pages: u64) -> Result<u64, StoreError> {
        let pages = i64::try_from(pages).unwrap_or(i64::MAX);
        self.writer
            .commit(None, move |conn| {
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
        self.writer.stall()
    }

    /// Commands waiting for the writer (not counting the batch it is running).
    pub fn queued(&self) -> usize {
        self.writer.queued()
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

/// Each write goes to the writer with the caller's `now` (so its batch sweeps first), except
/// the calls that have none; each read goes to the read connection.
#[async_trait]
impl PaymentStatusRead for SqliteStore {
    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError> {
        let payment_id = payment_id.to_string();
        self.read(move |conn| reads::payment_status(conn, &payment_id, now))
            .await
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError> {
        let lifetimes = self.lifetimes;
        self.writer
            .commit(Some(now), move |conn| {
                accept::accept(conn, &req, now, lifetimes)
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
        self.writer
            .commit(Some(now), move |conn| {
                commands::claim(conn, now, limit, lease_ms)
            })
            .await
    }

    async fn complete(
        &self,
        claimed: &Lease,
        attempt: DeliveryAttempt,
        completion: Completion,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let attempt = HistoryEntry::Delivery(attempt);
        let claimed = claimed.clone();
        let lifetimes = self.lifetimes;
        self.writer
            .commit(Some(now), move |conn| {
                commands::complete(conn, &claimed, attempt, completion, now, lifetimes)
            })
            .await
    }

    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
        let claimed = claimed.clone();
        self.writer
            .commit(None, move |conn| commands::release(conn, &claimed, next_at))
            .await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError> {
        let id = id.to_string();
        self.read(move |conn| reads::get(conn, &id)).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let filter = filter.clone();
        self.read(move |conn| reads::list(conn, &filter)).await
    }

    async fn resend(
        &self,
        id: &MessageId,
        mark: ResendMark,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError> {
        let id = id.to_string();
        self.writer
            .commit(Some(now), move |conn| {
                commands::resend(conn, &id, mark, fresh_deadline, now)
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
        self.writer
            .commit(None, move |conn| {
                commands::reserve_operation(conn, &key, &fingerprint, ttl_secs)
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
        let fingerprint = fingerprint.to_string();
        let response = response.to_string();
        self.writer
            .commit(None, move |conn| {
                commands::finish_operation(conn, &key, &fingerprint, &response, ttl_secs)
            })
            .await
    }

    async fn depth(&self) -> Result<QueueDepth, StoreError> {
        self.read(reads::depth).await
    }

    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError> {
        self.read(reads::oldest_unfinished).await
    }

    async fn minute_counts(
        &self,
        since: Millis,
        now: Millis,
    ) -> Result<Vec<MinuteCount>, StoreError> {
        self.read(move |conn| reads::minute_counts(conn, since, now))
            .await
    }

    async fn inbound_counts(
        &self,
        source: &str,
        since: Millis,
        until: Millis,
        now: Millis,
    ) -> Result<InboundCount, StoreError> {
        let source = source.to_string();
        self.read(move |conn| reads::inbound_counts(conn, &source, since, until, now))
            .await
    }

    async fn save_recovery(&self, recovery: &Recovery, now: Millis) -> Result<(), StoreError> {
        let recovery = recovery.clone();
        self.writer
            .commit(None, move |conn| {
                commands::save_recovery(conn, &recovery, now)
            })
            .await
    }

    async fn recoveries(&self, now: Millis) -> Result<Vec<Recovery>, StoreError> {
        self.read(move |conn| reads::recoveries(conn, now)).await
    }

    async fn recovery(&self, id: &str, now: Millis) -> Result<Option<Recovery>, StoreError> {
        let id = id.to_string();
        self.read(move |conn| reads::recovery(conn, &id, now)).await
    }

    /// A command of its own with no `now`, so its batch does not sweep first and the count
    /// is what this call removed.
    async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        self.writer
            .commit(None, move |conn| commands::sweep(conn, now))
            .await
    }

    /// Goes through the writer: ready means commands are being committed, not merely that
    /// the file can be read.
    /// Also fails with `Full` when the database is at its size cap (`max_page_count`) with no
    /// free page left: its next growing write would be refused.
    async fn ping(&self) -> Result<(), StoreError> {
        let path = self.path.clone();
        self.writer
            .commit(None, move |conn| {
                let pragma = |name: &str| {
                    conn.query_row(&format!("PRAGMA {name}"), [], |r| r.get::<_, i64>(0))
                        .db()
                };
                let (pages, cap) = (pragma("page_count")?, pragma("max_page_count")?);
                if pages >= cap && pragma("freelist_count")? == 0 {
                    return Err(StoreError::Full(format!(
                        "SQLite database {}: at its cap of {cap} pages",
                        path.display()
                    )));
                }
                Ok(())
            })
            .await
    }

    fn partitions(&self) -> Partitions {
        self.partitions
    }
}
