//! Chaos with reconciliation: the promise under faults is that every callback or hand-off that
//! got a 2xx is delivered at least once, and nothing is delivered that was not accepted.
//!
//! Senders push unique callbacks and hand-offs (retrying like a provider when refused) while
//! the run SIGKILLs callbackd processes, kills and restarts Redis (AOF, `appendfsync always`),
//! and the receiving sink fails 20% of deliveries, hangs some and resets some connections.
//! Then the faults stop, the queue drains, and the run reconciles acknowledged against
//! delivered. The SQLite variant kills the single process only. The Redis Cluster variant
//! SIGKILLs a master instead of restarting Redis, with its replica paused (SIGSTOP) just
//! before, so no replica acknowledges the writes of that moment: with
//! `store.min_replicas_acked = 1` none of them may get a 2xx (with 0, several do), and every
//! event acknowledged before the failover is still a replay after it.
//!
//! On PostgreSQL, two processes share one private server whose postmaster is stopped at once
//! (`pg_ctl stop -m immediate`) or SIGKILLed with its backends every second round and started
//! again: every event acknowledged before the last crash is a replay after it. The failover
//! variant runs a primary with a synchronous standby, both in `store.url`
//! (`target_session_attrs=read-write`): the standby is paused (SIGSTOP) for several store
//! timeouts, then the primary is SIGKILLed and the standby resumed and promoted. Nothing may
//! get a 2xx while the standby is paused (each commit waits for it, and neither callbackd's
//! timeout nor the statement timeout makes it local), callbackd goes on on the promoted
//! standby, and every event acknowledged before the kill is a replay there.
//!
//! CI runs a short version. A longer one: `CHAOS_SECS=300 cargo test --release --test chaos
//! -- --nocapture` (figures in RELIABILITY.md).

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use callbackd::store::Partitions;
use callbackd::store::ids::partition_of;
use postgres_support::PostgresServer;
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

/// One request of a sender and how it was answered.
struct Answer {
    event: usize,
    sent: Instant,
    answered: Instant,
    success: bool,
    /// A 2xx answered as a replay (`Idempotent-Replayed: true`) of a write made earlier.
    replayed: bool,
}

