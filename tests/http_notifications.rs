//! Connector hand-offs and their delivery, over HTTP against a private Redis and real sinks
//! (issue: the durable dispatcher).

mod support;

use std::sync::Arc;
use std::time::Duration;

use callbackd::clock::{Clock, ManualClock};
use callbackd::dispatch::Dispatcher;
use callbackd::store::{MessageId, MessageRecord, MessageState};
use serde_json::{Value, json};
use support::redis::RedisServer;
use support::sink::{Gate, Reply, Sink};
use support::{TestServer, config, eventually, handoff, virtual_loop_server, virtual_server};

async fn record(server: &TestServer, id: &str) -> MessageRecord {
    server
        .app
        .store
        .get(&MessageId::parse(id).unwrap())
        .await
        .unwrap()
        .expect("message exists")
}

/// Advances the virtual clock to each next attempt until the message is finished.
async fn run_to_completion(
    server: &TestServer,
    clock: &ManualClock,
    d: &Arc<Dispatcher>,
    id: &str,
) -> MessageRecord {
    d.tick().await;
    loop {
        let rec = record(server, id).await;
        match rec.state {
            MessageState::Pending => {
                let next = rec
                    .next_attempt_at
                    .expect("a pending head has a next attempt");
                assert!(next <= rec.deadline, "never scheduled past the deadline");
                clock.set(next.max(clock.now_ms()));
                d.tick().await;
            }
            _ => return rec,
        }
    }
}

#[tokio::test]
async fn handoff_is_idempotent_and_byte_identical() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let server = TestServer::start(config(&redis.url(), None)).await;
    let body = handoff("pay-1", "approved", &format!("{}/cb", sink.url));
    let first = server.notify(&body).await;
    assert_eq!(first.status(), 202);
    let first_bytes = first.bytes().await.unwrap();
    let answer: Value = serde_json::from_slice(&first_bytes).unwrap();
    assert_eq!(answer["paymentId"], "pay-1");
    assert_eq!(answer["status"], "approved");
    assert!(
        answer["notificationId"]
            .as_str()
            .unwrap()
            .starts_with("msg_")
    );

    let again = server.notify(&body).await;
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first_bytes);

    let changed = handoff("pay-1", "approved", &format!("{}/other", sink.url));
    let conflict = server.notify(&changed).await;
    assert_eq!(conflict.status(), 422);
    assert_eq!(
        conflict.json::<Value>().await.unwrap()["error"],
        "idempotency_key_reused"
    );

    // An Idempotency-Key header overrides paymentId + status.
    let keyed = |key: &str| {
        server
            .client
            .post(format!("{}/v1/notifications", server.url))
            .bearer_auth(support::CONNECTOR_TOKEN)
            .header("idempotency-key", key.to_string())
            .json(&handoff("pay-2", "approved", &format!("{}/cb", sink.url)))
            .send()
    };
    let k1 = keyed("req-1").await.unwrap();
    assert_eq!(k1.status(), 202);
    let k1_again = keyed("req-1").await.unwrap();
    assert_eq!(k1_again.headers()["idempotent-replayed"], "true");

    eventually(10, "both deliveries", || async {
        (sink.count() == 2).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.count(), 2, "repeats created nothing");
}

#[tokio::test]
async fn fifty_concurrent_identical_handoffs_deliver_once() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let server = TestServer::start(config(&redis.url(), None)).await;
    let body = handoff("pay-c", "approved", &format!("{}/cb", sink.url));
    let responses = futures::future::join_all((0..50).map(|_| server.notify(&body))).await;
    let mut bodies = std::collections::HashSet::new();
    let mut fresh = 0;
    for r in responses {
        assert_eq!(r.status(), 202);
        if r.headers().get("idempotent-replayed").is_none() {
            fresh += 1;
        }
        bodies.insert(r.bytes().await.unwrap());
    }
    assert_eq!(fresh, 1);
    assert_eq!(bodies.len(), 1);
    eventually(10, "the delivery", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(sink.count(), 1);
}

