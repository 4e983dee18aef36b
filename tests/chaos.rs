//! Chaos with reconciliation: the promise under faults is that every callback or hand-off that
//! got a 2xx is delivered at least once, and nothing is delivered that was not accepted.
//!
//! Senders push unique callbacks and hand-offs (retrying like a provider when refused) while
//! the run SIGKILLs callbackd processes, kills and restarts Redis (AOF, `appendfsync always`),
//! and the receiving sink fails 20% of deliveries, hangs some and resets some connections.
//! Then the faults stop, the queue drains, and the run reconciles acknowledged against
//! delivered. The SQLite variant kills the single process only. The Redis Cluster variant
//! SIGKILLs a master instead of restarting Redis, with `store.min_replicas_acked = 1`, and
//! also checks that events acknowledged before the failover are still replays.
//!
//! CI runs a short version. A longer one: `CHAOS_SECS=300 cargo test --release --test chaos
//! -- --nocapture` (figures in RELIABILITY.md).

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::process::Process;
use support::redis::RedisServer;
use support::redis::cluster::RedisCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn chaos_duration() -> Duration {
    let secs = std::env::var("CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    Duration::from_secs(secs)
}

/// What the sink saw: first successful delivery time per message id, and how many 2xx
/// answers each id got.
#[derive(Default)]
struct Deliveries {
    first_success: HashMap<String, Instant>,
    successes: HashMap<String, usize>,
}

/// A raw TCP receiver, so it can misbehave the ways real receivers do: answer 500, hang past
/// the client's timeout, or reset the connection without a word.
struct ChaosSink {
    url: String,
    deliveries: Arc<Mutex<Deliveries>>,
    healthy: Arc<AtomicBool>,
}

impl ChaosSink {
    async fn start() -> ChaosSink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/sink", listener.local_addr().unwrap());
        let deliveries: Arc<Mutex<Deliveries>> = Arc::default();
        let healthy = Arc::new(AtomicBool::new(false));
        let counter = Arc::new(AtomicU64::new(0));
        tokio::spawn({
            let deliveries = deliveries.clone();
            let healthy = healthy.clone();
            async move {
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let (deliveries, healthy, counter) =
                        (deliveries.clone(), healthy.clone(), counter.clone());
                    tokio::spawn(async move {
                        let _ = serve_connection(stream, deliveries, healthy, counter).await;
                    });
                }
            }
        });
        ChaosSink {
            url,
            deliveries,
            healthy,
        }
    }
}

async fn serve_connection(
    mut stream: tokio::net::TcpStream,
    deliveries: Arc<Mutex<Deliveries>>,
    healthy: Arc<AtomicBool>,
    counter: Arc<AtomicU64>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    loop {
        // Read one request: headers, then Content-Length bytes of body.
        let header_end = loop {
            if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break pos + 4;
            }
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..header_end]).to_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < header_end + length {
            let mut chunk = [0u8; 8192];
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let id = head
            .lines()
            .find_map(|l| l.strip_prefix("x-callbackd-message-id:"))
            .map(|v| v.trim().to_string())
            .unwrap_or_default();
        buf.drain(..header_end + length);
        let roll = counter.fetch_add(1, Ordering::Relaxed) % 20;
        if !healthy.load(Ordering::SeqCst) {
            match roll {
                0..=3 => {
                    stream
                        .write_all(
                            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n",
                        )
                        .await?;
                    continue;
                }
                4 => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    return Ok(());
                }
                5 => {
                    // Reset: close with unread data and SO_LINGER 0.
                    let _ = stream.set_zero_linger();
                    return Ok(());
                }
                _ => {}
            }
        }
        {
            let mut d = deliveries.lock().unwrap();
            d.first_success
                .entry(id.clone())
                .or_insert_with(Instant::now);
            *d.successes.entry(id).or_default() += 1;
        }
        stream.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await?;
    }
}

