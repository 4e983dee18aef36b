//! Typed settings per component, derived once from a validated [`Config`] when the app is
//! built. Durations are `Duration`s, secrets are decoded, and each source's verifier, forward
//! target and SSRF policy exist once, shared by the handlers and the dispatcher.
//!
//! [`Config`] stays the file's shape (its key names are the operator's interface) and plain
//! data; this is the shape the code wants, with the runtime objects built from it here, so the
//! config imports none of the modules that define them. A unit conversion happens here or at a seam that counts in another
//! unit (the store's seconds and milliseconds), never at each use.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Millis, deadline, millis};
use crate::config::{
    AlertsConfig, AuthConfig, Config, ConfigError, SourceConfig, StoreLocation, StoreTls, invalid,
};
use crate::inbound::dedupe::DEFAULT_FIELDS;
use crate::ssrf::SsrfGuard;
use crate::store::Partitions;
use crate::store::lifecycle::policy::Backoff;
use crate::store::postgres::{ClientCertificate, PostgresOptions, PostgresTls};
use crate::store::redis::{ClientIdentity, RedisOptions, RedisTls};
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
    /// `[dispatch.breaker]`.
    pub breaker: BreakerSettings,
    /// `[dispatch.hosts]`, by lookup key (`host:port`, or a bare host for all its ports).
    pub hosts: HashMap<String, HostLimits>,
}

/// `[dispatch.breaker]`.
#[derive(Debug, Clone, Copy)]
pub struct BreakerSettings {
    pub failures: u32,
    pub probe: Duration,
    pub max_probe: Duration,
}

/// One host's own limits (`dispatch.hosts."<host[:port]>"`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostLimits {
    pub max_per_second: Option<f64>,
    pub concurrency: Option<usize>,
}

impl DispatchSettings {
    /// The limits configured for the host of lookup key `host:port`: its own, else its bare
    /// host's, else none.
    pub fn host_limits(&self, key: &str) -> HostLimits {
        self.hosts
            .get(key)
            .or_else(|| self.hosts.get(crate::dispatch::host_key::bare(key)))
            .copied()
            .unwrap_or_default()
    }

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
    /// The provider's own API (`provider_api_url`, `provider_api_token`), which a recovery
    /// asks to resend callbacks; `None` when not configured.
    pub provider_api: Option<ProviderApi>,
}