#[tokio::test]
async fn state_machine_over_http() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let server = TestServer::start(config(&redis.url(), None)).await;
    let url = format!("{}/cb", sink.url);
    let status = |r: &reqwest::Response| r.status().as_u16();
    let cases = [
        ("p1", "approved", 202),
        ("p1", "settled", 202),
        ("p1", "refunded", 202),
        ("p1", "cancelled", 409),
        ("p2", "denied", 202),
        ("p2", "approved", 409),
        ("p3", "settled", 409),
        ("p3", "cancelled", 202),
        ("p3", "approved", 409),
        ("p4", "approved", 202),
        ("p4", "cancelled", 202),
        ("p4", "settled", 409),
        ("p5", "refunded", 409),
        ("p5", "undefined", 409),
    ];
    let mut accepted = 0;
    for (payment, to, expected) in cases {
        let r = server.notify(&handoff(payment, to, &url)).await;
        assert_eq!(status(&r), expected, "{payment} -> {to}");
        if expected == 409 {
            let err: Value = r.json().await.unwrap();
            assert_eq!(err["error"], "invalid_transition");
            assert_eq!(err["to"], to);
            assert!(err["from"].is_string());
        } else {
            accepted += 1;
        }
    }
    let err: Value = server
        .notify(&handoff("p1", "cancelled", &url))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(err["from"], "refunded");
    assert_eq!(
        server
            .store
            .payment_status("p1", server.app.clock.now_ms())
            .await
            .unwrap()
            .as_deref(),
        Some("refunded")
    );
    eventually(10, "accepted ones delivered", || async {
        (sink.count() == accepted).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        sink.count(),
        accepted,
        "a refused transition enqueues nothing"
    );

    for bad in [
        json!({"paymentId": "p9", "status": "APPROVED", "callbackUrl": url}),
        json!({"paymentId": "", "status": "approved", "callbackUrl": url}),
        json!({"paymentId": "p9", "status": "approved"}),
        json!({"paymentId": "p9", "status": "approved", "callbackUrl": "ftp://x/y"}),
        json!({"paymentId": 9, "status": "approved", "callbackUrl": url}),
        json!({"paymentId": "p9", "status": "approved", "callbackUrl": url, "maxAgeSecs": 0}),
        json!({"paymentId": "p9", "status": "approved", "callbackUrl": url, "headers": {"Host": "x"}}),
        json!([1]),
    ] {
        let r = server.notify(&bad).await;
        assert_eq!(r.status(), 400, "{bad}");
        let err: Value = r.json().await.unwrap();
        assert!(err["message"].as_str().unwrap().len() > 5);
    }
}

#[tokio::test]
async fn roles_are_enforced() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let body = handoff("p", "approved", "http://127.0.0.1:9/cb");
    let post = |token: Option<&str>| {
        let mut r = server
            .client
            .post(format!("{}/v1/notifications", server.url))
            .json(&body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    assert_eq!(post(None).await.unwrap().status(), 401);
    assert_eq!(post(Some("wrong-token-x")).await.unwrap().status(), 401);
    assert_eq!(
        post(Some(support::ADMIN_TOKEN)).await.unwrap().status(),
        403
    );
}

#[tokio::test]
async fn callback_url_and_headers_arrive_byte_for_byte() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let server = TestServer::start(config(&redis.url(), None)).await;
    let path =
        "/api/pvt/payments/pay-9/callback?X-VTEX-signature=ab%2Fcd%3D%3D&an=store%20one&x=%7E~";
    let body = json!({
        "paymentId": "pay-9", "status": "approved",
        "callbackUrl": format!("{}{path}", sink.url),
        "payload": {"paymentId": "pay-9", "status": "approved", "tid": "T-1"},
        "headers": {"X-VTEX-API-AppKey": "app-key", "X-VTEX-API-AppToken": "app-token-secret"},
    });
    let answer: Value = server.notify(&body).await.json().await.unwrap();
    eventually(10, "delivery", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    let got = &sink.received()[0];
    assert_eq!(got.uri, path);
    assert_eq!(got.header("x-vtex-api-appkey").as_deref(), Some("app-key"));
    assert_eq!(
        got.header("x-vtex-api-apptoken").as_deref(),
        Some("app-token-secret")
    );
    assert_eq!(
        got.header("x-callbackd-message-id").as_deref(),
        answer["notificationId"].as_str()
    );
    assert_eq!(got.header("x-callbackd-attempt").as_deref(), Some("1"));
    assert_eq!(
        got.json(),
        json!({"paymentId": "pay-9", "status": "approved", "tid": "T-1"})
    );
}

#[tokio::test]
async fn ssrf_targets_are_refused_at_handoff() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.dispatch.allow_private_networks = false;
    let server = TestServer::start(cfg).await;
    for url in [
        "http://127.0.0.1:8080/cb",
        "http://10.0.0.1/cb",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]:8080/cb",
        "http://[::ffff:127.0.0.1]/cb",
        "http://localhost:8080/cb",
    ] {
        let r = server.notify(&handoff("p-ssrf", "approved", url)).await;
        assert_eq!(r.status(), 400, "{url}");
        let err: Value = r.json().await.unwrap();
        let message = err["message"].as_str().unwrap();
        assert!(message.contains("callbackUrl"), "{err}");
        if url.contains("localhost") {
            // What the name resolved to stays inside: no map of the internal network.
            for resolved in ["127.0.0.1", "::1"] {
                assert!(!message.contains(resolved), "{message}");
            }
        }
    }
    assert_eq!(
        server
            .store
            .payment_status("p-ssrf", server.app.clock.now_ms())
            .await
            .unwrap(),
        None
    );
}

