//! Redis backend: one Lua script (one round trip, one atomic step) per state change.
//!
//! Key layout, ready for Redis Cluster: every key of a message lives under the hash tag of its
//! partition, `cb:{pNN}:`, derived from the ordering key, so each script touches one slot.
//!
//! | key | type | holds |
//! |---|---|---|
//! | `d:<hash>` | string | dedupe claim: fingerprint `\n` stored response, `dedupe_ttl_secs` |
//! | `s:<hash>` | string | signature seal: the first answer to a signature, while it is valid |
//! | `m:<id>` | hash | message record and mutable state (state, tries, lease token, deadline, `kh` = hash of its ordering key, `hn` = history rows ever) |
//! | `a:<id>` | list | attempt history (JSON rows): the first and the latest 100 |
//! | `q:<hash>` | list | ids of one ordering key not yet finished; only the head is due |
//! | `due` | zset | due heads scored by next attempt time |
//! | `lease` | zset | in-flight ids scored by lease expiry |
//! | `ix`, `ix:<state>`, `ix:k:<hash>` | zset (lex) | ids for listing: all, by state, by key |
//! | `pay:<hash>` | string | payment status for the compare-and-set, `payment_retention_secs` |
//! | `x` | zset | expiry index: `d:`, `s:`, `pay:` and finished `m:` members scored by when they end |
//!
//! Lifetimes follow the caller's clock, like everything else: a key whose expiry-index score
//! is past `now` counts as gone, and [`Store::sweep`] deletes it (a finished message with its
//! history and index entries). Redis TTLs on the string keys bound memory even without a
//! sweeper. The schema version is `cb:schema`; [`RedisStore::connect`] upgrades older layouts.

use crate::clock::Millis;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script, Value};

use super::ids::{PARTITIONS, partition_of};
use super::redis_upgrade;
use super::{
    AcceptOutcome, AcceptRequest, Attempt, Completion, DEFAULT_PAYMENT_RETENTION_SECS,
    HISTORY_TAIL, Lease, ListFilter, MessageId, MessageRecord, MessageState, NewMessage,
    OperationReservation, Page, QueueDepth, ResendEffect, SWEEP_LIMIT, Store, StoreError,
    matches_filter,
};
use crate::digest::short_hash;

/// The server settings that decide whether an acknowledged write survives, as `CONFIG GET`
/// reported them at start-up; `None` where the server did not say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurabilitySettings {
    pub appendonly: Option<String>,
    pub appendfsync: Option<String>,
    pub maxmemory_policy: Option<String>,
}

struct Scripts {
    accept: Script,
    claim: Script,
    complete: Script,
    release: Script,
    resend: Script,
    sweep: Script,
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            accept: Script::new(include_str!("lua/accept.lua")),
            claim: Script::new(include_str!("lua/claim.lua")),
            complete: Script::new(concat!(
                include_str!("lua/history.lua"),
                include_str!("lua/complete.lua")
            )),
            release: Script::new(include_str!("lua/release.lua")),
            resend: Script::new(concat!(
                include_str!("lua/history.lua"),
                include_str!("lua/resend.lua")
            )),
            sweep: Script::new(include_str!("lua/sweep.lua")),
        }
    }
}

/// The layout this binary writes. 1: the first release (TTLs only, global trims);
/// 2: the expiry index, `kh`/`hn` fields, signature seals, bounded history.
pub const SCHEMA_VERSION: u32 = 2;
const SCHEMA_KEY: &str = "cb:schema";
/// Held by the one process upgrading an older layout.
const UPGRADE_LOCK_KEY: &str = "cb:upgrading";
const UPGRADE_LOCK_MS: u64 = 600_000;

pub struct RedisStore {
    conn: ConnectionManager,
    scripts: Scripts,
    /// How long finished messages, their history and dedupe claims are kept.
    retention_secs: u64,
    /// How long a payment's status outlives its last transition.
    payment_retention_secs: u64,
    /// Leases timed by Redis' clock (`TIME`) rather than the caller's.
    store_clock_leases: bool,
    /// Partition that gets the first share of the next claim, rotated so a small `limit`
    /// does not always favour the low partitions.
    next_claim_start: AtomicUsize,
}

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// Key names of one partition.
struct Keys(String);

