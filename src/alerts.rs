//! Dead-letter alerts: when a message goes dead, callbackd posts a `message.dead` event to
//! `[alerts] webhook_url`, signed with Standard Webhooks (`[alerts] secret`).
//!
//! The alert is itself a message: it is accepted into the store like any other before the
//! dead letter is recorded, so it is delivered with the same retries and survives restarts.
//! If the alert cannot be recorded, neither is the dead letter (the lease runs out and the
//! attempt is made again), so a death given its own alert never goes unannounced. A crash
//! between the two steps repeats the attempt, and the alert's dedupe key (message id and
//! attempt number) keeps the repeat from announcing the same death twice. An alert that dies itself is not
//! announced: alerts never alert about alerts.
//!
//! Alerts are coalesced, so an incident that kills thousands of messages does not send
//! thousands of webhooks that then compete with real deliveries: per `[alerts]
//! digest_interval_secs` window, the first `max_alerts_per_interval` deaths are announced one by
//! one as above, and the rest are counted ([`AlertBudget`]) and announced together by one
//! `message.dead.digest` at the window's end, with their counts and a link to the console's
//! dead-letter list. The digest is accepted as a durable message like any alert, but its counts
//! are held in memory until then: a process that crashes inside a window loses that window's
//! digest (the deaths stay in the dead-letter list); a process that stops sends it first.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value, json};

use crate::app::AlertSettings;
use crate::clock::{Millis, format_iso};
use crate::digest::short_hash;
use crate::ordering::OrderingKey;
use crate::redact::display_url;
use crate::ssrf::SsrfGuard;
use crate::store::lifecycle::policy::{AttemptResult, DeathReason};
use crate::store::{
    AcceptRequest, DedupeClaim, DeliveryAttempt, Lease, MessageId, MessageKind, NewMessage,
    Partitions,
};
use crate::trace::{TRACEPARENT, TRACESTATE};

/// The event type of a dead-letter alert (its `type` and `X-Callback-Event`).
pub const DEAD_EVENT: &str = "message.dead";
/// The event type of the summary of a window's deaths beyond the cap.
pub const DIGEST_EVENT: &str = "message.dead.digest";
/// The event type of the alert that a host's circuit breaker opened.
pub const HOST_OPEN_EVENT: &str = "host.breaker.open";
/// The event type of the alert that a host whose breaker was open answered again.
pub const HOST_RECOVERED_EVENT: &str = "host.breaker.closed";
/// Message ids a digest lists; its counts cover every death.
pub const DIGEST_SAMPLE: usize = 20;
/// Whether a message is a dead-letter alert. Each alert is its own ordering key, so one slow
/// alert receiver never holds another alert back, and a dead alert is known as one.
pub fn is_alert(message: &NewMessage) -> bool {
    crate::ordering::is_alert(&message.ordering_key)
}

/// The configured alert target, ready to make alert messages.
#[derive(Clone)]
pub struct Alerts {
    url: String,
    secret: Vec<u8>,
    console_base: String,
    /// Which addresses `webhook_url` may reach (`allow_private_webhook_url`).
    ssrf: SsrfGuard,
    /// `dispatch.max_age_secs`: an alert is delivered as long as any message.
    max_age: Duration,
    dedupe_ttl: Duration,
    digest_interval: Duration,
    max_per_interval: u32,
}

impl std::fmt::Debug for Alerts {
    /// The signing key never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Alerts")
            .field("url", &self.url)
            .field("console_base", &self.console_base)
            .finish_non_exhaustive()
    }
}

impl Alerts {
    /// The alert target of a checked `[alerts]` section.
    pub fn new(settings: &AlertSettings, max_age: Duration, dedupe_ttl: Duration) -> Alerts {
        Alerts {
            url: settings.webhook_url.clone(),
            secret: settings.secret.clone(),
            console_base: settings.console_base.clone(),
            ssrf: SsrfGuard {
                allow_private: settings.allow_private,
            },
            max_age,
            dedupe_ttl,
            digest_interval: settings.digest_interval,
            max_per_interval: settings.max_per_interval,
        }
    }

    /// A fresh count of deaths for one process, by this target's window and cap.
    pub fn budget(&self) -> AlertBudget {
        AlertBudget::new(
            Millis::try_from(self.digest_interval.as_millis()).unwrap_or(Millis::MAX),
            self.max_per_interval,
        )
    }

    /// Which addresses alert deliveries may reach: their own switch, so an internal alert
    /// receiver does not open connectors' `callbackUrl`s.
    pub fn ssrf(&self) -> SsrfGuard {
        self.ssrf
    }