/// Waits until the message has `n` delivery attempts recorded, and returns its record.
async fn attempts_recorded(server: &TestServer, id: &str, n: usize) -> MessageRecord {
    eventually(20, &format!("{n} attempt(s) of {id} recorded"), || async {
        let rec = record(server, id).await;
        let deliveries = rec
            .history
            .iter()
            .filter(|a| a.delivery().is_some())
            .count();
        (deliveries == n && rec.state != MessageState::InFlight).then_some(rec)
    })
    .await
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

/// The SSRF guard at delivery: a `forward_url` naming `localhost` (resolved by the delivery
/// client's resolver) or a loopback literal is refused at every attempt, recorded as
/// `refused_address`, and the receiver sees nothing.
#[tokio::test]
async fn private_forward_urls_are_refused_at_delivery() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let port = port_of(&sink.url);
    let mut cfg = config(
        &redis.url(),
        Some(&format!("http://localhost:{port}/events")),
    );
    cfg.dispatch.allow_private_networks = false;
    cfg.sources
        .get_mut("payzu")
        .unwrap()
        .allow_private_forward_url = false;
    // Set past validation, which refuses a literal internal forward_url at start-up.
    let open = cfg.sources.get_mut("open").unwrap();
    open.allow_private_forward_url = false;
    open.forward_url = Some(format!("http://127.0.0.1:{port}/open"));
    let server = TestServer::start(cfg).await;
    let by_name = server
        .post_callback("payzu", r#"{"id":"tx-ssrf","status":"PAID"}"#, None)
        .await;
    assert_eq!(by_name.status(), 200);
    let literal = server
        .client
        .post(format!("{}/v1/callbacks/open", server.url))
        .body(r#"{"id":"tx-ssrf","status":"PAID"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(literal.status(), 200);
    for answer in [by_name, literal] {
        let id = answer.json::<Value>().await.unwrap()["messageId"]
            .as_str()
            .unwrap()
            .to_string();
        let rec = attempts_recorded(&server, &id, 1).await;
        assert_eq!(
            rec.history[0].delivery().and_then(|d| d.error.as_deref()),
            Some("refused_address"),
            "{:?}",
            rec.message.target_url
        );
        assert_eq!(rec.history[0].delivery().and_then(|d| d.status), None);
    }
    assert_eq!(sink.count(), 0, "nothing reached the internal address");
}

/// A `callbackUrl` that passed the hand-off check (here: taken by an ingest-only process
/// that allows private targets, as a name that resolved publicly at hand-off would pass) is
/// checked again at delivery on what the name resolves to then.
#[tokio::test]
async fn a_name_that_passed_at_handoff_is_refused_at_delivery() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let mut ingest_cfg = config(&redis.url(), None);
    ingest_cfg.dispatch.enabled = false;
    let ingest = TestServer::start(ingest_cfg).await;
    let mut worker_cfg = config(&redis.url(), None);
    worker_cfg.dispatch.allow_private_networks = false;
    let worker = TestServer::start(worker_cfg).await;
    let url = format!("http://localhost:{}/cb", port_of(&sink.url));
    let id = ingest
        .hand_off_id(&handoff("p-rebind", "approved", &url))
        .await;
    let rec = attempts_recorded(&worker, &id, 1).await;
    assert_eq!(
        rec.history[0].delivery().and_then(|d| d.error.as_deref()),
        Some("refused_address")
    );
    assert_eq!(rec.state, MessageState::Pending, "retried, never delivered");
    assert_eq!(sink.count(), 0);
}

/// `dispatch.allow_private_networks` opens connectors' `callbackUrl`s only; a source's
/// `forward_url` has its own switch, `sources.<name>.allow_private_forward_url`.
#[tokio::test]
async fn callback_urls_and_forward_urls_have_separate_switches() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let forward = format!("{}/fwd", sink.url);
    let body = r#"{"id":"tx-sep","status":"PAID"}"#;

    // Private callbackUrls allowed, private forwards not.
    let mut cfg = config(&redis.url(), Some(&forward));
    cfg.sources
        .get_mut("payzu")
        .unwrap()
        .allow_private_forward_url = false;
    let server = TestServer::start(cfg).await;
    let handed = server
        .hand_off_id(&handoff("p-sep", "approved", &format!("{}/cb", sink.url)))
        .await;
    let answer: Value = server
        .post_callback("payzu", body, None)
        .await
        .json()
        .await
        .unwrap();
    let forwarded = answer["messageId"].as_str().unwrap();
    assert_eq!(
        attempts_recorded(&server, &handed, 1).await.state,
        MessageState::Delivered
    );
    let rec = attempts_recorded(&server, forwarded, 1).await;
    assert_eq!(
        rec.history[0].delivery().and_then(|d| d.error.as_deref()),
        Some("refused_address")
    );
    server.stop().await;

    // Private forwards allowed, private callbackUrls not (a store of its own, so this
    // server does not deliver the first one's queue).
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), Some(&forward));
    cfg.dispatch.allow_private_networks = false;
    let server = TestServer::start(cfg).await;
    let r = server
        .notify(&handoff("p-sep2", "approved", &format!("{}/cb", sink.url)))
        .await;
    assert_eq!(r.status(), 400);
    let other = body.replace("tx-sep", "tx-sep2");
    let answer: Value = server
        .post_callback("payzu", &other, None)
        .await
        .json()
        .await
        .unwrap();
    let rec = attempts_recorded(&server, answer["messageId"].as_str().unwrap(), 1).await;
    assert_eq!(rec.state, MessageState::Delivered);

    let paths: Vec<String> = sink.received().iter().map(|r| r.uri.clone()).collect();
    assert_eq!(paths, ["/cb", "/fwd"]);
}

