//! `store.min_replicas_acked`: every write waits for replicas (`WAIT`), against a private
//! master with a replica started with `--replicaof` (docs/storage.md, "Choosing a store").

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use callbackd::StartError;
use callbackd::clock::{Millis, SystemClock};
use callbackd::store::redis::{RedisStore, SCHEMA_VERSION};
use callbackd::store::{
    AcceptOutcome, AcceptRequest, Completion, DeliveryAttempt, Store, StoreError,
};
use support::redis::RedisServer;
use support::{TestServer, config};

const NOW: Millis = 1_700_000_000_000;
/// The store's round-trip timeout in these tests; `WAIT` gets four fifths of it. A replica in
/// sync acknowledges within milliseconds, but on a busy 2-core machine a second's `WAIT`
/// has been seen to run out.
const TIMEOUT: Duration = Duration::from_millis(3_000);
/// How long a refused write may take: the timeout it waits out, with as much again and more
/// for a loaded test machine.
const GENEROUS: Duration = Duration::from_millis(3 * 3_000);

/// A master and one replica of it, the replica in sync.
fn master_and_replica() -> (RedisServer, RedisServer) {
    // No 5 s wait for more replicas before the first sync (Redis 7's diskless default).
    let master = RedisServer::start_with_args("always", &["--repl-diskless-sync-delay", "0"]);
    let port = master.port.to_string();
    let replica = RedisServer::start_with_args("always", &["--replicaof", "127.0.0.1", &port]);
    master.wait_for_replicas(1);
    (master, replica)
}

async fn store(redis: &RedisServer, min_replicas_acked: u32) -> RedisStore {
    RedisStore::connect(&redis.url(), TIMEOUT, 3_600)
        .await
        .expect("connects")
        .with_min_replicas_acked(min_replicas_acked)
}

/// A hand-off of `ordering_key` with a dedupe claim of its own.
fn request(ordering_key: &str) -> AcceptRequest {
    support::notification_request(&format!("claim/{ordering_key}"), ordering_key, NOW)
}

fn message_keys(redis: &RedisServer) -> usize {
    let keys = redis.cli(&["--scan", "--pattern", "cb:*:m:*"]);
    keys.lines().filter(|l| !l.is_empty()).count()
}

fn waits_sent(redis: &RedisServer) -> bool {
    redis
        .cli(&["info", "commandstats"])
        .contains("cmdstat_wait:")
}

#[tokio::test]
async fn an_acknowledged_write_is_on_the_replica() {
    let (master, replica) = master_and_replica();
    let store = store(&master, 1).await;
    assert_eq!(store.upgrade(NOW).await.expect("stamps"), SCHEMA_VERSION);
    let req = request("order/1");
    assert_eq!(
        store.accept(req.clone(), NOW).await.expect("accepted"),
        AcceptOutcome::Accepted
    );
    // WAIT answered only once the replica had applied the write: no polling needed.
    assert_eq!(message_keys(&replica), 1);
    assert!(waits_sent(&master));

    let leases = store.claim_due(NOW, 10, 60_000).await.expect("claims");
    assert_eq!(leases.len(), 1);
    let attempt = DeliveryAttempt {
        attempt: 1,
        at: NOW,
        status: Some(200),
        error: None,
        latency_ms: Some(1),
        response: None,
    };
    assert!(
        store
            .complete(&leases[0], attempt, Completion::Delivered, NOW)
            .await
            .expect("completes")
    );
    let key = master.cli(&["--scan", "--pattern", "cb:*:m:*"]);
    assert_eq!(
        replica.cli(&["hget", &key, "state"]),
        "delivered",
        "the completion is on the replica too"
    );
}

/// A paused replica (SIGSTOP) acknowledges nothing: the accept is refused within about the
/// timeout, the write stays on the master, and once the replica is back the same accept is
/// a replay.
#[tokio::test]
async fn a_paused_replica_means_unavailable_and_the_retry_replays() {
    let (master, replica) = master_and_replica();
    let store = store(&master, 1).await;
    assert_eq!(
        store.accept(request("warm"), NOW).await.expect("accepted"),
        AcceptOutcome::Accepted
    );

    replica.pause();
    let req = request("order/1");
    let started = Instant::now();
    let refused = store.accept(req.clone(), NOW).await;
    assert!(
        matches!(refused, Err(StoreError::Unavailable(ref why)) if why.contains("min_replicas_acked")),
        "{refused:?}"
    );
    assert!(started.elapsed() < GENEROUS, "{:?}", started.elapsed());
    assert_eq!(message_keys(&master), 2, "the write stayed on the master");

    replica.resume();
    let again = support::eventually(20, "the replica acknowledges again", || async {
        store.accept(req.clone(), NOW).await.ok()
    })
    .await;
    assert!(matches!(again, AcceptOutcome::Replayed { .. }), "{again:?}");
    assert_eq!(message_keys(&replica), 2);
}

