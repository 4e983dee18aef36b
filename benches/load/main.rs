//! Load benchmark for callbackd (issue 6): `cargo bench --bench load [-- --quick]`.
//!
//! One run starts its own `redis-server` (free port, temp dir, AOF `everysec`) and the release
//! `callbackd` binary as child processes, drives them over loopback, and prints one markdown
//! table (also written to `target/bench-results.md`). BENCHMARKS.md explains every row.
//!
//! Phases, each bounded in time and in count:
//!  1. ingest: 64 connections post unique, validly signed PayZu callbacks for a fixed time
//!     (closed loop); accepts/s and latency; then `redis-benchmark` runs unpipelined
//!     `SET NX EX` against the same Redis for the ratio, and the naive handler (verify,
//!     `SET NX EX`, 200, no durable record) takes the same load as a reference point.
//!  2. half load: open loop at 50% of the measured ingest rate; latency is measured from each
//!     request's *scheduled* send time, so a stall is charged to every request it delays
//!     (no coordinated omission).
//!  3. duplicate storm: one callback, byte for byte, from all 64 connections.
//!  4. dispatch: N notifications handed off to an ingest-only process, then a second process
//!     with dispatch on drains them into an in-process sink; then acceptance-to-first-attempt
//!     latency at a moderate open-loop hand-off rate.
//!  5. queue scale: claim/dispatch rate of due messages with and without many messages
//!     scheduled a day ahead (created through the library's `Store::accept` directly); Redis
//!     memory per accepted callback and per dedupe key.
//!  6. SQLite: phase 1 against `store.url = "sqlite://..."`.
//!  7. Redis Cluster: ingest and dispatch on the one Redis and on a 3-master, 3-replica
//!     cluster on loopback (callbackd pointed at one node), then the cluster's ingest again
//!     with `store.min_replicas_acked = 1` (`WAIT` after every write); Redis CPU per
//!     operation on each node, each master's `INFO commandstats`, and what an idle
//!     dispatcher's polling of every partition costs each node.
//!  8. PostgreSQL: a private server (`fsync`, `synchronous_commit` on): ingest over HTTP and
//!     the CPU per accept of callbackd and of the server; `pgbench` running an accept's shape
//!     of transaction on the same server, for the ratio; a dispatch drain; bytes on disk per
//!     finished callback; an idle dispatcher's cost; claim + complete with a future backlog;
//!     and a retention run of 90 virtual days (the store takes `now` from its caller).
//!
//! `--only=<phase>[,<phase>...]` runs some of them: `ingest` (1-3), `dispatch` (4), `queue`
//! (5), `sqlite` (6), `cluster` (7), `postgres` (8); e.g.
//! `cargo bench --bench load -- --quick --only=cluster`. Parts of phase 8 run alone, each on a
//! server of its own: `--only=postgres-backlog`, claim + complete with a future backlog (at full
//! size its 1M backlog without the 2M retention run); `--only=postgres-size`, bytes on disk
//! per finished callback; `--only=postgres-retention`, the retention run (at full size its 2M
//! callbacks over 90 virtual days, without the rest of the phase).
//!
//! The load generator is a minimal HTTP/1.1 keep-alive client over raw sockets with requests
//! formatted up front, so that on a small machine it takes as little CPU from the server as
//! possible.
//!
//! Layout: `main.rs` reads the arguments, runs the phases in order and prints the report.
//! One file per phase: `ingest` (1, with `naive`, the reference handler), `half_load` (2),
//! `storm` (3), `dispatch` (4), `backlog` and `memory` (5), `sqlite` (6), `cluster` (7),
//! `postgres` (8, with `pg_retention`, its retention run).
//! Shared by them: `load` (the closed and open loops and their latency histograms), `client`
//! (the HTTP client and the requests it sends), `daemon` (a `callbackd serve` process),
//! `redis_stats` (the Redis and what the report reads from it, or from any cluster node),
//! `sink` (the first arrival of each delivery), `direct_store` (the library calls of phases 5
//! and 8), `pg_server` (phase 8's server and what is read from it), `pgbench` (PostgreSQL's
//! own figure) and `machine` (CPU and memory from /proc). The processes, Redis, the cluster and the sink's
//! HTTP server are the tests' own (`tests/support`), configured here for a bench.
//!
//! The server binary is `CARGO_BIN_EXE_callbackd`: Cargo builds it for every bench run with the
//! `bench` profile, which inherits `release`, into `target/release/callbackd`, so it is never
//! stale and never a debug build. `CALLBACKD__*` variables in the environment (other than the
//! store URL, listen address and dispatch switch, which the bench sets) pass through to the
//! server processes and are listed in the report, e.g.
//! `CALLBACKD__DISPATCH__PER_HOST_CONCURRENCY=64 cargo bench --bench load -- --quick`.

