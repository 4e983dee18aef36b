//! Delivery slots per host (`dispatch.per_host_concurrency`), and what a claimed message does
//! when its host has none free. Claims cannot tell hosts apart, so this is where one dead
//! gateway is kept from starving the others: a message takes a global permit only once it
//! holds a slot to its host, and it waits for a slot only where one is expected soon.
//!
//! A busy but fast host (a slot frees every few milliseconds) gets its next messages sent as
//! slots free, from a bounded waiting room. A slow or dead one (its slots held for seconds, by
//! requests that end at `dispatch.request_timeout_ms`) sends its next messages back to the
//! queue at once, paced: the more of them it sent back since a slot was last free, the later
//! each is due again, so its backlog comes back at about the rate the host can take it, not
//! every 250 ms, and claims are spent on the hosts that answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::host_key;

/// The longest a message waits for a slot to its host, holding its lease but no permit.
pub(super) const HOST_WAIT: Duration = Duration::from_millis(500);
/// The soonest a message sent back for a busy host is due again.
const MIN_DEFER: Duration = Duration::from_millis(250);
/// The latest: a host that recovers is found again within this.
const MAX_DEFER: Duration = Duration::from_secs(60);
/// Hosts whose slots are remembered; beyond that the idle ones are forgotten.
const MAX_TRACKED_HOSTS: usize = 10_000;

pub(super) struct Hosts {
    per_host: usize,
    /// `dispatch.hosts."<host[:port]>".concurrency`, by lookup key.
    overrides: HashMap<String, usize>,
    hosts: Mutex<HashMap<String, Arc<Host>>>,
    /// Messages waiting for a slot, over all hosts (`dispatch.concurrency` of them): claims
    /// stop when it is full, so a busy host's backlog stays in the store, not in memory.
    room: Arc<Semaphore>,
    epoch: Instant,
}

struct Host {
    slots: Arc<Semaphore>,
    /// Its slots: `dispatch.per_host_concurrency`, or its own `concurrency`.
    per_host: usize,
    waiting: AtomicUsize,
    /// How long a request held a slot, smoothed (ms).
    hold_ms: AtomicU64,
    /// When a slot was last given back (ms since `Hosts::epoch`).
    freed_at_ms: AtomicU64,
    /// Messages sent back since a slot was last free at once.
    sent_back: AtomicU32,
}

/// What a claimed message does.
pub(super) enum Admission {
    /// Its host has a slot: deliver now.
    Send(Slot),
    /// Its host is busy but fast: wait for a slot, at most [`HOST_WAIT`].
    Wait(Waiter),
    /// Its host is slow or has enough waiting: back to the queue, due again after this.
    Defer(Duration),
}

/// A slot to a host, held while the request runs.
pub(super) struct Slot {
    _permit: OwnedSemaphorePermit,
    host: Arc<Host>,
    taken: Instant,
    epoch: Instant,
}

/// A place in the waiting room for a slot to one host.
pub(super) struct Waiter {
    host: Arc<Host>,
    _room: OwnedSemaphorePermit,
    epoch: Instant,
}

impl Hosts {
    pub(super) fn new(per_host: usize, room: usize, overrides: HashMap<String, usize>) -> Hosts {
        Hosts {
            per_host: per_host.max(1),
            overrides,
            hosts: Mutex::new(HashMap::new()),
            room: Arc::new(Semaphore::new(room.max(1))),
            epoch: Instant::now(),
        }
    }

    /// Free places in the waiting room: more messages than this are not worth claiming.
    pub(super) fn room(&self) -> usize {
        self.room.available_permits()
    }

    pub(super) fn admit(&self, url: &str) -> Admission {
        let Some(host) = self.host(url) else {
            return Admission::Defer(MIN_DEFER);
        };
        if let Ok(permit) = host.slots.clone().try_acquire_owned() {
            host.sent_back.store(0, Ordering::Relaxed);
            return Admission::Send(Slot::new(permit, host, self.epoch));
        }
        let waiting = host.waiting.load(Ordering::Relaxed);
        let expected = host.slot_time(self.epoch) * (waiting as u32 + 1) / host.per_host as u32;
        if expected < HOST_WAIT
            && let Ok(room) = self.room.clone().try_acquire_owned()
        {
            host.waiting.fetch_add(1, Ordering::Relaxed);
            return Admission::Wait(Waiter {
                host,
                _room: room,
                epoch: self.epoch,
            });
        }
        Admission::Defer(host.defer(self.epoch))
    }

    fn host(&self, url: &str) -> Option<Arc<Host>> {
        // host:port, so two services on one machine are two targets.
        let key = host_key::of_url(url).unwrap_or_default();
        let per_host = self
            .overrides
            .get(&key)
            .or_else(|| self.overrides.get(host_key::bare(&key)))
            .copied()
            .unwrap_or(self.per_host)
            .max(1);
        let mut hosts = self.hosts.lock().ok()?;
        if hosts.len() >= MAX_TRACKED_HOSTS {
            hosts.retain(|_, h| {
                h.slots.available_permits() < h.per_host || h.waiting.load(Ordering::Relaxed) > 0
            });
        }
        let since_epoch = self.epoch.elapsed().as_millis() as u64;
        Some(
            hosts
                .entry(key)
                .or_insert_with(|| {
                    Arc::new(Host {
                        slots: Arc::new(Semaphore::new(per_host)),
                        per_host,
                        waiting: AtomicUsize::new(0),
                        hold_ms: AtomicU64::new(0),
                        freed_at_ms: AtomicU64::new(since_epoch),
                        sent_back: AtomicU32::new(0),
                    })
                })
                .clone(),
        )
    }
}

