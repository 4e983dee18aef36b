//! The load generator: `CONCURRENCY` connections in a closed loop (each sends when its last
//! answer is in) or an open loop (each request has a scheduled send time), and the latency
//! histograms they fill.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio::sync::Semaphore;

use crate::client::{Conn, Resp, callback_request, payzu_body};
use crate::{CONCURRENCY, ms};

pub fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 120_000_000, 3).expect("histogram bounds")
}

pub fn percentiles(h: &Histogram<u64>) -> String {
    if h.is_empty() {
        return "no samples".into();
    }
    format!(
        "p50 {} / p99 {} / p99.9 {}",
        ms(h.value_at_quantile(0.50)),
        ms(h.value_at_quantile(0.99)),
        ms(h.value_at_quantile(0.999))
    )
}

pub type MakeRequest = Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>;
pub type Judge = Arc<dyn Fn(u64, &Resp) -> bool + Send + Sync>;

pub struct LoadResult {
    pub ok: u64,
    pub failed: u64,
    elapsed: Duration,
    /// Latency of successful requests, microseconds.
    pub hist: Histogram<u64>,
    /// Open loop only: latency measured from each request's send (service time).
    pub service: Histogram<u64>,
    statuses: HashMap<String, u64>,
}

impl LoadResult {
    fn new() -> LoadResult {
        LoadResult {
            ok: 0,
            failed: 0,
            elapsed: Duration::ZERO,
            hist: new_hist(),
            service: new_hist(),
            statuses: HashMap::new(),
        }
    }

    fn merge(&mut self, other: LoadResult) {
        self.ok += other.ok;
        self.failed += other.failed;
        let _ = self.hist.add(&other.hist);
        let _ = self.service.add(&other.service);
        for (k, v) in other.statuses {
            *self.statuses.entry(k).or_default() += v;
        }
    }

    pub fn per_sec(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn failures(&self) -> String {
        let mut v: Vec<_> = self.statuses.iter().collect();
        v.sort();
        v.iter()
            .map(|(k, n)| format!("{k}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn record(
        &mut self,
        i: u64,
        result: io::Result<Resp>,
        judge: &Judge,
        latency: Duration,
        service: Duration,
    ) {
        match result {
            Ok(resp) if judge(i, &resp) => {
                self.ok += 1;
                self.hist.saturating_record(latency.as_micros() as u64);
                self.service.saturating_record(service.as_micros() as u64);
            }
            Ok(resp) => {
                self.failed += 1;
                *self
                    .statuses
                    .entry(format!("HTTP {}", resp.status))
                    .or_default() += 1;
            }
            Err(e) => {
                self.failed += 1;
                *self.statuses.entry(format!("{:?}", e.kind())).or_default() += 1;
            }
        }
    }
}

/// `CONCURRENCY` connections each send the next request as soon as the previous one is
/// answered, until `secs` have passed or `limit` requests were made.
pub async fn closed_loop(
    addr: SocketAddr,
    secs: f64,
    limit: u64,
    make: MakeRequest,
    judge: Judge,
) -> LoadResult {
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (next, make, judge) = (next.clone(), make.clone(), judge.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut result = LoadResult::new();
            while Instant::now() < deadline {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= limit {
                    break;
                }
                let request = make(i);
                let sent = Instant::now();
                let resp = conn.send(&request).await;
                let took = sent.elapsed();
                result.record(i, resp, &judge, took, took);
            }
            result
        }));
    }
    let mut total = LoadResult::new();
    for t in tasks {
        if let Ok(r) = t.await {
            total.merge(r);
        }
    }
    total.elapsed = started.elapsed();
    total
}

/// Open loop: request `i` is due at `start + i / rate`, whatever happened before it. A pacer
/// thread releases one permit per due request; `CONCURRENCY` connections take them in order.
/// Latency is measured from the scheduled time, so a request held up behind a slow one is
/// charged for the wait.
pub async fn open_loop(
    addr: SocketAddr,
    rate: f64,
    secs: f64,
    make: MakeRequest,
    judge: Judge,
) -> LoadResult {
    let total = (rate * secs).max(1.0) as u64;
    let permits = Arc::new(Semaphore::new(0));
    let start = Instant::now() + Duration::from_millis(50);
    let schedule = move |i: u64| start + Duration::from_secs_f64(i as f64 / rate);
    let pacer = {
        let permits = permits.clone();
        std::thread::spawn(move || {
            for i in 0..total {
                let at = schedule(i);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                permits.add_permits(1);
            }
            // One more for every connection, so each wakes up and sees the end.
            permits.add_permits(CONCURRENCY);
        })
    };
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..CONCURRENCY {
        let (next, make, judge, permits) =
            (next.clone(), make.clone(), judge.clone(), permits.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut result = LoadResult::new();
            loop {
                match permits.acquire().await {
                    Ok(p) => p.forget(),
                    Err(_) => break,
                }
                // The k-th permit taken was released at or after the k-th scheduled time.
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let request = make(i);
                let sent = Instant::now();
                let resp = conn.send(&request).await;
                let done = Instant::now();
                result.record(
                    i,
                    resp,
                    &judge,
                    done.saturating_duration_since(schedule(i)),
                    done - sent,
                );
            }
            result
        }));
    }
    let mut result = LoadResult::new();
    for t in tasks {
        if let Ok(r) = t.await {
            result.merge(r);
        }
    }
    let _ = tokio::task::spawn_blocking(move || pacer.join()).await;
    result.elapsed = start.elapsed();
    result
}

/// Signed PayZu callbacks of fresh transactions `tx-<tag>-<i>`, as the ingest phases send.
pub fn ingest_make(host: String, tag: String) -> MakeRequest {
    Arc::new(move |i| callback_request(&host, &payzu_body(&format!("tx-{tag}-{i}"))))
}

/// A first arrival, accepted: 200 and not a replay.
pub fn accepted_fresh() -> Judge {
    Arc::new(|_, r| r.status == 200 && !r.replayed)
}