impl Keys {
    fn of_partition(partition: u8) -> Keys {
        Keys(format!("cb:{{p{partition:02}}}:"))
    }
    fn of_id(id: &MessageId) -> Keys {
        Keys::of_partition(id.partition())
    }
    fn of_ordering_key(ordering_key: &str) -> Keys {
        Keys::of_partition(partition_of(ordering_key))
    }
    fn prefix(&self) -> &str {
        &self.0
    }
    fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.0)
    }
    fn dedupe(&self, claim_key: &str) -> String {
        self.key(&format!("d:{claim_key}"))
    }
    fn message(&self, id: &MessageId) -> String {
        self.key(&format!("m:{id}"))
    }
    fn attempts(&self, id: &MessageId) -> String {
        self.key(&format!("a:{id}"))
    }
    fn queue(&self, ordering_key: &str) -> String {
        self.key(&format!("q:{}", short_hash(ordering_key.as_bytes())))
    }
    fn index_of_key(&self, ordering_key: &str) -> String {
        self.key(&format!("ix:k:{}", short_hash(ordering_key.as_bytes())))
    }
    fn index(&self, state: Option<MessageState>) -> String {
        match state {
            None => self.key("ix"),
            Some(s) => self.key(&format!("ix:{}", s.as_str())),
        }
    }
    fn payment(&self, payment_id: &str) -> String {
        self.key(&format!("pay:{}", short_hash(payment_id.as_bytes())))
    }
    fn due(&self) -> String {
        self.key("due")
    }
    fn expiry(&self) -> String {
        self.key("x")
    }
    fn seal(&self, seal_key: &str) -> String {
        self.key(&format!("s:{seal_key}"))
    }
    fn lease(&self) -> String {
        self.key("lease")
    }
}

fn operation_key(key: &str) -> String {
    format!("cb:op:{}", short_hash(key.as_bytes()))
}

