//! Typed settings per component, derived once from a validated [`Config`] when the app is
//! built. Durations are `Duration`s, secrets are decoded, and each source's verifier, forward
//! target and SSRF policy exist once, shared by the handlers and the dispatcher.
//!
//! [`Config`] stays the file's shape (its key names are the operator's interface); this is the
//! shape the code wants. A unit conversion happens here or at a seam that counts in another
//! unit (the store's seconds and milliseconds), never at each use.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::{AlertsConfig, AuthConfig, Config, ConfigError, StoreLocation, invalid};
use crate::clock::{Millis, deadline, millis};
use crate::inbound::dedupe::DEFAULT_FIELDS;
use crate::ssrf::SsrfGuard;
use crate::store::Partitions;
use crate::store::lifecycle::policy::Backoff;
use crate::store::postgres::PostgresOptions;
use crate::store::redis::RedisOptions;
use crate::webhook::{Verifier, decode_whsec};

/// Every component's settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub server: ServerSettings,
    pub store: StoreSettings,
    pub dispatch: DispatchSettings,
    /// `[auth]`: lists of tokens, already the shape the code wants.
    pub auth: AuthConfig,
    /// The configured sources by name, shared by the handlers and the dispatcher.
    pub sources: Sources,
    /// Where dead letters are announced (`[alerts]`), if anywhere.
    pub alerts: Option<AlertSettings>,
}

pub type Sources = Arc<HashMap<String, SourceSettings>>;

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub listen: SocketAddr,
    pub max_body_bytes: usize,
    /// Request body bytes held in memory at once, all connections together.
    pub max_buffered_bytes: usize,
    /// How long shutdown waits for in-flight deliveries, then for open requests.
    pub shutdown_grace: Duration,
    /// Whole-request deadline once headers are in.
    pub request_timeout: Duration,
    /// A client must send its request headers within this time.
    pub header_timeout: Duration,
    pub max_connections: usize,
    pub max_streams_per_connection: u32,
}

/// `[store]`.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    pub location: StoreLocation,
    /// How long a dedupe claim, a seal and a finished message are kept.
    pub dedupe_ttl: Duration,
    /// How long a payment's status outlives its last transition.
    pub payment_retention: Duration,
    pub sweep_interval: Duration,
    /// Timeout of every store round trip.
    pub timeout: Duration,
    pub require_durable: bool,
    /// Key prefix and TLS certificates, used when `location` is Redis.
    pub redis: RedisOptions,
    /// TLS certificates, used when `location` is PostgreSQL.
    pub postgres: PostgresOptions,
    /// Redis replicas that must acknowledge every write; 0 waits for none.
    pub min_replicas_acked: u32,
    /// `store.partitions` when set; `None` keeps the store's own count (the default for a new
    /// store).
    pub partitions: Option<Partitions>,
    /// How long the store may go unanswered before `/healthz` fails; `None`: never.
    pub healthz_fails_after: Option<Duration>,
}

/// `[alerts]`, checked: the secret decoded, the console link resolved (by default the
/// server's `listen` address).
#[derive(Clone)]
pub struct AlertSettings {
    pub webhook_url: String,
    pub secret: Vec<u8>,
    pub console_base: String,
    /// `alerts.allow_private_webhook_url`.
    pub allow_private: bool,
    pub digest_interval: Duration,
    pub max_per_interval: u32,
}

impl AlertSettings {
    fn new(config: &AlertsConfig, listen: SocketAddr) -> Result<AlertSettings, ConfigError> {
        Ok(AlertSettings {
            webhook_url: config.webhook_url.clone(),
            secret: decode_whsec(&config.secret).map_err(|m| invalid("alerts.secret", m))?,
            console_base: config
                .console_url
                .clone()
                .unwrap_or_else(|| format!("http://{listen}"))
                .trim_end_matches('/')
                .to_string(),
            allow_private: config.allow_private_webhook_url,
            digest_interval: Duration::from_secs(config.digest_interval_secs),
            max_per_interval: config.max_alerts_per_interval,
        })
    }
}

impl std::fmt::Debug for AlertSettings {
    /// The signing key never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlertSettings")
            .field("webhook_url", &self.webhook_url)
            .field("console_base", &self.console_base)
            .finish_non_exhaustive()
    }
}

/// `[dispatch]`.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// False in an ingest-only process.
    pub enabled: bool,
    /// How long a message is delivered for before it is dead.
    pub max_age: Duration,
    pub backoff: Backoff,
    pub request_timeout: Duration,
    /// How long a claimed message stays leased.
    pub lease: Duration,
    pub concurrency: usize,
    pub per_host_concurrency: usize,
    /// Which addresses connectors' `callbackUrl`s may reach (`allow_private_networks`).
    pub callback_ssrf: SsrfGuard,
}

impl DispatchSettings {
    /// When a message accepted at `now` stops being delivered.
    pub fn deadline(&self, now: Millis) -> Millis {
        deadline(now, self.max_age)
    }
}

