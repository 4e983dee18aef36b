//! Phase 5's memory figures: Redis memory per accepted callback (the `used_memory` delta of
//! the day-ahead backlog), per finished callback (accepted, claimed and completed with one
//! attempt in its history, as a month of retention holds them; issue 28's figure), with what
//! each kind of key costs, and per dedupe key (sampled `MEMORY USAGE`, then the exact cost,
//! measured by deleting every dedupe key).

use std::time::{Duration, Instant};

use callbackd::clock::{Clock, SystemClock};
use callbackd::store::redis::RedisStore;

use crate::direct_store::{bulk_accept, store_cycle};
use crate::{DAY_MS, Env, Report, rate};

/// Fills `store` (db 1) with the backlog phase 5 measures against: `future_n` callbacks due
/// in 24 h.
pub async fn backlog(
    env: &Env,
    store: &RedisStore,
    target: &str,
    report: &mut Report,
) -> Result<(), String> {
    let plan = env.plan;
    let tag = &env.run_tag;
    let mem_before = env.redis.used_memory().await?;
    let keys_before = env.redis.dbsize(1).await?;
    eprintln!(
        "  accepting {} messages due in 24 h through Store::accept",
        plan.future_n
    );
    let (future, took) = bulk_accept(
        store,
        &format!("{tag}-future"),
        plan.future_n,
        DAY_MS,
        target,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mem_after = env.redis.used_memory().await?;
    let keys_after = env.redis.dbsize(1).await?;
    report.row(
        "Store::accept direct (256 in flight, one connection)",
        format!(
            "{}/s ({future} in {:.1} s)",
            rate(future as f64 / took.as_secs_f64()),
            took.as_secs_f64()
        ),
    );
    let per_callback = mem_after.saturating_sub(mem_before) as f64 / future.max(1) as f64;
    let keys_per = keys_after.saturating_sub(keys_before) as f64 / future.max(1) as f64;
    report.row(
        "Redis memory per accepted callback (claim + record + queue + indexes; used_memory delta)",
        format!("{per_callback:.0} B ({keys_per:.1} keys per callback)"),
    );
    Ok(())
}

/// The database the finished callbacks are measured in, alone.
const FINISHED_DB: u8 = 2;
/// Finished callbacks measured: the 100k, fewer only if the plan's backlog is smaller.
const FINISHED_N: u64 = 100_000;
/// Keys of each kind whose `MEMORY USAGE` is sampled.
const SAMPLE: usize = 500;

/// Accepts callbacks due now into an empty database and claims and completes each with one
/// delivery attempt: the `used_memory` delta per finished callback, and what each kind of key
/// a finished callback leaves costs (`MEMORY USAGE`, encoding), so that a figure over its
/// target says where the bytes are.
pub async fn finished(env: &Env, target: &str, report: &mut Report) -> Result<(), String> {
    let n = FINISHED_N.min(env.plan.future_n);
    eprintln!("  memory per finished callback: {n} accepted, claimed and completed");
    let store = RedisStore::connect(
        &env.redis.url_db(FINISHED_DB),
        Duration::from_secs(10),
        crate::DEDUPE_TTL_SECS,
    )
    .await
    .map_err(|e| e.to_string())?;
    store
        .upgrade(SystemClock.now_ms())
        .await
        .map_err(|e| e.to_string())?;
    // Loads the scripts and the connection before anything is measured.
    bulk_accept(&store, &format!("{}-fwarm", env.run_tag), 100, 0, target).await?;
    store_cycle(&store, 100).await?;
    let mem_before = env.redis.used_memory().await?;
    let keys_before = env.redis.dbsize(FINISHED_DB).await?;
    let (accepted, _) = bulk_accept(&store, &format!("{}-fin", env.run_tag), n, 0, target).await?;
    let (_, finished) = store_cycle(&store, accepted).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mem_after = env.redis.used_memory().await?;
    let keys_after = env.redis.dbsize(FINISHED_DB).await?;
    let per = mem_after.saturating_sub(mem_before) as f64 / finished.max(1) as f64;
    let keys_per = keys_after.saturating_sub(keys_before) as f64 / finished.max(1) as f64;
    report.target(
        format!(
            "Redis memory per finished callback ({finished} accepted, claimed, completed; one attempt in its history; used_memory delta)"
        ),
        format!("{per:.0} B ({keys_per:.1} keys per callback)"),
        "≤ 600 B",
        Some(per <= 600.0),
    );
    let mut conn = env.redis.conn_db(FINISHED_DB).await?;
    let mut kinds = Vec::new();
    let mut sampled = 0.0;
    for (kind, pattern) in [
        ("message hash m:", "cb:*:m:*"),
        ("history list a:", "cb:*:a:*"),
        ("dedupe claim d:", "cb:*:d:*"),
        (
            "per-transaction index ix:k: (layout 5 and before)",
            "cb:*:ix:k:*",
        ),
    ] {
        let keys = scan(&mut conn, pattern, SAMPLE).await?;
        let Some(first) = keys.first() else {
            continue;
        };
        let usages = memory_usage(&mut conn, &keys).await?;
        let avg = usages.iter().sum::<u64>() as f64 / usages.len().max(1) as f64;
        let encoding = encoding(&mut conn, first).await?;
        sampled += avg;
        kinds.push(format!("{kind} {avg:.0} B ({encoding})"));
    }
    // The key index (layout 6) and the buckets of the delivered state's index (layout 7) are
    // shared: a bucket's memory over the messages it lists.
    for (kind, pattern) in [
        ("key index kx:", "cb:*:kx:*"),
        ("state index fx:delivered:", "cb:*:fx:delivered:*"),
    ] {
        if let Some((per, in_bucket, encoding)) = per_member(&mut conn, pattern).await? {
            sampled += per;
            kinds.push(format!(
                "{kind} {per:.0} B a message ({in_bucket:.1} in a bucket, {encoding})"
            ));
        }
    }
    report.row(
        "Redis memory per finished callback, by key (MEMORY USAGE, a sample of each kind; the rest is the expiry-bucket members, the keyspace and expires entries, and the state index's bounds)",
        format!(
            "{}; rest {:.0} B",
            kinds.join(", "),
            (per - sampled).max(0.0)
        ),
    );
    redis::cmd("FLUSHDB")
        .query_async::<()>(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// For a sample of the sorted sets matching `pattern`, each listing many messages: the
/// `MEMORY USAGE` per member, the members per set, and the first set's encoding.
async fn per_member(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Result<Option<(f64, f64, String)>, String> {
    let buckets = scan(conn, pattern, SAMPLE).await?;
    let Some(first) = buckets.first() else {
        return Ok(None);
    };
    let usage: u64 = memory_usage(conn, &buckets).await?.iter().sum();
    let mut pipe = redis::pipe();
    for bucket in &buckets {
        pipe.zcard(bucket);
    }
    let members: Vec<u64> = pipe.query_async(conn).await.map_err(|e| e.to_string())?;
    let members: u64 = members.iter().sum();
    let encoding = encoding(conn, first).await?;
    Ok(Some((
        usage as f64 / members.max(1) as f64,
        members as f64 / buckets.len() as f64,
        encoding,
    )))
}

/// Up to `limit` names of keys matching `pattern`.
async fn scan(
    conn: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
    limit: usize,
) -> Result<Vec<String>, String> {
    let mut cursor: u64 = 0;
    let mut keys: Vec<String> = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await
            .map_err(|e| e.to_string())?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 || keys.len() >= limit {
            keys.truncate(limit);
            return Ok(keys);
        }
    }
}

/// How Redis keeps `key` (`OBJECT ENCODING`).
async fn encoding(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
) -> Result<String, String> {
    redis::cmd("OBJECT")
        .arg("ENCODING")
        .arg(key)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())
}

/// `MEMORY USAGE` of each of `keys` (every element counted, `SAMPLES 0`).
async fn memory_usage(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[impl AsRef<str>],
) -> Result<Vec<u64>, String> {
    let mut pipe = redis::pipe();
    for k in keys {
        pipe.cmd("MEMORY")
            .arg("USAGE")
            .arg(k.as_ref())
            .arg("SAMPLES")
            .arg(0);
    }
    let usages: Vec<Option<u64>> = pipe.query_async(conn).await.map_err(|e| e.to_string())?;
    Ok(usages.into_iter().flatten().collect())
}

/// Runs after the backlog phase, on every dedupe key it left in db 1.
pub async fn dedupe_keys(env: &Env, report: &mut Report) -> Result<(), String> {
    eprintln!("  measuring dedupe keys");
    let mut conn = env.redis.conn_db(1).await?;
    let mut cursor: u64 = 0;
    let mut keys: Vec<String> = Vec::new();
    let scan_started = Instant::now();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg("cb:*:d:*")
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        keys.extend(batch);
        cursor = next;
        if cursor == 0 || scan_started.elapsed() > Duration::from_secs(120) {
            break;
        }
    }
    let sample: Vec<&String> = keys
        .iter()
        .step_by((keys.len() / 1000).max(1))
        .take(1000)
        .collect();
    let usages = memory_usage(&mut conn, &sample).await?;
    let usage_total: u64 = usages.iter().sum();
    let usage_avg = usage_total as f64 / sample.len().max(1) as f64;
    let key_len = sample.iter().map(|k| k.len()).sum::<usize>() as f64 / sample.len().max(1) as f64;
    let mut value_len = 0usize;
    if let Some(k) = sample.first() {
        let v: Option<String> = redis::cmd("GET")
            .arg(k.as_str())
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        value_len = v.map(|v| v.len()).unwrap_or(0);
    }
    // Exact cost: delete every dedupe key and see how much memory comes back (includes the
    // keyspace and expires dictionary entries, which MEMORY USAGE leaves out).
    let before_delete = env.redis.used_memory().await?;
    for chunk in keys.chunks(1000) {
        redis::cmd("DEL")
            .arg(chunk)
            .query_async::<u64>(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after_delete = env.redis.used_memory().await?;
    let per_key = before_delete.saturating_sub(after_delete) as f64 / keys.len().max(1) as f64;
    report.target(
        format!(
            "Redis memory per dedupe key ({} keys deleted: used_memory delta)",
            keys.len()
        ),
        format!("{per_key:.0} B"),
        "≤ 120 B",
        Some(per_key <= 120.0),
    );
    report.row(
        "Redis MEMORY USAGE per dedupe key (sample of 1000)",
        format!("{usage_avg:.0} B (key {key_len:.0} chars, value {value_len} bytes; excludes the expires entry)"),
    );
    Ok(())
}
