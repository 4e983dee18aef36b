//! Phase 8, PostgreSQL (issue 26): the third store engine on a private server of its own
//! (`fsync`, `synchronous_commit`, `full_page_writes` on), one database per measurement:
//!
//! - ingest over HTTP, as the other stores' ingest phase (dispatch off), with the CPU per
//!   accept of callbackd and of the server (the postmaster and every process it started);
//! - the ratio that counts: that ingest against `pgbench` running an accept's shape of
//!   transaction (one insert-on-conflict claim and one message row, 64 clients, random keys)
//!   on the same server, and against a lone insert-on-conflict;
//! - dispatch: due messages created through `Store::accept`, drained into the sink (one
//!   host) by a dispatching process;
//! - bytes on disk per finished callback with a one-attempt history;
//! - an idle dispatcher's cost on the server (CPU and statements/s);
//! - claim + complete through the library with a future backlog vs an empty queue;
//! - the retention run ([`crate::pg_retention`]).

use std::time::{Duration, Instant};

use callbackd::store::postgres::PostgresStore;

use crate::daemon::Daemon;
use crate::direct_store::{bulk_accept, drain, store_cycle};
use crate::idle::{IDLE_PAIRS, idle_window, settle_after_resume, signal, spread};
use crate::load::{accepted_fresh, closed_loop, ingest_make, percentiles};
use crate::machine::{cpu_secs, cpu_secs_fine, peak_rss_mib};
use crate::pg_server::{Pg, connect, sizes};
use crate::pgbench::{self, Script};
use crate::{DAY_MS, DEDUPE_TTL_SECS, Env, Report, pg_retention, rate};

const DISPATCH_TARGET: f64 = 5_000.0;

pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    eprintln!("[8/8] PostgreSQL: a private server, synchronous_commit = on, fsync on");
    let Some(pg) = start(report).await? else {
        return Ok(());
    };
    let ingest_rate = ingest(env, &pg, report).await?;
    raw_pgbench(env, &pg, report, ingest_rate).await?;
    dispatch(env, &pg, report).await?;
    disk_per_callback(env, &pg, report).await?;
    idle(env, &pg, report).await?;
    backlog(env, &pg, report).await?;
    pg_retention::run(env, &pg, report).await?;
    Ok(())
}

/// A part of the phase that can run alone, on a server of its own.
#[derive(Debug, Clone, Copy)]
pub enum Part {
    /// Claim + complete with a future backlog (`--only=postgres-backlog`).
    Backlog,
    /// Bytes on disk per finished callback (`--only=postgres-size`).
    Size,
    /// The retention run (`--only=postgres-retention`).
    Retention,
}

/// One part of the phase alone.
pub async fn run_alone(env: &Env, report: &mut Report, part: Part) -> Result<(), String> {
    eprintln!("[8/8, alone] PostgreSQL: {part:?}");
    let Some(pg) = start(report).await? else {
        return Ok(());
    };
    match part {
        Part::Backlog => backlog(env, &pg, report).await,
        Part::Size => disk_per_callback(env, &pg, report).await,
        Part::Retention => pg_retention::run(env, &pg, report).await,
    }
}

/// The phase's server, reported; `None`, reported too, when PostgreSQL is not installed.
async fn start(report: &mut Report) -> Result<Option<Pg>, String> {
    let pg = match tokio::task::spawn_blocking(Pg::start)
        .await
        .map_err(|e| e.to_string())?
    {
        Ok(pg) => pg,
        Err(e) => {
            eprintln!("  postgres: not available ({e})");
            report.target(
                "PostgreSQL",
                format!(
                    "postgres: not available ({})",
                    e.lines().next().unwrap_or("")
                ),
                "",
                None,
            );
            return Ok(None);
        }
    };
    report.row(
        "PostgreSQL server (private, on 127.0.0.1)",
        format!(
            "{}; fsync {}, synchronous_commit {}, full_page_writes {}, shared_buffers {}, autovacuum_naptime {}; {}",
            pg.show("server_version"),
            pg.show("fsync"),
            pg.show("synchronous_commit"),
            pg.show("full_page_writes"),
            pg.show("shared_buffers"),
            pg.show("autovacuum_naptime"),
            if pg.statements {
                "pg_stat_statements loaded"
            } else {
                "pg_stat_statements not installed: transactions counted instead of statements"
            }
        ),
    );
    Ok(Some(pg))
}

