//! Time as an input. Everything that schedules (the dispatcher, the handlers that stamp
//! messages) reads one `Clock`; tests swap in a [`ManualClock`] and run seven days of retries
//! in milliseconds.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: every instant the store and the scheduler are given.
pub type Millis = i64;

pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> Millis;

    fn now_secs(&self) -> i64 {
        self.now_ms().div_euclid(1000)
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> Millis {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as Millis)
            .unwrap_or(0)
    }
}

/// A clock that moves only when told to.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn new(start: Millis) -> ManualClock {
        ManualClock(AtomicI64::new(start))
    }

    pub fn set(&self, at: Millis) {
        self.0.store(at, Ordering::SeqCst);
    }

    pub fn advance(&self, ms: Millis) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> Millis {
        self.0.load(Ordering::SeqCst)
    }
}

/// RFC 3339 with milliseconds, UTC: how times appear in API answers.
pub fn format_iso(at: Millis) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(at.max(0) as u64);
    humantime::format_rfc3339_millis(at).to_string()
}

/// A delay for people and logs, without spaces: `850ms`, `1.2s`, `4m15s`, `2h8m15s`, `6d23h8m`.
pub fn format_delay(ms: Millis) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    if ms < 60_000 {
        return format!("{:.1}s", ms as f64 / 1000.0);
    }
    let secs = ms / 1000;
    let parts = [
        (secs / 86_400, "d"),
        (secs / 3600 % 24, "h"),
        (secs / 60 % 60, "m"),
        (secs % 60, "s"),
    ];
    let mut text = String::new();
    for (n, unit) in parts {
        // Seconds are noise once a delay runs to days.
        if n > 0 && !(unit == "s" && secs >= 86_400) {
            text.push_str(&format!("{n}{unit}"));
        }
    }
    text
}

/// The forms [`parse_rfc3339`] accepts, for error messages.
pub const RFC3339_FORMS: &str = "RFC 3339 with an offset, e.g. 2026-11-30T00:00:00-03:00, \
    2026-11-30T03:00:00Z or 2026-11-30T03:00:00.250Z";

/// Parses an RFC 3339 timestamp with any offset (`Z`, `-03:00`...). A bare date is refused
/// rather than guessed: midnight in which time zone would be a silent surprise to an operator
/// in São Paulo.
pub fn parse_rfc3339(s: &str) -> Option<Millis> {
    let at = time::OffsetDateTime::parse(s.trim(), &time::format_description::well_known::Rfc3339)
        .ok()?;
    Millis::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()
}

/// Parses an HTTP date (RFC 9110: IMF-fixdate, or the obsolete RFC 850 and asctime forms), as
/// `Retry-After` may carry one. A date before the epoch reads as the epoch.
pub fn parse_http_date(s: &str) -> Option<Millis> {
    let at = httpdate::parse_http_date(s).ok()?;
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    Some(Millis::try_from(since_epoch.as_millis()).unwrap_or(Millis::MAX))
}

/// `now + span`, saturating: the one place a setting's `Duration` becomes a point in time (a
/// delivery window's deadline, a signature seal's expiry).
pub fn deadline(now: Millis, span: Duration) -> Millis {
    now.saturating_add(Millis::try_from(span.as_millis()).unwrap_or(Millis::MAX))
}

/// `d` in whole milliseconds, the unit the store's leases and the retry schedule count in.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trip_and_offsets() {
        let t = 1_764_460_800_123;
        assert_eq!(format_iso(t), "2025-11-30T00:00:00.123Z");
        assert_eq!(parse_rfc3339(&format_iso(t)), Some(t));
        // São Paulo's midnight is 03:00 UTC.
        assert_eq!(
            parse_rfc3339("2025-11-30T00:00:00-03:00"),
            Some(1_764_460_800_000 + 3 * 3_600_000)
        );
        assert_eq!(
            parse_rfc3339("2025-11-30T05:30:00+05:30"),
            Some(1_764_460_800_000)
        );
        assert_eq!(parse_rfc3339("2025-11-30"), None, "a date alone is refused");
        assert_eq!(parse_rfc3339("2025-11-30T00:00:00"), None, "no offset");
        assert_eq!(parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn delays_read_without_spaces() {
        assert_eq!(format_delay(850), "850ms");
        assert_eq!(format_delay(1_234), "1.2s");
        assert_eq!(format_delay(255_000), "4m15s");
        assert_eq!(format_delay(3_600_000), "1h");
        assert_eq!(format_delay(7_695_000), "2h8m15s");
        assert_eq!(format_delay(604_080_000 - 60_000), "6d23h47m");
        assert_eq!(format_delay(-5), "0ms");
    }
}
