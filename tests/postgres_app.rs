//! callbackd on `store.url = "postgres://…"`: the engine as the app opens it (the durability
//! check, the layout made on first start), a callback and a payment's hand-offs delivered
//! in order, a replay answered byte for byte, a bad URL refused by the config without its
//! password, and what a synchronous standby that stops answering means for an acknowledgement.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::path::Path;
use std::sync::Arc;

use callbackd::StartError;
use callbackd::clock::SystemClock;
use callbackd::config::Config;
use postgres_support::PostgresServer;
use serde_json::Value;
use support::sink::Sink;
use support::{TestServer, config, eventually, handoff};

#[tokio::test]
async fn callbacks_and_hand_offs_go_through_postgres_in_order() {
    let db = PostgresServer::shared().fresh_database();
    let sink = Sink::ok().await;
    let forward = format!("{}/forward", sink.url);
    let server = TestServer::start(config(&db, Some(&forward))).await;

    let body = r#"{"id":"tx-pg-1","status":"PAID","amount":100}"#;
    let first = server.post_callback("payzu", body, None).await;
    assert_eq!(first.status(), 200);
    let first = first.text().await.unwrap();
    let replay = server.post_callback("payzu", body, None).await;
    assert_eq!(replay.status(), 200);
    assert_eq!(
        replay.text().await.unwrap(),
        first,
        "a replay, byte for byte"
    );

    let target = format!("{}/payments", sink.url);
    let mut ids = Vec::new();
    for status in ["approved", "settled", "refunded"] {
        ids.push(
            server
                .hand_off_id(&handoff("pay-pg-1", status, &target))
                .await,
        );
    }
    let conflict = server
        .notify(&handoff("pay-pg-1", "cancelled", &target))
        .await;
    assert_eq!(conflict.status(), 409, "refunded is terminal");

    eventually(20, "four deliveries", || async {
        (sink.count() >= 4).then_some(())
    })
    .await;
    let received = sink.received();
    assert_eq!(received.iter().filter(|r| r.uri == "/forward").count(), 1);
    let statuses: Vec<String> = received
        .iter()
        .filter(|r| r.uri == "/payments")
        .map(|r| r.json()["status"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(statuses, ["approved", "settled", "refunded"], "in order");
    for id in &ids {
        let message: Value = eventually(10, "delivered", || async {
            let got: Value = server
                .admin_get(&format!("/v1/messages/{id}"))
                .await
                .json()
                .await
                .ok()?;
            (got["state"] == "delivered").then_some(got)
        })
        .await;
        assert_eq!(
            message["attempts"].as_array().map(Vec::len),
            Some(1),
            "{message}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn a_durable_config_refuses_a_server_without_fsync() {
    let lax = PostgresServer::start_with(&[("fsync", "off")]);
    let mut cfg = config(&lax.url(), None);
    cfg.store.require_durable = true;
    match callbackd::build(cfg, Arc::new(SystemClock)).await {
        Err(StartError::NotDurable(why)) => assert!(why.contains("fsync is off"), "{why}"),
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("fsync = off must be refused"),
    }
    assert_eq!(
        lax.psql("SELECT count(*) FROM pg_tables WHERE tablename = 'callbackd_layout'"),
        "0",
        "refused before anything was written"
    );
}

#[test]
fn a_bad_postgres_url_is_refused_naming_the_key_without_the_password() {
    let text = r#"
[store]
url = "postgres://cb:pg-s3cret@db.example:5432/cb?sslmode=sometimes"
"#;
    let err = Config::from_toml_str(text, Path::new("test.toml"), std::iter::empty())
        .expect_err("an unknown sslmode");
    let message = err.to_string();
    assert!(message.contains("store.url"), "{message}");
    assert!(message.contains("cb:***@db.example"), "{message}");
    assert!(!message.contains("pg-s3cret"), "{message}");
}

/// A primary whose synchronous standby stops answering (paused): a callback's commit waits
/// for it, callbackd answers 503 at its store timeout, and our `statement_timeout` (the same
/// timeout) does not end the wait, since PostgreSQL disables it before committing: the
/// retry waits behind the first commit's locks and gets 503 too, long after several
/// timeouts. A cancel of the wait (an operator's `pg_cancel_backend`) makes the commit local
/// and visible, but the retry that finds it is no 2xx either: its own commit waits for the
/// standby past what it read, so a replay is acknowledged only once the standby holds the
/// event (RELIABILITY.md, "PostgreSQL: what a synchronous standby covers").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_synchronous_standby_does_not_acknowledge_waits_until_cancelled() {
    let primary = PostgresServer::start();
    let standby = PostgresServer::standby_of(&primary);
    let server = TestServer::start(config(&primary.url(), None)).await;
    let post = || async {
        server
            .client
            .post(format!("{}/v1/callbacks/open", server.url))
            .body(r#"{"id":"tx-sync","status":"PAID"}"#)
            .send()
            .await
            .expect("an answer")
    };
    let before = post().await;
    assert_eq!(before.status(), 200, "accepted while the standby answers");
    let waiting = || {
        primary.psql(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event = 'SyncRep' AND application_name LIKE 'callbackd%'",
        )
    };

    standby.pause();
    let body = r#"{"id":"tx-sync-2","status":"PAID"}"#;
    let post_new = || async {
        server
            .client
            .post(format!("{}/v1/callbacks/open", server.url))
            .body(body)
            .send()
            .await
            .expect("an answer")
    };
    let first = post_new().await;
    assert_eq!(first.status(), 503, "not acknowledged without the standby");
    for _ in 0..3 {
        let retry = post_new().await;
        assert_eq!(retry.status(), 503, "a retry waits behind the first commit");
    }
    // Four store timeouts later, the first commit still waits: the statement timeout did not
    // end it.
    assert_eq!(
        waiting(),
        "1",
        "the first commit still waits for the standby"
    );

    let cancelled = primary.psql(
        "SELECT count(*) FILTER (WHERE pg_cancel_backend(pid)) FROM \
         (SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep' \
          AND application_name LIKE 'callbackd%' AND pid <> pg_backend_pid() OFFSET 0) waiting",
    );
    assert_eq!(cancelled, "1");
    // Locally committed, not replicated: its replay waits for the standby as the first did.
    let unreplicated = post_new().await;
    assert_eq!(
        unreplicated.status(),
        503,
        "a replay of a commit the standby lacks is not acknowledged"
    );
    standby.resume();
    let replay = eventually(20, "the replay once the standby is back", || async {
        let r = post_new().await;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert_eq!(
        replay
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "the cancelled commit, replicated now, answered as a replay"
    );
    server.stop().await;
}
