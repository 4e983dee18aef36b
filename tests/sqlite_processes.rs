//! The embedded SQLite store end to end: real processes, kill -9 during a burst of accepts,
//! and the README's promise that no Redis is needed.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use support::eventually;
use support::process::{Process, serve_until_refused};
use support::sink::{Reply, Sink};

fn source_table(sink: &Sink) -> String {
    format!(
        "[sources.open]\nsignature = \"none\"\nforward_url = \"{}/events\"\n\
         allow_private_forward_url = true\n",
        sink.url
    )
}

async fn post(client: &reqwest::Client, base: &str, tx: usize) -> Option<reqwest::Response> {
    client
        .post(format!("{base}/v1/callbacks/open"))
        .body(format!(r#"{{"id":"tx-{tx}","status":"COMPLETED"}}"#))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()
}

#[tokio::test]
async fn kill_9_during_a_burst_loses_no_acknowledged_callback() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let up = Arc::new(AtomicBool::new(false));
    let sink = Sink::start({
        let up = up.clone();
        move |_, _| Reply::status(if up.load(Ordering::SeqCst) { 204 } else { 503 })
    })
    .await;
    let mut process = Process::start(&store, &source_table(&sink));
    let client = support::client();

    // Eight senders post unique callbacks until the process dies under them.
    let base = process.url.clone();
    let acks = Arc::new(AtomicUsize::new(0));
    let senders: Vec<_> = (0..8)
        .map(|sender| {
            let (client, base, acks) = (client.clone(), base.clone(), acks.clone());
            tokio::spawn(async move {
                let mut acknowledged = Vec::new();
                for i in 0.. {
                    let tx = sender * 1_000_000 + i;
                    match post(&client, &base, tx).await {
                        Some(r) if r.status() == 200 => {
                            acknowledged.push(tx);
                            acks.fetch_add(1, Ordering::SeqCst);
                        }
                        Some(_) => {}
                        None => break,
                    }
                }
                acknowledged
            })
        })
        .collect();
    // The kill lands mid-burst: once 200 callbacks are acknowledged, however long that takes.
    eventually(60, "200 callbacks acknowledged", || async {
        (acks.load(Ordering::SeqCst) >= 200).then_some(())
    })
    .await;
    process.child.kill().unwrap();
    process.child.wait().unwrap();
    let mut acknowledged = Vec::new();
    for s in senders {
        acknowledged.extend(s.await.unwrap());
    }
    assert!(acknowledged.len() >= 200, "{}", acknowledged.len());
    println!("acknowledged before kill -9: {}", acknowledged.len());

    let restarted = Process::start(&store, &source_table(&sink));
    for tx in &acknowledged {
        let r = post(&client, &restarted.url, *tx)
            .await
            .expect("restarted server answers");
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()
                .get("idempotent-replayed")
                .map(|v| v.to_str().unwrap()),
            Some("true"),
            "tx-{tx} was acknowledged before the crash, so it must be a replay now"
        );
    }
    up.store(true, Ordering::SeqCst);
    let expected: HashSet<String> = acknowledged.iter().map(|tx| format!("tx-{tx}")).collect();
    eventually(60, "every acknowledged callback delivered", || async {
        let delivered: HashSet<String> = sink
            .received()
            .iter()
            .map(|r| r.json()["id"].as_str().unwrap_or_default().to_string())
            .collect();
        expected.is_subset(&delivered).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_second_process_on_the_same_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let _first = Process::start(&store, "");
    let (status, stderr) = serve_until_refused(&format!("url = \"{store}\"")).await;
    assert_eq!(status.code(), Some(2));
    let db = dir.path().join("cb.db");
    assert!(
        stderr.contains(&format!(
            "another callbackd process has the database {} open",
            db.display()
        )),
        "a clear error naming the file: {stderr}"
    );
}

#[tokio::test]
async fn the_default_config_runs_without_redis() {
    // The repository's config.toml (sqlite://data/callbackd.db), run from a scratch directory
    // so its relative data directory is created there.
    let dir = tempfile::tempdir().unwrap();
    let config =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml")).unwrap();
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    let port = support::redis::free_port();
    let _child = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .arg("serve")
        .current_dir(dir.path())
        .env("CALLBACKD__SERVER__LISTEN", format!("127.0.0.1:{port}"))
        .env_remove("CALLBACKD_CONFIG")
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let client = support::client();
    let base = format!("http://127.0.0.1:{port}");
    let ready = eventually(15, "ready", || async {
        client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .ok()
            .filter(|r| r.status() == 200)
    })
    .await;
    assert_eq!(ready.status(), 200);
    assert!(dir.path().join("data/callbackd.db").exists());
    let body = r#"{"id":"tx-readme","status":"COMPLETED"}"#;
    let sig = callbackd::webhook::sign_payzu(
        b"change-me-payzu-secret",
        callbackd::clock::Clock::now_secs(&callbackd::clock::SystemClock),
        body.as_bytes(),
    );
    for replayed in [false, true] {
        let r = client
            .post(format!("{base}/v1/callbacks/payzu"))
            .header("x-callback-signature", &sig)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().get("idempotent-replayed").is_some(), replayed);
    }
}

#[tokio::test]
async fn a_full_disk_answers_503_and_records_nothing() {
    use callbackd::store::sqlite::{SqliteOptions, SqliteStore};
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::config(
        &format!("sqlite://{}", dir.path().join("cb.db").display()),
        None,
    );
    let store = Arc::new(
        SqliteStore::open_with(&dir.path().join("cb.db"), 3600, SqliteOptions::default()).unwrap(),
    );
    let app = Arc::new(
        callbackd::app::App::new(cfg, store.clone(), Arc::new(callbackd::clock::SystemClock))
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(callbackd::serve(app, listener, shutdown.clone()));
    let client = support::client();
    let send = |tx: usize| {
        client
            .post(format!("{base}/v1/callbacks/open"))
            .body(format!(r#"{{"id":"tx-{tx}","status":"COMPLETED"}}"#))
            .send()
    };

    // The disk is full: the database may not grow by a single page. What still fits in the
    // free space of its last pages is accepted; then the first write that needs a page fails.
    store.set_max_page_count(1).await.unwrap();
    let mut refused = None;
    for tx in 0..5_000 {
        let r = send(tx).await.unwrap();
        if r.status() == 503 {
            assert!(r.headers().contains_key("retry-after"));
            assert_eq!(
                r.json::<serde_json::Value>().await.unwrap()["error"],
                "store_full"
            );
            refused = Some(tx);
            break;
        }
        assert_eq!(r.status(), 200);
    }
    let refused = refused.expect("a full disk refuses writes");
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 503, "a full store is not ready");
    assert_eq!(
        ready.json::<serde_json::Value>().await.unwrap()["error"],
        "store_full"
    );

    // Space again: the refused callback is a first arrival, so nothing was recorded or burned.
    store.set_max_page_count(1 << 30).await.unwrap();
    let accepted = send(refused).await.unwrap();
    assert_eq!(accepted.status(), 200);
    let ready = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "ready once there is room");
    assert!(accepted.headers().get("idempotent-replayed").is_none());
    shutdown.cancel();
}

/// A disk whose fsync hangs past `store.timeout_ms`: every caller waiting gets 503. A write
/// the writer had not started is withdrawn (its retry is a first arrival); one it had started
/// may commit after the 503 (its retry is then a replay). Either way each callback is
/// recorded exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_disk_answers_503_and_no_retry_is_lost_or_doubled() {
    use callbackd::store::sqlite::{SqliteOptions, SqliteStore};
    use callbackd::store::{ListFilter, Store};
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::config(
        &format!("sqlite://{}", dir.path().join("cb.db").display()),
        None,
    );
    let options = SqliteOptions {
        timeout: Duration::from_millis(500),
        ..SqliteOptions::default()
    };
    let store = Arc::new(SqliteStore::open_with(&dir.path().join("cb.db"), 3600, options).unwrap());
    let app = Arc::new(
        callbackd::app::App::new(cfg, store.clone(), Arc::new(callbackd::clock::SystemClock))
            .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(callbackd::serve(app, listener, shutdown.clone()));
    let client = support::client();
    let send = |tx: &str| {
        client
            .post(format!("{base}/v1/callbacks/open"))
            .body(format!(r#"{{"id":"{tx}","status":"COMPLETED"}}"#))
            .send()
    };
    let refused = |r: reqwest::Response| async move {
        assert_eq!(r.status(), 503);
        assert!(r.headers().contains_key("retry-after"));
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"], "store_unavailable");
    };

    let stall = store.stall_commits();
    // tx-run: the writer runs it, then its commit hangs.
    let run = tokio::spawn(send("tx-run"));
    stall.holding().await;
    // tx-queued: waits behind the hung commit; its caller gives up before it starts.
    refused(send("tx-queued").await.unwrap()).await;
    refused(run.await.unwrap().unwrap()).await;
    drop(stall);

    let queued = send("tx-queued").await.unwrap();
    assert_eq!(queued.status(), 200);
    assert!(
        queued.headers().get("idempotent-replayed").is_none(),
        "withdrawn before it ran: the retry is a first arrival"
    );
    let run = send("tx-run").await.unwrap();
    assert_eq!(run.status(), 200, "accepted or replayed");

    let all = store
        .list(&ListFilter {
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .unwrap();
    let mut recorded: Vec<String> = all
        .messages
        .iter()
        .map(|r| {
            r.message
                .transaction_id
                .as_deref()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    recorded.sort();
    assert_eq!(recorded, ["tx-queued", "tx-run"], "each recorded once");
    shutdown.cancel();
}
