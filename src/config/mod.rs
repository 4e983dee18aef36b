//! Configuration: `config.toml`, then `CALLBACKD__SECTION__KEY` environment overrides, then
//! validation. Every error names the key it is about, because an operator reading a failed
//! start-up log should not have to guess which of forty settings is wrong.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde::Deserialize;

/// Environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "CALLBACKD_CONFIG";
/// Prefix of per-key overrides: `CALLBACKD__STORE__URL=redis://...`.
pub const OVERRIDE_PREFIX: &str = "CALLBACKD__";
pub const DEFAULT_CONFIG_PATH: &str = "config.toml";
/// Expired data is gone at most this long after it expires.
pub const MAX_SWEEP_INTERVAL_SECS: u64 = 60;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("environment override {var}: {message}")]
    Override { var: String, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub auth: AuthConfig,
    pub dispatch: DispatchConfig,
    pub log: LogConfig,
    pub sources: BTreeMap<String, SourceConfig>,
    /// Dead-letter alerts (`[alerts]`); none when absent.
    pub alerts: Option<crate::alerts::AlertsConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    /// How long a SIGTERM waits for in-flight deliveries before releasing their leases.
    pub shutdown_grace_secs: u64,
    /// Whole-request deadline once headers are in: a client that trickles its body gets 408.
    pub request_timeout_secs: u64,
    /// A client must send its request headers within this time (slowloris protection).
    pub header_timeout_secs: u64,
    /// Open connections beyond this wait in the kernel backlog instead of costing memory.
    pub max_connections: usize,
    /// HTTP/2 requests open at once on one connection; more are refused (REFUSED_STREAM).
    pub max_streams_per_connection: u32,
    /// Request body bytes held in memory at once, all connections together. A body that
    /// cannot get its share within a second is answered 503 + `Retry-After`.
    pub max_buffered_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 1_048_576,
            shutdown_grace_secs: 30,
            request_timeout_secs: 30,
            header_timeout_secs: 10,
            max_connections: 4096,
            max_streams_per_connection: 32,
            max_buffered_bytes: 64 * 1_048_576,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    pub url: String,
    pub dedupe_ttl_secs: u64,
    /// How long a payment's status outlives its last transition; at least `dedupe_ttl_secs`,
    /// so a refund after the dedupe claims are gone still finds the payment.
    pub payment_retention_secs: u64,
    /// How often expired claims, seals, payment states and finished messages are deleted.
    pub sweep_interval_secs: u64,
    pub require_durable: bool,
    /// Timeout of every store round trip; past it the request gets a 503, never a hang.
    pub timeout_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: "sqlite://data/callbackd.db".into(),
            dedupe_ttl_secs: 2_592_000,
            payment_retention_secs: crate::store::DEFAULT_PAYMENT_RETENTION_SECS,
            sweep_interval_secs: 30,
            require_durable: false,
            timeout_ms: 5_000,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    pub connector_tokens: Vec<String>,
    pub admin_tokens: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DispatchConfig {
    pub max_age_secs: u64,
    pub initial_backoff_ms: u64,
    pub max_backoff_secs: u64,
    pub request_timeout_ms: u64,
    pub concurrency: usize,
    /// Deliveries to one host at once, so one slow gateway cannot take every worker.
    pub per_host_concurrency: usize,
    /// How long a claimed message stays leased; must exceed `request_timeout_ms` with margin.
    pub lease_secs: u64,
    /// SSRF guard for connectors' `callbackUrl`s: true lets them reach loopback, private and
    /// other internal addresses. A source's `forward_url` has its own switch
    /// (`sources.<name>.allow_private_forward_url`): config is trusted, hand-offs less so.
    pub allow_private_networks: bool,
    /// Set to false to run an ingest-only process (the queue is served by other processes).
    pub enabled: bool,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        DispatchConfig {
            max_age_secs: 604_800,
            initial_backoff_ms: 1_000,
            max_backoff_secs: 3_600,
            request_timeout_ms: 10_000,
            concurrency: 64,
            per_host_concurrency: 16,
            lease_secs: 60,
            allow_private_networks: false,
            enabled: true,
        }
    }
}

