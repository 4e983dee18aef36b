//! A connector's hand-off (`POST /v1/notifications`) is checked, then becomes an accept
//! request: the claim of its idempotency key with the answer every repeat gets, the
//! notification to deliver to the gateway's `callbackUrl`, and the payment's compare-and-set
//! (§1.3), recorded by one `Store::accept` in one atomic step. The handler parses the request
//! and reads the clock; this checks it and decides what is recorded. Pure but for one DNS
//! lookup: whether the `callbackUrl`'s host resolves to an address a delivery may reach
//! (`ssrf.rs`).
//!
//! The idempotency key is `paymentId + status`, or the `Idempotency-Key` header scoped to the
//! payment. The fingerprint is the request's JSON, so the same key with another body is a
//! conflict.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use serde::Serialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::clock::deadline;
use crate::clock::{Millis, format_iso};
use crate::digest::short_hash;
use crate::payment::{self, PaymentStatus};
use crate::ssrf::{SsrfError, SsrfGuard};
use crate::store::{
    AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, Partitions, PaymentId,
    PaymentTransition,
};
use crate::webhook::{ATTEMPT_HEADER, MESSAGE_ID_HEADER};

/// Longest `paymentId`, in characters.
pub const MAX_ID_LEN: usize = 256;
/// Most `headers` one notification may carry.
pub const MAX_HEADERS: usize = 32;
/// Headers a connector may not set: they belong to the HTTP exchange or to callbackd.
pub const RESERVED_HEADERS: [&str; 7] = [
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    MESSAGE_ID_HEADER,
    ATTEMPT_HEADER,
];
/// How long the `callbackUrl`'s host may take to resolve; one that does not resolve in time
/// is let through, and delivery checks it again.
const DNS_TIMEOUT: Duration = Duration::from_secs(2);

/// What accepting a hand-off takes from the settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// How long a notification is delivered for unless it asks for less
    /// (`dispatch.max_age_secs`).
    pub max_window: Duration,
    /// How long an idempotency key is claimed (`store.dedupe_ttl_secs`).
    pub dedupe_ttl: Duration,
    /// The store's partition count, which the message id embeds.
    pub partitions: Partitions,
    /// Which addresses a `callbackUrl` may reach (`dispatch.allow_private_networks`).
    pub callback_ssrf: SsrfGuard,
}

