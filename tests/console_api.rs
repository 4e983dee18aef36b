//! The operator's console over plain HTTP (issue 15): each attempt keeps the receiver's
//! answer, the console's JSON endpoint, its pages' security headers, the resend dry run,
//! dead-letter alerts and the new metrics. The browser drives the same server in
//! `console_browser.rs`.

mod support;

use axum::http::HeaderMap;
use callbackd::clock::Clock;
use callbackd::config::AlertsConfig;
use callbackd::trace::TraceParent;
use callbackd::webhook::Verifier;
use callbackd::webhook::decode_whsec;
use serde_json::{Value, json};
use support::redis::RedisServer;
use support::sink::{Answer, Reply, Sink};
use support::{CONNECTOR_TOKEN, TestServer, handoff, virtual_server};

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("console.db").display())
}

async fn view(server: &TestServer, id: &str) -> Value {
    let r = server.admin_get(&format!("/v1/messages/{id}")).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A receiver that refuses with a long JSON body and `Retry-After`, then accepts with a short
/// text one: both answers are in the attempts, the long one cut at 2 KB and marked.
#[tokio::test]
async fn each_attempt_keeps_the_receivers_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (server, clock, d) = virtual_server(&sqlite_url(&dir), |_| {}).await;
    let long = format!("{{\"error\":\"{}\"}}", "x".repeat(3000));
    let sink = Sink::answering({
        let long = long.clone();
        move |_, n| {
            if n == 0 {
                Answer {
                    reply: Reply {
                        retry_after: Some("7".into()),
                        ..Reply::status(503)
                    },
                    content_type: Some("application/json".into()),
                    body: long.clone().into_bytes(),
                }
            } else {
                Answer {
                    reply: Reply::status(200),
                    content_type: Some("text/plain; charset=utf-8".into()),
                    body: b"thanks".to_vec(),
                }
            }
        }
    })
    .await;
    let id = server
        .hand_off_id(&handoff(
            "p-answer",
            "approved",
            &format!("{}/cb", sink.url),
        ))
        .await;
    d.tick().await;
    let v = view(&server, &id).await;
    let first = &v["attempts"][0];
    assert_eq!(first["status"], 503);
    let answer = &first["response"];
    assert_eq!(answer["contentType"], "application/json");
    assert_eq!(answer["retryAfter"], "7");
    assert_eq!(answer["bodyTruncated"], true);
    let kept = answer["body"].as_str().unwrap();
    assert_eq!(kept.len(), 2048);
    assert_eq!(kept, &long[..2048]);

    clock.advance(7_000);
    d.tick().await;
    let v = view(&server, &id).await;
    assert_eq!(v["state"], "delivered");
    let second = &v["attempts"][1]["response"];
    assert_eq!(second["contentType"], "text/plain; charset=utf-8");
    assert_eq!(second["body"], "thanks");
    assert!(second.get("bodyTruncated").is_none());
    assert!(second.get("retryAfter").is_none());
    server.stop().await;
}

/// What the stored answer of `attempt` costs as JSON: its body's serialized length.
fn stored_body_bytes(attempt: &Value) -> usize {
    serde_json::to_string(&attempt["response"]["body"])
        .unwrap()
        .len()
}

