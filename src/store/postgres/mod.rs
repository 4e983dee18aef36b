//! The PostgreSQL engine: the store payment teams already run, managed, with a synchronous
//! standby, backups and point-in-time recovery (ARCHITECTURE.md, "The store seam").
//!
//! Why it is built this way:
//!
//! - **The engine decides nothing.** The rules are `store::lifecycle`'s; each write applies
//!   what they decide, as the SQLite engine does, in one transaction, so a 2xx means the claim
//!   and the record are committed together (ARCHITECTURE.md §1.2) and, with
//!   `synchronous_commit = on`, flushed to disk (and to a synchronous standby) first.
//! - **Several processes, one database.** Nothing is held in the process that another could
//!   contradict: leases are timed by the database's clock, claims take queue heads with
//!   `FOR UPDATE SKIP LOCKED`, so N processes share the queue and each message is delivered
//!   once.
//! - **Woken, not polled.** A write that makes work due notifies on commit, and each dispatching
//!   process listens on one connection of its own, so another process claims new work at once
//!   and an idle dispatcher polls only every 5 s (`listen.rs`).
//! - **One commit for many accepts.** Concurrent accepts share a transaction, each in a
//!   savepoint, and are answered after its one commit (`batch.rs`), as on SQLite.
//! - **Retention without bloat.** Finished messages and their history live in one partition
//!   per day their retention ends, dropped whole once the sweep horizon passes it; a resend
//!   moves a message back to the live partition first (`migrations/0001_layout.sql`).
//! - **Bounded calls.** Every call runs within the store timeout on a pooled connection, which
//!   is dropped after any failure; a lost connection is a 503 + `Retry-After`, never a hang
//!   (`connection.rs`).
//! - **A versioned layout.** The version is recorded in the database and checked at every
//!   start; a newer one refuses an older binary (`migrate.rs`).
//!
//! | file | holds |
//! |---|---|
//! | `connection.rs` | the URL (multi-host, `sslmode`, TLS files), the pool, the bounded call, the redacted URL |
//! | `error.rs` | PostgreSQL failures as `StoreError`s |
//! | `durability.rs` | the start-up check of `fsync`, `synchronous_commit` and the synchronous standby |
//! | `migrate.rs`, `migrations/` | the layout version and the SQL that builds each layout |
//! | `accept_set.rs` | a batch of accepts read, decided and written as sets (three statements) |
//! | `accept.rs`, `commands.rs` | the lifecycle transactions: each reads, asks its `store::lifecycle` rule, applies the effect; an accept batch one by one in savepoints when the set write is refused |
//! | `complete.rs` | completions, group-committed, and their attempts-per-minute counts |
//! | `batch.rs` | group commit: concurrent accepts, and concurrent completions, share one transaction |
//! | `listen.rs` | the wake-up across processes: `pg_notify` on commit, one `LISTEN` connection per dispatching store |
//! | `locks.rs` | the advisory locks of keys that may have no row yet, and of ordering keys' queues |
//! | `days.rs`, `sweep.rs` | the day partitions of finished messages; the sweep (bounded deletes, the horizon, whole days dropped) |
//! | `reads.rs` | get, list, depth, payment status, oldest unfinished, ping |
//! | `operations.rs` | resend request ids |
//! | `recoveries.rs` | recoveries, and the inbound counts per source and minute they report (written by the accepts) |

mod accept;
mod accept_set;
mod apply_set;
mod batch;
mod commands;
mod complete;
mod connection;
mod days;
mod durability;
mod effects;
mod error;
mod listen;
mod locks;
mod migrate;
mod operations;
mod reads;
mod recoveries;
mod sweep;
pub mod url;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;

pub use batch::WORKERS as ACCEPT_WORKERS;
pub use connection::{ClientCertificate, PostgresTls};
pub use durability::{DurabilitySettings, Setting, judge};
pub use migrate::LAYOUT_VERSION;
pub use url::{check_url, redacted_url};

use self::accept::run_accepts;
use self::accept_set::Queued;
use self::batch::Batcher;
use self::complete::Completing;
use self::connection::Database;
use self::days::{Days, end_day};
use self::listen::Listener;
use super::{
    AcceptOutcome, AcceptRequest, Completion, DEFAULT_PAYMENT_RETENTION_SECS, DeliveryAttempt,
    HistoryEntry, InboundCount, Lease, ListFilter, MessageId, MessageRecord, MinuteCount,
    OperationReservation, Page, Partitions, PaymentStatusRead, QueueDepth, Recovery, ResendEffect,
    ResendMark, Store, StoreError, WorkSignal,
};
use crate::clock::Millis;
use crate::durability::Verdict;
use crate::store::lifecycle::Lifetimes;

