//! The pool of connections to PostgreSQL, and the one way the engine uses it: [`Database::call`],
//! bounded by the store timeout.
//!
//! Why it is built this way:
//!
//! - **The URL is the operator's, with libpq's vocabulary.** `store.url` is a
//!   `postgres://user:pass@host:port/db` URL, or one with several hosts
//!   (`postgres://u:p@a:5432,b:5432/db?target_session_attrs=read-write`): each new connection
//!   tries the hosts in order and keeps the one that takes writes, so after a failover the
//!   pool finds the promoted standby by itself. `sslmode` is libpq's; `verify-ca` and
//!   `verify-full` are accepted and mean what every TLS connection here is anyway: the
//!   server's certificate must chain to `store.tls_ca_file` (else the system's roots) and name
//!   the host.
//! - **Every call is bounded twice.** The client gives up after the store timeout, whatever
//!   the network does (a 503, never a hang), and drops the connection, which may be stuck; the
//!   server cancels any statement that runs longer (`statement_timeout`) and ends a session
//!   left idle inside a transaction, so a client that gave up holds no lock for long.
//!   TCP keepalives and `tcp_user_timeout` find a peer that vanished without a word.
//! - **A connection that failed is not reused.** Any failure drops it from the pool: the next
//!   call opens a new one, which is how a connection to a demoted or restarted primary is
//!   replaced by one to the host that now takes writes.
//! - **The password is never shown.** Messages and logs name the server by [`redacted_url`];
//!   the driver's own `Debug` of its config hides the password too.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Client, Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use futures_util::future::BoxFuture;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_postgres::config::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::error::{open_error, pool_error};
use super::listen::ListenConfig;
use super::migrate::application_name;
use super::url::{driver_url, redacted_url};
use crate::store::StoreError;

/// PEM contents for TLS (`store.tls_*`), read and parsed when the config is loaded so that a
/// bad file is reported by its key, not at the first connection.
#[derive(Clone, Default)]
pub struct PostgresTls {
    /// The CA certificates the server's certificate must chain to; `None` trusts the system's.
    pub ca_pem: Option<Vec<u8>>,
    /// Certificate chain and private key presented to a server that authenticates clients
    /// (`hostssl ... cert` in `pg_hba.conf`).
    pub client: Option<ClientCertificate>,
}

