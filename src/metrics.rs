//! Prometheus metrics. The recorder is process-global (the `metrics` facade), so it is
//! installed once, however many servers a test process starts.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::dispatch::gate::HoldReason;
use crate::store::lifecycle::policy::{DeathReason, FailureClass};
use crate::store::{MessageKind, ResendEffect};

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
pub const HOST_BREAKER_OPEN: &str = "callbackd_host_breaker_open";
pub const HOST_FAILURES: &str = "callbackd_host_consecutive_failures";
pub const HELD_BACK: &str = "callbackd_held_back_total";

/// Metrics that are set, not counted: read at scrape time.
pub const GAUGES: [&str; 7] = [
    QUEUE_DEPTH,
    BUFFERED_BYTES,
    OLDEST_PENDING_AGE,
    STORE_UP,
    BUILD_INFO,
    HOST_BREAKER_OPEN,
    HOST_FAILURES,
];

/// One metric as documented: the metrics table of docs/operations.md and the `/metrics` HELP lines are
/// both made from this (a test holds the table to it).
pub struct MetricDoc {
    pub name: &'static str,
    pub labels: &'static [&'static str],
    pub meaning: &'static str,
    /// The values a label takes, for labels with a fixed set (not `source`).
    pub values: &'static [(&'static str, &'static [&'static str])],
}

impl MetricDoc {
    /// The HELP text: the meaning, then each label's values.
    pub fn help(&self) -> String {
        let mut help = self.meaning.to_string();
        for (label, values) in self.values {
            help.push_str(&format!("; {label}: {}", values.join(", ")));
        }
        help
    }

    /// The values `label` may take, if it has a fixed set.
    pub fn values_of(&self, label: &str) -> Option<&'static [&'static str]> {
        self.values
            .iter()
            .find(|(l, _)| *l == label)
            .map(|(_, v)| *v)
    }
}

pub const CALLBACK_OUTCOMES: &[&str] = &[
    "accepted",
    "replayed",
    "bad_signature",
    "bad_request",
    "too_large",
    "timeout",
    "unavailable",
    "busy",
    "unknown_source",
    "signature_reused",
];
pub const NOTIFICATION_OUTCOMES: &[&str] = &[
    "accepted",
    "replayed",
    "invalid_transition",
    "key_conflict",
    "bad_request",
    "too_large",
    "timeout",
    "unauthorized",
    "unavailable",
    "busy",
];
/// The `reason` of the alerts that a host's breaker opened, and that it closed.
pub const HOST_ALERT_REASONS: [&str; 2] = ["host_open", "host_recovered"];
const KINDS: &[&str] = &["inbound", "notification"];

/// The labels of a delivery policy outcome (`store/lifecycle/policy.rs`), in the order of its
/// `ALL`: the policy spells each once, and the catalogue lists what it can emit.
macro_rules! labels_of {
    ($outcome:ty) => {{
        let mut labels = [""; <$outcome>::ALL.len()];
        let mut i = 0;
        while i < labels.len() {
            labels[i] = <$outcome>::ALL[i].as_str();
            i += 1;
        }
        labels
    }};
}

const DEATH_REASONS: [&str; DeathReason::ALL.len()] = labels_of!(DeathReason);
/// An alert of one death has its reason; a digest covers many: the death reasons, then
/// `digest`, then a host's breaker opening and closing.
const ALERT_REASONS: [&str; DeathReason::ALL.len() + 1 + HOST_ALERT_REASONS.len()] = {
    let mut reasons = ["digest"; DeathReason::ALL.len() + 1 + HOST_ALERT_REASONS.len()];
    let mut i = 0;
    while i < DEATH_REASONS.len() {
        reasons[i] = DEATH_REASONS[i];
        i += 1;
    }
    let mut j = 0;
    while j < HOST_ALERT_REASONS.len() {
        reasons[DEATH_REASONS.len() + 1 + j] = HOST_ALERT_REASONS[j];
        j += 1;
    }
    reasons
};
const FAILURE_CLASSES: [&str; FailureClass::ALL.len()] = labels_of!(FailureClass);
const HOLD_REASONS: [&str; HoldReason::ALL.len()] = labels_of!(HoldReason);
const RESEND_EFFECTS: &[&str] = &[
    "requeued",
    "expedited",
    "queued",
    "after_current",
    "skipped",
];

