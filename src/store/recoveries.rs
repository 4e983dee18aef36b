//! Provider-side recoveries (issue #27): what the store keeps of one, and the inbound accepts
//! per source and minute that its report is read from.
//!
//! A recovery asks a provider to resend its callbacks of a time range. What arrives is
//! ordinary callbacks, accepted by whichever process the provider reaches, so no process can
//! tell a resent callback from a live one, and none sees them all. The store can: every
//! engine counts each inbound accept of a source in its minute, as **new** (the event was
//! recorded) or **replay** (the dedupe key was already claimed and the first answer given
//! again), in the same atomic step as the accept itself (no round trip of its own). A
//! recovery's report is the sum of its source's counts from the minute it started to the end
//! of its counting window, less what that first minute held when it started (its
//! `baseline`), read by any process alike. So it counts the source's ordinary traffic of that
//! period too: it is exact for a source that is otherwise quiet, and an upper
//! bound otherwise (docs/operations.md says so).
//!
//! Both are bounded: a minute's counts live [`INBOUND_COUNT_LIFETIME_MS`] (the sweep, or a
//! Redis TTL, removes them), a recovery [`RECOVERY_LIFETIME_MS`], and the store keeps the
//! newest [`MAX_RECOVERIES`] at most. Once its counting window is over, a recovery read by
//! the use case gets its figures written in (`settled`), so they outlive the counts.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::counts::{MINUTE_MS, minute_of};
use super::{AcceptOutcome, AcceptRequest, MessageKind};
use crate::clock::Millis;

const DAY_MS: Millis = 86_400_000;

/// How long a minute's inbound counts live after the minute starts: past the longest
/// counting window a recovery may ask for ([`MAX_COUNT_MS`]) with a day to spare, in which a
/// read of the recovery settles its figures.
pub const INBOUND_COUNT_LIFETIME_MS: Millis = 2 * DAY_MS;

/// The longest counting window of a recovery.
pub const MAX_COUNT_MS: Millis = DAY_MS;

/// How long a recovery is kept after it started.
pub const RECOVERY_LIFETIME_MS: Millis = 30 * DAY_MS;

/// Most recoveries kept: the oldest go first.
pub const MAX_RECOVERIES: usize = 100;

/// How an inbound accept counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The event was recorded now.
    New,
    /// The dedupe key was already claimed: the first answer, given again.
    Replay,
}

impl Arrival {
    /// What an accept of `req` that answered `outcome` counts, and for which source: only a
    /// provider callback (an inbound message with a source) that was recorded or replayed.
    /// A refusal counts nothing, since nothing arrived that the report should show.
    pub fn of<'r>(req: &'r AcceptRequest, outcome: &AcceptOutcome) -> Option<(&'r str, Arrival)> {
        if req.message.kind != MessageKind::Inbound {
            return None;
        }
        let source = req.message.source.as_deref()?;
        match outcome {
            AcceptOutcome::Accepted => Some((source, Arrival::New)),
            AcceptOutcome::Replayed { .. } => Some((source, Arrival::Replay)),
            _ => None,
        }
    }

    /// What it adds to its minute's [`InboundCount`].
    pub fn count(self) -> InboundCount {
        match self {
            Arrival::New => InboundCount { new: 1, replays: 0 },
            Arrival::Replay => InboundCount { new: 0, replays: 1 },
        }
    }
}

/// Inbound accepts of one source: new events and replays.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct InboundCount {
    /// Callbacks recorded as new events.
    pub new: u64,
    /// Callbacks whose event was already recorded (the dedupe absorbed them).
    pub replays: u64,
}

impl InboundCount {
    pub fn plus(self, other: InboundCount) -> InboundCount {
        InboundCount {
            new: self.new + other.new,
            replays: self.replays + other.replays,
        }
    }

    /// What `self` counted beyond `earlier` (a count never goes down; the saturation only
    /// guards against counts that were swept in between).
    pub fn since(self, earlier: InboundCount) -> InboundCount {
        InboundCount {
            new: self.new.saturating_sub(earlier.new),
            replays: self.replays.saturating_sub(earlier.replays),
        }
    }
}

/// The first and last minute a read of counts from `since` to `until` at `now` sums: from
/// `since`'s minute, but none whose lifetime is over, to `until`'s or `now`'s, whichever is
/// first. The first is after the last when nothing is left.
pub fn count_window(since: Millis, until: Millis, now: Millis) -> (Millis, Millis) {
    let first_alive = minute_of(now - INBOUND_COUNT_LIFETIME_MS + MINUTE_MS);
    (minute_of(since).max(first_alive), minute_of(until.min(now)))
}

/// Whether a minute's inbound counts are gone at `now`.
pub fn count_is_gone(minute: Millis, now: Millis) -> bool {
    minute + INBOUND_COUNT_LIFETIME_MS <= now
}

