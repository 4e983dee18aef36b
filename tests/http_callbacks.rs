//! Provider callbacks over HTTP against a private Redis (issue: the inbound receiver).

mod support;

use std::time::Duration;

use callbackd::webhook::sign_payzu;
use support::redis::RedisServer;
use support::{TestServer, config};

const BODY: &str =
    r#"{"id":"tx:1","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":99.9}"#;

fn message_keys(redis: &RedisServer) -> usize {
    let keys = redis.cli(&["--scan", "--pattern", "cb:*:m:*"]);
    keys.lines().filter(|l| !l.is_empty()).count()
}

#[tokio::test]
async fn first_arrival_then_byte_identical_replay() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let first = server.post_callback("payzu", BODY, None).await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.bytes().await.unwrap();
    let parsed: serde_json::Value = serde_json::from_slice(&first_body).unwrap();
    assert!(parsed["messageId"].as_str().unwrap().starts_with("msg_"));

    let again = server.post_callback("payzu", BODY, None).await;
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first_body);

    // A status change of the same transaction is a new event.
    let refunded = BODY.replace("COMPLETED", "REFUNDED");
    let r = server.post_callback("payzu", &refunded, None).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("idempotent-replayed").is_none());
    assert_eq!(message_keys(&redis), 2);
}

fn dedupe_keys(redis: &RedisServer) -> usize {
    let keys = redis.cli(&["--scan", "--pattern", "cb:*:d:*"]);
    keys.lines().filter(|l| !l.is_empty()).count()
}

/// PayZu signs `t.body`, not `X-Callback-Event`: a captured request re-posted within its
/// tolerance with another event header (or none) must not become a new event, nor swallow
/// the provider's real second event (issue 22, item 9): it is a 409 `signature_reused` that
/// records nothing, a repeat with the same event is still a replay, and the provider's
/// retry, signed again, is accepted.
#[tokio::test]
async fn a_signature_re_posted_with_another_event_is_refused_and_records_nothing() {
    let redis = RedisServer::start();
    let clock = support::manual_clock();
    let server = TestServer::start_with_clock(config(&redis.url(), None), clock.clone()).await;
    let captured = sign_payzu(
        support::PAYZU_SECRET.as_bytes(),
        server.app.clock.now_secs(),
        BODY.as_bytes(),
    );
    let first = server
        .post_signed("payzu", BODY, &captured, Some("TRANSACTION_PAID"))
        .await;
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first_body = first.bytes().await.unwrap();
    assert_eq!((message_keys(&redis), dedupe_keys(&redis)), (1, 1));

    let again = server
        .post_signed("payzu", BODY, &captured, Some("TRANSACTION_PAID"))
        .await;
    assert_eq!(again.status(), 200, "the same event is a replay");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first_body);

    for event in [
        Some("TRANSACTION_REFUNDED"),
        Some("INFRACTION_CHANGED"),
        None,
    ] {
        let reused = server.post_signed("payzu", BODY, &captured, event).await;
        assert_eq!(reused.status(), 409, "{event:?}");
        assert!(reused.headers().get("idempotent-replayed").is_none());
        let error: serde_json::Value = reused.json().await.unwrap();
        assert_eq!(error["error"], "signature_reused", "{event:?}: {error}");
    }
    assert_eq!(
        (message_keys(&redis), dedupe_keys(&redis)),
        (1, 1),
        "no event recorded, no dedupe key claimed"
    );
    let metrics = server
        .client
        .get(format!("{}/metrics", server.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("callbackd_callbacks_total")
                && l.contains(r#"outcome="signature_reused""#)),
        "{metrics}"
    );

    // The provider retries its refund a second later, signed again: a new event.
    clock.advance(1_000);
    let resigned = sign_payzu(
        support::PAYZU_SECRET.as_bytes(),
        server.app.clock.now_secs(),
        BODY.as_bytes(),
    );
    assert_ne!(resigned, captured);
    let refund = server
        .post_signed("payzu", BODY, &resigned, Some("TRANSACTION_REFUNDED"))
        .await;
    assert_eq!(refund.status(), 200);
    assert!(refund.headers().get("idempotent-replayed").is_none());
    assert_ne!(refund.bytes().await.unwrap(), first_body);
    assert_eq!(message_keys(&redis), 2);
    // And the captured request still gets nothing new.
    let reused = server
        .post_signed("payzu", BODY, &captured, Some("TRANSACTION_REFUNDED"))
        .await;
    assert_eq!(reused.status(), 409);
    assert_eq!(message_keys(&redis), 2);
}

#[tokio::test]
async fn two_hundred_concurrent_duplicates_make_one_record() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let futures = (0..200).map(|_| server.post_callback("payzu", BODY, Some("TRANSACTION_PAID")));
    let responses = futures::future::join_all(futures).await;
    let mut first = 0;
    let mut replays = 0;
    let mut bodies = std::collections::HashSet::new();
    for r in responses {
        assert_eq!(r.status(), 200);
        if r.headers().get("idempotent-replayed").is_some() {
            replays += 1;
        } else {
            first += 1;
        }
        bodies.insert(r.bytes().await.unwrap());
    }
    assert_eq!((first, replays), (1, 199));
    assert_eq!(bodies.len(), 1, "every answer is byte-identical");
    assert_eq!(message_keys(&redis), 1);
}