/// Every metric with its labels and meaning.
pub const CATALOGUE: [MetricDoc; 18] = [
    MetricDoc {
        name: CALLBACKS,
        labels: &["source", "outcome"],
        meaning: "Provider callbacks by outcome",
        values: &[("outcome", CALLBACK_OUTCOMES)],
    },
    MetricDoc {
        name: NOTIFICATIONS,
        labels: &["outcome"],
        meaning: "Connector hand-offs by outcome",
        values: &[("outcome", NOTIFICATION_OUTCOMES)],
    },
    MetricDoc {
        name: DELIVERIES,
        labels: &["kind", "outcome"],
        meaning: "Delivery attempts",
        values: &[("kind", KINDS), ("outcome", &["success", "failure"])],
    },
    MetricDoc {
        name: RETRIES,
        labels: &["kind"],
        meaning: "Retries scheduled after a failed attempt",
        values: &[("kind", KINDS)],
    },
    MetricDoc {
        name: DEAD_LETTERS,
        labels: &["kind", "reason"],
        meaning: "Messages dead-lettered: gone (410), expired (window over), or the window over while their host was held back (breaker_open, throttled)",
        values: &[("kind", KINDS), ("reason", &DEATH_REASONS)],
    },
    MetricDoc {
        name: RESENDS,
        labels: &["effect"],
        meaning: "Messages resent by operators, by effect",
        values: &[("effect", RESEND_EFFECTS)],
    },
    MetricDoc {
        name: QUEUE_DEPTH,
        labels: &["state"],
        meaning: "Messages by state, read from the store at scrape time",
        values: &[("state", &["pending", "in_flight", "dead"])],
    },
    MetricDoc {
        name: ACCEPT_SECONDS,
        labels: &["route"],
        meaning: "Time to verify, dedupe and durably record a callback or hand-off",
        values: &[("route", &["callbacks", "notifications"])],
    },
    MetricDoc {
        name: DELIVERY_SECONDS,
        labels: &["kind"],
        meaning: "Duration of one delivery attempt (HTTP round trip)",
        values: &[("kind", KINDS)],
    },
    MetricDoc {
        name: BUFFERED_BYTES,
        labels: &[],
        meaning: "Request body bytes held in memory now, of server.max_buffered_bytes, at scrape time",
        values: &[],
    },
    MetricDoc {
        name: DELIVERY_FAILURES,
        labels: &["kind", "class"],
        meaning: "Failed delivery attempts by class: the status class when the receiver answered, else the error",
        values: &[("kind", KINDS), ("class", &FAILURE_CLASSES)],
    },
    MetricDoc {
        name: ALERTS,
        labels: &["reason"],
        meaning: "Alerts recorded for delivery to [alerts] webhook_url: one per death, a digest of a window's deaths beyond the cap, or one per host breaker opening or closing",
        values: &[("reason", &ALERT_REASONS)],
    },
    MetricDoc {
        name: OLDEST_PENDING_AGE,
        labels: &[],
        meaning: "Age of the oldest message not delivered yet (pending or in flight), 0 when none, read at scrape time",
        values: &[],
    },
    MetricDoc {
        name: STORE_UP,
        labels: &[],
        meaning: "1 when the store answered the scrape's reads, 0 when it did not",
        values: &[],
    },
    MetricDoc {
        name: HOST_BREAKER_OPEN,
        labels: &["host"],
        meaning: "1 while this process's circuit breaker for the host (host:port) is open, else 0",
        values: &[],
    },
    MetricDoc {
        name: HOST_FAILURES,
        labels: &["host"],
        meaning: "Consecutive failed attempts to the host (no answer, a 5xx) as this process counts them",
        values: &[],
    },
    MetricDoc {
        name: HELD_BACK,
        labels: &["host", "reason"],
        meaning: "Claimed messages sent back to the queue without an attempt, to protect their host",
        values: &[("reason", &HOLD_REASONS)],
    },
    MetricDoc {
        name: BUILD_INFO,
        labels: &["version"],
        meaning: "Always 1; the label carries the running version",
        values: &[],
    },
];