#[tokio::test]
async fn a_killed_replica_means_unavailable_and_the_retry_replays() {
    let (master, mut replica) = master_and_replica();
    let store = store(&master, 1).await;
    replica.stop(true);
    let req = request("order/1");
    let started = Instant::now();
    let refused = store.accept(req.clone(), NOW).await;
    assert!(
        matches!(refused, Err(StoreError::Unavailable(_))),
        "{refused:?}"
    );
    assert!(started.elapsed() < GENEROUS, "{:?}", started.elapsed());

    replica.start_again();
    let again = support::eventually(20, "the replica is back", || async {
        store.accept(req.clone(), NOW).await.ok()
    })
    .await;
    assert!(matches!(again, AcceptOutcome::Replayed { .. }), "{again:?}");
    assert_eq!(message_keys(&replica), 1);
}

#[tokio::test]
async fn without_the_setting_no_wait_is_sent() {
    let (master, _replica) = master_and_replica();
    // The test's own probe for the replica sent one.
    master.cli(&["config", "resetstat"]);
    let store = store(&master, 0).await;
    store.upgrade(NOW).await.expect("stamps");
    store
        .accept(request("order/1"), NOW)
        .await
        .expect("accepted");
    let leases = store.claim_due(NOW, 10, 60_000).await.expect("claims");
    store
        .release(&leases[0], NOW + 1_000)
        .await
        .expect("releases");
    store.sweep(NOW).await.expect("sweeps");
    assert!(
        !waits_sent(&master),
        "{}",
        master.cli(&["info", "commandstats"])
    );
}

#[tokio::test]
async fn start_up_refuses_fewer_connected_replicas_than_required() {
    let (master, _replica) = master_and_replica();
    let mut cfg = config(&master.url(), None);
    cfg.store.min_replicas_acked = 2;
    match callbackd::build(cfg, Arc::new(SystemClock)).await {
        Err(StartError::TooFewReplicas(why)) => {
            assert!(why.contains("store.min_replicas_acked = 2"), "{why}");
            assert!(why.contains("1 replica(s) connected"), "{why}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("started with 1 replica connected and 2 required"),
    }
    let mut cfg = config(&master.url(), None);
    cfg.store.min_replicas_acked = 1;
    assert!(callbackd::build(cfg, Arc::new(SystemClock)).await.is_ok());
}

/// Over HTTP: a callback the replica cannot acknowledge gets 503 + Retry-After, and the
/// provider's retry, once the replica is back, gets the replay of the write that stayed.
#[tokio::test]
async fn over_http_a_missing_ack_is_503_and_the_retry_replays() {
    const BODY: &str =
        r#"{"id":"tx:1","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":99.9}"#;
    let (master, replica) = master_and_replica();
    let mut cfg = config(&master.url(), None);
    cfg.store.min_replicas_acked = 1;
    let server = TestServer::start(cfg).await;
    let warm = BODY.replace("tx:1", "tx:warm");
    assert_eq!(
        server.post_callback("payzu", &warm, None).await.status(),
        200
    );

    replica.pause();
    let down = server.post_callback("payzu", BODY, None).await;
    assert_eq!(down.status(), 503);
    assert_eq!(down.headers()["retry-after"], "1");
    assert_eq!(
        down.json::<serde_json::Value>().await.unwrap()["error"],
        "store_unavailable"
    );
    replica.resume();

    let again = support::eventually(20, "the replica acknowledges again", || async {
        let r = server.post_callback("payzu", BODY, None).await;
        (r.status() == 200).then_some(r)
    })
    .await;
    assert_eq!(
        again.headers()["idempotent-replayed"],
        "true",
        "the retry finds the write that stayed"
    );
    server.stop().await;
}
