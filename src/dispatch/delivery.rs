//! One HTTP delivery attempt and the classification of its outcome. Pure where it can be:
//! [`classify`] turns what came back into what the store should do.

use crate::clock::Millis;
use std::collections::BTreeMap;
use std::error::Error as _;
use std::time::{Duration, UNIX_EPOCH};

use axum::http::{HeaderMap, HeaderName, HeaderValue, header};

use super::schedule::{Backoff, Next, next_attempt};
use crate::ssrf::{REFUSED_ADDRESS, is_forbidden};
use crate::store::{Completion, KEPT_BODY_BYTES, Lease, ReceiverAnswer};
use crate::webhook::{ATTEMPT_HEADER, EVENT_HEADER, MESSAGE_ID_HEADER, standard_webhook_headers};

/// Bytes of a response body read before the connection is given back to the pool; the rest
/// is dropped with the connection. Receivers answer with small bodies; a huge one must not
/// cost memory.
const MAX_RESPONSE_BODY: usize = 64 * 1024;

/// What one attempt produced.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptResult {
    pub status: Option<u16>,
    /// Error class when there was no HTTP status: `timeout`, `connect`, `refused_address`,
    /// `request`.
    pub error: Option<String>,
    pub retry_after: Option<RetryAfter>,
    /// The receiver's answer (bounded), when there was one.
    pub response: Option<ReceiverAnswer>,
}

/// A target's `Retry-After`, as it came: a delay, or an instant. An instant is resolved when
/// the attempt is classified, against the dispatcher's clock (not the host's: on a virtual
/// clock, or a host whose clock is off, the two differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAfter {
    DelayMs(u64),
    At(Millis),
}

impl RetryAfter {
    /// The delay it asks for at `now`; an instant in the past asks for none.
    pub fn delay_ms(self, now: Millis) -> u64 {
        match self {
            RetryAfter::DelayMs(ms) => ms,
            RetryAfter::At(at) => u64::try_from(at.saturating_sub(now)).unwrap_or(0),
        }
    }
}

/// What the store should do after an attempt, and why (for metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Delivered,
    Gone,
    Retry(Millis),
    Expired,
}

impl Verdict {
    pub fn completion(self) -> Completion {
        match self {
            Verdict::Delivered => Completion::Delivered,
            Verdict::Retry(next_at) => Completion::Retry { next_at },
            Verdict::Gone | Verdict::Expired => Completion::Dead,
        }
    }
}

/// 2xx delivered; 410 dead at once; anything else retried until the deadline.
pub fn classify(
    result: &AttemptResult,
    backoff: Backoff,
    claimed: &Lease,
    now: Millis,
    jitter: f64,
) -> Verdict {
    match result.status {
        Some(s) if (200..300).contains(&s) => Verdict::Delivered,
        Some(410) => Verdict::Gone,
        _ => match next_attempt(
            backoff,
            claimed.backoff_step,
            now,
            claimed.deadline,
            jitter,
            result.retry_after.map(|r| r.delay_ms(now)),
        ) {
            Next::RetryAt(at) => Verdict::Retry(at),
            Next::GiveUp => Verdict::Expired,
        },
    }
}

/// The class of a failed attempt, for the failures metric: the status class when the receiver
/// answered, else the error class. Always one of a fixed set, so labels stay bounded.
pub fn failure_class(result: &AttemptResult) -> &'static str {
    match (result.status, result.error.as_deref()) {
        (Some(s), _) => match s / 100 {
            1 => "1xx",
            2 => "2xx",
            3 => "3xx",
            4 => "4xx",
            _ => "5xx",
        },
        (None, Some("timeout")) => "timeout",
        (None, Some("connect")) => "connect",
        (None, Some(REFUSED_ADDRESS)) => "refused_address",
        (None, Some("bad_url")) => "bad_url",
        (None, _) => "request",
    }
}