/// A receiver answering 2,000 NUL bytes, then 2,000 bytes of invalid UTF-8, then text, all
/// 503: each stored body stays within the 2 KB budget as stored (JSON escapes and U+FFFD
/// counted), and after a dozen attempts only the first and the latest 5 rows keep a body.
async fn answers_are_bounded_as_stored_on(store_url: &str) {
    let (server, clock, d) = virtual_server(store_url, |_| {}).await;
    let sink = Sink::answering(|_, n| Answer {
        reply: Reply::status(503),
        content_type: Some("application/octet-stream".into()),
        body: match n {
            0 => vec![0u8; 2000],
            1 => vec![0xFFu8; 2000],
            n => format!("busy {n}").into_bytes(),
        },
    })
    .await;
    let id = server
        .hand_off_id(&handoff(
            "p-binary",
            "approved",
            &format!("{}/cb", sink.url),
        ))
        .await;
    d.tick().await;
    clock.advance(3_600_000);
    d.tick().await;
    let v = view(&server, &id).await;
    let budget = callbackd::store::KEPT_BODY_BYTES + 2;
    for attempt in &v["attempts"].as_array().unwrap()[..2] {
        let stored = stored_body_bytes(attempt);
        assert!(stored <= budget, "{stored} bytes stored: {attempt}");
        assert!(stored > 1_000, "most of the budget is used: {attempt}");
        assert_eq!(attempt["response"]["bodyTruncated"], true);
    }
    assert!(
        v["attempts"][0]["response"]["body"]
            .as_str()
            .unwrap()
            .starts_with("\0\0")
    );

    for _ in 2..12 {
        clock.advance(3_600_000);
        d.tick().await;
    }
    let v = view(&server, &id).await;
    let attempts = v["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 12);
    for (i, attempt) in attempts.iter().enumerate() {
        let answer = &attempt["response"];
        let keeps = i == 0 || i >= 12 - callbackd::store::ANSWER_BODY_ROWS;
        assert_eq!(answer["body"] != "", keeps, "row {i}: {attempt}");
        assert_eq!(answer.get("bodyDropped").is_some(), !keeps, "row {i}");
        assert_eq!(attempt["status"], 503, "row {i} keeps its status");
        assert_eq!(answer["contentType"], "application/octet-stream");
    }
    assert_eq!(attempts[11]["response"]["body"], "busy 11");
    let total: usize = attempts.iter().map(stored_body_bytes).sum();
    assert!(
        total <= 6 * budget,
        "{total} bytes of bodies for 12 attempts"
    );
    server.stop().await;
}

#[tokio::test]
async fn stored_answers_are_bounded_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    answers_are_bounded_as_stored_on(&sqlite_url(&dir)).await;
}

#[tokio::test]
async fn stored_answers_are_bounded_on_redis() {
    let redis = RedisServer::start();
    answers_are_bounded_as_stored_on(&redis.url()).await;
}

/// A sink answering by path: `/ok` 204, `/gone` 410, anything else 503.
async fn path_sink() -> Sink {
    Sink::start(|r, _| {
        Reply::status(if r.uri.starts_with("/ok") {
            204
        } else if r.uri.starts_with("/gone") {
            410
        } else {
            503
        })
    })
    .await
}