/// The real dispatcher loop on a virtual clock: a retry can only happen once the test moves
/// the clock, so "another payment is delivered before approved's next attempt" is decided by
/// the code, not by how fast the machine is.
#[tokio::test]
async fn approved_retried_three_times_still_arrives_before_settled() {
    let redis = RedisServer::start();
    // Fails the first three `approved` deliveries.
    let counting = Sink::start({
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        move |req, _| {
            if req.uri == "/cb"
                && req.body.contains("approved")
                && count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 3
            {
                Reply::status(503)
            } else {
                Reply::status(204)
            }
        }
    })
    .await;
    let (server, clock) = virtual_loop_server(&redis.url(), |_| {}).await;
    let url = format!("{}/cb", counting.url);
    let approved = server
        .hand_off_id(&handoff("p-ord", "approved", &url))
        .await;
    let mut rec = attempts_recorded(&server, &approved, 1).await;
    let settled = server.hand_off_id(&handoff("p-ord", "settled", &url)).await;
    // Another payment is not held up by p-ord's retries: it is delivered while the clock
    // stands still, so before approved's next attempt.
    server
        .hand_off_id(&handoff(
            "p-other",
            "approved",
            &format!("{}/other", counting.url),
        ))
        .await;
    eventually(20, "the other payment delivered", || async {
        counting
            .received()
            .iter()
            .any(|r| r.uri == "/other")
            .then_some(())
    })
    .await;
    let cb_requests = || counting.received().into_iter().filter(|r| r.uri == "/cb");
    assert_eq!(cb_requests().count(), 1, "approved was not retried early");

    // Each retry happens when the clock reaches its scheduled time, within the jittered
    // backoff (1 s, 2 s, 4 s, each shortened by at most half).
    for n in 1..=3 {
        let previous = rec.history.last().unwrap().at();
        let next = rec
            .next_attempt_at
            .expect("a failed head has a next attempt");
        let base = 1000 * (1 << (n - 1));
        assert!(
            (previous + base / 2..=previous + base).contains(&next),
            "retry {n} scheduled {} ms after the failure",
            next - previous
        );
        clock.set(next);
        rec = attempts_recorded(&server, &approved, n + 1).await;
        assert_eq!(rec.history.last().unwrap().at(), next, "attempted when due");
    }
    assert_eq!(rec.state, MessageState::Delivered);
    let settled = attempts_recorded(&server, &settled, 1).await;
    assert_eq!(settled.state, MessageState::Delivered);

    let statuses: Vec<String> = cb_requests()
        .map(|r| r.json()["status"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        statuses,
        ["approved", "approved", "approved", "approved", "settled"]
    );
    let attempts: Vec<String> = cb_requests()
        .map(|r| r.header("x-callbackd-attempt").unwrap())
        .collect();
    assert_eq!(attempts, ["1", "2", "3", "4", "1"]);
}

/// The same loop dead-letters on 410, honours `Retry-After` and delivers a resend.
#[tokio::test]
async fn the_real_loop_on_a_virtual_clock_gone_retry_after_and_resend() {
    let redis = RedisServer::start();
    let sink = Sink::start(|_, _| Reply {
        status: 429,
        retry_after: Some("120".into()),
        delay: Duration::ZERO,
    })
    .await;
    // A host of its own: the 429 pauses its whole host (docs/delivery.md, "Protecting the
    // gateway"), which would hold the resend below until the pause ends.
    let gone_sink = Sink::start(|_, _| Reply::status(410)).await;
    let (server, clock) = virtual_loop_server(&redis.url(), |_| {}).await;
    let gone = server
        .hand_off_id(&handoff(
            "p-gone",
            "approved",
            &format!("{}/gone", gone_sink.url),
        ))
        .await;
    let later = server
        .hand_off_id(&handoff(
            "p-later",
            "approved",
            &format!("{}/later", sink.url),
        ))
        .await;
    let rec = attempts_recorded(&server, &gone, 1).await;
    assert_eq!(rec.state, MessageState::Dead, "410 stops at once");
    let rec = attempts_recorded(&server, &later, 1).await;
    let first = rec.history[0].at();
    assert_eq!(
        rec.next_attempt_at,
        Some(first + 120_000),
        "Retry-After: 120"
    );
    clock.set(first + 120_000);
    attempts_recorded(&server, &later, 2).await;

    let r = server
        .admin_post("/v1/admin/resend", &json!({"messageIds": [gone]}))
        .await;
    assert_eq!(r.status(), 200);
    let rec = attempts_recorded(&server, &gone, 2).await;
    assert_eq!(rec.state, MessageState::Dead, "resent, then 410 again");
    assert_eq!(gone_sink.count(), 2);
}

/// Attempts a target that is always down gets at times before `horizon` (ms after
/// acceptance) within the default 7-day window: `(fewest, most)`, with every delay at its
/// longest (no jitter) and at its shortest (jittered down by half). Any run lies between.
fn failures_before(horizon: i64) -> (usize, usize) {
    use callbackd::store::lifecycle::policy::{Backoff, Next, next_attempt};
    let backoff = Backoff {
        initial_ms: 1_000,
        max_ms: 3_600_000,
    };
    let count = |jitter: f64| {
        let (mut at, mut step, mut n) = (0, 0, 0);
        while at < horizon {
            n += 1;
            match next_attempt(backoff, step, at, 7 * 86_400_000, jitter, None) {
                Next::RetryAt(next) => at = next,
                Next::GiveUp => break,
            }
            step += 1;
        }
        n
    };
    (count(0.0), count(1.0))
}

#[tokio::test]
async fn seven_days_on_a_virtual_clock() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |_| {}).await;
    let start = clock.now_ms();
    let six_days = 6 * 86_400_000;
    let sink = Sink::start({
        let clock = clock.clone();
        move |_, _| {
            Reply::status(if clock.now_ms() - start < six_days {
                503
            } else {
                204
            })
        }
    })
    .await;

    // Down for six days, then up: delivered once.
    let id = server
        .hand_off_id(&handoff("p-6d", "approved", &format!("{}/cb", sink.url)))
        .await;
    let rec = run_to_completion(&server, &clock, &d, &id).await;
    assert_eq!(rec.state, MessageState::Delivered);
    let successes = rec
        .history
        .iter()
        .filter(|a| a.delivery().and_then(|d| d.status) == Some(204))
        .count();
    assert_eq!(successes, 1);
    let attempts = rec.delivery_attempts as usize;
    println!("down 6 days then up: delivered at attempt {attempts}");
    let (fewest, most) = failures_before(six_days);
    assert!(
        (fewest + 1..=most + 1).contains(&attempts),
        "{attempts} attempts: the schedule allows {} to {}",
        fewest + 1,
        most + 1
    );
    assert_eq!(sink.count() as u64, rec.history_total);
    assert_eq!(
        rec.history.len(),
        1 + callbackd::store::HISTORY_TAIL,
        "the history keeps the first attempt and the latest 100"
    );

    // Down forever: dead exactly at the deadline, nothing after it.
    let down = Sink::start(|_, _| Reply::status(500)).await;
    clock.set(start);
    let id = server
        .hand_off_id(&handoff("p-7d", "approved", &format!("{}/cb", down.url)))
        .await;
    let rec = run_to_completion(&server, &clock, &d, &id).await;
    assert_eq!(rec.state, MessageState::Dead);
    let last = rec.history.last().unwrap();
    assert_eq!(
        last.at(),
        rec.message.deadline,
        "the last attempt lands at the deadline"
    );
    assert_eq!(
        rec.message.deadline - rec.message.created_at,
        7 * 86_400_000
    );
    let attempts = rec.delivery_attempts as usize;
    println!("down for good: {attempts} attempts over 7 days, then dead");
    let (fewest, most) = failures_before(7 * 86_400_000 + 1);
    assert_eq!(
        fewest, 180,
        "docs/delivery.md: 180 attempts over 7 days without jitter"
    );
    assert!(
        (fewest..=most).contains(&attempts),
        "{attempts} attempts: the schedule allows {fewest} to {most}"
    );
    clock.advance(86_400_000);
    d.tick().await;
    assert_eq!(
        down.count() as u64,
        rec.history_total,
        "no attempt after the deadline"
    );

    // maxAgeSecs shortens the window.
    let short = Sink::start(|_, _| Reply::status(500)).await;
    clock.set(start);
    let body = json!({"paymentId": "p-pix", "status": "approved", "callbackUrl": format!("{}/cb", short.url), "maxAgeSecs": 900});
    let id = server.hand_off_id(&body).await;
    let rec = run_to_completion(&server, &clock, &d, &id).await;
    assert_eq!(rec.state, MessageState::Dead);
    assert_eq!(
        rec.history.last().unwrap().at() - rec.message.created_at,
        900_000
    );
    assert!(rec.history.len() < 15);
}