/// The ingest closed loop against a process with dispatch off. Returns accepted/s.
async fn ingest(env: &Env, pg: &Pg, report: &mut Report) -> Result<f64, String> {
    let plan = env.plan;
    eprintln!(
        "  ingest: 64 connections, {} s, dispatch off",
        plan.pg_ingest_secs
    );
    let url = pg.create_db("ingest")?;
    let mut daemon = Daemon::start(env.dir.path(), "pg-ingest", &url, false).await?;
    pg.reset_statements();
    let started = Instant::now();
    let (d0, s0, g0) = (cpu_secs(Some(daemon.pid)), pg.cpu_secs(), cpu_secs(None));
    let ingest = closed_loop(
        daemon.addr,
        plan.pg_ingest_secs,
        u64::MAX,
        ingest_make(daemon.host(), format!("{}-p", env.run_tag)),
        accepted_fresh(),
    )
    .await;
    let (d1, s1, g1) = (cpu_secs(Some(daemon.pid)), pg.cpu_secs(), cpu_secs(None));
    let wall = started.elapsed().as_secs_f64();
    let per_sec = ingest.per_sec();
    eprintln!(
        "  {} accepted/s, {}",
        rate(per_sec),
        percentiles(&ingest.hist)
    );
    report.row(
        "PostgreSQL ingest: accepted callbacks/s (64 conns, closed loop, dispatch off)",
        rate(per_sec),
    );
    report.row("PostgreSQL ingest: latency", percentiles(&ingest.hist));
    let diff = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
    let (d, s, g) = (diff(d0, d1), diff(s0, s1), diff(g0, g1));
    let per = |v: Option<f64>| {
        v.map(|v| format!("{:.0}", v * 1e6 / ingest.ok.max(1) as f64))
            .unwrap_or_else(|| "?".into())
    };
    let cores = |v: Option<f64>| {
        v.map(|v| format!("{:.2}", v / wall))
            .unwrap_or_else(|| "?".into())
    };
    let total_us: f64 = [d, s, g].iter().flatten().sum::<f64>() * 1e6 / ingest.ok.max(1) as f64;
    report.row(
        "PostgreSQL ingest: CPU per accepted callback",
        format!(
            "callbackd {} / postgres (postmaster + backends) {} / load generator {} µs; ≈ {}/s if all of 2 cores were free",
            per(d),
            per(s),
            per(g),
            rate(2e6 / total_us.max(1e-9))
        ),
    );
    report.row(
        "PostgreSQL ingest: CPU in use",
        format!(
            "callbackd {} / postgres {} / load generator + sink {} cores",
            cores(d),
            cores(s),
            cores(g)
        ),
    );
    if let Some(top) = pg.top_statements("ingest", ingest.ok) {
        report.row(
            "PostgreSQL ingest: statements per accepted callback (pg_stat_statements: calls and execution µs, plans and planning µs; biggest first)",
            top,
        );
    }
    if let Some(mib) = peak_rss_mib(daemon.pid) {
        report.row(
            "Peak RSS of callbackd under PostgreSQL ingest",
            format!("{mib:.1} MiB"),
        );
    }
    if ingest.failed > 0 {
        report.note(format!(
            "postgres ingest: {} requests failed ({})",
            ingest.failed,
            ingest.failures()
        ));
    }
    let logged = daemon.errors_logged();
    if logged > 0 {
        report.note(format!(
            "postgres ingest process logged {logged} WARN/ERROR lines, last: {}",
            daemon.log_tail()
        ));
    }
    daemon.stop();
    Ok(per_sec)
}

