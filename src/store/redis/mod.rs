//! The Redis engine.
//!
//! Why it is built this way:
//!
//! - **One Lua script per state change.** Accepting, claiming, completing, releasing, resending
//!   and sweeping each read and write several keys; a script does all of it as one atomic step
//!   in one round trip, so no client ever sees half a step and an accepted message is one
//!   durable write (ARCHITECTURE.md §1.2). The decisions are `store::lifecycle`'s
//!   (src/store/lifecycle/rules.rs); each script in `lua/` names the rule whose effect it
//!   applies.
//! - **Keys hash-tagged by partition.** Every key of a message lives under the hash tag of its
//!   partition, derived from the ordering key, so each script touches one slot and the store
//!   runs on Redis Cluster as on one server. What spans partitions (claiming, sweeping,
//!   counting, listing) builds one pipeline per partition, sent as one round trip to one
//!   server and fanned out to the masters of a cluster (`connection.rs`). `keys.rs` has the
//!   layout.
//! - **Leases timed by Redis `TIME`.** Everything else takes `now` from the caller, but every
//!   worker must judge a lease by one clock: a process whose clock runs ahead would otherwise
//!   take over leases that have not expired yet.
//! - **Lifetimes by the caller's clock.** A string carries its end and counts as gone once `now`
//!   passes it; what ends has a member in an hourly expiry bucket, and [`Store::sweep`] deletes
//!   it from there (a finished message with its history and index entries). Redis TTLs on the
//!   strings and their buckets bound memory even without a sweeper.
//! - **A versioned layout.** The version is in `cb:schema` (`cb` being `store.key_prefix`); [`RedisStore::upgrade`] brings an
//!   older layout up to date in place (`upgrade.rs`).
//! - **A fixed partition count.** `cb:partitions` records `store.partitions` when the store is
//!   first used; every later connection takes it from there (`partitions.rs`).
//!
//! - **Replica acknowledgement on request.** With `store.min_replicas_acked = N` every write is
//!   followed by `WAIT N` in the same round trip ([`RedisStore::write`]); fewer acks within
//!   the store timeout is `Unavailable` (503), and the write stays for the retry to replay
//!   (docs/storage.md, "Choosing a store").
//!
//! - **Other processes woken at once.** A script that makes work due publishes on its
//!   partition's wake channel, and a dispatching store subscribes (`wake.rs`), so an idle
//!   dispatcher polls every 5 s instead of every 100 ms.
//!
//! `commands.rs` builds the script calls of the state changes and decodes their replies,
//! `reads.rs` answers the reads; both go through the round trips defined here, over the
//! connection of `connection.rs` (one server or a cluster: neither needs to know which).

mod apply;
mod claim;
mod commands;
mod connection;
mod counts;
mod keys;
mod partitions;
pub mod prefix;
mod reads;
mod record;
mod recoveries;
mod replaceable;
mod round_trips;
mod scripts;
mod upgrade;
mod wake;

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::{FromRedisValue, Value};
use serde::Serialize;

use super::{
    AcceptOutcome, AcceptRequest, Completion, DEFAULT_PAYMENT_RETENTION_SECS, DeliveryAttempt,
    InboundCount, Lease, ListFilter, MessageId, MessageRecord, MinuteCount, OperationReservation,
    Page, Partitions, PaymentStatusRead, QueueDepth, Recovery, ResendEffect, ResendMark, Store,
    StoreError, WorkSignal,
};
use crate::clock::Millis;
use crate::store::ids::partition_of;
use claim::Hints;
use connection::{Connection, Primary, is_refusal};
use keys::KeySpace;
use round_trips::{one_call, script_call, wait_timeout_ms};
use scripts::Scripts;
use wake::{WakeConfig, Waker};

pub use keys::SCHEMA_VERSION;
pub use prefix::{DEFAULT_KEY_PREFIX, key_prefix_problem};

/// How to reach Redis beyond its URL, and where in it this deployment's keys live.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    /// The start of every key name (`store.key_prefix`), already checked by
    /// [`key_prefix_problem`].
    pub key_prefix: String,
    /// Certificates for a `rediss://` URL; without them the system's roots are trusted.
    pub tls: Option<RedisTls>,
    /// `store.partitions` when set: a new store records it, an existing one must agree with
    /// its own. `None` keeps what the store has (the default for a new one).
    pub partitions: Option<Partitions>,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            key_prefix: DEFAULT_KEY_PREFIX.to_string(),
            tls: None,
            partitions: None,
        }
    }
}