#[tokio::test]
async fn retry_after_gone_and_failures() {
    let redis = RedisServer::start();
    let (server, clock, d) =
        virtual_server(&redis.url(), |c| c.dispatch.request_timeout_ms = 300).await;
    // The virtual clock runs 30 days ahead of the host's: a Retry-After date must be read
    // against the dispatcher's clock, or this one would look 30 days away.
    clock.advance(30 * 86_400_000);
    let sink = Sink::start({
        let clock = clock.clone();
        move |req, _| match req.uri.as_str() {
            "/seconds" => Reply {
                status: 429,
                retry_after: Some("120".into()),
                delay: Duration::ZERO,
            },
            "/date" => Reply {
                status: 503,
                retry_after: Some(http_date(clock.now_ms() + 300_000)),
                delay: Duration::ZERO,
            },
            "/gone" => Reply::status(410),
            "/hang" => Reply {
                status: 204,
                retry_after: None,
                delay: Duration::from_secs(2),
            },
            _ => Reply::status(500),
        }
    })
    .await;
    let closed = format!("http://127.0.0.1:{}/cb", support::redis::free_port());
    let mut ids = Vec::new();
    for (i, url) in [
        format!("{}/seconds", sink.url),
        format!("{}/date", sink.url),
        format!("{}/gone", sink.url),
        format!("{}/hang", sink.url),
        format!("{}/error", sink.url),
        closed,
    ]
    .iter()
    .enumerate()
    {
        let a: Value = server
            .notify(&handoff(&format!("p-r{i}"), "approved", url))
            .await
            .json()
            .await
            .unwrap();
        ids.push(a["notificationId"].as_str().unwrap().to_string());
    }
    let now = clock.now_ms();
    d.tick().await;
    let recs = futures::future::join_all(ids.iter().map(|id| record(&server, id))).await;
    assert_eq!(
        recs[0].next_attempt_at,
        Some(now + 120_000),
        "Retry-After seconds"
    );
    // HTTP dates have whole seconds: the date names `now + 300 s` rounded down.
    let by_date = recs[1].next_attempt_at.unwrap() - now;
    assert!(
        (299_000..=300_000).contains(&by_date),
        "Retry-After date: {by_date}"
    );
    assert_eq!(recs[2].state, MessageState::Dead, "410 stops at once");
    assert_eq!(recs[2].history.len(), 1);
    assert_eq!(
        recs[3].history[0]
            .delivery()
            .and_then(|d| d.error.as_deref()),
        Some("timeout")
    );
    assert_eq!(
        recs[4].history[0].delivery().and_then(|d| d.status),
        Some(500)
    );
    assert_eq!(
        recs[5].history[0]
            .delivery()
            .and_then(|d| d.error.as_deref()),
        Some("connect")
    );
    for r in [&recs[3], &recs[4], &recs[5]] {
        assert_eq!(r.state, MessageState::Pending, "retried");
        let delay = r.next_attempt_at.unwrap() - now;
        assert!(
            (500..=1_000).contains(&delay),
            "first retry after 0.5-1 s, got {delay}"
        );
    }
}

