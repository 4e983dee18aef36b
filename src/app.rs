//! The state every handler and the dispatcher share, built once from the config.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::Config;
use crate::dispatch::ssrf::SsrfGuard;
use crate::inbound::dedupe::DEFAULT_FIELDS;
use crate::inbound::signature::Verifier;
use crate::store::Store;

/// A configured provider account, ready to verify and key its callbacks.
#[derive(Debug)]
pub struct Source {
    pub name: String,
    pub verifier: Verifier,
    pub dedupe_fields: Vec<String>,
    pub forward_url: Option<String>,
}

pub struct App {
    pub config: Config,
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    pub sources: HashMap<String, Source>,
    pub ssrf: SsrfGuard,
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
    pub fn new(
        config: Config,
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
    ) -> Result<App, String> {
        let mut sources = HashMap::new();
        for (name, cfg) in &config.sources {
            let verifier =
                Verifier::from_config(cfg).map_err(|e| format!("sources.{name}: {e}"))?;
            let dedupe_fields = cfg
                .dedupe_fields
                .clone()
                .unwrap_or_else(|| DEFAULT_FIELDS.iter().map(|f| f.to_string()).collect());
            sources.insert(
                name.clone(),
                Source {
                    name: name.clone(),
                    verifier,
                    dedupe_fields,
                    forward_url: cfg.forward_url.clone(),
                },
            );
        }
        Ok(App {
            body_budget: Arc::new(Semaphore::new(config.server.max_buffered_bytes)),
            ssrf: SsrfGuard {
                allow_private: config.dispatch.allow_private_networks,
            },
            config,
            store,
            clock,
            sources,
            wake: Arc::new(Notify::new()),
            metrics: crate::metrics::handle(),
            shutting_down: CancellationToken::new(),
            deliveries: Arc::default(),
        })
    }
}