impl RedisStore {
    /// Connects with a reconnecting connection manager: a Redis restart costs the requests in
    /// flight at that moment (503, the sender retries), not the process.
    pub async fn connect(
        url: &str,
        timeout: Duration,
        retention_secs: u64,
    ) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url).map_err(unavailable)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let conn =
            tokio::time::timeout(timeout, ConnectionManager::new_with_config(client, config))
                .await
                .map_err(|_| {
                    StoreError::Unavailable(format!("no answer from {url} within {timeout:?}"))
                })?
                .map_err(unavailable)?;
        Ok(RedisStore {
            conn,
            scripts: Scripts::new(),
            retention_secs,
            payment_retention_secs: DEFAULT_PAYMENT_RETENTION_SECS.max(retention_secs),
            store_clock_leases: true,
            next_claim_start: AtomicUsize::new(0),
        })
    }

    /// How long a payment's status outlives its last transition (at least the retention).
    pub fn with_payment_retention_secs(mut self, secs: u64) -> RedisStore {
        self.payment_retention_secs = secs.max(self.retention_secs);
        self
    }

    /// Times leases by the caller's `now` instead of Redis' clock. Only for tests that move a
    /// virtual clock past a lease; in production every worker must judge leases by one clock.
    pub fn with_caller_clock_leases(mut self) -> RedisStore {
        self.store_clock_leases = false;
        self
    }

    /// Brings the store to [`SCHEMA_VERSION`] and returns the version it found. A new store
    /// is stamped; a version-1 store (no version key, but data) is upgraded in place; a
    /// store newer than this binary is refused.
    pub async fn upgrade(&self, now: Millis) -> Result<u32, StoreError> {
        let mut conn = self.conn.clone();
        let found: Option<u32> = conn.get(SCHEMA_KEY).await.map_err(unavailable)?;
        let found = match found {
            Some(v) => v,
            None if redis_upgrade::has_data(&mut conn).await? => 1,
            None => SCHEMA_VERSION,
        };
        if found > SCHEMA_VERSION {
            return Err(StoreError::Unavailable(format!(
                "the Redis store has layout version {found} ({SCHEMA_KEY}), newer than this \
                 callbackd understands ({SCHEMA_VERSION}); run a newer callbackd"
            )));
        }
        if found == SCHEMA_VERSION {
            // A new store is stamped; stamping an up-to-date one again changes nothing.
            conn.set::<_, _, ()>(SCHEMA_KEY, SCHEMA_VERSION)
                .await
                .map_err(unavailable)?;
            return Ok(found);
        }
        // One process upgrades; the others wait for the version key and serve only then, so
        // nothing is written in the new layout while an old-layout read is in flight.
        let token = MessageId::generate(now, "upgrade").to_string();
        let mine: Option<String> = redis::cmd("SET")
            .arg(UPGRADE_LOCK_KEY)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(UPGRADE_LOCK_MS)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        if mine.is_none() {
            return self.wait_for_upgrade(found).await;
        }
        let lifetimes = redis_upgrade::Lifetimes {
            retention_secs: self.retention_secs,
            payment_retention_secs: self.payment_retention_secs,
        };
        redis_upgrade::v1_to_v2(&mut conn, now, lifetimes).await?;
        redis::pipe()
            .set(SCHEMA_KEY, SCHEMA_VERSION)
            .del(UPGRADE_LOCK_KEY)
            .query_async::<()>(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(found)
    }

    /// Waits while another process upgrades (at most the lock's lifetime: a process that died
    /// mid-upgrade leaves a lock that expires, and the next start redoes the idempotent steps).
    async fn wait_for_upgrade(&self, found: u32) -> Result<u32, StoreError> {
        let mut conn = self.conn.clone();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(UPGRADE_LOCK_MS);
        while tokio::time::Instant::now() < deadline {
            let version: Option<u32> = conn.get(SCHEMA_KEY).await.map_err(unavailable)?;
            if version == Some(SCHEMA_VERSION) {
                return Ok(found);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(StoreError::Unavailable(format!(
            "another process has been upgrading the Redis layout for {} s ({UPGRADE_LOCK_KEY}); \
             start again to take over",
            UPGRADE_LOCK_MS / 1000
        )))
    }

    /// `CONFIG GET` of the persistence and eviction settings, or `None` when CONFIG is
    /// disabled, renamed or not permitted (managed Redis often does that): what that means is
    /// the caller's decision. One command per setting, since Redis 6 takes one name per GET.
    pub async fn durability_settings(&self) -> Result<Option<DurabilitySettings>, StoreError> {
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        for name in ["appendonly", "appendfsync", "maxmemory-policy"] {
            pipe.cmd("CONFIG").arg("GET").arg(name);
        }
        let reply: redis::RedisResult<Vec<HashMap<String, String>>> =
            pipe.query_async(&mut conn).await;
        match reply {
            Ok(replies) => {
                let mut all: HashMap<String, String> = replies.into_iter().flatten().collect();
                Ok(Some(DurabilitySettings {
                    appendonly: all.remove("appendonly"),
                    appendfsync: all.remove("appendfsync"),
                    maxmemory_policy: all.remove("maxmemory-policy"),
                }))
            }
            Err(e) if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() => {
                Err(unavailable(e))
            }
            Err(_) => Ok(None),
        }
    }

    /// Loads records; histories only when asked (a list page never loads them).
    async fn load_records(
        &self,
        ids: &[MessageId],
        with_history: bool,
    ) -> Result<Vec<MessageRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for id in ids {
            let keys = Keys::of_id(id);
            pipe.hgetall(keys.message(id))
                .zscore(keys.due(), id.as_str());
            if with_history {
                pipe.lrange(keys.attempts(id), 0, -1);
            }
        }
        let mut conn = self.conn.clone();
        let replies: Vec<Value> = pipe.query_async(&mut conn).await.map_err(unavailable)?;
        let mut records = Vec::with_capacity(ids.len());
        for chunk in replies.chunks(if with_history { 3 } else { 2 }) {
            let (fields, due, history) = match chunk {
                [fields, due, history] => (fields, due, Some(history)),
                [fields, due] => (fields, due, None),
                _ => return Err(corrupt("short pipeline reply")),
            };
            let fields: HashMap<String, String> =
                redis::from_redis_value_ref(fields).map_err(corrupt)?;
            let Some(rec) = fields.get("rec") else {
                continue;
            };
            let message: NewMessage = serde_json::from_str(rec).map_err(corrupt)?;
            let state = fields
                .get("state")
                .and_then(|s| MessageState::parse(s))
                .ok_or_else(|| corrupt(format!("message {} has no valid state", message.id)))?;
            let history = if let Some(history) = history {
                let rows: Vec<String> = redis::from_redis_value_ref(history).map_err(corrupt)?;
                rows.iter()
                    .map(|row| serde_json::from_str::<Attempt>(row).map_err(corrupt))
                    .collect::<Result<Vec<_>, _>>()?
            } else {
                Vec::new()
            };
            let history_total = fields
                .get("hn")
                .and_then(|n| n.parse().ok())
                .unwrap_or(history.len() as u64);
            let next_attempt_at: Option<f64> = redis::from_redis_value_ref(due).map_err(corrupt)?;
            let deadline = fields
                .get("dl")
                .and_then(|d| d.parse().ok())
                .unwrap_or(message.deadline);
            records.push(MessageRecord {
                message,
                state,
                deadline,
                next_attempt_at: next_attempt_at.map(|s| s as Millis),
                history,
                history_total,
                delivery_attempts: fields
                    .get("tries")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0),
            });
        }
        Ok(records)
    }

    /// Up to `limit` ids above `after` (and below `before`), merged over the partitions.
    async fn scan_ids(
        &self,
        filter: &ListFilter,
        after: Option<&MessageId>,
        limit: usize,
    ) -> Result<Vec<MessageId>, StoreError> {
        let min = match (after, filter.created_from) {
            (Some(a), Some(f)) if MessageId::lower_bound(f) > *a => {
                format!("[{}", MessageId::lower_bound(f))
            }
            (Some(a), _) => format!("({a}"),
            (None, Some(f)) => format!("[{}", MessageId::lower_bound(f)),
            (None, None) => "-".to_string(),
        };
        let max = match filter.created_to {
            Some(t) => format!("({}", MessageId::lower_bound(t + 1)),
            None => "+".to_string(),
        };
        let indexes: Vec<String> = match &filter.ordering_key {
            Some(k) => vec![Keys::of_ordering_key(k).index_of_key(k)],
            None => (0..PARTITIONS)
                .map(|p| Keys::of_partition(p).index(filter.state))
                .collect(),
        };
        let mut pipe = redis::pipe();
        for index in &indexes {
            pipe.cmd("ZRANGE")
                .arg(index)
                .arg(&min)
                .arg(&max)
                .arg("BYLEX")
                .arg("LIMIT")
                .arg(0)
                .arg(limit);
        }
        let mut conn = self.conn.clone();
        let pages: Vec<Vec<String>> = pipe.query_async(&mut conn).await.map_err(unavailable)?;
        let mut ids: Vec<MessageId> = pages
            .into_iter()
            .flatten()
            .filter_map(|s| MessageId::parse(&s))
            .collect();
        ids.sort();
        ids.truncate(limit);
        Ok(ids)
    }

    /// How many messages each partition could hand out at `now`: due heads plus expired
    /// leases (which claim.lua makes due again first). One pipelined round trip.
    async fn claimable_per_partition(&self, now: Millis) -> Result<Vec<usize>, StoreError> {
        let mut conn = self.conn.clone();
        let lease_now = if self.store_clock_leases {
            let (secs, micros): (i64, i64) = redis::cmd("TIME")
                .query_async(&mut conn)
                .await
                .map_err(unavailable)?;
            secs * 1000 + micros / 1000
        } else {
            now
        };
        let mut pipe = redis::pipe();
        for p in 0..PARTITIONS {
            let keys = Keys::of_partition(p);
            pipe.zcount(keys.due(), "-inf", now)
                .zcount(keys.lease(), "-inf", lease_now);
        }
        let counts: Vec<usize> = pipe.query_async(&mut conn).await.map_err(unavailable)?;
        Ok(counts.chunks(2).map(|c| c.iter().sum()).collect())
    }

    /// Runs the claim script on every partition with a non-zero quota, in a single
    /// pipelined round trip.
    async fn claim_partitions(
        &self,
        now: Millis,
        quotas: &[usize],
        lease_ms: u64,
    ) -> Result<Vec<Value>, StoreError> {
        let mut pipe = redis::pipe();
        for (p, quota) in (0..PARTITIONS).zip(quotas) {
            if *quota == 0 {
                continue;
            }
            let keys = Keys::of_partition(p);
            pipe.cmd("EVALSHA")
                .arg(self.scripts.claim.get_hash())
                .arg(4)
                .arg(keys.due())
                .arg(keys.lease())
                .arg(keys.index(Some(MessageState::Pending)))
                .arg(keys.index(Some(MessageState::InFlight)))
                .arg(now)
                .arg(*quota)
                .arg(lease_ms)
                .arg(keys.prefix())
                .arg(if self.store_clock_leases { "1" } else { "0" });
        }
        let mut conn = self.conn.clone();
        self.with_script_loaded(&self.scripts.claim, &mut conn, &pipe)
            .await
    }

    /// Runs a pipeline of EVALSHAs of `script`. Scripts are not in the server's cache after a
    /// Redis restart, so a NOSCRIPT reply loads it and runs the pipeline again.
    async fn with_script_loaded<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        conn: &mut ConnectionManager,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        match pipe.query_async::<T>(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                script.load_async(conn).await.map_err(unavailable)?;
                pipe.query_async(conn).await.map_err(unavailable)
            }
            other => other.map_err(unavailable),
        }
    }
}

