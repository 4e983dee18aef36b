//! The gates of every host this process delivers to (`gate.rs` decides, this keeps them), and
//! what they show: the metrics of each host's breaker, and the snapshot the admin API lists.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::board::{HeldHost, MAX_WAITING};
use super::gate::{GateState, HoldReason, HostGate, Limits, Pass, Transition};
use crate::app::DispatchSettings;
use crate::clock::{Millis, millis};
use crate::metrics as m;
use crate::store::lifecycle::policy::HostSignal;

/// Hosts whose gates are remembered; beyond that the idle ones are forgotten.
const MAX_TRACKED_HOSTS: usize = 10_000;

pub(super) struct Guards {
    settings: DispatchSettings,
    gates: Mutex<HashMap<String, HostGate>>,
    /// Messages held back per host while it is open or throttled (for the admin API).
    waiting: Mutex<HashMap<String, HashSet<String>>>,
}

/// A message's leave to go to its host. It must be [`Ticket::record`]ed once its attempt has
/// an outcome; dropped unrecorded (sent back for a slot, cancelled), it frees its place, and a
/// probe that was never made lets the next message probe.
pub(super) struct Ticket {
    guards: Arc<Guards>,
    pub(super) host: String,
    probe: bool,
    recorded: bool,
}

impl Guards {
    pub(super) fn new(settings: &DispatchSettings) -> Guards {
        Guards {
            settings: settings.clone(),
            gates: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
        }
    }

    fn limits(&self, host: &str) -> Limits {
        let own = self.settings.host_limits(host);
        let b = &self.settings.breaker;
        Limits {
            failures: b.failures,
            probe_ms: Millis::try_from(millis(b.probe)).unwrap_or(Millis::MAX),
            max_probe_ms: Millis::try_from(millis(b.max_probe)).unwrap_or(Millis::MAX),
            concurrency: own
                .concurrency
                .unwrap_or(self.settings.per_host_concurrency),
            max_per_second: own.max_per_second,
        }
    }

    /// Whether a message may go to `host` now: a ticket (and how long to wait for the rate),
    /// or when it is due again and why.
    pub(super) fn admit(
        self: &Arc<Self>,
        host: &str,
        message: &str,
        now: Millis,
    ) -> Result<(Ticket, Millis), (Millis, HoldReason)> {
        let pass = {
            let Ok(mut gates) = self.gates.lock() else {
                // A poisoned lock only follows a panic elsewhere: deliver unguarded rather
                // than stop delivering.
                return Ok((self.ticket(host, false), 0));
            };
            if gates.len() >= MAX_TRACKED_HOSTS {
                gates.retain(|_, g| !g.is_idle(now));
            }
            gates
                .entry(host.to_string())
                .or_insert_with(|| HostGate::new(self.limits(host)))
                .admit(now)
        };
        match pass {
            Pass::Go { wait_ms, probe } => {
                if let Ok(mut waiting) = self.waiting.lock()
                    && let Some(held) = waiting.get_mut(host)
                {
                    held.remove(message);
                }
                Ok((self.ticket(host, probe), wait_ms))
            }
            Pass::Hold { until, reason } => {
                if matches!(reason, HoldReason::Open | HoldReason::Throttled)
                    && let Ok(mut waiting) = self.waiting.lock()
                {
                    let held = waiting.entry(host.to_string()).or_default();
                    if held.len() < MAX_WAITING {
                        held.insert(message.to_string());
                    }
                }
                metrics::counter!(m::HELD_BACK, "host" => host.to_string(), "reason" => reason.as_str())
                    .increment(1);
                Err((until, reason))
            }
        }
    }

    fn ticket(self: &Arc<Self>, host: &str, probe: bool) -> Ticket {
        Ticket {
            guards: Arc::clone(self),
            host: host.to_string(),
            probe,
            recorded: false,
        }
    }

    /// The hosts held back now (breaker open, or throttled), by name.
    pub fn held(&self, now: Millis) -> Vec<HeldHost> {
        let states: Vec<(String, GateState)> = match self.gates.lock() {
            Ok(gates) => gates
                .iter()
                .map(|(host, g)| (host.clone(), g.state(now)))
                .collect(),
            Err(_) => return Vec::new(),
        };
        let Ok(mut waiting) = self.waiting.lock() else {
            return Vec::new();
        };
        let mut held = Vec::new();
        for (host, state) in states {
            if state.open_since.is_none() && state.throttled_until.is_none() {
                // Its episode is over: the next one counts afresh.
                waiting.remove(&host);
                continue;
            }
            held.push(HeldHost {
                waiting: waiting.get(&host).map_or(0, HashSet::len),
                host,
                open_since: state.open_since,
                throttled_since: state.throttled_since,
                throttled_until: state.throttled_until,
                failures: state.failures,
            });
        }
        held.sort_by(|a, b| a.host.cmp(&b.host));
        held
    }

    fn publish(host: &str, state: GateState) {
        let open = if state.open_since.is_some() { 1.0 } else { 0.0 };
        metrics::gauge!(m::HOST_BREAKER_OPEN, "host" => host.to_string()).set(open);
        metrics::gauge!(m::HOST_FAILURES, "host" => host.to_string())
            .set(f64::from(state.failures));
    }
}

impl Ticket {
    /// Records what the attempt said about the host; a change worth an alert is returned.
    pub(super) fn record(mut self, signal: HostSignal, now: Millis) -> Option<Transition> {
        self.recorded = true;
        let mut gates = self.guards.gates.lock().ok()?;
        let gate = gates.get_mut(&self.host)?;
        let transition = gate.record(signal, self.probe, now);
        Guards::publish(&self.host, gate.state(now));
        transition
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.recorded {
            return;
        }
        if let Ok(mut gates) = self.guards.gates.lock()
            && let Some(gate) = gates.get_mut(&self.host)
        {
            gate.abandon(self.probe);
        }
    }
}