/// `Retry-After` as delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<RetryAfter> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(RetryAfter::DelayMs(secs.saturating_mul(1000)));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let since_epoch = at.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    Some(RetryAfter::At(
        i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX),
    ))
}

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
    let failure = |class: &str| AttemptResult {
        status: None,
        error: Some(class.to_string()),
        retry_after: None,
        response: None,
    };
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return failure("bad_url");
    };
    // Literal addresses never reach the resolver, so they are checked here.
    if !allow_private {
        let host = parsed.host_str().unwrap_or_default();
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        if bare.parse().map(is_forbidden).unwrap_or(false) {
            return failure(REFUSED_ADDRESS);
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

fn error_class(e: &reqwest::Error) -> &'static str {
    let mut source = e.source();
    while let Some(s) = source {
        if s.to_string().contains(REFUSED_ADDRESS) {
            return REFUSED_ADDRESS;
        }
        source = s.source();
    }
    if e.is_timeout() {
        "timeout"
    } else if e.is_connect() {
        "connect"
    } else {
        "request"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    const BACKOFF: Backoff = Backoff {
        initial_ms: 1000,
        max_ms: 3_600_000,
    };

    fn status(s: u16) -> AttemptResult {
        AttemptResult {
            status: Some(s),
            error: None,
            retry_after: None,
            response: None,
        }
    }

    #[test]
    fn classification() {
        let c = claimed(0, 100_000);
        assert_eq!(
            classify(&status(204), BACKOFF, &c, 0, 0.0),
            Verdict::Delivered
        );
        assert_eq!(classify(&status(410), BACKOFF, &c, 0, 0.0), Verdict::Gone);
        for s in [500, 503, 429, 404, 301, 400] {
            assert_eq!(
                classify(&status(s), BACKOFF, &c, 0, 0.0),
                Verdict::Retry(1000),
                "{s}"
            );
        }
        let timeout = AttemptResult {
            status: None,
            error: Some("timeout".into()),
            retry_after: None,
            response: None,
        };
        assert_eq!(
            classify(&timeout, BACKOFF, &claimed(3, 100_000), 0, 0.0),
            Verdict::Retry(8000)
        );
        let later = AttemptResult {
            status: Some(429),
            error: None,
            retry_after: Some(RetryAfter::DelayMs(30_000)),
            response: None,
        };
        assert_eq!(
            classify(&later, BACKOFF, &c, 5, 0.0),
            Verdict::Retry(30_005)
        );
        // A date is resolved against the `now` given (the dispatcher's clock), and one in the
        // past or `Retry-After: 0` keeps the scheduled delay instead of retrying at once.
        let date = AttemptResult {
            retry_after: Some(RetryAfter::At(50_000)),
            ..later.clone()
        };
        assert_eq!(
            classify(&date, BACKOFF, &c, 20_000, 0.0),
            Verdict::Retry(50_000)
        );
        for retry_after in [RetryAfter::At(1_000), RetryAfter::DelayMs(0)] {
            let soon = AttemptResult {
                retry_after: Some(retry_after),
                ..later.clone()
            };
            assert_eq!(
                classify(&soon, BACKOFF, &c, 20_000, 0.0),
                Verdict::Retry(21_000),
                "{retry_after:?}"
            );
        }
        assert_eq!(
            classify(&status(500), BACKOFF, &c, 100_000, 0.0),
            Verdict::Expired
        );
    }

    #[test]
    fn failure_classes() {
        assert_eq!(failure_class(&status(503)), "5xx");
        assert_eq!(failure_class(&status(410)), "4xx");
        assert_eq!(failure_class(&status(302)), "3xx");
        for class in ["timeout", "connect", REFUSED_ADDRESS, "bad_url", "request"] {
            let r = AttemptResult {
                status: None,
                error: Some(class.into()),
                retry_after: None,
                response: None,
            };
            assert_eq!(failure_class(&r), class);
        }
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(parse_retry_after("120"), Some(RetryAfter::DelayMs(120_000)));
        assert_eq!(parse_retry_after(" 0 "), Some(RetryAfter::DelayMs(0)));
        let at = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let date = httpdate::fmt_http_date(at);
        assert_eq!(
            parse_retry_after(&date),
            Some(RetryAfter::At(1_000_000_000))
        );
        assert_eq!(RetryAfter::At(1_000_000_000).delay_ms(999_910_000), 90_000);
        assert_eq!(RetryAfter::At(1_000_000_000).delay_ms(1_000_090_000), 0);
        assert_eq!(parse_retry_after("soon"), None);
        assert_eq!(parse_retry_after("-5"), None);
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
