//! The network between callbackd and its Redis at fault, through the fault proxy of
//! `support/fault_proxy.rs`: latency, a blackhole, resets, replies cut mid-frame, a trickle,
//! and a connection stranded while new ones work. Under load, every answer is a 200 or a 503
//! within the store's timeout and a margin; callbacks get 200 again within seconds of the
//! heal; and in the end every acknowledged event is forwarded under the one message id its
//! answers named.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::fault_proxy::{Fault, FaultProxy};
use support::redis::RedisServer;
use support::redis::cluster::cluster_port;
use support::sink::Sink;
use support::{TestServer, config, eventually};
use tokio::sync::Mutex;

const TIMEOUT_MS: u64 = 500;
/// The longest an answer may take: a script call and its reload after NOSCRIPT, each bounded
/// by the timeout, and a second for a busy 2-core machine.
const ANSWER_WITHIN: Duration = Duration::from_millis(3 * TIMEOUT_MS + 1_000);

struct Setup {
    server: TestServer,
    proxy: FaultProxy,
    sink: Sink,
    _redis: RedisServer,
}

/// callbackd with its Redis behind a fault proxy, forwarding the `payzu` source to a sink.
async fn behind_a_proxy() -> Setup {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let sink = Sink::ok().await;
    let mut cfg = config(
        &format!("redis://127.0.0.1:{}/0", proxy.port),
        Some(&format!("{}/events", sink.url)),
    );
    cfg.store.timeout_ms = TIMEOUT_MS;
    let server = TestServer::start(cfg).await;
    Setup {
        server,
        proxy,
        sink,
        _redis: redis,
    }
}

fn body(tx: usize) -> String {
    format!(r#"{{"id":"tx-{tx}","status":"COMPLETED"}}"#)
}

/// Posts callback `tx` and checks the answer is a 200 (with its message id) or a 503, in time.
async fn post(server: &TestServer, tx: usize) -> Option<String> {
    let started = Instant::now();
    let r = server.post_callback("payzu", &body(tx), None).await;
    let took = started.elapsed();
    let status = r.status().as_u16();
    assert!(took <= ANSWER_WITHIN, "tx-{tx}: {status} after {took:?}");
    match status {
        200 => Some(
            r.json::<Value>().await.expect("JSON")["messageId"]
                .as_str()
                .expect("messageId")
                .to_string(),
        ),
        503 => None,
        other => panic!("tx-{tx}: {other}, neither a 200 nor a 503"),
    }
}

/// Every message id each transaction was answered with.
type Answers = Arc<Mutex<BTreeMap<usize, BTreeSet<String>>>>;

/// Two senders posting new transactions until `until`; returns the next transaction number.
async fn load(server: &Arc<TestServer>, answers: &Answers, first: usize, for_: Duration) -> usize {
    let until = Instant::now() + for_;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(first));
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let (server, answers, next) = (server.clone(), answers.clone(), next.clone());
            tokio::spawn(async move {
                while Instant::now() < until {
                    let tx = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let answer = post(&server, tx).await;
                    answers.lock().await.entry(tx).or_default().extend(answer);
                }
            })
        })
        .collect();
    for sender in senders {
        sender.await.expect("a sender");
    }
    next.load(std::sync::atomic::Ordering::SeqCst)
}