#[path = "../../tests/support/postgres.rs"]
#[allow(dead_code)]
mod pg_support;
#[path = "../../tests/support/mod.rs"]
mod support;

mod backlog;
mod client;
mod cluster;
mod daemon;
mod direct_store;
mod dispatch;
mod half_load;
mod idle;
mod ingest;
mod load;
mod machine;
mod memory;
mod naive;
mod pg_retention;
mod pg_server;
mod pgbench;
mod postgres;
mod redis_stats;
mod sink;
mod sqlite;
mod storm;
mod wrk;

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use callbackd::clock::{Clock, SystemClock};

use crate::daemon::OWNED_ENV;
use crate::machine::{command_output, cpu_model, loadavg};
use crate::postgres::Part;
use crate::redis_stats::Redis;
use crate::sink::Arrivals;

const CONCURRENCY: usize = 64;
const SECRET: &str = "bench-payzu-secret";
const CONNECTOR_TOKEN: &str = "bench-connector-token";
const ADMIN_TOKEN: &str = "bench-admin-token";
const DEDUPE_TTL_SECS: u64 = 2_592_000;
/// Any single request slower than this counts as an error (and bounds every phase).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound of any drain wait.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(180);
const DAY_MS: i64 = 86_400_000;

/// Sizes of one run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    quick: bool,
    ingest_secs: f64,
    half_secs: f64,
    dup_secs: f64,
    dispatch_n: u64,
    first_rate: f64,
    first_secs: f64,
    future_n: u64,
    due_n: u64,
    redis_bench_n: u64,
    sqlite_secs: f64,
    /// Each ingest of phase 7 (three of them); its idle-dispatcher readings last two thirds.
    cluster_secs: f64,
    /// Longest a drain is watched; the rate is taken over what arrived.
    drain_cap_secs: f64,
    /// wrk's raw POST run into the sink, which the drain's rate is compared with.
    wrk_secs: u64,
    /// Phase 8, PostgreSQL: the ingest closed loop.
    pg_ingest_secs: f64,
    /// Each of the two pgbench runs.
    pgbench_secs: u64,
    /// Due messages drained into the sink.
    pg_dispatch_n: u64,
    /// Callbacks accepted and finished to measure bytes on disk per callback.
    pg_size_n: u64,
    /// How long an idle dispatcher is watched.
    pg_idle_secs: f64,
    /// The future backlog of the claim + complete comparison.
    pg_future_n: u64,
    /// Callbacks written over the retention run's 90 virtual days.
    pg_retention_n: u64,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                quick,
                ingest_secs: 3.0,
                half_secs: 2.0,
                dup_secs: 2.0,
                dispatch_n: 2_000,
                first_rate: 500.0,
                first_secs: 2.0,
                future_n: 100_000,
                due_n: 2_000,
                redis_bench_n: 100_000,
                sqlite_secs: 3.0,
                cluster_secs: 3.0,
                drain_cap_secs: 4.0,
                wrk_secs: 2,
                pg_ingest_secs: 3.0,
                pgbench_secs: 3,
                pg_dispatch_n: 2_000,
                pg_size_n: 5_000,
                pg_idle_secs: 5.0,
                pg_future_n: 50_000,
                pg_retention_n: 18_000,
            }
        } else {
            Plan {
                quick,
                ingest_secs: 20.0,
                half_secs: 10.0,
                dup_secs: 10.0,
                dispatch_n: 20_000,
                first_rate: 500.0,
                first_secs: 5.0,
                future_n: 1_000_000,
                due_n: 10_000,
                redis_bench_n: 1_000_000,
                sqlite_secs: 20.0,
                cluster_secs: 10.0,
                drain_cap_secs: 30.0,
                wrk_secs: 5,
                pg_ingest_secs: 20.0,
                pgbench_secs: 20,
                pg_dispatch_n: 20_000,
                pg_size_n: 50_000,
                pg_idle_secs: 10.0,
                pg_future_n: 1_000_000,
                pg_retention_n: 2_000_000,
            }
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; anything but `--quick` and `--only=` is ignored.
    if naive::serve_if_asked() {
        return;
    }
    let quick = std::env::args().skip(1).any(|a| a == "--quick");
    let only: Vec<String> = std::env::args()
        .filter_map(|a| Some(a.strip_prefix("--only=")?.to_string()))
        .flat_map(|list| list.split(',').map(str::to_string).collect::<Vec<_>>())
        .collect();
    if let Some(unknown) = only.iter().find(|p| !PHASES.contains(&p.as_str())) {
        eprintln!(
            "unknown phase {unknown:?}; the phases: {}",
            PHASES.join(", ")
        );
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let code = runtime.block_on(run(Plan::new(quick), only));
    drop(runtime);
    std::process::exit(code);
}

// ---------------------------------------------------------------------------------------------
// Report

struct Row {
    metric: String,
    value: String,
    target: String,
    verdict: String,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    notes: Vec<String>,
}

impl Report {
    fn row(&mut self, metric: impl Into<String>, value: impl Into<String>) {
        self.rows.push(Row {
            metric: metric.into(),
            value: value.into(),
            target: String::new(),
            verdict: String::new(),
        });
    }

    fn target(
        &mut self,
        metric: impl Into<String>,
        value: impl Into<String>,
        target: &str,
        met: Option<bool>,
    ) {
        self.rows.push(Row {
            metric: metric.into(),
            value: value.into(),
            target: target.into(),
            verdict: match met {
                Some(true) => "met".into(),
                Some(false) => "**not met**".into(),
                None => "n/a".into(),
            },
        });
    }

    fn note(&mut self, text: impl Into<String>) {
        let text = text.into();
        eprintln!("  note: {text}");
        self.notes.push(text);
    }

    fn markdown(&self, header: &str) -> String {
        let mut out = String::new();
        out.push_str(header);
        out.push_str("\n| metric | value | target | verdict |\n|---|---|---|---|\n");
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                r.metric, r.value, r.target, r.verdict
            );
        }
        if !self.notes.is_empty() {
            out.push_str("\nNotes:\n");
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        out
    }
}

