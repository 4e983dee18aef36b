//! Phase 5's calls into the library: messages created through `Store::accept`, and the
//! store's half of dispatching (claim, complete) without HTTP; plus a drain by a real process.

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use callbackd::clock::{Clock, SystemClock};
use callbackd::inbound::dedupe::{self, DEFAULT_FIELDS};
use callbackd::store::{
    AcceptOutcome, AcceptRequest, Completion, DedupeClaim, DeliveryAttempt, MessageId, MessageKind,
    NewMessage, Partitions, Store,
};
use futures::stream::{self, StreamExt};

use crate::client::payzu_body;
use crate::daemon::Daemon;
use crate::machine::peak_rss_mib;
use crate::sink::Arrivals;
use crate::{CONCURRENCY, DAY_MS, DEDUPE_TTL_SECS, DRAIN_TIMEOUT};

fn inbound_accept(tx: &str, now: i64, target_url: &str, partitions: Partitions) -> AcceptRequest {
    inbound_accept_for(tx, now, target_url, partitions, DEDUPE_TTL_SECS)
}

/// A PayZu callback of transaction `tx` accepted at `now`, for `target_url`, its dedupe claim
/// kept `ttl_secs`: what the HTTP layer hands `Store::accept`.
pub fn inbound_accept_for(
    tx: &str,
    now: i64,
    target_url: &str,
    partitions: Partitions,
    ttl_secs: u64,
) -> AcceptRequest {
    let body = payzu_body(tx);
    let value: serde_json::Value = serde_json::from_str(&body).expect("bench body is JSON");
    let key = dedupe::derive("payzu", &value, None, &DEFAULT_FIELDS).expect("bench body has a key");
    let ordering_key = format!("src/payzu/{}", key.transaction_id);
    // As the HTTP layer makes it (src/inbound/accept.rs), so its claim takes the same form.
    let id = MessageId::for_claim(now, &ordering_key, partitions, &key.key);
    let response = format!(r#"{{"messageId":"{id}"}}"#);
    AcceptRequest {
        dedupe: DedupeClaim {
            key: key.key,
            ttl_secs,
            fingerprint: None,
            response,
        },
        message: NewMessage {
            id,
            kind: MessageKind::Inbound,
            source: Some("payzu".into()),
            payment_id: None,
            transaction_id: Some(key.transaction_id.into()),
            ordering_key,
            event: None,
            target_url: Some(target_url.to_string()),
            headers: Default::default(),
            body,
            created_at: now,
            deadline: now + 7 * DAY_MS,
        },
        payment: None,
        seal: None,
    }
}

/// Accepts `n` callbacks through `Store::accept`, 256 in flight (on Redis, one multiplexed
/// connection; on PostgreSQL, as many as the pool holds), each due `due_offset_ms` after its acceptance. Returns (accepted, elapsed).
pub async fn bulk_accept<S: Store + ?Sized>(
    store: &S,
    tag: &str,
    n: u64,
    due_offset_ms: i64,
    target_url: &str,
) -> Result<(u64, Duration), String> {
    let started = Instant::now();
    let accepted = AtomicU64::new(0);
    let errors = AtomicU64::new(0);
    let first_error = Mutex::new(None::<String>);
    let step = (n / 10).max(1);
    stream::iter(0..n)
        .map(|i| {
            let (accepted, errors, first_error) = (&accepted, &errors, &first_error);
            async move {
                let now = SystemClock.now_ms() + due_offset_ms;
                let req = inbound_accept(
                    &format!("tx-{tag}-{i}"),
                    now,
                    target_url,
                    store.partitions(),
                );
                match store.accept(req, now).await {
                    Ok(AcceptOutcome::Accepted) => {
                        let done = accepted.fetch_add(1, Ordering::Relaxed) + 1;
                        if n >= 100_000 && done % step == 0 {
                            eprintln!(
                                "    {done}/{n} accepted ({:.0}/s)",
                                done as f64 / started.elapsed().as_secs_f64()
                            );
                        }
                    }
                    other => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut first) = first_error.lock() {
                            first.get_or_insert_with(|| match other {
                                Ok(outcome) => format!("{outcome:?}"),
                                Err(e) => e.to_string(),
                            });
                        }
                    }
                }
            }
        })
        .buffer_unordered(256)
        .collect::<()>()
        .await;
    let errors = errors.into_inner();
    if errors > 0 {
        let first = first_error
            .lock()
            .ok()
            .and_then(|e| e.clone())
            .unwrap_or_default();
        if errors * 100 > n {
            return Err(format!("{errors} of {n} accepts failed, first: {first}"));
        }
        eprintln!("    {errors} accepts failed, first: {first}");
    }
    Ok((accepted.into_inner(), started.elapsed()))
}

/// The store's half of dispatching, without HTTP: claim up to 64 due messages (what a
/// dispatcher with 64 free permits asks for), complete each as delivered, repeat until none
/// is due. Returns messages per second.
pub async fn store_cycle<S: Store + ?Sized>(store: &S, n: u64) -> Result<(f64, u64), String> {
    store_cycle_at(store, n, 0).await
}

/// `store_cycle` with the clock `ahead_ms` in the future (to sweep up messages a drain left
/// scheduled a second ahead).
pub async fn store_cycle_at<S: Store + ?Sized>(
    store: &S,
    n: u64,
    ahead_ms: i64,
) -> Result<(f64, u64), String> {
    let started = Instant::now();
    let mut done = 0u64;
    let mut empty_rounds = 0;
    while done < n && started.elapsed() < DRAIN_TIMEOUT {
        let now = SystemClock.now_ms() + ahead_ms;
        let batch = store
            .claim_due(now, CONCURRENCY, 60_000)
            .await
            .map_err(|e| e.to_string())?;
        if batch.is_empty() {
            empty_rounds += 1;
            if empty_rounds > 50 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            continue;
        }
        let completions = batch.iter().map(|c| {
            let attempt = DeliveryAttempt {
                attempt: c.attempts + 1,
                at: now,
                status: Some(204),
                error: None,
                latency_ms: Some(1),
                response: None,
            };
            store.complete(
                c,
                attempt,
                Completion::Delivered,
                SystemClock.now_ms() + ahead_ms,
            )
        });
        for r in futures::future::join_all(completions).await {
            r.map_err(|e| e.to_string())?;
        }
        done += batch.len() as u64;
    }
    Ok((done as f64 / started.elapsed().as_secs_f64(), done))
}

/// Starts a dispatching callbackd against the queue and measures how fast `n` distinct
/// messages arrive at the sink: (deliveries/s from first to last arrival, delivered,
/// repeats, peak RSS MiB).
pub async fn drain(
    dir: &Path,
    name: &str,
    store_url: &str,
    sink: &Arrivals,
    n: u64,
    cap: Duration,
) -> Result<(f64, usize, u64, Option<f64>), String> {
    sink.reset();
    let mut daemon = Daemon::start(dir, name, store_url, true).await?;
    let got = sink
        .wait_for(n as usize, Duration::from_secs(15), cap)
        .await;
    let rss = peak_rss_mib(daemon.pid);
    daemon.stop();
    let (first, last) = sink.span().ok_or("nothing was delivered")?;
    let secs = last.duration_since(first).as_secs_f64().max(1e-6);
    Ok((
        (got as f64 - 1.0).max(1.0) / secs,
        got,
        sink.repeats.load(Ordering::Relaxed),
        rss,
    ))
}