/// Minimum gap between the request timeout and the lease, so a delivery that is slow but alive
/// finishes (and acks) before its lease can be reclaimed by another worker.
pub const LEASE_MARGIN_MS: u64 = 5_000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub format: LogFormat,
    /// `tracing` filter directive, e.g. `info` or `callbackd=debug`; `RUST_LOG` wins when set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

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
}

fn default_tolerance() -> u64 {
    300
}

/// Shortest token or secret accepted on a non-loopback `server.listen`: 16 random bytes are
/// 128 bits, which nobody guesses.
const MIN_EXPOSED_SECRET_BYTES: usize = 16;
/// How the example config's placeholders start (`change-me-admin-token`).
const PLACEHOLDER_PREFIX: &str = "change-me";

/// Who can reach the server, which decides how strong its tokens and secrets must be.
#[derive(Debug, Clone, Copy)]
enum Exposure {
    /// Only this machine: the example config's placeholders are fine for trying things out.
    Loopback,
    Network(SocketAddr),
}

impl Exposure {
    /// Refuses a placeholder or short token or secret when the server is reachable from the
    /// network, where anyone who read the README could use it. `len` is the key's length in
    /// bytes (decoded, for a `whsec_` secret). The value itself is never echoed.
    fn check(self, key: &str, raw: &str, len: usize) -> Result<(), ConfigError> {
        let Exposure::Network(listen) = self else {
            return Ok(());
        };
        let bare = raw.strip_prefix("whsec_").unwrap_or(raw);
        if bare.to_ascii_lowercase().starts_with(PLACEHOLDER_PREFIX) {
            return Err(invalid(
                key,
                format!(
                    "is a placeholder (`{PLACEHOLDER_PREFIX}...`) and server.listen ({listen}) is \
                     not loopback: set a random value, e.g. from `openssl rand -hex 32`"
                ),
            ));
        }
        if len < MIN_EXPOSED_SECRET_BYTES {
            return Err(invalid(
                key,
                format!(
                    "is {len} bytes and server.listen ({listen}) is not loopback: use at least \
                     {MIN_EXPOSED_SECRET_BYTES} random bytes, e.g. from `openssl rand -hex 32`"
                ),
            ));
        }
        Ok(())
    }
}

/// Where the store lives, parsed from `store.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    Sqlite(PathBuf),
    Redis(String),
}

