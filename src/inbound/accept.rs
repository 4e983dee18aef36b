//! A verified provider callback becomes an accept request: the dedupe claim (§1.1) with the
//! answer every replay will get, the message, and the seal of its signature. Pure: the
//! handler reads the request and the clock, this decides what one `Store::accept` records.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use super::dedupe::{self, KeyError};
use crate::clock::Millis;
use crate::clock::deadline;
use crate::digest::short_hash;
use crate::store::{
    AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, Partitions, SignatureSeal,
};
use crate::webhook::Verified;

/// What accepting one source's callbacks takes from the settings.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    pub name: &'a str,
    /// JSON pointers of the dedupe key (the source's `dedupe_fields`, §1.1).
    pub dedupe_fields: &'a [String],
    /// Where its callbacks are delivered; `None` records them only.
    pub forward_url: Option<&'a str>,
    /// How long a callback is delivered for (`dispatch.max_age_secs`).
    pub window: Duration,
    /// How long a dedupe claim lasts (`store.dedupe_ttl_secs`).
    pub dedupe_ttl: Duration,
    /// The store's partition count, which the message id embeds.
    pub partitions: Partitions,
}

/// A callback whose signature verified and whose body is JSON.
#[derive(Debug, Clone)]
pub struct Callback<'a> {
    /// The body as received: it is delivered byte for byte.
    pub body: &'a [u8],
    pub json: &'a Value,
    /// `X-Callback-Event`, when sent: it takes the place of `status` in the dedupe key.
    pub event: Option<String>,
    /// The signature that verified; `None` for a source without one.
    pub verified: Option<Verified>,
    /// Headers kept with the message (the trace context the request carried).
    pub headers: BTreeMap<String, String>,
}

