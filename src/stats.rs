//! Deliveries and failures per minute over the last hour, for the console's chart.
//!
//! Kept in memory by the process that made the attempts: the chart shows what this process
//! delivered (the Prometheus counters are the fleet-wide record). Minutes come from the
//! caller's clock, like everything else, so tests on a virtual clock see their own minutes.

use crate::clock::Millis;
use std::sync::Mutex;

use serde::Serialize;

/// Minutes of history shown.
pub const MINUTES: usize = 60;
const MINUTE_MS: Millis = 60_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MinuteCount {
    /// Start of the minute, ms since the epoch.
    pub minute: Millis,
    pub deliveries: u64,
    pub failures: u64,
}

/// A ring of per-minute counts; a slot is reused when its minute is an hour old.
#[derive(Debug)]
pub struct DeliveryStats {
    ring: Mutex<[MinuteCount; MINUTES]>,
}

impl Default for DeliveryStats {
    fn default() -> Self {
        DeliveryStats {
            ring: Mutex::new([MinuteCount::default(); MINUTES]),
        }
    }
}

impl DeliveryStats {
    /// Counts one attempt made at `now`: delivered or failed.
    pub fn record(&self, now: Millis, delivered: bool) {
        let minute = now.div_euclid(MINUTE_MS) * MINUTE_MS;
        let slot = (now.div_euclid(MINUTE_MS)).rem_euclid(MINUTES as i64) as usize;
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        let count = &mut ring[slot];
        if count.minute != minute {
            *count = MinuteCount {
                minute,
                ..MinuteCount::default()
            };
        }
        if delivered {
            count.deliveries += 1;
        } else {
            count.failures += 1;
        }
    }

    /// The last [`MINUTES`] minutes up to `now`'s, oldest first, zero where nothing happened.
    pub fn last_hour(&self, now: Millis) -> Vec<MinuteCount> {
        let current = now.div_euclid(MINUTE_MS);
        let ring = self
            .ring
            .lock()
            .map(|r| *r)
            .unwrap_or([MinuteCount::default(); MINUTES]);
        (0..MINUTES as i64)
            .rev()
            .map(|back| {
                let minute = (current - back) * MINUTE_MS;
                let slot = (current - back).rem_euclid(MINUTES as i64) as usize;
                if ring[slot].minute == minute {
                    ring[slot]
                } else {
                    MinuteCount {
                        minute,
                        ..MinuteCount::default()
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_minute_and_forgets_after_an_hour() {
        let stats = DeliveryStats::default();
        let t0 = 1_764_460_800_000;
        stats.record(t0, true);
        stats.record(t0 + 59_999, false);
        stats.record(t0 + 60_000, true);
        let hour = stats.last_hour(t0 + 60_000);
        assert_eq!(hour.len(), MINUTES);
        let last = hour[MINUTES - 1];
        let before = hour[MINUTES - 2];
        assert_eq!(
            (last.minute, last.deliveries, last.failures),
            (t0 + 60_000, 1, 0)
        );
        assert_eq!(
            (before.minute, before.deliveries, before.failures),
            (t0, 1, 1)
        );
        // An hour later the same slots hold new minutes; the old counts are gone.
        stats.record(t0 + 3_600_000, false);
        let later = stats.last_hour(t0 + 3_600_000);
        assert_eq!(later.iter().map(|m| m.deliveries).sum::<u64>(), 1);
        assert_eq!(later[MINUTES - 1].failures, 1);
        assert_eq!(later[0].minute, t0 + 60_000);
    }
}