impl Host {
    /// How long one slot of this host stays taken: the smoothed hold, or, when no slot has
    /// been given back for longer than that, the time since one was (a host gone silent has
    /// no completed request to measure yet).
    fn slot_time(&self, epoch: Instant) -> Duration {
        let now = epoch.elapsed().as_millis() as u64;
        let since_freed = now.saturating_sub(self.freed_at_ms.load(Ordering::Relaxed));
        Duration::from_millis(self.hold_ms.load(Ordering::Relaxed).max(since_freed))
    }

    /// When a message sent back now is due again: after the slot time of every message sent
    /// back before it, shared over the host's slots.
    fn defer(&self, epoch: Instant) -> Duration {
        let ahead = self.sent_back.fetch_add(1, Ordering::Relaxed);
        let share = 1 + ahead / self.per_host as u32;
        self.slot_time(epoch)
            .saturating_mul(share)
            .clamp(MIN_DEFER, MAX_DEFER)
    }
}

impl Slot {
    fn new(permit: OwnedSemaphorePermit, host: Arc<Host>, epoch: Instant) -> Slot {
        Slot {
            _permit: permit,
            host,
            taken: Instant::now(),
            epoch,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let held = self.taken.elapsed().as_millis() as u64;
        // An average over about the last 8 requests.
        let before = self.host.hold_ms.load(Ordering::Relaxed);
        self.host
            .hold_ms
            .store((before * 7 + held) / 8, Ordering::Relaxed);
        self.host
            .freed_at_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl Waiter {
    /// A slot within `limit`, or when to be due again.
    pub(super) async fn slot(self, limit: Duration) -> Result<Slot, Duration> {
        let acquired = tokio::time::timeout(limit, self.host.slots.clone().acquire_owned()).await;
        match acquired {
            Ok(Ok(permit)) => Ok(Slot::new(permit, self.host.clone(), self.epoch)),
            _ => Err(self.host.defer(self.epoch)),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.host.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_host_whose_slots_stay_taken_sends_its_messages_back_ever_later() {
        let hosts = Hosts::new(1, 64, HashMap::new());
        let url = "http://dead.example:80/hook";
        let held: Vec<Slot> = (0..1)
            .map(|_| match hosts.admit(url) {
                Admission::Send(slot) => slot,
                _ => panic!("a free host sends at once"),
            })
            .collect();
        // Its slots have been taken past the wait: nobody waits for them.
        tokio::time::sleep(HOST_WAIT + Duration::from_millis(50)).await;
        let delays: Vec<Duration> = (0..6)
            .map(|_| match hosts.admit(url) {
                Admission::Defer(delay) => delay,
                _ => panic!("a host that has not freed a slot for longer than the wait defers"),
            })
            .collect();
        assert!(delays.windows(2).all(|w| w[0] <= w[1]), "{delays:?}");
        assert!(
            delays[5] >= delays[0] * 3,
            "paced by how many went back: {delays:?}"
        );
        assert_eq!(hosts.room(), 64, "no place in the waiting room is taken");

        // Another host is not affected.
        assert!(matches!(
            hosts.admit("http://healthy.example/hook"),
            Admission::Send(_)
        ));
        drop(held);
    }

    #[tokio::test]
    async fn a_busy_fast_host_lets_its_next_messages_wait_for_a_slot() {
        let hosts = Hosts::new(1, 4, HashMap::new());
        let url = "http://busy.example/hook";
        let Admission::Send(slot) = hosts.admit(url) else {
            panic!("a free host sends at once");
        };
        let Admission::Wait(waiter) = hosts.admit(url) else {
            panic!("a host that just started its request is worth waiting for");
        };
        assert_eq!(hosts.room(), 3);
        let waited = tokio::spawn(waiter.slot(HOST_WAIT));
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(slot);
        assert!(
            waited.await.unwrap().is_ok(),
            "the freed slot goes to the waiter"
        );
        assert_eq!(hosts.room(), 4, "its place in the room is given back");
    }

    #[tokio::test]
    async fn a_host_with_its_own_concurrency_gets_that_many_slots() {
        let overrides = HashMap::from([("own.example".to_string(), 3)]);
        let hosts = Hosts::new(1, 64, overrides);
        let sends = |url: &str| {
            // Kept until counted, so no slot is given back early.
            let admitted: Vec<Admission> = (0..5).map(|_| hosts.admit(url)).collect();
            admitted
                .iter()
                .filter(|a| matches!(a, Admission::Send(_)))
                .count()
        };
        assert_eq!(sends("http://own.example:8080/hook"), 3);
        assert_eq!(sends("http://other.example/hook"), 1);
    }
}
