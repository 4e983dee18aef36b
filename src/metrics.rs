//! Prometheus metrics. The recorder is process-global (the `metrics` facade), so it is
//! installed once, however many servers a test process starts.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const CALLBACKS: &str = "callbackd_callbacks_total";
pub const NOTIFICATIONS: &str = "callbackd_notifications_total";
pub const DELIVERIES: &str = "callbackd_deliveries_total";
pub const RETRIES: &str = "callbackd_retries_total";
pub const DEAD_LETTERS: &str = "callbackd_dead_letters_total";
pub const RESENDS: &str = "callbackd_resends_total";
pub const QUEUE_DEPTH: &str = "callbackd_queue_depth";
pub const ACCEPT_SECONDS: &str = "callbackd_accept_duration_seconds";
pub const DELIVERY_SECONDS: &str = "callbackd_delivery_duration_seconds";
pub const BUFFERED_BYTES: &str = "callbackd_http_buffered_bytes";
pub const ALERTS: &str = "callbackd_dead_letter_alerts_total";
pub const DELIVERY_FAILURES: &str = "callbackd_delivery_failures_total";
pub const OLDEST_PENDING_AGE: &str = "callbackd_oldest_pending_age_seconds";
pub const STORE_UP: &str = "callbackd_store_up";
pub const BUILD_INFO: &str = "callbackd_build_info";

/// Metrics that are set, not counted: read at scrape time.
pub const GAUGES: [&str; 5] = [
    QUEUE_DEPTH,
    BUFFERED_BYTES,
    OLDEST_PENDING_AGE,
    STORE_UP,
    BUILD_INFO,
];

/// Every metric with its labels and meaning, for README's table and `/metrics` HELP lines.
pub const CATALOGUE: [(&str, &str, &str); 15] = [
    (
        CALLBACKS,
        "source, outcome",
        "Provider callbacks by outcome: accepted, replayed, bad_signature, bad_request, too_large, unavailable, busy",
    ),
    (
        NOTIFICATIONS,
        "outcome",
        "Connector hand-offs: accepted, replayed, invalid_transition, key_conflict, bad_request, unavailable, busy",
    ),
    (
        DELIVERIES,
        "kind, outcome",
        "Delivery attempts: success, failure (kind: inbound, notification)",
    ),
    (RETRIES, "kind", "Retries scheduled after a failed attempt"),
    (
        DEAD_LETTERS,
        "kind, reason",
        "Messages dead-lettered: gone (410) or expired (window over)",
    ),
    (RESENDS, "effect", "Messages resent by operators, by effect"),
    (
        QUEUE_DEPTH,
        "state",
        "Messages by state (pending, in_flight, dead), read from the store at scrape time",
    ),
    (
        ACCEPT_SECONDS,
        "route",
        "Time to verify, dedupe and durably record a callback or hand-off",
    ),
    (
        DELIVERY_SECONDS,
        "kind",
        "Duration of one delivery attempt (HTTP round trip)",
    ),
    (
        BUFFERED_BYTES,
        "",
        "Request body bytes held in memory now, of server.max_buffered_bytes, at scrape time",
    ),
    (
        DELIVERY_FAILURES,
        "kind, class",
        "Failed delivery attempts by class: 1xx, 3xx, 4xx, 5xx (status), timeout, connect, refused_address, request, bad_url",
    ),
    (
        ALERTS,
        "reason",
        "Dead-letter alerts recorded for delivery to [alerts] webhook_url: gone, expired",
    ),
    (
        OLDEST_PENDING_AGE,
        "",
        "Age of the oldest message not delivered yet (pending or in flight), 0 when none, read at scrape time",
    ),
    (
        STORE_UP,
        "",
        "1 when the store answered the scrape's reads, 0 when it did not",
    ),
    (
        BUILD_INFO,
        "version",
        "Always 1; the label carries the running version",
    ),
];

const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Installs the global recorder once and returns its handle.
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
                .expect("static, non-empty bucket list")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding application): then
            // our handle renders only what we record through it, which is still correct.
            let _ = metrics::set_global_recorder(recorder);
            for (name, _, help) in CATALOGUE {
                if GAUGES.contains(&name) {
                    metrics::describe_gauge!(name, help);
                } else if name.ends_with("_seconds") {
                    metrics::describe_histogram!(name, metrics::Unit::Seconds, help);
                } else {
                    metrics::describe_counter!(name, help);
                }
            }
            handle
        })
        .clone()
}
