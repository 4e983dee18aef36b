//! The state every handler and the dispatcher share, built once from the config.

use std::sync::Arc;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::{Config, Settings};
use crate::store::Store;

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
    /// Deliveries and failures per minute made by this process, for the console's chart.
    pub deliveries: Arc<crate::stats::DeliveryStats>,
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
            settings,
            store,
            clock,
            wake: Arc::new(Notify::new()),
            metrics: crate::metrics::handle(),
            shutting_down: CancellationToken::new(),
            deliveries: Arc::default(),
        }
    }
}