async fn overview_on(store_url: &str) {
    let (server, clock, d) = virtual_server(store_url, |_| {}).await;
    let sink = path_sink().await;
    let t0 = clock.now_ms();
    server
        .hand_off_id(&handoff("p-ok", "approved", &format!("{}/ok", sink.url)))
        .await;
    let waiting = server
        .hand_off_id(&handoff(
            "p-wait",
            "approved",
            &format!("{}/fail", sink.url),
        ))
        .await;
    server
        .hand_off_id(&handoff(
            "p-gone",
            "approved",
            &format!("{}/gone", sink.url),
        ))
        .await;
    clock.set(t0 + 90_000);
    assert_eq!(d.tick().await, 3);

    let unauthenticated = server
        .client
        .get(format!("{}/v1/console/overview", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthenticated.status(), 401);
    let connector = server
        .client
        .get(format!("{}/v1/console/overview", server.url))
        .bearer_auth(CONNECTOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(connector.status(), 403);

    let r = server.admin_get("/v1/console/overview").await;
    assert_eq!(r.status(), 200);
    let o: Value = r.json().await.unwrap();
    assert_eq!(o["depth"], json!({"pending": 1, "inFlight": 0, "dead": 1}));
    assert_eq!(o["oldestPending"]["id"], waiting.as_str());
    assert_eq!(o["oldestPending"]["ageSeconds"], 90);
    let minutes = o["perMinute"].as_array().unwrap();
    assert_eq!(minutes.len(), 60);
    let last = &minutes[59];
    assert_eq!(last["deliveries"], 1);
    assert_eq!(last["failures"], 2);
    assert_eq!(last["dead"], 1, "the 410 is dead at once");
    assert_eq!(last["minute"], (t0 + 90_000) / 60_000 * 60_000);
    let all: u64 = minutes
        .iter()
        .map(|m| m["deliveries"].as_u64().unwrap() + m["failures"].as_u64().unwrap())
        .sum();
    assert_eq!(all, 3);

    // The same figures for Prometheus, with the build and failures by class.
    let text = server.admin_get("/metrics").await.text().await.unwrap();
    let lines: Vec<&str> = text.lines().collect();
    for expected in [
        "callbackd_oldest_pending_age_seconds 90",
        "callbackd_store_up 1",
        concat!(
            "callbackd_build_info{version=\"",
            env!("CARGO_PKG_VERSION"),
            "\"} 1"
        ),
    ] {
        assert!(lines.contains(&expected), "`{expected}` in\n{text}");
    }
    for class in ["4xx", "5xx"] {
        let prefix = format!(
            "callbackd_delivery_failures_total{{kind=\"notification\",class=\"{class}\"}} "
        );
        assert!(
            lines.iter().any(|l| l.starts_with(&prefix)),
            "{prefix} in\n{text}"
        );
    }
    assert!(text.contains("# TYPE callbackd_oldest_pending_age_seconds gauge"));
    server.stop().await;
}

#[tokio::test]
async fn overview_shows_depth_oldest_pending_and_the_last_hour_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    overview_on(&sqlite_url(&dir)).await;
}

#[tokio::test]
async fn overview_shows_depth_oldest_pending_and_the_last_hour_on_redis() {
    let redis = RedisServer::start();
    overview_on(&redis.url()).await;
}

/// Every console page and asset carries the CSP, no framing and no sniffing; the pages hold
/// no inline script or style, and the scripts never write markup from data.
#[tokio::test]
async fn console_pages_are_served_with_strict_headers_and_no_inline_code() {
    let dir = tempfile::tempdir().unwrap();
    let (server, _, _) = virtual_server(&sqlite_url(&dir), |_| {}).await;
    let pages = [
        ("/console", "text/html"),
        ("/console/messages?state=dead&paymentId=p-1", "text/html"),
        (
            "/console/messages/msg_000000000000000000000000000000",
            "text/html",
        ),
        ("/console/assets/app.js", "text/javascript"),
        ("/console/assets/api.js", "text/javascript"),
        ("/console/assets/dom.js", "text/javascript"),
        ("/console/assets/chart.js", "text/javascript"),
        ("/console/assets/console.css", "text/css"),
        ("/console/assets/favicon.svg", "image/svg+xml"),
    ];
    for (path, content_type) in pages {
        let r = server
            .client
            .get(format!("{}{path}", server.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers();
        assert!(
            h["content-type"]
                .to_str()
                .unwrap()
                .starts_with(content_type),
            "{path}"
        );
        assert_eq!(h["content-security-policy"], callbackd::http::console::CSP);
        assert!(
            h["content-security-policy"]
                .to_str()
                .unwrap()
                .starts_with("default-src 'self';")
        );
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h["x-content-type-options"], "nosniff");
        let text = r.text().await.unwrap();
        if content_type == "text/html" {
            assert!(!text.contains("<style"), "no inline style in {path}");
            assert!(!text.contains(" style="), "no style attribute in {path}");
            for script in text.split("<script").skip(1) {
                let tag = &script[..script.find('>').unwrap()];
                assert!(
                    tag.contains("src=\"/console/assets/"),
                    "inline script in {path}"
                );
            }
        }
        if content_type == "text/javascript" {
            assert!(!text.contains("innerHTML"), "{path} writes markup");
            assert!(!text.contains("eval("), "{path} evaluates code");
        }
    }
    let missing = server
        .client
        .get(format!("{}/console/assets/secrets.toml", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.headers()["x-frame-options"], "DENY");
    server.stop().await;
}

/// `dryRun: true` counts what a resend would deliver again and changes nothing: no attempt,
/// no history row, and its requestId is not used up.
#[tokio::test]
async fn resend_dry_run_counts_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (server, clock, d) = virtual_server(&sqlite_url(&dir), |_| {}).await;
    let sink = path_sink().await;
    let mut dead = Vec::new();
    for p in ["p-d1", "p-d2", "p-d3"] {
        dead.push(
            server
                .hand_off_id(&handoff(p, "approved", &format!("{}/gone", sink.url)))
                .await,
        );
    }
    server
        .hand_off_id(&handoff("p-fine", "approved", &format!("{}/ok", sink.url)))
        .await;
    d.tick().await;
    assert_eq!(sink.count(), 4);
    let from = callbackd::clock::format_iso(clock.now_ms() - 3_600_000);
    let selection =
        json!({"state": "dead", "createdAtFrom": from, "dryRun": true, "requestId": "r-1"});
    let r = server.admin_post("/v1/admin/resend", &selection).await;
    assert_eq!(r.status(), 200);
    let count: Value = r.json().await.unwrap();
    assert_eq!(
        count,
        json!({"resent": 0, "messageIds": [], "dryRun": true, "wouldResend": 3, "more": false})
    );
    let by_ids =
        json!({"messageIds": [dead[0], "msg_0000000000000000000000000000"], "dryRun": true});
    let r = server.admin_post("/v1/admin/resend", &by_ids).await;
    assert_eq!(r.json::<Value>().await.unwrap()["wouldResend"], 1);
    for id in &dead {
        let v = view(&server, id).await;
        assert_eq!(v["state"], "dead");
        assert_eq!(v["historyTotal"], 1, "a dry run records nothing");
    }
    d.tick().await;
    assert_eq!(sink.count(), 4, "a dry run delivers nothing");

    let mut real = selection.clone();
    real["dryRun"] = json!(false);
    let r = server.admin_post("/v1/admin/resend", &real).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("idempotent-replayed").is_none());
    assert_eq!(r.json::<Value>().await.unwrap()["resent"], 3);
    d.tick().await;
    assert_eq!(sink.count(), 7);
    server.stop().await;
}

/// A delivered message past its retention that the sweeper has not reached yet is gone: the
/// resend skips it, so the dry run must not count it either (it once had its own copy of the
/// skip rule, without the retention).
async fn a_dry_run_skips_a_message_past_its_retention(store_url: &str) {
    let (server, clock, d) = virtual_server(store_url, |cfg| {
        cfg.store.sweep_interval_secs = 86_400;
    })
    .await;
    let sink = path_sink().await;
    let id = server
        .hand_off_id(&handoff("p-old", "approved", &format!("{}/ok", sink.url)))
        .await;
    d.tick().await;
    assert_eq!(view(&server, &id).await["state"], "delivered");
    let retention_ms = server.app.settings.store.dedupe_ttl.as_millis() as i64;
    clock.set(clock.now_ms() + retention_ms + 1_000);
    for selection in [
        json!({"messageIds": [id], "dryRun": true}),
        json!({"paymentId": "p-old", "dryRun": true}),
    ] {
        let r = server.admin_post("/v1/admin/resend", &selection).await;
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.json::<Value>().await.unwrap()["wouldResend"],
            0,
            "{selection}"
        );
    }
    let r = server
        .admin_post("/v1/admin/resend", &json!({"messageIds": [id]}))
        .await;
    assert_eq!(
        r.json::<Value>().await.unwrap()["resent"],
        0,
        "the resend skips it"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_dry_run_skips_a_message_past_its_retention_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    a_dry_run_skips_a_message_past_its_retention(&sqlite_url(&dir)).await;
}

#[tokio::test]
async fn a_dry_run_skips_a_message_past_its_retention_on_redis() {
    let redis = RedisServer::start();
    a_dry_run_skips_a_message_past_its_retention(&redis.url()).await;
}

/// The first Standard Webhooks vector of `tests/vectors/signatures.json` (made by the
/// `standardwebhooks` package): its secret signs the alerts here, and the verifier that
/// checks them must accept the vector first.
fn vector_checked_verifier() -> (String, Verifier) {
    let vectors: Value =
        serde_json::from_str(include_str!("vectors/signatures.json")).expect("vectors");
    let v = &vectors["standard_webhooks"][0];
    let secret = v["secret"].as_str().unwrap().to_string();
    let verifier = Verifier::StandardWebhooks {
        secrets: vec![decode_whsec(&secret).unwrap()],
        tolerance_secs: 300,
    };
    let mut headers = HeaderMap::new();
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        headers.insert(name, v[name].as_str().unwrap().parse().unwrap());
    }
    let ts: i64 = v["webhook-timestamp"].as_str().unwrap().parse().unwrap();
    verifier
        .verify(&headers, v["body"].as_str().unwrap().as_bytes(), ts)
        .expect("the verifier accepts the independent vector");
    (secret, verifier)
}

