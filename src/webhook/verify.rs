//! Verifying the signature schemes a source may use. Verification runs before anything is
//! claimed, so a forged request can never burn the dedupe key of a real event. `now` is an
//! argument: the vectors in `tests/vectors/signatures.json` were signed years ago and must
//! still verify in tests.

use axum::http::{HeaderMap, HeaderName};
use base64::Engine;
use hmac::{KeyInit, Mac};

use super::{HmacSha256, PAYZU_HEADER, WEBHOOK_ID, WEBHOOK_SIGNATURE, WEBHOOK_TIMESTAMP};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("missing signature header {0}")]
    Missing(String),
    #[error("malformed signature header {header}: {reason}")]
    Malformed { header: String, reason: String },
    #[error("signature timestamp is {0} s away from now, outside the tolerance")]
    OutsideTolerance(i64),
    #[error("no signature matches the body with any configured secret")]
    Mismatch,
}

/// A source's configured verification, with secrets decoded once at start-up.
#[derive(Clone)]
pub enum Verifier {
    None,
    Payzu {
        secrets: Vec<Vec<u8>>,
        tolerance_secs: i64,
    },
    StandardWebhooks {
        secrets: Vec<Vec<u8>>,
        tolerance_secs: i64,
    },
    HmacSha256 {
        secrets: Vec<Vec<u8>>,
        header: HeaderName,
    },
}

impl std::fmt::Debug for Verifier {
    /// Secrets never reach a log line, even through a `{:?}`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Verifier::None => "none",
            Verifier::Payzu { .. } => "payzu",
            Verifier::StandardWebhooks { .. } => "standard-webhooks",
            Verifier::HmacSha256 { .. } => "hmac-sha256",
        };
        write!(f, "Verifier({name})")
    }
}

impl Verifier {
    /// Whether the request is signed correctly.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: i64,
    ) -> Result<(), SignatureError> {
        self.verify_signature(headers, body, now_secs).map(|_| ())
    }

    /// Verifies the request and returns the signature that matched, with how long it could
    /// be accepted again (`None` for `none`, which has no signature).
    pub fn verify_signature(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now_secs: i64,
    ) -> Result<Option<Verified>, SignatureError> {
        match self {
            Verifier::None => Ok(None),
            Verifier::Payzu {
                secrets,
                tolerance_secs,
            } => {
                let header = header_str(headers, PAYZU_HEADER)?;
                let parsed = parse_payzu_header(header)?;
                check_tolerance(parsed.timestamp, now_secs, *tolerance_secs)?;
                let prefix = format!("{}.", parsed.timestamp);
                let signatures = parsed
                    .signatures
                    .iter()
                    .filter_map(|hex_sig| hex::decode(hex_sig).ok())
                    .collect::<Vec<_>>();
                let signature = any_matches(secrets, &signatures, &[prefix.as_bytes(), body])?;
                Ok(Some(Verified {
                    signature,
                    valid_until_secs: Some(parsed.timestamp.saturating_add(*tolerance_secs)),
                }))
            }
            Verifier::StandardWebhooks {
                secrets,
                tolerance_secs,
            } => {
                // The id is signed as raw bytes: it may be UTF-8 (see tests/vectors).
                let id = single_header(headers, WEBHOOK_ID)?.as_bytes();
                let ts_raw = header_str(headers, WEBHOOK_TIMESTAMP)?;
                let timestamp: i64 =
                    ts_raw
                        .trim()
                        .parse()
                        .map_err(|_| SignatureError::Malformed {
                            header: WEBHOOK_TIMESTAMP.into(),
                            reason: "not an integer".into(),
                        })?;
                check_tolerance(timestamp, now_secs, *tolerance_secs)?;
                let signatures =
                    parse_standard_signatures(header_str(headers, WEBHOOK_SIGNATURE)?)?;
                let suffix = format!(".{timestamp}.");
                let signature = any_matches(secrets, &signatures, &[id, suffix.as_bytes(), body])?;
                Ok(Some(Verified {
                    signature,
                    valid_until_secs: Some(timestamp.saturating_add(*tolerance_secs)),
                }))
            }
            Verifier::HmacSha256 { secrets, header } => {
                let value = header_str(headers, header.as_str())?.trim();
                let hex_sig = value.strip_prefix("sha256=").unwrap_or(value);
                let signature = hex::decode(hex_sig).map_err(|_| SignatureError::Malformed {
                    header: header.to_string(),
                    reason: "not hex".into(),
                })?;
                let signature = any_matches(secrets, &[signature], &[body])?;
                Ok(Some(Verified {
                    signature,
                    valid_until_secs: None,
                }))
            }
        }
    }
}

