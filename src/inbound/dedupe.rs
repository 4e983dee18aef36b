//! Dedupe keys of provider callbacks (ARCHITECTURE.md §1.1).
//!
//! The key is the source, the transaction `id`, then the `X-Callback-Event` header when the
//! request has one (registered webhooks) or else `/status` (transaction `callbackUrl`), then
//! every other configured field that is present. Never `id` alone (a REFUNDED after COMPLETED
//! would be dropped) and never `id + status` for events that keep the status (suspected fraud,
//! infraction changes). A key may be finer than the seed's, never coarser.
//!
//! The tuple is encoded as a JSON array of `[name, value]` pairs before hashing, so no two
//! different tuples can produce the same input (ids may contain `:`, a field may be absent).

use serde_json::Value;

use crate::digest::short_hash;

/// The default `dedupe_fields` (`/status` is replaced by the event header when present).
pub const DEFAULT_FIELDS: [&str; 5] = [
    "/status",
    "/infraction/id",
    "/infraction/status",
    "/refundStatus",
    "/refundAmount",
];

const STATUS: &str = "/status";
/// Longest accepted transaction id; provider ids are short, and the id is stored with every
/// message of the transaction.
pub const MAX_ID_LEN: usize = 256;
/// Largest integer id (2^53 - 1): beyond it JSON parsers (JavaScript's among them) round
/// numbers, so two ids could become one key and an event would be dropped. Larger ids must
/// be strings.
pub const MAX_SAFE_ID: i64 = (1 << 53) - 1;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("body must be a JSON object")]
    NotAnObject,
    #[error("body has no `id`")]
    MissingId,
    #[error(
        "`id` must be a string of 1 to {MAX_ID_LEN} characters or an integer within ±{MAX_SAFE_ID}"
    )]
    BadId,
    #[error("body has no `status` and the request has no X-Callback-Event header")]
    MissingStatus,
    #[error("`status` must be a string or a number")]
    BadStatus,
}

/// The derived key: the transaction id (for ordering) and the hashed, source-scoped key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupeKey {
    pub transaction_id: String,
    pub key: String,
}

/// An integer id within ±[`MAX_SAFE_ID`], written as `12` or `12.0` (the same number to
/// JSON). Fractions and larger numbers are refused: they may have been rounded already.
fn safe_integer(n: &serde_json::Number) -> Option<i64> {
    let value = match n.as_i64() {
        Some(i) => i,
        None => {
            let f = n.as_f64()?;
            if f.fract() != 0.0 || f.abs() > MAX_SAFE_ID as f64 {
                return None;
            }
            f as i64
        }
    };
    (value.abs() <= MAX_SAFE_ID).then_some(value)
}

