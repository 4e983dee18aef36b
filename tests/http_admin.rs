//! Operator surface over HTTP against a private Redis: inspect, list, resend, roles,
//! metrics, OpenAPI, CLI, log hygiene (issue: the ops surface).

mod support;

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use callbackd::clock::Clock;
use callbackd::dispatch::Dispatcher;
use futures::StreamExt;
use serde_json::{Value, json};
use support::redis::RedisServer;
use support::sink::{Reply, Sink};
use support::{
    ADMIN_TOKEN, CONNECTOR_TOKEN, TestServer, config, eventually, handoff, virtual_server,
};

async fn view(server: &TestServer, id: &str) -> Value {
    let r = server.admin_get(&format!("/v1/messages/{id}")).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Drives one message through failed attempts until it is dead.
async fn kill_message(
    server: &TestServer,
    clock: &callbackd::clock::ManualClock,
    d: &Arc<Dispatcher>,
    id: &str,
) {
    d.tick().await;
    loop {
        let v = view(server, id).await;
        if v["state"] == "dead" {
            return;
        }
        let next = callbackd::clock::parse_rfc3339(v["nextAttemptAt"].as_str().unwrap()).unwrap();
        clock.set(next.max(clock.now_ms()));
        d.tick().await;
    }
}

#[tokio::test]
async fn inspect_a_message_that_failed_three_times() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |c| c.dispatch.max_age_secs = 3600).await;
    let sink = Sink::start(|_, n| Reply::status(if n < 3 { 503 } else { 204 })).await;
    let body = json!({"paymentId": "p-i", "status": "approved", "callbackUrl": format!("{}/cb", sink.url),
        "headers": {"X-VTEX-API-AppToken": "super-secret-app-token"}});
    let id = server.hand_off_id(&body).await;
    let id = id.as_str();
    for _ in 0..3 {
        d.tick().await;
        let v = view(&server, id).await;
        let next = callbackd::clock::parse_rfc3339(v["nextAttemptAt"].as_str().unwrap()).unwrap();
        clock.set(next);
    }
    let v = view(&server, id).await;
    assert_eq!(v["state"], "pending");
    assert_eq!(v["attemptCount"], 3);
    let attempts = v["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 3);
    for (i, a) in attempts.iter().enumerate() {
        assert_eq!(a["status"], 503);
        assert_eq!(a["attempt"], i + 1);
        assert!(a["latencyMs"].is_u64());
    }
    assert_eq!(v["headers"]["X-VTEX-API-AppToken"], "[redacted]");
    assert!(!v.to_string().contains("super-secret-app-token"));
    assert_eq!(v["paymentId"], "p-i");
    assert_eq!(v["kind"], "notification");
    d.tick().await;
    let v = view(&server, id).await;
    assert_eq!(v["state"], "delivered");
    assert_eq!(v["attempts"][3]["status"], 204);

    let missing = server
        .admin_get("/v1/messages/msg_000000000000000000000000000000")
        .await;
    assert_eq!(missing.status(), 404);
    assert_eq!(missing.json::<Value>().await.unwrap()["error"], "not_found");
    // Well formed, in partition 0xff, which a store of the default 64 does not have.
    let elsewhere = server
        .admin_get("/v1/messages/msg_000000000001ff00000000000000")
        .await;
    assert_eq!(elsewhere.status(), 404);
    assert_eq!(
        server.admin_get("/v1/messages/../../etc").await.status(),
        404
    );
}

/// A receiver that fails forever: the API keeps the first attempt and the latest 100, shows
/// the totals, and list pages carry the totals without any attempt.
#[tokio::test]
async fn a_hostile_receivers_history_is_bounded_in_the_api() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |_| {}).await;
    let sink = Sink::start(|_, _| Reply::status(503)).await;
    let id = server
        .hand_off_id(&handoff("p-h", "approved", &format!("{}/cb", sink.url)))
        .await;
    for _ in 0..150 {
        d.tick().await;
        let v = view(&server, &id).await;
        let next = callbackd::clock::parse_rfc3339(v["nextAttemptAt"].as_str().unwrap()).unwrap();
        clock.set(next);
    }
    let v = view(&server, &id).await;
    assert_eq!(v["attemptCount"], 150);
    assert_eq!(v["historyTotal"], 150);
    let attempts = v["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 101);
    assert_eq!(attempts[0]["attempt"], 1);
    assert_eq!(attempts[1]["attempt"], 51);
    assert_eq!(attempts[100]["attempt"], 150);

    let page: Value = server
        .admin_get("/v1/messages?paymentId=p-h")
        .await
        .json()
        .await
        .unwrap();
    let listed = &page["messages"][0];
    assert_eq!(listed["historyTotal"], 150);
    assert_eq!(listed["attemptCount"], 150);
    assert_eq!(listed["attempts"], json!([]), "list pages load no history");
}

#[tokio::test]
async fn dead_letters_paginate_without_gaps_or_duplicates_while_new_ones_arrive() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |c| c.dispatch.max_age_secs = 3600).await;
    let sink = Sink::start(|_, _| Reply::status(410)).await;
    let url = format!("{}/cb", sink.url);
    for i in 0..23 {
        clock.advance(1);
        assert_eq!(
            server
                .notify(&handoff(&format!("dl-{i}"), "approved", &url))
                .await
                .status(),
            202
        );
    }
    d.tick().await;
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut path = "/v1/messages?state=dead&limit=5".to_string();
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let page: Value = server.admin_get(&path).await.json().await.unwrap();
        for m in page["messages"].as_array().unwrap() {
            assert_eq!(m["state"], "dead");
            seen.push(m["id"].as_str().unwrap().to_string());
        }
        pages += 1;
        // New dead letters arrive between pages.
        if pages == 2 {
            for i in 0..4 {
                clock.advance(1);
                server
                    .notify(&handoff(&format!("late-{i}"), "approved", &url))
                    .await;
            }
            d.tick().await;
        }
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "no duplicates");
    assert_eq!(
        seen.len(),
        27,
        "no gaps: the 23 and the 4 that arrived meanwhile"
    );
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(sorted, seen, "oldest first");

    for bad in [
        "state=zombie",
        "limit=0",
        "limit=5000",
        "cursor=%%%",
        "cursor=",
        "createdAtFrom=yesterday",
    ] {
        let r = server.admin_get(&format!("/v1/messages?{bad}")).await;
        assert_eq!(r.status(), 400, "{bad}");
        let field = bad.split('=').next().unwrap();
        let message = r.json::<Value>().await.unwrap()["message"].to_string();
        assert!(message.contains(&format!("`{field}`")), "{bad}: {message}");
    }
    // Filters combine: no message has both a payment and a provider transaction.
    let r = server
        .admin_get("/v1/messages?paymentId=dl-1&transactionId=tx-1&source=payzu")
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["messages"], json!([]));
    let one: Value = server
        .admin_get("/v1/messages?paymentId=dl-1")
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(one["messages"].as_array().unwrap().len(), 1);
}

