//! Redis Cluster mode: callbackd pointed at one node of a cluster of 3 masters and 3 replicas
//! finds the others, serves over HTTP, sends each `WAIT` to the master of the write it
//! follows, loads its scripts where they are missing, and runs its start-up checks on every
//! master. The store contract and the lifecycle model run on a cluster too
//! (tests/store_contract.rs, tests/lifecycle_model.rs).
//!
//! One cluster for this file. The tests that read the masters' counters, flush their scripts
//! or change their settings run one after the other in one test function; the one beside it
//! sends no `WAIT` and requires no durability.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use callbackd::clock::Millis;
use callbackd::durability::{Verdict, check_redis, check_replicas};
use callbackd::store::Partitions;
use callbackd::store::ids::partition_of;
use callbackd::store::redis::{RedisOptions, RedisStore};
use callbackd::store::{AcceptOutcome, Store};
use support::redis::cluster::RedisCluster;
use support::sink::Sink;
use support::{TestServer, config};

const NOW: Millis = 1_700_000_000_000;

async fn store(cluster: &RedisCluster, prefix: &str, min_replicas_acked: u32) -> RedisStore {
    let options = RedisOptions {
        key_prefix: prefix.to_string(),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect_with(&cluster.url(), Duration::from_secs(2), 3600, &options)
        .await
        .expect("connects to the cluster")
        .with_min_replicas_acked(min_replicas_acked);
    store.upgrade(NOW).await.expect("stamps the layout");
    store
}

/// Ordering keys, one in each partition.
fn one_key_per_partition() -> Vec<String> {
    let mut keys = BTreeMap::new();
    for i in 0..10_000 {
        let key = format!("order-{i}");
        keys.entry(partition_of(&key, Partitions::DEFAULT))
            .or_insert(key);
    }
    keys.into_values().collect()
}

/// The bug this mode fixes: pointed at one node, every callback and hand-off is a 2xx (not
/// a 503 for those whose slot another master serves) and is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbackd_on_one_node_serves_and_delivers_across_the_cluster() {
    let cluster = RedisCluster::shared();
    let sink = Sink::ok().await;
    let mut cfg = config(&cluster.url(), None);
    cfg.store.key_prefix = RedisCluster::unique_prefix();
    let server = TestServer::start(cfg).await;
    let payments: Vec<String> = (0..40).map(|i| format!("pay-{i}")).collect();
    for payment in &payments {
        let answer = server
            .notify(&support::handoff(payment, "approved", &sink.url))
            .await;
        assert_eq!(answer.status(), 202, "{payment}");
    }
    support::eventually(20, "every hand-off delivered", || async {
        (sink.count() >= payments.len()).then_some(())
    })
    .await;
    // Stopped first, so a repeat still in flight is counted too.
    server.stop().await;
    let mut delivered: Vec<String> = sink
        .received()
        .iter()
        .map(|r| {
            r.json()["paymentId"]
                .as_str()
                .expect("a paymentId")
                .to_string()
        })
        .collect();
    delivered.sort();
    let mut expected = payments.clone();
    expected.sort();
    // The same list, repeats included: a repeat beside a loss would keep the count.
    assert_eq!(delivered, expected, "each payment delivered once");
}

/// NOSCRIPT: a master that lost its script cache (a restart, a promoted replica) gets the
/// script loaded, and the call goes through.
async fn a_master_without_the_scripts_gets_them_loaded(cluster: &RedisCluster) {
    let store = store(cluster, &RedisCluster::unique_prefix(), 0).await;
    for (i, key) in one_key_per_partition().iter().enumerate() {
        if i % 5 == 0 {
            for master in cluster.masters() {
                assert_eq!(master.cli(&["SCRIPT", "FLUSH"]), "OK");
            }
        }
        let request = support::notification_request(&format!("claim/{key}"), key, NOW);
        let outcome = store.accept(request, NOW).await.expect("accepts");
        assert_eq!(outcome, AcceptOutcome::Accepted);
    }
}

/// The tests that read the masters' counters or change their settings, one after the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masters_one_at_a_time() {
    let cluster = RedisCluster::shared();
    each_wait_goes_to_the_master_of_its_write(cluster).await;
    a_master_without_the_scripts_gets_them_loaded(cluster).await;
    start_up_checks_ask_every_master(cluster).await;
}

/// `WAIT` waits for the replicas of the connection's master: sent anywhere else, it would
/// wait for nothing and acknowledge a write no replica has.
async fn each_wait_goes_to_the_master_of_its_write(cluster: &RedisCluster) {
    let prefix = RedisCluster::unique_prefix();
    let store = store(cluster, &prefix, 1).await;
    for key in one_key_per_partition().iter().take(6) {
        let request = support::notification_request(&format!("claim/{key}"), key, NOW);
        let message_key = format!(
            "{prefix}:{{p{:02}}}:m:{}",
            partition_of(key, Partitions::DEFAULT),
            request.message.id
        );
        let writer = cluster.master_of_key(&message_key);
        for master in cluster.masters() {
            master.cli(&["CONFIG", "RESETSTAT"]);
        }
        let outcome = store.accept(request, NOW).await.expect("accepts");
        assert_eq!(outcome, AcceptOutcome::Accepted);
        for master in cluster.masters() {
            let stats = master.cli(&["INFO", "commandstats"]);
            // Any count: a master that had not loaded the script yet answers NOSCRIPT, and
            // the store sends the call and its WAIT again after loading it there.
            let waited = stats.contains("cmdstat_wait:");
            assert_eq!(
                waited,
                master.port == writer.port,
                "WAIT on port {} for a write on port {}: {stats}",
                master.port,
                writer.port
            );
        }
    }
}

async fn start_up_checks_ask_every_master(cluster: &RedisCluster) {
    let store = store(cluster, &RedisCluster::unique_prefix(), 0).await;
    let clean = check_redis(&store, true).await.expect("reads every master");
    assert_eq!(clean, Verdict::Start { warnings: vec![] });
    assert_eq!(
        check_replicas(&store, 1).await.expect("reads"),
        Verdict::Start { warnings: vec![] }
    );
    match check_replicas(&store, 2).await.expect("reads") {
        Verdict::Refuse(why) => assert!(why.contains("1 replica(s) connected"), "{why}"),
        other => panic!("two replicas per master are not there: {other:?}"),
    }

    let masters = cluster.masters();
    let lax = masters[1];
    assert_eq!(lax.cli(&["CONFIG", "SET", "appendonly", "no"]), "OK");
    let verdict = check_redis(&store, true).await.expect("reads every master");
    assert_eq!(lax.cli(&["CONFIG", "SET", "appendonly", "yes"]), "OK");
    match verdict {
        Verdict::Refuse(why) => {
            let named = format!("primary 127.0.0.1:{}: ", lax.port);
            assert!(why.starts_with(&named), "names the master: {why}");
            assert!(why.contains("appendonly no"), "{why}");
            for other in masters.iter().filter(|m| m.port != lax.port) {
                assert!(!why.contains(&other.port.to_string()), "{why}");
            }
        }
        other => panic!("one master without AOF is refused: {other:?}"),
    }
}