fn alerts_to(sink: &Sink, secret: &str) -> AlertsConfig {
    AlertsConfig {
        webhook_url: format!("{}/alerts", sink.url),
        secret: secret.to_string(),
        console_url: Some("https://ops.example.com/".into()),
        // The sink is on 127.0.0.1.
        allow_private_webhook_url: true,
        digest_interval_secs: 60,
        max_alerts_per_interval: 10,
    }
}

/// A notification the receiver refuses with 410 is dead; its alert is a stored message that
/// is retried until the alert receiver takes it, signed each time, carrying what an operator
/// needs and a link to the console page.
#[tokio::test]
async fn a_dead_letter_is_announced_by_a_signed_durable_alert() {
    let dir = tempfile::tempdir().unwrap();
    let (secret, verifier) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, n| Reply::status(if n == 0 { 503 } else { 204 })).await;
    let (server, clock, d) = virtual_server(&sqlite_url(&dir), |c| {
        c.alerts = Some(alerts_to(&alert_sink, &secret));
    })
    .await;
    let sink = path_sink().await;
    let dead = server
        .hand_off_id(&handoff(
            "p-alert",
            "approved",
            &format!("{}/gone", sink.url),
        ))
        .await;
    d.tick().await;
    assert_eq!(view(&server, &dead).await["state"], "dead");
    assert_eq!(
        alert_sink.count(),
        1,
        "the alert went out with the same tick"
    );
    let first = alert_sink.received()[0].clone();
    let alert_id = first.header("webhook-id").expect("webhook-id");
    let alert = view(&server, &alert_id).await;
    assert_eq!(
        alert["state"], "pending",
        "the refused alert waits for its retry"
    );
    assert_eq!(alert["event"], "message.dead");

    clock.advance(1_000);
    d.tick().await;
    assert_eq!(alert_sink.count(), 2);
    assert_eq!(view(&server, &alert_id).await["state"], "delivered");
    for received in alert_sink.received() {
        assert_eq!(received.uri, "/alerts");
        assert_eq!(
            received.header("webhook-id").as_deref(),
            Some(alert_id.as_str())
        );
        let ts: i64 = received
            .header("webhook-timestamp")
            .unwrap()
            .parse()
            .unwrap();
        verifier
            .verify(&received.headers, received.body.as_bytes(), ts)
            .expect("a valid Standard Webhooks signature");
        let mut tampered = received.body.clone();
        tampered.push(' ');
        assert!(
            verifier
                .verify(&received.headers, tampered.as_bytes(), ts)
                .is_err()
        );
        assert_eq!(
            received.header("x-callback-event").as_deref(),
            Some("message.dead")
        );
    }
    let body = first.json();
    assert_eq!(body["type"], "message.dead");
    let data = &body["data"];
    assert_eq!(data["messageId"], dead.as_str());
    assert_eq!(data["kind"], "notification");
    assert_eq!(data["paymentId"], "p-alert");
    assert_eq!(data["reason"], "gone");
    assert_eq!(data["attempts"], 1);
    assert_eq!(data["lastStatus"], 410);
    assert_eq!(
        data["consoleUrl"],
        format!("https://ops.example.com/console/messages/{dead}")
    );
    server.stop().await;
}

