//! The Redis side of the attempts per minute (store/counts.rs): one small hash per partition
//! and hour, `n:<hour>`, whose fields are the minute of the hour and a letter (`17d`: minute
//! 17's deliveries, `f` failures, `x` dead letters).
//!
//! Why this shape: apply.lua counts a completion with one `HINCRBY` (two for a death) and a
//! `PEXPIRE` on a key of the message's own partition, so the count is in the same atomic step
//! as the attempt's history row and, on Redis Cluster, in the same slot. A read of the hour
//! shown is two `HGETALL`s per partition (this hour and the one before), summed in Rust. One
//! hash per minute would cost sixty reads per partition instead, and one key for the whole
//! store would put every completion of a cluster on one master. Each hash lives until the
//! last minute it holds has outlived [`COUNT_LIFETIME_MS`], by a Redis TTL, so no sweep is
//! needed and a full store holds at most three hours of them per partition (at most 180
//! small integer fields each).

use std::collections::HashMap;

use redis::Pipeline;

use super::RedisStore;
use super::connection::Sent;
use super::keys::Keys;
use crate::clock::Millis;
use crate::store::StoreError;
use crate::store::counts::{self, COUNT_LIFETIME_MS, MINUTE_MS, MinuteCount, Tally};

pub(super) const HOUR_MS: Millis = 3_600_000;

/// The hour (ms since the epoch / 1 h) whose hash holds `now`'s minute.
pub(super) fn hour_of(now: Millis) -> Millis {
    now.div_euclid(HOUR_MS)
}

/// The minute of the hour that `now`'s fields start with (`17` in `17d`).
pub(super) fn minute_of_hour(now: Millis) -> Millis {
    now.rem_euclid(HOUR_MS) / MINUTE_MS
}

/// How long (ms from `now`) an hourly hash of `now`'s hour lives when its counts are kept
/// `lifetime` ms: until its last minute's counts are gone.
pub(super) fn hash_lifetime_ms(now: Millis, lifetime: Millis) -> Millis {
    ((hour_of(now) + 1) * HOUR_MS + lifetime - now).max(1)
}

/// One field of an hourly hash: the start of its minute (ms), its letter, its count.
pub(super) struct MinuteField {
    pub(super) minute: Millis,
    pub(super) letter: char,
    pub(super) n: u64,
}

/// The fields of hour `hour`'s hash; a field not of the form `<minute><letter>` is left out.
fn fields(hour: Millis, hash: HashMap<String, u64>) -> impl Iterator<Item = MinuteField> {
    hash.into_iter().filter_map(move |(field, n)| {
        let letter = field.chars().last()?;
        let minute: Millis = field[..field.len() - letter.len_utf8()].parse().ok()?;
        Some(MinuteField {
            minute: hour * HOUR_MS + minute * MINUTE_MS,
            letter,
            n,
        })
    })
}

/// Every partition's hourly hashes named by `name` for the hours of `[first, last]`, in one
/// pipeline per partition: their fields whose minute lies in `[first, last]`.
pub(super) async fn read_minutes(
    store: &RedisStore,
    first: Millis,
    last: Millis,
    name: impl Fn(&Keys, Millis) -> String,
) -> Result<Vec<MinuteField>, StoreError> {
    if first > last {
        return Ok(Vec::new());
    }
    let hours: Vec<Millis> = (hour_of(first)..=hour_of(last)).collect();
    let pipes: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let mut pipe = redis::pipe();
            for hour in &hours {
                pipe.hgetall(name(&keys, *hour));
            }
            pipe
        })
        .collect();
    let hashes: Vec<Vec<HashMap<String, u64>>> = store.every_partition(Sent::Read, &pipes).await?;
    Ok(hashes
        .into_iter()
        .flat_map(|partition| {
            hours
                .iter()
                .zip(partition)
                .flat_map(|(hour, hash)| fields(*hour, hash))
                .collect::<Vec<_>>()
        })
        .filter(|field| (first..=last).contains(&field.minute))
        .collect())
}

/// The fields a completion at `now` adds to, with how much: what apply.lua `HINCRBY`s.
pub(super) fn increments(tally: Tally, now: Millis) -> Vec<(String, u64)> {
    let minute = minute_of_hour(now);
    tally
        .fields()
        .map(|(name, n)| {
            let letter = match name {
                "deliveries" => 'd',
                "failures" => 'f',
                _ => 'x',
            };
            (format!("{minute}{letter}"), n)
        })
        .collect()
}

/// How long (ms from `now`) the hash of `now`'s hour lives.
pub(super) fn lifetime_ms(now: Millis) -> Millis {
    hash_lifetime_ms(now, COUNT_LIFETIME_MS)
}

/// Store::minute_counts: the hashes of every hour of the window (at most three, since no
/// read reaches past the lifetime) of every partition, summed by minute.
pub(super) async fn minute_counts(
    store: &RedisStore,
    since: Millis,
    now: Millis,
) -> Result<Vec<MinuteCount>, StoreError> {
    let (first, last) = counts::window(since, now);
    let fields = read_minutes(store, first, last, |keys, hour| keys.counts(hour)).await?;
    Ok(counts::merge(fields.into_iter().filter_map(row)))
}

/// The row of one field; a letter this code does not know is left out.
fn row(field: MinuteField) -> Option<MinuteCount> {
    let mut row = MinuteCount {
        minute: field.minute,
        ..MinuteCount::default()
    };
    match field.letter {
        'd' => row.deliveries = field.n,
        'f' => row.failures = field.n,
        'x' => row.dead = field.n,
        _ => return None,
    }
    Some(row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Completion;

    const T0: Millis = 1_764_460_800_000; // an hour's start

    #[test]
    fn a_completion_adds_to_its_minute_of_the_hour_and_reads_back_as_that_minute() {
        let now = T0 + 17 * MINUTE_MS + 5_000;
        let added = increments(Tally::of(Completion::Dead), now);
        assert_eq!(added, [("17f".to_string(), 1), ("17x".to_string(), 1)]);
        let hash: HashMap<String, u64> = added.into_iter().collect();
        assert_eq!(
            counts::merge(fields(hour_of(now), hash).filter_map(row)),
            [MinuteCount {
                minute: T0 + 17 * MINUTE_MS,
                deliveries: 0,
                failures: 1,
                dead: 1
            }]
        );
    }

    #[test]
    fn an_hours_hash_lives_until_its_last_minute_is_gone() {
        let last_minute = T0 + 59 * MINUTE_MS;
        let now = T0 + 10 * MINUTE_MS;
        let ends = now + lifetime_ms(now);
        assert!(counts::is_gone(last_minute, ends));
        assert!(!counts::is_gone(last_minute, ends - MINUTE_MS - 1));
        assert!(ends - T0 <= COUNT_LIFETIME_MS + HOUR_MS);
    }
}