#[derive(Clone)]
pub struct ClientCertificate {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// Never prints the private key, so settings can be debug-printed.
impl std::fmt::Debug for PostgresTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTls")
            .field("ca_pem_bytes", &self.ca_pem.as_ref().map(Vec::len))
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

/// The driver's config of `url`, with callbackd's bounds on every connection. `url` was
/// checked when the config was loaded; an error here still never shows the password.
fn driver_config(url: &str, timeout: Duration) -> Result<Config, StoreError> {
    let mut config = Config::from_str(&driver_url(url))
        .map_err(|e| StoreError::Unavailable(format!("store.url `{}`: {e}", redacted_url(url))))?;
    let timeout_ms = timeout.as_millis().max(1);
    // The server's own bound on each statement, so one the client gave up on stops too; a
    // session a vanished client left inside a transaction ends soon after.
    let bounds = format!(
        "-c statement_timeout={timeout_ms} -c idle_in_transaction_session_timeout={}",
        timeout_ms.saturating_mul(2)
    );
    let options = match config.get_options() {
        Some(own) if !own.is_empty() => format!("{own} {bounds}"),
        _ => bounds,
    };
    config.options(options);
    if config.get_application_name().is_none() {
        config.application_name(application_name());
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(timeout);
    }
    config
        .keepalives(true)
        .keepalives_idle(timeout.clamp(Duration::from_secs(1), Duration::from_secs(30)))
        .tcp_user_timeout(timeout);
    Ok(config)
}

/// The TLS connector every connection uses when `sslmode` asks for TLS (`prefer`, the driver's
/// default, `require` and the `verify-*` modes).
fn tls_connector(tls: &PostgresTls) -> Result<MakeRustlsConnect, StoreError> {
    let bad = |what: &str, e: &dyn std::fmt::Display| {
        StoreError::Unavailable(format!("PostgreSQL TLS: {what}: {e}"))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca_pem {
        Some(ca_pem) => {
            for cert in CertificateDer::pem_slice_iter(ca_pem) {
                let cert = cert.map_err(|e| bad("store.tls_ca_file", &e))?;
                roots.add(cert).map_err(|e| bad("store.tls_ca_file", &e))?;
            }
        }
        None => {
            // Unreadable system certificates only narrow what is trusted.
            let system = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(system.certs);
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad("protocol versions", &e))?
        .with_root_certificates(roots);
    let config = match &tls.client {
        Some(client) => {
            let chain = CertificateDer::pem_slice_iter(&client.cert_pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| bad("store.tls_cert_file", &e))?;
            let key = PrivateKeyDer::from_pem_slice(&client.key_pem)
                .map_err(|e| bad("store.tls_key_file", &e))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| bad("store.tls_cert_file", &e))?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The pool, and how long any call may take.
pub(super) struct Database {
    pool: Pool,
    timeout: Duration,
    /// The URL as messages show it ([`redacted_url`]).
    shown_url: String,
    /// How the wake-up listener opens its own connection, as the pool opens its.
    listen: ListenConfig,
}

impl Database {
    /// Builds the pool for `url` and opens one connection, so that a server that cannot be
    /// reached or refuses us is reported now ([`StoreError::Unreachable`] when waiting may
    /// help), not at the first request.
    pub(super) async fn open(
        url: &str,
        timeout: Duration,
        tls: &PostgresTls,
        pool_size: usize,
    ) -> Result<Database, StoreError> {
        let shown_url = redacted_url(url);
        let config = driver_config(url, timeout)?;
        let tls = tls_connector(tls)?;
        let listen = ListenConfig {
            config: config.clone(),
            tls: tls.clone(),
            timeout,
            shown_url: shown_url.clone(),
        };
        let manager = Manager::from_config(
            config,
            tls,
            ManagerConfig {
                // A closed connection is never handed out; a broken one is dropped by `call`.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .build()
            .map_err(|e| StoreError::Unavailable(format!("PostgreSQL pool: {e}")))?;
        let database = Database {
            pool,
            timeout,
            shown_url,
            listen,
        };
        match database.pool.get().await {
            Ok(_) => Ok(database),
            Err(deadpool_postgres::PoolError::Backend(e)) => {
                Err(open_error(e, &database.shown_url))
            }
            Err(deadpool_postgres::PoolError::Timeout(_)) => Err(StoreError::Unreachable(format!(
                "PostgreSQL at {} did not answer within {timeout:?}",
                database.shown_url
            ))),
            Err(e) => Err(pool_error(e, &database.shown_url)),
        }
    }

    /// The URL as messages show it, password hidden.
    pub(super) fn shown_url(&self) -> &str {
        &self.shown_url
    }

    /// How to open a connection of its own, outside the pool (the wake-up listener).
    pub(super) fn listen_config(&self) -> ListenConfig {
        self.listen.clone()
    }

    /// The store timeout: the bound of every call.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `work` on a connection of the pool, within the store timeout (waiting for a
    /// connection included). Past the timeout, or after any failure, the connection is
    /// dropped rather than returned: it may be stuck on a dead peer, in the middle of a
    /// cancelled statement, or connected to a server that no longer takes writes.
    pub(super) async fn call<T>(
        &self,
        work: impl for<'c> FnOnce(&'c mut Client) -> BoxFuture<'c, Result<T, StoreError>> + Send,
    ) -> Result<T, StoreError> {
        self.call_within(self.timeout, work).await
    }

    /// [`Database::call`] within `bound` instead of the store timeout: for the migration, which
    /// may rebuild an index over every retained message (it also lifts the server's
    /// `statement_timeout` for its own transaction, `migrate.rs`).
    pub(super) async fn call_within<T>(
        &self,
        bound: Duration,
        work: impl for<'c> FnOnce(&'c mut Client) -> BoxFuture<'c, Result<T, StoreError>> + Send,
    ) -> Result<T, StoreError> {
        let deadline = tokio::time::Instant::now() + bound;
        let late = || {
            StoreError::Unavailable(format!(
                "PostgreSQL at {} did not answer within {bound:?}",
                self.shown_url
            ))
        };
        let mut client = tokio::time::timeout_at(deadline, self.pool.get())
            .await
            .map_err(|_| late())?
            .map_err(|e| pool_error(e, &self.shown_url))?;
        match tokio::time::timeout_at(deadline, work(&mut client)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => {
                drop(Object::take(client));
                Err(e)
            }
            Err(_) => {
                drop(Object::take(client));
                Err(late())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_connection_carries_the_bounds_and_keeps_its_own_options() {
        let config = driver_config(
            "postgres://cb:pw@a:5432,b:5433/cb?target_session_attrs=read-write\
             &options=-c%20search_path%3Dcb&sslmode=verify-full",
            Duration::from_millis(1500),
        )
        .expect("parses");
        assert_eq!(
            config.get_options(),
            Some(
                "-c search_path=cb -c statement_timeout=1500 \
                 -c idle_in_transaction_session_timeout=3000"
            )
        );
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(
            config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(config.get_application_name(), Some("callbackd/5"));
        assert_eq!(
            config.get_connect_timeout(),
            Some(&Duration::from_millis(1500))
        );
        assert!(
            !format!("{config:?}").contains("pw"),
            "the driver's Debug hides the password"
        );
    }

    #[test]
    fn a_bad_url_is_refused_without_its_password() {
        let Err(StoreError::Unavailable(why)) = driver_config(
            "postgres://cb:s3cret@h/db?nonsense=1",
            Duration::from_secs(1),
        ) else {
            panic!("refused");
        };
        assert!(why.contains("nonsense"), "{why}");
        assert!(!why.contains("s3cret"), "{why}");
    }
}