/// An inbound callback whose window runs out is announced with its source and transaction
/// id; an alert that dies itself (its receiver answers 410) is not announced.
#[tokio::test]
async fn an_expired_callback_is_announced_and_a_dead_alert_is_not() {
    let redis = RedisServer::start();
    let (secret, _) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, _| Reply::status(410)).await;
    let target = path_sink().await;
    let (server, clock, d) = virtual_server(&redis.url(), |c| {
        c.alerts = Some(alerts_to(&alert_sink, &secret));
        c.dispatch.max_age_secs = 10;
        c.sources.get_mut("payzu").unwrap().forward_url = Some(format!("{}/down", target.url));
    })
    .await;
    let body =
        r#"{"id":"tx:alert","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":9.9}"#;
    let r = server.post_callback("payzu", body, None).await;
    assert_eq!(r.status(), 200);
    d.tick().await;
    // Retries until the 10 s window is over, then the message is dead.
    let mut deaths = 0;
    for _ in 0..100 {
        if deaths > 0 {
            break;
        }
        clock.advance(1_000);
        d.tick().await;
        let page: Value = server
            .admin_get("/v1/messages?state=dead&source=payzu")
            .await
            .json()
            .await
            .unwrap();
        deaths = page["messages"].as_array().unwrap().len();
    }
    assert_eq!(deaths, 1, "the callback died when its window ran out");
    assert_eq!(alert_sink.count(), 1);
    let data = alert_sink.received()[0].json()["data"].clone();
    assert_eq!(data["kind"], "inbound");
    assert_eq!(data["source"], "payzu");
    assert_eq!(data["transactionId"], "tx:alert");
    assert_eq!(data["reason"], "expired");
    assert_eq!(data["lastStatus"], 503);
    assert!(data["attempts"].as_u64().unwrap() > 1);
    assert!(data.get("paymentId").is_none());

    // The alert itself was refused with 410: dead, and nothing announces it.
    let alert_id = alert_sink.received()[0].header("webhook-id").unwrap();
    assert_eq!(view(&server, &alert_id).await["state"], "dead");
    clock.advance(60_000);
    d.tick().await;
    assert_eq!(alert_sink.count(), 1);
    let all: Value = server.admin_get("/v1/messages").await.json().await.unwrap();
    assert_eq!(all["messages"].as_array().unwrap().len(), 2);
    server.stop().await;
}