/// São Paulo operators write offsets; a bare date is refused with the forms that work.
#[tokio::test]
async fn time_filters_take_any_offset_and_refuse_a_bare_date() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let r = server
        .post_callback("payzu", r#"{"id":"tx-br","status":"PAID"}"#, None)
        .await;
    assert_eq!(r.status(), 200);
    let brazil = time::UtcOffset::from_hms(-3, 0, 0).unwrap();
    let at = |offset_ms: i64| {
        let now = time::OffsetDateTime::now_utc() + time::Duration::milliseconds(offset_ms);
        now.to_offset(brazil)
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap()
    };
    let count = |query: String| {
        let server = &server;
        async move {
            let r = server.admin_get(&format!("/v1/messages?{query}")).await;
            assert_eq!(r.status(), 200, "{query}");
            let page: Value = r.json().await.unwrap();
            page["messages"].as_array().unwrap().len()
        }
    };
    let hour = 3_600_000;
    let from = at(-hour).replace('+', "%2B");
    assert!(from.ends_with("-03:00"), "{from}");
    assert_eq!(count(format!("createdAtFrom={from}")).await, 1);
    assert_eq!(count(format!("createdAtFrom={}", at(hour))).await, 0);
    assert_eq!(count(format!("createdAtTo={}", at(-hour))).await, 0);
    assert_eq!(
        count(format!("createdAtFrom={from}&createdAtTo={}", at(hour))).await,
        1
    );

    let r = server
        .admin_get("/v1/messages?createdAtFrom=2026-11-30")
        .await;
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("createdAtFrom") && message.contains("-03:00"),
        "{message}"
    );
}

#[tokio::test]
async fn resend_by_id_payment_and_window_with_request_id() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |c| {
        c.dispatch.max_age_secs = 3600;
        // Killing three messages takes ~28 failures to one host: past the breaker's default
        // threshold, which would hold the resends back (tests/host_protection.rs covers that).
        c.dispatch.breaker.failures = 1_000;
    })
    .await;
    let sink = Sink::start(|_, _| Reply::status(500)).await;
    let url = format!("{}/cb", sink.url);
    let mut ids = Vec::new();
    for i in 0..3 {
        let a: Value = server
            .notify(&handoff(&format!("r-{i}"), "approved", &url))
            .await
            .json()
            .await
            .unwrap();
        ids.push(a["notificationId"].as_str().unwrap().to_string());
    }
    for id in &ids {
        kill_message(&server, &clock, &d, id).await;
    }
    let before = sink.count();

    // By id.
    let r = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [ids[0]], "requestId": "op-1"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let first = r.text().await.unwrap();
    let answer: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(answer["resent"], 1);
    // The same requestId returns the stored answer and resends nothing.
    let again = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [ids[0]], "requestId": "op-1"}),
        )
        .await;
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first);
    d.tick().await;
    assert_eq!(sink.count(), before + 1, "resent exactly once");
    let v = view(&server, &ids[0]).await;
    assert_eq!(v["state"], "pending", "a fresh window after the resend");
    let marks: Vec<&Value> = v["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == "resend")
        .collect();
    assert_eq!(marks.len(), 1);
    assert_eq!(marks[0]["requestId"], "op-1");

    // Ids are narrowed by the other filters: of a pending and a dead one, `state: dead`
    // resends the dead one; `source` matches no notification.
    let r: Value = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [ids[0], ids[1]], "state": "dead"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["messageIds"], json!([ids[1]]), "{r}");
    let r: Value = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [ids[2]], "source": "payzu"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["resent"], 0, "{r}");
    assert_eq!(view(&server, &ids[2]).await["state"], "dead");

    // A malformed id is named, and nothing is resent.
    let history_before = view(&server, &ids[2]).await["historyTotal"].clone();
    let r = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [ids[2], "msg_nope"]}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let err: Value = r.json().await.unwrap();
    assert_eq!(err["error"], "invalid_query");
    let message = err["message"].as_str().unwrap();
    assert!(
        message.contains("messageIds[1]") && message.contains("msg_nope"),
        "{message}"
    );
    let v = view(&server, &ids[2]).await;
    assert_eq!(v["state"], "dead");
    assert_eq!(v["historyTotal"], history_before, "nothing recorded");

    // By paymentId.
    let r: Value = server
        .admin_post("/v1/admin/resend", &json!({"paymentId": "r-1"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["messageIds"], json!([ids[1]]));

    // By window, narrowed by state.
    let first_created = callbackd::store::MessageId::parse(&ids[0])
        .unwrap()
        .created_at();
    let from = callbackd::clock::format_iso(first_created);
    let r: Value = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"createdAtFrom": from, "state": "dead"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["messageIds"], json!([ids[2]]), "only the one still dead");

    for no_selector in [
        json!({"state": "dead"}),
        json!({}),
        json!({"paymentId": null}),
    ] {
        let none = server.admin_post("/v1/admin/resend", &no_selector).await;
        assert_eq!(none.status(), 400, "{no_selector}");
        assert_eq!(none.json::<Value>().await.unwrap()["error"], "no_selector");
    }
    // A payment and a transaction together select nothing: answered, not refused.
    let r: Value = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"paymentId": "r-0", "transactionId": "tx-1", "source": "payzu"}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["resent"], 0);
}

