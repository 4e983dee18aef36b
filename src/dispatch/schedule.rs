//! The retry schedule, pure: the store persists its result (the next attempt time), so a
//! restart never forgets a retry, and tests walk seven days of it in microseconds.
//!
//! delay(n) = min(max_backoff, initial × 2^n), jittered down by up to half ("equal jitter":
//! retries of many messages that failed together spread out, and no delay is shorter than
//! half its base). `Retry-After` from the target is a lower bound: it can push the next
//! attempt later (up to [`MAX_RETRY_AFTER_MS`]) but never earlier than the schedule, so a
//! receiver answering `Retry-After: 0` (or a date in the past) cannot turn retries into a hot
//! loop. No attempt is ever scheduled past the deadline; when the next one would be, the last
//! attempt lands exactly at the deadline; after an attempt at or past the deadline, the
//! message is dead.

use crate::clock::Millis;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub initial_ms: u64,
    pub max_ms: u64,
}

/// The most a target's `Retry-After` may postpone the next attempt: a receiver asking for a
/// week of silence still gets one attempt a day until the deadline.
pub const MAX_RETRY_AFTER_MS: u64 = 24 * 3_600_000;

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    RetryAt(Millis),
    GiveUp,
}

/// Base delay before retry number `step + 1` (step = failures so far, minus one).
pub fn base_delay_ms(backoff: Backoff, step: u32) -> u64 {
    let factor = 1u64.checked_shl(step.min(63)).unwrap_or(u64::MAX);
    backoff
        .initial_ms
        .saturating_mul(factor)
        .min(backoff.max_ms)
}

