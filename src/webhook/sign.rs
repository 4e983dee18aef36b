//! Signing with the schemes [`super::verify`] checks: what callbackd sends is verifiable
//! with the same code that verifies what it receives (the vectors test holds both).

use base64::Engine;
use hmac::{KeyInit, Mac};

use super::{HmacSha256, WEBHOOK_ID, WEBHOOK_SIGNATURE, WEBHOOK_TIMESTAMP};

/// Decodes a Standard Webhooks secret (`whsec_` + base64). The prefix is optional, as in the
/// reference libraries. An empty key is refused: anyone could sign with it.
pub fn decode_whsec(secret: &str) -> Result<Vec<u8>, String> {
    let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("not a whsec_<base64> secret: {e}"))?;
    if key.is_empty() {
        return Err("is an empty key: anyone could sign".into());
    }
    Ok(key)
}

/// The Standard Webhooks signature of a message, `v1,<base64>`, for merchants who verify
/// callbackd.
pub fn sign_standard_webhook(secret: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(format!("{id}.{timestamp}.").as_bytes());
    mac.update(body);
    let sig = base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes());
    format!("v1,{sig}")
}

/// The three Standard Webhooks headers of a signed message, in the order they are set.
pub fn standard_webhook_headers(
    secret: &[u8],
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> [(&'static str, String); 3] {
    [
        (WEBHOOK_ID, id.to_string()),
        (WEBHOOK_TIMESTAMP, timestamp.to_string()),
        (
            WEBHOOK_SIGNATURE,
            sign_standard_webhook(secret, id, timestamp, body),
        ),
    ]
}

/// hex(HMAC-SHA256(secret, "<t>." + body)): PayZu's formula, used by tests and the bench.
pub fn sign_payzu(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(format!("{timestamp}.").as_bytes());
    mac.update(body);
    format!(
        "t={timestamp}, v1={}",
        hex::encode(mac.finalize().into_bytes())
    )
}

/// `sha256=` + hex(HMAC-SHA256(secret, body)): the `hmac-sha256` scheme, whose header name
/// each source configures.
pub fn sign_hmac_sha256(secret: &[u8], body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(body);
    format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::Verifier;
    use axum::http::{HeaderMap, HeaderName, HeaderValue};

    #[test]
    fn a_whsec_secret_decodes_with_or_without_its_prefix_and_never_to_an_empty_key() {
        assert_eq!(decode_whsec("whsec_AAEC"), Ok(vec![0, 1, 2]));
        assert_eq!(decode_whsec("AAEC"), Ok(vec![0, 1, 2]));
        assert!(decode_whsec("whsec_").is_err());
        assert!(decode_whsec("whsec_!!").is_err());
    }

    #[test]
    fn what_is_signed_verifies() {
        let (body, now) = (br#"{"id":"tx1"}"#, 1_764_460_800);
        let mut headers = HeaderMap::new();
        for (name, value) in standard_webhook_headers(b"secret", "msg_1", now, body) {
            headers.insert(name, HeaderValue::from_str(&value).unwrap());
        }
        let standard = Verifier::StandardWebhooks {
            secrets: vec![b"secret".to_vec()],
            tolerance_secs: 300,
        };
        assert_eq!(standard.verify(&headers, body, now), Ok(()));

        let header = HeaderName::from_static("x-signature");
        let mut headers = HeaderMap::new();
        headers.insert(
            header.clone(),
            HeaderValue::from_str(&sign_hmac_sha256(b"k", body)).unwrap(),
        );
        let hmac = Verifier::HmacSha256 {
            secrets: vec![b"k".to_vec()],
            header,
        };
        assert_eq!(hmac.verify(&headers, body, now), Ok(()));
    }
}
