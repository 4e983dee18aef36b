//! Configuration: `config.toml`, then `CALLBACKD__SECTION__KEY` environment overrides, then
//! validation. Every error names the key it is about, because an operator reading a failed
//! start-up log should not have to guess which of forty settings is wrong.
//!
//! - this file: the file's shape ([`Config`], one struct per section) and its defaults;
//! - `load.rs`: the file and the environment, layered;
//! - `validate.rs`: the checks, and how strong a token must be on a public `server.listen`;
//! - `sources.rs`: `[sources.<name>]` and the signature schemes.
//!
//! Config holds plain data and builds no runtime object: the typed settings and what they build
//! (verifiers, SSRF guards, the backoff, the store engines' options) are derived in
//! `app::settings`. It calls below itself only for pure rules its checks share with the code
//! that applies them (`decode_whsec`, `is_forbidden`, the store's URL, key prefix and partition
//! count checks).

mod alerts;
mod load;
mod sources;
mod validate;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

pub use alerts::AlertsConfig;
pub use sources::{SignatureScheme, SourceConfig};

/// Environment variable naming the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "CALLBACKD_CONFIG";
/// Prefix of per-key overrides: `CALLBACKD__STORE__URL=redis://...`.
pub const OVERRIDE_PREFIX: &str = "CALLBACKD__";
pub const DEFAULT_CONFIG_PATH: &str = "config.toml";
/// Expired data is gone at most this long after it expires.
pub const MAX_SWEEP_INTERVAL_SECS: u64 = 60;
/// Most replicas `store.min_replicas_acked` may ask for: more than any sane deployment runs
/// behind one master, so a larger number is a typo.
pub const MAX_MIN_REPLICAS_ACKED: u32 = 16;

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

/// A refusal of `key`; also used by `app::settings` for what only deriving the settings finds.
pub(crate) fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
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
    pub alerts: Option<AlertsConfig>,
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
    /// Redis only: the start of every key name, so deployments sharing one Redis stay apart.
    pub key_prefix: String,
    /// A TLS Redis (`rediss://`) or PostgreSQL: PEM file of the CA that signed the server's
    /// certificate (PostgreSQL without it trusts the system's roots).
    pub tls_ca_file: Option<PathBuf>,
    /// A TLS Redis or PostgreSQL: PEM certificate chain for a server that authenticates
    /// clients.
    pub tls_cert_file: Option<PathBuf>,
    /// A TLS Redis or PostgreSQL: PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// Redis replicas that must acknowledge every write (`WAIT`) within `timeout_ms` before it
    /// counts; fewer is a 503. 0 waits for none.
    pub min_replicas_acked: u32,
    /// Queue partitions of a new store (1 to 256; unset: 64). Fixed when the store is first
    /// used and recorded in it; when set, a store recording another count refuses to start.
    pub partitions: Option<u16>,
    /// How long the store may go without answering before `/healthz` fails, so that an
    /// orchestrator restarts the process with every connection new; 0 never fails it.
    pub healthz_fails_after_secs: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            url: "sqlite://data/callbackd.db".into(),
            dedupe_ttl_secs: 2_592_000,
            payment_retention_secs: crate::store::retention::DEFAULT_PAYMENT_RETENTION_SECS,
            sweep_interval_secs: 30,
            require_durable: false,
            timeout_ms: 5_000,
            key_prefix: crate::store::redis::prefix::DEFAULT_KEY_PREFIX.into(),
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            min_replicas_acked: 0,
            healthz_fails_after_secs: 300,
            partitions: None,
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
    /// `[dispatch.breaker]`: when a failing host stops getting attempts.
    pub breaker: BreakerConfig,
    /// `[dispatch.hosts."<host[:port]>"]`: one gateway's own limits.
    pub hosts: BTreeMap<String, HostConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed attempts to a host (no answer, a 5xx) that open its breaker.
    pub failures: u32,
    /// How often an open host gets one probe.
    pub probe_secs: u64,
    /// The longest the probe interval grows to while probes fail.
    pub max_probe_secs: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures: 20,
            probe_secs: 5,
            max_probe_secs: 60,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Requests per second to this host, over the whole process.
    pub max_per_second: Option<f64>,
    /// Deliveries in flight to this host, instead of `dispatch.per_host_concurrency`.
    pub concurrency: Option<usize>,
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
            breaker: BreakerConfig::default(),
            hosts: BTreeMap::new(),
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

/// `store.tls_*`, read and checked: the PEM files' contents, which `app::settings` hands to the
/// engine `store.url` names.
#[derive(Clone, Default)]
pub struct StoreTls {
    /// The CA certificates the server's certificate must chain to.
    pub ca_pem: Option<Vec<u8>>,
    /// Certificate chain and private key presented to a server that authenticates clients.
    pub client: Option<ClientPem>,
}

/// `store.tls_cert_file` and `store.tls_key_file`, read and parsed.
#[derive(Clone)]
pub struct ClientPem {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Where the store lives, parsed from `store.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    Sqlite(PathBuf),
    Redis(String),
    /// `postgres://` or `postgresql://`, one host or several.
    Postgres(String),
}
