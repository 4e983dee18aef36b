//! Where deliveries go: the tests' HTTP sink (tests/support/sink.rs) on 127.0.0.1, answering
//! 204 and keeping only the first arrival of each `x-callbackd-message-id`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::DRAIN_TIMEOUT;
use crate::support::sink::{Received, Reply, Sink};

#[derive(Default)]
pub struct Arrivals {
    first: Mutex<HashMap<String, Instant>>,
    pub repeats: AtomicU64,
}

impl Arrivals {
    pub fn unique(&self) -> usize {
        self.first.lock().map(|m| m.len()).unwrap_or(0)
    }

    pub fn reset(&self) {
        if let Ok(mut m) = self.first.lock() {
            m.clear();
        }
        self.repeats.store(0, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HashMap<String, Instant> {
        self.first.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Waits until `n` distinct messages arrived, or nothing new arrived for `idle`, or
    /// `DRAIN_TIMEOUT`. Returns how many arrived.
    pub async fn wait_for(&self, n: usize, idle: Duration, cap: Duration) -> usize {
        let started = Instant::now();
        let mut last_count = 0;
        let mut last_change = Instant::now();
        loop {
            let count = self.unique();
            if count >= n {
                return count;
            }
            if count != last_count {
                last_count = count;
                last_change = Instant::now();
            }
            if last_change.elapsed() > idle || started.elapsed() > cap.min(DRAIN_TIMEOUT) {
                return count;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// (first arrival, last arrival) of this phase.
    pub fn span(&self) -> Option<(Instant, Instant)> {
        let m = self.first.lock().ok()?;
        let first = m.values().min().copied()?;
        let last = m.values().max().copied()?;
        Some((first, last))
    }

    fn arrived(&self, request: &Received, at: Instant) {
        if let Some(id) = request.headers.get("x-callbackd-message-id")
            && let Ok(id) = id.to_str()
            && let Ok(mut m) = self.first.lock()
        {
            if m.contains_key(id) {
                self.repeats.fetch_add(1, Ordering::Relaxed);
            } else {
                m.insert(id.to_string(), at);
            }
        }
    }
}

/// Starts the sink; returns its arrivals and the URL deliveries are sent to.
pub async fn start() -> (Arc<Arrivals>, String) {
    let arrivals = Arc::new(Arrivals::default());
    let record = arrivals.clone();
    let sink = Sink::start_unrecorded(move |request, _| {
        record.arrived(request, Instant::now());
        Reply::status(204)
    })
    .await;
    (arrivals, format!("{}/cb", sink.url))
}
