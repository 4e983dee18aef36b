//! The start-up check of Redis persistence (`CONFIG GET appendonly`).

mod support;

use std::sync::Arc;

use callbackd::StartError;
use callbackd::clock::SystemClock;
use support::config;
use support::redis::RedisServer;

#[tokio::test]
async fn without_aof_a_durable_config_refuses_to_start() {
    let redis = RedisServer::start_with_args("always", &["--appendonly", "no"]);
    let mut cfg = config(&redis.url(), None);
    cfg.store.require_durable = true;
    let err = callbackd::build(cfg, Arc::new(SystemClock))
        .await
        .err()
        .expect("refused");
    assert!(matches!(err, StartError::NotDurable), "{err}");
    assert!(
        err.to_string().contains("appendonly"),
        "the message says what to change: {err}"
    );
}

#[tokio::test]
async fn without_aof_the_default_config_starts_with_a_warning() {
    let redis = RedisServer::start_with_args("always", &["--appendonly", "no"]);
    let cfg = config(&redis.url(), None);
    assert!(callbackd::build(cfg, Arc::new(SystemClock)).await.is_ok());
}

#[tokio::test]
async fn managed_redis_without_config_command_is_tolerated() {
    let redis = RedisServer::start_with_args("always", &["--rename-command", "CONFIG", ""]);
    assert!(
        redis
            .cli(&["config", "get", "appendonly"])
            .contains("unknown command")
    );
    let mut cfg = config(&redis.url(), None);
    cfg.store.require_durable = true;
    assert!(callbackd::build(cfg, Arc::new(SystemClock)).await.is_ok());
}

#[tokio::test]
async fn with_aof_a_durable_config_starts() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.store.require_durable = true;
    assert!(callbackd::build(cfg, Arc::new(SystemClock)).await.is_ok());
}