/// A gateway signs its `callbackUrl` in the query. The receiver gets the URL byte for byte,
/// but no view shows the query's values: not the API's `targetUrl` (detail and list, which the
/// console's Target field shows), nor the `message.dead` alert.
#[tokio::test]
async fn a_signed_callback_url_is_delivered_exactly_and_shown_redacted() {
    const SECRET_QUERY: &str = "X-VTEX-signature=sig%2Fs3cret&an=AppKey-7";
    let dir = tempfile::tempdir().unwrap();
    let (secret, _) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, _| Reply::status(204)).await;
    let (server, _clock, d) = virtual_server(&sqlite_url(&dir), |c| {
        c.alerts = Some(alerts_to(&alert_sink, &secret));
    })
    .await;
    let sink = path_sink().await;
    let url = format!("{}/gone?{SECRET_QUERY}", sink.url);
    let id = server
        .hand_off_id(&handoff("p-signed-url", "approved", &url))
        .await;
    d.tick().await;
    assert_eq!(sink.count(), 1);
    assert_eq!(sink.received()[0].uri, format!("/gone?{SECRET_QUERY}"));
    let shown = format!(
        "{}/gone?X-VTEX-signature=[redacted]&an=[redacted]",
        sink.url
    );

    let detail = server.admin_get(&format!("/v1/messages/{id}")).await;
    let detail = detail.text().await.unwrap();
    let view: Value = serde_json::from_str(&detail).unwrap();
    assert_eq!(view["targetUrl"], shown.as_str());
    let list = server
        .admin_get("/v1/messages?paymentId=p-signed-url")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&list).unwrap()["messages"][0]["targetUrl"],
        shown.as_str()
    );
    assert_eq!(alert_sink.count(), 1);
    let alert = &alert_sink.received()[0];
    assert_eq!(alert.json()["data"]["targetUrl"], shown.as_str());
    for text in [&detail, &list, &alert.body] {
        assert!(
            !text.contains("s3cret") && !text.contains("AppKey-7"),
            "{text}"
        );
    }
    server.stop().await;
}

/// `alerts.allow_private_webhook_url` lets alerts reach an internal receiver (the sink on
/// 127.0.0.1) while `dispatch.allow_private_networks` stays off: the alert is delivered, and a
/// connector's `callbackUrl` on the same address is still refused.
#[tokio::test]
async fn an_allowed_private_alert_url_is_delivered_without_opening_callback_urls() {
    let dir = tempfile::tempdir().unwrap();
    let (secret, _) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, _| Reply::status(204)).await;
    let target = path_sink().await;
    let (server, _clock, d) = virtual_server(&sqlite_url(&dir), |c| {
        c.dispatch.allow_private_networks = false;
        c.alerts = Some(alerts_to(&alert_sink, &secret));
        // The source's own switch lets its forward reach the sink, which answers 410.
        c.sources.get_mut("payzu").unwrap().forward_url = Some(format!("{}/gone", target.url));
    })
    .await;
    let body = r#"{"id":"tx:private-alert","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":1}"#;
    assert_eq!(
        server.post_callback("payzu", body, None).await.status(),
        200
    );
    d.tick().await;
    assert_eq!(target.count(), 1);
    assert_eq!(
        alert_sink.count(),
        1,
        "the alert reached the internal receiver"
    );
    let alert_id = alert_sink.received()[0].header("webhook-id").unwrap();
    assert_eq!(view(&server, &alert_id).await["state"], "delivered");
    assert_eq!(
        alert_sink.received()[0].json()["data"]["transactionId"],
        "tx:private-alert"
    );

    let refused = server
        .notify(&handoff(
            "p-internal",
            "approved",
            &format!("{}/ok", target.url),
        ))
        .await;
    assert_eq!(refused.status(), 400, "callbackUrls are still guarded");
    server.stop().await;
}

