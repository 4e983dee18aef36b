//! Brings a Redis store written by an older callbackd to the layout of this one, in place.
//!
//! Version 1 (the first release) kept lifetimes only as Redis TTLs and trimmed its listing
//! indexes by id on every write. Version 2 decides lifetimes by the caller's clock through a
//! per-partition expiry index, so each expiring key gets its member there (its current TTL
//! becomes its score), finished messages lose their TTL (the sweeper deletes them together
//! with their index entries), and message hashes gain `kh` (hash of the ordering key) and
//! `hn` (history rows ever). Payment states get their own, longer lifetime. Index entries of
//! messages that v1 already expired are dropped.
//!
//! Version 3 keeps each string's end inside its value and expires through hourly buckets
//! instead of a sorted set with a member per key (keys.rs), and has no index of all messages.
//! Each member of a partition's v2 expiry index is rewritten in the v3 form (a dedupe claim
//! under its shorter name, with its remaining Redis TTL; a finished message gets its `end`
//! field) and leaves the v2 index in the same transaction, so a page is upgraded entirely or
//! not at all. The index of all messages is dropped last.
//!
//! Version 4 may keep an inbound callback's dedupe claim as one integer (keys.rs). It rewrites
//! nothing: the string claims of version 3 stay readable until they end, and only the version
//! key changes, so a version-3 binary refuses the store once integers may be in it.
//!
//! Version 5 may keep a message's record compressed, and keeps it in pieces (record.rs). It
//! rewrites nothing either: the whole JSON `rec` of version 4 and before stays readable as it
//! is, and a version-4 binary refuses the store once records in pieces may be in it.
//!
//! Version 6 compresses new records and first history rows against fixed dictionaries
//! (store/record.rs), and lists by ordering key through the shared key index `kx:` (keys.rs).
//! It rewrites nothing: the records and JSON first rows of version 5 stay readable as they
//! are, and its messages stay in their sets `ix:k:<kh>`, read beside the key index until the
//! sweeper empties them. A version-5 binary refuses the store once either new form may be in
//! it, and messages its listing by key would not find.
//!
//! Version 7 lists delivered and recorded messages through buckets of ids (`fx:`, index.lua)
//! instead of one sorted set per state and partition. It rewrites nothing: what version 6
//! ended stays in `ix:delivered` and `ix:recorded`, read beside the buckets and left by each
//! message as it is resent or swept. A version-6 binary refuses the store once messages its
//! listing by state would not find may be in it.
//!
//! Every step is idempotent (members are added with `NX`, a payment is extended only while
//! it has no member yet, a v2 expiry member leaves with its upgrade), so an upgrade cut short
//! by a crash is simply run again. The version key is written last. Old processes must be
//! stopped first: they would keep writing the old layout.
//!
//! Keys are scanned on every primary (each master of a cluster holds its own), and each page's
//! writes are one transaction per partition, since a cluster runs a transaction in one slot.
//!
//! The version-1 and version-2 key names are spelled here rather than taken from `keys.rs`:
//! those layouts are fixed, whatever the current one becomes. Only their prefix comes from
//! there (`store.key_prefix`, `cb` before it was configurable): a store under another prefix
//! is upgraded under it, and never mistakes a neighbour's keys for its own old layout.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use redis::{Cmd, Pipeline, Value};

use super::commands::stored_response;
use super::connection::Primary;
use super::keys::{EXPIRY_BUCKET_MS, Keys, SCHEMA_VERSION};
use super::{RedisStore, unavailable};
use crate::clock::Millis;
use crate::digest::short_hash;
use crate::store::{HISTORY_TAIL, MessageId, MessageState, NewMessage, StoreError};

/// Keys read per SCAN step and per pipeline.
const PAGE: usize = 500;

/// How long the upgrade lock is held: the longest a process waits for another's upgrade.
const UPGRADE_LOCK_MS: u64 = 600_000;