/// Shares `limit` among partitions one message at a time, round-robin from `start`, never
/// giving a partition more than it has available. The quotas sum to at most `limit`.
fn spread(limit: usize, available: &[usize], start: usize) -> Vec<usize> {
    let n = available.len();
    let mut quotas = vec![0; n];
    let mut left = limit;
    loop {
        let mut gave = false;
        for i in 0..n {
            if left == 0 {
                return quotas;
            }
            let p = (start + i) % n;
            if quotas[p] < available[p] {
                quotas[p] += 1;
                left -= 1;
                gave = true;
            }
        }
        if !gave {
            return quotas;
        }
    }
}

fn parse_claimed(row: Value) -> Result<Lease, StoreError> {
    let (rec, token, tries, rb, deadline): (String, u64, u32, u32, Millis) =
        redis::from_redis_value(row).map_err(corrupt)?;
    let message: NewMessage = serde_json::from_str(&rec).map_err(corrupt)?;
    Ok(Lease {
        message,
        token,
        attempts: tries,
        backoff_step: tries.saturating_sub(rb),
        deadline,
    })
}

#[async_trait]
impl Store for RedisStore {
    async fn accept(&self, req: AcceptRequest, now: Millis) -> Result<AcceptOutcome, StoreError> {
        let msg = &req.message;
        let keys = Keys::of_id(&msg.id);
        let initial = if msg.target_url.is_some() {
            MessageState::Pending
        } else {
            MessageState::Recorded
        };
        let payment_key = match &req.payment {
            Some(p) => keys.payment(&p.payment_id),
            None => keys.payment(""),
        };
        let (to, allowed) = match &req.payment {
            Some(p) => (p.to.clone(), p.allowed_from.join(" ")),
            None => (String::new(), String::new()),
        };
        let (seal_key, seal_until) = match &req.seal {
            Some(seal) => (keys.seal(&seal.key), seal.expires_at.to_string()),
            None => (keys.seal(""), String::new()),
        };
        let record = serde_json::to_string(msg).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let reply: Vec<String> = self
            .scripts
            .accept
            .key(keys.dedupe(&req.dedupe.key))
            .key(keys.message(&msg.id))
            .key(keys.queue(&msg.ordering_key))
            .key(keys.due())
            .key(keys.index(None))
            .key(keys.index(Some(initial)))
            .key(keys.index_of_key(&msg.ordering_key))
            .key(payment_key)
            .key(keys.expiry())
            .key(seal_key)
            .arg(req.dedupe.ttl_secs)
            .arg(&req.dedupe.fingerprint)
            .arg(&req.dedupe.response)
            .arg(msg.id.as_str())
            .arg(record)
            .arg(now)
            .arg(msg.deadline)
            .arg(initial.as_str())
            .arg(to)
            .arg(allowed)
            .arg(self.payment_retention_secs)
            .arg(self.retention_secs)
            .arg(seal_until)
            .arg(keys.prefix())
            .arg(short_hash(msg.ordering_key.as_bytes()))
            .invoke_async(&mut conn)
            .await
            .map_err(unavailable)?;
        match reply.as_slice() {
            [ok] if ok == "ok" => Ok(AcceptOutcome::Accepted),
            [dup, response] if dup == "dup" => Ok(AcceptOutcome::Replayed {
                response: response.clone(),
            }),
            [c] if c == "conflict" => Ok(AcceptOutcome::Conflict),
            [t, from] if t == "transition" => {
                Ok(AcceptOutcome::InvalidTransition { from: from.clone() })
            }
            other => Err(corrupt(format!("accept script answered {other:?}"))),
        }
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
        // Asking every partition for `limit / PARTITIONS` (rounded up) would lease up to
        // PARTITIONS messages when asked for one, and a caller sizes `limit` to its free
        // workers. So first count what each partition has, then ask each for its share.
        let available = self.claimable_per_partition(now).await?;
        let start = self.next_claim_start.fetch_add(1, Ordering::Relaxed);
        let quotas = spread(limit, &available, start);
        if quotas.iter().all(|q| *q == 0) {
            return Ok(Vec::new());
        }
        let pages = self.claim_partitions(now, &quotas, lease_ms).await?;
        let mut claimed = Vec::new();
        for page in pages {
            let rows: Vec<Value> = redis::from_redis_value(page).map_err(corrupt)?;
            for row in rows {
                claimed.push(parse_claimed(row)?);
            }
        }
        Ok(claimed)
    }

