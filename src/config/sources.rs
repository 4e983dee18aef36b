//! `[sources.<name>]`: one provider account each, with its signature scheme, its secrets and
//! where its callbacks are forwarded. Validation here is per source; the exposure rules that
//! depend on `server.listen` come in from `validate.rs`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::validate::Exposure;
use super::{ConfigError, invalid};
use crate::redact::{Secret, url_credentials};
use crate::webhook::decode_whsec;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SignatureScheme {
    Payzu,
    StandardWebhooks,
    HmacSha256,
    None,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    #[serde(default)]
    pub secrets: Vec<String>,
    pub signature: SignatureScheme,
    #[serde(default)]
    pub signature_header: Option<String>,
    #[serde(default = "default_tolerance")]
    pub tolerance_secs: u64,
    #[serde(default)]
    pub forward_url: Option<String>,
    /// Lets `forward_url` reach loopback, private and other internal addresses (a merchant
    /// handler on the internal network). Off, such a target is refused at start-up when it
    /// is a literal address, and at every delivery on the addresses its name resolves to.
    #[serde(default)]
    pub allow_private_forward_url: bool,
    #[serde(default)]
    pub forward_headers: BTreeMap<String, String>,
    #[serde(default)]
    pub forward_secret: Option<String>,
    #[serde(default)]
    pub dedupe_fields: Option<Vec<String>>,
    /// Base URL of the provider's own API (PayZu: `https://api.payzu.example`), for a
    /// recovery (`callbackd recover`), which asks it to resend callbacks. With
    /// `provider_api_token`, or neither.
    #[serde(default)]
    pub provider_api_url: Option<String>,
    /// Bearer token of the provider's API; never echoed or logged ([`Secret`]).
    #[serde(default)]
    pub provider_api_token: Option<Secret>,
}

fn default_tolerance() -> u64 {
    300
}

impl SourceConfig {
    pub(super) fn validate(&self, name: &str, exposure: Exposure) -> Result<(), ConfigError> {
        let key = |k: &str| format!("sources.{name}.{k}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(invalid(
                format!("sources.{name}"),
                "source names are path segments: use letters, digits, '-' and '_'",
            ));
        }
        match self.signature {
            SignatureScheme::None => {}
            _ if self.secrets.is_empty() => {
                return Err(invalid(
                    key("secrets"),
                    "at least one secret is required (or signature = \"none\" to opt out)",
                ));
            }
            _ => {}
        }
        for (i, secret) in self.secrets.iter().enumerate() {
            let secret_key = format!("{}[{i}]", key("secrets"));
            if secret.is_empty() {
                return Err(invalid(secret_key, "is empty: anyone could sign"));
            }
            let len = if self.signature == SignatureScheme::StandardWebhooks {
                decode_whsec(secret)
                    .map_err(|m| invalid(&secret_key, m))?
                    .len()
            } else {
                secret.len()
            };
            exposure.check(&secret_key, secret, len)?;
        }
        if self.signature == SignatureScheme::HmacSha256 && self.signature_header.is_none() {
            return Err(invalid(
                key("signature_header"),
                "required when signature = \"hmac-sha256\"",
            ));
        }
        if let Some(header) = &self.signature_header
            && axum::http::HeaderName::from_bytes(header.as_bytes()).is_err()
        {
            return Err(invalid(key("signature_header"), "not a valid header name"));
        }
        if let Some(url) = &self.forward_url {
            let parsed = reqwest::Url::parse(url)
                .map_err(|e| invalid(key("forward_url"), format!("not a URL: {e}")))?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(invalid(key("forward_url"), "must be http:// or https://"));
            }
            let literal = parsed
                .host_str()
                .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
                .and_then(|h| h.parse::<std::net::IpAddr>().ok());
            if !self.allow_private_forward_url && literal.is_some_and(crate::ssrf::is_forbidden) {
                return Err(invalid(
                    key("forward_url"),
                    format!(
                        "is a loopback, private or reserved address, which the SSRF guard \
                         refuses; set {} = true if the merchant's handler is internal",
                        key("allow_private_forward_url")
                    ),
                ));
            }
        }
        for header in self.forward_headers.keys() {
            if axum::http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(invalid(
                    format!("{}.{header}", key("forward_headers")),
                    "not a valid header name",
                ));
            }
        }
        if let Some(secret) = &self.forward_secret {
            let decoded = decode_whsec(secret).map_err(|m| invalid(key("forward_secret"), m))?;
            exposure.check(&key("forward_secret"), secret, decoded.len())?;
        }
        self.validate_provider_api(name, exposure)?;
        if let Some(fields) = &self.dedupe_fields {
            for (i, field) in fields.iter().enumerate() {
                if !field.starts_with('/') {
                    return Err(invalid(
                        format!("{}[{i}]", key("dedupe_fields")),
                        format!("`{field}` is not a JSON pointer (it must start with '/')"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `provider_api_url` and `provider_api_token`: both or neither; the URL an http(s) base
    /// with a host and no credentials of its own (the token is where a credential goes); the
    /// token as strong as the other secrets. Neither value is echoed (a URL's user and
    /// password are hidden).
    fn validate_provider_api(&self, name: &str, exposure: Exposure) -> Result<(), ConfigError> {
        let key = |k: &str| format!("sources.{name}.{k}");
        let (url, token) = match (&self.provider_api_url, &self.provider_api_token) {
            (None, None) => return Ok(()),
            (Some(_), None) => {
                return Err(invalid(
                    key("provider_api_token"),
                    format!("is required with {}", key("provider_api_url")),
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    key("provider_api_url"),
                    format!("is required with {}", key("provider_api_token")),
                ));
            }
            (Some(url), Some(token)) => (url, token),
        };
        let url_key = key("provider_api_url");
        let shown = url_credentials(url);
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| invalid(&url_key, format!("`{shown}` is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(invalid(&url_key, "must be http:// or https://"));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(invalid(&url_key, "has no host"));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(invalid(
                &url_key,
                format!(
                    "must not hold credentials (`{shown}`): put the token in {}",
                    key("provider_api_token")
                ),
            ));
        }
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(invalid(
                &url_key,
                "is a base URL: no query or fragment (the resend path is appended to it)",
            ));
        }
        let token_key = key("provider_api_token");
        let token = token.expose();
        if token.is_empty() {
            return Err(invalid(token_key, "is empty"));
        }
        if token.len() < 8 {
            return Err(invalid(token_key, "tokens must be at least 8 characters"));
        }
        if token.chars().any(|c| c.is_control() || c == ' ') {
            return Err(invalid(
                token_key,
                "must be visible characters without spaces (it is sent in a header)",
            ));
        }
        exposure.check(&token_key, token, token.len())
    }
}
