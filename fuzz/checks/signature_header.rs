//! The signature property the `signature_header` fuzz target checks, shared with `cargo test`
//! (`tests/fuzz_corpus.rs` replays the kept corpus through it): header parsing and
//! verification never panic, whatever the provider (or an attacker) sends, and never accept a
//! body that was not signed.
//!
//! Input: the header value, a NUL byte, then the body.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use callbackd::webhook::{Verifier, parse_payzu_header, parse_standard_signatures, sign_payzu};

pub fn check(data: &[u8]) {
    let split = data.iter().position(|b| *b == 0).unwrap_or(data.len());
    let (header, body) = data.split_at(split);
    let header = String::from_utf8_lossy(header);
    let _ = parse_payzu_header(&header);
    let _ = parse_standard_signatures(&header);

    let now = 1_764_460_800;
    let payzu = Verifier::Payzu {
        secrets: vec![b"fuzz-secret".to_vec()],
        tolerance_secs: 300,
    };
    let standard = Verifier::StandardWebhooks {
        secrets: vec![b"fuzz-secret".to_vec()],
        tolerance_secs: 300,
    };
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(header.as_bytes()) {
        for name in [
            "x-callback-signature",
            "webhook-id",
            "webhook-timestamp",
            "webhook-signature",
        ] {
            headers.insert(HeaderName::from_static(name), value.clone());
        }
    }
    let _ = standard.verify(&headers, body, now);
    if payzu.verify(&headers, body, now).is_ok() {
        // Accepted: it can only be because the header holds the real signature of this body.
        let expected = sign_payzu(
            b"fuzz-secret",
            parse_payzu_header(&header).unwrap().timestamp,
            body,
        );
        let v1 = expected.split("v1=").nth(1).unwrap();
        assert!(
            header.contains(v1),
            "accepted a signature that is not the body's"
        );
    }
}