    async fn complete(
        &self,
        claimed: &Lease,
        attempt: Attempt,
        completion: Completion,
        now: Millis,
    ) -> Result<bool, StoreError> {
        let id = &claimed.message.id;
        let keys = Keys::of_id(id);
        let (outcome, next_at, final_state) = match completion {
            Completion::Delivered => ("delivered", now, MessageState::Delivered),
            Completion::Retry { next_at } => ("retry", next_at, MessageState::Dead),
            Completion::Dead => ("dead", now, MessageState::Dead),
        };
        let attempt = serde_json::to_string(&attempt).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let done: i64 = self
            .scripts
            .complete
            .key(keys.message(id))
            .key(keys.attempts(id))
            .key(keys.lease())
            .key(keys.due())
            .key(keys.queue(&claimed.message.ordering_key))
            .key(keys.index(Some(MessageState::InFlight)))
            .key(keys.index(Some(MessageState::Pending)))
            .key(keys.index(Some(final_state)))
            .key(keys.expiry())
            .arg(id.as_str())
            .arg(claimed.token)
            .arg(outcome)
            .arg(attempt)
            .arg(next_at)
            .arg(now)
            .arg(self.retention_secs)
            .arg(HISTORY_TAIL)
            .invoke_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(done == 1)
    }

    async fn release(&self, claimed: &Lease, next_at: Millis) -> Result<bool, StoreError> {
        let id = &claimed.message.id;
        let keys = Keys::of_id(id);
        let mut conn = self.conn.clone();
        let done: i64 = self
            .scripts
            .release
            .key(keys.message(id))
            .key(keys.lease())
            .key(keys.due())
            .key(keys.index(Some(MessageState::InFlight)))
            .key(keys.index(Some(MessageState::Pending)))
            .arg(id.as_str())
            .arg(claimed.token)
            .arg(next_at)
            .invoke_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(done == 1)
    }