/// pgbench on the same server: an accept's shape, and a lone insert-on-conflict.
async fn raw_pgbench(
    env: &Env,
    pg: &Pg,
    report: &mut Report,
    ingest_rate: f64,
) -> Result<(), String> {
    let secs = env.plan.pgbench_secs;
    pg.create_db("pgbench")?;
    pg.server
        .try_psql_db("pgbench", pgbench::SCHEMA)
        .map_err(|e| format!("pgbench tables: {e}"))?;
    for script in [Script::AcceptShape, Script::LoneClaim] {
        let shape = matches!(script, Script::AcceptShape);
        let what = script.describe();
        eprintln!("  pgbench -c 64 -M prepared, {secs} s: {what}");
        let s0 = pg.cpu_secs();
        let started = Instant::now();
        let tps = pgbench::tps(pg.server.port, "pgbench", script, secs, env.dir.path()).await;
        let cpu = pg.cpu_secs().zip(s0).map(|(b, a)| b - a);
        let wall = started.elapsed().as_secs_f64();
        let label = if shape {
            "pgbench, an accept's shape"
        } else {
            "pgbench, a lone claim"
        };
        match tps {
            Ok(tps) => {
                eprintln!("  {} tps", rate(tps));
                let cpu_per = cpu
                    .map(|c| {
                        format!(
                            "; postgres CPU ≈ {:.0} µs per transaction",
                            c * 1e6 / (tps * wall).max(1.0)
                        )
                    })
                    .unwrap_or_default();
                report.row(
                    format!("{label} ({what}; -c 64 -j 2 -M prepared, random keys, {secs} s): transactions/s"),
                    format!("{}{cpu_per}", rate(tps)),
                );
                if shape {
                    let ratio = ingest_rate / tps.max(1e-9);
                    report.target(
                        "PostgreSQL ingest / pgbench of an accept's shape (the ratio that counts)",
                        format!("{ratio:.3}× ({} / {})", rate(ingest_rate), rate(tps)),
                        "≥ 0.5×",
                        Some(ratio >= 0.5),
                    );
                } else {
                    report.row(
                        "PostgreSQL ingest / pgbench of a lone claim",
                        format!("{:.3}×", ingest_rate / tps.max(1e-9)),
                    );
                }
            }
            Err(e) => {
                eprintln!("  pgbench: {e}");
                report.target(label, format!("n/a ({e})"), "", None);
            }
        }
    }
    Ok(())
}

/// Opens a store on a fresh database `name` and brings its layout up, as `callbackd serve`
/// does.
async fn store(pg: &Pg, name: &str) -> Result<(PostgresStore, String), String> {
    let url = pg.create_db(name)?;
    let mut store = PostgresStore::connect(&url, Duration::from_secs(30), DEDUPE_TTL_SECS)
        .await
        .map_err(|e| format!("{name}: {e}"))?;
    store.migrate().await.map_err(|e| format!("{name}: {e}"))?;
    Ok((store, url))
}