/// 1,000 messages dying at once: the first 10 of the minute are announced one by one, the
/// rest by one `message.dead.digest` when the minute is over, with counts and a link to the
/// dead-letter list. A few webhooks, which together account for every death.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_deaths_at_once_are_a_few_alerts_that_account_for_all() {
    const DEATHS: usize = 1_000;
    let redis = RedisServer::start();
    let (secret, verifier) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, _| Reply::status(204)).await;
    let (server, clock, d) = virtual_server(&redis.url(), |c| {
        c.alerts = Some(alerts_to(&alert_sink, &secret));
    })
    .await;
    let sink = path_sink().await;
    let gone = format!("{}/gone", sink.url);
    for chunk in 0..DEATHS / 50 {
        let handoffs = (0..50).map(|i| {
            let body = handoff(&format!("p-storm-{chunk}-{i}"), "approved", &gone);
            let server = &server;
            async move {
                assert_eq!(server.notify(&body).await.status(), 202);
            }
        });
        futures::future::join_all(handoffs).await;
    }
    d.tick().await;
    assert_eq!(sink.count(), DEATHS);
    assert_eq!(server.app.store.depth().await.unwrap().dead, DEATHS as u64);
    assert_eq!(alert_sink.count(), 10, "the cap's alerts went out at once");

    clock.advance(60_000);
    d.tick().await;
    let received = alert_sink.received();
    assert!(received.len() <= 30, "{} webhooks", received.len());
    let mut announced = 0;
    let mut digests = 0;
    for r in &received {
        let ts: i64 = r.header("webhook-timestamp").unwrap().parse().unwrap();
        verifier
            .verify(&r.headers, r.body.as_bytes(), ts)
            .expect("every alert is signed");
        let body = r.json();
        match body["type"].as_str().unwrap() {
            "message.dead" => announced += 1,
            "message.dead.digest" => {
                digests += 1;
                let data = &body["data"];
                let count = data["count"].as_u64().unwrap();
                assert_eq!(data["reasons"]["gone"], count);
                assert_eq!(data["messageIds"].as_array().unwrap().len(), 20);
                assert_eq!(
                    data["consoleUrl"],
                    "https://ops.example.com/console/messages?state=dead"
                );
                assert_eq!(
                    r.header("x-callback-event").as_deref(),
                    Some("message.dead.digest")
                );
                announced += count;
            }
            other => panic!("unexpected alert {other}"),
        }
    }
    assert_eq!(digests, 1);
    assert_eq!(announced, DEATHS as u64, "every death is accounted for");
    server.stop().await;
}

/// A window's digest lives in the process until the window ends; a process that stops
/// records it first (the next process delivers it), so a graceful restart loses no count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_process_records_its_open_windows_digest() {
    let dir = tempfile::tempdir().unwrap();
    let (secret, _) = vector_checked_verifier();
    let alert_sink = Sink::start(|_, _| Reply::status(204)).await;
    let (server, _clock) = support::virtual_loop_server(&sqlite_url(&dir), |c| {
        let mut alerts = alerts_to(&alert_sink, &secret);
        alerts.max_alerts_per_interval = 0;
        c.alerts = Some(alerts);
    })
    .await;
    let sink = path_sink().await;
    for n in 0..3 {
        server
            .hand_off_id(&handoff(
                &format!("p-stop-{n}"),
                "approved",
                &format!("{}/gone", sink.url),
            ))
            .await;
    }
    let store = server.app.store.clone();
    support::eventually(10, "three deaths", || async {
        (store.depth().await.unwrap().dead == 3).then_some(())
    })
    .await;
    assert_eq!(alert_sink.count(), 0, "the window is still open");
    server.stop().await;
    let page = store
        .list(&callbackd::store::ListFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap();
    let digests: Vec<Value> = page
        .messages
        .iter()
        .filter(|r| r.message.event.as_deref() == Some("message.dead.digest"))
        .map(|r| serde_json::from_str(&r.message.body).unwrap())
        .collect();
    assert_eq!(digests.len(), 1, "one digest recorded at the stop");
    assert_eq!(digests[0]["data"]["count"], 3);
}

