//! Real `callbackd serve` processes sharing one Redis (or one Redis Cluster, or one
//! PostgreSQL database): crashes, scale-out, graceful shutdown.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use postgres_support::PostgresServer;
use serde_json::{Value, json};
use support::process::Process;
use support::redis::RedisServer;
use support::redis::cluster::RedisCluster;
use support::sink::{Gate, Reply, Sink};
use support::{CONNECTOR_TOKEN, eventually};

async fn hand_off(client: &reqwest::Client, base: &str, payment: &str, target: &str) -> Value {
    hand_off_status(client, base, payment, "approved", target).await
}

async fn hand_off_status(
    client: &reqwest::Client,
    base: &str,
    payment: &str,
    status: &str,
    target: &str,
) -> Value {
    let r = client
        .post(format!("{base}/v1/notifications"))
        .bearer_auth(CONNECTOR_TOKEN)
        .json(&json!({"paymentId": payment, "status": status, "callbackUrl": target}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{payment} {status}");
    r.json().await.unwrap()
}

/// A sink that holds its first request until `gate` opens and answers 204 to the others.
async fn holding_first(gate: &Gate) -> Sink {
    let gate = gate.clone();
    Sink::start_async(move |_, index| {
        let gate = gate.clone();
        Box::pin(async move {
            if index == 0 {
                gate.wait().await;
            }
            Reply::status(204)
        })
    })
    .await
}

/// A sink that answers 204 and counts the deliveries of each message id.
async fn counting_sink() -> (Sink, Arc<Mutex<HashMap<String, usize>>>) {
    let seen: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let sink = Sink::start({
        let seen = seen.clone();
        move |req, _| {
            let id = req.header("x-callbackd-message-id").unwrap_or_default();
            *seen.lock().unwrap().entry(id).or_default() += 1;
            Reply::status(204)
        }
    })
    .await;
    (sink, seen)
}

async fn view(client: &reqwest::Client, base: &str, id: &str) -> Option<Value> {
    client
        .get(format!("{base}/v1/messages/{id}"))
        .bearer_auth(support::ADMIN_TOKEN)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

#[tokio::test]
async fn a_worker_killed_mid_delivery_is_replaced_after_its_lease() {
    let redis = RedisServer::start();
    // The first attempt is held open until the test is done and times out only after 10 s, so
    // the kill (issued as soon as the attempt is seen) always lands mid-delivery.
    let gate = Gate::new();
    let sink = holding_first(&gate).await;
    let env = [
        ("CALLBACKD__DISPATCH__REQUEST_TIMEOUT_MS", "10000"),
        ("CALLBACKD__DISPATCH__LEASE_SECS", "15"),
    ];
    let mut doomed = Process::start_with_env(&redis.url(), "", &env);
    let client = support::client();
    let answer = hand_off(&client, &doomed.url, "p-crash", &format!("{}/cb", sink.url)).await;
    eventually(10, "first attempt in flight", || async {
        (sink.in_flight() == 1).then_some(())
    })
    .await;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();

    let survivor = Process::start(&redis.url(), "");
    eventually(60, "redelivery by the survivor after the lease", || async {
        (sink.count() == 2).then_some(())
    })
    .await;
    gate.open();
    let got = sink.received();
    let id = answer["notificationId"].as_str().unwrap();
    assert_eq!(got[0].header("x-callbackd-message-id").as_deref(), Some(id));
    assert_eq!(
        got[1].header("x-callbackd-message-id").as_deref(),
        Some(id),
        "stable id lets the receiver drop the redelivery"
    );
    let view: Value = eventually(10, "recorded as delivered", || async {
        let v = view(&client, &survivor.url, id).await?;
        (v["state"] == "delivered").then_some(v)
    })
    .await;
    assert_eq!(
        view["attemptCount"], 1,
        "the killed attempt was never recorded"
    );
}

#[tokio::test]
async fn three_processes_deliver_nine_thousand_messages_exactly_once() {
    let redis = RedisServer::start_with("everysec");
    let (sink, seen) = counting_sink().await;
    let processes: Vec<Process> = (0..3).map(|_| Process::start(&redis.url(), "")).collect();
    let urls: Vec<String> = processes.iter().map(|p| p.url.clone()).collect();
    let client = support::client();
    let total = 9_000;
    let target = format!("{}/cb", sink.url);
    let semaphore = Arc::new(tokio::sync::Semaphore::new(48));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let (client, base, target) = (client.clone(), urls[i % 3].clone(), target.clone());
        let permit = semaphore.clone().acquire_owned().await.unwrap();
        tasks.spawn(async move {
            hand_off(&client, &base, &format!("pay-{i}"), &target).await;
            drop(permit);
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    eventually(120, "every message delivered", || async {
        (seen.lock().unwrap().len() == total).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let seen = seen.lock().unwrap();
    let duplicates = seen.values().filter(|n| **n > 1).count();
    assert_eq!(seen.len(), total);
    assert_eq!(duplicates, 0, "without crashes, exactly once");
    assert_eq!(sink.count(), total);
}

/// A sink that answers 503 to the first request of each message id and 204 to the others,
/// so each message goes through a retry, and a payment's next hand-off waits behind it.
/// Returns the sink and every request, in arrival order: (message id, body, answered 204).
async fn failing_each_first_sink() -> (Sink, Arc<Mutex<Vec<(String, Value, bool)>>>) {
    let log: Arc<Mutex<Vec<(String, Value, bool)>>> = Arc::default();
    let sink = Sink::start({
        let log = log.clone();
        move |req, _| {
            let id = req.header("x-callbackd-message-id").unwrap_or_default();
            let mut log = log.lock().unwrap();
            let again = log.iter().any(|(seen, _, _)| *seen == id);
            log.push((id, req.json(), again));
            Reply::status(if again { 204 } else { 503 })
        }
    })
    .await;
    (sink, log)
}

/// Two processes, one on each of `store_urls`, take the hand-offs of 300 payments: each
/// payment's `statuses` back to back, each through the other process than the one before, so
/// a payment's queue is written by both. The receiver fails each message's first attempt:
/// each hand-off is delivered exactly once after exactly one retry, and each payment's in
/// the order it was handed off, the next one waiting behind the retry of the one before.
async fn two_processes_deliver_hand_offs_exactly_once_in_order(
    store_urls: [&str; 2],
    env: &[(&str, &str)],
    statuses: &[&str],
) {
    let (sink, log) = failing_each_first_sink().await;
    let processes: Vec<Process> = store_urls
        .iter()
        .map(|url| Process::start_with_env(url, "", env))
        .collect();
    let client = support::client();
    let payments = 300;
    let total = payments * statuses.len();
    let target = format!("{}/cb", sink.url);
    for i in 0..payments {
        for (step, status) in statuses.iter().enumerate() {
            let base = &processes[(i + step) % 2].url;
            hand_off_status(&client, base, &format!("pay-{i}"), status, &target).await;
        }
    }
    let delivered = || log.lock().unwrap().iter().filter(|(_, _, ok)| *ok).count();
    eventually(90, "every hand-off delivered", || async {
        (delivered() >= total).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = log.lock().unwrap();
    let mut successes: HashMap<&str, usize> = HashMap::new();
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for (id, body, _) in log.iter().filter(|(_, _, ok)| *ok) {
        *successes.entry(id).or_default() += 1;
        order
            .entry(body["paymentId"].as_str().unwrap_or_default().to_string())
            .or_default()
            .push(body["status"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(successes.len(), total);
    assert!(
        successes.values().all(|n| *n == 1),
        "without crashes, exactly once"
    );
    assert_eq!(
        log.len(),
        2 * total,
        "one failed attempt and one delivery each, nothing more"
    );
    assert_eq!(order.len(), payments);
    for (payment, got) in &order {
        assert_eq!(got, statuses, "{payment}: in the order handed off");
    }
}

/// Two processes given different nodes of one cluster, each write acknowledged by its master's
/// replica: hand-offs spread over every master are each delivered once.
#[tokio::test]
async fn two_processes_on_a_cluster_deliver_three_hundred_hand_offs_exactly_once() {
    let cluster = RedisCluster::start();
    let urls = [cluster.nodes()[0].url(), cluster.nodes()[1].url()];
    two_processes_deliver_hand_offs_exactly_once_in_order(
        [&urls[0], &urls[1]],
        &[("CALLBACKD__STORE__MIN_REPLICAS_ACKED", "1")],
        &["approved"],
    )
    .await;
}

/// Two processes on one PostgreSQL database share its queue: 300 payments approved, then
/// settled, 600 hand-offs, each delivered once after one retry, and each payment's in order.
#[tokio::test]
async fn two_processes_on_postgres_deliver_two_times_three_hundred_hand_offs_exactly_once() {
    let server = PostgresServer::start();
    let url = server.url();
    two_processes_deliver_hand_offs_exactly_once_in_order(
        [&url, &url],
        &[],
        &["approved", "settled"],
    )
    .await;
}

/// SIGTERM while a delivery is held open by the receiver: new connections are refused,
/// readiness fails on open ones, the delivery finishes within the grace period and is
/// recorded, and the process exits 0.
#[tokio::test]
async fn sigterm_lets_the_in_flight_delivery_finish_and_exits_zero() {
    let redis = RedisServer::start();
    let gate = Gate::new();
    let sink = holding_first(&gate).await;
    // A grace and an attempt timeout far longer than the test: the process stays up, with its
    // delivery open, until the test lets the receiver answer.
    let mut process = Process::start_with_env(
        &redis.url(),
        "",
        &[
            ("CALLBACKD__SERVER__SHUTDOWN_GRACE_SECS", "120"),
            ("CALLBACKD__DISPATCH__REQUEST_TIMEOUT_MS", "120000"),
            ("CALLBACKD__DISPATCH__LEASE_SECS", "130"),
            ("CALLBACKD__SERVER__HEADER_TIMEOUT_SECS", "120"),
        ],
    );
    let client = support::kept_alive_client();
    let answer = hand_off(&client, &process.url, "p-term", &format!("{}/cb", sink.url)).await;
    eventually(10, "delivery in flight", || async {
        (sink.in_flight() == 1).then_some(())
    })
    .await;
    process.signal("TERM");
    eventually(10, "/readyz says the process is shutting down", || async {
        let r = client
            .get(format!("{}/readyz", process.url))
            .send()
            .await
            .ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    support::wait_until_refused(&process.url).await;
    assert!(
        process.child.try_wait().unwrap().is_none(),
        "still running: waiting for its delivery"
    );
    assert_eq!(sink.in_flight(), 1, "the delivery is still open");
    gate.open();
    let status = process.exit_status(30).await;
    assert_eq!(status.code(), Some(0), "clean exit");

    // The delivery completed and was recorded before exit: a new process finds it delivered,
    // so it is never sent again.
    let checker = Process::start(&redis.url(), "");
    let id = answer["notificationId"].as_str().unwrap();
    let view = view(&client, &checker.url, id).await.expect("message view");
    assert_eq!(view["state"], "delivered");
    assert_eq!(view["attemptCount"], 1);
    assert_eq!(view["attempts"][0]["status"], 204);
    assert_eq!(sink.count(), 1);
}

/// SIGTERM while the receiver holds a delivery longer than the grace period: the process
/// gives the lease back and exits 0, and a fresh process redelivers at once, long before the
/// 600 s lease would have expired.
#[tokio::test]
async fn sigterm_hands_an_unfinished_lease_back() {
    let redis = RedisServer::start();
    let gate = Gate::new();
    let sink = holding_first(&gate).await;
    // The attempt would time out only after 30 s: at the end of the 1 s grace it is still open.
    let env = [
        ("CALLBACKD__SERVER__SHUTDOWN_GRACE_SECS", "1"),
        ("CALLBACKD__DISPATCH__REQUEST_TIMEOUT_MS", "30000"),
        ("CALLBACKD__DISPATCH__LEASE_SECS", "600"),
    ];
    let mut process = Process::start_with_env(&redis.url(), "", &env);
    let client = support::client();
    let answer = hand_off(&client, &process.url, "p-back", &format!("{}/cb", sink.url)).await;
    eventually(10, "delivery in flight", || async {
        (sink.in_flight() == 1).then_some(())
    })
    .await;
    process.signal("TERM");
    let status = process.exit_status(30).await;
    assert_eq!(status.code(), Some(0), "clean exit after the grace period");

    let fresh = Process::start_with_env(&redis.url(), "", &env);
    eventually(30, "redelivery by a fresh process", || async {
        (sink.count() == 2).then_some(())
    })
    .await;
    gate.open();
    let id = answer["notificationId"].as_str().unwrap();
    let view = eventually(10, "recorded as delivered", || async {
        let v = view(&client, &fresh.url, id).await?;
        (v["state"] == "delivered").then_some(v)
    })
    .await;
    assert_eq!(
        view["attemptCount"], 1,
        "the abandoned attempt is not an attempt"
    );
}

/// `callbackd serve` started before its Redis (as an orchestrator starts both) does not exit:
/// it is alive, not ready, and answers 503 until Redis comes up, then serves and delivers
/// without a restart. A SIGTERM while it waits ends it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_started_before_its_redis_waits_for_it() {
    let port = support::redis::free_port();
    let url = format!("redis://127.0.0.1:{port}/0");
    let sink = Sink::ok().await;
    let mut waiting = Process::start_alive_with_env(&url, "", &[]);
    let client = support::client();
    let base = &waiting.url;

    let alive = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(alive.status(), 200);
    for _ in 0..3 {
        let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 503);
        assert_eq!(
            ready.json::<Value>().await.unwrap()["error"],
            "store_unavailable"
        );
        let refused = client
            .post(format!("{base}/v1/notifications"))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(&json!({"paymentId": "pay-1", "status": "approved", "callbackUrl": sink.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers()["retry-after"], "1");
        // Several of its attempts to connect fail meanwhile (the first retry is after 0.25 s).
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        waiting.child.try_wait().unwrap().is_none(),
        "callbackd exited while its store was not up"
    );

    let _redis = RedisServer::try_start_on(port, "always", &[], false, None).expect("redis starts");
    eventually(30, "ready once Redis is up", || async {
        let ready = client.get(format!("{base}/readyz")).send().await.ok()?;
        (ready.status() == 200).then_some(())
    })
    .await;
    hand_off(&client, base, "pay-1", &sink.url).await;
    eventually(30, "the notification delivered", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    waiting.stop(Duration::from_secs(10));

    let mut stopped = Process::start_alive_with_env(
        &format!("redis://127.0.0.1:{}/0", support::redis::free_port()),
        "",
        &[],
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    stopped.signal("TERM");
    assert!(
        stopped.exit_status(10).await.success(),
        "a SIGTERM while waiting for the store is a clean stop"
    );
}

/// A process counts as started once its `/readyz` answers 200, not once its port opens: the
/// port is bound before the store is opened, so a process whose store is down (a restart in
/// the chaos tests, say) must not be taken for a running one.
#[test]
fn a_process_whose_store_is_down_is_not_taken_as_started() {
    let mut redis = RedisServer::start();
    let began = std::time::Instant::now();
    drop(Process::start(&redis.url(), ""));
    // What a start takes on this machine now; ten of them is time enough to be ready.
    let window = began.elapsed() * 10;
    redis.stop(true);
    match Process::try_start_with_env(&redis.url(), "", &[], window) {
        Ok(_) => panic!("taken as started with its store down"),
        Err(e) => eprintln!("not started, as it should: {e}"),
    }
}

/// What `/v1/console/overview` of the process at `base` counts per minute, with the minute
/// its `now` is in.
async fn per_minute(client: &reqwest::Client, base: &str) -> (String, Vec<Value>) {
    let r = client
        .get(format!("{base}/v1/console/overview"))
        .bearer_auth(support::ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let o: Value = r.json().await.unwrap();
    let minute = o["now"].as_str().unwrap()[..16].to_string();
    (minute, o["perMinute"].as_array().unwrap().clone())
}

/// The overviews of `a` and `b`, read within one minute so both show the same hour; each
/// minute's figures as `(deliveries, failures, dead)` summed over the hour.
async fn same_overview(client: &reqwest::Client, a: &str, b: &str) -> (u64, u64, u64) {
    for _ in 0..3 {
        let (minute_a, hour_a) = per_minute(client, a).await;
        let (minute_b, hour_b) = per_minute(client, b).await;
        if minute_a != minute_b {
            continue;
        }
        assert_eq!(hour_a, hour_b, "both consoles show the same minutes");
        assert_eq!(hour_a.len(), 60);
        let sum = |key: &str| hour_a.iter().map(|m| m[key].as_u64().unwrap()).sum();
        return (sum("deliveries"), sum("failures"), sum("dead"));
    }
    panic!("three reads in a row straddled a minute");
}

/// Two processes' consoles show the same per-minute counts: the deployment's, kept in the
/// store. `a` delivers 8 alone; then `b` delivers 8 more and dead-letters 3 (410) while `a`
/// is stopped; then `a` is started again. Both overviews show 16 deliveries, 3 failures and
/// 3 dead letters, before and after the restart (a count in process memory would show
/// 8 + 0 on `a` and 11 on `b`, then nothing on the restarted `a`).
async fn two_consoles_show_the_same_per_minute_counts(store: &str) {
    let sink = Sink::start(|req, _| {
        if req.uri.contains("/gone/") {
            Reply::status(410)
        } else {
            Reply::status(204)
        }
    })
    .await;
    let client = support::client();
    let mut a = Process::start(store, "");
    for n in 0..8 {
        hand_off(
            &client,
            &a.url,
            &format!("p-a-{n}"),
            &format!("{}/ok/a{n}", sink.url),
        )
        .await;
    }
    eventually(30, "a delivered 8", || async {
        (sink.count() == 8).then_some(())
    })
    .await;
    let b = Process::start(store, "");
    a.stop(Duration::from_secs(10));
    for n in 0..8 {
        hand_off(
            &client,
            &b.url,
            &format!("p-b-{n}"),
            &format!("{}/ok/b{n}", sink.url),
        )
        .await;
    }
    for n in 0..3 {
        hand_off(
            &client,
            &b.url,
            &format!("p-gone-{n}"),
            &format!("{}/gone/{n}", sink.url),
        )
        .await;
    }
    eventually(30, "b made 11 attempts", || async {
        (sink.count() == 19).then_some(())
    })
    .await;
    // The attempt reaches the sink before its completion is recorded.
    eventually(10, "b's console counts all 19 attempts", || async {
        let (_, hour) = per_minute(&client, &b.url).await;
        let attempts: u64 = hour
            .iter()
            .map(|m| m["deliveries"].as_u64().unwrap() + m["failures"].as_u64().unwrap())
            .sum();
        (attempts == 19).then_some(())
    })
    .await;
    let a = Process::start(store, "");
    assert_eq!(same_overview(&client, &a.url, &b.url).await, (16, 3, 3));
    drop(a);
    let restarted = Process::start(store, "");
    assert_eq!(
        same_overview(&client, &restarted.url, &b.url).await,
        (16, 3, 3),
        "the same after a restart"
    );
}

#[tokio::test]
async fn two_consoles_on_redis_show_the_same_per_minute_counts() {
    let redis = RedisServer::start();
    two_consoles_show_the_same_per_minute_counts(&redis.url()).await;
}

#[tokio::test]
async fn two_consoles_on_postgres_show_the_same_per_minute_counts() {
    let server = PostgresServer::start();
    two_consoles_show_the_same_per_minute_counts(&server.url()).await;
}