    async fn get(&self, id: &MessageId) -> Result<Option<MessageRecord>, StoreError> {
        Ok(self
            .load_records(std::slice::from_ref(id), true)
            .await?
            .pop())
    }

    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.limit.max(1);
        // Filters the indexes cannot answer (source, or state within one key's index) are
        // applied to loaded records; the scan is bounded so a sparse filter cannot make one
        // page read the whole keyspace: the caller continues from `next_after`.
        let max_scanned = limit * 10;
        let mut scanned = 0;
        let mut after = filter.after.clone();
        let mut messages = Vec::new();
        loop {
            let ids = self.scan_ids(filter, after.as_ref(), limit).await?;
            let exhausted = ids.len() < limit;
            scanned += ids.len();
            if let Some(last) = ids.last() {
                after = Some(last.clone());
            }
            // A match that does not fit on this page: the next page starts right before it,
            // even when this chunk ended the scan (else it would be silently skipped).
            let mut overflow = false;
            for record in self.load_records(&ids, false).await? {
                if !matches_filter(&record, filter) {
                    continue;
                }
                if messages.len() >= limit {
                    overflow = true;
                    break;
                }
                after = Some(record.message.id.clone());
                messages.push(record);
            }
            if exhausted && !overflow {
                return Ok(Page {
                    messages,
                    next_after: None,
                });
            }
            if overflow || messages.len() >= limit || scanned >= max_scanned {
                return Ok(Page {
                    messages,
                    next_after: after,
                });
            }
        }
    }

    async fn resend(
        &self,
        id: &MessageId,
        mark: Attempt,
        fresh_deadline: Millis,
        now: Millis,
    ) -> Result<ResendEffect, StoreError> {
        let Some(ordering_key) = self.ordering_key_of(id).await? else {
            return Ok(ResendEffect::Skipped);
        };
        let keys = Keys::of_id(id);
        let mark = serde_json::to_string(&mark).map_err(corrupt)?;
        let mut conn = self.conn.clone();
        let effect: String = self
            .scripts
            .resend
            .key(keys.message(id))
            .key(keys.attempts(id))
            .key(keys.due())
            .key(keys.queue(&ordering_key))
            .key(keys.index(Some(MessageState::Pending)))
            .key(keys.index(Some(MessageState::Delivered)))
            .key(keys.index(Some(MessageState::Dead)))
            .key(keys.expiry())
            .arg(id.as_str())
            .arg(mark)
            .arg(fresh_deadline)
            .arg(now)
            .arg(HISTORY_TAIL)
            .invoke_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(match effect.as_str() {
            "requeued" => ResendEffect::Requeued,
            "expedited" => ResendEffect::Expedited,
            "queued" => ResendEffect::Queued,
            "after_current" => ResendEffect::AfterCurrent,
            _ => ResendEffect::Skipped,
        })
    }

    async fn reserve_operation(
        &self,
        key: &str,
        fingerprint: &str,
        ttl_secs: u64,
    ) -> Result<OperationReservation, StoreError> {
        let key = operation_key(key);
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&key)
            .arg(super::encode_running_operation(fingerprint))
            .arg("NX")
            .arg("EX")
            .arg(ttl_secs)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        if set.is_some() {
            return Ok(OperationReservation::Fresh);
        }
        let value: Option<String> = conn.get(&key).await.map_err(unavailable)?;
        // Gone between the two commands (it expired): the caller retries and reserves it.
        Ok(value.map_or(OperationReservation::InProgress, |v| {
            super::decode_operation(&v, fingerprint)
        }))
    }

    async fn finish_operation(
        &self,
        key: &str,
        fingerprint: &str,
        response: &str,
        ttl_secs: u64,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        conn.set_ex::<_, _, ()>(
            operation_key(key),
            super::encode_finished_operation(fingerprint, response),
            ttl_secs,
        )
        .await
        .map_err(unavailable)
    }

    async fn payment_status(
        &self,
        payment_id: &str,
        now: Millis,
    ) -> Result<Option<String>, StoreError> {
        let keys = Keys::of_ordering_key(&crate::payment::ordering_key(payment_id));
        let key = keys.payment(payment_id);
        let member = &key[keys.prefix().len()..];
        let mut conn = self.conn.clone();
        let (status, ends): (Option<String>, Option<f64>) = redis::pipe()
            .get(&key)
            .zscore(keys.expiry(), member)
            .query_async(&mut conn)
            .await
            .map_err(unavailable)?;
        Ok(status.filter(|_| ends.is_none_or(|e| e as Millis > now)))
    }

    async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        let mut pipe = redis::pipe();
        for p in 0..PARTITIONS {
            let keys = Keys::of_partition(p);
            pipe.cmd("EVALSHA")
                .arg(self.scripts.sweep.get_hash())
                .arg(5)
                .arg(keys.expiry())
                .arg(keys.index(None))
                .arg(keys.index(Some(MessageState::Delivered)))
                .arg(keys.index(Some(MessageState::Dead)))
                .arg(keys.index(Some(MessageState::Recorded)))
                .arg(now)
                .arg(SWEEP_LIMIT)
                .arg(keys.prefix());
        }
        let mut conn = self.conn.clone();
        let swept: Vec<usize> = self
            .with_script_loaded(&self.scripts.sweep, &mut conn, &pipe)
            .await?;
        Ok(swept.into_iter().sum())
    }

    async fn depth(&self) -> Result<QueueDepth, StoreError> {
        let mut pipe = redis::pipe();
        for p in 0..PARTITIONS {
            let keys = Keys::of_partition(p);
            for state in [
                MessageState::Pending,
                MessageState::InFlight,
                MessageState::Dead,
            ] {
                pipe.zcard(keys.index(Some(state)));
            }
        }
        let mut conn = self.conn.clone();
        let counts: Vec<u64> = pipe.query_async(&mut conn).await.map_err(unavailable)?;
        let mut depth = QueueDepth::default();
        for chunk in counts.chunks(3) {
            depth.pending += chunk[0];
            depth.in_flight += chunk[1];
            depth.dead += chunk[2];
        }
        Ok(depth)
    }

    async fn oldest_unfinished(&self) -> Result<Option<MessageId>, StoreError> {
        // Ids sort by creation time and the state indexes are lexical: the first member of
        // each is its oldest.
        let mut pipe = redis::pipe();
        for p in 0..PARTITIONS {
            let keys = Keys::of_partition(p);
            for state in [MessageState::Pending, MessageState::InFlight] {
                pipe.zrange(keys.index(Some(state)), 0, 0);
            }
        }
        let mut conn = self.conn.clone();
        let firsts: Vec<Vec<String>> = pipe.query_async(&mut conn).await.map_err(unavailable)?;
        firsts
            .into_iter()
            .flatten()
            .min()
            .map(|id| {
                MessageId::parse(&id)
                    .ok_or_else(|| StoreError::Corrupt(format!("message id `{id}`")))
            })
            .transpose()
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut conn = self.conn.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut conn)
            .await
            .map(|_| ())
            .map_err(unavailable)
    }
}

