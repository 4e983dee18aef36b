//! A gateway protected from us, through real sinks on 127.0.0.1: a `429` with `Retry-After`
//! pauses its whole host; a host refusing connections opens its breaker, gets a probe at a time
//! and recovers without losing order; `max_per_second` holds at the receiver. Each runs on
//! SQLite and on PostgreSQL, whose dispatcher polls seldom and wakes for what it held back.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use callbackd::config::{Config, HostConfig};
use callbackd::store::MessageId;
use postgres_support::PostgresServer;
use support::sink::{Received, Reply, Sink};
use support::{TestServer, config, eventually, handoff};

fn sqlite(dir: &tempfile::TempDir) -> Config {
    config(
        &format!("sqlite://{}", dir.path().join("cb.db").display()),
        None,
    )
}

/// Hands off an `approved` for each of `payments`, and a `settled` for every fifth after it,
/// 16 payments at a time so a backlog builds faster than one store commit at a time: the ids
/// of all.
async fn hand_off(server: &TestServer, tag: &str, payments: usize, url: &str) -> Vec<String> {
    use futures::StreamExt;
    futures::stream::iter(0..payments)
        .map(|i| async move {
            let payment = format!("pay-{tag}-{i}");
            let mut ids = vec![
                server
                    .hand_off_id(&handoff(&payment, "approved", url))
                    .await,
            ];
            if i % 5 == 0 {
                ids.push(server.hand_off_id(&handoff(&payment, "settled", url)).await);
            }
            ids
        })
        .buffer_unordered(16)
        .concat()
        .await
}

/// Each payment's requests arrived in order: no `settled` before its last `approved`
/// (an `approved` retried after a 429 included).
fn assert_in_order_per_payment(received: &[Received]) {
    let mut last_approved: HashMap<String, usize> = HashMap::new();
    for (i, r) in received.iter().enumerate() {
        let body = r.json();
        let payment = body["paymentId"].as_str().expect("paymentId").to_string();
        match body["status"].as_str() {
            Some("approved") => {
                last_approved.insert(payment, i);
            }
            Some("settled") => assert!(
                last_approved.contains_key(&payment),
                "{payment}: settled arrived (request {i}) before any approved"
            ),
            other => panic!("unexpected status {other:?}"),
        }
    }
    for (i, r) in received.iter().enumerate() {
        let body = r.json();
        if body["status"] == "settled" {
            let payment = body["paymentId"].as_str().unwrap_or_default();
            assert!(
                last_approved[payment] < i,
                "{payment}: approved arrived again after settled"
            );
        }
    }
}

/// Distinct message ids the sink answered 2xx to, when `ok(index)` says which did.
fn delivered(received: &[Received], ok: impl Fn(usize) -> bool) -> usize {
    let mut ids: Vec<String> = received
        .iter()
        .enumerate()
        .filter(|(i, _)| ok(*i))
        .filter_map(|(_, r)| r.header("x-callbackd-message-id"))
        .collect();
    ids.sort();
    ids.dedup();
    ids.len()
}

async fn a_429_with_retry_after_pauses_the_whole_host(cfg: Config) {
    let sink = Sink::start(|_, n| {
        if n == 0 {
            Reply {
                retry_after: Some("3".into()),
                ..Reply::status(429)
            }
        } else {
            Reply::status(200)
        }
    })
    .await;
    let server = TestServer::start(cfg).await;
    let url = format!("{}/gateway", sink.url);
    let ids = hand_off(&server, "throttled", 60, &url).await;
    eventually(30, "every message delivered", || async {
        (delivered(&sink.received(), |i| i > 0) == ids.len()).then_some(())
    })
    .await;

    let received = sink.received();
    let throttled_at = received[0].at;
    // Requests already on their way when the 429 came back may land just after it (how many
    // depends on how fast the others were answered meanwhile, not on the gate: counted, not
    // bounded); nothing else reaches the host until Retry-After has passed.
    let racing = Duration::from_millis(500);
    let early: Vec<Duration> = received[1..]
        .iter()
        .map(|r| r.at.saturating_duration_since(throttled_at))
        .filter(|d| *d > racing && *d < Duration::from_millis(2_950))
        .collect();
    assert!(
        early.is_empty(),
        "{} requests within Retry-After: {early:?}",
        early.len()
    );
    let raced = received[1..]
        .iter()
        .filter(|r| r.at.saturating_duration_since(throttled_at) <= racing)
        .count();
    println!("{raced} requests raced the 429");
    assert_in_order_per_payment(&received);
    server.stop().await;
}

/// A port nothing listens on: connections to it are refused until a sink binds it.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