#[tokio::test]
async fn resend_of_a_pending_message_keeps_its_schedule() {
    let redis = RedisServer::start();
    let (server, _clock, d) =
        virtual_server(&redis.url(), |c| c.dispatch.max_age_secs = 3600).await;
    let sink = Sink::start(|_, _| Reply::status(503)).await;
    let id = server
        .hand_off_id(&handoff("r-p", "approved", &format!("{}/cb", sink.url)))
        .await;
    let id = id.as_str();
    d.tick().await;
    d.tick().await;
    let scheduled = view(&server, id).await["nextAttemptAt"].clone();
    let r: Value = server
        .admin_post("/v1/admin/resend", &json!({"messageIds": [id]}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["resent"], 1);
    d.tick().await;
    assert_eq!(sink.count(), 2, "delivered once more, now");
    let v = view(&server, id).await;
    assert_eq!(
        v["nextAttemptAt"], scheduled,
        "the automatic schedule goes on unchanged"
    );
    assert_eq!(v["state"], "pending");
}

/// Resend marks of `requestId` in a message's history, read from the store.
async fn marks_of(store: &dyn callbackd::store::Store, id: &str, request_id: &str) -> usize {
    let id = callbackd::store::MessageId::parse(id).unwrap();
    let record = store.get(&id).await.unwrap().expect("message exists");
    record
        .history
        .iter()
        .filter_map(|row| row.resend())
        .filter(|mark| mark.request_id.as_deref() == Some(request_id))
        .count()
}

/// Repeats a resend until its `requestId` has an answer (409 while it runs).
async fn recorded_answer(
    client: &reqwest::Client,
    base: &str,
    body: &Value,
) -> (reqwest::header::HeaderMap, String) {
    eventually(30, "the resend's answer is recorded", || async {
        let r = client
            .post(format!("{base}/v1/admin/resend"))
            .bearer_auth(ADMIN_TOKEN)
            .json(body)
            .send()
            .await
            .ok()?;
        if r.status() == 409 {
            return None;
        }
        assert_eq!(r.status(), 200, "a repeat gets the recorded answer");
        Some((r.headers().clone(), r.text().await.unwrap()))
    })
    .await
}

#[tokio::test]
async fn a_request_id_reused_with_another_selection_is_422() {
    let redis = RedisServer::start();
    let (server, _clock, _d) = virtual_server(&redis.url(), |_| {}).await;
    let sink = Sink::ok().await;
    let url = format!("{}/cb", sink.url);
    let a = server
        .hand_off_id(&handoff("reuse-a", "approved", &url))
        .await;
    let b = server
        .hand_off_id(&handoff("reuse-b", "approved", &url))
        .await;

    let first = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [a], "requestId": "op-reuse"}),
        )
        .await;
    assert_eq!(first.status(), 200);
    let first = first.text().await.unwrap();

    let other = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [b], "requestId": "op-reuse"}),
        )
        .await;
    assert_eq!(other.status(), 422);
    let error: Value = other.json().await.unwrap();
    assert_eq!(error["error"], "idempotency_key_reused", "{error}");
    let store = &*server.app.store;
    assert_eq!(marks_of(store, &b, "op-reuse").await, 0, "b was not resent");

    // The same selection written differently (a repeated id) is the same request.
    let same = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"requestId": "op-reuse", "messageIds": [a, a]}),
        )
        .await;
    assert_eq!(same.status(), 200);
    assert_eq!(same.headers()["idempotent-replayed"], "true");
    assert_eq!(same.text().await.unwrap(), first);
    assert_eq!(marks_of(store, &a, "op-reuse").await, 1);
}

/// Issue 22, item 5: a resend `requestId` follows the rule of `Idempotency-Key` (1 to 256
/// visible ASCII characters, as the document says); anything else is a 400 naming it, and
/// changes nothing in the store.
#[tokio::test]
async fn a_resend_request_id_is_bounded_like_an_idempotency_key() {
    let redis = RedisServer::start();
    let (server, _clock, _d) = virtual_server(&redis.url(), |_| {}).await;
    let sink = Sink::ok().await;
    let id = server
        .hand_off_id(&handoff("rid-1", "approved", &format!("{}/cb", sink.url)))
        .await;
    let store = &*server.app.store;
    let parsed = callbackd::store::MessageId::parse(&id).unwrap();
    let before = store.get(&parsed).await.unwrap().expect("the message");

    let spec: Value = server
        .admin_get("/openapi.json")
        .await
        .json()
        .await
        .unwrap();
    let documented = &spec["components"]["schemas"]["ResendRequest"]["properties"]["requestId"];
    assert_eq!(
        (&documented["minLength"], &documented["maxLength"]),
        (&json!(1), &json!(256)),
        "{documented}"
    );
    let pattern = documented["pattern"].as_str().expect("a pattern");
    assert_eq!(pattern, callbackd::http::openapi::HEADER_TEXT);

    let megabyte = "r".repeat(1_000_000);
    for (what, request_id) in [
        ("1 MB", megabyte.as_str()),
        ("empty", ""),
        ("257 characters", &"r".repeat(257)),
        ("a space at an end", " op-1"),
        ("not ASCII", "op-\u{e9}"),
        ("a control character", "op\t1"),
    ] {
        for dry_run in [false, true] {
            let r = server
                .admin_post(
                    "/v1/admin/resend",
                    &json!({"messageIds": [id], "requestId": request_id, "dryRun": dry_run}),
                )
                .await;
            assert_eq!(r.status(), 400, "{what}");
            let error: Value = r.json().await.unwrap();
            assert_eq!(error["error"], "invalid_request", "{what}: {error}");
            let message = error["message"].as_str().unwrap();
            assert!(
                message.contains("`requestId`") && message.contains("1 to 256"),
                "{what}: {message}"
            );
            assert!(message.len() < 200, "the answer does not echo it back");
        }
    }
    assert_eq!(
        store.get(&parsed).await.unwrap().as_ref(),
        Some(&before),
        "nothing was resent or marked"
    );

    let longest = "r".repeat(256);
    let r = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [id], "requestId": longest}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["resent"], 1);
    assert_eq!(marks_of(store, &id, &longest).await, 1);
    let inner_space = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"messageIds": [id], "requestId": "replay 2026-11-30"}),
        )
        .await;
    assert_eq!(inner_space.status(), 200, "inner spaces are visible text");
}