impl RedisStore {
    async fn ordering_key_of(&self, id: &MessageId) -> Result<Option<String>, StoreError> {
        let mut conn = self.conn.clone();
        let rec: Option<String> = conn
            .hget(Keys::of_id(id).message(id), "rec")
            .await
            .map_err(unavailable)?;
        rec.map(|r| {
            serde_json::from_str::<NewMessage>(&r)
                .map(|m| m.ordering_key)
                .map_err(corrupt)
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::spread;

    #[test]
    fn spread_never_exceeds_the_limit_nor_what_a_partition_has() {
        let available = [0, 3, 0, 1, 10, 0];
        for limit in 0..20 {
            for start in 0..available.len() {
                let quotas = spread(limit, &available, start);
                let total: usize = quotas.iter().sum();
                assert_eq!(total, limit.min(14), "limit {limit} start {start}");
                assert!(quotas.iter().zip(&available).all(|(q, a)| q <= a));
            }
        }
    }

    #[test]
    fn spread_shares_round_robin_from_the_start() {
        assert_eq!(spread(3, &[5, 5, 5, 5], 1), vec![0, 1, 1, 1]);
        assert_eq!(spread(6, &[5, 5, 5, 5], 3), vec![2, 1, 1, 2]);
        assert_eq!(spread(4, &[0, 0], 0), vec![0, 0]);
    }
}