/// Connections a store keeps open at most when the options say nothing: every call holds one
/// for a round trip or a short transaction, so a handful serve a busy process.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// The database's clock in milliseconds since the epoch, as SQL: leases and operation records
/// are judged by it, so every process judges them by one clock.
const DB_NOW_MS: &str = "(extract(epoch FROM clock_timestamp()) * 1000)::bigint";

/// A message that is not gone, as SQL on `messages m`: unfinished (the live partition), or
/// finished and above the sweep horizon (sweep.rs).
const NOT_GONE: &str = "(m.end_day = 0 OR m.ends_at > (SELECT swept_to FROM sweep_horizon))";

/// A message's record (`store/record.rs`) as bytes, as SQL on `messages m`: `record` as
/// layouts 4 and 5 write it, else the JSON that layout 3 wrote in `message_json`.
const RECORD: &str = "coalesce(m.record, convert_to(m.message_json, 'UTF8'))";

/// How to reach PostgreSQL beyond its URL.
#[derive(Debug, Clone)]
pub struct PostgresOptions {
    /// CA and client certificates (`store.tls_*`); the default trusts the system's roots.
    pub tls: PostgresTls,
    /// `store.partitions` when set: a new store records it, an existing one must agree with
    /// its own. `None` keeps what the store has (the default for a new one).
    pub partitions: Option<Partitions>,
    /// Connections kept open at most.
    pub pool_size: usize,
    /// Whether a dispatching store listens for work other processes accept (`listen.rs`):
    /// off where `LISTEN` does not work (a pooler in transaction mode), and the dispatcher
    /// then polls often, as on the other engines.
    pub listen: bool,
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            tls: PostgresTls::default(),
            partitions: None,
            pool_size: DEFAULT_POOL_SIZE,
            listen: true,
        }
    }
}

pub struct PostgresStore {
    db: Arc<Database>,
    /// Group commit of accepts (`batch.rs`).
    batcher: Batcher<Queued, AcceptOutcome>,
    /// Group commit of completions.
    completions: Batcher<Completing, bool>,
    /// `PostgresOptions::listen`.
    listen: bool,
    /// The wake-up listener, started when a dispatcher first asks for the signal.
    listener: OnceLock<Listener>,
    /// The partition count the store records, or will record when it is migrated.
    partitions: Partitions,
    /// `store.partitions`, settled again under the migration's lock.
    configured_partitions: Option<Partitions>,
    lifetimes: Lifetimes,
    /// The day partitions known to exist.
    days: Arc<Days>,
    /// Leases timed by the database's clock rather than the caller's.
    database_clock_leases: bool,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("url", &self.db.shown_url())
            .finish_non_exhaustive()
    }
}

fn secs_to_ms(secs: u64) -> Millis {
    i64::try_from(secs).unwrap_or(i64::MAX).saturating_mul(1000)
}

impl PostgresStore {
    /// Connects to the database at `url` with the default options; finished messages are
    /// kept `retention_secs`.
    pub async fn connect(
        url: &str,
        timeout: Duration,
        retention_secs: u64,
    ) -> Result<PostgresStore, StoreError> {
        PostgresStore::connect_with(url, timeout, retention_secs, &PostgresOptions::default()).await
    }