/// Issue 22, item 8: with three sources configured, `transactionId` without `source` finds
/// the transaction's events in every source (listing and resend alike), `source` narrows it
/// to one, and an empty `transactionId` is a 400 naming it, as the document says.
#[tokio::test]
async fn a_transaction_id_without_source_searches_every_source() {
    let redis = RedisServer::start();
    // Forwarded (to a sink the test never delivers to), so that they can be resent.
    let sink = Sink::ok().await;
    let (server, _clock, _d) = virtual_server(&redis.url(), |c| {
        for source in c.sources.values_mut() {
            source.forward_url = Some(format!("{}/events", sink.url));
        }
        let open = c.sources["open"].clone();
        c.sources.insert("third".into(), open);
    })
    .await;
    assert_eq!(server.app.settings.sources.len(), 3);
    let post = |source: &'static str, id: &'static str, status: &'static str| {
        let body = json!({"id": id, "status": status}).to_string();
        let server = &server;
        async move {
            let r = if source == "payzu" {
                server.post_callback(source, &body, None).await
            } else {
                server.post_signed(source, &body, "-", None).await
            };
            assert_eq!(r.status(), 200, "{source}");
            let answer: Value = r.json().await.unwrap();
            answer["messageId"].as_str().unwrap().to_string()
        }
    };
    let mut shared = vec![
        post("payzu", "tx-shared", "PAID").await,
        post("open", "tx-shared", "PAID").await,
        post("third", "tx-shared", "PAID").await,
        post("open", "tx-shared", "REFUNDED").await,
    ];
    post("third", "tx-elsewhere", "PAID").await;
    shared.sort();

    let listed = |path: String| {
        let server = &server;
        async move {
            let r = server.admin_get(&path).await;
            assert_eq!(r.status(), 200, "{path}");
            let page: Value = r.json().await.unwrap();
            let ids: Vec<String> = page["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_string())
                .collect();
            (ids, page["nextCursor"].as_str().map(str::to_string))
        }
    };
    let (all, next) = listed("/v1/messages?transactionId=tx-shared".into()).await;
    assert_eq!(all, shared, "every source's events, oldest first");
    assert_eq!(next, None);
    // Paged two at a time, across the sources.
    let (first, next) = listed("/v1/messages?transactionId=tx-shared&limit=2".into()).await;
    let next = next.expect("a second page");
    let (second, _) = listed(format!(
        "/v1/messages?transactionId=tx-shared&limit=2&cursor={next}"
    ))
    .await;
    assert_eq!([first, second].concat(), shared);
    let (open, _) = listed("/v1/messages?transactionId=tx-shared&source=open".into()).await;
    assert_eq!(open.len(), 2, "`source` narrows it to one source");

    let dry: Value = server
        .admin_post(
            "/v1/admin/resend",
            &json!({"transactionId": "tx-shared", "dryRun": true}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(dry["wouldResend"], 4, "{dry}");
    let resent: Value = server
        .admin_post("/v1/admin/resend", &json!({"transactionId": "tx-shared"}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(resent["resent"], 4, "{resent}");

    let spec: Value = server
        .admin_get("/openapi.json")
        .await
        .json()
        .await
        .unwrap();
    let param = spec["paths"]["/v1/messages"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "transactionId")
        .unwrap()
        .clone();
    assert_eq!(param["schema"]["minLength"], 1, "{param}");
    assert_eq!(
        spec["components"]["schemas"]["ResendRequest"]["properties"]["transactionId"]["minLength"],
        1
    );
    let empty = server.admin_get("/v1/messages?transactionId=").await;
    assert_eq!(empty.status(), 400);
    let error: Value = empty.json().await.unwrap();
    assert_eq!(error["error"], "invalid_query");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("`transactionId`"),
        "{error}"
    );
    let empty = server
        .admin_post("/v1/admin/resend", &json!({"transactionId": ""}))
        .await;
    assert_eq!(empty.status(), 400);
    let error: Value = empty.json().await.unwrap();
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("`transactionId`"),
        "{error}"
    );
}

#[tokio::test]
async fn a_client_that_hangs_up_does_not_leave_its_resend_half_done() {
    let redis = RedisServer::start();
    // One connection at a time: once a fresh request is served, the server has dropped the
    // connection (and, before the fix, the handler) of the client that hung up.
    let (server, _clock, _d) = virtual_server(&redis.url(), |c| c.server.max_connections = 1).await;
    let once = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let sink = Sink::ok().await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let r: Value = once
            .post(format!("{}/v1/notifications", server.url))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(&handoff(
                &format!("hang-{i}"),
                "approved",
                &format!("{}/cb", sink.url),
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ids.push(r["notificationId"].as_str().unwrap().to_string());
    }
    // Listed in id order, which is acceptance order only across milliseconds.
    ids.sort();
    let from = callbackd::clock::format_iso(
        callbackd::store::MessageId::parse(&ids[0])
            .unwrap()
            .created_at(),
    );
    let request = json!({"createdAtFrom": from, "requestId": "op-hangup"});

    // Writes wait, so the resend is stuck on the store when its client hangs up.
    assert_eq!(redis.cli(&["client", "pause", "60000", "write"]), "OK");
    let body = request.to_string();
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut hung = tokio::net::TcpStream::connect(&addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut hung,
        format!(
            "POST /v1/admin/resend HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    eventually(10, "the resend waits on a paused write", || async {
        let clients = redis.cli(&["client", "list"]);
        clients
            .lines()
            .any(|l| l.contains("flags=b") && l.contains("cmd=set"))
            .then_some(())
    })
    .await;
    drop(hung);
    let served = once
        .get(format!("{}/healthz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200, "the hung-up connection is gone");
    assert_eq!(redis.cli(&["client", "unpause"]), "OK");

    let (headers, answer) = recorded_answer(&once, &server.url, &request).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["messageIds"], json!(ids), "the whole walk ran");
    assert_eq!(answer["incomplete"], false);
    let store = &*server.app.store;
    for id in &ids {
        assert_eq!(
            marks_of(store, id, "op-hangup").await,
            1,
            "{id} resent once"
        );
    }

    // Its record lost (a process that died before recording, then the reservation lapsed):
    // the same requestId walks again but resends nothing twice.
    let key = redis.cli(&["--scan", "--pattern", "cb:op:*"]);
    assert_eq!(redis.cli(&["del", key.trim()]), "1");
    let again = once
        .post(format!("{}/v1/admin/resend", server.url))
        .bearer_auth(ADMIN_TOKEN)
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert!(again.headers().get("idempotent-replayed").is_none());
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["messageIds"], json!(ids));
    for id in &ids {
        assert_eq!(
            marks_of(store, id, "op-hangup").await,
            1,
            "{id} not resent again"
        );
    }
}

#[tokio::test]
async fn a_store_failure_part_way_is_recorded_and_never_resent_twice() {
    use callbackd::store::sqlite::{SqliteOptions, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cb.db");
    let mut cfg = config(&format!("sqlite://{}", path.display()), None);
    cfg.dispatch.enabled = false;
    let store = Arc::new(SqliteStore::open_with(&path, 3600, SqliteOptions::default()).unwrap());
    let app = Arc::new(
        callbackd::app::App::new(cfg, store.clone(), Arc::new(callbackd::clock::SystemClock))
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(callbackd::serve(app, listener, shutdown.clone()));
    let client = support::client();
    let sink = Sink::ok().await;
    let mut ids = Vec::new();
    for i in 0..200 {
        let r: Value = client
            .post(format!("{base}/v1/notifications"))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(&handoff(
                &format!("full-{i}"),
                "approved",
                &format!("{}/cb", sink.url),
            ))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ids.push(r["notificationId"].as_str().unwrap().to_string());
    }
    let from = callbackd::clock::format_iso(
        callbackd::store::MessageId::parse(&ids[0])
            .unwrap()
            .created_at(),
    );
    let request = json!({"createdAtFrom": from, "requestId": "op-full"});

    // The disk fills up part-way through the walk.
    store.set_max_page_count(1).await.unwrap();
    let failed = client
        .post(format!("{base}/v1/admin/resend"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 503);
    assert!(failed.headers().contains_key("retry-after"));
    assert_eq!(failed.json::<Value>().await.unwrap()["error"], "store_full");

    // Space again: the repeat gets the partial answer that was recorded, and resends nothing.
    store.set_max_page_count(1 << 30).await.unwrap();
    let (headers, answer) = recorded_answer(&client, &base, &request).await;
    assert_eq!(headers["idempotent-replayed"], "true");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["incomplete"], true, "{answer}");
    let listed: HashSet<&str> = answer["messageIds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(answer["resent"], listed.len());
    assert!(listed.len() < ids.len(), "the disk filled part-way");
    for id in &ids {
        let expected = usize::from(listed.contains(id.as_str()));
        assert_eq!(marks_of(&*store, id, "op-full").await, expected, "{id}");
    }
    let (_, again) = recorded_answer(&client, &base, &request).await;
    assert_eq!(serde_json::from_str::<Value>(&again).unwrap(), answer);
    shutdown.cancel();
    let _ = serving.await;
}

/// A resend of a finished message (delivered, or dead) while a later message of the same
/// payment is pending: it is delivered after that one, never before it.
#[tokio::test]
async fn a_resent_finished_message_queues_behind_a_pending_one_of_its_key() {
    let redis = RedisServer::start();
    let (server, clock, d) = virtual_server(&redis.url(), |_| {}).await;
    let up = Arc::new(AtomicBool::new(false));
    // `settled` fails until `up`; `approved` is delivered on /ok and gone (410) on /gone.
    let sink = Sink::start({
        let up = up.clone();
        move |req, _| {
            let up = up.load(Ordering::SeqCst);
            let status = req.json()["status"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            Reply::status(match (status.as_str(), req.uri.as_str()) {
                ("settled", _) if !up => 503,
                ("approved", "/gone") if !up => 410,
                _ => 204,
            })
        }
    })
    .await;
    let mut finished = Vec::new();
    for (payment, path) in [("p-delivered", "/ok"), ("p-dead", "/gone")] {
        let url = format!("{}{path}", sink.url);
        let approved = server
            .hand_off_id(&handoff(payment, "approved", &url))
            .await;
        d.tick().await;
        server.hand_off_id(&handoff(payment, "settled", &url)).await;
        d.tick().await;
        finished.push(approved);
    }
    assert_eq!(view(&server, &finished[0]).await["state"], "delivered");
    assert_eq!(view(&server, &finished[1]).await["state"], "dead");
    let before = sink.count();
    assert_eq!(before, 4, "two approved, two failed settled");

    let r: Value = server
        .admin_post("/v1/admin/resend", &json!({"messageIds": finished}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["resent"], 2);
    // Due now, but behind `settled`, whose retry is not due yet: nothing is sent.
    d.tick().await;
    assert_eq!(sink.count(), before, "the resends wait for settled");
    for id in &finished {
        assert_eq!(view(&server, id).await["state"], "pending");
    }

    up.store(true, Ordering::SeqCst);
    let next = server
        .app
        .store
        .list(&callbackd::store::ListFilter {
            state: Some(callbackd::store::MessageState::Pending),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap()
        .messages
        .iter()
        .filter_map(|m| m.next_attempt_at)
        .max()
        .expect("settled is scheduled");
    clock.set(next);
    d.tick().await;
    for path in ["/ok", "/gone"] {
        let statuses: Vec<String> = sink
            .received()
            .iter()
            .filter(|r| r.uri == path)
            .map(|r| r.json()["status"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            statuses,
            ["approved", "settled", "settled", "approved"],
            "{path}: the resent approved after settled"
        );
    }
    for id in &finished {
        assert_eq!(view(&server, id).await["state"], "delivered");
    }
}

/// One resend request resends at most 10,000 messages and says `more`; the rest of the
/// selection is reached by narrowing the window.
#[tokio::test]
async fn a_resend_stops_at_ten_thousand_and_says_more() {
    use callbackd::store::{AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage};
    const CAP: usize = 10_000;
    let redis = RedisServer::start_with("no");
    let (server, clock, _d) = virtual_server(&redis.url(), |_| {}).await;
    let t0 = clock.now_ms();
    // Recorded through the store directly: 10,001 hand-offs over HTTP would only be slower.
    let store = server.app.store.clone();
    let accepts = (0..=CAP as i64).map(|i| {
        let store = store.clone();
        async move {
            let payment = format!("cap-{i}");
            let ordering_key = callbackd::payment::ordering_key(&payment);
            let id = MessageId::generate(t0 + i, &ordering_key, store.partitions());
            let message = NewMessage {
                id: id.clone(),
                kind: MessageKind::Notification,
                source: None,
                payment_id: Some(payment.clone().into()),
                transaction_id: None,
                ordering_key,
                event: None,
                target_url: Some("http://127.0.0.1:9/cb".into()),
                headers: Default::default(),
                body: "{}".into(),
                created_at: t0 + i,
                deadline: t0 + i + 3_600_000,
            };
            let request = AcceptRequest {
                dedupe: DedupeClaim {
                    key: format!("cap-{i}"),
                    ttl_secs: 3600,
                    fingerprint: None,
                    response: String::new(),
                },
                message,
                payment: None,
                seal: None,
            };
            store.accept(request, t0 + i).await.unwrap();
            id
        }
    });
    let ids: Vec<MessageId> = futures::stream::iter(accepts).buffered(64).collect().await;
    clock.set(t0 + CAP as i64 + 1);

    let from = callbackd::clock::format_iso(t0);
    let r = server
        .admin_post("/v1/admin/resend", &json!({"createdAtFrom": from}))
        .await;
    assert_eq!(r.status(), 200);
    let r: Value = r.json().await.unwrap();
    assert_eq!(r["resent"], CAP);
    assert_eq!(r["more"], true);
    let resent: Vec<&str> = r["messageIds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let oldest: Vec<String> = ids[..CAP].iter().map(|id| id.to_string()).collect();
    assert_eq!(resent, oldest, "the oldest 10,000, in order");

    // Narrowed to what is left: the last one, and nothing more.
    let rest = callbackd::clock::format_iso(ids[CAP].created_at());
    let r: Value = server
        .admin_post("/v1/admin/resend", &json!({"createdAtFrom": rest}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(r["messageIds"], json!([ids[CAP].to_string()]));
    assert_eq!(r["more"], false);
}

/// A `requestId` whose resend is still running gets 409 and resends nothing. The first
/// request's reservation is held in a SQLite commit while the second one's queues behind it,
/// so the second reads the reservation of a resend that has not finished, whatever the speed.
#[tokio::test]
async fn a_request_id_still_running_is_409() {
    use callbackd::store::sqlite::{SqliteOptions, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cb.db");
    let cfg = config(&format!("sqlite://{}", path.display()), None);
    // Long enough that no caller gives up while the test holds the commit.
    let options = SqliteOptions {
        timeout: Duration::from_secs(60),
        ..SqliteOptions::default()
    };
    let store = Arc::new(SqliteStore::open_with(&path, 3600, options).unwrap());
    let app = Arc::new(
        callbackd::app::App::new(cfg, store.clone(), Arc::new(callbackd::clock::SystemClock))
            .unwrap(),
    );
    // The router alone: no dispatcher or sweeper writing to the store meanwhile.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, callbackd::http::router(app)).await });
    let client = support::client();
    let answer: Value = client
        .post(format!("{base}/v1/notifications"))
        .bearer_auth(CONNECTOR_TOKEN)
        .json(&handoff("r-busy", "approved", "http://127.0.0.1:9/cb"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = answer["notificationId"].as_str().unwrap().to_string();
    let body = json!({"messageIds": [id], "requestId": "op-busy"});
    let resend = || {
        client
            .post(format!("{base}/v1/admin/resend"))
            .bearer_auth(ADMIN_TOKEN)
            .json(&body)
            .send()
    };

    let stall = store.stall_commits();
    let first = tokio::spawn(resend());
    stall.holding().await;
    let second = tokio::spawn(resend());
    while store.queued() < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(stall);

    let second = second.await.unwrap().unwrap();
    assert_eq!(second.status(), 409);
    assert_eq!(
        second.json::<Value>().await.unwrap()["error"],
        "in_progress"
    );
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status(), 200);
    let first = first.text().await.unwrap();
    assert_eq!(
        serde_json::from_str::<Value>(&first).unwrap()["messageIds"],
        json!([id])
    );
    assert_eq!(
        marks_of(&*store, &id, "op-busy").await,
        1,
        "resent once, by the first"
    );

    let again = resend().await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), first);
}

#[tokio::test]
async fn roles_on_admin_routes() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    for (token, status) in [
        (None, 401),
        (Some("nope-nope-nope"), 401),
        (Some(CONNECTOR_TOKEN), 403),
        (Some(ADMIN_TOKEN), 200),
    ] {
        let mut r = server.client.get(format!("{}/v1/messages", server.url));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        assert_eq!(r.send().await.unwrap().status(), status, "{token:?}");
        let mut r = server
            .client
            .post(format!("{}/v1/admin/resend", server.url))
            .json(&json!({"paymentId": "x"}));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        assert_eq!(r.send().await.unwrap().status(), status, "{token:?}");
    }
}

fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|lbl| l.contains(lbl)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn metrics_are_present_and_move() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let scrape = || async {
        server
            .client
            .get(format!("{}/metrics", server.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let body = r#"{"id":"tx-m","status":"COMPLETED"}"#;
    server.post_callback("payzu", body, None).await;
    let before = scrape().await;
    let replays_before = metric(
        &before,
        "callbackd_callbacks_total",
        &["outcome=\"replayed\"", "source=\"payzu\""],
    );
    server.post_callback("payzu", body, None).await;
    let after = scrape().await;
    let replays_after = metric(
        &after,
        "callbackd_callbacks_total",
        &["outcome=\"replayed\"", "source=\"payzu\""],
    );
    assert_eq!(replays_after, replays_before + 1.0);
    assert!(
        metric(
            &after,
            "callbackd_callbacks_total",
            &["outcome=\"accepted\""]
        ) >= 1.0
    );
    assert!(after.contains("callbackd_queue_depth{state=\"pending\"}"));
    assert!(after.contains("callbackd_accept_duration_seconds_bucket"));
    let bad = server
        .client
        .post(format!("{}/v1/callbacks/payzu", server.url))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 401);
    assert!(
        metric(
            &scrape().await,
            "callbackd_callbacks_total",
            &["outcome=\"bad_signature\""]
        ) >= 1.0
    );
}

#[tokio::test]
async fn openapi_documents_every_route() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let spec: Value = server
        .client
        .get(format!("{}/openapi.json", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(spec["openapi"].as_str().unwrap().starts_with("3."));
    let routes = callbackd::http::routes();
    for route in &routes {
        let (method, path) = (route.method.as_str().to_lowercase(), route.path);
        assert!(
            spec["paths"][path][&method].is_object(),
            "{method} {path} missing from /openapi.json"
        );
        // And the route really is served: without a token, every route answers something of
        // its own, never the router's fallback (404 `not_found`) or a 405.
        let r = server
            .client
            .request(
                route.method.clone(),
                format!(
                    "{}{}",
                    server.url,
                    path.replace("{source}", "payzu").replace("{id}", "msg_x")
                ),
            )
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap();
        let code = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string));
        assert!(
            ![404, 405].contains(&status)
                && !matches!(code.as_deref(), Some("not_found" | "method_not_allowed")),
            "{method} {path}: {status} {body}"
        );
    }
    assert!(spec["components"]["schemas"]["ErrorBody"].is_object());
    let documented: usize = spec["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p.as_object().unwrap().len())
        .sum();
    assert_eq!(
        documented,
        routes.len(),
        "nothing documented that is not routed"
    );
}

/// The rows of the table that follows `heading` in the manual page `page` (under docs/).
fn manual_table(page: &str, heading: &str) -> Vec<String> {
    let path = format!("{}/docs/{page}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let after = text
        .split_once(heading)
        .unwrap_or_else(|| panic!("{path} has no `{heading}`"))
        .1;
    after
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(str::to_string)
        .collect()
}

/// One catalogue of error codes (`ErrorCode`: every error is built from one of its codes, so
/// nothing else can be emitted) and one of metrics feed the manual (docs/), the OpenAPI document
/// and the `/metrics` HELP text; this holds all three to them.
#[tokio::test]
async fn error_and_metric_catalogues_agree_with_the_manual_spec_and_help() {
    use callbackd::http::error::ErrorCode;
    use callbackd::metrics::CATALOGUE;

    let expected: Vec<String> = ErrorCode::ALL
        .iter()
        .map(|c| {
            format!(
                "| {} | `{}` | {} |",
                c.status().as_u16(),
                c.as_str(),
                c.meaning()
            )
        })
        .collect();
    assert_eq!(
        manual_table("api.md", "### Errors"),
        expected,
        "the error table of docs/api.md"
    );

    let backticked = |values: &[&str]| {
        values
            .iter()
            .map(|v| format!("`{v}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let expected: Vec<String> = CATALOGUE
        .iter()
        .map(|m| {
            let mut meaning = m.meaning.to_string();
            for (label, values) in m.values {
                meaning.push_str(&format!("; `{label}`: {}", backticked(values)));
            }
            format!("| `{}` | {} | {meaning} |", m.name, backticked(m.labels))
        })
        .collect();
    assert_eq!(
        manual_table("operations.md", "### Metrics"),
        expected,
        "the metrics table of docs/operations.md"
    );

    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let spec: Value = server
        .client
        .get(format!("{}/openapi.json", server.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    assert_eq!(
        spec["components"]["schemas"]["ErrorCode"]["enum"],
        json!(codes)
    );
    assert_eq!(
        spec["components"]["schemas"]["ErrorBody"]["properties"]["error"]["$ref"],
        "#/components/schemas/ErrorCode"
    );
    let mut with_body = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if op.get("requestBody").is_none() {
                continue;
            }
            with_body += 1;
            for status in ["400", "408", "413"] {
                assert!(
                    op["responses"][status].is_object(),
                    "{method} {path} reads a body but does not document {status}"
                );
            }
        }
    }
    assert_eq!(with_body, 4, "callbacks, notifications, resend, recoveries");

    // Emit the outcomes the issue found missing, then read the HELP lines.
    server.post_callback("nope", "{}", None).await;
    server
        .client
        .post(format!("{}/v1/notifications", server.url))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let text = server
        .client
        .get(format!("{}/metrics", server.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metric(
            &text,
            "callbackd_callbacks_total",
            &["outcome=\"unknown_source\""]
        ) >= 1.0
    );
    assert!(
        metric(
            &text,
            "callbackd_notifications_total",
            &["outcome=\"unauthorized\""]
        ) >= 1.0
    );
    let mut helped = 0;
    for m in &CATALOGUE {
        if let Some(line) = text
            .lines()
            .find(|l| l.starts_with(&format!("# HELP {} ", m.name)))
        {
            assert_eq!(line, format!("# HELP {} {}", m.name, m.help()));
            helped += 1;
        }
    }
    assert!(
        helped >= 3,
        "HELP lines for the metrics this run touched:\n{text}"
    );
    let help = m_help(&text, "callbackd_callbacks_total");
    assert!(help.contains("unknown_source"), "{help}");
    let help = m_help(&text, "callbackd_notifications_total");
    assert!(help.contains("unauthorized"), "{help}");
}

fn m_help(text: &str, name: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(&format!("# HELP {name} ")))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test]
async fn cli_round_trip() {
    let redis = RedisServer::start();
    let sink = Sink::start(|_, _| Reply::status(410)).await;
    let server = TestServer::start(config(&redis.url(), None)).await;
    let id = server
        .hand_off_id(&handoff("cli-1", "approved", &format!("{}/cb", sink.url)))
        .await;
    eventually(10, "dead letter", || async {
        let v: Value = server
            .admin_get(&format!("/v1/messages/{id}"))
            .await
            .json()
            .await
            .ok()?;
        (v["state"] == "dead").then_some(())
    })
    .await;
    let url = server.url.clone();
    let cli = |args: Vec<String>| {
        let url = url.clone();
        async move {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
                .args(&args)
                .env("CALLBACKD_URL", url)
                .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
                .output()
                .await
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).to_string(),
                String::from_utf8_lossy(&out.stderr).to_string(),
            )
        }
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let (code, out, err) = cli(args(&["messages", "show", &id])).await;
    assert_eq!(code, Some(0), "{err}");
    let shown: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(shown["state"], "dead");
    let (code, out, _) = cli(args(&["resend", "--id", &id, "--request-id", "cli-op"])).await;
    assert_eq!(code, Some(0));
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["resent"], 1);
    eventually(10, "redelivered", || async {
        (sink.count() == 2).then_some(())
    })
    .await;
    let (code, out, _) = cli(args(&[
        "messages", "list", "--state", "dead", "--limit", "5",
    ]))
    .await;
    assert_eq!(code, Some(0));
    assert!(serde_json::from_str::<Value>(&out).unwrap()["messages"].is_array());
    let no_token = Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["messages", "list"])
        .env_remove("CALLBACKD_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(no_token.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&no_token.stderr).contains("CALLBACKD_ADMIN_TOKEN"));
}

/// Starts `callbackd serve` with `config_path` (listening on `port`) and waits until it
/// answers. Logs go to a file, not a pipe: a full pipe would stall the server mid-test; the
/// config alone decides the log level (`RUST_LOG` is removed).
async fn serve_logging_to_a_file(
    dir: &std::path::Path,
    config_path: &std::path::Path,
    port: u16,
) -> (tokio::process::Child, std::path::PathBuf, String) {
    let log_path = dir.join("callbackd.log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["serve", "--config", config_path.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .stderr(log_file.try_clone().unwrap())
        .stdout(log_file)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let client = support::client();
    eventually(15, "server up", || async {
        client
            .get(format!("{base}/healthz"))
            .send()
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    (child, log_path, base)
}

#[tokio::test]
async fn logs_of_a_full_run_hold_no_secrets() {
    let redis = RedisServer::start();
    let sink = Sink::start(|_, n| Reply::status(if n == 0 { 500 } else { 204 })).await;
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("config.toml");
    let port = support::redis::free_port();
    std::fs::write(
        &config_path,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
[store]
url = "{}"
[auth]
connector_tokens = ["{CONNECTOR_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]
[dispatch]
allow_private_networks = true
initial_backoff_ms = 50
[log]
format = "json"
level = "debug"
[sources.payzu]
secrets = ["{}"]
signature = "payzu"
forward_url = "{}/fwd"
allow_private_forward_url = true
forward_headers = {{ Authorization = "Bearer merchant-forward-secret" }}
forward_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
"#,
            redis.url(),
            support::PAYZU_SECRET,
            sink.url
        ),
    )
    .unwrap();
    let (mut child, log_path, base) = serve_logging_to_a_file(dir.path(), &config_path, port).await;
    let client = support::client();
    let body = r#"{"id":"tx-log","status":"COMPLETED"}"#;
    let now = callbackd::clock::SystemClock.now_secs();
    let signature =
        callbackd::webhook::sign_payzu(support::PAYZU_SECRET.as_bytes(), now, body.as_bytes());
    let r = client
        .post(format!("{base}/v1/callbacks/payzu"))
        .header("x-callback-signature", &signature)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client
        .post(format!("{base}/v1/callbacks/payzu"))
        .header("x-callback-signature", "t=1, v1=deadbeef")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .post(format!("{base}/v1/notifications"))
        .bearer_auth(CONNECTOR_TOKEN)
        .json(&json!({"paymentId": "p-log", "status": "approved", "callbackUrl": format!("{}/cb?X-VTEX-signature=vtex-sig-value", sink.url),
            "headers": {"X-VTEX-API-AppToken": "vtex-app-token-value"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    client
        .get(format!("{base}/v1/messages"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    eventually(15, "deliveries incl. a retry", || async {
        (sink.count() >= 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));
    let logs = std::fs::read_to_string(&log_path).unwrap();
    assert!(logs.lines().count() > 3, "the run logged something: {logs}");
    assert!(
        logs.lines()
            .all(|l| l.trim().is_empty() || serde_json::from_str::<Value>(l).is_ok()),
        "JSON logs"
    );
    assert!(logs.contains("request_id"), "request ids on request spans");
    // The failed first delivery, in JSON values: a number, strings, an RFC 3339 time.
    let failed: Value = logs
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|l| l["fields"]["message"] == "delivery failed")
        .unwrap_or_else(|| panic!("no failed delivery logged:\n{logs}"));
    let fields = &failed["fields"];
    assert_eq!(fields["status"], 500, "{failed}");
    assert_eq!(fields["outcome"], "retry", "{failed}");
    assert!(fields.get("error").is_none(), "{failed}");
    assert!(
        callbackd::clock::parse_rfc3339(fields["next_attempt_at"].as_str().unwrap_or_default())
            .is_some(),
        "{failed}"
    );
    assert!(fields["retry_in"].is_string(), "{failed}");
    // Our own lines (dependencies' debug lines are theirs).
    for line in logs
        .lines()
        .filter(|l| l.contains(r#""target":"callbackd"#))
    {
        assert!(
            !line.contains("Some(") && !line.contains("Retry("),
            "{line}"
        );
    }
    assert!(logs.contains("message_id"), "message ids on delivery spans");
    for secret in [
        support::PAYZU_SECRET,
        CONNECTOR_TOKEN,
        ADMIN_TOKEN,
        "merchant-forward-secret",
        "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "vtex-app-token-value",
        "vtex-sig-value",
        signature.split("v1=").nth(1).unwrap(),
        "deadbeef",
    ] {
        assert!(!logs.contains(secret), "`{secret}` leaked into the logs");
    }
}

/// Issue: `delivery failed status=None error=Some("connect") verdict=Retry(1796031171374)`.
/// A real process, text logs, through a 503 (retried), a 410 (dead) and a refused connection
/// (retried): each line says what happened in plain values, the next attempt as a time and a
/// delay.
#[tokio::test]
async fn failed_deliveries_are_logged_as_plain_values() {
    let sink = Sink::start(|_, n| Reply::status(if n == 0 { 503 } else { 410 })).await;
    // Bound and dropped: nothing listens there, so a delivery gets a connection error.
    let closed_port = support::redis::free_port();
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("config.toml");
    let port = support::redis::free_port();
    std::fs::write(
        &config_path,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
[store]
url = "sqlite://{}"
[auth]
connector_tokens = ["{CONNECTOR_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]
[dispatch]
allow_private_networks = true
initial_backoff_ms = 50
max_backoff_secs = 1
[log]
format = "text"
level = "info"
"#,
            dir.path().join("cb.db").display()
        ),
    )
    .unwrap();
    let (mut child, log_path, base) = serve_logging_to_a_file(dir.path(), &config_path, port).await;
    let client = support::client();
    let hand_off = |payment: &str, url: String| {
        client
            .post(format!("{base}/v1/notifications"))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(&handoff(payment, "approved", &url))
            .send()
    };
    assert_eq!(
        hand_off("p-503", format!("{}/cb", sink.url))
            .await
            .unwrap()
            .status(),
        202
    );
    let refused: Value = hand_off("p-refused", format!("http://127.0.0.1:{closed_port}/cb"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let refused_id = refused["notificationId"].as_str().unwrap().to_string();
    eventually(15, "a 503 then a 410", || async {
        (sink.count() >= 2).then_some(())
    })
    .await;
    eventually(15, "a refused connection", || async {
        let v: Value = client
            .get(format!("{base}/v1/messages/{refused_id}"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (v["attemptCount"].as_u64()? >= 1).then_some(())
    })
    .await;
    Command::new("kill")
        .args(["-TERM", &child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert_eq!(child.wait().await.unwrap().code(), Some(0));
    let logs = std::fs::read_to_string(&log_path).unwrap();

    assert!(
        !logs.contains("\u{1b}["),
        "no colour codes in a file:\n{logs}"
    );
    for line in logs.lines().filter(|l| l.contains(" callbackd")) {
        for wrapper in ["Some(", "None", "Retry("] {
            assert!(!line.contains(wrapper), "`{wrapper}` in {line}");
        }
    }
    let line = |needle: &str| {
        logs.lines()
            .find(|l| l.contains("delivery failed") && l.contains(needle))
            .unwrap_or_else(|| panic!("no `delivery failed` line with `{needle}`:\n{logs}"))
            .to_string()
    };
    let field = |line: &str, name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .map(str::to_string)
    };
    let retried = line("status=503");
    assert_eq!(
        field(&retried, "outcome").as_deref(),
        Some("retry"),
        "{retried}"
    );
    assert_eq!(
        field(&retried, "error"),
        None,
        "no error field when there is a status"
    );
    let next = field(&retried, "next_attempt_at").unwrap_or_default();
    assert!(
        callbackd::clock::parse_rfc3339(&next).is_some(),
        "{retried}"
    );
    let delay = field(&retried, "retry_in").unwrap_or_default();
    assert!(
        delay.ends_with("ms") || delay.ends_with('s'),
        "a delay with its unit: {retried}"
    );
    let gone = line("status=410");
    assert_eq!(field(&gone, "outcome").as_deref(), Some("dead"), "{gone}");
    assert_eq!(field(&gone, "reason").as_deref(), Some("gone"), "{gone}");
    let connect = line("error=connect");
    assert_eq!(
        field(&connect, "status"),
        None,
        "no status field without an answer"
    );
    assert_eq!(
        field(&connect, "outcome").as_deref(),
        Some("retry"),
        "{connect}"
    );
    assert!(
        callbackd::clock::parse_rfc3339(&field(&connect, "next_attempt_at").unwrap_or_default())
            .is_some()
    );
}
