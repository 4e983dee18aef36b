//! The start-up check of Redis durability (`CONFIG GET appendonly`, `appendfsync`,
//! `maxmemory-policy`), against private redis-servers configured each way.

mod support;

use std::sync::Arc;
use std::time::Duration;

use callbackd::StartError;
use callbackd::clock::SystemClock;
use callbackd::durability::{Verdict, check_redis};
use callbackd::store::redis::RedisStore;
use support::config;
use support::redis::RedisServer;

/// Starts callbackd on `redis`; the refusal message when it refuses.
async fn refusal(redis: &RedisServer, require_durable: bool) -> Option<String> {
    let mut cfg = config(&redis.url(), None);
    cfg.store.require_durable = require_durable;
    match callbackd::build(cfg, Arc::new(SystemClock)).await {
        Ok(_) => None,
        Err(StartError::NotDurable(why)) => Some(why),
        Err(other) => panic!("refused for another reason: {other}"),
    }
}

/// The warnings a start on `redis` logs.
async fn warnings(redis: &RedisServer, require_durable: bool) -> Vec<String> {
    let store = RedisStore::connect(&redis.url(), Duration::from_secs(2), 60)
        .await
        .expect("connects");
    match check_redis(&store, require_durable).await.expect("reads") {
        Verdict::Start { warnings } => warnings,
        Verdict::Refuse(why) => panic!("refused: {why}"),
    }
}

#[tokio::test]
async fn without_aof_a_durable_config_refuses_to_start() {
    let redis = RedisServer::start_with_args("always", &["--appendonly", "no"]);
    let why = refusal(&redis, true).await.expect("refused");
    assert!(
        why.contains("appendonly yes"),
        "the message says what to change: {why}"
    );
}

#[tokio::test]
async fn without_aof_the_default_config_starts_with_a_warning() {
    let redis = RedisServer::start_with_args("always", &["--appendonly", "no"]);
    assert_eq!(refusal(&redis, false).await, None);
    let w = warnings(&redis, false).await;
    assert!(w.iter().any(|m| m.contains("appendonly no")), "{w:?}");
}

#[tokio::test]
async fn an_evicting_redis_is_refused_when_durability_is_required() {
    let redis = RedisServer::start_with_args("always", &["--maxmemory-policy", "allkeys-lru"]);
    let why = refusal(&redis, true).await.expect("refused");
    assert!(why.contains("maxmemory-policy is allkeys-lru"), "{why}");
    assert!(
        why.contains("noeviction"),
        "the message says what to set: {why}"
    );
}

#[tokio::test]
async fn an_evicting_redis_starts_with_a_warning_otherwise() {
    let redis = RedisServer::start_with_args("always", &["--maxmemory-policy", "allkeys-lru"]);
    assert_eq!(refusal(&redis, false).await, None);
    let w = warnings(&redis, false).await;
    assert!(w.iter().any(|m| m.contains("allkeys-lru")), "{w:?}");
}

#[tokio::test]
async fn appendfsync_no_is_a_warning_not_a_refusal() {
    let redis = RedisServer::start_with("no");
    assert_eq!(
        redis.cli(&["config", "get", "appendfsync"]),
        "appendfsync\nno"
    );
    assert_eq!(refusal(&redis, true).await, None);
    let w = warnings(&redis, true).await;
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].contains("appendfsync is no"), "{w:?}");
}

#[tokio::test]
async fn without_config_command_a_durable_config_refuses_to_start() {
    let redis = RedisServer::start_with_args("always", &["--rename-command", "CONFIG", ""]);
    assert!(
        redis
            .cli_error(&["config", "get", "appendonly"])
            .contains("unknown command")
    );
    let why = refusal(&redis, true).await.expect("cannot tell is refused");
    assert!(why.contains("cannot read"), "{why}");
    assert!(
        why.contains("appendonly yes") && why.contains("noeviction"),
        "the message says what to check: {why}"
    );
}

#[tokio::test]
async fn without_config_command_the_default_config_starts_with_a_warning() {
    // Managed Redis often disables CONFIG: without require_durable that is still tolerated.
    let redis = RedisServer::start_with_args("always", &["--rename-command", "CONFIG", ""]);
    assert_eq!(refusal(&redis, false).await, None);
    let w = warnings(&redis, false).await;
    assert!(w.iter().any(|m| m.contains("cannot read")), "{w:?}");
}

#[tokio::test]
async fn with_aof_and_noeviction_a_durable_config_starts_without_warnings() {
    let redis = RedisServer::start();
    assert_eq!(refusal(&redis, true).await, None);
    assert_eq!(warnings(&redis, true).await, Vec::<String>::new());
}
