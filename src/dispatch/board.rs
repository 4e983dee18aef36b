//! What the admin API shows of the hosts this process holds back. The dispatcher publishes a
//! reader here once it runs; the app owns the board, so the HTTP side reads it without
//! depending on the dispatcher (which depends on the app).

use std::sync::OnceLock;

use crate::clock::Millis;

/// A host held back now: its breaker open, or throttled, or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldHost {
    /// `host:port`.
    pub host: String,
    pub open_since: Option<Millis>,
    pub throttled_since: Option<Millis>,
    pub throttled_until: Option<Millis>,
    /// Consecutive failed attempts counted when it opened, or so far.
    pub failures: u32,
    /// Distinct messages held back for it since it was held (at most [`MAX_WAITING`]).
    pub waiting: usize,
}

/// Held message ids remembered per host; the count stops there.
pub const MAX_WAITING: usize = 100_000;

type Reader = Box<dyn Fn() -> Vec<HeldHost> + Send + Sync>;

/// The hosts held back, as the running dispatcher sees them.
#[derive(Default)]
pub struct HostBoard {
    reader: OnceLock<Reader>,
}

impl HostBoard {
    /// Sets where the list comes from; a second dispatcher in one process keeps the first's.
    pub fn publish(&self, reader: impl Fn() -> Vec<HeldHost> + Send + Sync + 'static) {
        let _ = self.reader.set(Box::new(reader));
    }

    /// The hosts held back now; none when no dispatcher runs in this process.
    pub fn list(&self) -> Vec<HeldHost> {
        self.reader.get().map(|read| read()).unwrap_or_default()
    }
}