fn http_date(at: i64) -> String {
    httpdate::fmt_http_date(std::time::UNIX_EPOCH + Duration::from_millis(at as u64))
}

/// Walks a message that keeps failing through its retries on the virtual clock, stopping
/// at the first attempt scheduled after `until` (or when it is finished).
async fn walk_until(
    server: &TestServer,
    clock: &ManualClock,
    d: &Arc<Dispatcher>,
    id: &str,
    until: i64,
) -> MessageRecord {
    d.tick().await;
    loop {
        let rec = record(server, id).await;
        match rec.next_attempt_at {
            Some(next) if rec.state == MessageState::Pending && next <= until => {
                clock.set(next.max(clock.now_ms()));
                d.tick().await;
            }
            _ => return rec,
        }
    }
}

#[tokio::test]
async fn retry_after_zero_or_past_is_not_a_hot_loop() {
    use callbackd::store::lifecycle::policy::{Next, base_delay_ms, next_attempt};
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |_| {}).await;
    let backoff = server.app.settings.dispatch.backoff;
    let span: i64 = 3 * 3_600_000;
    // Attempts in `span` by the pure schedule of a target that sends no Retry-After: jitter 0
    // gives the fewest (every delay its full base), jitter 1 the most (every delay half it).
    let walk = |jitter: f64| {
        let (mut now, mut step, mut count) = (0, 0, 1);
        while let Next::RetryAt(at) = next_attempt(backoff, step, now, span, jitter, None) {
            if at >= span {
                break;
            }
            (now, step, count) = (at, step + 1, count + 1);
        }
        count
    };
    let (fewest, most) = (walk(0.0), walk(1.0));
    assert!(fewest >= 10 && most > fewest, "{fewest}..{most}");

    for (payment, past) in [("p-ra-zero", false), ("p-ra-past", true)] {
        // After `most + 5` answers the sink accepts, so a hot loop ends (and fails the
        // count) instead of spinning inside one tick forever.
        let sink = Sink::start({
            let clock = clock.clone();
            move |_, index| {
                if index > most + 5 {
                    return Reply::status(204);
                }
                let retry_after = if past {
                    http_date(clock.now_ms() - 3_600_000)
                } else {
                    "0".to_string()
                };
                Reply {
                    status: 503,
                    retry_after: Some(retry_after),
                    delay: Duration::ZERO,
                }
            }
        })
        .await;
        let path = if past { "a past date" } else { "0" };
        let start = clock.now_ms();
        let id = server
            .hand_off_id(&handoff(payment, "approved", &format!("{}/cb", sink.url)))
            .await;
        let rec = walk_until(&server, &clock, &d, &id, start + span - 1).await;
        let attempts = sink.count();
        assert!(
            (fewest..=most).contains(&attempts),
            "Retry-After {path}: {attempts} attempts in {span} ms; the schedule allows {fewest}..={most}"
        );
        assert_eq!(
            rec.state,
            MessageState::Pending,
            "Retry-After {path}: still retrying"
        );
        for (step, pair) in rec.history.windows(2).enumerate() {
            let gap = (pair[1].at() - pair[0].at()) as u64;
            let base = base_delay_ms(backoff, step as u32);
            assert!(
                gap >= base - base / 2,
                "Retry-After {path}: retry {step} came {gap} ms after the previous one; base {base}"
            );
        }
    }
}