    /// Opens the pool and one connection, and reads the recorded layout without writing
    /// anything: a layout newer than this binary's, or a configured partition count that
    /// contradicts the recorded one, is refused here. [`PostgresStore::migrate`] then brings
    /// the layout up to date, once [`PostgresStore::durability`] has judged the server.
    pub async fn connect_with(
        url: &str,
        timeout: Duration,
        retention_secs: u64,
        options: &PostgresOptions,
    ) -> Result<PostgresStore, StoreError> {
        let db = Database::open(url, timeout, &options.tls, options.pool_size).await?;
        let layout = db
            .call(|client| migrate::read_layout(client).boxed())
            .await?;
        let found = match layout.partitions {
            Some(held) => crate::store::partitions::Found::Recorded(held),
            None => crate::store::partitions::Found::Empty,
        };
        let partitions = crate::store::partitions::settle(options.partitions, found)?;
        let retention_ms = secs_to_ms(retention_secs);
        let db = Arc::new(db);
        let days = Arc::new(Days::default());
        Ok(PostgresStore {
            batcher: Batcher::start("accepts", Arc::clone(&db), Arc::clone(&days), run_accepts),
            completions: Batcher::start(
                "completions",
                Arc::clone(&db),
                Arc::clone(&days),
                complete::run_completions,
            ),
            db,
            listen: options.listen,
            listener: OnceLock::new(),
            partitions,
            configured_partitions: options.partitions,
            lifetimes: Lifetimes {
                retention_ms,
                payment_retention_ms: secs_to_ms(
                    DEFAULT_PAYMENT_RETENTION_SECS.max(retention_secs),
                ),
            },
            days,
            database_clock_leases: true,
        })
    }

    /// How long a payment's status outlives its last transition (at least the retention).
    pub fn with_payment_retention_secs(mut self, secs: u64) -> PostgresStore {
        self.lifetimes.payment_retention_ms = secs_to_ms(secs).max(self.lifetimes.retention_ms);
        self
    }

    /// Times leases by the caller's `now` instead of the database's clock. Only for tests that
    /// move a virtual clock past a lease; in production every worker must judge leases by one
    /// clock.
    pub fn with_caller_clock_leases(mut self) -> PostgresStore {
        self.database_clock_leases = false;
        self
    }

    /// Accept transactions committed by this store (`batch.rs`): fewer than the accepts
    /// when concurrent ones were group-committed.
    pub fn accept_commits(&self) -> u64 {
        self.batcher.commits()
    }

    /// Completion transactions committed by this store: fewer than the completions when
    /// concurrent ones were group-committed.
    pub fn completion_commits(&self) -> u64 {
        self.completions.commits()
    }

    /// Committed batches the server refused to write as sets (`accept_set.rs`), so run one
    /// accept at a time: a batch holding an accept that fails alone.
    pub fn accept_batches_one_by_one(&self) -> u64 {
        self.batcher.one_by_one()
    }

    /// The URL as messages and logs may show it: the password hidden.
    pub fn shown_url(&self) -> &str {
        self.db.shown_url()
    }

    /// Reads the server's durability settings, as this role's sessions see them.
    pub async fn durability_settings(&self) -> Result<DurabilitySettings, StoreError> {
        self.db
            .call(|client| durability::read_settings(client).boxed())
            .await
    }

    /// Judges the server's durability ([`judge`]): refused under `require_durable` when a
    /// commit may be acknowledged before it is on disk.
    pub async fn durability(&self, require_durable: bool) -> Result<Verdict, StoreError> {
        Ok(judge(&self.durability_settings().await?, require_durable))
    }

    /// Brings the layout up to [`LAYOUT_VERSION`] and records the partition count; returns
    /// the version found (0 for an empty database).
    pub async fn migrate(&mut self) -> Result<i32, StoreError> {
        let configured = self.configured_partitions.or(Some(self.partitions));
        let (found, partitions) = self
            .db
            .call_within(migrate::MIGRATION_TIMEOUT, move |client| {
                migrate::migrate(client, configured).boxed()
            })
            .await?;
        self.partitions = partitions;
        Ok(found)
    }

    /// Makes sure the day a message finishing at `now` ends in has its partitions, before a
    /// write that may finish one (days.rs).
    async fn prepare_day(&self, now: Millis) -> Result<(), StoreError> {
        let day = end_day(Some(now.saturating_add(self.lifetimes.retention_ms)));
        if self.days.known(day) {
            return Ok(());
        }
        let days = Arc::clone(&self.days);
        self.db
            .call(move |client| async move { days.ensure(client, day).await }.boxed())
            .await
    }
}