/// Where a recovery reaches a source's provider, and with which token (its `Debug` hides it).
#[derive(Debug, Clone)]
pub struct ProviderApi {
    /// Base URL, without a trailing `/`.
    pub url: String,
    pub token: crate::redact::Secret,
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
        let location = config.store_location()?;
        let (redis, postgres) = engine_options(&location, &store.key_prefix, config.store_tls()?);
        let store = StoreSettings {
            location,
            dedupe_ttl: Duration::from_secs(store.dedupe_ttl_secs),
            payment_retention: Duration::from_secs(store.payment_retention_secs),
            sweep_interval: Duration::from_secs(store.sweep_interval_secs),
            timeout: Duration::from_millis(store.timeout_ms),
            require_durable: store.require_durable,
            redis,
            postgres,
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
            breaker: BreakerSettings {
                failures: dispatch.breaker.failures,
                probe: Duration::from_secs(dispatch.breaker.probe_secs),
                max_probe: Duration::from_secs(dispatch.breaker.max_probe_secs),
            },
            hosts: dispatch
                .hosts
                .iter()
                .map(|(key, host)| {
                    let parsed = crate::dispatch::host_key::parse(key)
                        .map_err(|problem| invalid(format!("dispatch.hosts.\"{key}\""), problem))?;
                    let limits = HostLimits {
                        max_per_second: host.max_per_second,
                        concurrency: host.concurrency,
                    };
                    Ok((parsed, limits))
                })
                .collect::<Result<HashMap<_, _>, ConfigError>>()?,
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

/// The engines' options: the key prefix is Redis', the certificates go to the engine `location`
/// names.
fn engine_options(
    location: &StoreLocation,
    key_prefix: &str,
    tls: StoreTls,
) -> (RedisOptions, PostgresOptions) {
    // The partition count is the store's setting, not only one engine's: `StoreSettings` has it.
    let mut redis = RedisOptions {
        key_prefix: key_prefix.to_string(),
        tls: None,
        partitions: None,
    };
    let StoreTls { ca_pem, client } = tls;
    if let StoreLocation::Postgres(_) = location {
        let client = client.map(|c| ClientCertificate {
            cert_pem: c.cert_pem,
            key_pem: c.key_pem,
        });
        let postgres = PostgresOptions {
            tls: PostgresTls { ca_pem, client },
            ..PostgresOptions::default()
        };
        return (redis, postgres);
    }
    redis.tls = ca_pem.map(|ca_pem| RedisTls {
        ca_pem,
        client: client.map(|c| ClientIdentity {
            cert_pem: c.cert_pem,
            key_pem: c.key_pem,
        }),
    });
    (redis, PostgresOptions::default())
}

impl SourceSettings {
    fn new(name: &str, config: &SourceConfig) -> Result<SourceSettings, ConfigError> {
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
            provider_api: match (&config.provider_api_url, &config.provider_api_token) {
                (Some(url), Some(token)) => Some(ProviderApi {
                    url: url.trim_end_matches('/').to_string(),
                    token: token.clone(),
                }),
                _ => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_toml_str(
            text,
            Path::new("test.toml"),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn partitions_are_the_stores_unless_set() {
        let unset = load("", &[]).unwrap();
        assert_eq!(unset.store.partitions, None);
        assert_eq!(
            Settings::from_config(&unset).unwrap().store.partitions,
            None
        );
        let set = load("[store]\npartitions = 128\n", &[]).unwrap();
        assert_eq!(
            Settings::from_config(&set).unwrap().store.partitions,
            Partitions::new(128)
        );
        let env = load("", &[("CALLBACKD__STORE__PARTITIONS", "256")]).unwrap();
        assert_eq!(env.store.partitions, Some(256));
        let err = load("[store]\npartitions = 300\n", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("must be 1 to 256 (got 300)"), "{err}");
    }

    #[test]
    fn the_key_prefix_reaches_the_redis_options() {
        let redis = |text: &str| {
            Settings::from_config(&load(text, &[]).unwrap())
                .unwrap()
                .store
                .redis
        };
        assert_eq!(redis("").key_prefix, "cb");
        assert_eq!(
            redis("[store]\nkey_prefix = \"tenant-b.eu_1\"\n").key_prefix,
            "tenant-b.eu_1"
        );
    }

    #[test]
    fn min_replicas_acked_reaches_the_store_settings() {
        let text = "[store]\nurl = \"redis://127.0.0.1:6379/0\"\nmin_replicas_acked = 16\n";
        let c = load(text, &[]).unwrap();
        assert_eq!(
            Settings::from_config(&c).unwrap().store.min_replicas_acked,
            16
        );
        let c = load(
            "[store]\nurl = \"redis://127.0.0.1:6379/0\"\n",
            &[("CALLBACKD__STORE__MIN_REPLICAS_ACKED", "2")],
        )
        .unwrap();
        assert_eq!(c.store.min_replicas_acked, 2);
    }

    #[test]
    fn settings_are_typed_and_derived_once() {
        let c = load(
            "[server]\nshutdown_grace_secs = 7\nrequest_timeout_secs = 9\n\
         [store]\ntimeout_ms = 250\ndedupe_ttl_secs = 60\npayment_retention_secs = 120\n\
         [dispatch]\nmax_age_secs = 3\ninitial_backoff_ms = 200\nmax_backoff_secs = 2\n\
         request_timeout_ms = 1500\nlease_secs = 7\nallow_private_networks = true\n\
         [sources.p]\nsignature = \"none\"\nforward_url = \"http://10.1.2.3/hook\"\n\
         allow_private_forward_url = true\nforward_headers = { Authorization = \"Bearer x\" }\n\
         forward_secret = \"whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=\"\n\
         [sources.q]\nsignature = \"none\"\ndedupe_fields = [\"/id\"]\n",
            &[],
        )
        .unwrap();
        let s = Settings::from_config(&c).unwrap();
        assert_eq!(s.server.shutdown_grace, Duration::from_secs(7));
        assert_eq!(s.server.request_timeout, Duration::from_secs(9));
        assert_eq!(s.server.header_timeout, Duration::from_secs(10));
        assert_eq!(s.store.timeout, Duration::from_millis(250));
        assert_eq!(s.store.dedupe_ttl, Duration::from_secs(60));
        assert_eq!(s.store.payment_retention, Duration::from_secs(120));
        assert_eq!(s.store.sweep_interval, Duration::from_secs(30));
        assert!(matches!(s.store.location, StoreLocation::Sqlite(_)));
        let d = &s.dispatch;
        assert_eq!(d.max_age, Duration::from_secs(3));
        assert_eq!((d.backoff.initial_ms, d.backoff.max_ms), (200, 2_000));
        assert_eq!(d.request_timeout, Duration::from_millis(1500));
        assert_eq!(millis(d.lease), 7_000);
        assert_eq!(d.deadline(1_000), 4_000);
        assert!(d.callback_ssrf.allow_private);
        let p = &s.sources["p"];
        assert_eq!(p.forward_url.as_deref(), Some("http://10.1.2.3/hook"));
        assert!(p.forward.ssrf.allow_private);
        assert_eq!(p.forward.headers["Authorization"], "Bearer x");
        assert_eq!(
            p.forward.signing_secret.as_deref(),
            Some(b"0123456789abcdef0123456789abcdef".as_slice())
        );
        assert_eq!(p.dedupe_fields.len(), DEFAULT_FIELDS.len());
        let q = &s.sources["q"];
        assert_eq!(q.dedupe_fields, ["/id"]);
        assert!(!q.forward.ssrf.allow_private && q.forward.signing_secret.is_none());
        assert!(s.alerts.is_none());
        let debug = format!("{p:?}");
        assert!(!debug.contains("Bearer x"), "{debug}");
    }

    #[test]
    fn deadlines_saturate() {
        assert_eq!(deadline(5, Duration::from_secs(u64::MAX)), Millis::MAX);
        assert_eq!(millis(Duration::from_secs(u64::MAX)), u64::MAX);
    }
}
