//! The state every handler and the dispatcher share, built once from the config, and the
//! typed settings it is built from (`settings.rs`).

mod settings;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, millis};
use crate::config::Config;
use crate::store::{Store, StoreError};

pub use settings::{
    AlertSettings, DispatchSettings, ForwardSettings, ProviderApi, ServerSettings, Settings,
    SourceSettings, Sources, StoreSettings,
};

pub struct App {
    /// The typed settings derived from the config, once.
    pub settings: Settings,
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    /// Rung after every accept so an idle dispatcher starts delivering at once.
    pub wake: Arc<Notify>,
    pub metrics: metrics_exporter_prometheus::PrometheusHandle,
    /// Cancelled when shutdown begins, so `/readyz` turns 503 while requests are still served.
    pub shutting_down: CancellationToken,
    /// One permit per byte of `server.max_buffered_bytes`: request bodies being read or
    /// held by a handler take their size from it (see `http::read_body`).
    pub body_budget: Arc<Semaphore>,
    /// The hosts this process's dispatcher holds back (breaker open, throttled), for the
    /// admin API.
    pub held_hosts: crate::dispatch::board::HostBoard,
    /// When the store last answered a ping, in ms since `started`: `/healthz` fails once it
    /// is older than `store.healthz_fails_after_secs`. Monotonic, not the app clock: it is
    /// about the connection now, and a virtual clock moved by days must not fail it.
    store_answered_at: AtomicU64,
    started: Instant,
}

impl App {
    /// Derives the settings of `config` and builds the shared state around `store`.
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
    ) -> Result<App, String> {
        let settings = Settings::from_config(&config).map_err(|e| e.to_string())?;
        Ok(App::with_settings(settings, store, clock))
    }

    /// Builds the shared state from settings already derived.
    pub fn with_settings(settings: Settings, store: Arc<dyn Store>, clock: Arc<dyn Clock>) -> App {
        App {
            body_budget: Arc::new(Semaphore::new(settings.server.max_buffered_bytes)),
            store_answered_at: AtomicU64::new(0),
            started: Instant::now(),
            settings,
            store,
            clock,
            wake: Arc::new(Notify::new()),
            metrics: crate::metrics::handle(),
            shutting_down: CancellationToken::new(),
            held_hosts: Default::default(),
        }
    }
}

/// How often the store is pinged for `/healthz`.
const STORE_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl App {
    /// Pings the store every second until `shutdown`, noting when it last answered. A full
    /// store answers too: what `/healthz` asks is whether the connection still works.
    pub async fn watch_store(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            if matches!(self.store.ping().await, Ok(()) | Err(StoreError::Full(_))) {
                self.store_answered_at
                    .store(millis(self.started.elapsed()), Ordering::Relaxed);
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(STORE_WATCH_INTERVAL) => {}
            }
        }
    }

    /// How long the store has gone without answering, once that is longer than
    /// `store.healthz_fails_after_secs`.
    pub fn store_silent_for(&self) -> Option<std::time::Duration> {
        let limit = self.settings.store.healthz_fails_after?;
        let since = millis(self.started.elapsed())
            .saturating_sub(self.store_answered_at.load(Ordering::Relaxed));
        let silent = std::time::Duration::from_millis(since);
        (silent > limit).then_some(silent)
    }
}
