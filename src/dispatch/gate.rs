//! What protects one gateway from us, pure (`now` is an input, so tests walk minutes of it in
//! microseconds): whether a claimed message may go to its host now, or must wait in the store.
//! The dispatcher applies it (`dispatch/mod.rs`); `hosts.rs` then shares the host's slots.
//!
//! * **Throttled**: a `429`, or a `503` with `Retry-After`, pauses the whole host (not only the
//!   message that got it) until `Retry-After` has passed, capped like the policy caps it.
//! * **Breaker**: after `failures` consecutive failed attempts (no answer, or a 5xx) the host is
//!   open: nothing goes out but one probe per probe interval, which doubles (up to its cap)
//!   while probes fail. A probe that gets an answer closes it, and the host's concurrency ramps
//!   back up, one more request at once per answer (1, 2, 4… per round trip), so a gateway just
//!   back is not hit by its whole backlog at once.
//! * **Rate**: `max_per_second` is a token bucket (GCRA) holding a tenth of a second's worth,
//!   so any one-second window sees at most `rate + rate / 10` requests. A message whose token is
//!   near waits for it in memory; one whose token is further goes back to the store, due when
//!   its turn comes (a cursor paces them, so the backlog comes back at the rate, not at once).
//!
//! Each process keeps its own: with N processes an outage costs at most N × (outage ÷ probe
//! interval) probes, plus the threshold's failures and what was already in flight.

use crate::clock::Millis;
use crate::store::lifecycle::policy::HostSignal as Signal;

/// A message whose rate token comes within this waits for it; a later one is held.
pub const MAX_RATE_WAIT_MS: Millis = 250;
/// How long a message held by the ramp after a recovery stays in the store: about a round
/// trip, after which the ramp has usually grown.
pub const RAMP_HOLD_MS: Millis = 100;

/// A host's limits, from `[dispatch]` and `dispatch.hosts."<host:port>"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Consecutive failures that open the breaker.
    pub failures: u32,
    pub probe_ms: Millis,
    pub max_probe_ms: Millis,
    /// The host's concurrency: where the ramp after a recovery ends.
    pub concurrency: usize,
    /// Requests per second, if limited.
    pub max_per_second: Option<f64>,
}

/// Why a message is held back, for the metrics (labels spelled once, here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    Throttled,
    Open,
    Ramp,
    Rate,
}

impl HoldReason {
    pub const ALL: [HoldReason; 4] = [
        HoldReason::Throttled,
        HoldReason::Open,
        HoldReason::Ramp,
        HoldReason::Rate,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            HoldReason::Throttled => "throttled",
            HoldReason::Open => "breaker_open",
            HoldReason::Ramp => "ramp",
            HoldReason::Rate => "rate",
        }
    }
}

/// What a claimed message does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Go, after waiting `wait_ms` for its rate token. A probe is the one request an open host
    /// gets.
    Go { wait_ms: Millis, probe: bool },
    /// Back to the store, due at `until`, no attempt made.
    Hold { until: Millis, reason: HoldReason },
}

/// A change worth an alert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Opened,
    Recovered,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Breaker {
    Closed {
        failures: u32,
        /// Requests at once while ramping up after a recovery; none when done.
        ramp: Option<usize>,
    },
    Open {
        since: Millis,
        next_probe: Millis,
        interval: Millis,
        probing: bool,
    },
}

/// One host's state.
#[derive(Debug, Clone)]
pub struct HostGate {
    limits: Limits,
    breaker: Breaker,
    throttled_until: Option<Millis>,
    throttled_since: Option<Millis>,
    in_flight: usize,
    /// GCRA: the theoretical arrival time of the next request (µs).
    tat_us: i64,
    /// When the next message held for the rate is due (µs), so held ones come back spread.
    held_cursor_us: i64,
}

/// A snapshot for metrics and the admin API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateState {
    pub open_since: Option<Millis>,
    pub throttled_until: Option<Millis>,
    pub throttled_since: Option<Millis>,
    pub failures: u32,
}

impl HostGate {
    pub fn new(limits: Limits) -> HostGate {
        HostGate {
            limits,
            breaker: Breaker::Closed {
                failures: 0,
                ramp: None,
            },
            throttled_until: None,
            throttled_since: None,
            in_flight: 0,
            tat_us: i64::MIN / 2,
            held_cursor_us: i64::MIN / 2,
        }
    }

