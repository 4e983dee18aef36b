//! A connector's hand-off (`POST /v1/notifications`) becomes an accept request: the claim of
//! its idempotency key with the answer every repeat gets, the notification to deliver to the
//! gateway's `callbackUrl`, and the payment's compare-and-set (§1.3), recorded by one
//! `Store::accept` in one atomic step. Pure: the handler checks the request and reads the
//! clock, this decides what is recorded.
//!
//! The idempotency key is `paymentId + status`, or the `Idempotency-Key` header scoped to the
//! payment. The fingerprint is the request's JSON, so the same key with another body is a
//! conflict.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::clock::deadline;
use crate::clock::{Millis, format_iso};
use crate::digest::short_hash;
use crate::payment::{self, PaymentStatus};
use crate::store::{
    AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, Partitions, PaymentTransition,
};

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
}

/// A hand-off whose every field was checked: the status is a payment status, the
/// `callbackUrl` may be reached, the headers may be set and the window is within
/// [`Settings::max_window`].
#[derive(Debug, Clone)]
pub struct Notification {
    pub payment_id: String,
    pub to: PaymentStatus,
    /// Delivered to byte for byte (the gateway signs it).
    pub callback_url: String,
    /// The body to deliver; `{"paymentId", "status"}` when absent.
    pub payload: Option<Map<String, Value>>,
    /// Headers sent with every attempt (the connector's, and the trace context).
    pub headers: BTreeMap<String, String>,
    /// A shorter delivery window, when asked for.
    pub window: Option<Duration>,
    /// The `Idempotency-Key` header, when sent.
    pub idempotency_key: Option<String>,
    /// The request as parsed: what its fingerprint is taken from.
    pub request: Value,
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
pub fn accept_request(
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
        payment_id: payment_id.clone(),
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
            fingerprint: short_hash(request.to_string().as_bytes()),
            response,
        },
        message,
        seal: None,
        payment: Some(PaymentTransition {
            payment_id,
            to: to.to_string(),
            allowed_from: payment::allowed_from(to)
                .into_iter()
                .map(|s| s.to_string())
                .collect(),
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
    };

    fn notification(request: &str) -> Notification {
        let request: Value = serde_json::from_str(request).unwrap();
        Notification {
            payment_id: request["paymentId"].as_str().unwrap().to_string(),
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
                to: "approved".into(),
                allowed_from: vec!["undefined".into()],
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
        assert_eq!(payment.allowed_from, vec!["approved".to_string()]);
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
}