/// How long a string expiry bucket outlives its end (expiry.lua's `BUCKET_GRACE_MS`).
const BUCKET_GRACE_MS: i64 = 86_400_000;

impl RedisStore {
    /// Brings the store to [`SCHEMA_VERSION`] and returns the version it found. A new store
    /// is stamped; a version-1 store (no version key, but data) is upgraded in place; a
    /// store newer than this binary is refused.
    /// The partition count is recorded first, if it is not yet (`partitions.rs`).
    pub async fn upgrade(&self, now: Millis) -> Result<u32, StoreError> {
        let schema_key = self.keys.schema();
        let found: Option<u32> = self.send(&Cmd::get(&schema_key)).await?;
        let found = match found {
            Some(v) => v,
            None if self.has_data().await.map_err(during_upgrade)? => 1,
            None => SCHEMA_VERSION,
        };
        if found > SCHEMA_VERSION {
            return Err(StoreError::Unavailable(format!(
                "the Redis store has layout version {found} ({schema_key}), newer than this \
                 callbackd understands ({SCHEMA_VERSION}); run a newer callbackd"
            )));
        }
        self.record_partitions().await?;
        if found == SCHEMA_VERSION {
            // A new store is stamped; stamping an up-to-date one again changes nothing.
            return self
                .write(&Cmd::set(&schema_key, SCHEMA_VERSION))
                .await
                .map(|()| found);
        }
        // One process upgrades; the others wait for the version key and serve only then, so
        // nothing is written in the new layout while an old-layout read is in flight.
        let token = MessageId::generate(now, "upgrade", self.keys.partitions()).to_string();
        let mut lock = redis::cmd("SET");
        lock.arg(self.keys.upgrade_lock())
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(UPGRADE_LOCK_MS);
        let mine: Option<String> = self.write(&lock).await?;
        if mine.is_none() {
            return self.wait_for_upgrade(found).await;
        }
        if found == 1 {
            self.v1_to_v2(now).await.map_err(during_upgrade)?;
        }
        if found <= 2 {
            self.v2_to_v3(now).await.map_err(during_upgrade)?;
        }
        // Two writes, as the two keys may live on two masters; a crash in between leaves a lock
        // that expires.
        self.write::<()>(&Cmd::set(&schema_key, SCHEMA_VERSION))
            .await?;
        self.write::<()>(&Cmd::del(self.keys.upgrade_lock()))
            .await?;
        // Messages were rewritten behind the claim's back: count every partition again.
        self.hints.forget_all();
        Ok(found)
    }