/// One recovery as the store keeps it (as JSON in every engine: it is read whole, never
/// queried by its fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Recovery {
    /// `rec_` + the start in ms (12 hex digits) + 8 random hex digits: sorts by start.
    pub id: String,
    pub source: String,
    pub started_at: Millis,
    /// The range asked for, `[from, to)`.
    pub from: Millis,
    pub to: Millis,
    /// Arrivals of the source are counted from `started_at`'s minute to this time's.
    pub count_until: Millis,
    /// The range split in windows the provider accepts, each with what it answered.
    pub windows: Vec<RecoveryWindow>,
    /// What the source's counts already held of `started_at`'s minute when it started: taken
    /// off its figures, so what arrived earlier in that minute is not reported as its own.
    #[serde(default)]
    pub baseline: InboundCount,
    /// The figures, written once the counting window is over; until then they are read from
    /// the counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settled: Option<InboundCount>,
}

/// One window of a recovery, `[from, to)`, and the provider's answer to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RecoveryWindow {
    pub from: Millis,
    pub to: Millis,
    pub state: WindowState,
    /// Callbacks the provider said it would resend (its `total`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total: Option<u64>,
    /// Why the window failed: the provider's status and the start of its body, or the
    /// transport error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Requests sent for this window (retries included).
    pub attempts: u32,
}

/// Where a window stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WindowState {
    /// Not sent yet (or its recovery stopped before it: the process ended).
    Pending,
    /// The provider accepted it.
    Sent,
    /// The provider refused it, or could not be reached, after the retries.
    Failed,
}

impl Recovery {
    /// The id of a recovery started at `started_at`.
    pub fn new_id(started_at: Millis) -> String {
        format!(
            "rec_{:012x}{:08x}",
            started_at.max(0),
            rand::random::<u32>()
        )
    }

    /// Whether it is still kept at `now`.
    pub fn is_live(&self, now: Millis) -> bool {
        self.started_at + RECOVERY_LIFETIME_MS > now
    }
}

/// When the recovery of `id` started, read from the id.
pub fn started_at_of(id: &str) -> Option<Millis> {
    let hex = id.strip_prefix("rec_")?.get(..12)?;
    Millis::from_str_radix(hex, 16).ok()
}

/// Whether `id` has the shape of a recovery id: what a store may be asked to look up.
pub fn is_recovery_id(id: &str) -> bool {
    id.strip_prefix("rec_")
        .is_some_and(|hex| hex.len() == 20 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Of the recoveries a store holds (id and start), those to delete at `now`: the ones past
/// their lifetime, and all but the newest [`MAX_RECOVERIES`]. Ids sort by start.
pub fn to_drop(mut held: Vec<(String, Millis)>, now: Millis) -> Vec<String> {
    held.sort_by(|a, b| b.0.cmp(&a.0));
    held.into_iter()
        .enumerate()
        .filter(|(i, (_, started))| *i >= MAX_RECOVERIES || started + RECOVERY_LIFETIME_MS <= now)
        .map(|(_, (id, _))| id)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Millis = 1_764_460_800_000;

    #[test]
    fn ids_sort_by_start_and_are_recognised() {
        let (a, b) = (Recovery::new_id(T0), Recovery::new_id(T0 + 1));
        assert!(a < b);
        assert_eq!(started_at_of(&a), Some(T0));
        assert!(is_recovery_id(&a) && is_recovery_id(&b));
        for bad in ["rec_", "rec_xyz", "msg_0123", "rec_0123456789abcdef012g"] {
            assert!(!is_recovery_id(bad), "{bad}");
        }
    }

    #[test]
    fn the_oldest_and_the_expired_are_dropped() {
        let held: Vec<(String, Millis)> = (0..MAX_RECOVERIES as Millis + 3)
            .map(|i| (Recovery::new_id(T0 + i), T0 + i))
            .collect();
        let dropped = to_drop(held.clone(), T0 + 1000);
        assert_eq!(dropped.len(), 3);
        assert!(dropped.contains(&held[0].0) && dropped.contains(&held[2].0));
        // Started at T0 to T0 + 5: six past their lifetime, the three oldest beyond the bound.
        let later = to_drop(held, T0 + RECOVERY_LIFETIME_MS + 5);
        assert_eq!(later.len(), 6);
    }

    #[test]
    fn a_count_window_stops_at_now_and_at_the_lifetime() {
        assert_eq!(
            count_window(T0 + 30_000, T0 + 10 * MINUTE_MS, T0 + 5 * MINUTE_MS + 1),
            (T0, T0 + 5 * MINUTE_MS)
        );
        let late = T0 + INBOUND_COUNT_LIFETIME_MS + MINUTE_MS;
        assert_eq!(count_window(T0, late, late).0, T0 + 2 * MINUTE_MS);
        assert!(count_is_gone(T0, T0 + INBOUND_COUNT_LIFETIME_MS));
        assert!(!count_is_gone(T0, T0 + INBOUND_COUNT_LIFETIME_MS - 1));
    }
}