fn ms(us: u64) -> String {
    format!("{:.2} ms", us as f64 / 1000.0)
}

fn rate(n: f64) -> String {
    if n >= 100.0 {
        let s = format!("{:.0}", n);
        // thousands separators
        let bytes = s.as_bytes();
        let mut out = String::new();
        for (i, b) in bytes.iter().enumerate() {
            if i > 0 && (bytes.len() - i) % 3 == 0 {
                out.push(',');
            }
            out.push(*b as char);
        }
        out
    } else {
        format!("{n:.1}")
    }
}

/// What the phases share: the sizes, a temp dir for configs and logs, one Redis, the sink, and
/// a tag that keeps this run's ids apart from an earlier run's.
struct Env {
    plan: Plan,
    dir: tempfile::TempDir,
    redis: Redis,
    sink: Arc<Arrivals>,
    sink_url: String,
    run_tag: String,
}

/// The phases in the order they run, by the names `--only=` takes.
const PHASES: [&str; 9] = [
    "ingest",
    "dispatch",
    "queue",
    "sqlite",
    "cluster",
    "postgres",
    "postgres-backlog",
    "postgres-size",
    "postgres-retention",
];

/// Parts of a phase that run alone only when `--only=` names them: a run of every phase has
/// them in their phase already.
const ONLY_WHEN_NAMED: [&str; 3] = ["postgres-backlog", "postgres-size", "postgres-retention"];