impl Config {
    /// Loads the file at `path` (or, when `None`, `$CALLBACKD_CONFIG`, else `./config.toml`),
    /// applies the environment overrides in `env` and validates the result.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let env: Vec<(String, String)> = env.into_iter().collect();
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => env
                .iter()
                .find(|(k, _)| k == CONFIG_ENV)
                .map(|(_, v)| PathBuf::from(v))
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH)),
        };
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        Self::from_toml_str(&text, &path, env)
    }

    pub fn from_toml_str(
        text: &str,
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut table: toml::Table =
            text.parse()
                .map_err(|e: toml::de::Error| ConfigError::Syntax {
                    path: path.to_path_buf(),
                    message: e.message().to_string(),
                })?;
        for (var, value) in env {
            if let Some(rest) = var.strip_prefix(OVERRIDE_PREFIX) {
                apply_override(&mut table, &var, rest, &value)?;
            }
        }
        let config: Config = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| invalid(e.path().to_string(), e.inner().message().to_string()))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.store_location()?;
        if let Some(alerts) = &self.alerts {
            alerts.validate()?;
        }
        if self.server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be greater than 0"));
        }
        for (key, value) in [
            (
                "server.request_timeout_secs",
                self.server.request_timeout_secs,
            ),
            (
                "server.header_timeout_secs",
                self.server.header_timeout_secs,
            ),
            ("server.max_connections", self.server.max_connections as u64),
            (
                "server.max_streams_per_connection",
                u64::from(self.server.max_streams_per_connection),
            ),
            ("store.timeout_ms", self.store.timeout_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if self.server.max_buffered_bytes < self.server.max_body_bytes {
            return Err(invalid(
                "server.max_buffered_bytes",
                format!(
                    "must be at least server.max_body_bytes ({}), or a body of the largest \
                     allowed size could never be read",
                    self.server.max_body_bytes
                ),
            ));
        }
        if u32::try_from(self.server.max_buffered_bytes).is_err() {
            return Err(invalid(
                "server.max_buffered_bytes",
                format!("must be at most {} (4 GiB - 1)", u32::MAX),
            ));
        }
        if self.store.dedupe_ttl_secs == 0 {
            return Err(invalid("store.dedupe_ttl_secs", "must be greater than 0"));
        }
        if self.store.payment_retention_secs < self.store.dedupe_ttl_secs {
            return Err(invalid(
                "store.payment_retention_secs",
                format!(
                    "must be at least store.dedupe_ttl_secs ({} s): a payment's state must \
                     outlive the dedupe claims of its notifications",
                    self.store.dedupe_ttl_secs
                ),
            ));
        }
        if !(1..=MAX_SWEEP_INTERVAL_SECS).contains(&self.store.sweep_interval_secs) {
            return Err(invalid(
                "store.sweep_interval_secs",
                format!("must be 1 to {MAX_SWEEP_INTERVAL_SECS} seconds"),
            ));
        }
        let d = &self.dispatch;
        for (key, value) in [
            ("dispatch.max_age_secs", d.max_age_secs),
            ("dispatch.initial_backoff_ms", d.initial_backoff_ms),
            ("dispatch.max_backoff_secs", d.max_backoff_secs),
            ("dispatch.request_timeout_ms", d.request_timeout_ms),
            ("dispatch.concurrency", d.concurrency as u64),
            (
                "dispatch.per_host_concurrency",
                d.per_host_concurrency as u64,
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        if d.lease_secs * 1000 < d.request_timeout_ms + LEASE_MARGIN_MS {
            return Err(invalid(
                "dispatch.lease_secs",
                format!(
                    "must be at least request_timeout_ms + {LEASE_MARGIN_MS} ms ({} ms), so a slow \
                     but live delivery is never handed to a second worker",
                    d.request_timeout_ms + LEASE_MARGIN_MS
                ),
            ));
        }
        let exposure = self.exposure();
        for (list, tokens) in [
            ("auth.connector_tokens", &self.auth.connector_tokens),
            ("auth.admin_tokens", &self.auth.admin_tokens),
        ] {
            for (i, token) in tokens.iter().enumerate() {
                let key = format!("{list}[{i}]");
                if token.len() < 8 {
                    return Err(invalid(key, "tokens must be at least 8 characters"));
                }
                exposure.check(&key, token, token.len())?;
            }
        }
        for (name, source) in &self.sources {
            source.validate(name, exposure)?;
        }
        Ok(())
    }

    /// Whether tokens and secrets must be unguessable: the server is reachable beyond this
    /// machine.
    fn exposure(&self) -> Exposure {
        if self.server.listen.ip().is_loopback() {
            Exposure::Loopback
        } else {
            Exposure::Network(self.server.listen)
        }
    }

    pub fn store_location(&self) -> Result<StoreLocation, ConfigError> {
        parse_store_url(&self.store.url)
    }
}

fn parse_store_url(url: &str) -> Result<StoreLocation, ConfigError> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        if path.is_empty() {
            return Err(invalid("store.url", "sqlite:// needs a file path"));
        }
        Ok(StoreLocation::Sqlite(PathBuf::from(path)))
    } else if url.starts_with("redis://") || url.starts_with("rediss://") {
        Ok(StoreLocation::Redis(url.to_string()))
    } else {
        Err(invalid(
            "store.url",
            format!("`{url}` is neither sqlite://PATH nor redis://HOST:PORT/DB"),
        ))
    }
}

