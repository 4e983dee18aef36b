//! The Redis engine shared by several processes: work accepted through one process wakes the
//! dispatcher of another at once (the scripts publish on their partition's wake channel, on
//! a cluster a shard channel), a lost subscription is replaced, an idle dispatcher that
//! subscribes costs Redis next to nothing (counted by `INFO commandstats`), and a user whose
//! ACL allows no channels still accepts and delivers.

mod support;

use std::sync::Arc;
use std::time::Duration;

use callbackd::app::Settings;
use callbackd::clock::SystemClock;
use callbackd::dispatch::Dispatcher;
use callbackd::store::Store;
use callbackd::store::redis::RedisStore;
use support::redis::RedisServer;
use support::redis::cluster::RedisCluster;
use support::sink::Sink;
use support::wake::{assert_woken_at_once, delivered_after, front_and_back};
use support::{config, eventually};
use tokio_util::sync::CancellationToken;

const RETENTION_SECS: u64 = 2_592_000;
const TIMEOUT: Duration = Duration::from_secs(5);
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_accepted_by_one_process_is_delivered_by_another_at_once() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&redis.url(), &sink).await;
    // The back subscribes, and its first (empty) claims pass.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_woken_at_once(&front, &sink, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_the_shard_channels_wake_another_process_at_once() {
    let cluster = RedisCluster::start();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&cluster.url(), &sink).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Callbacks of several payments: their partitions lie on different masters.
    assert_woken_at_once(&front, &sink, 20).await;
}

/// The ids of the clients subscribed to `server`'s channels.
fn subscribers(server: &RedisServer) -> Vec<String> {
    server
        .cli(&["CLIENT", "LIST", "TYPE", "pubsub"])
        .lines()
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("id="))
                .map(str::to_string)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_is_replaced_and_wakes_again() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&redis.url(), &sink).await;
    let first = eventually(10, "the back subscribes", || async {
        let found = subscribers(&redis);
        (found.len() == 1).then_some(found)
    })
    .await;
    redis.cli(&["CLIENT", "KILL", "ID", &first[0]]);
    eventually(10, "another connection subscribes", || async {
        let found = subscribers(&redis);
        (found.len() == 1 && found != first).then_some(())
    })
    .await;
    // No pause: a wake-up right after the count the new subscription starts with is not
    // taken for what that count found.
    assert_woken_at_once(&front, &sink, 10).await;
}

/// Commands Redis ran for a dispatcher with no work over 10 s (`INFO commandstats`, after
/// `CONFIG RESETSTAT`).
async fn idle_commands(wake_ups: bool) -> u64 {
    let redis = RedisServer::start();
    let settings = Settings::from_config(&config(&redis.url(), None)).expect("settings");
    let store = RedisStore::connect(&redis.url(), TIMEOUT, RETENTION_SECS)
        .await
        .expect("connects");
    let store: Arc<dyn Store> = Arc::new(if wake_ups {
        store
    } else {
        store.without_wake_ups()
    });
    let dispatcher = Dispatcher::new(
        &settings,
        store,
        Arc::new(SystemClock),
        Arc::new(tokio::sync::Notify::new()),
    )
    .expect("dispatcher");
    let stop = CancellationToken::new();
    let running = tokio::spawn(Arc::new(dispatcher).run(stop.clone(), Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    redis.cli(&["CONFIG", "RESETSTAT"]);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let stats = redis.cli(&["INFO", "commandstats"]);
    stop.cancel();
    running.await.expect("the dispatcher stops");
    stats
        .lines()
        .filter(|line| !line.starts_with("cmdstat_config") && !line.starts_with("cmdstat_info"))
        .filter_map(|line| {
            let calls = line.split("calls=").nth(1)?.split(',').next()?;
            calls.parse::<u64>().ok()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_dispatcher_costs_next_to_nothing_when_it_subscribes() {
    let polled = idle_commands(false).await;
    let subscribed = idle_commands(true).await;
    eprintln!(
        "an idle dispatcher over 10 s: polling every 100 ms, {polled} commands; subscribed, \
         polling every 5 s, {subscribed} commands"
    );
    assert!(
        polled >= 1000,
        "the 100 ms poll counts partitions: {polled}"
    );
    assert!(
        subscribed * 8 <= polled,
        "subscribed: {subscribed} commands, polling: {polled}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_allowed_no_channels_still_accepts_and_delivers() {
    let redis = RedisServer::start();
    let reply = redis.cli(&[
        "ACL",
        "SETUSER",
        "nochannels",
        "on",
        ">pw-NoChannels-1",
        "~*",
        "resetchannels",
        "+@all",
    ]);
    assert_eq!(reply, "OK");
    let url = format!(
        "redis://nochannels:pw-NoChannels-1@127.0.0.1:{}/0",
        redis.port
    );
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&url, &sink).await;
    for n in 30..33 {
        delivered_after(&front, &sink, n).await;
    }
    assert!(
        subscribers(&redis).is_empty(),
        "a refused subscription is not retried"
    );
}

/// The `ZCOUNT`s Redis ran (`INFO commandstats`): two per partition counted.
fn zcounts(redis: &RedisServer) -> u64 {
    redis
        .cli(&["INFO", "commandstats"])
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_zcount:calls="))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_of_work_from_another_process_is_counted_where_it_was_written() {
    let redis = RedisServer::start();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&redis.url(), &sink).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    redis.cli(&["CONFIG", "RESETSTAT"]);
    for n in 40..60 {
        delivered_after(&front, &sink, n).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Each of the 20 wake-ups counts its own partition; the other 63 are counted again
    // every 5 s, not at every wake-up (which would be 20 x 128 = 2,560 and more).
    let counted = zcounts(&redis);
    eprintln!("20 callbacks 100 ms apart through another process: {counted} ZCOUNTs");
    assert!(counted <= 1000, "{counted} ZCOUNTs");
}