#[derive(Default)]
struct Ledger {
    /// message id → when the sender got its 2xx
    acknowledged: Mutex<HashMap<String, Instant>>,
    /// event number → the message id its 2xx named
    ids: Mutex<HashMap<usize, String>>,
    refused: AtomicUsize,
    gave_up: AtomicUsize,
}

/// Event `n`: a callback when even, a hand-off when odd; the same request every time it is
/// sent, so a retry of a committed event is a replay.
fn event_request(
    client: &reqwest::Client,
    base: &str,
    n: usize,
    sink_url: &str,
) -> reqwest::RequestBuilder {
    let request = if n.is_multiple_of(2) {
        client
            .post(format!("{base}/v1/callbacks/open"))
            .body(json!({"id": format!("chaos-{n}"), "status": "COMPLETED"}).to_string())
    } else {
        client
            .post(format!("{base}/v1/notifications"))
            .bearer_auth(support::CONNECTOR_TOKEN)
            .json(&json!({"paymentId": format!("chaos-pay-{n}"), "status": "approved", "callbackUrl": sink_url}))
    };
    request.timeout(Duration::from_secs(3))
}

/// The message id a 2xx answer names.
fn acknowledged_id(body: &Value) -> String {
    body["messageId"]
        .as_str()
        .or(body["notificationId"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// Sends one event until it is acknowledged (or 60 s pass), round-robin over the processes.
async fn send_until_acknowledged(
    client: &reqwest::Client,
    urls: &[Arc<Mutex<String>>],
    ledger: &Ledger,
    n: usize,
    sink_url: &str,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut attempt = 0;
    while Instant::now() < deadline {
        let base = urls[(n + attempt) % urls.len()].lock().unwrap().clone();
        attempt += 1;
        match event_request(client, &base, n, sink_url).send().await {
            Ok(r) if r.status().is_success() => {
                let Ok(body) = r.json::<Value>().await else {
                    continue;
                };
                let id = acknowledged_id(&body);
                ledger.ids.lock().unwrap().insert(n, id.clone());
                ledger
                    .acknowledged
                    .lock()
                    .unwrap()
                    .entry(id)
                    .or_insert_with(Instant::now);
                return;
            }
            _ => {
                ledger.refused.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    ledger.gave_up.fetch_add(1, Ordering::Relaxed);
}

struct Report {
    acknowledged: usize,
    delivered: usize,
    lost: usize,
    duplicates: usize,
    refused: usize,
    max_delay: Duration,
}

fn reconcile(ledger: &Ledger, sink: &ChaosSink) -> Report {
    let acknowledged = ledger.acknowledged.lock().unwrap();
    let d = sink.deliveries.lock().unwrap();
    let ack_ids: HashSet<&String> = acknowledged.keys().collect();
    let lost = ack_ids
        .iter()
        .filter(|id| !d.first_success.contains_key(id.as_str()))
        .count();
    let unexpected: Vec<&String> = d
        .first_success
        .keys()
        .filter(|id| !ack_ids.contains(id))
        .collect();
    let max_delay = acknowledged
        .iter()
        .filter_map(|(id, at)| {
            d.first_success
                .get(id)
                .map(|first| first.saturating_duration_since(*at))
        })
        .max()
        .unwrap_or_default();
    // Senders retry until acknowledged, and a retry of a committed event is answered with the
    // original id, so every delivered id was acknowledged, except for events whose sender
    // gave up after a commit whose answer was lost with a killed process.
    assert!(
        unexpected.len() <= ledger.gave_up.load(Ordering::Relaxed),
        "delivered something never acknowledged: {unexpected:?}"
    );
    Report {
        acknowledged: acknowledged.len(),
        delivered: d.first_success.len(),
        lost,
        duplicates: d.successes.values().map(|n| n - 1).sum(),
        refused: ledger.refused.load(Ordering::Relaxed),
        max_delay,
    }
}

/// What a run breaks besides the callbackd processes it SIGKILLs round after round.
enum StoreFault {
    /// Nothing: the store is a file, lost only with the machine.
    None,
    /// Every third round Redis is SIGKILLed and started again from its AOF.
    RestartRedis(RedisServer),
    /// In the second round the master on `victim` is SIGKILLed; its replica takes over, and
    /// once every slot is served again the old master comes back as a replica. `store.url`
    /// names another node, so restarted processes still find the cluster.
    FailOverMaster { cluster: RedisCluster, victim: u16 },
}

/// Whether the killed master's replica was promoted: three masters run again and every slot
/// is served. (Before the cluster marks the master as failed, which takes the node timeout,
/// the other nodes still report every slot served.)
fn replica_took_over(cluster: &RedisCluster) -> bool {
    cluster.masters().len() == 3 && cluster.serves_every_slot()
}

/// When the cluster's failover happened, for the replay check of what was acknowledged
/// before it.
struct Failover {
    killed_at: Instant,
    rejoined: bool,
}

impl StoreFault {
    /// Applies this round's fault, noting in `failover` when it kills a master.
    async fn strike(&mut self, round: usize, failover: &mut Option<Failover>) {
        match self {
            StoreFault::None => {}
            StoreFault::RestartRedis(redis) => {
                if round.is_multiple_of(3) {
                    redis.stop(true);
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    redis.start_again();
                }
            }
            StoreFault::FailOverMaster { cluster, victim } => match failover {
                None if round == 2 => {
                    cluster.kill(*victim);
                    *failover = Some(Failover {
                        killed_at: Instant::now(),
                        rejoined: false,
                    });
                }
                Some(f) if !f.rejoined && replica_took_over(cluster) => {
                    cluster.restart(*victim);
                    f.rejoined = true;
                }
                _ => {}
            },
        }
    }

    /// Waits until the store is whole again after the last fault.
    async fn settle(&mut self) {
        if let StoreFault::FailOverMaster { cluster, victim } = self {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !replica_took_over(cluster) {
                assert!(
                    Instant::now() < deadline,
                    "no replica took over from the killed master"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            if !cluster
                .nodes()
                .iter()
                .any(|n| n.port == *victim && n.is_running())
            {
                cluster.restart(*victim);
            }
            tokio::task::block_in_place(|| cluster.wait_until_ok());
            let rejoined = cluster.nodes().iter().find(|n| n.port == *victim);
            assert_eq!(
                rejoined.and_then(|n| n.cli(&["ROLE"]).lines().next().map(str::to_string)),
                Some("slave".to_string()),
                "the killed master came back as a replica: its replica took over"
            );
        }
    }
}

async fn run_chaos(
    store_url: &str,
    processes: usize,
    mut fault: StoreFault,
    env: &[(&str, &str)],
    name: &str,
) {
    let sink = ChaosSink::start().await;
    let source = format!(
        "[sources.open]\nsignature = \"none\"\nforward_url = \"{}\"\nallow_private_forward_url = true\n",
        sink.url
    );
    let start = || Process::start_with_env(store_url, &source, env);
    let mut procs: Vec<Process> = (0..processes).map(|_| start()).collect();
    let urls: Vec<Arc<Mutex<String>>> = procs
        .iter()
        .map(|p| Arc::new(Mutex::new(p.url.clone())))
        .collect();
    let ledger = Arc::new(Ledger::default());
    let client = support::client();
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let senders: Vec<_> = (0..8)
        .map(|_| {
            let (client, urls, ledger, stop, next, sink_url) = (
                client.clone(),
                urls.clone(),
                ledger.clone(),
                stop.clone(),
                next.clone(),
                sink.url.clone(),
            );
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    send_until_acknowledged(&client, &urls, &ledger, n, &sink_url).await;
                }
            })
        })
        .collect();

    let started = Instant::now();
    let mut round = 0;
    let mut failover = None;
    while started.elapsed() < chaos_duration() {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        round += 1;
        let victim = round % procs.len();
        let _ = procs[victim].child.kill();
        let _ = procs[victim].child.wait();
        fault.strike(round, &mut failover).await;
        procs[victim] = start();
        *urls[victim].lock().unwrap() = procs[victim].url.clone();
    }
    fault.settle().await;
    stop.store(true, Ordering::SeqCst);
    for s in senders {
        s.await.unwrap();
    }
    sink.healthy.store(true, Ordering::SeqCst);
    if let Some(failover) = failover {
        let base = urls[0].lock().unwrap().clone();
        let replays =
            replays_of_events_before(&client, &base, &ledger, failover.killed_at, &sink.url).await;
        println!(
            "chaos [{name}]: {replays} events acknowledged before the failover were replayed with their ids"
        );
        assert!(
            replays > 20,
            "the run acknowledged enough before the failover to mean something"
        );
    }
    let drain_deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let report = reconcile(&ledger, &sink);
        if report.lost == 0 || Instant::now() > drain_deadline {
            println!(
                "chaos [{name}]: {:?} of faults, {} kills; acknowledged {}, delivered {}, lost {}, duplicates delivered {}, refused requests {}, senders gave up {}, max acceptance-to-delivery {:?}",
                chaos_duration(),
                round,
                report.acknowledged,
                report.delivered,
                report.lost,
                report.duplicates,
                report.refused,
                ledger.gave_up.load(Ordering::Relaxed),
                report.max_delay
            );
            assert!(
                report.acknowledged > 100,
                "the run accepted enough to mean something"
            );
            assert_eq!(report.lost, 0, "an acknowledged event was never delivered");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends every event acknowledged before `before` once more: each must be answered as a
/// replay, with the id of its first answer. Returns how many were checked.
async fn replays_of_events_before(
    client: &reqwest::Client,
    base: &str,
    ledger: &Ledger,
    before: Instant,
    sink_url: &str,
) -> usize {
    let earlier: Vec<(usize, String)> = {
        let acknowledged = ledger.acknowledged.lock().unwrap();
        let ids = ledger.ids.lock().unwrap();
        ids.iter()
            .filter(|(_, id)| acknowledged.get(*id).is_some_and(|at| *at < before))
            .map(|(n, id)| (*n, id.clone()))
            .collect()
    };
    for (n, id) in &earlier {
        let r = event_request(client, base, *n, sink_url)
            .send()
            .await
            .unwrap_or_else(|e| panic!("replay of event {n}: {e}"));
        assert!(
            r.status().is_success(),
            "replay of event {n}: {}",
            r.status()
        );
        assert_eq!(
            r.headers()
                .get("idempotent-replayed")
                .and_then(|v| v.to_str().ok()),
            Some("true"),
            "event {n}, acknowledged before the failover, is not recognised as a replay"
        );
        let body: Value = r.json().await.expect("a JSON answer");
        assert_eq!(
            &acknowledged_id(&body),
            id,
            "event {n} replayed with another id"
        );
    }
    earlier.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_two_processes() {
    let redis = RedisServer::start();
    let url = redis.url();
    run_chaos(&url, 2, StoreFault::RestartRedis(redis), &[], "redis").await;
}

/// A master of a Redis Cluster is SIGKILLed under load with `store.min_replicas_acked = 1`:
/// while its replica takes over, requests for its partitions get 503, never a 2xx without a
/// replica holding the write; afterwards every acknowledged event is delivered, and events
/// acknowledged before the failover are still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_cluster_master_failover() {
    let cluster = RedisCluster::start();
    let victim = cluster.masters()[0].port;
    let url = cluster
        .nodes()
        .iter()
        .find(|n| n.port != victim)
        .expect("another node")
        .url();
    run_chaos(
        &url,
        2,
        StoreFault::FailOverMaster { cluster, victim },
        &[("CALLBACKD__STORE__MIN_REPLICAS_ACKED", "1")],
        "cluster failover",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_sqlite_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("chaos.db").display());
    run_chaos(&url, 1, StoreFault::None, &[], "sqlite").await;
}