    pub fn state(&self, now: Millis) -> GateState {
        let throttled = self.throttled_until.filter(|u| *u > now);
        GateState {
            open_since: match self.breaker {
                Breaker::Open { since, .. } => Some(since),
                Breaker::Closed { .. } => None,
            },
            throttled_until: throttled,
            throttled_since: throttled.and(self.throttled_since),
            failures: match self.breaker {
                Breaker::Closed { failures, .. } => failures,
                Breaker::Open { .. } => self.limits.failures,
            },
        }
    }

    /// Nothing to remember: a host in this state can be forgotten and made anew.
    pub fn is_idle(&self, now: Millis) -> bool {
        self.in_flight == 0
            && self.throttled_until.is_none_or(|u| u <= now)
            && self.breaker
                == Breaker::Closed {
                    failures: 0,
                    ramp: None,
                }
            && self.tat_us <= now.saturating_mul(1000)
    }

    /// Whether a message may go now. A `Go` must be followed by [`HostGate::record`] or
    /// [`HostGate::abandon`].
    pub fn admit(&mut self, now: Millis) -> Pass {
        if let Some(until) = self.throttled_until {
            if until > now {
                return Pass::Hold {
                    until,
                    reason: HoldReason::Throttled,
                };
            }
            self.throttled_until = None;
            self.throttled_since = None;
        }
        match &mut self.breaker {
            Breaker::Open {
                next_probe,
                interval,
                probing,
                ..
            } => {
                if *probing || now < *next_probe {
                    // A probe in flight decides soon; the others come back at the next one.
                    let until = if *probing {
                        now + *interval
                    } else {
                        *next_probe
                    };
                    return Pass::Hold {
                        until,
                        reason: HoldReason::Open,
                    };
                }
                *probing = true;
                self.in_flight += 1;
                return Pass::Go {
                    wait_ms: 0,
                    probe: true,
                };
            }
            Breaker::Closed {
                ramp: Some(limit), ..
            } if self.in_flight >= *limit => {
                return Pass::Hold {
                    until: now + RAMP_HOLD_MS,
                    reason: HoldReason::Ramp,
                };
            }
            Breaker::Closed { .. } => {}
        }
        let wait_ms = match self.take_token(now) {
            Ok(wait_ms) => wait_ms,
            Err(until) => {
                return Pass::Hold {
                    until,
                    reason: HoldReason::Rate,
                };
            }
        };
        self.in_flight += 1;
        Pass::Go {
            wait_ms,
            probe: false,
        }
    }

    /// GCRA with a tenth of a second of burst: the wait for this request's token, or, when it
    /// is further than [`MAX_RATE_WAIT_MS`], when to come back (no token taken).
    fn take_token(&mut self, now: Millis) -> Result<Millis, Millis> {
        let Some(rate) = self.limits.max_per_second.filter(|r| *r > 0.0) else {
            return Ok(0);
        };
        let interval_us = (1_000_000.0 / rate).max(1.0) as i64;
        let burst = (rate / 10.0).floor().max(1.0) as i64;
        let tolerance_us = (burst - 1) * interval_us;
        let now_us = now.saturating_mul(1000);
        let tat = self.tat_us.max(now_us);
        let send_at = (tat - tolerance_us).max(now_us);
        let wait_ms = (send_at - now_us + 999) / 1000;
        if wait_ms <= MAX_RATE_WAIT_MS {
            self.tat_us = tat + interval_us;
            return Ok(wait_ms);
        }
        let due = self.held_cursor_us.max(send_at);
        self.held_cursor_us = due + interval_us;
        Err((due + 999) / 1000)
    }

