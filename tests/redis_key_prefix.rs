//! `store.key_prefix`: two deployments on one Redis, each under its own prefix, never see
//! each other's events, claims or layout version.

mod support;

use std::time::Duration;

use callbackd::clock::Millis;
use callbackd::store::redis::{RedisOptions, RedisStore, SCHEMA_VERSION};
use callbackd::store::{AcceptOutcome, AcceptRequest, MessageId, Store};
use support::redis::RedisServer;

const NOW: Millis = 1_700_000_000_000;

async fn store(server: &RedisServer, prefix: &str) -> RedisStore {
    let options = RedisOptions {
        key_prefix: prefix.to_string(),
        ..RedisOptions::default()
    };
    RedisStore::connect_with(&server.url(), Duration::from_secs(2), 3600, &options)
        .await
        .expect("connects")
}

/// The same callback (same dedupe key, same ordering key) as each deployment receives it.
fn request(dedupe_key: &str, ordering_key: &str) -> AcceptRequest {
    support::notification_request(dedupe_key, ordering_key, NOW)
}

#[tokio::test]
async fn two_prefixes_on_one_redis_never_see_each_other() {
    let server = RedisServer::start();
    let a = store(&server, "cb").await;
    let b = store(&server, "tenant-b").await;
    assert_eq!(a.upgrade(NOW).await.expect("stamps a"), SCHEMA_VERSION);
    let first = request("claim/shared", "order-1");
    let a_id = first.message.id.clone();
    assert_eq!(
        a.accept(first, NOW).await.expect("a accepts"),
        AcceptOutcome::Accepted
    );
    // A store whose prefix holds no data is new, even with another deployment's keys next to
    // it: it must not mistake them for an old layout to upgrade.
    assert_eq!(b.upgrade(NOW).await.expect("stamps b"), SCHEMA_VERSION);
    let second = request("claim/shared", "order-1");
    let b_id = second.message.id.clone();
    assert_eq!(
        b.accept(second, NOW).await.expect("b accepts"),
        AcceptOutcome::Accepted,
        "the other deployment's claim of the same key is not a replay here"
    );
    assert!(matches!(
        a.accept(request("claim/shared", "order-1"), NOW)
            .await
            .expect("a replays"),
        AcceptOutcome::Replayed { .. }
    ));

    let a_leases = a.claim_due(NOW + 1, 10, 60_000).await.expect("a claims");
    let b_leases = b.claim_due(NOW + 1, 10, 60_000).await.expect("b claims");
    let ids = |leases: &[callbackd::store::Lease]| -> Vec<MessageId> {
        leases.iter().map(|l| l.message.id.clone()).collect()
    };
    assert_eq!(ids(&a_leases), vec![a_id.clone()]);
    assert_eq!(ids(&b_leases), vec![b_id.clone()]);
    assert!(a.get(&b_id).await.expect("reads").is_none());
    assert!(b.get(&a_id).await.expect("reads").is_none());
    assert_eq!(a.depth().await.expect("depth").in_flight, 1);
    assert_eq!(b.depth().await.expect("depth").in_flight, 1);

    let keys = server.cli(&["--scan"]);
    let keys: Vec<&str> = keys.lines().collect();
    assert!(keys.iter().any(|k| k.starts_with("cb:{p")), "{keys:?}");
    assert!(
        keys.iter().any(|k| k.starts_with("tenant-b:{p")),
        "{keys:?}"
    );
    assert!(keys.contains(&"cb:schema") && keys.contains(&"tenant-b:schema"));
    for key in &keys {
        assert!(
            key.starts_with("cb:") || key.starts_with("tenant-b:"),
            "a key outside both prefixes: {key}"
        );
    }
}
