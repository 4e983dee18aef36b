//! Checks a parsed config before anything starts: every refusal names its key, and a token or
//! secret is never echoed. Which tokens are strong enough depends on who can reach
//! `server.listen` ([`Exposure`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use super::{
    ClientPem, Config, ConfigError, LEASE_MARGIN_MS, MAX_MIN_REPLICAS_ACKED,
    MAX_SWEEP_INTERVAL_SECS, StoreLocation, StoreTls, invalid,
};
use crate::dispatch::host_key;
use crate::store::partitions::Partitions;
use crate::store::redis::prefix::key_prefix_problem;

/// Shortest token or secret accepted on a non-loopback `server.listen`: 16 random bytes are
/// 128 bits, which nobody guesses.
const MIN_EXPOSED_SECRET_BYTES: usize = 16;
/// How the example config's placeholders start (`change-me-admin-token`).
const PLACEHOLDER_PREFIX: &str = "change-me";

/// Who can reach the server, which decides how strong its tokens and secrets must be.
#[derive(Debug, Clone, Copy)]
pub(super) enum Exposure {
    /// Only this machine: the example config's placeholders are fine for trying things out.
    Loopback,
    Network(SocketAddr),
}

impl Exposure {
    /// Refuses a placeholder or short token or secret when the server is reachable from the
    /// network, where anyone who read the README could use it. `len` is the key's length in
    /// bytes (decoded, for a `whsec_` secret). The value itself is never echoed.
    pub(super) fn check(self, key: &str, raw: &str, len: usize) -> Result<(), ConfigError> {
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

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.store_location()?;
        self.validate_key_prefix()?;
        self.store_tls()?;
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
        self.validate_min_replicas_acked()?;
        self.partitions()?;
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
        self.validate_hosts()?;
        // Saturating, so an absurd value is refused (or accepted) rather than overflowing.
        let least_lease_ms = d.request_timeout_ms.saturating_add(LEASE_MARGIN_MS);
        if d.lease_secs.saturating_mul(1000) < least_lease_ms {
            return Err(invalid(
                "dispatch.lease_secs",
                format!(
                    "must be at least request_timeout_ms + {LEASE_MARGIN_MS} ms ({} ms), so a slow \
                     but live delivery is never handed to a second worker",
                    least_lease_ms
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

    /// `[dispatch.breaker]` and `[dispatch.hosts]`: each number in range, each host key a
    /// `host` or `host:port` named once.
    fn validate_hosts(&self) -> Result<(), ConfigError> {
        let b = &self.dispatch.breaker;
        if b.failures == 0 {
            return Err(invalid("dispatch.breaker.failures", "must be ≥ 1"));
        }
        if b.probe_secs == 0 {
            return Err(invalid("dispatch.breaker.probe_secs", "must be ≥ 1"));
        }
        if b.max_probe_secs < b.probe_secs {
            return Err(invalid(
                "dispatch.breaker.max_probe_secs",
                format!("must be ≥ dispatch.breaker.probe_secs ({})", b.probe_secs),
            ));
        }
        let mut seen = std::collections::BTreeMap::new();
        for (key, host) in &self.dispatch.hosts {
            let name = format!("dispatch.hosts.\"{key}\"");
            let parsed = host_key::parse(key).map_err(|problem| invalid(&name, problem))?;
            if let Some(other) = seen.insert(parsed, key) {
                return Err(invalid(
                    &name,
                    format!("names the same host as \"{other}\""),
                ));
            }
            if let Some(rate) = host.max_per_second
                && !(rate.is_finite() && rate > 0.0 && rate <= 1_000_000.0)
            {
                return Err(invalid(
                    format!("{name}.max_per_second"),
                    "must be > 0 and at most 1000000",
                ));
            }
            if host.concurrency == Some(0) {
                return Err(invalid(format!("{name}.concurrency"), "must be ≥ 1"));
            }
        }
        Ok(())
    }

    /// Replicas are waited for only behind Redis: on SQLite the setting would promise what
    /// nothing does, and PostgreSQL has its own (`synchronous_standby_names`), so it is refused
    /// rather than ignored.
    fn validate_min_replicas_acked(&self) -> Result<(), ConfigError> {
        let n = self.store.min_replicas_acked;
        if n > MAX_MIN_REPLICAS_ACKED {
            return Err(invalid(
                "store.min_replicas_acked",
                format!("must be at most {MAX_MIN_REPLICAS_ACKED} (got {n})"),
            ));
        }
        match self.store_location()? {
            StoreLocation::Sqlite(_) if n > 0 => Err(invalid(
                "store.min_replicas_acked",
                "needs a redis:// store.url (SQLite has no replicas); set it to 0",
            )),
            StoreLocation::Postgres(_) if n > 0 => Err(invalid(
                "store.min_replicas_acked",
                "needs a redis:// store.url (PostgreSQL's commits wait for the standbys its \
                 synchronous_standby_names names); set it to 0",
            )),
            _ => Ok(()),
        }
    }

    /// `store.partitions` when set, checked: every partition is numbered by one byte.
    pub fn partitions(&self) -> Result<Option<Partitions>, ConfigError> {
        self.store
            .partitions
            .map(|n| {
                Partitions::new(n).ok_or_else(|| {
                    invalid(
                        "store.partitions",
                        format!("must be 1 to {} (got {n})", Partitions::MAX),
                    )
                })
            })
            .transpose()
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

    /// `store.key_prefix`, checked by the Redis engine's rule for it.
    fn validate_key_prefix(&self) -> Result<(), ConfigError> {
        let prefix = &self.store.key_prefix;
        match key_prefix_problem(prefix) {
            Some(problem) => Err(invalid("store.key_prefix", format!("`{prefix}` {problem}"))),
            None => Ok(()),
        }
    }

    /// `store.tls_*`, with the PEM files read and parsed, so a missing or unreadable file stops
    /// the start naming its key and path. They apply to a TLS Redis, which needs the CA with a
    /// client certificate, or to PostgreSQL, which without a CA trusts the system's roots.
    pub fn store_tls(&self) -> Result<StoreTls, ConfigError> {
        let store = &self.store;
        let tls_keys = [
            ("store.tls_ca_file", &store.tls_ca_file),
            ("store.tls_cert_file", &store.tls_cert_file),
            ("store.tls_key_file", &store.tls_key_file),
        ];
        let postgres = is_postgres_url(&store.url);
        if let Some((key, _)) = tls_keys.iter().find(|(_, file)| file.is_some())
            && !store.url.starts_with("rediss://")
            && !postgres
        {
            return Err(invalid(
                *key,
                "applies only to a TLS Redis or to PostgreSQL: store.url must start with \
                 rediss:// or postgres://",
            ));
        }
        let client = self.client_identity()?;
        let ca_pem = self.ca_pem()?;
        if !postgres && ca_pem.is_none() && client.is_some() {
            return Err(invalid(
                "store.tls_ca_file",
                "is required with store.tls_cert_file and store.tls_key_file",
            ));
        }
        Ok(StoreTls { ca_pem, client })
    }

    /// `store.tls_cert_file` and `store.tls_key_file`, both or neither, read and parsed.
    fn client_identity(&self) -> Result<Option<ClientPem>, ConfigError> {
        let store = &self.store;
        match (&store.tls_cert_file, &store.tls_key_file) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => {
                let cert_pem = read_pem("store.tls_cert_file", cert)?;
                if CertificateDer::pem_slice_iter(&cert_pem).next().is_none() {
                    return Err(pem_error(
                        "store.tls_cert_file",
                        cert,
                        "holds no certificate",
                    ));
                }
                let key_pem = read_pem("store.tls_key_file", key)?;
                PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| pem_error("store.tls_key_file", key, e))?;
                Ok(Some(ClientPem { cert_pem, key_pem }))
            }
            (Some(_), None) => Err(invalid(
                "store.tls_key_file",
                "is required with store.tls_cert_file",
            )),
            (None, Some(_)) => Err(invalid(
                "store.tls_cert_file",
                "is required with store.tls_key_file",
            )),
        }
    }

    /// `store.tls_ca_file`, read, holding at least one certificate and only good ones.
    fn ca_pem(&self) -> Result<Option<Vec<u8>>, ConfigError> {
        let Some(ca) = &self.store.tls_ca_file else {
            return Ok(None);
        };
        let ca_pem = read_pem("store.tls_ca_file", ca)?;
        let mut certs = CertificateDer::pem_slice_iter(&ca_pem).peekable();
        if certs.peek().is_none() {
            return Err(pem_error("store.tls_ca_file", ca, "holds no certificate"));
        }
        for cert in certs {
            cert.map_err(|e| pem_error("store.tls_ca_file", ca, e))?;
        }
        Ok(Some(ca_pem))
    }
}

fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn read_pem(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| pem_error(key, path, e))
}

fn pem_error(key: &str, path: &Path, why: impl std::fmt::Display) -> ConfigError {
    invalid(
        key,
        format!("cannot read PEM from {}: {why}", path.display()),
    )
}

fn parse_store_url(url: &str) -> Result<StoreLocation, ConfigError> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        if path.is_empty() {
            return Err(invalid("store.url", "sqlite:// needs a file path"));
        }
        Ok(StoreLocation::Sqlite(PathBuf::from(path)))
    } else if url.starts_with("redis://") || url.starts_with("rediss://") {
        Ok(StoreLocation::Redis(url.to_string()))
    } else if is_postgres_url(url) {
        crate::store::postgres::url::check_url(url).map_err(|why| invalid("store.url", why))?;
        Ok(StoreLocation::Postgres(url.to_string()))
    } else {
        Err(invalid(
            "store.url",
            format!(
                "`{}` is neither sqlite://PATH nor redis://HOST:PORT/DB nor \
                 postgres://USER:PASSWORD@HOST:PORT/DB",
                crate::redact::url_credentials(url)
            ),
        ))
    }
}