    /// The key alert deliveries are signed with.
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// The alert announcing that `claimed` went dead after `attempt`, to be accepted before
    /// the dead letter is recorded, into a store of `partitions`; `None` when the dead message
    /// is an alert itself.
    pub fn dead_letter(
        &self,
        claimed: &Lease,
        attempt: &DeliveryAttempt,
        reason: DeathReason,
        now: Millis,
        partitions: Partitions,
    ) -> Option<AcceptRequest> {
        let dead = &claimed.message;
        if is_alert(dead) {
            return None;
        }
        let mut data = Map::new();
        data.insert("messageId".into(), json!(dead.id.as_str()));
        data.insert("kind".into(), json!(dead.kind));
        match dead.kind {
            MessageKind::Notification => {
                data.insert("paymentId".into(), json!(dead.payment_id));
            }
            MessageKind::Inbound => {
                data.insert("source".into(), json!(dead.source));
                data.insert("transactionId".into(), json!(dead.transaction_id));
            }
        }
        if let Some(event) = &dead.event {
            data.insert("event".into(), json!(event));
        }
        data.insert("reason".into(), json!(reason.as_str()));
        data.insert("attempts".into(), json!(attempt.attempt));
        data.insert("lastStatus".into(), json!(attempt.status));
        if let Some(error) = &attempt.error {
            data.insert("lastError".into(), json!(error));
        }
        // Alerts often go to a third-party chat: the signed query stays behind.
        data.insert(
            "targetUrl".into(),
            json!(dead.target_url.as_deref().map(display_url)),
        );
        data.insert(
            "consoleUrl".into(),
            json!(format!(
                "{}/console/messages/{}",
                self.console_base, dead.id
            )),
        );
        let body = json!({
            "type": DEAD_EVENT,
            "timestamp": format_iso(now),
            "data": Value::Object(data),
        })
        .to_string();
        // The alert continues the dead message's trace, if it had one.
        let headers = dead
            .headers
            .iter()
            .filter(|(k, _)| k.as_str() == TRACEPARENT || k.as_str() == TRACESTATE)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // One alert per death: a repeat of the same attempt (after a crash) replays.
        let dedupe_key = short_hash(format!("alert\n{}\n{}", dead.id, attempt.attempt).as_bytes());
        Some(self.request(
            OrderingKey::Alert(dead.id.as_str()).to_string(),
            DEAD_EVENT,
            body,
            headers,
            dedupe_key,
            now,
            partitions,
        ))
    }

    /// The alert announcing the deaths `digest` counted, into a store of `partitions`.
    pub fn digest(&self, digest: &Digest, now: Millis, partitions: Partitions) -> AcceptRequest {
        let reasons: Map<String, Value> = DeathReason::ALL
            .into_iter()
            .map(|reason| (reason.as_str().to_string(), json!(digest.deaths(reason))))
            .collect();
        let body = json!({
            "type": DIGEST_EVENT,
            "timestamp": format_iso(now),
            "data": {
                "from": format_iso(digest.from),
                "to": format_iso(digest.to),
                "count": digest.count,
                "reasons": reasons,
                "messageIds": digest.sample,
                "consoleUrl": format!("{}/console/messages?state=dead", self.console_base),
            },
        })
        .to_string();
        // Each digest is its own: two processes' digests of one window are two messages.
        let nonce = format!("{:032x}", rand::random::<u128>());
        let dedupe_key = short_hash(format!("alert-digest\n{nonce}").as_bytes());
        self.request(
            OrderingKey::Alert(&format!("digest/{nonce}")).to_string(),
            DIGEST_EVENT,
            body,
            Default::default(),
            dedupe_key,
            now,
            partitions,
        )
    }

    /// The alert that this process's breaker for `host` (`host:port`) opened (`open`) or
    /// closed, after the attempt that got `result`. One per change, whatever the backlog.
    pub fn host(
        &self,
        host: &str,
        open: bool,
        result: &AttemptResult,
        now: Millis,
        partitions: Partitions,
    ) -> AcceptRequest {
        let event = if open {
            HOST_OPEN_EVENT
        } else {
            HOST_RECOVERED_EVENT
        };
        let body = json!({
            "type": event,
            "timestamp": format_iso(now),
            "data": {
                "host": host,
                "lastStatus": result.status,
                "lastError": result.error.map(|e| e.as_str()),
            },
        })
        .to_string();
        // Each change is its own: two processes' alerts about one host are two messages.
        let nonce = format!("{:032x}", rand::random::<u128>());
        let dedupe_key = short_hash(format!("alert-host\n{nonce}").as_bytes());
        self.request(
            OrderingKey::Alert(&format!("host/{nonce}")).to_string(),
            event,
            body,
            Default::default(),
            dedupe_key,
            now,
            partitions,
        )
    }

