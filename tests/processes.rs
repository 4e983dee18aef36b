//! Real `callbackd serve` processes sharing one Redis: crashes, scale-out, graceful shutdown.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use support::process::Process;
use support::redis::RedisServer;
use support::sink::{Reply, Sink};
use support::{CONNECTOR_TOKEN, eventually};

async fn hand_off(client: &reqwest::Client, base: &str, payment: &str, target: &str) -> Value {
    let r = client
        .post(format!("{base}/v1/notifications"))
        .bearer_auth(CONNECTOR_TOKEN)
        .json(&json!({"paymentId": payment, "status": "approved", "callbackUrl": target}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    r.json().await.unwrap()
}

#[tokio::test]
async fn a_worker_killed_mid_delivery_is_replaced_after_its_lease() {
    let redis = RedisServer::start();
    let first = Arc::new(AtomicUsize::new(0));
    let sink = Sink::start({
        let first = first.clone();
        move |_, _| {
            if first.fetch_add(1, Ordering::SeqCst) == 0 {
                // Hold the first attempt until the worker is dead.
                Reply {
                    status: 204,
                    retry_after: None,
                    delay: Duration::from_millis(900),
                }
            } else {
                Reply::status(204)
            }
        }
    })
    .await;
    let mut doomed = Process::start(&redis.url(), "");
    let client = reqwest::Client::new();
    let answer = hand_off(&client, &doomed.url, "p-crash", &format!("{}/cb", sink.url)).await;
    eventually(10, "first attempt in flight", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();

    let survivor = Process::start(&redis.url(), "");
    eventually(20, "redelivery by the survivor after the lease", || async {
        (sink.count() == 2).then_some(())
    })
    .await;
    let got = sink.received();
    let id = answer["notificationId"].as_str().unwrap();
    assert_eq!(got[0].header("x-callbackd-message-id").as_deref(), Some(id));
    assert_eq!(
        got[1].header("x-callbackd-message-id").as_deref(),
        Some(id),
        "stable id lets the receiver drop the redelivery"
    );
    let view: Value = eventually(10, "recorded as delivered", || async {
        let v: Value = client
            .get(format!("{}/v1/messages/{id}", survivor.url))
            .bearer_auth(support::ADMIN_TOKEN)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
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
    let processes: Vec<Process> = (0..3).map(|_| Process::start(&redis.url(), "")).collect();
    let urls: Vec<String> = processes.iter().map(|p| p.url.clone()).collect();
    let client = reqwest::Client::new();
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

#[tokio::test]
async fn sigterm_lets_the_in_flight_delivery_finish_and_exits_zero() {
    let redis = RedisServer::start();
    let sink = Sink::start(|_, _| Reply {
        status: 204,
        retry_after: None,
        delay: Duration::from_millis(800),
    })
    .await;
    let mut process = Process::start(&redis.url(), "");
    let client = reqwest::Client::new();
    let answer = hand_off(&client, &process.url, "p-term", &format!("{}/cb", sink.url)).await;
    eventually(10, "delivery in flight", || async {
        (sink.count() == 1).then_some(())
    })
    .await;
    process.signal("TERM");
    let status = tokio::task::spawn_blocking(move || {
        let status = process.child.wait().unwrap();
        (status, process)
    })
    .await
    .unwrap()
    .0;
    assert_eq!(status.code(), Some(0), "clean exit");

    // The delivery completed and was recorded before exit: a new process finds it delivered
    // and does not send it again.
    let checker = Process::start(&redis.url(), "");
    let id = answer["notificationId"].as_str().unwrap();
    let view: Value = client
        .get(format!("{}/v1/messages/{id}", checker.url))
        .bearer_auth(support::ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["state"], "delivered");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.count(), 1);
}
