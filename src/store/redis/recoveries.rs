//! The Redis side of recoveries (store/recoveries.rs).
//!
//! Inbound counts: one small hash per partition, hour and source, `in:<hour>:<source>`,
//! whose fields are the minute of the hour and a letter (`17n`: minute 17's new events, `r`
//! replays). accept.lua adds to it with one `HINCRBY` and a `PEXPIRE` on a key of the
//! message's own partition, in the accept's atomic step and, on Redis Cluster, in its slot,
//! as apply.lua counts completions (counts.rs). A read sums the hashes of the window's hours
//! of every partition. Each hash lives until the last minute it holds has outlived
//! [`INBOUND_COUNT_LIFETIME_MS`], by a Redis TTL: no sweep needed.
//!
//! Recoveries: one hash, `<prefix>:recoveries`, id → JSON, trimmed by every save to what
//! [`recoveries::to_drop`] leaves (at most 100 fields), with a TTL of the lifetime so a store
//! that stops saving them does not keep them.

use std::collections::HashMap;

use redis::Cmd;

use super::RedisStore;
use super::counts::{hash_lifetime_ms, minute_of_hour, read_minutes};
use crate::clock::Millis;
use crate::store::StoreError;
use crate::store::recoveries::{
    self, INBOUND_COUNT_LIFETIME_MS, InboundCount, RECOVERY_LIFETIME_MS, Recovery,
};

/// The field prefix (minute of the hour) an accept at `now` adds to.
pub(super) fn field(now: Millis) -> String {
    minute_of_hour(now).to_string()
}

/// How long (ms from `now`) the hash of `now`'s hour lives.
pub(super) fn lifetime_ms(now: Millis) -> Millis {
    hash_lifetime_ms(now, INBOUND_COUNT_LIFETIME_MS)
}

/// Store::inbound_counts: the source's hashes of every hour of the window, every partition.
pub(super) async fn inbound_counts(
    store: &RedisStore,
    source: &str,
    since: Millis,
    until: Millis,
    now: Millis,
) -> Result<InboundCount, StoreError> {
    let (first, last) = recoveries::count_window(since, until, now);
    let fields = read_minutes(store, first, last, |keys, hour| {
        keys.inbound_counts(hour, source)
    })
    .await?;
    let mut sum = InboundCount::default();
    for field in fields {
        match field.letter {
            'n' => sum.new += field.n,
            'r' => sum.replays += field.n,
            _ => {}
        }
    }
    Ok(sum)
}

/// Store::save_recovery: the field, then the trim (a second round trip: a recovery is saved a
/// few times in its life, and a trim that is late by one save keeps one more for a while).
pub(super) async fn save(
    store: &RedisStore,
    recovery: &Recovery,
    now: Millis,
) -> Result<(), StoreError> {
    let key = store.keys.recoveries();
    let json = serde_json::to_string(recovery).map_err(super::corrupt)?;
    let mut pipe = redis::pipe();
    pipe.hset(&key, &recovery.id, json)
        .ignore()
        .pexpire(&key, RECOVERY_LIFETIME_MS)
        .ignore()
        .hkeys(&key);
    let (ids,): (Vec<String>,) = store.write(&pipe).await?;
    let held = ids
        .into_iter()
        .map(|id| {
            let started = recoveries::started_at_of(&id).unwrap_or(Millis::MIN / 2);
            (id, started)
        })
        .collect();
    let dropped = recoveries::to_drop(held, now);
    if !dropped.is_empty() {
        let _: i64 = store.write(&Cmd::hdel(&key, dropped)).await?;
    }
    Ok(())
}

/// Store::recoveries: the live ones, newest first.
pub(super) async fn list(store: &RedisStore, now: Millis) -> Result<Vec<Recovery>, StoreError> {
    let all: HashMap<String, String> = store.send(&Cmd::hgetall(store.keys.recoveries())).await?;
    let mut kept = all
        .values()
        .map(|json| serde_json::from_str::<Recovery>(json).map_err(super::corrupt))
        .collect::<Result<Vec<_>, _>>()?;
    kept.retain(|r| r.is_live(now));
    kept.sort_by(|a, b| b.id.cmp(&a.id));
    kept.truncate(recoveries::MAX_RECOVERIES);
    Ok(kept)
}

/// Store::recovery.
pub(super) async fn get(
    store: &RedisStore,
    id: &str,
    now: Millis,
) -> Result<Option<Recovery>, StoreError> {
    let json: Option<String> = store.send(&Cmd::hget(store.keys.recoveries(), id)).await?;
    let recovery = json
        .map(|json| serde_json::from_str::<Recovery>(&json).map_err(super::corrupt))
        .transpose()?;
    Ok(recovery.filter(|r| r.is_live(now)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::counts::MINUTE_MS;

    const T0: Millis = 1_764_460_800_000; // an hour's start

    #[test]
    fn an_accept_counts_in_its_minute_and_the_hash_outlives_its_last_minute() {
        assert_eq!(field(T0 + 17 * MINUTE_MS + 5_000), "17");
        let now = T0 + 10 * MINUTE_MS;
        let ends = now + lifetime_ms(now);
        assert!(recoveries::count_is_gone(T0 + 59 * MINUTE_MS, ends));
        assert!(!recoveries::count_is_gone(
            T0 + 59 * MINUTE_MS,
            ends - MINUTE_MS - 1
        ));
    }
}