impl SourceConfig {
    fn validate(&self, name: &str, exposure: Exposure) -> Result<(), ConfigError> {
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
            if !self.allow_private_forward_url
                && literal.is_some_and(crate::dispatch::ssrf::is_forbidden)
            {
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
}

/// Decodes a Standard Webhooks secret (`whsec_` + base64). The prefix is optional, as in the
/// reference libraries. An empty key is refused: anyone could sign with it.
pub fn decode_whsec(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("not a whsec_<base64> secret: {e}"))?;
    if key.is_empty() {
        return Err("is an empty key: anyone could sign".into());
    }
    Ok(key)
}

/// Sets `section.key[.key...]` in the parsed file from a `CALLBACKD__SECTION__KEY` variable.
/// The value is read as a TOML value when it parses as one (`64`, `true`, `["a","b"]`), and as
/// a plain string otherwise, so `CALLBACKD__STORE__URL=redis://...` needs no quoting.
fn apply_override(
    table: &mut toml::Table,
    var: &str,
    path: &str,
    raw: &str,
) -> Result<(), ConfigError> {
    let segments: Vec<String> = path.split("__").map(|s| s.to_ascii_lowercase()).collect();
    if segments.iter().any(|s| s.is_empty()) {
        return Err(ConfigError::Override {
            var: var.to_string(),
            message: "empty key segment".into(),
        });
    }
    let value = format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()));
    let (last, parents) = segments.split_last().expect("split yields one segment");
    let mut node = table;
    for segment in parents {
        let entry = node
            .entry(segment.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = entry.as_table_mut().ok_or_else(|| ConfigError::Override {
            var: var.to_string(),
            message: format!("`{segment}` is not a table"),
        })?;
    }
    node.insert(last.clone(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_toml_str(
            text,
            Path::new("test.toml"),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn defaults_match_the_design() {
        let c = load("", &[]).unwrap();
        assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.server.max_body_bytes, 1_048_576);
        assert_eq!(c.server.max_streams_per_connection, 32);
        assert_eq!(c.server.max_buffered_bytes, 64 * 1_048_576);
        assert_eq!(c.store.dedupe_ttl_secs, 2_592_000);
        assert_eq!(c.store.payment_retention_secs, 400 * 86_400);
        assert_eq!(c.store.sweep_interval_secs, 30);
        assert_eq!(c.dispatch.max_age_secs, 604_800);
        assert_eq!(c.dispatch.initial_backoff_ms, 1000);
        assert_eq!(c.dispatch.max_backoff_secs, 3600);
        assert_eq!(c.dispatch.request_timeout_ms, 10_000);
        assert_eq!(c.dispatch.concurrency, 64);
        assert!(!c.dispatch.allow_private_networks);
        assert!(matches!(
            c.store_location().unwrap(),
            StoreLocation::Sqlite(_)
        ));
    }

    #[test]
    fn env_overrides_win_and_parse_types() {
        let c = load(
            "[server]\nlisten = \"127.0.0.1:1\"\n",
            &[
                ("CALLBACKD__SERVER__LISTEN", "127.0.0.1:9000"),
                ("CALLBACKD__STORE__URL", "redis://127.0.0.1:6379/0"),
                ("CALLBACKD__DISPATCH__CONCURRENCY", "8"),
                ("CALLBACKD__SOURCES__P__SIGNATURE", "none"),
                ("OTHER", "x"),
            ],
        )
        .unwrap();
        assert_eq!(c.server.listen.port(), 9000);
        assert_eq!(
            c.store_location().unwrap(),
            StoreLocation::Redis("redis://127.0.0.1:6379/0".into())
        );
        assert_eq!(c.dispatch.concurrency, 8);
        assert_eq!(c.sources["p"].signature, SignatureScheme::None);
    }

    #[test]
    fn errors_name_the_key() {
        let cases = [
            ("[server]\nlisten = \"nope\"\n", "server.listen"),
            ("[store]\nurl = \"mysql://x\"\n", "store.url"),
            ("[dispatch]\nconcurency = 3\n", "dispatch"),
            ("[dispatch]\nconcurrency = 0\n", "dispatch.concurrency"),
            (
                "[store]\ndedupe_ttl_secs = 100\npayment_retention_secs = 99\n",
                "store.payment_retention_secs",
            ),
            (
                "[store]\nsweep_interval_secs = 61\n",
                "store.sweep_interval_secs",
            ),
            (
                "[store]\nsweep_interval_secs = 0\n",
                "store.sweep_interval_secs",
            ),
            (
                "[server]\nmax_streams_per_connection = 0\n",
                "server.max_streams_per_connection",
            ),
            (
                "[server]\nmax_buffered_bytes = 1000\n",
                "server.max_buffered_bytes",
            ),
            ("[dispatch]\nlease_secs = 10\n", "dispatch.lease_secs"),
            ("[sources.p]\nsignature = \"payzu\"\n", "sources.p.secrets"),
            (
                "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"whsec_!!\"]\n",
                "sources.p.secrets[0]",
            ),
            (
                "[sources.p]\nsignature = \"hmac-sha256\"\nsecrets = [\"s\"]\n",
                "sources.p.signature_header",
            ),
            (
                "[sources.p]\nsignature = \"none\"\ndedupe_fields = [\"status\"]\n",
                "sources.p.dedupe_fields[0]",
            ),
            (
                "[sources.p]\nsignature = \"rot13\"\n",
                "sources.p.signature",
            ),
            (
                "[sources.p]\nsignature = \"none\"\nforward_url = \"http://10.1.2.3/hook\"\n",
                "sources.p.allow_private_forward_url",
            ),
            (
                "[sources.p]\nsignature = \"none\"\nforward_url = \"http://[::1]:9/hook\"\n",
                "sources.p.forward_url",
            ),
        ];
        for (text, key) in cases {
            let err = load(text, &[]).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?}: `{err}` does not name {key}");
        }
    }

    #[test]
    fn empty_secrets_are_refused_for_every_scheme() {
        let cases = [
            (
                "[sources.p]\nsignature = \"payzu\"\nsecrets = [\"\"]\n",
                "sources.p.secrets[0]",
            ),
            (
                "[sources.p]\nsignature = \"hmac-sha256\"\nsignature_header = \"x-sig\"\n\
                 secrets = [\"long-enough-secret\", \"\"]\n",
                "sources.p.secrets[1]",
            ),
            (
                "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"whsec_\"]\n",
                "sources.p.secrets[0]",
            ),
            (
                "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"\"]\n",
                "sources.p.secrets[0]",
            ),
            (
                "[sources.p]\nsignature = \"none\"\nforward_secret = \"whsec_\"\n",
                "sources.p.forward_secret",
            ),
            (
                "[sources.p]\nsignature = \"none\"\nforward_secret = \"\"\n",
                "sources.p.forward_secret",
            ),
        ];
        for (text, key) in cases {
            // Refused on loopback too: an empty key lets anyone sign, wherever it listens.
            let err = load(text, &[]).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?}: `{err}` does not name {key}");
            assert!(err.contains("empty"), "{text:?}: `{err}` does not say why");
        }
    }

    /// Every token and secret key, each given a strong value except `weak_key`, which gets
    /// `weak`.
    fn config_with(weak_key: &str, weak: &str) -> String {
        let strong = "0123456789abcdef0123456789abcdef";
        // 32 random-looking bytes, base64.
        let strong_whsec = "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
        let pick = |key: &str, default: &str| {
            if key == weak_key {
                weak.to_string()
            } else {
                default.to_string()
            }
        };
        format!(
            "[auth]\nconnector_tokens = [\"{}\"]\nadmin_tokens = [\"{}\"]\n\
             [sources.p]\nsignature = \"payzu\"\nsecrets = [\"{}\"]\n\
             [sources.w]\nsignature = \"standard-webhooks\"\nsecrets = [\"{}\"]\n\
             forward_secret = \"{}\"\n",
            pick("auth.connector_tokens[0]", strong),
            pick("auth.admin_tokens[0]", strong),
            pick("sources.p.secrets[0]", strong),
            pick("sources.w.secrets[0]", strong_whsec),
            pick("sources.w.forward_secret", strong_whsec),
        )
    }

    #[test]
    fn placeholders_and_short_secrets_are_refused_off_loopback() {
        let public = [("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")];
        assert!(
            load(&config_with("", ""), &public).is_ok(),
            "strong values pass"
        );
        // 8 bytes, base64: long enough as text, too short as a key.
        let short_whsec = "whsec_MDEyMzQ1Njc=";
        let cases = [
            (
                "auth.connector_tokens[0]",
                "change-me-connector-token",
                "placeholder",
            ),
            (
                "auth.admin_tokens[0]",
                "change-me-admin-token",
                "placeholder",
            ),
            (
                "auth.admin_tokens[0]",
                "Change-Me-Please-0123456789",
                "placeholder",
            ),
            ("auth.admin_tokens[0]", "fifteen-bytes!!", "15 bytes"),
            (
                "sources.p.secrets[0]",
                "change-me-payzu-secret",
                "placeholder",
            ),
            ("sources.p.secrets[0]", "short-secret", "12 bytes"),
            ("sources.w.secrets[0]", short_whsec, "8 bytes"),
            ("sources.w.forward_secret", short_whsec, "8 bytes"),
        ];
        for (key, weak, why) in cases {
            let text = config_with(key, weak);
            for listen in ["0.0.0.0:8080", "192.0.2.10:8080", "[::]:8080"] {
                let err = load(&text, &[("CALLBACKD__SERVER__LISTEN", listen)])
                    .unwrap_err()
                    .to_string();
                assert!(err.contains(key), "{key} on {listen}: `{err}`");
                assert!(
                    err.contains(why),
                    "{key} on {listen}: `{err}` lacks `{why}`"
                );
                assert!(!err.contains(weak), "the value is never echoed: `{err}`");
            }
            for listen in ["127.0.0.1:8080", "[::1]:8080"] {
                assert!(
                    load(&text, &[("CALLBACKD__SERVER__LISTEN", listen)]).is_ok(),
                    "{key} = {weak:?} is fine on loopback {listen}"
                );
            }
        }
    }

    #[test]
    fn the_example_config_is_refused_off_loopback() {
        let example = include_str!("../config.toml");
        assert!(
            load(example, &[]).is_ok(),
            "it serves on 127.0.0.1 as shipped"
        );
        let err = load(example, &[("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("auth.connector_tokens[0]"), "{err}");
    }

    #[test]
    fn private_forward_urls_need_their_own_switch() {
        let internal =
            "[sources.p]\nsignature = \"none\"\nforward_url = \"http://10.1.2.3/hook\"\n";
        // The callbackUrl switch does not open forward_url.
        let with_dispatch_switch = format!("[dispatch]\nallow_private_networks = true\n{internal}");
        assert!(load(&with_dispatch_switch, &[]).is_err());
        let allowed = format!("{internal}allow_private_forward_url = true\n");
        let c = load(&allowed, &[]).unwrap();
        assert!(c.sources["p"].allow_private_forward_url);
        assert!(!c.dispatch.allow_private_networks);
        // A public address, or a name (checked at delivery, where DNS answers), is fine.
        for url in [
            "https://93.184.215.14/hook",
            "https://merchant.example.com/hook",
        ] {
            let text = format!("[sources.p]\nsignature = \"none\"\nforward_url = \"{url}\"\n");
            assert!(load(&text, &[]).is_ok(), "{url}");
        }
    }
}