// The answer to an accepted callback. It is stored with the dedupe claim, so a replay gets
// these exact bytes. (Not a doc comment: it would become the API document's description.)
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CallbackAccepted {
    pub message_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CallbackError {
    /// The body does not make a dedupe key.
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Answer(#[from] serde_json::Error),
}

/// Ordering key of a source's transaction: its events are delivered in acceptance order.
pub fn ordering_key(source: &str, transaction_id: &str) -> String {
    crate::ordering::OrderingKey::Transaction {
        source,
        id: transaction_id,
    }
    .to_string()
}

/// The accept request of `callback`, accepted from `source` at `now`.
pub fn accept_request(
    source: &Settings,
    callback: Callback,
    now: Millis,
) -> Result<AcceptRequest, CallbackError> {
    let key = dedupe::derive(
        source.name,
        callback.json,
        callback.event.as_deref(),
        source.dedupe_fields,
    )?;
    let ordering_key = ordering_key(source.name, &key.transaction_id);
    // Derived from the claim key, so the Redis store keeps the claim as one integer and
    // rebuilds this answer from it (store/ids.rs).
    let id = MessageId::for_claim(now, &ordering_key, source.partitions, &key.key);
    let response = serde_json::to_string(&CallbackAccepted {
        message_id: id.to_string(),
    })?;
    let message = NewMessage {
        id,
        kind: MessageKind::Inbound,
        source: Some(source.name.into()),
        payment_id: None,
        transaction_id: Some(key.transaction_id.into()),
        ordering_key,
        event: callback.event,
        target_url: source.forward_url.map(str::to_string),
        headers: callback.headers,
        // Valid JSON is valid UTF-8, so nothing is replaced.
        body: String::from_utf8_lossy(callback.body).into_owned(),
        created_at: now,
        deadline: deadline(now, source.window),
    };
    Ok(AcceptRequest {
        dedupe: DedupeClaim {
            key: key.key,
            ttl_secs: source.dedupe_ttl.as_secs(),
            fingerprint: None,
            response,
        },
        seal: callback
            .verified
            .map(|v| seal(source.name, &v, now, source.dedupe_ttl)),
        message,
        payment: None,
    })
}

/// Makes a verified signature single-use for as long as it could verify again. A scheme with
/// a timestamp stops verifying after its tolerance; `hmac-sha256` never does, so its
/// signatures are remembered as long as dedupe claims.
fn seal(source: &str, verified: &Verified, now: Millis, dedupe_ttl: Duration) -> SignatureSeal {
    let expires_at = match verified.valid_until_secs {
        Some(secs) => secs.saturating_add(1).saturating_mul(1000).max(now + 1),
        None => deadline(now, dedupe_ttl),
    };
    let scoped = serde_json::json!([source, hex::encode(&verified.signature)]);
    SignatureSeal {
        key: short_hash(scoped.to_string().as_bytes()),
        expires_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbound::dedupe::DEFAULT_FIELDS;
    use serde_json::json;

    const NOW: Millis = 1_764_460_800_000;
    const DAY: Duration = Duration::from_secs(86_400);

    fn fields() -> Vec<String> {
        DEFAULT_FIELDS.iter().map(|f| f.to_string()).collect()
    }

    fn settings(fields: &[String]) -> Settings<'_> {
        Settings {
            name: "payzu",
            dedupe_fields: fields,
            forward_url: Some("https://merchant.example/cb"),
            window: 7 * DAY,
            dedupe_ttl: 30 * DAY,
            partitions: Partitions::new(128).expect("a valid count"),
        }
    }

    fn callback<'a>(body: &'a [u8], json: &'a Value) -> Callback<'a> {
        Callback {
            body,
            json,
            event: None,
            verified: None,
            headers: BTreeMap::new(),
        }
    }

    #[test]
    fn a_callback_becomes_its_claim_and_its_message() {
        let body = br#"{"id": "tx1", "status": "COMPLETED"}"#;
        let json: Value = serde_json::from_slice(body).unwrap();
        let fields = fields();
        let trace = BTreeMap::from([("traceparent".to_string(), "00-ab-cd-01".to_string())]);
        let request = accept_request(
            &settings(&fields),
            Callback {
                headers: trace.clone(),
                ..callback(body, &json)
            },
            NOW,
        )
        .unwrap();

        let m = &request.message;
        assert_eq!(m.kind, MessageKind::Inbound);
        assert_eq!(m.source.as_deref(), Some("payzu"));
        assert_eq!(m.transaction_id.as_deref(), Some("tx1"));
        assert_eq!(m.ordering_key, "src/payzu/tx1");
        assert_eq!(
            m.id.partition(),
            crate::store::ids::partition_of("src/payzu/tx1", settings(&fields).partitions),
            "the partition of its ordering key in the store's count"
        );
        assert_eq!(m.id.created_at(), NOW);
        assert_eq!(
            m.id,
            MessageId::of_claim(NOW, m.id.partition(), &request.dedupe.key),
            "rebuilt from the time, the partition and the claim key"
        );
        assert_eq!(m.target_url.as_deref(), Some("https://merchant.example/cb"));
        assert_eq!(m.body.as_bytes(), body, "delivered byte for byte");
        assert_eq!(m.headers, trace);
        assert_eq!((m.created_at, m.deadline), (NOW, NOW + 7 * 86_400_000));

        let key = dedupe::derive("payzu", &json, None, &fields).unwrap().key;
        assert_eq!(request.dedupe.key, key);
        assert_eq!(request.dedupe.ttl_secs, 30 * 86_400);
        assert_eq!(
            request.dedupe.fingerprint, None,
            "the key is the body's own"
        );
        assert_eq!(
            request.dedupe.response,
            format!(r#"{{"messageId":"{}"}}"#, m.id)
        );
        assert_eq!((request.payment, request.seal), (None, None));
    }

    #[test]
    fn the_event_header_keys_and_travels_with_the_message() {
        let body = br#"{"id": 42}"#;
        let json: Value = serde_json::from_slice(body).unwrap();
        let fields = fields();
        let event = Callback {
            event: Some("INFRACTION_CHANGED".into()),
            ..callback(body, &json)
        };
        let request = accept_request(&settings(&fields), event, NOW).unwrap();
        assert_eq!(request.message.event.as_deref(), Some("INFRACTION_CHANGED"));
        assert_eq!(request.message.ordering_key, "src/payzu/42");
        let key = dedupe::derive("payzu", &json, Some("INFRACTION_CHANGED"), &fields).unwrap();
        assert_eq!(request.dedupe.key, key.key);

        let no_status = accept_request(&settings(&fields), callback(body, &json), NOW);
        assert!(
            matches!(no_status, Err(CallbackError::Key(KeyError::MissingStatus))),
            "{no_status:?}"
        );
    }

    #[test]
    fn a_seal_lasts_while_its_signature_could_verify_again() {
        let body = br#"{"id": "tx1", "status": "COMPLETED"}"#;
        let json: Value = serde_json::from_slice(body).unwrap();
        let fields = fields();
        let sealed = |valid_until_secs| {
            let verified = Verified {
                signature: vec![1, 2, 3],
                valid_until_secs,
            };
            let signed = Callback {
                verified: Some(verified),
                ..callback(body, &json)
            };
            accept_request(&settings(&fields), signed, NOW)
                .unwrap()
                .seal
                .unwrap()
        };
        let timestamped = sealed(Some(NOW / 1000 + 300));
        assert_eq!(timestamped.expires_at, NOW + 301_000);
        assert_eq!(
            timestamped.key,
            short_hash(json!(["payzu", "010203"]).to_string().as_bytes())
        );
        // A timestamp already out of the window still seals past now.
        assert_eq!(sealed(Some(NOW / 1000 - 10)).expires_at, NOW + 1);
        assert_eq!(sealed(None).expires_at, NOW + 30 * 86_400_000);
    }

    #[test]
    fn a_source_without_forward_url_records_only() {
        let body = br#"{"id": "tx1", "status": "COMPLETED"}"#;
        let json: Value = serde_json::from_slice(body).unwrap();
        let fields = fields();
        let source = Settings {
            forward_url: None,
            ..settings(&fields)
        };
        let request = accept_request(&source, callback(body, &json), NOW).unwrap();
        assert_eq!(request.message.target_url, None);
    }
}
