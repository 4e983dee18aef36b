//! Work accepted through one process, delivered by another: how fast a dispatcher that an
//! engine's wake-up signal serves (PostgreSQL `LISTEN`, Redis pub/sub) finds it.

use std::time::{Duration, Instant};

use super::sink::Sink;
use super::{TestServer, config};

/// A delivery woken by a wake-up arrives within this; a signalled dispatcher polls every 5 s,
/// so a missed wake-up shows as a delivery late by up to 5 s. Wide enough for a loaded
/// 2-core machine.
pub const WOKEN_WITHIN: Duration = Duration::from_millis(600);

/// Two callbackd apps on one store: `front` accepts (its dispatcher off), `back` delivers to
/// `sink`.
pub async fn front_and_back(store_url: &str, sink: &Sink) -> (TestServer, TestServer) {
    let forward = format!("{}/forward", sink.url);
    let mut front = config(store_url, Some(&forward));
    front.dispatch.enabled = false;
    let front = TestServer::start(front).await;
    let back = TestServer::start(config(store_url, Some(&forward))).await;
    (front, back)
}

/// Posts callback `n` through `front` and returns how long until the sink had it.
pub async fn delivered_after(front: &TestServer, sink: &Sink, n: usize) -> Duration {
    let before = sink.count();
    let started = Instant::now();
    let body = format!(r#"{{"id":"tx-wake-{n}","status":"PAID","amount":100}}"#);
    let answer = front.post_callback("payzu", &body, None).await;
    assert_eq!(answer.status(), 200, "accepted");
    while sink.count() == before {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "callback {n} never delivered"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    started.elapsed()
}

/// Three callbacks 800 ms apart: with the 5 s idle poll alone, at most one of them could be
/// found by a poll within [`WOKEN_WITHIN`], so each arriving in time shows the wake-up.
pub async fn assert_woken_at_once(front: &TestServer, sink: &Sink, first: usize) {
    for n in first..first + 3 {
        let took = delivered_after(front, sink, n).await;
        assert!(
            took < WOKEN_WITHIN,
            "callback {n} accepted by one process took {took:?} to be delivered by the other"
        );
        tokio::time::sleep(Duration::from_millis(800)).await;
    }
}