/// Decides the next attempt after a failure at `now`.
///
/// * `step` — failed attempts before this one (0 after the first failure);
/// * `jitter` — a number in `[0, 1)` from the caller's RNG (0 = no jitter);
/// * `retry_after_ms` — the target's `Retry-After` (already resolved against the caller's
///   clock), when it sent one: the delay is `max(scheduled, min(retry_after, 24 h))`.
pub fn next_attempt(
    backoff: Backoff,
    step: u32,
    now: Millis,
    deadline: Millis,
    jitter: f64,
    retry_after_ms: Option<u64>,
) -> Next {
    if now >= deadline {
        return Next::GiveUp;
    }
    let base = base_delay_ms(backoff, step);
    let scheduled = base - (base as f64 * jitter.clamp(0.0, 1.0) / 2.0) as u64;
    // Capping Retry-After (not the sum) keeps a configured `max_backoff` above 24 h intact.
    let asked = retry_after_ms.map_or(0, |ms| ms.min(MAX_RETRY_AFTER_MS));
    let delay = scheduled.max(asked);
    let at = now.saturating_add(i64::try_from(delay).unwrap_or(i64::MAX));
    Next::RetryAt(at.min(deadline))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT: Backoff = Backoff {
        initial_ms: 1_000,
        max_ms: 3_600_000,
    };
    const WEEK: Millis = 7 * 86_400_000;

    /// Walks the schedule of a target that is always down, from acceptance at 0.
    fn attempts_until_dead(backoff: Backoff, deadline: Millis, jitter: f64) -> Vec<Millis> {
        let mut now = 0;
        let mut times = vec![now];
        let mut step = 0;
        while let Next::RetryAt(at) = next_attempt(backoff, step, now, deadline, jitter, None) {
            assert!(at > now, "time moves forward");
            now = at;
            times.push(now);
            step += 1;
        }
        times
    }

    #[test]
    fn doubles_then_caps() {
        let delays: Vec<u64> = (0..14).map(|n| base_delay_ms(DEFAULT, n)).collect();
        assert_eq!(&delays[..4], &[1_000, 2_000, 4_000, 8_000]);
        assert_eq!(delays[11], 2_048_000);
        assert_eq!(delays[12], 3_600_000);
        assert_eq!(base_delay_ms(DEFAULT, 500), 3_600_000);
    }

    #[test]
    fn seven_days_without_jitter_ends_exactly_at_the_deadline() {
        let times = attempts_until_dead(DEFAULT, WEEK, 0.0);
        assert_eq!(*times.last().unwrap(), WEEK);
        assert!(times.iter().all(|t| *t <= WEEK));
        // 13 doubling attempts (incl. the first) reach 4095 s, then hourly, then the deadline.
        assert_eq!(
            times.len(),
            13 + (WEEK as usize - 4_095_000) / 3_600_000 + 1
        );
    }

    #[test]
    fn jitter_stays_within_half_and_never_passes_the_deadline() {
        for jitter in [0.0, 0.25, 0.5, 0.999] {
            let times = attempts_until_dead(DEFAULT, WEEK, jitter);
            assert_eq!(*times.last().unwrap(), WEEK);
            for (step, pair) in times.windows(2).enumerate() {
                let gap = (pair[1] - pair[0]) as u64;
                let base = base_delay_ms(DEFAULT, step as u32);
                assert!(gap <= base, "gap {gap} > base {base}");
                assert!(
                    gap >= base / 2 || pair[1] == WEEK,
                    "gap {gap} < half of {base}"
                );
            }
        }
    }

    #[test]
    fn retry_after_postpones_but_not_past_the_deadline() {
        assert_eq!(
            next_attempt(DEFAULT, 0, 1_000, WEEK, 0.0, Some(120_000)),
            Next::RetryAt(121_000)
        );
        // Longer than the scheduled delay is honoured; 24 h is the most it may ask.
        assert_eq!(
            next_attempt(DEFAULT, 12, 0, WEEK, 0.0, Some(5 * 3_600_000)),
            Next::RetryAt(5 * 3_600_000)
        );
        assert_eq!(
            next_attempt(DEFAULT, 0, 0, WEEK, 0.0, Some(3 * 86_400_000)),
            Next::RetryAt(MAX_RETRY_AFTER_MS as Millis)
        );
        assert_eq!(
            next_attempt(DEFAULT, 0, WEEK - 10, WEEK, 0.0, Some(120_000)),
            Next::RetryAt(WEEK)
        );
        assert_eq!(
            next_attempt(DEFAULT, 0, WEEK, WEEK, 0.0, None),
            Next::GiveUp
        );
    }

    #[test]
    fn retry_after_never_shortens_the_schedule() {
        for jitter in [0.0, 0.5, 0.999] {
            for step in [0, 3, 12, 40] {
                let scheduled = next_attempt(DEFAULT, step, 1_000, WEEK, jitter, None);
                // `Retry-After: 0`, a date in the past (resolved to 0) and a short delay all
                // keep the scheduled time.
                for asked in [0, 1, 499] {
                    assert_eq!(
                        next_attempt(DEFAULT, step, 1_000, WEEK, jitter, Some(asked)),
                        scheduled,
                        "step {step}, jitter {jitter}, Retry-After {asked} ms"
                    );
                }
            }
        }
    }

    #[test]
    fn retry_after_zero_walks_the_plain_schedule() {
        // A target that always answers `Retry-After: 0` is retried exactly as one that sends
        // no Retry-After: the same 180 attempts over seven days, not a hot loop.
        let mut now = 0;
        let mut step = 0;
        let mut times = vec![now];
        while let Next::RetryAt(at) = next_attempt(DEFAULT, step, now, WEEK, 0.0, Some(0)) {
            assert!(at > now, "time moves forward");
            now = at;
            times.push(now);
            step += 1;
        }
        assert_eq!(times, attempts_until_dead(DEFAULT, WEEK, 0.0));
    }

    #[test]
    fn a_short_window_gives_up_sooner() {
        let times = attempts_until_dead(DEFAULT, 15 * 60_000, 0.0);
        assert_eq!(*times.last().unwrap(), 15 * 60_000);
        assert!(times.len() < 15);
    }
}