/// Due messages created through the store, drained into the sink by a dispatching process.
async fn dispatch(env: &Env, pg: &Pg, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    let n = plan.pg_dispatch_n;
    eprintln!("  dispatch: {n} due messages (Store::accept), drained into the sink");
    let (store, url) = store(pg, "dispatch").await?;
    let (made, took) =
        bulk_accept(&store, &format!("{}-pd", env.run_tag), n, 0, &env.sink_url).await?;
    report.row(
        "PostgreSQL Store::accept direct (256 in flight, pool of 16 connections)",
        format!(
            "{}/s ({made} in {:.1} s)",
            rate(made as f64 / took.as_secs_f64().max(1e-9)),
            took.as_secs_f64()
        ),
    );
    drop(store);
    pg.reset_statements();
    let s0 = pg.cpu_secs();
    let (per_sec, got, repeats, rss) = drain(
        env.dir.path(),
        "pg-dispatch",
        &url,
        &env.sink,
        made,
        Duration::from_secs_f64(plan.drain_cap_secs),
    )
    .await?;
    let server = pg.cpu_secs().zip(s0).map(|(b, a)| b - a);
    eprintln!("  {} deliveries/s ({got} of {made})", rate(per_sec));
    report.target(
        format!(
            "PostgreSQL dispatch drain: deliveries/s to one host ({got}/{made} delivered, first to last arrival)"
        ),
        rate(per_sec),
        "≥ 5,000/s",
        Some(per_sec >= DISPATCH_TARGET),
    );
    if let Some(cpu) = server {
        report.row(
            "PostgreSQL dispatch drain: postgres CPU per delivery (postmaster + backends)",
            format!("{:.0} µs", cpu * 1e6 / got.max(1) as f64),
        );
    }
    if let Some(top) = pg.top_statements("dispatch", got as u64) {
        report.row(
            "PostgreSQL dispatch drain: statements per delivery (pg_stat_statements: calls and execution µs, plans and planning µs; biggest first)",
            top,
        );
    }
    if let Some(mib) = rss {
        report.row(
            "Peak RSS of callbackd during the PostgreSQL drain",
            format!("{mib:.1} MiB"),
        );
    }
    if repeats > 0 {
        report.note(format!("postgres drain: {repeats} repeated deliveries"));
    }
    if (got as u64) < made {
        report.note(format!(
            "postgres drain: watched for {} s at most; {got} of {made} arrived by then",
            plan.drain_cap_secs
        ));
    }
    Ok(())
}

/// Rounds of the bytes-on-disk measurement: the live partitions hold one round at a time.
const SIZE_ROUNDS: u64 = 10;

/// Bytes on disk per finished callback: accepted, claimed and completed (one delivery
/// attempt in its history) through the store, tables plus indexes, before and after a VACUUM.
///
/// In [`SIZE_ROUNDS`] rounds, each accepted and finished before the next, with a VACUUM
/// between them as autovacuum would make: a deployment's live partitions hold its backlog,
/// not its month, and their space is used again by the next callbacks, so one round of them
/// at a time is what a month of finished callbacks pays for them.
async fn disk_per_callback(env: &Env, pg: &Pg, report: &mut Report) -> Result<(), String> {
    let n = env.plan.pg_size_n;
    let round = (n / SIZE_ROUNDS).max(1);
    eprintln!(
        "  bytes on disk: {n} callbacks accepted and finished with one attempt, {round} at a time"
    );
    let (store, url) = store(pg, "size").await?;
    let client = connect(&url).await?;
    let before = sizes(&client).await?;
    let mut finished = 0;
    for i in 0..n.div_ceil(round) {
        let this_round = round.min(n - i * round);
        bulk_accept(
            &store,
            &format!("{}-ps{i}", env.run_tag),
            this_round,
            0,
            &env.sink_url,
        )
        .await?;
        finished += store_cycle(&store, this_round).await?.1;
        client
            .batch_execute("VACUUM")
            .await
            .map_err(|e| format!("VACUUM: {e}"))?;
    }
    let after = sizes(&client).await?;
    let per = (after.total() - before.total()) as f64 / finished.max(1) as f64;
    eprintln!(
        "  per finished callback: {}",
        before.per_item(&after, finished)
    );
    report.target(
        format!("PostgreSQL bytes on disk per finished callback (one attempt; {finished} finished in {SIZE_ROUNDS} rounds, a VACUUM after each; pg_total_relation_size of every table and partition)"),
        before.per_item(&after, finished),
        "≤ 1 KB",
        Some(per <= 1024.0 && finished > 0),
    );
    Ok(())
}