async fn attempts(server: &TestServer, ids: &[String]) -> u32 {
    let mut total = 0;
    for id in ids {
        let id = MessageId::parse(id).expect("a message id");
        let record = server.store.get(&id).await.expect("store read");
        total += record.map_or(0, |r| r.delivery_attempts);
    }
    total
}

async fn a_host_refusing_connections_gets_probes_not_its_backlog(cfg: Config) {
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}/gateway");
    let alert_sink = Sink::ok().await;
    let mut cfg = cfg;
    cfg.dispatch.breaker.probe_secs = 1;
    cfg.dispatch.breaker.max_probe_secs = 2;
    cfg.alerts = Some(alerts_to(&alert_sink));
    let server = TestServer::start(cfg).await;
    let down_since = Instant::now();
    let ids = hand_off(&server, "down", 500, &url).await;
    tokio::time::sleep(Duration::from_secs(20).saturating_sub(down_since.elapsed())).await;

    // The admin API and the metrics show it open, with its backlog waiting.
    let host = format!("127.0.0.1:{port}");
    let listed: serde_json::Value = server
        .admin_get("/v1/admin/hosts")
        .await
        .json()
        .await
        .unwrap();
    let entry = &listed["hosts"][0];
    assert_eq!(entry["host"], host.as_str(), "{listed}");
    assert_eq!(entry["state"], serde_json::json!(["open"]), "{listed}");
    assert!(entry["openSince"].is_string(), "{listed}");
    assert!(entry["waiting"].as_u64().unwrap_or(0) >= 100, "{listed}");
    let metrics = server.admin_get("/metrics").await.text().await.unwrap();
    assert!(
        metrics.contains(&format!("callbackd_host_breaker_open{{host=\"{host}\"}} 1")),
        "the breaker's gauge"
    );

    // 20 failures open the breaker; what was in flight then (16 at most) fails too; then one
    // probe every 1 s, 2 s, 2 s...: about 20 + 16 + 11.
    let during = attempts(&server, &ids).await;
    println!(
        "{during} attempts in 20 s of refused connections, {} messages",
        ids.len()
    );
    assert!(
        during <= 60,
        "{during} attempts while the host refused connections"
    );

    let sink = Sink::start_on(port, |_, _| Reply::status(200)).await;
    let up = Instant::now();
    eventually(
        15,
        "every message delivered once the host is back",
        || async { (delivered(&sink.received(), |_| true) == ids.len()).then_some(()) },
    )
    .await;
    println!(
        "{} delivered {:?} after the host came back",
        ids.len(),
        up.elapsed()
    );
    assert_in_order_per_payment(&sink.received());
    server.stop().await;
}

async fn max_per_second_holds_at_the_receiver(cfg: Config) {
    // The first request pauses the host for 4 s, while the backlog is handed off: then it
    // drains at the rate.
    let sink = Sink::start(|_, n| {
        if n == 0 {
            Reply {
                retry_after: Some("4".into()),
                ..Reply::status(429)
            }
        } else {
            Reply::status(200)
        }
    })
    .await;
    let host = sink.url.trim_start_matches("http://").to_string();
    let mut cfg = cfg;
    cfg.dispatch.hosts.insert(
        host,
        HostConfig {
            max_per_second: Some(50.0),
            concurrency: None,
        },
    );
    let server = TestServer::start(cfg).await;
    let url = format!("{}/gateway", sink.url);
    let started = Instant::now();
    let ids = hand_off(&server, "rate", 416, &url).await;
    assert_eq!(ids.len(), 500);
    let handed_off = started.elapsed();
    eventually(30, "every message delivered", || async {
        (sink.count() > ids.len()).then_some(())
    })
    .await;
    // The drain: every request once the pause is over (the few that raced the 429, sent
    // before it came back, are not part of it).
    let received = sink.received();
    let paused_at = received[0].at;
    let times: Vec<Instant> = received[1..]
        .iter()
        .map(|r| r.at)
        .filter(|t| t.duration_since(paused_at) >= Duration::from_millis(3_900))
        .collect();
    println!(
        "handed off in {handed_off:?}; {} raced the 429, {} drained after the pause",
        received.len() - 1 - times.len(),
        times.len()
    );
    assert!(times.len() >= 480, "the backlog waited for the pause");
    let first = times[0];
    let offsets: Vec<f64> = times
        .iter()
        .map(|t| t.duration_since(first).as_secs_f64())
        .collect();
    let span = offsets.last().copied().unwrap_or_default();
    // The bucket holds a tenth of a second (5 requests) at once: over the drain, what came
    // beyond that burst came at most at the rate, 10 % allowed for timing.
    let rate = (times.len() - 5) as f64 / span;
    println!(
        "{} requests in {span:.2} s: {rate:.1}/s after the burst",
        times.len()
    );
    assert!(rate <= 55.0, "{rate:.1} requests/s");
    // No one-second window holds more than the burst and a second's worth (55), plus 3 for
    // arrival jitter on a shared machine.
    let busiest = offsets
        .iter()
        .map(|start| {
            offsets
                .iter()
                .filter(|t| **t >= *start && **t < start + 1.0)
                .count()
        })
        .max()
        .unwrap_or_default();
    assert!(busiest <= 58, "{busiest} requests in one second");
    server.stop().await;
}