/// A signature that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The signature bytes that matched: an HMAC, so equal only for the same signed content.
    pub signature: Vec<u8>,
    /// The last second its timestamp is inside the tolerance; `None` for a scheme without a
    /// timestamp (`hmac-sha256`), whose signature never stops verifying.
    pub valid_until_secs: Option<i64>,
}

/// The single value of a signature header. A header sent twice is refused: which copy a
/// proxy or framework would pick differs, and an attacker could rely on that difference.
fn single_header<'a>(
    headers: &'a HeaderMap,
    name: &str,
) -> Result<&'a axum::http::HeaderValue, SignatureError> {
    let mut values = headers.get_all(name).iter();
    let value = values
        .next()
        .ok_or_else(|| SignatureError::Missing(name.to_string()))?;
    if values.next().is_some() {
        return Err(SignatureError::Malformed {
            header: name.to_string(),
            reason: "sent more than once".into(),
        });
    }
    Ok(value)
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, SignatureError> {
    let value = single_header(headers, name)?;
    value.to_str().map_err(|_| SignatureError::Malformed {
        header: name.to_string(),
        reason: "not visible ASCII".into(),
    })
}

fn check_tolerance(timestamp: i64, now_secs: i64, tolerance: i64) -> Result<(), SignatureError> {
    let skew = now_secs.saturating_sub(timestamp);
    if skew.saturating_abs() > tolerance {
        return Err(SignatureError::OutsideTolerance(skew));
    }
    Ok(())
}

/// The first of `signatures` that some secret signs `parts` to. `verify_slice` compares in
/// constant time; every secret is tried so rotation works in both directions.
fn any_matches(
    secrets: &[Vec<u8>],
    signatures: &[Vec<u8>],
    parts: &[&[u8]],
) -> Result<Vec<u8>, SignatureError> {
    for secret in secrets {
        let Ok(mut mac) = HmacSha256::new_from_slice(secret) else {
            continue;
        };
        for part in parts {
            mac.update(part);
        }
        for signature in signatures {
            if mac.clone().verify_slice(signature).is_ok() {
                return Ok(signature.clone());
            }
        }
    }
    Err(SignatureError::Mismatch)
}

#[derive(Debug, PartialEq)]
pub struct PayzuHeader {
    pub timestamp: i64,
    pub signatures: Vec<String>,
}

