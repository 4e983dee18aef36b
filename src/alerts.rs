//! Dead-letter alerts: when a message goes dead, callbackd posts a `message.dead` event to
//! `[alerts] webhook_url`, signed with Standard Webhooks (`[alerts] secret`).
//!
//! The alert is itself a message: it is accepted into the store like any other before the
//! dead letter is recorded, so it is delivered with the same retries and survives restarts.
//! If the alert cannot be recorded, neither is the dead letter (the lease runs out and the
//! attempt is made again), so a dead letter never goes unannounced. A crash between the two
//! steps repeats the attempt, and the alert's dedupe key (message id and attempt number)
//! keeps the repeat from announcing the same death twice. An alert that dies itself is not
//! announced: alerts never alert about alerts.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::clock::{Millis, format_iso};
use crate::config::ConfigError;
use crate::digest::short_hash;
use crate::dispatch::ssrf::{SsrfGuard, is_forbidden};
use crate::redact::display_url;
use crate::store::{
    AcceptRequest, DedupeClaim, DeliveryAttempt, Lease, MessageId, MessageKind, NewMessage,
    Partitions,
};
use crate::trace::{TRACEPARENT, TRACESTATE};
use crate::webhook::decode_whsec;

/// The event type of a dead-letter alert (its `type` and `X-Callback-Event`).
pub const DEAD_EVENT: &str = "message.dead";
/// Ordering keys of alert messages start with this: each alert is its own key, so one slow
/// alert receiver never holds another alert back, and a dead alert is known as one.
const ORDERING_PREFIX: &str = "alert/";

/// `[alerts]` in the config file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlertsConfig {
    /// Where `message.dead` events are posted.
    pub webhook_url: String,
    /// `whsec_<base64>`: the Standard Webhooks signing secret the receiver verifies with.
    pub secret: String,
    /// Base URL operators open the console at, for the link in each alert
    /// (default: `http://<server.listen>`).
    #[serde(default)]
    pub console_url: Option<String>,
    /// Lets `webhook_url` reach loopback, private and other internal addresses (an alert
    /// receiver inside the network) without opening `dispatch.allow_private_networks` for
    /// every connector's `callbackUrl`. Off, such a URL is refused at start-up when it is a
    /// literal address, and at every delivery on the addresses its name resolves to.
    #[serde(default)]
    pub allow_private_webhook_url: bool,
}

impl AlertsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: format!("alerts.{key}"),
            message,
        };
        let url = reqwest::Url::parse(&self.webhook_url)
            .map_err(|e| invalid("webhook_url", format!("not a URL: {e}")))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid("webhook_url", "must be http or https".into()));
        }
        // A literal internal address would be refused at every delivery, and the operator
        // never alerted: say so now.
        let literal = url
            .host_str()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
            .and_then(|h| h.parse::<std::net::IpAddr>().ok());
        if !self.allow_private_webhook_url && literal.is_some_and(is_forbidden) {
            return Err(invalid(
                "webhook_url",
                "is a loopback, private or reserved address, which the SSRF guard refuses; set \
                 alerts.allow_private_webhook_url = true if the alert receiver is internal"
                    .into(),
            ));
        }
        if !self.secret.starts_with("whsec_") {
            return Err(invalid(
                "secret",
                "must be a Standard Webhooks secret, `whsec_<base64>`".into(),
            ));
        }
        let key = decode_whsec(&self.secret).map_err(|m| invalid("secret", m))?;
        if key.len() < 16 {
            return Err(invalid("secret", "must hold at least 16 bytes".into()));
        }
        if let Some(base) = &self.console_url {
            reqwest::Url::parse(base)
                .map_err(|e| invalid("console_url", format!("not a URL: {e}")))?;
        }
        Ok(())
    }
}

/// Whether a message is a dead-letter alert.
pub fn is_alert(message: &NewMessage) -> bool {
    message.ordering_key.starts_with(ORDERING_PREFIX)
}

/// Why a message went dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeathReason {
    /// The receiver answered 410 Gone.
    Gone,
    /// The delivery window ran out.
    Expired,
}

impl DeathReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Gone => "gone",
            DeathReason::Expired => "expired",
        }
    }
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
    /// The alert target of a validated `[alerts]` section; the console link defaults to the
    /// server's `listen` address.
    pub fn new(
        config: &AlertsConfig,
        listen: SocketAddr,
        max_age: Duration,
        dedupe_ttl: Duration,
    ) -> Result<Alerts, String> {
        Ok(Alerts {
            url: config.webhook_url.clone(),
            secret: decode_whsec(&config.secret)?,
            console_base: config
                .console_url
                .clone()
                .unwrap_or_else(|| format!("http://{listen}"))
                .trim_end_matches('/')
                .to_string(),
            ssrf: SsrfGuard {
                allow_private: config.allow_private_webhook_url,
            },
            max_age,
            dedupe_ttl,
        })
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
        let ordering_key = format!("{ORDERING_PREFIX}{}", dead.id);
        let message = NewMessage {
            id: MessageId::generate(now, &ordering_key, partitions),
            kind: MessageKind::Notification,
            source: None,
            payment_id: None,
            transaction_id: None,
            ordering_key,
            event: Some(DEAD_EVENT.to_string()),
            target_url: Some(self.url.clone()),
            // The alert continues the dead message's trace, if it had one.
            headers: dead
                .headers
                .iter()
                .filter(|(k, _)| k.as_str() == TRACEPARENT || k.as_str() == TRACESTATE)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            body,
            created_at: now,
            deadline: crate::config::deadline(now, self.max_age),
        };
        Some(AcceptRequest {
            dedupe: DedupeClaim {
                // One alert per death: a repeat of the same attempt (after a crash) replays.
                key: short_hash(format!("alert\n{}\n{}", dead.id, attempt.attempt).as_bytes()),
                ttl_secs: self.dedupe_ttl.as_secs(),
                fingerprint: String::new(),
                response: String::new(),
            },
            message,
            payment: None,
            seal: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

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
