//! One HTTP delivery attempt: its headers, the request, and the receiver's answer read into
//! an [`AttemptResult`]. What that result means for the message (delivered, retried when,
//! dead why) is the delivery policy's, `store/lifecycle/policy.rs`.

use std::collections::BTreeMap;
use std::error::Error as _;

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::ssrf::{REFUSED_ADDRESS, is_forbidden};
use crate::store::lifecycle::policy::{AttemptError, AttemptResult, parse_retry_after};
use crate::store::{KEPT_BODY_BYTES, Lease, ReceiverAnswer};
use crate::webhook::{ATTEMPT_HEADER, EVENT_HEADER, MESSAGE_ID_HEADER, standard_webhook_headers};

/// Bytes of a response body read before the connection is given back to the pool; the rest
/// is dropped with the connection. Receivers answer with small bodies; a huge one must not
/// cost memory.
const MAX_RESPONSE_BODY: usize = 64 * 1024;

/// Headers of one attempt: configured ones first, then ours, which win on a clash so the
/// receiver can always dedupe by message id.
pub fn build_headers(
    claimed: &Lease,
    static_headers: &BTreeMap<String, String>,
    signing_secret: Option<&[u8]>,
    now_secs: i64,
) -> HeaderMap {
    let msg = &claimed.message;
    let mut headers = HeaderMap::new();
    for (name, value) in static_headers.iter().chain(msg.headers.iter()) {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.insert(n, v);
        }
    }
    // Each attempt is a new span of the trace the message arrived with.
    crate::trace::new_span(&mut headers);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(id) = HeaderValue::from_str(msg.id.as_str()) {
        headers.insert(MESSAGE_ID_HEADER, id);
    }
    headers.insert(ATTEMPT_HEADER, HeaderValue::from(claimed.attempts + 1));
    if let Some(event) = msg
        .event
        .as_deref()
        .and_then(|e| HeaderValue::from_str(e).ok())
    {
        headers.insert(EVENT_HEADER, event);
    }
    if let Some(secret) = signing_secret {
        let signed =
            standard_webhook_headers(secret, msg.id.as_str(), now_secs, msg.body.as_bytes());
        for (name, value) in signed {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        }
    }
    headers
}

/// Sends one attempt. The URL is passed to the client exactly as stored: the gateway signs it
/// (`X-VTEX-signature`), so not one byte of it may change.
pub async fn send(
    client: &reqwest::Client,
    url: &str,
    headers: HeaderMap,
    body: String,
    allow_private: bool,
) -> AttemptResult {
    let failure = |error: AttemptError| AttemptResult {
        status: None,
        error: Some(error),
        retry_after: None,
        response: None,
    };
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return failure(AttemptError::BadUrl);
    };
    // Literal addresses never reach the resolver, so they are checked here.
    if !allow_private {
        let host = parsed.host_str().unwrap_or_default();
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if bare.parse().map(is_forbidden).unwrap_or(false) {
            return failure(AttemptError::RefusedAddress);
        }
    }
    let response = client.post(parsed).headers(headers).body(body).send().await;
    match response {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            let header_text = |name| {
                resp.headers()
                    .get(name)
                    .and_then(|v: &HeaderValue| v.to_str().ok())
                    .map(str::to_string)
            };
            let retry_after_text = header_text(header::RETRY_AFTER);
            let content_type = header_text(header::CONTENT_TYPE);
            let retry_after = retry_after_text.as_deref().and_then(parse_retry_after);
            // The start is kept for the operator; the rest is read (up to a bound) so the
            // connection can go back to the pool, and dropped.
            let mut kept = Vec::new();
            let mut read = 0;
            while let Ok(Some(chunk)) = resp.chunk().await {
                if kept.len() <= KEPT_BODY_BYTES {
                    let room = KEPT_BODY_BYTES + 1 - kept.len();
                    kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
                read += chunk.len();
                if read > MAX_RESPONSE_BODY {
                    break;
                }
            }
            AttemptResult {
                status: Some(status),
                error: None,
                retry_after,
                response: Some(ReceiverAnswer::new(
                    content_type.as_deref(),
                    retry_after_text.as_deref(),
                    &kept,
                    false,
                )),
            }
        }
        Err(e) => failure(error_class(&e)),
    }
}

/// Why a request got no answer. The SSRF guard's resolver refuses a name with an error that
/// names [`REFUSED_ADDRESS`], somewhere down the chain: it is looked for first.
fn error_class(e: &reqwest::Error) -> AttemptError {
    let mut source = e.source();
    while let Some(s) = source {
        if s.to_string().contains(REFUSED_ADDRESS) {
            return AttemptError::RefusedAddress;
        }
        source = s.source();
    }
    if e.is_timeout() {
        AttemptError::Timeout
    } else if e.is_connect() {
        AttemptError::Connect
    } else {
        AttemptError::Request
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Millis;
    use crate::store::{MessageId, MessageKind, NewMessage, Partitions};

    fn claimed(backoff_step: u32, deadline: Millis) -> Lease {
        Lease {
            message: NewMessage {
                id: MessageId::generate(0, "k", Partitions::DEFAULT),
                kind: MessageKind::Notification,
                source: None,
                payment_id: Some("p".into()),
                transaction_id: None,
                ordering_key: "k".into(),
                event: Some("PIX_RECEIVED".into()),
                target_url: Some("http://example.com/cb".into()),
                headers: BTreeMap::from([("X-VTEX-API-AppKey".into(), "key".into())]),
                body: "{}".into(),
                created_at: 0,
                deadline,
            },
            token: 1,
            attempts: 2,
            backoff_step,
            deadline,
            resume_at: None,
            again: false,
        }
    }

    #[test]
    fn kept_answer_is_bounded_on_a_character_boundary() {
        // 2047 ASCII bytes then a 2-byte character that the cut splits.
        let mut body = vec![b'a'; KEPT_BODY_BYTES - 1];
        body.extend_from_slice("é and more".as_bytes());
        let answer = ReceiverAnswer::new(Some("text/plain"), Some("30"), &body, false);
        assert_eq!(answer.body.len(), KEPT_BODY_BYTES - 1);
        assert!(answer.body_truncated);
        assert_eq!(answer.retry_after.as_deref(), Some("30"));
        let short = ReceiverAnswer::new(None, None, "{\"ok\":false}".as_bytes(), false);
        assert_eq!(short.body, "{\"ok\":false}");
        assert!(!short.body_truncated);
    }

    #[test]
    fn headers_carry_id_attempt_event_and_signature() {
        let c = claimed(0, 1);
        let h = build_headers(&c, &BTreeMap::new(), Some(b"secret"), 1_700_000_000);
        assert_eq!(h[MESSAGE_ID_HEADER], c.message.id.as_str());
        assert_eq!(h[ATTEMPT_HEADER], "3");
        assert_eq!(h[EVENT_HEADER], "PIX_RECEIVED");
        assert_eq!(h["x-vtex-api-appkey"], "key");
        assert_eq!(h["webhook-id"], c.message.id.as_str());
        assert!(h["webhook-signature"].to_str().unwrap().starts_with("v1,"));
    }
}