/// PEM contents for TLS (`store.tls_*`), read and parsed when the config is loaded so that a
/// bad file is reported by its key, not at the first connection.
#[derive(Clone)]
pub struct RedisTls {
    /// The CA certificates the server's certificate must chain to.
    pub ca_pem: Vec<u8>,
    /// Certificate chain and private key presented to a server that authenticates clients.
    pub client: Option<ClientIdentity>,
}

#[derive(Clone)]
pub struct ClientIdentity {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Never prints the private key, so settings can be debug-printed.
impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_identity", &self.client.is_some())
            .finish()
    }
}

/// The server settings that decide whether an acknowledged write survives, as `CONFIG GET`
/// reported them at start-up; `None` where the server did not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurabilitySettings {
    pub appendonly: Option<String>,
    pub appendfsync: Option<String>,
    pub maxmemory_policy: Option<String>,
}

pub struct RedisStore {
    conn: Connection,
    scripts: Scripts,
    /// The names of this deployment's keys.
    keys: KeySpace,
    /// How long finished messages, their history and dedupe claims are kept.
    retention_secs: u64,
    /// How long a payment's status outlives its last transition.
    payment_retention_secs: u64,
    /// Leases timed by Redis' clock (`TIME`) rather than the caller's.
    store_clock_leases: bool,
    /// Replicas that must acknowledge every write (`store.min_replicas_acked`); 0 sends no
    /// `WAIT`.
    min_replicas_acked: u32,
    /// How long a `WAIT` blocks, inside the round trip's timeout.
    wait_timeout_ms: u64,
    /// What this process knows of each partition's claimable work (`claim.rs`).
    hints: Arc<Hints>,
    /// Where a dispatching store subscribes to other processes' work (`wake.rs`); `None`
    /// when it only polls.
    wake: Option<WakeConfig>,
    /// The subscription, opened by the first call of [`Store::work_signal`].
    waker: OnceLock<Waker>,
}

impl RedisStore {
    /// Connects to the server at `url`, or to the Redis Cluster it is a node of
    /// (`connection.rs`).
    pub async fn connect(
        url: &str,
        timeout: Duration,
        retention_secs: u64,
    ) -> Result<RedisStore, StoreError> {
        RedisStore::connect_with(url, timeout, retention_secs, &RedisOptions::default()).await
    }

    /// [`RedisStore::connect`] with a key prefix, TLS certificates and a partition count. The
    /// store's count is read here, without writing anything: a configured count that
    /// contradicts it is refused ([`crate::store::partitions::settle`]).
    pub async fn connect_with(
        url: &str,
        timeout: Duration,
        retention_secs: u64,
        options: &RedisOptions,
    ) -> Result<RedisStore, StoreError> {
        let conn = Connection::open(url, timeout, options.tls.as_ref()).await?;
        let cluster = conn.is_cluster();
        let mut store = RedisStore {
            conn,
            scripts: Scripts::new(cluster),
            // Only the names outside the partitions are used before the count is settled.
            keys: KeySpace::new(&options.key_prefix, Partitions::LEGACY),
            retention_secs,
            payment_retention_secs: DEFAULT_PAYMENT_RETENTION_SECS.max(retention_secs),
            store_clock_leases: true,
            min_replicas_acked: 0,
            wait_timeout_ms: wait_timeout_ms(timeout),
            hints: Arc::new(Hints::new(0)),
            wake: None,
            waker: OnceLock::new(),
        };
        let found = store.found_partitions().await?;
        let partitions = crate::store::partitions::settle(options.partitions, found)?;
        store.keys = KeySpace::new(&options.key_prefix, partitions);
        store.hints = Arc::new(Hints::new(usize::from(partitions.count())));
        store.wake = Some(WakeConfig {
            url: url.to_string(),
            timeout,
            tls: options.tls.clone(),
            cluster,
            channels: partitions
                .all()
                .map(|p| (store.keys.of_partition(p).wake(), p))
                .collect(),
            hints: Arc::clone(&store.hints),
            shown_url: crate::redact::url_credentials(url),
        });
        Ok(store)
    }

    /// The lifetimes the rules give what has nothing left to do.
    fn lifetimes(&self) -> crate::store::lifecycle::Lifetimes {
        let ms = |secs: u64| i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        crate::store::lifecycle::Lifetimes {
            retention_ms: ms(self.retention_secs),
            payment_retention_ms: ms(self.payment_retention_secs),
        }
    }

    /// How long a payment's status outlives its last transition (at least the retention).
    pub fn with_payment_retention_secs(mut self, secs: u64) -> RedisStore {
        self.payment_retention_secs = secs.max(self.retention_secs);
        self
    }