/// Each call is one pooled connection within the store timeout (`connection.rs`); each write
/// one transaction that applies what its `store::lifecycle` rule decides.
#[async_trait]
impl PaymentStatusRead for PostgresStore {
    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError> {
        let payment_id = payment_id.to_string();
        self.db
            .call(move |client| {
                async move { reads::payment_status(client, &payment_id, now).await }.boxed()
            })
            .await
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError> {
        self.prepare_day(now).await?;
        let lifetimes = self.lifetimes;
        self.batcher
            .submit(Queued {
                req,
                now,
                lifetimes,
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
        let (days, database_clock) = (Arc::clone(&self.days), self.database_clock_leases);
        self.db
            .call(move |client| {
                async move {
                    commands::claim(client, &days, now, limit, lease_ms, database_clock).await
                }
                .boxed()
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
        self.prepare_day(now).await?;
        self.completions
            .submit(Completing {
                lease: claimed.clone(),
                attempt: HistoryEntry::Delivery(attempt),
                completion,
                now,
                lifetimes: self.lifetimes,
            })
            .await
    }

    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
        let (days, lease) = (Arc::clone(&self.days), claimed.clone());
        self.db
            .call(move |client| {
                async move { commands::release(client, &days, &lease, next_at).await }.boxed()
            })
            .await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError> {
        let id = id.to_string();
        self.db
            .call(move |client| async move { reads::get(client, &id).await }.boxed())
            .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let filter = filter.clone();
        self.db
            .call(move |client| async move { reads::list(client, &filter).await }.boxed())
            .await
    }

    async fn resend(
        &self,
        id: &MessageId,
        mark: ResendMark,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError> {
        let (days, id) = (Arc::clone(&self.days), id.to_string());
        self.db
            .call(move |client| {
                async move { commands::resend(client, &days, &id, mark, fresh_deadline, now).await }
                    .boxed()
            })
            .await
    }

    async fn reserve_operation(
        &self,
        key: &str,
        fingerprint: &str,
        ttl_secs: u64,
    ) -> Result<OperationReservation, StoreError> {
        let (key, fingerprint) = (key.to_string(), fingerprint.to_string());
        self.db
            .call(move |client| {
                async move { operations::reserve(client, &key, &fingerprint, ttl_secs).await }
                    .boxed()
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
        let (key, fingerprint, response) = (
            key.to_string(),
            fingerprint.to_string(),
            response.to_string(),
        );
        self.db
            .call(move |client| {
                async move {
                    operations::finish(client, &key, &fingerprint, &response, ttl_secs).await
                }
                .boxed()
            })
            .await
    }

    async fn depth(&self) -> Result<QueueDepth, StoreError> {
        self.db.call(|client| reads::depth(client).boxed()).await
    }

    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError> {
        self.db
            .call(|client| reads::oldest_unfinished(client).boxed())
            .await
    }

    async fn minute_counts(
        &self,
        since: Millis,
        now: Millis,
    ) -> Result<Vec<MinuteCount>, StoreError> {
        self.db
            .call(move |client| {
                async move { reads::minute_counts(client, since, now).await }.boxed()
            })
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
        self.db
            .call(move |client| {
                async move { recoveries::inbound_counts(client, &source, since, until, now).await }
                    .boxed()
            })
            .await
    }

    async fn save_recovery(&self, recovery: &Recovery, now: Millis) -> Result<(), StoreError> {
        let recovery = recovery.clone();
        self.db
            .call(move |client| {
                async move { recoveries::save(client, &recovery, now).await }.boxed()
            })
            .await
    }

    async fn recoveries(&self, now: Millis) -> Result<Vec<Recovery>, StoreError> {
        self.db
            .call(move |client| async move { recoveries::list(client, now).await }.boxed())
            .await
    }

    async fn recovery(&self, id: &str, now: Millis) -> Result<Option<Recovery>, StoreError> {
        let id = id.to_string();
        self.db
            .call(move |client| async move { recoveries::get(client, &id, now).await }.boxed())
            .await
    }

    async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        let days = Arc::clone(&self.days);
        self.db
            .call(move |client| async move { sweep::sweep(client, &days, now).await }.boxed())
            .await
    }

    /// Readiness: the server answers and takes writes.
    async fn ping(&self) -> Result<(), StoreError> {
        self.db.call(|client| reads::ping(client).boxed()).await
    }

    fn partitions(&self) -> Partitions {
        self.partitions
    }

    /// Changes on every notification of work committed by any process on this database, and
    /// when the listening connection is back after a loss (`listen.rs`).
    fn work_signal(&self) -> Option<WorkSignal> {
        // The listener's task needs a runtime; without one, the dispatcher polls.
        if !self.listen || tokio::runtime::Handle::try_current().is_err() {
            return None;
        }
        let listener = self
            .listener
            .get_or_init(|| Listener::start(self.db.listen_config()));
        Some(listener.subscribe())
    }
}