fn trace_of(received: &support::sink::Received) -> TraceParent {
    TraceParent::parse(&received.header("traceparent").expect("traceparent sent"))
        .expect("a valid traceparent")
}

/// The `traceparent` of a hand-off and of a provider callback reaches every delivery of its
/// message: the same trace and flags, a new span per attempt; `tracestate` goes along. An
/// invalid one is not passed on.
#[tokio::test]
async fn traceparent_travels_from_the_request_to_each_delivery() {
    const INBOUND: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let dir = tempfile::tempdir().unwrap();
    let sink = Sink::start(|r, _| Reply::status(if r.uri == "/flaky" { 503 } else { 204 })).await;
    let (server, clock, d) = virtual_server(&sqlite_url(&dir), |c| {
        c.sources.get_mut("payzu").unwrap().forward_url = Some(format!("{}/forward", sink.url));
    })
    .await;
    let handed = |path: &str, traceparent: &str| {
        server
            .client
            .post(format!("{}/v1/notifications", server.url))
            .bearer_auth(support::CONNECTOR_TOKEN)
            .header("traceparent", traceparent)
            .header("tracestate", "acme=7")
            .json(&handoff(
                "p-trace",
                "approved",
                &format!("{}{path}", sink.url),
            ))
            .send()
    };
    assert_eq!(handed("/flaky", INBOUND).await.unwrap().status(), 202);
    d.tick().await;
    clock.advance(1_000);
    d.tick().await;
    let attempts = sink.received();
    assert_eq!(attempts.len(), 2);
    let inbound = TraceParent::parse(INBOUND).unwrap();
    let spans: Vec<TraceParent> = attempts.iter().map(trace_of).collect();
    for span in &spans {
        assert_eq!(span.trace_id, inbound.trace_id);
        assert_eq!(span.flags, "01");
        assert_ne!(span.parent_id, inbound.parent_id);
    }
    assert_ne!(
        spans[0].parent_id, spans[1].parent_id,
        "a new span per attempt"
    );
    assert_eq!(attempts[0].header("tracestate").as_deref(), Some("acme=7"));

    // A provider callback forwarded to the merchant.
    let body =
        r#"{"id":"tx-trace","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":1}"#;
    let signature = callbackd::webhook::sign_payzu(
        support::PAYZU_SECRET.as_bytes(),
        server.app.clock.now_secs(),
        body.as_bytes(),
    );
    let r = server
        .client
        .post(format!("{}/v1/callbacks/payzu", server.url))
        .header("x-callback-signature", signature)
        .header(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        )
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    d.tick().await;
    let forwarded = sink
        .received()
        .into_iter()
        .find(|r| r.uri == "/forward")
        .unwrap();
    let span = trace_of(&forwarded);
    assert_eq!(span.trace_id, "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(span.flags, "00");

    // An invalid traceparent is dropped.
    let r = server
        .client
        .post(format!("{}/v1/notifications", server.url))
        .bearer_auth(support::CONNECTOR_TOKEN)
        .header(
            "traceparent",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        )
        .json(&handoff(
            "p-untraced",
            "approved",
            &format!("{}/plain", sink.url),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    d.tick().await;
    let plain = sink
        .received()
        .into_iter()
        .find(|r| r.uri == "/plain")
        .unwrap();
    assert_eq!(plain.header("traceparent"), None);
    server.stop().await;
}

/// `/healthz` judges the store's silence by the machine's monotonic time, not the app clock: a
/// virtual clock moved past `store.healthz_fails_after_secs` does not fail it.
#[tokio::test]
async fn healthz_is_not_failed_by_a_clock_jump() {
    let dir = tempfile::tempdir().unwrap();
    let (server, clock, _d) = virtual_server(&sqlite_url(&dir), |_| {}).await;
    // The store watch's first ping, before the jump (the next comes a second later).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    clock.set(clock.now_ms() + 40 * 86_400_000);
    let r = server
        .client
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    server.stop().await;
}