    /// Makes every write wait for `n` replicas to acknowledge it (`store.min_replicas_acked`).
    pub fn with_min_replicas_acked(mut self, n: u32) -> RedisStore {
        self.min_replicas_acked = n;
        self
    }

    /// Leaves the dispatcher polling often instead of subscribing to other processes' work
    /// (`wake.rs`): for measuring what the subscription saves.
    pub fn without_wake_ups(mut self) -> RedisStore {
        self.wake = None;
        self
    }

    /// Times leases by the caller's `now` instead of Redis' clock. Only for tests that move a
    /// virtual clock past a lease; in production every worker must judge leases by one clock.
    pub fn with_caller_clock_leases(mut self) -> RedisStore {
        self.store_clock_leases = false;
        self
    }

    /// `CONFIG GET` of the persistence and eviction settings of every primary (each master of
    /// a cluster has its own, named), `None` for one that disabled, renamed or did not permit
    /// CONFIG (managed Redis often does that): what that means is the caller's decision. One
    /// command per setting, since Redis 6 takes one name per GET.
    pub async fn durability_settings(
        &self,
    ) -> Result<Vec<(Option<String>, Option<DurabilitySettings>)>, StoreError> {
        let mut per_primary: Vec<(Primary, Option<HashMap<String, String>>)> = Vec::new();
        for name in ["appendonly", "appendfsync", "maxmemory-policy"] {
            let replies = self
                .conn
                .on_every_primary(redis::cmd("CONFIG").arg("GET").arg(name))
                .await
                .map_err(unavailable)?;
            for (primary, reply) in replies {
                let values: Option<HashMap<String, String>> = match reply {
                    Ok(value) => Some(decode(value)?),
                    Err(e) if is_refusal(&e) => None,
                    Err(e) => return Err(unavailable(e)),
                };
                match per_primary.iter_mut().find(|(p, _)| *p == primary) {
                    Some((_, all)) => {
                        *all = all.take().zip(values).map(|(mut all, values)| {
                            all.extend(values);
                            all
                        });
                    }
                    None => per_primary.push((primary, values)),
                }
            }
        }
        Ok(per_primary
            .into_iter()
            .map(|(primary, all)| {
                let settings = all.map(|mut all| DurabilitySettings {
                    appendonly: all.remove("appendonly"),
                    appendfsync: all.remove("appendfsync"),
                    maxmemory_policy: all.remove("maxmemory-policy"),
                });
                (primary.name(), settings)
            })
            .collect())
    }

    /// `connected_slaves` of `INFO replication`: the fewest of any primary (every master of a
    /// cluster must have its replicas), or `None` when INFO is disabled, renamed or not
    /// permitted on one, or does not say.
    pub async fn connected_replicas(&self) -> Result<Option<u32>, StoreError> {
        let replies = self
            .conn
            .on_every_primary(redis::cmd("INFO").arg("replication"))
            .await
            .map_err(unavailable)?;
        let mut fewest: Option<u32> = None;
        for (_, reply) in replies {
            let info: String = match reply {
                Ok(value) => decode(value)?,
                Err(e) if is_refusal(&e) => return Ok(None),
                Err(e) => return Err(unavailable(e)),
            };
            let connected = info.lines().find_map(|line| {
                line.trim()
                    .strip_prefix("connected_slaves:")
                    .and_then(|n| n.parse().ok())
            });
            let Some(connected) = connected else {
                return Ok(None);
            };
            fewest = Some(fewest.map_or(connected, |f: u32| f.min(connected)));
        }
        Ok(fewest)
    }
}

/// A failed call as the store's error: Redis' `OOM` refusal (at `maxmemory` with
/// `noeviction`) is `Full`, anything else `Unavailable`. A pipeline's error keeps no code of
/// its own, so the refusal is also known by its text.
fn unavailable(e: redis::RedisError) -> StoreError {
    let text = e.to_string();
    if e.code() == Some("OOM") || text.contains("command not allowed when used memory") {
        StoreError::Full(text)
    } else {
        StoreError::Unavailable(text)
    }
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// A reply of the shape the engine wrote; anything else is corrupt data.
fn decode<T: FromRedisValue>(value: Value) -> Result<T, StoreError> {
    redis::from_redis_value(value).map_err(corrupt)
}

/// A JSON value as the engine stores it (records, history rows).
fn to_json(value: &impl Serialize) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(corrupt)
}