#[tokio::test]
async fn inbound_callbacks_are_forwarded_and_signed() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let mut cfg = config(&redis.url(), Some(&format!("{}/payzu-events", sink.url)));
    let source = cfg.sources.get_mut("payzu").unwrap();
    source
        .forward_headers
        .insert("Authorization".into(), "Bearer merchant".into());
    source.forward_secret = Some("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into());
    let server = TestServer::start(cfg).await;
    let body = r#"{"id":"tx-f","status":"COMPLETED","amount":10.5}"#;
    let r = server
        .post_callback("payzu", body, Some("TRANSACTION_PAID"))
        .await;
    assert_eq!(r.status(), 200);
    eventually(10, "forward", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    let got = &sink.received()[0];
    assert_eq!(got.uri, "/payzu-events");
    assert_eq!(got.body, body, "the provider's body, byte for byte");
    assert_eq!(
        got.header("x-callback-event").as_deref(),
        Some("TRANSACTION_PAID")
    );
    assert_eq!(
        got.header("authorization").as_deref(),
        Some("Bearer merchant")
    );
    // The merchant verifies the forward with the Standard Webhooks scheme.
    let verifier = callbackd::webhook::Verifier::StandardWebhooks {
        secrets: vec![
            callbackd::webhook::decode_whsec("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap(),
        ],
        tolerance_secs: 300,
    };
    verifier
        .verify(
            &got.headers,
            got.body.as_bytes(),
            server.app.clock.now_secs(),
        )
        .expect("forward signature verifies");
}

#[tokio::test]
async fn a_slow_gateway_does_not_hold_up_another() {
    let redis = RedisServer::start();
    // The slow gateway answers nothing until the test opens the gate.
    let gate = Gate::new();
    let slow = Sink::start_async({
        let gate = gate.clone();
        move |_, _| {
            let gate = gate.clone();
            Box::pin(async move {
                gate.wait().await;
                Reply::status(204)
            })
        }
    })
    .await;
    let fast = Sink::ok().await;
    let mut cfg = config(&redis.url(), None);
    cfg.dispatch.concurrency = 8;
    cfg.dispatch.per_host_concurrency = 2;
    // Held requests must not time out (a retry would be a new request, not more concurrency).
    cfg.dispatch.request_timeout_ms = 60_000;
    cfg.dispatch.lease_secs = 70;
    let server = TestServer::start(cfg).await;
    for i in 0..20 {
        let r = server
            .notify(&handoff(
                &format!("slow-{i}"),
                "approved",
                &format!("{}/cb", slow.url),
            ))
            .await;
        assert_eq!(r.status(), 202);
    }
    eventually(10, "the slow gateway holds two requests", || async {
        (slow.in_flight() == 2).then_some(())
    })
    .await;
    let r = server
        .notify(&handoff("fast-1", "approved", &format!("{}/cb", fast.url)))
        .await;
    assert_eq!(r.status(), 202);
    // Delivered while both of the slow gateway's slots are still taken.
    eventually(10, "the other gateway's delivery", || async {
        (fast.count() == 1).then_some(())
    })
    .await;
    assert_eq!(slow.in_flight(), 2, "the slow gateway still holds its two");

    gate.open();
    eventually(30, "the slow backlog delivered", || async {
        (slow.count() == 20).then_some(())
    })
    .await;
    assert_eq!(
        slow.peak_in_flight(),
        2,
        "never more than per_host_concurrency open at once"
    );
}
