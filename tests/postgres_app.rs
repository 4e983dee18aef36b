//! callbackd on `store.url = "postgres://…"`: the engine as the app opens it (the durability
//! check, the layout made on first start), a callback and a payment's hand-offs delivered
//! in order, a replay answered byte for byte, and a bad URL refused by the config without its
//! password.

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
