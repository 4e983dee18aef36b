//! A full Redis (`maxmemory` with `noeviction`, as `store.require_durable` asks) under a
//! real `callbackd serve` whose deliveries keep failing: memory stays at the limit, new
//! events get 503 `store_full`, `/readyz` says so, and once memory frees every message is
//! delivered.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::process::Process;
use support::redis::RedisServer;
use support::sink::{Answer, Reply, Sink};
use support::{CONNECTOR_TOKEN, eventually};

const MAXMEMORY: u64 = 20 * 1024 * 1024;
const MESSAGES: usize = 300;

fn memory(redis: &RedisServer, field: &str) -> u64 {
    redis
        .cli(&["INFO", "memory"])
        .lines()
        .find_map(|line| line.trim().strip_prefix(&format!("{field}:"))?.parse().ok())
        .unwrap_or_else(|| panic!("INFO memory has no {field}"))
}

/// Fills what is left of `maxmemory` with junk strings of 256 KiB, until Redis refuses.
/// Returns their names.
fn fill(redis: &RedisServer) -> Vec<String> {
    let mut junk = Vec::new();
    for i in 0..1_000 {
        let key = format!("junk:{i}");
        match redis.try_cli(&["SETRANGE", &key, "262143", "x"]) {
            Ok(_) => junk.push(key),
            Err(e) if e.contains("OOM") => return overfill(redis, junk),
            Err(e) => panic!("{e}"),
        }
    }
    panic!("Redis never refused a write: is maxmemory set?");
}

/// Just over the limit is not full for long: a client's buffers shrink and Redis takes writes
/// again. It goes 1 MB over, by raising the limit for it and setting it back.
fn overfill(redis: &RedisServer, mut junk: Vec<String>) -> Vec<String> {
    let over = 2 * 1024 * 1024;
    redis.cli(&[
        "CONFIG",
        "SET",
        "maxmemory",
        &(MAXMEMORY + over).to_string(),
    ]);
    for i in 0..4 {
        let key = format!("junk:over:{i}");
        redis.cli(&["SETRANGE", &key, "262143", "x"]);
        junk.push(key);
    }
    redis.cli(&["CONFIG", "SET", "maxmemory", &MAXMEMORY.to_string()]);
    junk
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_stays_at_its_limit_and_delivers_everything_once_memory_frees() {
    let redis = RedisServer::start_with_args(
        "always",
        &[
            "--maxmemory",
            &MAXMEMORY.to_string(),
            "--maxmemory-policy",
            "noeviction",
        ],
    );
    // The receiver fails with a proxy's error page until `healthy`: every attempt's row keeps
    // a sizeable answer, so a store that let attempts through at OOM would grow fast.
    let healthy = Arc::new(AtomicBool::new(false));
    let sink = Sink::answering({
        let healthy = healthy.clone();
        move |_, _| {
            if healthy.load(Ordering::SeqCst) {
                return Answer {
                    reply: Reply::status(204),
                    content_type: None,
                    body: Vec::new(),
                };
            }
            Answer {
                reply: Reply::status(500),
                content_type: Some("text/html".into()),
                body: format!(
                    "<html><body>{}</body></html>",
                    "upstream error ".repeat(130)
                )
                .into_bytes(),
            }
        }
    })
    .await;
    let process = Process::start_with_env(
        &redis.url(),
        "",
        &[
            ("CALLBACKD__STORE__REQUIRE_DURABLE", "true"),
            // Every message must keep failing at the sink: the host's breaker would otherwise
            // open after 20 failures and hold the rest back, sparing the store their rows.
            ("CALLBACKD__DISPATCH__BREAKER__FAILURES", "1000000"),
        ],
    );
    let client = support::client();
    let base = &process.url;
    let mut ids = HashSet::new();
    for i in 0..MESSAGES {
        let r = client
            .post(format!("{base}/v1/notifications"))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(&json!({"paymentId": format!("pay-{i}"), "status": "approved", "callbackUrl": sink.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        ids.insert(
            r.json::<Value>().await.unwrap()["notificationId"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    eventually(30, "every message has failed once", || async {
        (sink.count() >= MESSAGES).then_some(())
    })
    .await;

    let junk = fill(&redis);
    let refused = client
        .post(format!("{base}/v1/notifications"))
        .bearer_auth(CONNECTOR_TOKEN)
        .json(&json!({"paymentId": "pay-late", "status": "approved", "callbackUrl": sink.url}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(
        refused.json::<Value>().await.unwrap()["error"],
        "store_full"
    );
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503, "a full store is not ready");
    assert_eq!(ready.json::<Value>().await.unwrap()["error"], "store_full");

    // The failing messages are due again every second at most; none of their attempts may
    // grow the store. Watched for 10 s, about ten rounds of them.
    let mut peak = 0;
    let watch_until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < watch_until {
        peak = peak.max(memory(&redis, "used_memory"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        peak <= MAXMEMORY + MAXMEMORY / 10,
        "used_memory reached {peak} B with maxmemory {MAXMEMORY} B"
    );

    // Memory frees; the receiver recovers: every message is delivered, none was lost.
    for key in &junk {
        redis.cli(&["DEL", key]);
    }
    healthy.store(true, Ordering::SeqCst);
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "ready once memory frees");
    eventually(60, "every message delivered", || async {
        let mut delivered = 0;
        for id in &ids {
            let view: Value = client
                .get(format!("{base}/v1/messages/{id}"))
                .bearer_auth(support::ADMIN_TOKEN)
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            if view["state"] == "delivered" {
                delivered += 1;
            }
        }
        (delivered == ids.len()).then_some(())
    })
    .await;
}
