//! The dedupe key property the `dedupe_key` fuzz target checks, shared with `cargo test`
//! (`tests/fuzz_corpus.rs` replays the kept corpus through it): key derivation never panics
//! on any JSON a provider sends, is deterministic, scoped per source, and status-sensitive.
//!
//! Input: an optional `X-Callback-Event` value, a NUL byte, then the JSON body.

use callbackd::inbound::dedupe::{DEFAULT_FIELDS, derive};

pub fn check(data: &[u8]) {
    let split = data.iter().position(|b| *b == 0).unwrap_or(data.len());
    let (event, body) = data.split_at(split);
    let event = std::str::from_utf8(event).ok().filter(|e| !e.is_empty());
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(body.get(1..).unwrap_or_default())
    else {
        return;
    };
    let Ok(key) = derive("fuzz", &json, event, &DEFAULT_FIELDS) else {
        return;
    };
    assert_eq!(derive("fuzz", &json, event, &DEFAULT_FIELDS).unwrap(), key);
    assert_eq!(key.key.len(), 22);
    // Another source never shares the key.
    assert_ne!(
        derive("fuzz2", &json, event, &DEFAULT_FIELDS).unwrap().key,
        key.key
    );
    // Changing the status (or event) changes the key.
    let mut changed = json.clone();
    if event.is_none()
        && let Some(obj) = changed.as_object_mut()
    {
        obj.insert(
            "status".into(),
            serde_json::Value::String("__FUZZ_OTHER__".into()),
        );
        if json["status"] != "__FUZZ_OTHER__" {
            assert_ne!(
                derive("fuzz", &changed, event, &DEFAULT_FIELDS)
                    .unwrap()
                    .key,
                key.key
            );
        }
    }
}
