//! Deliveries, failed attempts and dead letters per minute, kept in the store.
//!
//! The console's chart shows the last hour of the whole deployment, not of the process that
//! serves the page, and the same before and after a restart: so the counts live in the store,
//! written by `Store::complete` in the same atomic step as the attempt's history row (a count
//! cannot drift from the history it counts), and read back by every process. Each minute's
//! counts have a lifetime a bit over the hour shown, so the store never grows with them. The
//! minute is the caller's `now`, like every time the store is given.

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::ToSchema;

use super::Completion;
use crate::clock::Millis;

/// Minutes the console shows, up to the current one.
pub const SHOWN_MINUTES: usize = 60;

pub const MINUTE_MS: Millis = 60_000;

/// How long a minute's counts live after the minute starts: the hour shown and another, so a
/// read at any point of a minute finds the whole hour, and the sweep (or Redis' TTL) may come
/// late without a count going missing.
pub const COUNT_LIFETIME_MS: Millis = 2 * 3_600_000;

/// One minute of the deployment's attempts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MinuteCount {
    /// Start of the minute, ms since the epoch.
    pub minute: Millis,
    /// Attempts the receiver accepted (2xx).
    pub deliveries: u64,
    /// Attempts recorded that did not deliver (retried or dead).
    pub failures: u64,
    /// Messages dead-lettered (each also counted in `failures`).
    pub dead: u64,
}

/// What one recorded completion adds to its minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub deliveries: u64,
    pub failures: u64,
    pub dead: u64,
}

impl Tally {
    pub fn of(completion: Completion) -> Tally {
        let (deliveries, failures, dead) = match completion {
            Completion::Delivered => (1, 0, 0),
            Completion::Retry { .. } => (0, 1, 0),
            Completion::Dead => (0, 1, 1),
        };
        Tally {
            deliveries,
            failures,
            dead,
        }
    }

    /// Both tallies' counts together: what several completions of one minute add.
    pub fn plus(self, other: Tally) -> Tally {
        Tally {
            deliveries: self.deliveries + other.deliveries,
            failures: self.failures + other.failures,
            dead: self.dead + other.dead,
        }
    }

    /// The non-zero counts by name (`deliveries`, `failures`, `dead`): what an engine adds.
    pub fn fields(self) -> impl Iterator<Item = (&'static str, u64)> {
        [
            ("deliveries", self.deliveries),
            ("failures", self.failures),
            ("dead", self.dead),
        ]
        .into_iter()
        .filter(|(_, n)| *n > 0)
    }
}

/// The start of `at`'s minute.
pub fn minute_of(at: Millis) -> Millis {
    at.div_euclid(MINUTE_MS) * MINUTE_MS
}

/// The first minute shown at `now`: [`SHOWN_MINUTES`] minutes up to `now`'s.
pub fn first_shown(now: Millis) -> Millis {
    minute_of(now) - (SHOWN_MINUTES as Millis - 1) * MINUTE_MS
}

/// Whether a minute's counts are gone at `now` (their lifetime is over).
pub fn is_gone(minute: Millis, now: Millis) -> bool {
    minute + COUNT_LIFETIME_MS <= now
}

/// The first and last minute a read from `since` at `now` returns: from `since`'s minute, but
/// none whose lifetime is over, to `now`'s. The first is after the last when nothing is left.
pub fn window(since: Millis, now: Millis) -> (Millis, Millis) {
    let first_alive = minute_of(now - COUNT_LIFETIME_MS + MINUTE_MS);
    (minute_of(since).max(first_alive), minute_of(now))
}

/// Rows as an engine read them (several rows of one minute, one per slot or partition) as
/// one per minute, oldest first.
pub fn merge(rows: impl IntoIterator<Item = MinuteCount>) -> Vec<MinuteCount> {
    let mut minutes: BTreeMap<Millis, MinuteCount> = BTreeMap::new();
    for row in rows {
        let sum = minutes.entry(row.minute).or_insert(MinuteCount {
            minute: row.minute,
            ..MinuteCount::default()
        });
        sum.deliveries += row.deliveries;
        sum.failures += row.failures;
        sum.dead += row.dead;
    }
    minutes.into_values().collect()
}

