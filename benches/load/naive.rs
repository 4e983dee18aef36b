//! The reference point of phase 1: what a team would write without callbackd, the seeds'
//! handler. It verifies the PayZu signature, derives the same dedupe key, claims it with one
//! `SET NX EX` (30 days) and answers 200: no durable record of the event, no queue, no
//! forwarding. Measured in the same run against the same Redis, it shows what the durable
//! record costs. It is reported, not a target.
//!
//! It runs as a child process of the bench binary itself (`--naive-handler <redis url>`), so
//! it has its own CPU like `callbackd serve` and needs no binary target of its own.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use callbackd::clock::{Clock, SystemClock};
use callbackd::digest::short_hash;
use callbackd::inbound::dedupe::{DEFAULT_FIELDS, derive};
use callbackd::webhook::Verifier;
use redis::aio::ConnectionManager;
use tokio::io::AsyncBufReadExt;

use crate::load::{accepted_fresh, closed_loop, ingest_make, percentiles};
use crate::machine::CpuSnapshot;
use crate::{Env, Report, SECRET, rate};

const ARG: &str = "--naive-handler";
const THIRTY_DAYS_SECS: u64 = 30 * 24 * 3600;

/// Serves the naive handler when the bench binary was started as one; `false` otherwise.
pub fn serve_if_asked() -> bool {
    let args: Vec<String> = std::env::args().collect();
    let Some(url) = args
        .iter()
        .position(|a| a == ARG)
        .and_then(|i| args.get(i + 1))
    else {
        return false;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = runtime.block_on(serve(url)) {
        eprintln!("naive handler: {e}");
        std::process::exit(1);
    }
    true
}

struct Handler {
    redis: ConnectionManager,
    verifier: Verifier,
}

async fn serve(url: &str) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let redis = ConnectionManager::new(client)
        .await
        .map_err(|e| e.to_string())?;
    let handler = Arc::new(Handler {
        redis,
        verifier: Verifier::Payzu {
            secrets: vec![SECRET.as_bytes().to_vec()],
            tolerance_secs: 300,
        },
    });
    let app = Router::new()
        .route("/v1/callbacks/payzu", post(callback))
        .with_state(handler);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    println!("{port}");
    axum::serve(listener, app).await.map_err(|e| e.to_string())
}

async fn callback(
    State(handler): State<Arc<Handler>>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, &'static str) {
    if handler
        .verifier
        .verify(&headers, &body, SystemClock.now_secs())
        .is_err()
    {
        return (StatusCode::UNAUTHORIZED, "bad signature");
    }
    let Ok(json) = serde_json::from_slice(&body) else {
        return (StatusCode::BAD_REQUEST, "bad json");
    };
    let Ok(key) = derive("payzu", &json, None, &DEFAULT_FIELDS) else {
        return (StatusCode::BAD_REQUEST, "no dedupe key");
    };
    let claimed: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(format!("naive:{}", short_hash(key.key.as_bytes())))
        .arg(1)
        .arg("NX")
        .arg("EX")
        .arg(THIRTY_DAYS_SECS)
        .query_async(&mut handler.redis.clone())
        .await;
    match claimed {
        Ok(_) => (StatusCode::OK, "{\"status\":\"accepted\"}"),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "redis unavailable"),
    }
}

/// A naive handler child process, killed when dropped.
struct NaiveProcess {
    child: Child,
    port: u16,
}

impl Drop for NaiveProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start(redis_url: &str) -> Result<NaiveProcess, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .args([ARG, redis_url])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("start the naive handler: {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let stdout = tokio::process::ChildStdout::from_std(stdout).map_err(|e| e.to_string())?;
    let mut line = String::new();
    let mut process = NaiveProcess { child, port: 0 };
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::BufReader::new(stdout).read_line(&mut line),
    )
    .await
    .map_err(|_| "the naive handler did not report its port within 10 s".to_string())?
    .map_err(|e| e.to_string())?;
    process.port = line
        .trim()
        .parse()
        .map_err(|_| format!("the naive handler printed {line:?}, not a port"))?;
    Ok(process)
}

/// Runs the naive handler under phase 1's closed loop; reports its rate and what callbackd's
/// `callbackd_rate` is of it.
pub async fn run(env: &Env, report: &mut Report, callbackd_rate: f64) -> Result<(), String> {
    eprintln!("[1/8] reference: the naive handler (verify, SET NX EX, 200) under the same load");
    env.redis.flushall().await?;
    let naive = start(&env.redis.url()).await?;
    // The port is printed after the bind, so connections queue from here on.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], naive.port));
    env.redis.reset_stats().await?;
    let before = CpuSnapshot::take(naive.child.id(), env.redis.pid());
    let load = closed_loop(
        addr,
        env.plan.ingest_secs,
        u64::MAX,
        ingest_make(
            format!("127.0.0.1:{}", naive.port),
            format!("{}-n", env.run_tag),
        ),
        accepted_fresh(),
    )
    .await;
    let after = CpuSnapshot::take(naive.child.id(), env.redis.pid());
    let naive_rate = load.per_sec();
    eprintln!(
        "  {} naive/s, {}",
        rate(naive_rate),
        percentiles(&load.hist)
    );
    report.row(
        "Reference: naive handler (verify, SET NX EX, 200; no durable record) accepted/s",
        rate(naive_rate),
    );
    report.row("Reference: naive handler latency", percentiles(&load.hist));
    report.row(
        "Reference: naive handler CPU per accepted callback",
        before.per_op(&after, load.ok),
    );
    if naive_rate > 0.0 {
        report.row(
            "Ingest, Redis / naive handler (what the durable record costs)",
            format!("{:.3}×", callbackd_rate / naive_rate),
        );
    }
    if load.failed > 0 {
        report.note(format!(
            "naive handler: {} requests failed ({})",
            load.failed,
            load.failures()
        ));
    }
    drop(naive);
    env.redis.flushall().await
}