    /// An alert message to this target: each is its own ordering key.
    #[allow(clippy::too_many_arguments)]
    fn request(
        &self,
        ordering_key: String,
        event: &str,
        body: String,
        headers: BTreeMap<String, String>,
        dedupe_key: String,
        now: Millis,
        partitions: Partitions,
    ) -> AcceptRequest {
        let message = NewMessage {
            id: MessageId::generate(now, &ordering_key, partitions),
            kind: MessageKind::Notification,
            source: None,
            payment_id: None,
            transaction_id: None,
            ordering_key,
            event: Some(event.to_string()),
            target_url: Some(self.url.clone()),
            headers,
            body,
            created_at: now,
            deadline: crate::clock::deadline(now, self.max_age),
        };
        AcceptRequest {
            dedupe: DedupeClaim {
                key: dedupe_key,
                ttl_secs: self.dedupe_ttl.as_secs(),
                fingerprint: None,
                response: String::new(),
            },
            message,
            payment: None,
            seal: None,
        }
    }
}

/// One process's count of deaths per window, pure: which are announced one by one and which
/// wait for their window's digest.
#[derive(Debug)]
pub struct AlertBudget {
    interval_ms: Millis,
    cap: u32,
    /// The window the cap is counting, and how many alerts went out in it.
    window: Millis,
    sent: u32,
    /// Windows with deaths beyond the cap, by start.
    digests: BTreeMap<Millis, Digest>,
}

/// The deaths of one window beyond its cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    pub from: Millis,
    pub to: Millis,
    pub count: u64,
    /// Deaths by reason, in the order of [`DeathReason::ALL`].
    pub by_reason: [u64; DeathReason::ALL.len()],
    /// The first [`DIGEST_SAMPLE`] ids.
    pub sample: Vec<String>,
}

impl Digest {
    /// The deaths it counts for `reason`.
    pub fn deaths(&self, reason: DeathReason) -> u64 {
        self.by_reason[reason_index(reason)]
    }
}

/// Where `reason` is counted in [`Digest::by_reason`].
fn reason_index(reason: DeathReason) -> usize {
    DeathReason::ALL
        .iter()
        .position(|r| *r == reason)
        .unwrap_or_default()
}

impl AlertBudget {
    pub fn new(interval_ms: Millis, cap: u32) -> AlertBudget {
        AlertBudget {
            interval_ms: interval_ms.max(1),
            cap,
            window: Millis::MIN,
            sent: 0,
            digests: BTreeMap::new(),
        }
    }

    fn window_of(&self, now: Millis) -> Millis {
        now - now.rem_euclid(self.interval_ms)
    }

    /// Whether a death at `now` gets an alert of its own (counted against the cap), or waits
    /// for the digest ([`AlertBudget::coalesce`]).
    pub fn admit(&mut self, now: Millis) -> bool {
        let window = self.window_of(now);
        if window != self.window {
            self.window = window;
            self.sent = 0;
        }
        if self.sent < self.cap {
            self.sent += 1;
            true
        } else {
            false
        }
    }

    /// Counts a death recorded at `now` without an alert of its own.
    pub fn coalesce(&mut self, now: Millis, id: &MessageId, reason: DeathReason) {
        let from = self.window_of(now);
        let to = from.saturating_add(self.interval_ms);
        let digest = self.digests.entry(from).or_insert_with(|| Digest {
            from,
            to,
            count: 0,
            by_reason: [0; DeathReason::ALL.len()],
            sample: Vec::new(),
        });
        digest.count += 1;
        digest.by_reason[reason_index(reason)] += 1;
        if digest.sample.len() < DIGEST_SAMPLE {
            digest.sample.push(id.to_string());
        }
    }

    /// The digests of windows over at `now`, taken out; `until = None` takes them all (the
    /// process is stopping).
    pub fn take_due(&mut self, until: Option<Millis>) -> Vec<Digest> {
        let keep = match until {
            Some(now) => self.digests.split_off(&self.window_of(now)),
            None => BTreeMap::new(),
        };
        std::mem::replace(&mut self.digests, keep)
            .into_values()
            .collect()
    }