#[tokio::test]
async fn claim_survives_a_redis_kill_and_has_a_30_day_ttl() {
    let mut redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let first = server.post_callback("payzu", BODY, None).await;
    assert_eq!(first.status(), 200);
    let first_body = first.text().await.unwrap();

    let dedupe_keys = redis.cli(&["--scan", "--pattern", "cb:*:d:*"]);
    let key = dedupe_keys
        .lines()
        .next()
        .expect("one dedupe key")
        .to_string();
    let ttl: i64 = redis.cli(&["ttl", &key]).parse().unwrap();
    assert!((2_591_990..=2_592_000).contains(&ttl), "ttl {ttl}");
    // A callback's claim is one integer (src/store/redis/keys.rs).
    assert_eq!(redis.cli(&["object", "encoding", &key]), "int");

    // SIGKILL, not a clean shutdown: only what the AOF had fsynced survives.
    redis.stop(true);
    redis.start_again();
    let again = support::eventually(10, "redis back", || async {
        let r = server.post_callback("payzu", BODY, None).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first_body);
    assert_eq!(
        redis.cli(&["object", "encoding", &key]),
        "int",
        "and stays one after the AOF is replayed"
    );
}

#[tokio::test]
async fn redis_down_means_503_and_nothing_burned() {
    let mut redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    redis.stop(true);

    let down = server.post_callback("payzu", BODY, None).await;
    assert_eq!(down.status(), 503);
    assert_eq!(down.headers()["retry-after"], "1");
    let err: serde_json::Value = down.json().await.unwrap();
    assert_eq!(err["error"], "store_unavailable");
    let ready = server
        .client
        .get(format!("{}/readyz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let healthy = server
        .client
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(healthy.status(), 200);

    redis.start_again();
    let accepted = support::eventually(10, "redis back", || async {
        let r = server.post_callback("payzu", BODY, None).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert!(
        accepted.headers().get("idempotent-replayed").is_none(),
        "the refused attempt burned no key: this is a first arrival"
    );
    let ready = server
        .client
        .get(format!("{}/readyz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
}

/// A Redis that hangs rather than refuses: the script reaches Redis, the request times out
/// (`store.timeout_ms`) and gets 503, and Redis runs the script once it goes on. The write
/// lands after the 503, so the provider's retry is answered as a replay: recorded once, not
/// lost, not doubled.
#[tokio::test]
async fn a_paused_redis_answers_503_and_the_retry_replays_the_late_write() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    // A first accept loads the script into Redis, as on any server that has taken traffic.
    let warm = BODY.replace("tx:1", "tx:warm");
    assert_eq!(
        server.post_callback("payzu", &warm, None).await.status(),
        200
    );
    assert_eq!(message_keys(&redis), 1);

    redis.pause();
    let down = server.post_callback("payzu", BODY, None).await;
    assert_eq!(down.status(), 503);
    assert_eq!(down.headers()["retry-after"], "1");
    assert_eq!(
        down.json::<serde_json::Value>().await.unwrap()["error"],
        "store_unavailable"
    );
    redis.resume();
    support::eventually(10, "the write sent before the 503 lands", || async {
        (message_keys(&redis) == 2).then_some(())
    })
    .await;

    let again = server.post_callback("payzu", BODY, None).await;
    assert_eq!(again.status(), 200);
    assert_eq!(
        again.headers()["idempotent-replayed"],
        "true",
        "the retry finds the late write"
    );
    assert_eq!(message_keys(&redis), 2, "recorded once");
}

#[tokio::test]
async fn forged_request_does_not_block_the_real_one() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let now = server.app.clock.now_secs();
    let forged = server
        .post_signed(
            "payzu",
            BODY,
            &sign_payzu(b"attacker", now, BODY.as_bytes()),
            None,
        )
        .await;
    assert_eq!(forged.status(), 401);
    let err: serde_json::Value = forged.json().await.unwrap();
    assert_eq!(err["error"], "invalid_signature");
    assert_eq!(message_keys(&redis), 0);

    let real = server.post_callback("payzu", BODY, None).await;
    assert_eq!(real.status(), 200);
    assert!(real.headers().get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn bad_requests_get_json_errors_and_change_nothing() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.max_body_bytes = 1024;
    let server = TestServer::start(cfg).await;
    let now = server.app.clock.now_secs();
    let post = |source: &str, body: String, signature: Option<String>, event: Option<&str>| {
        let mut req = server
            .client
            .post(format!("{}/v1/callbacks/{source}", server.url))
            .body(body);
        if let Some(s) = signature {
            req = req.header("x-callback-signature", s);
        }
        if let Some(e) = event {
            req = req.header("x-callback-event", e.to_string());
        }
        req.send()
    };
    let signed = |body: &str| {
        Some(sign_payzu(
            support::PAYZU_SECRET.as_bytes(),
            now,
            body.as_bytes(),
        ))
    };
    /// source, body, signature header, event header, expected status, expected error code
    type Case<'a> = (
        &'a str,
        String,
        Option<String>,
        Option<&'a str>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        (
            "nope",
            BODY.into(),
            signed(BODY),
            None,
            404,
            "unknown_source",
        ),
        ("payzu", BODY.into(), None, None, 401, "invalid_signature"),
        (
            "payzu",
            BODY.into(),
            Some("t=1, v1=00".into()),
            None,
            401,
            "invalid_signature",
        ),
        (
            "payzu",
            BODY.into(),
            Some(sign_payzu(
                support::PAYZU_SECRET.as_bytes(),
                now - 400,
                BODY.as_bytes(),
            )),
            None,
            401,
            "invalid_signature",
        ),
        (
            "payzu",
            BODY.into(),
            Some(sign_payzu(
                support::PAYZU_SECRET.as_bytes(),
                now + 400,
                BODY.as_bytes(),
            )),
            None,
            401,
            "invalid_signature",
        ),
        (
            "payzu",
            "[1,2]".into(),
            signed("[1,2]"),
            None,
            400,
            "invalid_callback",
        ),
        (
            "payzu",
            "{\"id\":".into(),
            signed("{\"id\":"),
            None,
            400,
            "invalid_json",
        ),
        (
            "payzu",
            "{\"status\":\"X\"}".into(),
            signed("{\"status\":\"X\"}"),
            None,
            400,
            "invalid_callback",
        ),
        (
            "payzu",
            "{\"id\":true,\"status\":\"X\"}".into(),
            signed("{\"id\":true,\"status\":\"X\"}"),
            None,
            400,
            "invalid_callback",
        ),
        (
            "payzu",
            "{\"id\":\"t\"}".into(),
            signed("{\"id\":\"t\"}"),
            None,
            400,
            "invalid_callback",
        ),
        (
            "payzu",
            "x".repeat(2000),
            signed(&"x".repeat(2000)),
            None,
            413,
            "payload_too_large",
        ),
    ];
    for (source, body, sig, event, status, code) in cases {
        let r = post(source, body.clone(), sig, event).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{source} {body:.40}");
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"], code, "{body:.40}");
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    assert_eq!(message_keys(&redis), 0);
    assert_eq!(
        redis.cli(&["GET", "cb:schema"]),
        callbackd::store::redis::SCHEMA_VERSION.to_string(),
        "the layout version is written at start-up"
    );
    assert_eq!(
        redis.cli(&["GET", "cb:partitions"]),
        "64",
        "and so is the partition count"
    );
    assert_eq!(
        redis.cli(&["dbsize"]),
        "2",
        "nothing else at all was written"
    );

    // Event header without status is fine; a numeric id is fine; `none` needs no signature.
    let r = post(
        "payzu",
        "{\"id\":\"t\"}".into(),
        signed("{\"id\":\"t\"}"),
        Some("INFRACTION_CHANGED"),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let r = post("open", "{\"id\":42,\"status\":\"PAID\"}".into(), None, None)
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn rotated_secret_verifies() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let now = server.app.clock.now_secs();
    let without_space = sign_payzu(b"old-secret", now, BODY.as_bytes()).replace(", ", ",");
    let r = server
        .post_signed("payzu", BODY, &without_space, None)
        .await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn slow_clients_are_cut_off_and_block_no_one() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.header_timeout_secs = 1;
    cfg.server.request_timeout_secs = 1;
    cfg.server.max_connections = 8;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();

    // Slowloris: headers trickle in and never finish.
    let mut headers_slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    headers_slow
        .write_all(b"POST /v1/callbacks/payzu HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // A body that never completes.
    let mut body_slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    body_slow
        .write_all(
            b"POST /v1/callbacks/open HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"id\":",
        )
        .await
        .unwrap();

    // Meanwhile everyone else is served.
    let r = server.post_callback("payzu", BODY, None).await;
    assert_eq!(r.status(), 200);

    let mut buf = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(5), headers_slow.read_to_end(&mut buf)).await;
    assert!(
        read.is_ok(),
        "the header-slow connection was closed by the server"
    );
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), body_slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the body-slow request was ended");
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
}

#[tokio::test]
async fn connections_beyond_the_limit_wait_instead_of_failing() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.max_connections = 2;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();
    let idle: Vec<_> =
        futures::future::join_all((0..2).map(|_| tokio::net::TcpStream::connect(addr.clone())))
            .await;
    // Both slots are held by idle connections: a new request waits.
    let fresh = support::client();
    let waiting = tokio::time::timeout(
        Duration::from_millis(500),
        fresh.get(format!("{}/healthz", server.url)).send(),
    )
    .await;
    assert!(
        waiting.is_err(),
        "a third connection is not served while two are held"
    );
    drop(idle);
    let served = tokio::time::timeout(
        Duration::from_secs(15),
        fresh.get(format!("{}/healthz", server.url)).send(),
    )
    .await;
    assert_eq!(served.unwrap().unwrap().status(), 200);
}

#[tokio::test]
async fn silent_connections_are_closed() {
    use tokio::io::AsyncReadExt;
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.header_timeout_secs = 1;
    cfg.server.request_timeout_secs = 1;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();
    // A connection that never sends a byte must not hold a connection slot forever.
    let mut idle = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), idle.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the server closed the idle connection");
}