/// Parses `t=<unix>, v1=<hex>` (the space after the comma is optional; several `v1` may come
/// during the provider's own key rotation; unknown schemes are ignored).
pub fn parse_payzu_header(value: &str) -> Result<PayzuHeader, SignatureError> {
    let malformed = |reason: &str| SignatureError::Malformed {
        header: PAYZU_HEADER.into(),
        reason: reason.into(),
    };
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in value.split(',') {
        let (name, val) = part
            .trim()
            .split_once('=')
            .ok_or_else(|| malformed("expected comma-separated name=value pairs"))?;
        match name.trim() {
            "t" => {
                if timestamp.is_some() {
                    return Err(malformed("t appears twice"));
                }
                timestamp = Some(
                    val.trim()
                        .parse::<i64>()
                        .map_err(|_| malformed("t is not a unix timestamp"))?,
                );
            }
            "v1" => signatures.push(val.trim().to_string()),
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or_else(|| malformed("no t="))?;
    if signatures.is_empty() {
        return Err(malformed("no v1="));
    }
    Ok(PayzuHeader {
        timestamp,
        signatures,
    })
}

/// Parses `v1,<base64> v1,<base64>`; other versions are skipped, as the spec asks.
pub fn parse_standard_signatures(value: &str) -> Result<Vec<Vec<u8>>, SignatureError> {
    let signatures: Vec<Vec<u8>> = value
        .split_whitespace()
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
        .collect();
    if signatures.is_empty() {
        return Err(SignatureError::Malformed {
            header: WEBHOOK_SIGNATURE.into(),
            reason: "no v1,<base64> signature".into(),
        });
    }
    Ok(signatures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::{decode_whsec, sign_payzu, sign_standard_webhook};
    use axum::http::HeaderValue;

    const NOW: i64 = 1_764_460_800;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn payzu(secrets: &[&str]) -> Verifier {
        Verifier::Payzu {
            secrets: secrets.iter().map(|s| s.as_bytes().to_vec()).collect(),
            tolerance_secs: 300,
        }
    }

    #[test]
    fn payzu_accepts_valid_with_and_without_space_and_rotated_secret() {
        let body = br#"{"id":"tx1","status":"COMPLETED"}"#;
        let sig = sign_payzu(b"new", NOW, body);
        let v = payzu(&["old", "new"]);
        assert_eq!(
            v.verify(&headers(&[(PAYZU_HEADER, &sig)]), body, NOW),
            Ok(())
        );
        let no_space = sig.replace(", ", ",");
        assert_eq!(
            v.verify(&headers(&[(PAYZU_HEADER, &no_space)]), body, NOW),
            Ok(())
        );
    }

    #[test]
    fn payzu_rejects_every_bad_case() {
        let body = br#"{"id":"tx1","status":"COMPLETED"}"#;
        let good = sign_payzu(b"s1", NOW, body);
        let v = payzu(&["s1"]);
        let check = |h: &HeaderMap, b: &[u8], now: i64| v.verify(h, b, now);
        assert_eq!(
            check(
                &headers(&[(PAYZU_HEADER, &sign_payzu(b"wrong", NOW, body))]),
                body,
                NOW
            ),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            check(
                &headers(&[(PAYZU_HEADER, &good)]),
                br#"{"id":"tx1","status":"REFUNDED"}"#,
                NOW
            ),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            check(&headers(&[(PAYZU_HEADER, &good)]), body, NOW + 301),
            Err(SignatureError::OutsideTolerance(301))
        );
        assert_eq!(
            check(&headers(&[(PAYZU_HEADER, &good)]), body, NOW - 301),
            Err(SignatureError::OutsideTolerance(-301))
        );
        assert_eq!(
            check(&headers(&[]), body, NOW),
            Err(SignatureError::Missing(PAYZU_HEADER.into()))
        );
        for malformed in [
            "",
            "v1=abc",
            "t=abc, v1=00",
            "t=1",
            "garbage",
            "t=1,t=2,v1=00",
        ] {
            assert!(
                matches!(
                    check(&headers(&[(PAYZU_HEADER, malformed)]), body, NOW),
                    Err(SignatureError::Malformed { .. })
                ),
                "{malformed:?}"
            );
        }
        let not_hex = format!("t={NOW}, v1=zz");
        assert_eq!(
            check(&headers(&[(PAYZU_HEADER, &not_hex)]), body, NOW),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn standard_webhooks_rules() {
        let secret = b"0123456789abcdef".to_vec();
        let body = br#"{"id":"tx1"}"#;
        let v = Verifier::StandardWebhooks {
            secrets: vec![b"other".to_vec(), secret.clone()],
            tolerance_secs: 300,
        };
        let sig = sign_standard_webhook(&secret, "msg_1", NOW, body);
        let ts = NOW.to_string();
        let both = format!("v1,AAAA {sig}");
        let ok = headers(&[
            (WEBHOOK_ID, "msg_1"),
            (WEBHOOK_TIMESTAMP, &ts),
            (WEBHOOK_SIGNATURE, &both),
        ]);
        assert_eq!(v.verify(&ok, body, NOW), Ok(()));
        assert_eq!(v.verify(&ok, b"{}", NOW), Err(SignatureError::Mismatch));
        assert!(matches!(
            v.verify(&ok, body, NOW + 1000),
            Err(SignatureError::OutsideTolerance(_))
        ));
        assert!(matches!(
            v.verify(&ok, body, NOW - 1000),
            Err(SignatureError::OutsideTolerance(_))
        ));
        let other_id = headers(&[
            (WEBHOOK_ID, "msg_2"),
            (WEBHOOK_TIMESTAMP, &ts),
            (WEBHOOK_SIGNATURE, &sig),
        ]);
        assert_eq!(
            v.verify(&other_id, body, NOW),
            Err(SignatureError::Mismatch)
        );
        let missing = headers(&[(WEBHOOK_ID, "msg_1"), (WEBHOOK_TIMESTAMP, &ts)]);
        assert_eq!(
            v.verify(&missing, body, NOW),
            Err(SignatureError::Missing(WEBHOOK_SIGNATURE.into()))
        );
        let v2 = headers(&[
            (WEBHOOK_ID, "msg_1"),
            (WEBHOOK_TIMESTAMP, &ts),
            (WEBHOOK_SIGNATURE, "v2,abc"),
        ]);
        assert!(matches!(
            v.verify(&v2, body, NOW),
            Err(SignatureError::Malformed { .. })
        ));
        let bad_ts = headers(&[
            (WEBHOOK_ID, "msg_1"),
            (WEBHOOK_TIMESTAMP, "soon"),
            (WEBHOOK_SIGNATURE, &sig),
        ]);
        assert!(matches!(
            v.verify(&bad_ts, body, NOW),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn a_signature_header_sent_twice_is_refused() {
        let body = b"{}";
        let good = sign_payzu(b"s1", NOW, body);
        let mut h = headers(&[(PAYZU_HEADER, &good)]);
        h.append(PAYZU_HEADER, HeaderValue::from_static("t=1, v1=00"));
        assert!(matches!(
            payzu(&["s1"]).verify(&h, body, NOW),
            Err(SignatureError::Malformed { .. })
        ));
    }

    #[test]
    fn hmac_sha256_with_and_without_prefix() {
        let body = b"{\"id\":1}";
        let mut mac = HmacSha256::new_from_slice(b"k").unwrap();
        mac.update(body);
        let hex_sig = hex::encode(mac.finalize().into_bytes());
        let v = Verifier::HmacSha256 {
            secrets: vec![b"k".to_vec()],
            header: HeaderName::from_static("x-signature"),
        };
        assert_eq!(
            v.verify(&headers(&[("x-signature", &hex_sig)]), body, NOW),
            Ok(())
        );
        let prefixed = format!("sha256={hex_sig}");
        assert_eq!(
            v.verify(&headers(&[("x-signature", &prefixed)]), body, NOW),
            Ok(())
        );
        assert_eq!(
            v.verify(&headers(&[("x-signature", &prefixed)]), b"{}", NOW),
            Err(SignatureError::Mismatch)
        );
        assert!(matches!(
            v.verify(&headers(&[("x-signature", "xyz")]), body, NOW),
            Err(SignatureError::Malformed { .. })
        ));
        assert!(matches!(
            v.verify(&headers(&[]), body, NOW),
            Err(SignatureError::Missing(_))
        ));
    }

    #[test]
    fn independent_vectors_verify() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/signatures.json");
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("the shared vectors are needed at {path}: {e}"));
        let vectors: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut checked = 0;
        for case in vectors["standard_webhooks"].as_array().unwrap() {
            let secret = decode_whsec(case["secret"].as_str().unwrap()).unwrap();
            let ts = case["webhook-timestamp"].as_str().unwrap();
            let now: i64 = ts.parse().unwrap();
            let v = Verifier::StandardWebhooks {
                secrets: vec![secret.clone()],
                tolerance_secs: 300,
            };
            let h = headers(&[
                (WEBHOOK_ID, case["webhook-id"].as_str().unwrap()),
                (WEBHOOK_TIMESTAMP, ts),
                (
                    WEBHOOK_SIGNATURE,
                    case["webhook-signature"].as_str().unwrap(),
                ),
            ]);
            let body = case["body"].as_str().unwrap().as_bytes();
            assert_eq!(v.verify(&h, body, now + 299), Ok(()), "{case}");
            assert!(v.verify(&h, body, now + 301).is_err());
            let id = case["webhook-id"].as_str().unwrap();
            assert_eq!(
                sign_standard_webhook(&secret, id, now, body),
                case["webhook-signature"].as_str().unwrap()
            );
            checked += 1;
        }
        for case in vectors["payzu"].as_array().unwrap() {
            let secret = case["secret"].as_str().unwrap();
            let now = case["t"].as_i64().unwrap();
            let body = case["body"].as_str().unwrap().as_bytes();
            let header = case["X-Callback-Signature"].as_str().unwrap();
            assert_eq!(
                payzu(&[secret]).verify(&headers(&[(PAYZU_HEADER, header)]), body, now - 5),
                Ok(()),
                "{case}"
            );
            assert_eq!(sign_payzu(secret.as_bytes(), now, body), header);
            checked += 1;
        }
        assert_eq!(checked, 6);
    }
}