/// Load through `fault` for 1.5 s, then the heal: callbacks are answered 200 again within
/// seconds; each refused one, sent again as its provider would, is acknowledged; and every
/// transaction is forwarded under exactly the one message id its answers named.
async fn survives(fault: Fault) {
    let Setup {
        server,
        proxy,
        sink,
        _redis,
    } = behind_a_proxy().await;
    let server = Arc::new(server);
    let answers: Answers = Arc::default();
    let mut next = load(&server, &answers, 0, Duration::from_millis(300)).await;
    proxy.set(fault);
    next = load(&server, &answers, next, Duration::from_millis(1_500)).await;
    proxy.set(Fault::Pass);
    let healed = Instant::now();
    loop {
        let tx = next;
        next += 1;
        let answer = post(&server, tx).await;
        let ok = answer.is_some();
        answers.lock().await.entry(tx).or_default().extend(answer);
        if ok {
            break;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(10),
            "{fault:?}: no 200 within 10 s of the heal"
        );
    }
    let recovered_in = healed.elapsed();

    let mut answers = answers.lock().await;
    let refused = answers.values().filter(|ids| ids.is_empty()).count();
    for (tx, ids) in answers.iter_mut() {
        let mut tries = 0;
        while ids.is_empty() {
            tries += 1;
            assert!(
                tries <= 20,
                "{fault:?}: tx-{tx} never acknowledged after the heal"
            );
            ids.extend(post(&server, *tx).await);
        }
        assert_eq!(
            ids.len(),
            1,
            "{fault:?}: tx-{tx} answered with two message ids: {ids:?}"
        );
    }
    let want: BTreeSet<String> = answers.values().flatten().cloned().collect();
    eventually(30, "every acknowledged event forwarded", || async {
        let forwarded: BTreeSet<String> = sink
            .received()
            .iter()
            .filter_map(|r| r.header("x-callbackd-message-id"))
            .collect();
        (forwarded == want).then_some(())
    })
    .await;
    println!(
        "{fault:?}: {} events, {refused} refused during the fault, 200 again {recovered_in:?} \
         after the heal, {} connections opened to Redis",
        answers.len(),
        proxy.accepted()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_past_the_timeout() {
    survives(Fault::Latency(Duration::from_millis(2 * TIMEOUT_MS))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackhole() {
    survives(Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resets() {
    survives(Fault::Reset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_cut_mid_frame() {
    survives(Fault::CutAfter(7)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle() {
    survives(Fault::Trickle(Duration::from_millis(20))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranded_connection() {
    survives(Fault::Strand).await;
}

/// The defect this guards: a connection gone silent without a FIN or RST (a partition, a NAT
/// that dropped the flow) failed every call with a timeout for good, while new connections
/// would have worked. Now the first timeout opens a new connection, and callbacks get 200
/// again within a few timeouts, without any heal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_store_connection_is_replaced() {
    let Setup {
        server,
        proxy,
        _redis,
        ..
    } = behind_a_proxy().await;
    assert!(post(&server, 0).await.is_some());
    let opened = proxy.accepted();
    proxy.set(Fault::Strand);
    let stranded = Instant::now();
    let mut tx = 1;
    while post(&server, tx).await.is_none() {
        tx += 1;
        assert!(
            stranded.elapsed() < Duration::from_secs(10),
            "still 503 after 10 s: the silent connection was never replaced"
        );
    }
    assert!(proxy.accepted() > opened, "a new connection was opened");
    println!(
        "200 again {:?} after the connection went silent, {} answers refused",
        stranded.elapsed(),
        tx - 1
    );
}

/// A store that stays silent (a blackhole that never heals, whatever connections are
/// opened) fails `/healthz` after `store.healthz_fails_after_secs`, so that an orchestrator
/// restarts the process; once the store answers again, `/healthz` is 200 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_fails_once_the_store_has_been_silent_for_long() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let mut cfg = config(&format!("redis://127.0.0.1:{}/0", proxy.port), None);
    cfg.store.timeout_ms = TIMEOUT_MS;
    cfg.store.healthz_fails_after_secs = 2;
    let server = TestServer::start(cfg).await;
    let healthz = || async {
        let r = server
            .client
            .get(format!("{}/healthz", server.url))
            .send()
            .await
            .expect("healthz answers");
        r.status().as_u16()
    };
    assert_eq!(healthz().await, 200);
    proxy.set(Fault::Blackhole);
    let silent = Instant::now();
    eventually(20, "healthz fails", || async {
        (healthz().await == 503).then_some(())
    })
    .await;
    // Its last answer came at most one ping interval (1 s) before the blackhole.
    assert!(
        silent.elapsed() >= Duration::from_secs(1),
        "not before the store was silent for the configured time"
    );
    proxy.set(Fault::Pass);
    eventually(20, "healthz passes again", || async {
        (healthz().await == 200).then_some(())
    })
    .await;
}

/// Three cluster masters, each announcing a fault proxy in front of it as its address, so
/// that every connection of the cluster client goes through one.
async fn cluster_behind_proxies() -> (Vec<RedisServer>, Vec<FaultProxy>) {
    let ports: Vec<u16> = (0..3).map(|_| cluster_port()).collect();
    let mut proxies = Vec::new();
    for &port in &ports {
        proxies.push(FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], port))).await);
    }
    let nodes: Vec<RedisServer> = ports
        .iter()
        .zip(&proxies)
        .map(|(&port, proxy)| {
            let bus = (port + 10_000).to_string();
            let announced = proxy.port.to_string();
            RedisServer::try_start_on(
                port,
                "always",
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    &bus,
                    "--cluster-announce-port",
                    &announced,
                    "--cluster-announce-bus-port",
                    &bus,
                    "--cluster-config-file",
                    "nodes.conf",
                ],
                false,
                None,
            )
            .expect("a cluster node starts")
        })
        .collect();
    let created = std::process::Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(ports.iter().map(|p| format!("127.0.0.1:{p}")))
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stdout)
    );
    eventually(30, "every node sees the cluster ok", || async {
        nodes
            .iter()
            .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
            .then_some(())
    })
    .await;
    (nodes, proxies)
}

/// The same defect on a Redis Cluster: the cluster client reconnects a node after a dropped
/// connection, not after a silent one. With one master's connection stranded, callbacks of its
/// partitions get 503 only until the cluster connection is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_cluster_node_connection_is_replaced() {
    let (_nodes, proxies) = cluster_behind_proxies().await;
    let mut cfg = config(&format!("redis://127.0.0.1:{}/0", proxies[0].port), None);
    cfg.store.timeout_ms = TIMEOUT_MS;
    let server = TestServer::start(cfg).await;
    // Enough callbacks in a row that each master's partitions are written to.
    let all_accepted = |from: usize| {
        let server = &server;
        async move {
            for tx in from..from + 30 {
                if post(server, tx).await.is_none() {
                    return false;
                }
            }
            true
        }
    };
    assert!(
        all_accepted(0).await,
        "the cluster accepts before the fault"
    );
    let opened = proxies[1].accepted();
    proxies[1].set(Fault::Strand);
    let stranded = Instant::now();
    let mut from = 1_000;
    while !all_accepted(from).await {
        from += 1_000;
        assert!(
            stranded.elapsed() < Duration::from_secs(20),
            "a master's partitions still refused 20 s after its connection went silent"
        );
    }
    assert!(
        proxies[1].accepted() > opened,
        "a new connection to that master"
    );
    println!(
        "every partition accepts again {:?} after a master's connection went silent",
        stranded.elapsed()
    );
}

/// The defect this guards: a delivery held its host's slot until its outcome was recorded, so
/// a store that answers slowly (or not at all, for a while) capped a fast gateway at its
/// slots per store commit, and the next message for it waited out its turn and went back to
/// the queue. Now the slot is given back when the request ends: with one slot per host, a
/// message waiting for it is sent while the store cannot record the first one's outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_slot_is_free_while_the_store_records_the_outcome() {
    let redis = RedisServer::start();
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let first_reply = support::sink::Gate::new();
    let sink = Sink::start_async({
        let first_reply = first_reply.clone();
        move |_, n| {
            let first_reply = first_reply.clone();
            Box::pin(async move {
                if n == 0 {
                    first_reply.wait().await;
                }
                support::sink::Reply::status(204)
            })
        }
    })
    .await;
    let mut cfg = config(
        &format!("redis://127.0.0.1:{}/0", proxy.port),
        Some(&format!("{}/events", sink.url)),
    );
    cfg.store.timeout_ms = TIMEOUT_MS;
    cfg.dispatch.per_host_concurrency = 1;
    let server = TestServer::start(cfg).await;

    let first = post(&server, 1)
        .await
        .expect("the first callback is acknowledged");
    eventually(10, "the first delivery reaches the sink", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    let second = post(&server, 2)
        .await
        .expect("the second callback is acknowledged");
    // Claimed, so it waits for the host's one slot, which the first delivery holds.
    eventually(5, "the second message is claimed", || async {
        let r = server.admin_get(&format!("/v1/messages/{second}")).await;
        let v: Value = r.json().await.ok()?;
        (v["state"] == "in_flight").then_some(())
    })
    .await;
    // The store goes silent, then the sink answers the first delivery: its outcome cannot be
    // recorded until the heal.
    proxy.set(Fault::Blackhole);
    first_reply.open();
    eventually(
        5,
        "the second message is sent while the store is silent",
        || async {
            let sent: Vec<String> = sink
                .received()
                .iter()
                .filter_map(|r| r.header("x-callbackd-message-id"))
                .collect();
            sent.contains(&second).then_some(())
        },
    )
    .await;
    proxy.set(Fault::Pass);
    for id in [&first, &second] {
        eventually(30, "both outcomes recorded after the heal", || async {
            let r = server.admin_get(&format!("/v1/messages/{id}")).await;
            let v: Value = r.json().await.ok()?;
            (v["state"] == "delivered").then_some(())
        })
        .await;
    }
}