    /// Waits while another process upgrades (at most the lock's lifetime: a process that died
    /// mid-upgrade leaves a lock that expires, and the next start redoes the idempotent steps).
    async fn wait_for_upgrade(&self, found: u32) -> Result<u32, StoreError> {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(UPGRADE_LOCK_MS);
        while tokio::time::Instant::now() < deadline {
            let version: Option<u32> = self.send(&Cmd::get(self.keys.schema())).await?;
            if version == Some(SCHEMA_VERSION) {
                self.hints.forget_all();
                return Ok(found);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(StoreError::Unavailable(format!(
            "another process has been upgrading the Redis layout for {} s ({}); \
             start again to take over",
            UPGRADE_LOCK_MS / 1000,
            self.keys.upgrade_lock()
        )))
    }

    /// True when the store holds any partition key (so a missing version means version 1).
    pub(super) async fn has_data(&self) -> Result<bool, StoreError> {
        for primary in self.conn.primaries().await.map_err(unavailable)? {
            let mut cursor = 0u64;
            loop {
                let (next, keys) = self.scan_step(&primary, cursor).await?;
                if !keys.is_empty() {
                    return Ok(true);
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(false)
    }

    /// One SCAN step over the partition keys of one primary: the next cursor (0 at the end)
    /// and a page of keys.
    async fn scan_step(
        &self,
        primary: &Primary,
        cursor: u64,
    ) -> Result<(u64, Vec<String>), StoreError> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(self.keys.partition_pattern())
            .arg("COUNT")
            .arg(PAGE);
        self.conn
            .query_at(primary, &scan)
            .await
            .map_err(unavailable)
    }

    /// Upgrades every partition key from version 1 to 2, a SCAN page at a time.
    async fn v1_to_v2(&self, now: Millis) -> Result<(), StoreError> {
        let primaries = self.conn.primaries().await.map_err(unavailable)?;
        for pass in [Pass::Records, Pass::Indexes] {
            for primary in &primaries {
                let mut cursor = 0u64;
                loop {
                    let (next, keys) = self.scan_step(primary, cursor).await?;
                    self.upgrade_page(&keys, pass, now).await?;
                    if next == 0 {
                        break;
                    }
                    cursor = next;
                }
            }
        }
        Ok(())
    }

    async fn upgrade_page(
        &self,
        keys: &[String],
        pass: Pass,
        now: Millis,
    ) -> Result<(), StoreError> {
        let retention_ms = self.retention_secs as i64 * 1000;
        let extension_ms = (self.payment_retention_secs as i64 - self.retention_secs as i64) * 1000;
        // Score of a key that keeps its current lifetime; a key without a TTL gets the retention.
        let ends = |pttl: i64| now + if pttl > 0 { pttl } else { retention_ms };
        // One MULTI/EXEC per partition of the page: a crash never leaves a history trimmed but
        // uncounted.
        let mut per_partition: BTreeMap<&str, Pipeline> = BTreeMap::new();
        for key in keys {
            let Some((prefix, member, kind)) = classify(key) else {
                continue;
            };
            if (pass == Pass::Indexes) != matches!(kind, Kind::Index) {
                continue;
            }
            let writes = per_partition.entry(prefix).or_insert_with(|| {
                let mut writes = redis::pipe();
                writes.atomic();
                writes
            });
            let expiry = format!("{prefix}x");
            match kind {
                Kind::Dedupe => {
                    let pttl: i64 = self.send(&Cmd::pttl(key)).await?;
                    writes
                        .cmd("ZADD")
                        .arg(&expiry)
                        .arg("NX")
                        .arg(ends(pttl))
                        .arg(member)
                        .ignore();
                }
                Kind::Payment => {
                    let mut read = redis::pipe();
                    read.pttl(key).zscore(&expiry, member);
                    let (pttl, upgraded): (i64, Option<f64>) = self.send(&read).await?;
                    if upgraded.is_none() && pttl > 0 {
                        let lifetime = pttl + extension_ms;
                        writes.pexpire(key, lifetime).ignore();
                        writes.zadd(&expiry, member, now + lifetime).ignore();
                    }
                }
                Kind::Message(id) => {
                    self.upgrade_message(writes, prefix, &id, ends).await?;
                }
                Kind::Index => self.drop_dangling(writes, prefix, key).await?,
            }
        }
        for writes in per_partition.values() {
            self.write::<Value>(writes).await?;
        }
        Ok(())
    }

    async fn upgrade_message(
        &self,
        writes: &mut redis::Pipeline,
        prefix: &str,
        id: &str,
        ends: impl Fn(i64) -> Millis,
    ) -> Result<(), StoreError> {
        let key = format!("{prefix}m:{id}");
        let attempts = format!("{prefix}a:{id}");
        let mut read = redis::pipe();
        read.hgetall(&key)
            .llen(&attempts)
            .lindex(&attempts, 0)
            .pttl(&key);
        let (fields, rows, first, pttl): (HashMap<String, String>, i64, Option<String>, i64) =
            self.send(&read).await?;
        let Some(rec) = fields.get("rec") else {
            return Ok(());
        };
        let message: NewMessage = serde_json::from_str(rec)
            .map_err(|e| StoreError::Corrupt(format!("message {id} during upgrade: {e}")))?;
        writes
            .hset(&key, "kh", short_hash(message.ordering_key.as_bytes()))
            .ignore();
        if !fields.contains_key("hn") {
            writes.hset(&key, "hn", rows).ignore();
        }
        // v1 kept every row; keep the first and the latest HISTORY_TAIL, as v2 does.
        if let Some(first) = first.filter(|_| rows > HISTORY_TAIL as i64 + 1) {
            writes
                .ltrim(&attempts, -(HISTORY_TAIL as isize), -1)
                .ignore();
            writes.lpush(&attempts, first).ignore();
        }
        let finished = fields
            .get("state")
            .and_then(|s| MessageState::parse(s))
            .is_some_and(|s| {
                matches!(
                    s,
                    MessageState::Delivered | MessageState::Dead | MessageState::Recorded
                )
            });
        if finished {
            writes
                .cmd("ZADD")
                .arg(format!("{prefix}x"))
                .arg("NX")
                .arg(ends(pttl))
                .arg(format!("m:{id}"))
                .ignore();
            writes.persist(&key).ignore();
            writes.persist(&attempts).ignore();
        }
        Ok(())
    }

    /// Removes the ids of messages that no longer exist from one listing index.
    async fn drop_dangling(
        &self,
        writes: &mut redis::Pipeline,
        prefix: &str,
        index: &str,
    ) -> Result<(), StoreError> {
        let mut cursor = 0u64;
        loop {
            let mut scan = redis::cmd("ZSCAN");
            scan.arg(index).arg(cursor).arg("COUNT").arg(PAGE);
            let (next, page): (u64, Vec<String>) = self.send(&scan).await?;
            // ZSCAN answers member, score, member, score...
            let ids: Vec<&String> = page.iter().step_by(2).collect();
            let mut exists = redis::pipe();
            for id in &ids {
                exists.exists(format!("{prefix}m:{id}"));
            }
            let present: Vec<bool> = self.send(&exists).await?;
            for (id, present) in ids.iter().zip(present) {
                if !present {
                    writes.zrem(index, id.as_str()).ignore();
                }
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }
}

impl RedisStore {
    /// Upgrades every partition from version 2 to 3, a page of its v2 expiry index at a time.
    async fn v2_to_v3(&self, now: Millis) -> Result<(), StoreError> {
        for keys in self.keys.all() {
            let prefix = keys.prefix();
            let v2_expiry = format!("{prefix}x");
            loop {
                let mut page = redis::cmd("ZRANGE");
                page.arg(&v2_expiry).arg(0).arg(PAGE - 1).arg("WITHSCORES");
                let members: Vec<(String, f64)> = self.send(&page).await?;
                if members.is_empty() {
                    break;
                }
                // A string's value, or a message's record (present while the message is).
                let mut read = redis::pipe();
                for (member, _) in &members {
                    let key = format!("{prefix}{member}");
                    if member.starts_with("m:") {
                        read.hget(&key, "rec");
                    } else {
                        read.get(&key);
                    }
                    read.pttl(&key);
                }
                let found: Vec<(Option<String>, i64)> = self.send(&read).await?;
                let mut writes = redis::pipe();
                writes.atomic();
                for ((member, ends), (value, pttl)) in members.iter().zip(found) {
                    let ends = *ends as Millis;
                    upgrade_expiring(&mut writes, &keys, member, ends, value, pttl, now)?;
                    writes.zrem(&v2_expiry, member).ignore();
                }
                self.write::<Value>(&writes).await?;
            }
            self.write::<()>(&Cmd::del(format!("{prefix}ix"))).await?;
        }
        Ok(())
    }
}

/// Adds the v3 form of one member of a v2 expiry index, ending at `ends`, to `writes`: the
/// string (its v2 `value` and `pttl`) or the message (`value` is its record, `None` when it is
/// gone), and its expiry bucket member.
fn upgrade_expiring(
    writes: &mut redis::Pipeline,
    keys: &Keys,
    member: &str,
    ends: Millis,
    value: Option<String>,
    pttl: i64,
    now: Millis,
) -> Result<(), StoreError> {
    let prefix = keys.prefix();
    let old = format!("{prefix}{member}");
    let pttl = if pttl > 0 { pttl } else { (ends - now).max(1) };
    let v3_member = if member.starts_with("m:") {
        if value.is_some() {
            writes.hset(&old, "end", ends).ignore();
            add_expiry(writes, prefix, "xm", member, ends, now);
        }
        return Ok(());
    } else if let Some(claim_key) = member.strip_prefix("d:") {
        let Some(value) = value else { return Ok(()) };
        let (fingerprint, response) = value.split_once('\n').ok_or_else(|| {
            StoreError::Corrupt(format!("dedupe claim {old} during upgrade: no fingerprint"))
        })?;
        let new = keys.dedupe(claim_key);
        let payload = format!("{ends}|{fingerprint}\n{}", stored_response(response));
        writes.del(&old).ignore();
        writes.pset_ex(&new, payload, pttl as u64).ignore();
        keys.member(&new).to_string()
    } else if member.starts_with("s:") {
        let Some(value) = value else { return Ok(()) };
        let payload = format!("{ends}|{}", stored_response(&value));
        writes.pset_ex(&old, payload, pttl as u64).ignore();
        member.to_string()
    } else if member.starts_with("pay:") {
        let Some(value) = value else { return Ok(()) };
        writes
            .pset_ex(&old, format!("{ends}|{value}"), pttl as u64)
            .ignore();
        member.to_string()
    } else {
        return Ok(());
    };
    add_expiry(writes, prefix, "x", &v3_member, ends, now);
    Ok(())
}

/// expiry.lua's `add_expiry`, for the upgrade.
fn add_expiry(
    writes: &mut redis::Pipeline,
    prefix: &str,
    kind: &str,
    member: &str,
    ends: Millis,
    now: Millis,
) {
    let bucket_ms = EXPIRY_BUCKET_MS as i64;
    let b = ends.div_euclid(bucket_ms);
    let name = format!("{kind}:{b}");
    let list = format!("{prefix}{name}");
    writes.rpush(&list, member).ignore();
    writes
        .zadd(format!("{prefix}xb"), &name, b * bucket_ms)
        .ignore();
    if kind == "x" {
        let lifetime = ((b + 1) * bucket_ms - now).max(1) + BUCKET_GRACE_MS;
        writes.pexpire(&list, lifetime).ignore();
    }
}

/// Names the upgrade in an error of the store being unavailable.
fn during_upgrade(e: StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(why) => {
            StoreError::Unavailable(format!("upgrading the Redis layout: {why}"))
        }
        corrupt => corrupt,
    }
}

/// What one scan over the keys upgrades.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Claims, payments and messages. After it no finished message expires by a v1 TTL any
    /// more, so the next pass sees every message that will ever be swept.
    Records,
    /// Listing indexes: ids of messages v1 already expired are dropped.
    Indexes,
}

/// One key of a v1 partition and what it is.
enum Kind {
    Dedupe,
    Payment,
    Message(String),
    Index,
}

/// Splits `cb:{pNN}:<rest>` into the partition prefix and the kind of `<rest>`.
fn classify(key: &str) -> Option<(&str, &str, Kind)> {
    let end = key.find("}:")? + 2;
    let (prefix, rest) = key.split_at(end);
    let kind = if rest.starts_with("d:") {
        Kind::Dedupe
    } else if rest.starts_with("pay:") {
        Kind::Payment
    } else if let Some(id) = rest.strip_prefix("m:") {
        Kind::Message(id.to_string())
    } else if rest.starts_with("ix") {
        Kind::Index
    } else {
        return None;
    };
    Some((prefix, rest, kind))
}
