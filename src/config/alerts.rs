//! `[alerts]` in the config file, and its checks. The alerts themselves are made in
//! `alerts.rs`, from the [`AlertSettings`](super::AlertSettings) derived from this.

use serde::Deserialize;

use super::ConfigError;
use crate::ssrf::is_forbidden;
use crate::webhook::decode_whsec;

/// Largest `alerts.max_alerts_per_interval`.
const MAX_ALERTS_PER_INTERVAL: u32 = 10_000;
/// Longest `alerts.digest_interval_secs`: a day.
const MAX_DIGEST_INTERVAL_SECS: u64 = 86_400;
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
    /// The window deaths are counted in: at most `max_alerts_per_interval` alerts per window,
    /// then one digest of the rest when it ends.
    #[serde(default = "default_digest_interval_secs")]
    pub digest_interval_secs: u64,
    /// Deaths announced one by one per window (0: every death goes into the digest).
    #[serde(default = "default_max_alerts_per_interval")]
    pub max_alerts_per_interval: u32,
}

fn default_digest_interval_secs() -> u64 {
    60
}

fn default_max_alerts_per_interval() -> u32 {
    10
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
        if !(1..=MAX_DIGEST_INTERVAL_SECS).contains(&self.digest_interval_secs) {
            return Err(invalid(
                "digest_interval_secs",
                format!("must be 1 to {MAX_DIGEST_INTERVAL_SECS} seconds"),
            ));
        }
        if self.max_alerts_per_interval > MAX_ALERTS_PER_INTERVAL {
            return Err(invalid(
                "max_alerts_per_interval",
                format!("must be at most {MAX_ALERTS_PER_INTERVAL}"),
            ));
        }
        if let Some(base) = &self.console_url {
            reqwest::Url::parse(base)
                .map_err(|e| invalid("console_url", format!("not a URL: {e}")))?;
        }
        Ok(())
    }
}
