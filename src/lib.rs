//! callbackd: makes payment callbacks safe to retry. This file wires the parts together.
//!
//! The map (ARCHITECTURE.md has the long version):
//! - `http/`: thin handlers that authenticate (`http/auth.rs`'s `Admin` and `Connector`
//!   extractors), read and parse, call one use case and map its outcome to an answer; errors
//!   become statuses in `http/error.rs`. Nothing below `http` imports it;
//! - `webhook/`: the header names and the signature schemes, verified and signed;
//! - `inbound/accept.rs` (a verified callback) and `handoff.rs` (a connector's notification,
//!   whose fields it checks): the accept request each becomes, pure (but for the DNS lookup
//!   of a `callbackUrl`'s host); `inbound/dedupe.rs` and `payment.rs` the rules they apply,
//!   `ordering.rs` the ordering key each files its message under;
//! - `operations/`: the admin API's use cases: a listing's filters and the store filter they
//!   become (`messages.rs`), and the resend (`resend/`: its `requestId`, the walk detached
//!   from the request, the dry run);
//! - `store/`: the one seam to storage, each state change one atomic step with `now` from the
//!   caller; `store/lifecycle/` decides the message lifecycle once, in plain Rust (its rules
//!   return effects, its policy says what an answer means), and the engines,
//!   `store/sqlite/`, `store/redis/` and `store/postgres/`, apply what it decides;
//! - `dispatch/`: the workers that claim, deliver and complete, within per-host slots
//!   (`dispatch/hosts.rs`) and each host's gate (`gate.rs`: breaker, throttle, rate;
//!   `guards.rs` keeps one per host); `announce.rs` records alerts and digests; `ssrf.rs` the
//!   addresses a delivery may reach;
//! - `config/`: the file, its checks and the typed settings built from it once;
//! - `alerts.rs`, `metrics.rs`, `trace.rs`, `redact.rs`: what operators watch and see.
//!
//! `run` serves at once and waits for a store that is not reachable yet; `serve` runs the
//! HTTP server, the dispatcher, the sweeper and the store watch behind `/healthz`.