/// A dispatching process on an empty store: what its polling costs the server, in pairs of
/// windows with it running and stopped (idle.rs).
async fn idle(env: &Env, pg: &Pg, report: &mut Report) -> Result<(), String> {
    let window = idle_window(env.plan.pg_idle_secs);
    let secs = window.as_secs_f64();
    eprintln!(
        "  idle dispatcher: {IDLE_PAIRS} pairs of {secs:.0} s, running and stopped, on an empty store"
    );
    let url = pg.create_db("idle")?;
    let mut daemon = Daemon::start(env.dir.path(), "pg-idle", &url, true).await?;
    // A poll's time for its start (the layout written, the pool and `LISTEN` opened), then
    // its writes and the earlier phases' flushed, so the first window takes in neither.
    tokio::time::sleep(idle_window(0.0)).await;
    pg.checkpoint()?;
    tokio::time::sleep(settle_after_resume()).await;
    // The backends serving the dispatcher's connections (its pool and its `LISTEN`), opened
    // by now: their CPU is the dispatcher's cost to the server to the nanosecond, apart from
    // the server's own background work, which the running-minus-stopped difference carries.
    let backends = pg.backends_of("idle")?;
    let backend_cpu = || -> Vec<Option<f64>> {
        backends
            .iter()
            .map(|pid| cpu_secs_fine(Some(*pid)))
            .collect()
    };
    let (mut server, mut own, mut served) = (Vec::new(), Vec::new(), Vec::new());
    let mut statements = 0;
    for _ in 0..IDLE_PAIRS {
        // Each count is a `psql` of its own, read just outside the running window (before it,
        // and once the dispatcher is stopped), so it counts the window's statements only.
        let q0 = pg.statements_so_far();
        let (s0, d0, b0) = (
            pg.fine_cpu_secs(),
            cpu_secs_fine(Some(daemon.pid)),
            backend_cpu(),
        );
        tokio::time::sleep(window).await;
        let (s1, d1, b1) = (
            pg.fine_cpu_secs(),
            cpu_secs_fine(Some(daemon.pid)),
            backend_cpu(),
        );
        signal(daemon.pid, "-STOP")?;
        let q1 = pg.statements_so_far();
        let t0 = pg.fine_cpu_secs();
        tokio::time::sleep(window).await;
        let t1 = pg.fine_cpu_secs();
        signal(daemon.pid, "-CONT")?;
        // Only the backends there at both ends: one that ended meanwhile took its time along.
        let backends_secs: f64 = b0
            .iter()
            .zip(&b1)
            .filter_map(|(a, b)| Some(b.as_ref()? - a.as_ref()?))
            .sum();
        served.push(backends_secs * 1e3 / secs);
        if let (Some(s0), Some(s1), Some(t0), Some(t1)) = (s0, s1, t0, t1) {
            server.push(((s1 - s0) - (t1 - t0)) * 1e3 / secs);
        }
        if let (Some(d0), Some(d1)) = (d0, d1) {
            own.push((d1 - d0) * 1e3 / secs);
        }
        statements += q1.zip(q0).map_or(0, |(b, a)| b.saturating_sub(a));
        tokio::time::sleep(settle_after_resume()).await;
    }
    daemon.stop();
    let what = if pg.statements {
        "statements"
    } else {
        "transactions"
    };
    let per_sec = statements as f64 / (secs * IDLE_PAIRS as f64);
    let shown = format!(
        "its {} backends {} / the whole server, running minus stopped, {} / callbackd {}; {per_sec:.1} {what}/s",
        backends.len(),
        spread(&served),
        spread(&server),
        spread(&own)
    );
    eprintln!("  idle, ms/s of CPU: {shown}");
    report.row(
        format!("PostgreSQL idle dispatcher (empty store, {IDLE_PAIRS} pairs of {secs:.0} s, running and stopped): CPU in ms per second of the backends serving it, of the whole server (running minus stopped), of callbackd; {what} per second while running"),
        shown,
    );
    Ok(())
}