/// Derives the dedupe key of a callback body. `fields` are JSON pointers (the configured
/// `dedupe_fields`, or [`DEFAULT_FIELDS`]).
pub fn derive<S: AsRef<str>>(
    source: &str,
    body: &Value,
    event: Option<&str>,
    fields: &[S],
) -> Result<DedupeKey, KeyError> {
    let object = body.as_object().ok_or(KeyError::NotAnObject)?;
    let transaction_id = match object.get("id") {
        None | Some(Value::Null) => return Err(KeyError::MissingId),
        // Characters, not bytes: what the OpenAPI document's `maxLength` counts.
        Some(Value::String(s)) if !s.is_empty() && s.chars().count() <= MAX_ID_LEN => s.clone(),
        Some(Value::Number(n)) => safe_integer(n).ok_or(KeyError::BadId)?.to_string(),
        Some(_) => return Err(KeyError::BadId),
    };
    let mut tuple: Vec<(String, Value)> = vec![
        ("source".into(), Value::String(source.into())),
        ("id".into(), Value::String(transaction_id.clone())),
    ];
    match event {
        Some(e) => tuple.push(("event".into(), Value::String(e.into()))),
        None => match body.pointer(STATUS) {
            None | Some(Value::Null) => return Err(KeyError::MissingStatus),
            Some(v @ (Value::String(_) | Value::Number(_))) => {
                tuple.push((STATUS.into(), v.clone()));
            }
            Some(_) => return Err(KeyError::BadStatus),
        },
    }
    for field in fields.iter().map(AsRef::as_ref).filter(|f| *f != STATUS) {
        if let Some(value) = body.pointer(field).filter(|v| !v.is_null()) {
            tuple.push((field.to_string(), value.clone()));
        }
    }
    let encoded = serde_json::to_vec(&tuple).expect("JSON values always serialize");
    Ok(DedupeKey {
        transaction_id,
        key: short_hash(&encoded),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(body: Value, event: Option<&str>) -> String {
        derive("payzu", &body, event, &DEFAULT_FIELDS).unwrap().key
    }

    #[test]
    fn status_changes_of_one_id_are_distinct() {
        let completed = key(json!({"id": "tx1", "status": "COMPLETED"}), None);
        let refunded = key(json!({"id": "tx1", "status": "REFUNDED"}), None);
        assert_ne!(completed, refunded);
        assert_eq!(
            completed,
            key(
                json!({"id": "tx1", "status": "COMPLETED", "amount": 1}),
                None
            )
        );
    }

    #[test]
    fn events_that_keep_the_status_are_distinct() {
        let events = [
            "TRANSACTION_SUSPECTED_FRAUD",
            "TRANSACTION_SUSPECTED_FRAUD_REVERSAL",
            "INFRACTION_CHANGED",
        ];
        let body = json!({"id": "tx1", "status": "COMPLETED"});
        let mut keys: Vec<String> = events.iter().map(|e| key(body.clone(), Some(e))).collect();
        keys.push(key(body.clone(), None));
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 4);
    }

    #[test]
    fn infractions_and_refunds_are_part_of_the_key() {
        let e = Some("INFRACTION_CHANGED");
        let open = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i1", "status": "OPEN"}}),
            e,
        );
        let closed = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i1", "status": "CLOSED"}}),
            e,
        );
        let open_again = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i1", "status": "OPEN"}}),
            e,
        );
        let other = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i2", "status": "OPEN"}}),
            e,
        );
        assert_ne!(open, closed);
        assert_eq!(open, open_again);
        assert_ne!(open, other);
        let no_event_open = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i1", "status": "OPEN"}}),
            None,
        );
        let no_event_closed = key(
            json!({"id": "tx1", "status": "COMPLETED", "infraction": {"id": "i1", "status": "CLOSED"}}),
            None,
        );
        assert_ne!(no_event_open, no_event_closed);
        let r10 = key(
            json!({"id": "tx1", "status": "COMPLETED", "refundStatus": "PARTIALLY_REFUNDED", "refundAmount": 10}),
            None,
        );
        let r25 = key(
            json!({"id": "tx1", "status": "COMPLETED", "refundStatus": "PARTIALLY_REFUNDED", "refundAmount": 25}),
            None,
        );
        assert_ne!(r10, r25);
    }

    #[test]
    fn tuples_never_collide() {
        assert_ne!(
            key(json!({"id": "a:b", "status": "c"}), None),
            key(json!({"id": "a", "status": "b:c"}), None)
        );
        assert_ne!(
            key(json!({"id": "a", "status": "s"}), Some("s")),
            key(json!({"id": "a", "status": "s"}), None)
        );
        assert_ne!(
            derive(
                "a",
                &json!({"id": "x", "status": "s"}),
                None,
                &DEFAULT_FIELDS
            )
            .unwrap()
            .key,
            derive(
                "b",
                &json!({"id": "x", "status": "s"}),
                None,
                &DEFAULT_FIELDS
            )
            .unwrap()
            .key
        );
        assert_ne!(
            key(json!({"id": "1", "status": "s"}), None),
            key(
                json!({"id": "1", "status": "s", "refundAmount": null, "refundStatus": "1"}),
                None
            )
        );
    }

    #[test]
    fn numeric_ids_work_and_bad_input_is_named() {
        let d = derive(
            "p",
            &json!({"id": 123456, "status": "REFUNDED"}),
            None,
            &DEFAULT_FIELDS,
        )
        .unwrap();
        assert_eq!(d.transaction_id, "123456");
        let err = |body: Value, event: Option<&str>| {
            derive("p", &body, event, &DEFAULT_FIELDS).unwrap_err()
        };
        assert_eq!(err(json!([1]), None), KeyError::NotAnObject);
        assert_eq!(err(json!({"status": "X"}), None), KeyError::MissingId);
        assert_eq!(
            err(json!({"id": null, "status": "X"}), None),
            KeyError::MissingId
        );
        assert_eq!(
            err(json!({"id": true, "status": "X"}), None),
            KeyError::BadId
        );
        assert_eq!(err(json!({"id": "", "status": "X"}), None), KeyError::BadId);
        for unsafe_id in [
            json!(1.5),
            json!(MAX_SAFE_ID + 1),
            json!(u64::MAX),
            json!(1e300),
        ] {
            assert_eq!(
                err(json!({"id": unsafe_id, "status": "X"}), None),
                KeyError::BadId,
                "{unsafe_id}"
            );
        }
        let whole = |id: Value| {
            derive(
                "p",
                &json!({"id": id, "status": "X"}),
                None,
                &DEFAULT_FIELDS,
            )
            .unwrap()
        };
        assert_eq!(
            whole(json!(12.0)),
            whole(json!(12)),
            "12.0 is the number 12"
        );
        assert_eq!(
            whole(json!(-MAX_SAFE_ID)).transaction_id,
            format!("-{MAX_SAFE_ID}")
        );
        assert_eq!(
            err(json!({"id": {"a": 1}, "status": "X"}), None),
            KeyError::BadId
        );
        assert_eq!(err(json!({"id": "t"}), None), KeyError::MissingStatus);
        assert_eq!(
            err(json!({"id": "t", "status": {}}), None),
            KeyError::BadStatus
        );
        assert!(derive("p", &json!({"id": "t"}), Some("E"), &DEFAULT_FIELDS).is_ok());
    }

    #[test]
    fn configured_fields_replace_the_default() {
        let fields = ["/status", "/data/version"];
        let k = |v: i64| {
            derive(
                "p",
                &json!({"id": "t", "status": "S", "data": {"version": v}}),
                None,
                &fields,
            )
            .unwrap()
            .key
        };
        assert_ne!(k(1), k(2));
        let no_refund = ["/status"];
        let r = |amount: i64| {
            derive(
                "p",
                &json!({"id": "t", "status": "S", "refundAmount": amount}),
                None,
                &no_refund,
            )
            .unwrap()
            .key
        };
        assert_eq!(r(1), r(2));
    }
}