pub mod alerts;
pub mod app;
pub mod cli;
pub mod clock;
pub mod config;
pub mod digest;
pub mod dispatch;
pub mod durability;
pub mod handoff;
pub mod http;
pub mod inbound;
pub mod metrics;
pub mod operations;
pub mod ordering;
pub mod payment;
pub mod redact;
pub mod ssrf;
pub mod store;
pub mod trace;
pub mod webhook;

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use app::{App, ServerSettings, Settings, StoreSettings};
use clock::Clock;
use config::{Config, StoreLocation};
use dispatch::Dispatcher;
use durability::Verdict;
use store::postgres::{PostgresOptions, PostgresStore};
use store::redis::{RedisOptions, RedisStore};
use store::sqlite::{SqliteOptions, SqliteStore};
use store::{Inspectable, Store, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `store.require_durable = true` and the store (Redis, PostgreSQL) may lose acknowledged
    /// writes; the message says what to check.
    #[error("store.require_durable = true refuses this store: {0}")]
    NotDurable(String),
    /// `store.min_replicas_acked` asks for more replicas than the Redis has connected.
    #[error("{0}")]
    TooFewReplicas(String),
    #[error("{0}")]
    Setup(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// Opens the configured store and checks it is fit to acknowledge callbacks.
pub async fn open_store(settings: &StoreSettings) -> Result<Arc<dyn Store>, StartError> {
    Ok(open_inspectable_store(settings).await?)
}

/// [`open_store`], as a handle that can also read payment statuses
/// ([`store::PaymentStatusRead`]): what tests keep of the store a server runs on, since a
/// SQLite store admits a single handle and they cannot open a second.
pub async fn open_inspectable_store(
    settings: &StoreSettings,
) -> Result<Arc<dyn Inspectable>, StartError> {
    // The engines count retention in whole seconds, as the config does.
    let retention = settings.dedupe_ttl.as_secs();
    let payment_retention = settings.payment_retention.as_secs();
    match &settings.location {
        StoreLocation::Sqlite(path) => {
            let options = SqliteOptions {
                timeout: settings.timeout,
                payment_retention_secs: payment_retention,
                partitions: settings.partitions,
                ..SqliteOptions::default()
            };
            Ok(Arc::new(SqliteStore::open_with(path, retention, options)?))
        }
        StoreLocation::Redis(url) => {
            let options = RedisOptions {
                partitions: settings.partitions,
                ..settings.redis.clone()
            };
            let store = RedisStore::connect_with(url, settings.timeout, retention, &options)
                .await?
                .with_payment_retention_secs(payment_retention)
                .with_min_replicas_acked(settings.min_replicas_acked);
            // Judged before the upgrade writes anything to a Redis that may be refused.
            let durable = durability::check_redis(&store, settings.require_durable).await?;
            start_or_refuse(durable, StartError::NotDurable)?;
            let replicas = durability::check_replicas(&store, settings.min_replicas_acked).await?;
            start_or_refuse(replicas, StartError::TooFewReplicas)?;
            let from = store.upgrade(clock::SystemClock.now_ms()).await?;
            if from < store::redis::SCHEMA_VERSION {
                tracing::info!(
                    from,
                    to = store::redis::SCHEMA_VERSION,
                    "upgraded the Redis layout"
                );
            }
            Ok(Arc::new(store))
        }
        StoreLocation::Postgres(url) => {
            let options = PostgresOptions {
                partitions: settings.partitions,
                ..settings.postgres.clone()
            };
            let mut store = PostgresStore::connect_with(url, settings.timeout, retention, &options)
                .await?
                .with_payment_retention_secs(payment_retention);
            // Judged before the migration writes anything to a server that may be refused.
            let durable = store.durability(settings.require_durable).await?;
            start_or_refuse(durable, StartError::NotDurable)?;
            let from = store.migrate().await?;
            if from < store::postgres::LAYOUT_VERSION {
                tracing::info!(
                    from,
                    to = store::postgres::LAYOUT_VERSION,
                    "brought the PostgreSQL layout up to date"
                );
            }
            Ok(Arc::new(store))
        }
    }
}

/// Logs a start-up verdict's warnings, or refuses with `refused`.
fn start_or_refuse(verdict: Verdict, refused: fn(String) -> StartError) -> Result<(), StartError> {
    match verdict {
        Verdict::Refuse(why) => Err(refused(why)),
        Verdict::Start { warnings } => {
            for warning in warnings {
                tracing::warn!("{warning}");
            }
            Ok(())
        }
    }
}

/// Builds the shared state: the settings derived from `config`, the store they name, the
/// clock.
pub async fn build(config: Config, clock: Arc<dyn Clock>) -> Result<Arc<App>, StartError> {
    let settings = Settings::from_config(&config).map_err(|e| StartError::Setup(e.to_string()))?;
    let store = open_store(&settings.store).await?;
    Ok(app_on(settings, store, clock))
}

fn app_on(settings: Settings, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> Arc<App> {
    tracing::info!(
        partitions = store.partitions().count(),
        "the store's partition count"
    );
    Arc::new(App::with_settings(settings, store, clock))
}

/// Serves HTTP on `listener` and runs the dispatcher (when `dispatch.enabled`) and the
/// sweeper until `shutdown` is cancelled. Then the listener closes (new connections are
/// refused), `/readyz` answers 503 on the connections still open, which are still served, and
/// the dispatcher stops claiming; in-flight deliveries get `server.shutdown_grace_secs` to
/// finish and unfinished leases are handed back. Then open connections are asked to close
/// and get another `server.shutdown_grace_secs` to finish their requests.
pub async fn serve(
    app: Arc<App>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let server = &app.settings.server;
    let grace = server.shutdown_grace;
    tokio::spawn(app.clone().watch_store(shutdown.clone()));
    let sweeper = tokio::spawn(store::sweeper::run(
        app.store.clone(),
        app.clock.clone(),
        app.settings.store.sweep_interval,
        shutdown.clone(),
    ));
    let dispatcher = if app.settings.dispatch.enabled {
        let d = Dispatcher::new(
            &app.settings,
            app.store.clone(),
            app.clock.clone(),
            app.wake.clone(),
        )
        .map_err(|e| StartError::Setup(format!("HTTP client: {e}")))?
        .with_board(&app.held_hosts);
        Some(tokio::spawn(Arc::new(d).run(shutdown.clone(), grace)))
    } else {
        None
    };
    let stop_accepting = shutdown.clone();
    let http_shutdown = CancellationToken::new();
    let drain = tokio::spawn({
        let (app, http_shutdown) = (app.clone(), http_shutdown.clone());
        async move {
            shutdown.cancelled().await;
            app.shutting_down.cancel();
            if let Some(task) = dispatcher {
                let _ = task.await;
            }
            http_shutdown.cancel();
        }
    });
    http::server::serve(
        listener,
        http::router(app.clone()),
        stop_accepting,
        http_shutdown,
        limits(server),
    )
    .await;
    let _ = drain.await;
    let _ = sweeper.await;
    Ok(())
}

fn limits(server: &ServerSettings) -> http::server::Limits {
    http::server::Limits {
        header_timeout: server.header_timeout,
        // Longer than a slow body is given (`request_timeout_secs`), so that one still gets
        // its JSON 408 rather than a closed connection.
        idle_timeout: server.header_timeout.saturating_add(server.request_timeout),
        max_connections: server.max_connections,
        max_streams_per_connection: server.max_streams_per_connection,
        grace: server.shutdown_grace,
    }
}

/// What `callbackd serve` runs: [`build`] and [`serve`] with the system clock, except that a
/// store not reachable yet is waited for instead of ending the process. Under an orchestrator
/// callbackd and its Redis start together, and a process that exits would only crash-loop
/// until Redis is up. Meanwhile HTTP is served: `/healthz` 200, everything else 503. A
/// configuration error, or a store that answers with a refusal (a wrong password, a TLS
/// error, a layout it must not touch), still ends it at once with its message.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), StartError> {
    let settings = Settings::from_config(&config).map_err(|e| StartError::Setup(e.to_string()))?;
    let stop_starting = CancellationToken::new();
    let starting = http::server::serve(
        &listener,
        http::starting_router(),
        stop_starting.clone(),
        stop_starting.clone(),
        limits(&settings.server),
    );
    let opening = async {
        let opened = open_store_patiently(&settings.store, &shutdown).await;
        stop_starting.cancel();
        opened
    };
    let ((), opened) = tokio::join!(starting, opening);
    let Some(store) = opened? else {
        return Ok(());
    };
    let app = app_on(settings, store, Arc::new(clock::SystemClock));
    serve(app, listener, shutdown).await
}

/// [`open_store`], again with jittered backoff (0.25 s doubling to 5 s) while the store is
/// `Unreachable`, each failure logged. `None` when shutdown comes first.
async fn open_store_patiently(
    settings: &StoreSettings,
    shutdown: &CancellationToken,
) -> Result<Option<Arc<dyn Store>>, StartError> {
    let backoff = store::lifecycle::policy::Backoff {
        initial_ms: 250,
        max_ms: 5_000,
    };
    let mut step = 0;
    loop {
        let why = match open_store(settings).await {
            Ok(store) => return Ok(Some(store)),
            Err(StartError::Store(StoreError::Unreachable(why))) => why,
            Err(refused) => return Err(refused),
        };
        let base = store::lifecycle::policy::base_delay_ms(backoff, step);
        let delay = Duration::from_millis(base - rand::random_range(0..=base / 2));
        tracing::warn!(
            error = %why,
            attempt = step + 1,
            retry_in = ?delay,
            "the store is not reachable; answering 503 until it is"
        );
        tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            () = tokio::time::sleep(delay) => {}
        }
        step = step.saturating_add(1);
    }
}