/// The hour shown at `now`, oldest first, one entry per minute, zero where nothing happened,
/// from what [`Store::minute_counts`](super::Store::minute_counts) read.
pub fn last_hour(now: Millis, rows: impl IntoIterator<Item = MinuteCount>) -> Vec<MinuteCount> {
    let first = first_shown(now);
    let mut hour: Vec<MinuteCount> = (0..SHOWN_MINUTES as Millis)
        .map(|i| MinuteCount {
            minute: first + i * MINUTE_MS,
            ..MinuteCount::default()
        })
        .collect();
    for row in merge(rows) {
        let offset = (row.minute - first).div_euclid(MINUTE_MS);
        if let Some(slot) = usize::try_from(offset).ok().and_then(|i| hour.get_mut(i)) {
            *slot = row;
        }
    }
    hour
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_764_460_800_000;

    fn row(minute: Millis, deliveries: u64, failures: u64, dead: u64) -> MinuteCount {
        MinuteCount {
            minute,
            deliveries,
            failures,
            dead,
        }
    }

    #[test]
    fn the_hour_is_sixty_minutes_up_to_nows_with_rows_summed_and_others_left_out() {
        let now = T0 + 59 * MINUTE_MS + 30_000;
        let hour = last_hour(
            now,
            [
                row(T0, 1, 0, 0),
                row(T0, 2, 1, 1),
                row(T0 + 59 * MINUTE_MS, 0, 3, 0),
                // before the hour and after now's minute
                row(T0 - MINUTE_MS, 9, 9, 9),
                row(T0 + 60 * MINUTE_MS, 9, 9, 9),
            ],
        );
        assert_eq!(hour.len(), SHOWN_MINUTES);
        assert_eq!(hour[0], row(T0, 3, 1, 1));
        assert_eq!(hour[59], row(T0 + 59 * MINUTE_MS, 0, 3, 0));
        assert!(hour[1..59].iter().all(|m| m.deliveries + m.failures == 0));
        assert_eq!(hour[1].minute, T0 + MINUTE_MS);
    }

    #[test]
    fn a_completion_counts_one_attempt_and_a_death_also_a_dead_letter() {
        assert_eq!(
            Tally::of(Completion::Delivered)
                .fields()
                .collect::<Vec<_>>(),
            [("deliveries", 1)]
        );
        assert_eq!(
            Tally::of(Completion::Retry { next_at: T0 })
                .fields()
                .collect::<Vec<_>>(),
            [("failures", 1)]
        );
        assert_eq!(
            Tally::of(Completion::Dead).fields().collect::<Vec<_>>(),
            [("failures", 1), ("dead", 1)]
        );
    }

    #[test]
    fn counts_outlive_the_hour_shown_and_then_end() {
        assert!(!is_gone(T0, T0 + 60 * MINUTE_MS));
        assert!(!is_gone(T0, T0 + COUNT_LIFETIME_MS - 1));
        assert!(is_gone(T0, T0 + COUNT_LIFETIME_MS));
        // A read's window starts at the first minute still alive.
        assert_eq!(
            window(T0, T0 + COUNT_LIFETIME_MS - 1),
            (T0, T0 + COUNT_LIFETIME_MS - MINUTE_MS)
        );
        assert_eq!(window(T0, T0 + COUNT_LIFETIME_MS).0, T0 + MINUTE_MS);
        assert_eq!(window(T0 + 30_000, T0 + 90_000), (T0, T0 + MINUTE_MS));
        assert_eq!(minute_of(T0 + 59_999), T0);
        assert_eq!(minute_of(-1), -MINUTE_MS);
    }
}
