//! Upgrades a Redis store written by an older callbackd to the layout of this one, in place.
//!
//! Version 1 (the first release) kept lifetimes only as Redis TTLs and trimmed its listing
//! indexes by id on every write. Version 2 decides lifetimes by the caller's clock through a
//! per-partition expiry index, so each expiring key gets its member there (its current TTL
//! becomes its score), finished messages lose their TTL (the sweeper deletes them together
//! with their index entries), and message hashes gain `kh` (hash of the ordering key) and
//! `hn` (history rows ever). Payment states get their own, longer lifetime. Index entries of
//! messages that v1 already expired are dropped.
//!
//! Every step is idempotent (members are added with `NX`, a payment is extended only while
//! it has no member yet), so an upgrade cut short by a crash is simply run again. The version
//! key is written last. Old processes must be stopped first: they would keep writing v1.

use crate::clock::Millis;
use std::collections::HashMap;

use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Value};

use super::{HISTORY_TAIL, MessageState, NewMessage, StoreError};
use crate::digest::short_hash;

/// Keys read per SCAN step and per pipeline.
const PAGE: usize = 500;

fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("upgrading the Redis layout: {e}"))
}

/// Lifetimes the upgrade assigns, all from the upgrading process's configuration.
#[derive(Debug, Clone, Copy)]
pub struct Lifetimes {
    pub retention_secs: u64,
    pub payment_retention_secs: u64,
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

/// Every partition key of every layout.
const PARTITION_KEYS: &str = "cb:{p*}:*";

/// One SCAN step over the partition keys: the next cursor (0 at the end) and a page of keys.
async fn scan_step(
    conn: &mut ConnectionManager,
    cursor: u64,
) -> Result<(u64, Vec<String>), StoreError> {
    redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(PARTITION_KEYS)
        .arg("COUNT")
        .arg(PAGE)
        .query_async(conn)
        .await
        .map_err(unavailable)
}

/// True when the store holds any partition key (so a missing version means version 1).
pub async fn has_data(conn: &mut ConnectionManager) -> Result<bool, StoreError> {
    let mut cursor = 0u64;
    loop {
        let (next, keys) = scan_step(conn, cursor).await?;
        if !keys.is_empty() {
            return Ok(true);
        }
        if next == 0 {
            return Ok(false);
        }
        cursor = next;
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

/// Upgrades every partition key from version 1 to 2, a SCAN page at a time.
pub async fn v1_to_v2(
    conn: &mut ConnectionManager,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<(), StoreError> {
    for pass in [Pass::Records, Pass::Indexes] {
        scan_pass(conn, pass, now, lifetimes).await?;
    }
    Ok(())
}

async fn scan_pass(
    conn: &mut ConnectionManager,
    pass: Pass,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<(), StoreError> {
    let mut cursor = 0u64;
    loop {
        let (next, keys) = scan_step(conn, cursor).await?;
        upgrade_page(conn, &keys, pass, now, lifetimes).await?;
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

async fn upgrade_page(
    conn: &mut ConnectionManager,
    keys: &[String],
    pass: Pass,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<(), StoreError> {
    let retention_ms = lifetimes.retention_secs as i64 * 1000;
    let extension_ms =
        (lifetimes.payment_retention_secs as i64 - lifetimes.retention_secs as i64) * 1000;
    // One MULTI/EXEC per page: a crash never leaves a history trimmed but uncounted.
    let mut writes = redis::pipe();
    writes.atomic();
    for key in keys {
        let Some((prefix, member, kind)) = classify(key) else {
            continue;
        };
        if (pass == Pass::Indexes) != matches!(kind, Kind::Index) {
            continue;
        }
        let expiry = format!("{prefix}x");
        // Score of a key that keeps its current lifetime; a key without a TTL gets the retention.
        let ends = |pttl: i64| now + if pttl > 0 { pttl } else { retention_ms };
        match kind {
            Kind::Dedupe => {
                let pttl: i64 = conn.pttl(key).await.map_err(unavailable)?;
                writes
                    .cmd("ZADD")
                    .arg(&expiry)
                    .arg("NX")
                    .arg(ends(pttl))
                    .arg(member)
                    .ignore();
            }
            Kind::Payment => {
                let (pttl, upgraded): (i64, Option<f64>) = redis::pipe()
                    .pttl(key)
                    .zscore(&expiry, member)
                    .query_async(conn)
                    .await
                    .map_err(unavailable)?;
                if upgraded.is_none() && pttl > 0 {
                    let lifetime = pttl + extension_ms;
                    writes.pexpire(key, lifetime).ignore();
                    writes.zadd(&expiry, member, now + lifetime).ignore();
                }
            }
            Kind::Message(id) => {
                upgrade_message(conn, &mut writes, prefix, &id, now, retention_ms).await?;
            }
            Kind::Index => drop_dangling(conn, &mut writes, prefix, key).await?,
        }
    }
    writes
        .query_async::<Value>(conn)
        .await
        .map_err(unavailable)?;
    Ok(())
}

async fn upgrade_message(
    conn: &mut ConnectionManager,
    writes: &mut redis::Pipeline,
    prefix: &str,
    id: &str,
    now: Millis,
    retention_ms: i64,
) -> Result<(), StoreError> {
    let key = format!("{prefix}m:{id}");
    let attempts = format!("{prefix}a:{id}");
    let (fields, rows, first, pttl): (HashMap<String, String>, i64, Option<String>, i64) =
        redis::pipe()
            .hgetall(&key)
            .llen(&attempts)
            .lindex(&attempts, 0)
            .pttl(&key)
            .query_async(conn)
            .await
            .map_err(unavailable)?;
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
        let ends = now + if pttl > 0 { pttl } else { retention_ms };
        writes
            .cmd("ZADD")
            .arg(format!("{prefix}x"))
            .arg("NX")
            .arg(ends)
            .arg(format!("m:{id}"))
            .ignore();
        writes.persist(&key).ignore();
        writes.persist(&attempts).ignore();
    }
    Ok(())
}

/// Removes the ids of messages that no longer exist from one listing index.
async fn drop_dangling(
    conn: &mut ConnectionManager,
    writes: &mut redis::Pipeline,
    prefix: &str,
    index: &str,
) -> Result<(), StoreError> {
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<String>) = redis::cmd("ZSCAN")
            .arg(index)
            .arg(cursor)
            .arg("COUNT")
            .arg(PAGE)
            .query_async(conn)
            .await
            .map_err(unavailable)?;
        // ZSCAN answers member, score, member, score...
        let ids: Vec<&String> = page.iter().step_by(2).collect();
        let mut exists = redis::pipe();
        for id in &ids {
            exists.exists(format!("{prefix}m:{id}"));
        }
        let present: Vec<bool> = exists.query_async(conn).await.map_err(unavailable)?;
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