async fn run(plan: Plan, only: Vec<String>) -> i32 {
    let started = Instant::now();
    let bin = Path::new(env!("CARGO_BIN_EXE_callbackd"));
    let load_before = loadavg();
    eprintln!(
        "callbackd load bench ({}), binary {}",
        if plan.quick { "--quick" } else { "full" },
        bin.display()
    );
    let redis = match Redis::start() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let (sink, sink_url) = sink::start().await;
    let env = Env {
        plan,
        dir: tempfile::tempdir().expect("temp dir"),
        redis,
        sink,
        sink_url,
        run_tag: format!("{:x}", SystemClock.now_ms()),
    };
    let mut report = Report::default();
    let mut failed = false;
    for name in PHASES.iter().filter(|p| {
        only.iter().any(|o| o == *p) || (only.is_empty() && !ONLY_WHEN_NAMED.contains(p))
    }) {
        let result = match *name {
            "ingest" => ingest::run(&env, &mut report).await,
            "dispatch" => dispatch::run(&env, &mut report).await,
            "queue" => backlog::run(&env, &mut report).await,
            "sqlite" => sqlite::run(&env, &mut report).await,
            "cluster" => cluster::run(&env, &mut report).await,
            "postgres-backlog" => postgres::run_alone(&env, &mut report, Part::Backlog).await,
            "postgres-size" => postgres::run_alone(&env, &mut report, Part::Size).await,
            "postgres-retention" => postgres::run_alone(&env, &mut report, Part::Retention).await,
            _ => postgres::run(&env, &mut report).await,
        };
        if let Err(e) = result {
            failed = true;
            eprintln!("  phase {name} failed: {e}");
            report.note(format!("phase {name} failed: {e}"));
            let _ = env.redis.flushall().await;
        }
    }

    let overrides: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("CALLBACKD__") && !OWNED_ENV.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let manifest = env!("CARGO_MANIFEST_DIR");
    let commit = command_output("git", &["-C", manifest, "rev-parse", "--short", "HEAD"]);
    let dirty = !command_output(
        "git",
        &["-C", manifest, "status", "--porcelain", "--", "src"],
    )
    .is_empty();
    let redis_version = command_output("redis-server", &["--version"]);
    let header = format!(
        "## callbackd load bench ({mode})\n\n\
         - command: `cargo bench --bench load{args}`\n\
         - commit: {commit}{dirty}; binary: release profile ({bin})\n\
         - machine: {nproc} CPUs, {cpu}; load average before/after: {lb} / {la}\n\
         - {redis_version}; AOF on, appendfsync everysec; everything on 127.0.0.1\n\
         - run time: {secs:.0} s{overrides}\n",
        mode = if plan.quick { "quick" } else { "full" },
        args = if plan.quick { " -- --quick" } else { "" },
        dirty = if dirty {
            " + uncommitted changes in src/"
        } else {
            ""
        },
        bin = bin.display(),
        nproc = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        cpu = cpu_model(),
        lb = load_before,
        la = loadavg(),
        secs = started.elapsed().as_secs_f64(),
        overrides = if overrides.is_empty() {
            String::new()
        } else {
            format!(
                "\n- environment overrides passed to callbackd: `{}`",
                overrides.join(" ")
            )
        },
    );
    let markdown = report.markdown(&header);
    println!("\n{markdown}");
    if let Some(target_dir) = bin.parent().and_then(Path::parent) {
        let path = target_dir.join("bench-results.md");
        match std::fs::write(&path, &markdown) {
            Ok(()) => eprintln!("written to {}", path.display()),
            Err(e) => eprintln!("cannot write {}: {e}", path.display()),
        }
    }
    drop(env);
    if failed { 1 } else { 0 }
}