    /// A `Go` that made no attempt after all (sent back for a slot, shutdown).
    pub fn abandon(&mut self, probe: bool) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if probe && let Breaker::Open { probing, .. } = &mut self.breaker {
            *probing = false;
        }
    }

    /// What an attempt said about the host, at `now`.
    pub fn record(&mut self, signal: Signal, probe: bool, now: Millis) -> Option<Transition> {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Signal::Throttled(until) = signal
            && self.throttled_until.is_none_or(|u| u < until)
        {
            if self.throttled_until.is_none() {
                self.throttled_since = Some(now);
            }
            self.throttled_until = Some(until);
        }
        let answered = !matches!(signal, Signal::Failed);
        match &mut self.breaker {
            Breaker::Open {
                next_probe,
                interval,
                probing,
                ..
            } => {
                if !probe {
                    // An attempt already in flight when it opened: the probe decides.
                    return None;
                }
                if answered {
                    self.breaker = Breaker::Closed {
                        failures: 0,
                        ramp: Some(1).filter(|_| self.limits.concurrency > 1),
                    };
                    return Some(Transition::Recovered);
                }
                *probing = false;
                *interval = (*interval * 2).min(self.limits.max_probe_ms);
                *next_probe = now + *interval;
                None
            }
            Breaker::Closed { failures, ramp } => {
                if answered {
                    *failures = 0;
                    if let Some(limit) = ramp {
                        *limit += 1;
                        if *limit >= self.limits.concurrency {
                            *ramp = None;
                        }
                    }
                    return None;
                }
                *failures += 1;
                if *failures < self.limits.failures {
                    return None;
                }
                self.breaker = Breaker::Open {
                    since: now,
                    next_probe: now + self.limits.probe_ms,
                    interval: self.limits.probe_ms,
                    probing: false,
                };
                Some(Transition::Opened)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        failures: 3,
        probe_ms: 5_000,
        max_probe_ms: 60_000,
        concurrency: 8,
        max_per_second: None,
    };

    fn go(gate: &mut HostGate, now: Millis) -> bool {
        let pass = gate.admit(now);
        matches!(pass, Pass::Go { wait_ms: 0, .. })
    }

    #[test]
    fn a_throttle_holds_every_message_until_it_ends() {
        let mut gate = HostGate::new(LIMITS);
        assert!(go(&mut gate, 0));
        assert_eq!(gate.record(Signal::Throttled(3_000), false, 10), None);
        for now in [10, 1_000, 2_999] {
            assert_eq!(
                gate.admit(now),
                Pass::Hold {
                    until: 3_000,
                    reason: HoldReason::Throttled
                }
            );
        }
        assert_eq!(gate.state(100).throttled_until, Some(3_000));
        assert_eq!(gate.state(100).throttled_since, Some(10));
        // A shorter one does not shorten it.
        assert!(go(&mut gate, 3_000));
        assert_eq!(gate.state(3_000).throttled_until, None);
    }

    #[test]
    fn a_shorter_throttle_does_not_shorten_a_longer_one() {
        let mut gate = HostGate::new(LIMITS);
        gate.admit(0);
        gate.admit(0);
        gate.record(Signal::Throttled(9_000), false, 0);
        gate.record(Signal::Throttled(2_000), false, 0);
        assert!(matches!(gate.admit(5_000), Pass::Hold { until: 9_000, .. }));
    }

    #[test]
    fn consecutive_failures_open_and_one_probe_goes_out_per_interval() {
        let mut gate = HostGate::new(LIMITS);
        for _ in 0..3 {
            assert!(go(&mut gate, 0));
        }
        assert_eq!(gate.record(Signal::Failed, false, 1), None);
        assert_eq!(gate.record(Signal::Answered, false, 1), None, "resets");
        assert!(go(&mut gate, 1));
        assert!(go(&mut gate, 1));
        assert!(go(&mut gate, 1));
        assert_eq!(gate.record(Signal::Failed, false, 2), None);
        assert_eq!(gate.record(Signal::Failed, false, 2), None);
        assert_eq!(
            gate.record(Signal::Failed, false, 2),
            Some(Transition::Opened)
        );
        assert_eq!(gate.state(2).open_since, Some(2));
        // A straggler's failure neither probes nor reopens.
        assert_eq!(gate.record(Signal::Failed, false, 3), None);
        assert_eq!(
            gate.admit(3),
            Pass::Hold {
                until: 5_002,
                reason: HoldReason::Open
            }
        );
        // At the probe time exactly one goes.
        assert_eq!(
            gate.admit(5_002),
            Pass::Go {
                wait_ms: 0,
                probe: true
            }
        );
        assert!(matches!(
            gate.admit(5_002),
            Pass::Hold {
                reason: HoldReason::Open,
                ..
            }
        ));
        // Failing probes back off: 10 s, 20 s, 40 s, then 60 s at most.
        let mut now = 5_002;
        let mut gaps = Vec::new();
        for _ in 0..5 {
            gate.record(Signal::Failed, true, now);
            let Pass::Hold { until, .. } = gate.admit(now) else {
                panic!("open");
            };
            gaps.push(until - now);
            now = until;
            assert!(matches!(gate.admit(now), Pass::Go { probe: true, .. }));
        }
        assert_eq!(gaps, [10_000, 20_000, 40_000, 60_000, 60_000]);
        // An answer closes it, and concurrency ramps up: one, then two, then more.
        assert_eq!(
            gate.record(Signal::Answered, true, now),
            Some(Transition::Recovered)
        );
        assert_eq!(gate.state(now).open_since, None);
        assert!(go(&mut gate, now));
        assert_eq!(
            gate.admit(now),
            Pass::Hold {
                until: now + RAMP_HOLD_MS,
                reason: HoldReason::Ramp
            }
        );
        gate.record(Signal::Answered, false, now);
        assert!(go(&mut gate, now));
        assert!(go(&mut gate, now));
        assert!(!go(&mut gate, now));
        gate.record(Signal::Answered, false, now);
        gate.record(Signal::Answered, false, now);
        for _ in 0..4 {
            assert!(go(&mut gate, now));
        }
        assert!(!go(&mut gate, now));
        for _ in 0..4 {
            gate.record(Signal::Answered, false, now);
        }
        // Ramped up to the host's concurrency: no more holds (hosts.rs has the slots).
        for _ in 0..20 {
            assert!(go(&mut gate, now));
        }
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_message_probe() {
        let mut gate = HostGate::new(Limits {
            failures: 1,
            ..LIMITS
        });
        gate.admit(0);
        gate.record(Signal::Failed, false, 0);
        assert!(matches!(gate.admit(5_000), Pass::Go { probe: true, .. }));
        gate.abandon(true);
        assert!(matches!(gate.admit(5_000), Pass::Go { probe: true, .. }));
    }

    #[test]
    fn a_throttled_probe_closes_the_breaker_and_pauses_the_host() {
        let mut gate = HostGate::new(Limits {
            failures: 1,
            ..LIMITS
        });
        gate.admit(0);
        gate.record(Signal::Failed, false, 0);
        gate.admit(5_000);
        assert_eq!(
            gate.record(Signal::Throttled(8_000), true, 5_000),
            Some(Transition::Recovered)
        );
        assert!(matches!(
            gate.admit(6_000),
            Pass::Hold {
                reason: HoldReason::Throttled,
                ..
            }
        ));
    }

    /// Sends as many as it may each millisecond for `ms`, returning the send times.
    fn drain(gate: &mut HostGate, ms: Millis) -> Vec<Millis> {
        let mut sent = Vec::new();
        for now in 0..ms {
            while let Pass::Go { wait_ms, .. } = gate.admit(now) {
                gate.record(Signal::Answered, false, now);
                sent.push(now + wait_ms);
                if wait_ms > 0 {
                    break;
                }
            }
        }
        sent
    }

    #[test]
    fn the_rate_holds_in_every_second_with_a_tenth_of_a_second_of_burst() {
        let mut gate = HostGate::new(Limits {
            max_per_second: Some(50.0),
            ..LIMITS
        });
        let mut sent = drain(&mut gate, 10_000);
        sent.sort();
        // 5 at once, then one every 20 ms.
        assert_eq!(&sent[..5], &[0, 0, 0, 0, 0]);
        for window in 0..9_000 {
            let n = sent
                .iter()
                .filter(|t| (window..window + 1_000).contains(*t))
                .count();
            assert!(n <= 55, "{n} in the second from {window} ms");
        }
        assert!(sent.len() >= 500, "{}", sent.len());
    }

    #[test]
    fn messages_held_for_the_rate_come_back_spread_at_the_rate() {
        let mut gate = HostGate::new(Limits {
            max_per_second: Some(10.0),
            ..LIMITS
        });
        let mut held = Vec::new();
        let mut went = 0;
        for _ in 0..30 {
            match gate.admit(0) {
                Pass::Go { .. } => went += 1,
                Pass::Hold { until, reason } => {
                    assert_eq!(reason, HoldReason::Rate);
                    held.push(until);
                }
            }
        }
        // One at once and two more within the wait (100 ms apart).
        assert_eq!(went, 3);
        assert!(held.windows(2).all(|w| w[1] - w[0] == 100), "{held:?}");
        assert_eq!(held[0], 300);
    }

    #[test]
    fn an_idle_gate_can_be_forgotten() {
        let mut gate = HostGate::new(LIMITS);
        assert!(gate.is_idle(0));
        gate.admit(0);
        assert!(!gate.is_idle(0));
        gate.record(Signal::Answered, false, 0);
        assert!(gate.is_idle(0));
        gate.admit(0);
        gate.record(Signal::Failed, false, 0);
        assert!(!gate.is_idle(0), "a failure is remembered");
    }
}
