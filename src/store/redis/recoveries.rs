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

use redis::{Cmd, Pipeline};

use super::RedisStore;
use super::connection::Sent;
use super::counts::hour_of;
use crate::clock::Millis;
use crate::store::StoreError;
use crate::store::counts::MINUTE_MS;
use crate::store::recoveries::{
    self, INBOUND_COUNT_LIFETIME_MS, InboundCount, RECOVERY_LIFETIME_MS, Recovery,
};

const HOUR_MS: Millis = 3_600_000;

/// The field prefix (minute of the hour) an accept at `now` adds to.
pub(super) fn field(now: Millis) -> String {
    (now.rem_euclid(HOUR_MS) / MINUTE_MS).to_string()
}

/// How long (ms from `now`) the hash of `now`'s hour lives: until its last minute's counts
/// are gone.
pub(super) fn lifetime_ms(now: Millis) -> Millis {
    ((hour_of(now) + 1) * HOUR_MS + INBOUND_COUNT_LIFETIME_MS - now).max(1)
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
    if first > last {
        return Ok(InboundCount::default());
    }
    let hours: Vec<Millis> = (hour_of(first)..=hour_of(last)).collect();
    let pipes: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let mut pipe = redis::pipe();
            for hour in &hours {
                pipe.hgetall(keys.inbound_counts(*hour, source));
            }
            pipe
        })
        .collect();
    let hashes: Vec<Vec<HashMap<String, u64>>> = store.every_partition(Sent::Read, &pipes).await?;
    let mut sum = InboundCount::default();
    for partition in hashes {
        for (hour, hash) in hours.iter().zip(partition) {
            for (field, n) in hash {
                let Some((minute, letter)) =
                    field.len().checked_sub(1).map(|at| field.split_at(at))
                else {
                    continue;
                };
                let Ok(minute) = minute.parse::<Millis>() else {
                    continue;
                };
                if !(first..=last).contains(&(hour * HOUR_MS + minute * MINUTE_MS)) {
                    continue;
                }
                match letter {
                    "n" => sum.new += n,
                    "r" => sum.replays += n,
                    _ => {}
                }
            }
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