    /// Puts back a digest that could not be recorded, so the next flush sends it.
    pub fn restore(&mut self, digest: Digest) {
        let kept = self.digests.entry(digest.from).or_insert_with(|| Digest {
            count: 0,
            by_reason: [0; DeathReason::ALL.len()],
            sample: Vec::new(),
            ..digest.clone()
        });
        kept.count += digest.count;
        for (kept, more) in kept.by_reason.iter_mut().zip(digest.by_reason) {
            *kept += more;
        }
        for id in digest.sample {
            if kept.sample.len() < DIGEST_SAMPLE {
                kept.sample.push(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::Config;

    fn load(alerts: &str) -> Result<Config, String> {
        let text = format!("[store]\nurl = \"sqlite:///tmp/x.db\"\n[alerts]\n{alerts}");
        Config::from_toml_str(&text, Path::new("t.toml"), std::iter::empty())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn alerts_config_is_validated_naming_the_key() {
        let ok = "webhook_url = \"https://ops.example.com/hooks\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"";
        assert!(load(ok).unwrap().alerts.is_some());
        let raw = "webhook_url = \"https://ops.example.com/hooks\"\nsecret = \"plain\"";
        assert!(load(raw).unwrap_err().contains("alerts.secret"));
        let url = "webhook_url = \"ftp://x\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"";
        assert!(load(url).unwrap_err().contains("alerts.webhook_url"));
        assert!(load("secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"").is_err());
    }

    #[test]
    fn the_window_and_the_cap_are_validated_naming_the_key() {
        let base = "webhook_url = \"https://ops.example.com/hooks\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"";
        let alerts = load(base).unwrap().alerts.unwrap();
        assert_eq!(
            (alerts.digest_interval_secs, alerts.max_alerts_per_interval),
            (60, 10)
        );
        for (extra, key) in [
            ("digest_interval_secs = 0", "alerts.digest_interval_secs"),
            (
                "digest_interval_secs = 86401",
                "alerts.digest_interval_secs",
            ),
            (
                "max_alerts_per_interval = 10001",
                "alerts.max_alerts_per_interval",
            ),
            (
                "max_alerts_per_interval = -1",
                "alerts.max_alerts_per_interval",
            ),
        ] {
            let err = load(&format!("{base}\n{extra}")).unwrap_err();
            assert!(err.contains(key), "{extra}: {err}");
        }
        assert!(load(&format!("{base}\nmax_alerts_per_interval = 0")).is_ok());
    }

    /// The first `cap` deaths of a window get their own alert, the rest its digest, which is
    /// due once the window is over; a new window starts the cap over.
    #[test]
    fn deaths_beyond_the_cap_wait_for_their_windows_digest() {
        let id = |n: i64| MessageId::generate(n, "k", Partitions::DEFAULT);
        let mut budget = AlertBudget::new(60_000, 2);
        let t = 600_000;
        assert!(budget.admit(t));
        assert!(budget.admit(t + 1));
        for n in 0..30 {
            assert!(!budget.admit(t + 2));
            let reason = if n % 3 == 0 {
                DeathReason::Expired
            } else {
                DeathReason::Gone
            };
            budget.coalesce(t + 2, &id(n), reason);
        }
        assert!(budget.take_due(Some(t + 59_999)).is_empty(), "still open");
        assert!(budget.admit(t + 60_000), "a new window, a new cap");
        budget.coalesce(t + 60_001, &id(99), DeathReason::Gone);
        let due = budget.take_due(Some(t + 60_001));
        assert_eq!(due.len(), 1);
        let d = &due[0];
        assert_eq!((d.from, d.to), (t, t + 60_000));
        assert_eq!(
            (
                d.count,
                d.deaths(DeathReason::Gone),
                d.deaths(DeathReason::Expired)
            ),
            (30, 20, 10)
        );
        assert_eq!(d.sample.len(), DIGEST_SAMPLE);
        budget.restore(d.clone());
        let all = budget.take_due(None);
        assert_eq!(all.iter().map(|d| d.count).sum::<u64>(), 31);
        assert!(budget.take_due(None).is_empty());
    }

    /// An internal literal would be refused at every delivery, so it is refused at start-up,
    /// unless the alert receiver is declared internal.
    #[test]
    fn an_internal_webhook_url_needs_its_own_switch() {
        let secret = "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"";
        for url in [
            "http://169.254.169.254/latest/meta-data",
            "http://127.0.0.1:9/hooks",
            "http://10.1.2.3/hooks",
            "http://[::1]/hooks",
        ] {
            let text = format!("webhook_url = \"{url}\"\n{secret}");
            let err = load(&text).unwrap_err();
            assert!(err.contains("alerts.webhook_url"), "{url}: {err}");
            assert!(err.contains("alerts.allow_private_webhook_url"), "{err}");
            let allowed = format!("{text}\nallow_private_webhook_url = true");
            let alerts = load(&allowed).unwrap().alerts.unwrap();
            assert!(alerts.allow_private_webhook_url);
        }
    }
}