fn alerts_to(sink: &Sink) -> callbackd::config::AlertsConfig {
    callbackd::config::AlertsConfig {
        webhook_url: format!("{}/alerts", sink.url),
        secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".into(),
        console_url: None,
        allow_private_webhook_url: true,
        digest_interval_secs: 60,
        max_alerts_per_interval: 10,
    }
}

/// On a virtual clock: the breaker opens after its threshold with one signed alert (not one
/// per message), and a message whose window ends while its host is open is dead at the
/// deadline, named for the breaker, with no request made for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_window_ends_while_its_host_is_open_dies_for_the_breaker() {
    let dir = tempfile::tempdir().unwrap();
    let alert_sink = Sink::ok().await;
    let url = format!("http://127.0.0.1:{}/gateway", closed_port());
    let url_db = format!("sqlite://{}", dir.path().join("cb.db").display());
    let (server, clock, d) = support::virtual_server(&url_db, |c| {
        c.dispatch.max_age_secs = 60;
        c.dispatch.breaker.failures = 1;
        c.alerts = Some(alerts_to(&alert_sink));
    })
    .await;
    let first = server.hand_off_id(&handoff("p-1", "approved", &url)).await;
    d.tick().await;
    // Open after one failure: the second message gets no attempt.
    let second = server.hand_off_id(&handoff("p-2", "approved", &url)).await;
    d.tick().await;
    let attempts_of = |id: String| {
        let store = server.store.clone();
        async move {
            let id = MessageId::parse(&id).expect("a message id");
            store.get(&id).await.expect("store read").expect("stored")
        }
    };
    assert_eq!(attempts_of(first.clone()).await.delivery_attempts, 1);
    assert_eq!(attempts_of(second.clone()).await.delivery_attempts, 0);
    let alerts: Vec<serde_json::Value> = alert_sink.received().iter().map(|r| r.json()).collect();
    assert_eq!(alerts.len(), 1, "one alert for the host: {alerts:?}");
    assert_eq!(alerts[0]["type"], "host.breaker.open");
    assert!(
        alert_sink.received()[0]
            .header("webhook-signature")
            .is_some_and(|s| s.starts_with("v1,")),
        "signed like the dead-letter alert"
    );

    // Past both deadlines: one message is the probe (an attempt, expired); the other dies
    // unsent for the breaker.
    clock.advance(61_000);
    d.tick().await;
    let mut reasons = Vec::new();
    for id in [first, second] {
        let record = attempts_of(id).await;
        assert_eq!(format!("{:?}", record.state), "Dead");
        let last = record.history.last().expect("a history row");
        reasons.push(format!("{last:?}"));
    }
    assert!(
        reasons.iter().any(|r| r.contains("breaker_open")),
        "{reasons:?}"
    );
    let dead_alerts: Vec<serde_json::Value> = alert_sink
        .received()
        .iter()
        .map(|r| r.json())
        .filter(|a| a["type"] == "message.dead")
        .collect();
    assert!(
        dead_alerts
            .iter()
            .any(|a| a["data"]["reason"] == "breaker_open"),
        "{dead_alerts:?}"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_pauses_the_whole_host_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    a_429_with_retry_after_pauses_the_whole_host(sqlite(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_pauses_the_whole_host_on_postgres() {
    a_429_with_retry_after_pauses_the_whole_host(config(
        &PostgresServer::shared().fresh_database(),
        None,
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_refusing_connections_gets_probes_not_its_backlog_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    a_host_refusing_connections_gets_probes_not_its_backlog(sqlite(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_refusing_connections_gets_probes_not_its_backlog_on_postgres() {
    a_host_refusing_connections_gets_probes_not_its_backlog(config(
        &PostgresServer::shared().fresh_database(),
        None,
    ))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_per_second_holds_at_the_receiver_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    max_per_second_holds_at_the_receiver(sqlite(&dir)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_per_second_holds_at_the_receiver_on_postgres() {
    max_per_second_holds_at_the_receiver(config(&PostgresServer::shared().fresh_database(), None))
        .await;
}