/// Claim + complete through the library, an empty queue against one with a backlog due a day
/// later; alternating rounds, median per side.
async fn backlog(env: &Env, pg: &Pg, report: &mut Report) -> Result<(), String> {
    let plan = env.plan;
    let (future_n, due_n) = (plan.pg_future_n, plan.due_n);
    eprintln!(
        "  queue scale: {due_n} due messages, empty store vs {future_n} scheduled a day ahead"
    );
    let (empty, empty_url) = store(pg, "empty").await?;
    let (full, full_url) = store(pg, "backlog").await?;
    let stores = [&empty, &full];
    let vacuums = [connect(&empty_url).await?, connect(&full_url).await?];
    let tag = &env.run_tag;
    for (i, store) in stores.iter().enumerate() {
        bulk_accept(*store, &format!("{tag}-pw{i}"), 500, 0, &env.sink_url).await?;
        store_cycle(*store, 500).await?;
    }
    let (made, took) =
        bulk_accept(&full, &format!("{tag}-pf"), future_n, DAY_MS, &env.sink_url).await?;
    eprintln!("  {made} future messages in {:.1} s", took.as_secs_f64());
    let mut cycles: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut server = [0.0f64; 2];
    let mut vacuum_secs = [0.0f64; 2];
    // The churn of one side's round is vacuumed before the other side runs, and charged to
    // the side that made it: left to autovacuum, the vacuum of the backlog's live partition
    // (50,000 rows and more, past its 2% threshold every round) ran while the empty side was
    // measured, and the server's CPU, read for the whole server, put it on the empty side.
    for client in &vacuums {
        client
            .batch_execute("VACUUM")
            .await
            .map_err(|e| format!("VACUUM: {e}"))?;
    }
    let rounds = if plan.quick { 3 } else { 5 };
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for side in order {
            let store = stores[side];
            bulk_accept(
                store,
                &format!("{tag}-pc{side}-{round}"),
                due_n,
                0,
                &env.sink_url,
            )
            .await?;
            let s0 = pg.cpu_secs().unwrap_or(0.0);
            let (cycle, cycled) = store_cycle(store, due_n).await?;
            let vacuum_started = Instant::now();
            vacuums[side]
                .batch_execute("VACUUM")
                .await
                .map_err(|e| format!("VACUUM: {e}"))?;
            vacuum_secs[side] += vacuum_started.elapsed().as_secs_f64();
            server[side] += pg.cpu_secs().unwrap_or(0.0) - s0;
            if cycled < due_n {
                return Err(format!("postgres store cycle claimed {cycled} of {due_n}"));
            }
            cycles[side].push(cycle);
        }
    }
    let list = |v: &[f64]| v.iter().map(|c| rate(*c)).collect::<Vec<_>>().join(", ");
    eprintln!(
        "  store claim+complete: empty {} / future {}",
        list(&cycles[0]),
        list(&cycles[1])
    );
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let shown = format!(
        "rounds: empty {} / future {}",
        list(&cycles[0]),
        list(&cycles[1])
    );
    let (c0, c1) = (median(&mut cycles[0]), median(&mut cycles[1]));
    let ratio = c1 / c0;
    let label = if plan.quick {
        format!("{made} (--quick; the full run: 1M)")
    } else {
        format!("{made}")
    };
    report.target(
        format!("PostgreSQL store claim+complete/s (claim_due 64 + complete, no HTTP), empty → {label} future-scheduled (median of {rounds}, alternating)"),
        format!("{} → {} ({ratio:.3}×; {shown})", rate(c0), rate(c1)),
        "change < 10%",
        Some((ratio - 1.0).abs() < 0.10),
    );
    let per = |side: usize| server[side] * 1e6 / (rounds as f64 * due_n as f64);
    let vacuum_per = |side: usize| vacuum_secs[side] * 1e6 / (rounds as f64 * due_n as f64);
    report.row(
        "PostgreSQL CPU per claimed + completed message with the VACUUM after its round, empty → future-scheduled; the VACUUM's wall time per message",
        format!(
            "{:.0} µs → {:.0} µs; VACUUM {:.0} µs → {:.0} µs",
            per(0),
            per(1),
            vacuum_per(0),
            vacuum_per(1)
        ),
    );
    Ok(())
}