#[derive(Default)]
struct Ledger {
    /// message id → when the sender got its 2xx
    acknowledged: Mutex<HashMap<String, Instant>>,
    /// Every request sent, in the order answered.
    answers: Mutex<Vec<Answer>>,
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

/// The store partition of event `n` (see [`event_request`]): its ordering key's.
fn partition_of_event(n: usize) -> u8 {
    let key = if n.is_multiple_of(2) {
        callbackd::inbound::accept::ordering_key("open", &format!("chaos-{n}"))
    } else {
        callbackd::payment::ordering_key(&format!("chaos-pay-{n}"))
    };
    partition_of(&key, Partitions::DEFAULT)
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
        let sent = Instant::now();
        let answer = event_request(client, &base, n, sink_url).send().await;
        let success = answer.as_ref().is_ok_and(|r| r.status().is_success());
        let replayed = answer.as_ref().is_ok_and(|r| {
            r.headers()
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true")
        });
        ledger.answers.lock().unwrap().push(Answer {
            event: n,
            sent,
            answered: Instant::now(),
            success,
            replayed,
        });
        match answer {
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
    /// In the second round the replica of the master on `victim` is paused, and once
    /// writes to the master's partitions have been answered meanwhile, the master is
    /// SIGKILLed and its replica resumed; it takes over, and once every slot is served again
    /// the old master comes back as a replica. `store.url` names another node, so restarted
    /// processes still find the cluster.
    FailOverMaster { cluster: RedisCluster, victim: u16 },
    /// Every second round the PostgreSQL server crashes, alternately by `pg_ctl stop -m
    /// immediate` and by SIGKILL of the postmaster and its backends, and starts again: crash
    /// recovery replays the WAL. (Both happen within CI's 12 s, even on a busy machine.)
    CrashPostgres(PostgresServer),
    /// In the second round the primary's synchronous standby is paused for at least `hold`
    /// and until requests have been answered meanwhile; then the primary is SIGKILLed, the
    /// standby resumed and promoted. `store.url` names both, primary first.
    FailOverPostgres {
        primary: PostgresServer,
        standby: PostgresServer,
        hold: Duration,
    },
}

/// Requests for the victim's partitions answered while its replica was paused, before the
/// kill, for the window to mean something.
const ANSWERED_WHILE_PAUSED: usize = 3;

/// Whether the killed master's replica was promoted: three masters run again and every slot
/// is served. (Before the cluster marks the master as failed, which takes the node timeout,
/// the other nodes still report every slot served.)
fn replica_took_over(cluster: &RedisCluster) -> bool {
    cluster.masters().len() == 3 && cluster.serves_every_slot()
}

/// When the cluster's failover happened, for the replay check of what was acknowledged
/// before it.
struct Failover {
    /// The partitions the killed master served.
    partitions: HashSet<u8>,
    paused_at: Instant,
    killed_at: Instant,
    /// When every slot was seen served again.
    took_over_at: Option<Instant>,
    rejoined: bool,
}

impl Failover {
    /// Requests for the killed master's partitions sent after its replica was paused and
    /// answered before the kill: (2xx for a new write, 2xx replays, refused). A replay there is
    /// of a write made before the pause, which the replica had (a retry of a request whose
    /// answer was lost with a SIGKILLed process); the replay check after the failover finds
    /// out if it did not.
    fn answers_while_paused(&self, ledger: &Ledger) -> (usize, usize, usize) {
        let answers = ledger.answers.lock().unwrap();
        let window = answers.iter().filter(|a| {
            a.sent >= self.paused_at
                && a.answered <= self.killed_at
                && self.partitions.contains(&partition_of_event(a.event))
        });
        window.fold((0, 0, 0), |(new, replayed, refused), a| {
            match (a.success, a.replayed) {
                (true, false) => (new + 1, replayed, refused),
                (true, true) => (new, replayed + 1, refused),
                (false, _) => (new, replayed, refused + 1),
            }
        })
    }
}

/// Whether an event was acknowledged in the last `ms` milliseconds.
fn acknowledged_within(ledger: &Ledger, ms: u64) -> bool {
    let acknowledged = ledger.acknowledged.lock().unwrap();
    acknowledged
        .values()
        .any(|at| at.elapsed() < Duration::from_millis(ms))
}

/// Every store partition: what a single PostgreSQL server holds.
fn all_partitions() -> HashSet<u8> {
    (0..Partitions::DEFAULT.count())
        .filter_map(|p| u8::try_from(p).ok())
        .collect()
}

/// Waits, at least `hold` after `paused_at`, until [`ANSWERED_WHILE_PAUSED`] requests for
/// `partitions` sent since have been answered.
async fn answered_while_paused(
    ledger: &Ledger,
    partitions: &HashSet<u8>,
    paused_at: Instant,
    hold: Duration,
) {
    let deadline = paused_at + hold + Duration::from_secs(60);
    loop {
        let answered = ledger
            .answers
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a.sent >= paused_at && partitions.contains(&partition_of_event(a.event)))
            .count();
        if answered >= ANSWERED_WHILE_PAUSED && paused_at.elapsed() >= hold {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no request for the victim's partitions was answered while its replica was paused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The store partitions whose keys (`cb:{pNN}:...`) live on the master on `port`.
fn partitions_on(cluster: &RedisCluster, port: u16) -> HashSet<u8> {
    (0..Partitions::DEFAULT.count())
        .filter_map(|p| u8::try_from(p).ok())
        .filter(|p| cluster.master_of_key(&format!("{{p{p:02}}}")).port == port)
        .collect()
}

impl StoreFault {
    /// Applies this round's fault, noting in `failover` when it kills a master.
    /// A crash of the store it restarts is noted in `crashes`.
    async fn strike(
        &mut self,
        round: usize,
        failover: &mut Option<Failover>,
        crashes: &mut Vec<Instant>,
        ledger: &Ledger,
    ) {
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
                    let partitions = partitions_on(cluster, *victim);
                    let replica = cluster.replica_of(*victim).port;
                    let paused = cluster.nodes().iter().find(|n| n.port == replica);
                    let paused = paused.expect("the replica is a node");
                    paused.pause();
                    let paused_at = Instant::now();
                    // Until the senders' requests for those partitions have come back: each
                    // waits for a replica's acknowledgement up to four fifths of the store
                    // timeout, however long that takes on this machine.
                    answered_while_paused(ledger, &partitions, paused_at, Duration::ZERO).await;
                    cluster.kill(*victim);
                    let killed_at = Instant::now();
                    let paused = cluster.nodes().iter().find(|n| n.port == replica);
                    paused.expect("the replica is a node").resume();
                    *failover = Some(Failover {
                        partitions,
                        paused_at,
                        killed_at,
                        took_over_at: None,
                        rejoined: false,
                    });
                }
                Some(f) if !f.rejoined && replica_took_over(cluster) => {
                    f.took_over_at = Some(Instant::now());
                    cluster.restart(*victim);
                    f.rejoined = true;
                }
                _ => {}
            },
            StoreFault::CrashPostgres(server) => {
                if round.is_multiple_of(2) {
                    // In the midst of acknowledgements, so a 2xx given before its commit was
                    // flushed would be lost.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while Instant::now() < deadline && !acknowledged_within(ledger, 20) {
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    tokio::task::block_in_place(|| {
                        if round.is_multiple_of(4) {
                            server.kill9();
                        } else {
                            server.stop_immediate();
                        }
                        crashes.push(Instant::now());
                        std::thread::sleep(Duration::from_millis(300));
                        server.start_again();
                    });
                }
            }
            StoreFault::FailOverPostgres {
                primary,
                standby,
                hold,
            } => {
                if round == 2 && failover.is_none() {
                    let partitions = all_partitions();
                    standby.pause();
                    let paused_at = Instant::now();
                    answered_while_paused(ledger, &partitions, paused_at, *hold).await;
                    let killed_at = tokio::task::block_in_place(|| {
                        primary.kill9();
                        let killed_at = Instant::now();
                        standby.resume();
                        standby.promote();
                        killed_at
                    });
                    *failover = Some(Failover {
                        partitions,
                        paused_at,
                        killed_at,
                        took_over_at: Some(Instant::now()),
                        rejoined: true,
                    });
                }
            }
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
    // A restart while the cluster fails over is not ready (its /readyz is 503) while a slot
    // is unserved: it must serve, and still run at the end.
    let restart = || Process::start_alive_with_env(store_url, &source, env);
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
    let mut crashes = Vec::new();
    // When each round's callbackd kill happened: every round must acknowledge something.
    let mut kills = Vec::new();
    while started.elapsed() < chaos_duration() {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        round += 1;
        let victim = round % procs.len();
        let _ = procs[victim].child.kill();
        let _ = procs[victim].child.wait();
        kills.push(Instant::now());
        fault
            .strike(round, &mut failover, &mut crashes, &ledger)
            .await;
        procs[victim] = restart();
        *urls[victim].lock().unwrap() = procs[victim].url.clone();
    }
    fault.settle().await;
    stop.store(true, Ordering::SeqCst);
    for s in senders {
        s.await.unwrap();
    }
    let ended = Instant::now();
    for p in &mut procs {
        assert!(
            matches!(p.child.try_wait(), Ok(None)),
            "a restarted process exited: {:?}",
            p.child.try_wait()
        );
    }
    {
        // Through every fault the service went on acknowledging: between each kill and the
        // next (or the end), at least one event. Not while a master is failed over: each
        // sender retries its event until acknowledged, and soon every one waits on an event
        // of the dead master's partitions.
        let acknowledged = ledger.acknowledged.lock().unwrap();
        let failing_over = failover
            .as_ref()
            .map(|f| f.paused_at..f.took_over_at.unwrap_or(ended));
        let ends = kills.iter().skip(1).copied().chain(std::iter::once(ended));
        for (round, (from, to)) in kills.iter().zip(ends).enumerate() {
            if failing_over
                .as_ref()
                .is_some_and(|f| *from < f.end && f.start < to)
            {
                continue;
            }
            assert!(
                acknowledged.values().any(|at| (*from..to).contains(at)),
                "nothing was acknowledged in round {} of {}",
                round + 1,
                kills.len()
            );
        }
    }
    if let Some(took_over_at) = failover.as_ref().and_then(|f| f.took_over_at) {
        let acknowledged = ledger.acknowledged.lock().unwrap();
        assert!(
            acknowledged.values().any(|at| *at > took_over_at),
            "nothing was acknowledged after the failover"
        );
    }
    sink.healthy.store(true, Ordering::SeqCst);
    if let Some(failover) = failover {
        let (acked, replayed, refused) = failover.answers_while_paused(&ledger);
        println!(
            "chaos [{name}]: while the replica was paused, {acked} new writes to the victim's partitions acknowledged, {replayed} replays of earlier ones, {refused} refused"
        );
        // Through a process started once the cluster is whole again. (One that ran through
        // the failover can stay unready: see the report of issue 23.)
        procs.push(start());
        let bases = vec![procs[procs.len() - 1].url.clone()];
        let replays = replays_of_events_before(
            &client,
            &bases,
            &ledger,
            failover.killed_at,
            &failover.partitions,
            &sink.url,
        )
        .await;
        println!(
            "chaos [{name}]: of the events acknowledged before the failover, {} on the killed master's partitions; {} replayed with their ids, {} lost",
            replays.on_victim,
            replays.replayed,
            replays.lost.len()
        );
        assert!(
            replays.on_victim > 0,
            "events on the killed master's partitions were acknowledged before the failover"
        );
        assert_eq!(
            acked, 0,
            "a 2xx for a write no replica acknowledged (min_replicas_acked = 1, or a synchronous standby)"
        );
        assert!(
            refused > 0,
            "the paused replica's partitions were written to"
        );
        assert_eq!(
            replays.lost,
            Vec::<usize>::new(),
            "acknowledged before the failover, not replays after it"
        );
    }
    if let Some(crashed_at) = crashes.last() {
        let bases: Vec<String> = procs.iter().map(|p| p.url.clone()).collect();
        let replays = replays_of_events_before(
            &client,
            &bases,
            &ledger,
            *crashed_at,
            &all_partitions(),
            &sink.url,
        )
        .await;
        println!(
            "chaos [{name}]: {} store crashes; of the events acknowledged before the last, {} replayed with their ids, {} lost",
            crashes.len(),
            replays.replayed,
            replays.lost.len()
        );
        assert!(
            replays.replayed > 0,
            "events were acknowledged before the last crash"
        );
        assert_eq!(
            replays.lost,
            Vec::<usize>::new(),
            "acknowledged before a crash of the store, not replays after it"
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
            assert_eq!(report.lost, 0, "an acknowledged event was never delivered");
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What [`replays_of_events_before`] found.
struct Replays {
    replayed: usize,
    /// Events whose repeat was accepted as new: the store no longer held them.
    lost: Vec<usize>,
    /// Of all checked, those in the partitions the fault struck.
    on_victim: usize,
}

/// Sends every event acknowledged before `before` (a kill or a crash) once more, until it gets a 2xx, round-robin
/// over the processes as the senders do (a process's cluster connections may still be
/// settling after the failover): each must be answered as a replay, with the id of its first
/// answer, or it was lost.
async fn replays_of_events_before(
    client: &reqwest::Client,
    bases: &[String],
    ledger: &Ledger,
    before: Instant,
    partitions: &HashSet<u8>,
    sink_url: &str,
) -> Replays {
    let earlier: Vec<(usize, String)> = {
        let acknowledged = ledger.acknowledged.lock().unwrap();
        let ids = ledger.ids.lock().unwrap();
        ids.iter()
            .filter(|(_, id)| acknowledged.get(*id).is_some_and(|at| *at < before))
            .map(|(n, id)| (*n, id.clone()))
            .collect()
    };
    let mut replays = Replays {
        replayed: 0,
        lost: Vec::new(),
        on_victim: 0,
    };
    for (n, id) in &earlier {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut attempt = 0;
        let r = loop {
            let base = &bases[(n + attempt) % bases.len()];
            attempt += 1;
            match event_request(client, base, *n, sink_url).send().await {
                Ok(r) if r.status().is_success() => break r,
                other => {
                    assert!(
                        Instant::now() < deadline,
                        "replay of event {n}: {:?}",
                        other.map(|r| r.status())
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        if partitions.contains(&partition_of_event(*n)) {
            replays.on_victim += 1;
        }
        let replayed = r
            .headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok())
            == Some("true");
        let body: Value = r.json().await.expect("a JSON answer");
        if !replayed {
            replays.lost.push(*n);
            continue;
        }
        assert_eq!(
            &acknowledged_id(&body),
            id,
            "event {n} replayed with another id"
        );
        replays.replayed += 1;
    }
    replays
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_two_processes() {
    let redis = RedisServer::start();
    let url = redis.url();
    run_chaos(&url, 2, StoreFault::RestartRedis(redis), &[], "redis").await;
}

/// A master of a Redis Cluster is SIGKILLed under load with `store.min_replicas_acked = 1`,
/// its replica paused just before: while the replica is paused, requests for its master's
/// partitions get 503, never a 2xx without a replica acknowledging the write; afterwards
/// every acknowledged event is delivered, and events acknowledged before the failover are
/// still replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_redis_cluster_master_failover() {
    let cluster = RedisCluster::start_for_failover();
    let victim = cluster.masters()[0].port;
    let replica = cluster.replica_of(victim).port;
    // Not the replica either: it is paused, and restarted processes connect here first.
    let url = cluster
        .nodes()
        .iter()
        .find(|n| n.port != victim && n.port != replica)
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

/// Two processes on one PostgreSQL server, SIGKILLed in turn, while the server crashes every
/// second round (`pg_ctl stop -m immediate`, or SIGKILL of the postmaster and its backends)
/// and restarts: every acknowledged event is delivered, and every event acknowledged before
/// the last crash is a replay after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_kill_9() {
    let server = PostgresServer::start();
    let url = server.url();
    run_chaos(&url, 2, StoreFault::CrashPostgres(server), &[], "postgres").await;
}

/// A primary with a synchronous standby, both in `store.url`: the standby is paused for four
/// store timeouts (and `statement_timeout`s), and no request, first or retry, may get a 2xx
/// meanwhile. Then the primary is SIGKILLed and the standby promoted: callbackd goes on on it,
/// every acknowledged event is delivered, and every event acknowledged before the kill is a
/// replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_postgres_failover_to_a_synchronous_standby() {
    let primary = PostgresServer::start();
    let standby = PostgresServer::standby_of(&primary);
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port, standby.port
    );
    // A short store timeout, so the pause outlasts several of them.
    run_chaos(
        &url,
        2,
        StoreFault::FailOverPostgres {
            primary,
            standby,
            hold: Duration::from_secs(4),
        },
        &[("CALLBACKD__STORE__TIMEOUT_MS", "1000")],
        "postgres failover",
    )
    .await;
}