/// A configured provider account (`[sources.<name>]`), ready to verify and key its callbacks
/// and to deliver them on.
#[derive(Debug, Clone)]
pub struct SourceSettings {
    pub name: String,
    pub verifier: Verifier,
    pub dedupe_fields: Vec<String>,
    /// Where its callbacks are handed on; none keeps them for the API only.
    pub forward_url: Option<String>,
    pub forward: ForwardSettings,
}

/// How a message goes out. Read at delivery time, not stored with the message, so a rotated
/// token or secret applies to messages already queued.
#[derive(Clone, Default)]
pub struct ForwardSettings {
    /// Added to every delivery (`forward_headers`).
    pub headers: BTreeMap<String, String>,
    /// Standard Webhooks key the delivery is signed with (`forward_secret`).
    pub signing_secret: Option<Vec<u8>>,
    /// Which addresses the target may resolve to (`allow_private_forward_url`).
    pub ssrf: SsrfGuard,
}

impl std::fmt::Debug for ForwardSettings {
    /// Header values (an `Authorization`) and the key never reach a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForwardSettings")
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("signed", &self.signing_secret.is_some())
            .field("ssrf", &self.ssrf)
            .finish()
    }
}

impl Settings {
    /// Derives the settings of a config that passed validation ([`Config::load`] validates).
    /// It fails, naming the key, only for a config changed after it was validated.
    pub fn from_config(config: &Config) -> Result<Settings, ConfigError> {
        let (server, store, dispatch) = (&config.server, &config.store, &config.dispatch);
        let server = ServerSettings {
            listen: server.listen,
            max_body_bytes: server.max_body_bytes,
            max_buffered_bytes: server.max_buffered_bytes,
            shutdown_grace: Duration::from_secs(server.shutdown_grace_secs),
            request_timeout: Duration::from_secs(server.request_timeout_secs),
            header_timeout: Duration::from_secs(server.header_timeout_secs),
            max_connections: server.max_connections,
            max_streams_per_connection: server.max_streams_per_connection,
        };
        let store = StoreSettings {
            location: config.store_location()?,
            dedupe_ttl: Duration::from_secs(store.dedupe_ttl_secs),
            payment_retention: Duration::from_secs(store.payment_retention_secs),
            sweep_interval: Duration::from_secs(store.sweep_interval_secs),
            timeout: Duration::from_millis(store.timeout_ms),
            require_durable: store.require_durable,
            redis: config.redis_options()?,
            postgres: config.postgres_options()?,
            min_replicas_acked: store.min_replicas_acked,
            partitions: config.partitions()?,
            healthz_fails_after: (store.healthz_fails_after_secs > 0)
                .then(|| Duration::from_secs(store.healthz_fails_after_secs)),
        };
        let dispatch = DispatchSettings {
            enabled: dispatch.enabled,
            max_age: Duration::from_secs(dispatch.max_age_secs),
            backoff: Backoff {
                initial_ms: dispatch.initial_backoff_ms,
                max_ms: millis(Duration::from_secs(dispatch.max_backoff_secs)),
            },
            request_timeout: Duration::from_millis(dispatch.request_timeout_ms),
            lease: Duration::from_secs(dispatch.lease_secs),
            concurrency: dispatch.concurrency,
            per_host_concurrency: dispatch.per_host_concurrency,
            callback_ssrf: SsrfGuard {
                allow_private: dispatch.allow_private_networks,
            },
        };
        let sources = config
            .sources
            .iter()
            .map(|(name, source)| Ok((name.clone(), SourceSettings::new(name, source)?)))
            .collect::<Result<HashMap<_, _>, ConfigError>>()?;
        let alerts = config
            .alerts
            .as_ref()
            .map(|a| AlertSettings::new(a, server.listen))
            .transpose()?;
        Ok(Settings {
            server,
            store,
            dispatch,
            auth: config.auth.clone(),
            sources: Arc::new(sources),
            alerts,
        })
    }
}

impl SourceSettings {
    fn new(name: &str, config: &super::SourceConfig) -> Result<SourceSettings, ConfigError> {
        let verifier =
            Verifier::from_config(config).map_err(|m| invalid(format!("sources.{name}"), m))?;
        let signing_secret = config
            .forward_secret
            .as_deref()
            .map(decode_whsec)
            .transpose()
            .map_err(|m| invalid(format!("sources.{name}.forward_secret"), m))?;
        Ok(SourceSettings {
            name: name.to_string(),
            verifier,
            dedupe_fields: config
                .dedupe_fields
                .clone()
                .unwrap_or_else(|| DEFAULT_FIELDS.iter().map(|f| f.to_string()).collect()),
            forward_url: config.forward_url.clone(),
            forward: ForwardSettings {
                headers: config.forward_headers.clone(),
                signing_secret,
                ssrf: SsrfGuard {
                    allow_private: config.allow_private_forward_url,
                },
            },
        })
    }
}