/// A numeric field of a message hash; `None` when absent (older layouts) or unreadable.
fn field<T: FromStr>(fields: &HashMap<String, Vec<u8>>, name: &str) -> Option<T> {
    fields
        .get(name)
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

#[async_trait]
impl PaymentStatusRead for RedisStore {
    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError> {
        reads::payment_status(self, payment_id, now).await
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError> {
        let message = &req.message;
        let partition = partition_of(&message.ordering_key, self.partitions());
        // Every key of the request lives in the id's partition: an id made for another count
        // would put its dedupe claim where a retry with a right id never looks.
        if message.id.partition() != partition {
            return Err(corrupt(format!(
                "message {} names partition {}, but its ordering key is in partition {partition} \
                 of this store's {}",
                message.id,
                message.id.partition(),
                self.partitions()
            )));
        }
        commands::accept(self, &req, now).await
    }

    async fn claim_due(
        &self,
        now: Millis,
        limit: usize,
        lease_ms: u64,
    ) -> Result<Vec<Lease>, StoreError> {
        claim::claim(self, now, limit, lease_ms).await
    }

    async fn complete(
        &self,
        claimed: &Lease,
        attempt: DeliveryAttempt,
        completion: Completion,
        now: Millis,
    ) -> Result<bool, StoreError> {
        commands::complete(self, claimed, attempt, completion, now).await
    }

    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
        commands::release(self, claimed, next_at).await
    }

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError> {
        if !self.keys.holds(id) {
            return Ok(None);
        }
        reads::get(self, id).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        reads::list(self, filter).await
    }

    async fn resend(
        &self,
        id: &MessageId,
        mark: ResendMark,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError> {
        if !self.keys.holds(id) {
            return Ok(ResendEffect::Skipped);
        }
        commands::resend(self, id, mark, fresh_deadline, now).await
    }

    async fn reserve_operation(
        &self,
        key: &str,
        fingerprint: &str,
        ttl_secs: u64,
    ) -> Result<OperationReservation, StoreError> {
        commands::reserve_operation(self, key, fingerprint, ttl_secs).await
    }

    async fn finish_operation(
        &self,
        key: &str,
        fingerprint: &str,
        response: &str,
        ttl_secs: u64,
    ) -> Result<(), StoreError> {
        commands::finish_operation(self, key, fingerprint, response, ttl_secs).await
    }

    async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        commands::sweep(self, now).await
    }

    async fn depth(&self) -> Result<QueueDepth, StoreError> {
        reads::depth(self).await
    }

    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError> {
        reads::oldest_unfinished(self).await
    }

    async fn minute_counts(
        &self,
        since: Millis,
        now: Millis,
    ) -> Result<Vec<MinuteCount>, StoreError> {
        counts::minute_counts(self, since, now).await
    }

    async fn inbound_counts(
        &self,
        source: &str,
        since: Millis,
        until: Millis,
        now: Millis,
    ) -> Result<InboundCount, StoreError> {
        recoveries::inbound_counts(self, source, since, until, now).await
    }

    async fn save_recovery(&self, recovery: &Recovery, now: Millis) -> Result<(), StoreError> {
        recoveries::save(self, recovery, now).await
    }

    async fn recoveries(&self, now: Millis) -> Result<Vec<Recovery>, StoreError> {
        recoveries::list(self, now).await
    }

    async fn recovery(&self, id: &str, now: Millis) -> Result<Option<Recovery>, StoreError> {
        recoveries::get(self, id, now).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.send::<String>(&redis::cmd("PING")).await?;
        // A full Redis still answers PING. Each master has its own memory, so each is asked;
        // one that cannot be reached now fails only its own partitions' writes, as before.
        let mut probe = redis::cmd("EVAL");
        probe.arg(self.scripts.full_probe.source()).arg(0);
        let replies = self
            .conn
            .on_every_primary(&probe)
            .await
            .map_err(unavailable)?;
        for (primary, reply) in replies {
            if let Err(StoreError::Full(why)) = reply.map_err(unavailable) {
                return Err(StoreError::Full(match primary.name() {
                    Some(node) => format!("{node}: {why}"),
                    None => why,
                }));
            }
        }
        Ok(())
    }

    fn partitions(&self) -> Partitions {
        self.keys.partitions()
    }

    /// Changes on every wake-up another process's script published, and when the
    /// subscription is back after a loss (`wake.rs`).
    fn work_signal(&self) -> Option<WorkSignal> {
        // The subscription's task needs a runtime; without one, the dispatcher polls.
        let config = self.wake.as_ref()?;
        tokio::runtime::Handle::try_current().ok()?;
        let waker = self.waker.get_or_init(|| Waker::start(config.clone()));
        Some(waker.subscribe())
    }
}