/// A hand-off as the connector sent it: parsed, not checked yet.
#[derive(Debug, Clone)]
pub struct HandOff {
    pub payment_id: String,
    /// The payment status it moves to, as written.
    pub status: String,
    pub callback_url: String,
    pub payload: Option<Map<String, Value>>,
    /// The connector's headers for every attempt.
    pub headers: Option<BTreeMap<String, String>>,
    /// A shorter delivery window, in seconds.
    pub max_age_secs: Option<u64>,
    /// The request as parsed: what its fingerprint is taken from.
    pub request: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum HandOffError {
    /// A field breaks a rule; `field` is its name in the request.
    #[error("`{field}`: {problem}")]
    Invalid {
        field: &'static str,
        problem: String,
    },
    /// The answer could not be written as JSON (its shape cannot fail to).
    #[error(transparent)]
    Answer(#[from] serde_json::Error),
}

fn invalid(field: &'static str, problem: impl std::fmt::Display) -> HandOffError {
    HandOffError::Invalid {
        field,
        problem: problem.to_string(),
    }
}

/// Checks every field of `hand_off`, in the order the document lists them: only a checked
/// hand-off can be accepted.
pub async fn check(settings: &Settings, hand_off: HandOff) -> Result<Notification, HandOffError> {
    hand_off.check(settings).await
}

/// The accept request of `notification` under the connector's `Idempotency-Key`, if sent,
/// handed off at `now`. It carries the trace context of `request_headers` (else a valid one
/// among the connector's headers).
pub fn accept(
    settings: &Settings,
    mut notification: Notification,
    idempotency_key: Option<String>,
    request_headers: &HeaderMap,
    now: Millis,
) -> Result<AcceptRequest, HandOffError> {
    notification.idempotency_key = idempotency_key;
    crate::trace::carry(request_headers, &mut notification.headers);
    Ok(accept_request(settings, notification, now)?)
}

impl HandOff {
    async fn check(self, settings: &Settings) -> Result<Notification, HandOffError> {
        // Characters, not bytes: what the document's `maxLength` counts.
        let len = self.payment_id.chars().count();
        if len == 0 || len > MAX_ID_LEN {
            return Err(invalid(
                "paymentId",
                format!("must be 1 to {MAX_ID_LEN} characters"),
            ));
        }
        let to = PaymentStatus::parse(&self.status).ok_or_else(|| {
            let valid: Vec<&str> = PaymentStatus::ALL.iter().map(|s| s.as_str()).collect();
            invalid(
                "status",
                format!("`{}` is not one of {}", self.status, valid.join(", ")),
            )
        })?;
        settings
            .callback_ssrf
            .check_url(&self.callback_url, DNS_TIMEOUT)
            .await
            .map_err(|e| {
                // The answer does not say what the host resolved to; the operator's log does.
                if let SsrfError::Forbidden { host, addr } = &e {
                    tracing::info!(%host, %addr, "callbackUrl refused by the SSRF guard");
                }
                invalid("callbackUrl", e)
            })?;
        if let Some(headers) = &self.headers {
            check_headers(headers)?;
        }
        // `maxAgeSecs` counts in whole seconds, as `dispatch.max_age_secs` does.
        let most = settings.max_window.as_secs();
        if let Some(max_age) = self.max_age_secs
            && (max_age == 0 || max_age > most)
        {
            return Err(invalid(
                "maxAgeSecs",
                format!("must be 1 to {most} (dispatch.max_age_secs)"),
            ));
        }
        Ok(Notification {
            payment_id: PaymentId::from(self.payment_id),
            to,
            callback_url: self.callback_url,
            payload: self.payload,
            headers: self.headers.unwrap_or_default(),
            window: self.max_age_secs.map(Duration::from_secs),
            idempotency_key: None,
            request: self.request,
        })
    }
}

/// A connector's headers: few enough, each a valid header that callbackd does not set.
fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), HandOffError> {
    if headers.len() > MAX_HEADERS {
        return Err(invalid("headers", format!("at most {MAX_HEADERS} headers")));
    }
    for (name, value) in headers {
        let parsed = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid("headers", format!("`{name}` is not a header name")))?;
        if RESERVED_HEADERS.contains(&parsed.as_str()) {
            return Err(invalid("headers", format!("`{name}` is set by callbackd")));
        }
        HeaderValue::from_str(value).map_err(|_| {
            invalid(
                "headers",
                format!("value of `{name}` is not a valid header value"),
            )
        })?;
    }
    Ok(())
}

/// A hand-off whose every field was checked: the status is a payment status, the
/// `callbackUrl` may be reached, the headers may be set and the window is within
/// [`Settings::max_window`].
#[derive(Debug, Clone)]
pub struct Notification {
    payment_id: PaymentId,
    to: PaymentStatus,
    /// Delivered to byte for byte (the gateway signs it).
    callback_url: String,
    /// The body to deliver; `{"paymentId", "status"}` when absent.
    payload: Option<Map<String, Value>>,
    /// Headers sent with every attempt (the connector's, and the trace context).
    headers: BTreeMap<String, String>,
    /// A shorter delivery window, when asked for.
    window: Option<Duration>,
    /// The `Idempotency-Key` header, when sent.
    idempotency_key: Option<String>,
    /// The request as parsed: what its fingerprint is taken from.
    request: Value,
}

// The answer to an accepted hand-off. It is stored with the claim, so a repeat gets these
// exact bytes. (Not a doc comment: it would become the API document's description.)
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NotificationAccepted {
    pub notification_id: String,
    pub payment_id: String,
    pub status: String,
    pub accepted_at: String,
    pub deliver_until: String,
}

