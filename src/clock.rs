//! Time as an input. Everything that schedules (the dispatcher, the handlers that stamp
//! messages) reads one `Clock`; tests swap in a [`ManualClock`] and run seven days of retries
//! in milliseconds.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::store::Millis;

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

/// Parses ISO-8601 as PayZu's `createdAtFrom`/`createdAtTo` use it: a full timestamp
/// (`2026-11-30T12:00:00Z`, offset or not) or a bare date (`2026-11-30`, midnight UTC).
pub fn parse_iso(s: &str) -> Option<Millis> {
    let full = if s.len() == 10 {
        format!("{s}T00:00:00Z")
    } else {
        s.to_string()
    };
    let t = humantime::parse_rfc3339_weak(full.trim_end_matches('Z')).ok()?;
    t.duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as Millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_round_trip() {
        let t = 1_764_460_800_123;
        assert_eq!(format_iso(t), "2025-11-30T00:00:00.123Z");
        assert_eq!(parse_iso(&format_iso(t)), Some(t));
        assert_eq!(parse_iso("2025-11-30"), Some(1_764_460_800_000));
        assert_eq!(parse_iso("yesterday"), None);
    }
}