/// The `kind` label of a message.
pub fn kind(kind: MessageKind) -> &'static str {
    match kind {
        MessageKind::Inbound => "inbound",
        MessageKind::Notification => "notification",
    }
}

/// The `effect` label of a resend.
pub fn resend_effect(effect: ResendEffect) -> &'static str {
    match effect {
        ResendEffect::Requeued => "requeued",
        ResendEffect::Expedited => "expedited",
        ResendEffect::Queued => "queued",
        ResendEffect::AfterCurrent => "after_current",
        ResendEffect::Skipped => "skipped",
    }
}

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
            for metric in &CATALOGUE {
                let (name, help) = (metric.name, metric.help());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::lifecycle::policy::{AttemptError, AttemptResult};

    fn values(name: &str, label: &str) -> &'static [&'static str] {
        CATALOGUE
            .iter()
            .find(|m| m.name == name)
            .and_then(|m| m.values_of(label))
            .unwrap_or_else(|| panic!("{name} has no values for `{label}`"))
    }

    /// Every label the dispatcher and the alerts can emit is documented (the accept routes'
    /// outcomes are held to it in `http/record.rs`).
    #[test]
    fn every_label_a_worker_can_emit_is_in_the_catalogue() {
        for k in [MessageKind::Inbound, MessageKind::Notification] {
            assert!(values(DELIVERIES, "kind").contains(&kind(k)));
        }
        for reason in DeathReason::ALL {
            assert!(values(ALERTS, "reason").contains(&reason.as_str()));
        }
        // Every failed attempt's class: statuses that are not 2xx, and every error.
        let failures = [100, 301, 404, 429, 500, 503]
            .map(|s| (Some(s), None))
            .into_iter()
            .chain(AttemptError::ALL.map(|e| (None, Some(e))));
        for (status, error) in failures {
            let class = FailureClass::of(&AttemptResult {
                status,
                error,
                retry_after: None,
                response: None,
            })
            .map_or("none", FailureClass::as_str);
            assert!(
                values(DELIVERY_FAILURES, "class").contains(&class),
                "{class}"
            );
        }
        for effect in [
            ResendEffect::Requeued,
            ResendEffect::Expedited,
            ResendEffect::Queued,
            ResendEffect::AfterCurrent,
            ResendEffect::Skipped,
        ] {
            assert!(values(RESENDS, "effect").contains(&resend_effect(effect)));
        }
    }

    /// Label values written as literals at the call sites (`"reason" => "gone"`) are
    /// documented too: every literal label value in the sources is in its metric's list.
    #[test]
    fn literal_label_values_in_the_sources_are_in_the_catalogue() {
        let all: Vec<&str> = CATALOGUE
            .iter()
            .flat_map(|m| m.values.iter().flat_map(|(_, v)| v.iter().copied()))
            .collect();
        let mut checked = 0;
        let mut stack = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                    continue;
                }
                if path.extension().is_none_or(|e| e != "rs") || path.ends_with("metrics.rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                for part in text.split("\" => \"").skip(1) {
                    let value = part.split('"').next().unwrap_or_default();
                    assert!(
                        all.contains(&value),
                        "{}: label value `{value}` is not in metrics::CATALOGUE",
                        path.display()
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 0, "the scan found the metric call sites");
    }
}