/// The accept request of `notification`, handed off at `now`.
fn accept_request(
    settings: &Settings,
    notification: Notification,
    now: Millis,
) -> Result<AcceptRequest, serde_json::Error> {
    let Notification {
        payment_id,
        to,
        callback_url,
        payload,
        headers,
        window,
        idempotency_key,
        request,
    } = notification;
    let ordering_key = payment::ordering_key(&payment_id);
    let id = MessageId::generate(now, &ordering_key, settings.partitions);
    let deliver_until = deadline(now, window.unwrap_or(settings.max_window));
    let response = serde_json::to_string(&NotificationAccepted {
        notification_id: id.to_string(),
        payment_id: payment_id.to_string(),
        status: to.to_string(),
        accepted_at: format_iso(now),
        deliver_until: format_iso(deliver_until),
    })?;
    let key_tuple = match &idempotency_key {
        Some(k) => json!(["notification-key", payment_id, k]),
        None => json!(["notification", payment_id, to.as_str()]),
    };
    let body = match payload {
        Some(p) => Value::Object(p),
        None => json!({"paymentId": payment_id, "status": to.as_str()}),
    };
    let message = NewMessage {
        id,
        kind: MessageKind::Notification,
        source: None,
        payment_id: Some(payment_id.clone()),
        transaction_id: None,
        ordering_key,
        event: None,
        target_url: Some(callback_url),
        headers,
        body: body.to_string(),
        created_at: now,
        deadline: deliver_until,
    };
    Ok(AcceptRequest {
        dedupe: DedupeClaim {
            key: short_hash(key_tuple.to_string().as_bytes()),
            ttl_secs: settings.dedupe_ttl.as_secs(),
            // serde_json's map is ordered, so equal JSON gives equal fingerprints whatever
            // the key order or whitespace of the original bytes.
            fingerprint: Some(short_hash(request.to_string().as_bytes())),
            response,
        },
        message,
        seal: None,
        payment: Some(PaymentTransition {
            payment_id,
            to,
            allowed_from: payment::allowed_from(to),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Millis = 1_764_460_800_000;
    const WEEK: Duration = Duration::from_secs(7 * 86_400);
    const SETTINGS: Settings = Settings {
        max_window: WEEK,
        dedupe_ttl: Duration::from_secs(30 * 86_400),
        partitions: Partitions::DEFAULT,
        callback_ssrf: SsrfGuard {
            allow_private: false,
        },
    };

    fn notification(request: &str) -> Notification {
        let request: Value = serde_json::from_str(request).unwrap();
        Notification {
            payment_id: request["paymentId"].as_str().unwrap().into(),
            to: PaymentStatus::parse(request["status"].as_str().unwrap()).unwrap(),
            callback_url: request["callbackUrl"].as_str().unwrap().to_string(),
            payload: request["payload"].as_object().cloned(),
            headers: BTreeMap::new(),
            window: request["maxAgeSecs"].as_u64().map(Duration::from_secs),
            idempotency_key: None,
            request,
        }
    }

    const APPROVED: &str = r#"{"paymentId": "p1", "status": "approved",
        "callbackUrl": "https://gw.example/cb?X-VTEX-signature=abc"}"#;

    #[test]
    fn a_hand_off_becomes_its_claim_its_notification_and_its_transition() {
        let request = accept_request(&SETTINGS, notification(APPROVED), NOW).unwrap();
        let m = &request.message;
        assert_eq!(m.kind, MessageKind::Notification);
        assert_eq!(m.payment_id.as_deref(), Some("p1"));
        assert_eq!(m.ordering_key, "pay/p1");
        assert_eq!(m.id.created_at(), NOW);
        assert_eq!(
            m.target_url.as_deref(),
            Some("https://gw.example/cb?X-VTEX-signature=abc")
        );
        assert_eq!(m.body, r#"{"paymentId":"p1","status":"approved"}"#);
        assert_eq!((m.created_at, m.deadline), (NOW, NOW + 7 * 86_400_000));
        assert_eq!(
            request.payment,
            Some(PaymentTransition {
                payment_id: "p1".into(),
                to: PaymentStatus::Approved,
                allowed_from: vec![PaymentStatus::Undefined],
            })
        );
        assert_eq!(request.seal, None);
        assert_eq!(request.dedupe.ttl_secs, 30 * 86_400);
        assert_eq!(
            request.dedupe.key,
            short_hash(
                json!(["notification", "p1", "approved"])
                    .to_string()
                    .as_bytes()
            )
        );
        let answer: Value = serde_json::from_str(&request.dedupe.response).unwrap();
        assert_eq!(
            answer,
            json!({
                "notificationId": m.id.as_str(),
                "paymentId": "p1",
                "status": "approved",
                "acceptedAt": format_iso(NOW),
                "deliverUntil": format_iso(NOW + 7 * 86_400_000),
            })
        );
    }

    #[test]
    fn the_payload_is_delivered_and_the_window_may_be_shorter() {
        let request = r#"{"paymentId": "p1", "status": "settled", "maxAgeSecs": 60,
            "callbackUrl": "https://gw.example/cb", "payload": {"b": 1, "a": [2]}}"#;
        let request = accept_request(&SETTINGS, notification(request), NOW).unwrap();
        assert_eq!(request.message.body, r#"{"a":[2],"b":1}"#);
        assert_eq!(request.message.deadline, NOW + 60_000);
        assert!(request.dedupe.response.contains(&format_iso(NOW + 60_000)));
        let payment = request.payment.unwrap();
        assert_eq!(payment.allowed_from, vec![PaymentStatus::Approved]);
    }

    #[test]
    fn an_idempotency_key_is_scoped_to_its_payment() {
        let keyed = |payment: &str| {
            let mut n = notification(&APPROVED.replace("p1", payment));
            n.idempotency_key = Some("k-1".into());
            accept_request(&SETTINGS, n, NOW).unwrap().dedupe.key
        };
        assert_eq!(
            keyed("p1"),
            short_hash(
                json!(["notification-key", "p1", "k-1"])
                    .to_string()
                    .as_bytes()
            )
        );
        assert_ne!(keyed("p1"), keyed("p2"));
        let unkeyed = accept_request(&SETTINGS, notification(APPROVED), NOW).unwrap();
        assert_ne!(keyed("p1"), unkeyed.dedupe.key);
    }

    #[test]
    fn the_fingerprint_is_the_json_not_its_spelling() {
        let fingerprint = |request: &str| {
            accept_request(&SETTINGS, notification(request), NOW)
                .unwrap()
                .dedupe
                .fingerprint
        };
        let reordered = r#"{"callbackUrl":"https://gw.example/cb?X-VTEX-signature=abc",
            "status":"approved","paymentId":"p1"}"#;
        assert_eq!(fingerprint(APPROVED), fingerprint(reordered));
        let other_url = APPROVED.replace("abc", "abd");
        assert_ne!(fingerprint(APPROVED), fingerprint(&other_url));
    }

    fn hand_off(request: &str) -> HandOff {
        let request: Value = serde_json::from_str(request).unwrap();
        HandOff {
            payment_id: request["paymentId"].as_str().unwrap().into(),
            status: request["status"].as_str().unwrap().to_string(),
            callback_url: request["callbackUrl"].as_str().unwrap().to_string(),
            payload: None,
            headers: serde_json::from_value(request["headers"].clone()).unwrap(),
            max_age_secs: request["maxAgeSecs"].as_u64(),
            request,
        }
    }

    /// Settings that let any `callbackUrl` host through, so no test looks a name up.
    const OPEN: Settings = Settings {
        callback_ssrf: SsrfGuard {
            allow_private: true,
        },
        ..SETTINGS
    };

    #[tokio::test]
    async fn a_hand_off_is_checked_field_by_field_and_the_refusal_names_the_field() {
        let cases = [
            (
                OPEN,
                APPROVED.replace("\"p1\"", "\"\""),
                "`paymentId`: must be 1 to 256",
            ),
            (
                OPEN,
                APPROVED.replace("approved", "paid"),
                "`status`: `paid` is not one of",
            ),
            (OPEN, APPROVED.replace("https:", "ftp:"), "`callbackUrl`: "),
            (
                SETTINGS,
                APPROVED.replace("https://gw.example", "http://127.0.0.1"),
                "`callbackUrl`: ",
            ),
            (
                OPEN,
                APPROVED.replace('}', r#", "headers": {"Content-Type": "x"}}"#),
                "`headers`: `Content-Type` is set by callbackd",
            ),
            (
                OPEN,
                APPROVED.replace('}', r#", "maxAgeSecs": 604801}"#),
                "`maxAgeSecs`: must be 1 to 604800 (dispatch.max_age_secs)",
            ),
        ];
        for (settings, request, expected) in cases {
            let refused = check(&settings, hand_off(&request)).await;
            let message = refused.unwrap_err().to_string();
            assert!(message.starts_with(expected), "{request}: {message}");
        }
    }

    #[tokio::test]
    async fn a_checked_hand_off_carries_the_requests_trace_context() {
        let trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut request_headers = HeaderMap::new();
        request_headers.insert(crate::trace::TRACEPARENT, trace.parse().unwrap());
        let request = APPROVED.replace('}', r#", "headers": {"X-App": "k"}}"#);
        let checked = check(&OPEN, hand_off(&request)).await.unwrap();
        let accepted = accept(&OPEN, checked, None, &request_headers, NOW).unwrap();
        assert_eq!(
            accepted.message.headers,
            BTreeMap::from([
                ("X-App".to_string(), "k".to_string()),
                (crate::trace::TRACEPARENT.to_string(), trace.to_string()),
            ])
        );
    }
}
