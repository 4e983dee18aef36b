//! Phase 7, Redis Cluster: ingest and dispatch on the one Redis and on a 3-master, 3-replica
//! cluster on loopback (the tests' [`RedisCluster`], AOF `everysec` like the one Redis),
//! callbackd pointed at one node; then the cluster again with `store.min_replicas_acked = 1`,
//! where every write waits for its master's replica (`WAIT`). Each store starts empty.
//!
//! Two shared cores cannot show a cluster scaling out, so what this reads is the cost per
//! operation on each Redis process (CPU time from /proc) and each master's `INFO
//! commandstats`; BENCHMARKS.md ("Redis Cluster") builds the capacity model on them. The
//! ingest process runs with dispatch off, so the dispatcher's idle polling (a claim asks every
//! partition) is not in the per-accept figures: it is measured on its own, after the drain.
//! Each measurement also says how much of the machine other work took meanwhile. CPU time is
//! read from each thread's schedstat, to the nanosecond: a drain lasts about a second.

use std::time::{Duration, Instant};

use callbackd::store::partitions::Partitions;
use callbackd::store::redis::DEFAULT_KEY_PREFIX;

use crate::daemon::Daemon;
use crate::dispatch::{Drained, drain, hand_off};
use crate::idle::{IDLE_PAIRS, idle_window, settle_after_resume, signal, spread};
use crate::load::{accepted_fresh, ingest_make};
use crate::load::{closed_loop, percentiles};
use crate::machine::{cpu_secs_fine, loadavg, machine_busy_secs};
use crate::redis_stats::{self, command_stats_at, connect, reset_stats_at};
use crate::support::redis::cluster::RedisCluster;
use crate::{Env, Report, rate};

const MIN_REPLICAS_ACKED: &str = "CALLBACKD__STORE__MIN_REPLICAS_ACKED";

/// One Redis process behind a store.
struct Node {
    role: &'static str,
    port: u16,
    pid: u32,
}

impl Node {
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn name(&self) -> String {
        format!("{} :{}", self.role, self.port)
    }

    fn serves_writes(&self) -> bool {
        self.role != "replica"
    }
}

/// A store under test: the URL callbackd gets, the settings it runs with, and the Redis
/// processes behind it.
struct Target {
    label: String,
    /// Names this target's processes (their config and log files) and callback ids.
    slug: &'static str,
    url: String,
    settings: Vec<(&'static str, &'static str)>,
    nodes: Vec<Node>,
    dispatch: bool,
}

impl Target {
    fn writers(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.serves_writes())
    }

    fn settings(&self) -> Vec<(&str, &str)> {
        self.settings.to_vec()
    }

    async fn reset_stats(&self) -> Result<(), String> {
        for node in self.writers() {
            reset_stats_at(&node.url()).await?;
        }
        Ok(())
    }

    /// Empties the store: FLUSHALL on every master (a replica follows its master).
    async fn flush(&self) -> Result<(), String> {
        for node in self.writers() {
            let mut conn = connect(&node.url()).await?;
            redis::cmd("FLUSHALL")
                .query_async::<()>(&mut conn)
                .await
                .map_err(|e| format!("FLUSHALL on {}: {e}", node.name()))?;
        }
        Ok(())
    }

    /// One row per master: its busiest commands per operation.
    async fn command_rows(&self, report: &mut Report, what: &str, ops: u64) {
        for node in self.writers() {
            if let Ok(stats) = command_stats_at(&node.url()).await {
                report.row(
                    format!(
                        "{}, {}: commands {what} (calls, µs)",
                        self.label,
                        node.name()
                    ),
                    redis_stats::per_op(&stats, ops),
                );
            }
        }
    }
}

/// CPU seconds so far of every process involved (to the nanosecond), and of the whole machine.
struct Sample {
    at: Instant,
    nodes: Vec<Option<f64>>,
    callbackd: Option<f64>,
    generator: Option<f64>,
    machine: Option<f64>,
}

impl Sample {
    /// `callbackd`: `None` before the process starts, so all it uses afterwards counts.
    fn take(target: &Target, callbackd: Option<u32>) -> Sample {
        Sample {
            at: Instant::now(),
            nodes: target
                .nodes
                .iter()
                .map(|n| cpu_secs_fine(Some(n.pid)))
                .collect(),
            callbackd: callbackd.map_or(Some(0.0), |pid| cpu_secs_fine(Some(pid))),
            generator: cpu_secs_fine(None),
            machine: machine_busy_secs(),
        }
    }

    /// CPU µs per operation of callbackd, the load generator and each Redis process, with the
    /// sum over the masters (what the capacity model divides a core by) and over the replicas.
    fn per_op(&self, later: &Sample, target: &Target, ops: f64) -> String {
        let us = |a: Option<f64>, b: Option<f64>| Some((b? - a?) * 1e6 / ops.max(1e-9));
        let mut parts = Vec::new();
        let (mut writers, mut replicas) = (0.0, 0.0);
        for (i, node) in target.nodes.iter().enumerate() {
            if let Some(v) = us(self.nodes[i], later.nodes[i]) {
                parts.push(format!("{} {v:.1}", node.name()));
                if node.serves_writes() {
                    writers += v;
                } else {
                    replicas += v;
                }
            }
        }
        let own = [
            us(self.callbackd, later.callbackd).map(|v| format!("callbackd {v:.0}")),
            us(self.generator, later.generator).map(|v| format!("bench (generator + sink) {v:.0}")),
        ];
        let sums = if target.nodes.len() > 1 {
            format!(" (masters together {writers:.1}, replicas together {replicas:.1})")
        } else {
            String::new()
        };
        format!(
            "{} µs; Redis: {}{sums}",
            own.into_iter().flatten().collect::<Vec<_>>().join(" / "),
            parts.join(", ")
        )
    }

    /// Cores used by this bench's processes, and by everything else on the machine.
    fn cores(&self, later: &Sample) -> String {
        let wall = later.at.duration_since(self.at).as_secs_f64().max(1e-9);
        let delta = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
        let redis: f64 = self
            .nodes
            .iter()
            .zip(&later.nodes)
            .filter_map(|(a, b)| delta(*a, *b))
            .sum();
        let ours = redis
            + delta(self.callbackd, later.callbackd).unwrap_or(0.0)
            + delta(self.generator, later.generator).unwrap_or(0.0);
        let others = delta(self.machine, later.machine).map(|busy| (busy - ours).max(0.0) / wall);
        format!(
            "redis {:.2} / callbackd {:.2} / generator + sink {:.2} / other work on the machine {} cores",
            redis / wall,
            delta(self.callbackd, later.callbackd).unwrap_or(0.0) / wall,
            delta(self.generator, later.generator).unwrap_or(0.0) / wall,
            others.map_or("n/a".into(), |o| format!("{o:.2}")),
        )
    }
}

pub async fn run(env: &Env, report: &mut Report) -> Result<(), String> {
    eprintln!(
        "[7/8] Redis Cluster: one Redis vs 3 masters + 3 replicas, ingest {} s each",
        env.plan.cluster_secs
    );
    let load_before = loadavg();
    let cluster = tokio::task::spawn_blocking(|| {
        RedisCluster::start_with(|| vec!["--appendfsync".into(), "everysec".into()])
    })
    .await
    .map_err(|e| format!("the cluster did not start: {e}"))?;
    let one = Target {
        label: "One Redis".into(),
        slug: "one",
        url: env.redis.url(),
        settings: Vec::new(),
        nodes: vec![Node {
            role: "single",
            port: env.redis.port(),
            pid: env.redis.pid(),
        }],
        dispatch: true,
    };
    let on_cluster = |acked: &'static str, slug: &'static str, dispatch: bool| Target {
        label: format!("Cluster, min_replicas_acked = {acked}"),
        slug,
        url: cluster.url(),
        settings: vec![(MIN_REPLICAS_ACKED, acked)],
        nodes: cluster_nodes(&cluster),
        dispatch,
    };
    let targets = [
        one,
        on_cluster("0", "cluster-acked0", true),
        on_cluster("1", "cluster-acked1", false),
    ];
    let mut layout = None;
    for target in &targets {
        target.flush().await?;
        measure_ingest(env, target, report).await?;
        if target.nodes.len() > 1 && layout.is_none() {
            layout = Some(partition_layout(&cluster, target).await?);
        }
        if target.dispatch {
            measure_dispatch(env, target, report).await?;
        }
        target.flush().await?;
    }
    if let Some(layout) = layout {
        report.row(
            "Cluster phase: partitions served by each master (of the store's count)",
            layout,
        );
    }
    report.row(
        "Cluster phase: load average before / after (1, 5, 15 min)",
        format!("{load_before} / {}", loadavg()),
    );
    Ok(())
}

/// The cluster's nodes with their roles now (`ROLE` on each).
fn cluster_nodes(cluster: &RedisCluster) -> Vec<Node> {
    let masters: Vec<u16> = cluster.masters().iter().map(|m| m.port).collect();
    let mut nodes: Vec<Node> = cluster
        .nodes()
        .iter()
        .map(|n| Node {
            role: if masters.contains(&n.port) {
                "master"
            } else {
                "replica"
            },
            port: n.port,
            pid: n.pid(),
        })
        .collect();
    nodes.sort_by_key(|n| (n.role, n.port));
    nodes
}

async fn measure_ingest(env: &Env, target: &Target, report: &mut Report) -> Result<(), String> {
    let label = &target.label;
    let name = format!("{}-ingest", target.slug);
    let daemon = Daemon::start_with_env(
        env.dir.path(),
        &name,
        &target.url,
        false,
        &target.settings(),
    )
    .await?;
    target.reset_stats().await?;
    let before = Sample::take(target, Some(daemon.pid));
    let ingest = closed_loop(
        daemon.addr,
        env.plan.cluster_secs,
        u64::MAX,
        ingest_make(daemon.host(), format!("{}-{}", env.run_tag, target.slug)),
        accepted_fresh(),
    )
    .await;
    let after = Sample::take(target, Some(daemon.pid));
    eprintln!(
        "  {label}: {} accepted/s, {}",
        rate(ingest.per_sec()),
        percentiles(&ingest.hist)
    );
    report.row(
        format!("{label}: ingest accepted/s (64 conns, closed loop, dispatch off); latency"),
        format!("{}; {}", rate(ingest.per_sec()), percentiles(&ingest.hist)),
    );
    report.row(
        format!("{label}: ingest CPU per accepted callback"),
        before.per_op(&after, target, ingest.ok as f64),
    );
    report.row(
        format!("{label}: ingest, cores in use"),
        before.cores(&after),
    );
    target
        .command_rows(report, "per accepted callback", ingest.ok)
        .await;
    if ingest.failed > 0 {
        report.note(format!(
            "{label}, ingest: {} requests failed ({})",
            ingest.failed,
            ingest.failures()
        ));
    }
    finish(daemon, label, "ingest", report);
    Ok(())
}

async fn measure_dispatch(env: &Env, target: &Target, report: &mut Report) -> Result<(), String> {
    let label = &target.label;
    let handoff = hand_off(
        env,
        &target.url,
        &format!("{}-handoff", target.slug),
        &format!("{}-", target.slug),
        &target.settings(),
    )
    .await?;
    report.row(
        format!("{label}: hand-offs/s (dispatch off); latency"),
        format!(
            "{}; {}",
            rate(handoff.per_sec()),
            percentiles(&handoff.hist)
        ),
    );
    target.reset_stats().await?;
    let before = Sample::take(target, None);
    let (dispatcher, Drained { got, per_sec }) = drain(
        env,
        &target.url,
        &format!("{}-dispatch", target.slug),
        handoff.ok,
        &target.settings(),
    )
    .await?;
    let after = Sample::take(target, Some(dispatcher.pid));
    eprintln!(
        "  {label}: {} deliveries/s ({got}/{})",
        rate(per_sec),
        handoff.ok
    );
    report.row(
        format!(
            "{label}: dispatch drain deliveries/s ({got}/{} delivered)",
            handoff.ok
        ),
        rate(per_sec),
    );
    report.row(
        format!("{label}: dispatch CPU per delivery"),
        before.per_op(&after, target, got as f64),
    );
    target
        .command_rows(report, "per delivery", got as u64)
        .await;

    // The queue is empty now: what remains is the dispatcher polling every partition.
    let idle = idle_window(env.plan.cluster_secs * 2.0 / 3.0);
    let idle_cost = idle_pairs(target, dispatcher.pid, idle).await?;
    let idle_secs = idle.as_secs_f64();
    report.row(
        format!(
            "{label}: idle dispatcher, Redis CPU with it running minus with it stopped (SIGSTOP), ms per second, {IDLE_PAIRS} alternating pairs of {idle_secs:.1} s"
        ),
        idle_cost.summary(),
    );
    let running = idle_cost.running_secs.round().max(1.0) as u64;
    for (node, stats) in target.writers().zip(&idle_cost.commands) {
        let calls: u64 = stats.iter().map(|s| s.1).sum();
        report.row(
            format!(
                "{label}, {}: idle dispatcher, commands/s while it ran; by command, calls and µs per second",
                node.name()
            ),
            format!(
                "{:.0}; {}",
                calls as f64 / idle_cost.running_secs,
                redis_stats::per_op(stats, running)
            ),
        );
    }
    if (got as u64) < handoff.ok {
        report.note(format!(
            "{label}: the drain was watched for {} s at most; {got} of {} arrived",
            env.plan.drain_cap_secs, handoff.ok
        ));
    }
    finish(dispatcher, label, "dispatch", report);
    Ok(())
}

fn finish(mut daemon: Daemon, label: &str, what: &str, report: &mut Report) {
    let logged = daemon.errors_logged();
    if logged > 0 {
        report.note(format!(
            "{label}, {what}: the process logged {logged} WARN/ERROR lines, last: {}",
            daemon.log_tail()
        ));
    }
    daemon.stop();
}

/// How the store's partitions (one hash tag each, so one slot each) fall on the masters:
/// the busiest master's share bounds what the cluster takes, whatever the others do.
async fn partition_layout(cluster: &RedisCluster, target: &Target) -> Result<String, String> {
    let count = recorded_partitions(target)
        .await
        .unwrap_or(Partitions::DEFAULT.count());
    let nodes = cluster
        .nodes()
        .first()
        .ok_or("the cluster has no node")?
        .cli(&["CLUSTER", "NODES"]);
    let mut conn = connect(&target.url).await?;
    let mut keyslots = redis::pipe();
    for p in 0..count {
        keyslots
            .cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("{{p{p:02}}}"));
    }
    let slots: Vec<u16> = keyslots
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let mut shares = Vec::new();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if !fields.get(2).is_some_and(|f| f.contains("master")) {
            continue;
        }
        let served = slots
            .iter()
            .filter(|slot| {
                fields.iter().skip(8).any(|range| {
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    matches!((from.parse::<u16>(), to.parse::<u16>()),
                        (Ok(from), Ok(to)) if (from..=to).contains(*slot))
                })
            })
            .count();
        let address = fields
            .get(1)
            .and_then(|a| a.split('@').next())
            .unwrap_or("?");
        shares.push(format!("{address} {served}"));
    }
    Ok(format!("{} (of {count})", shares.join(", ")))
}

/// `<prefix>:partitions` as the store recorded it (the prefix may come through the
/// environment): the master holding it answers, the others redirect.
async fn recorded_partitions(target: &Target) -> Option<u16> {
    let prefix =
        std::env::var("CALLBACKD__STORE__KEY_PREFIX").unwrap_or_else(|_| DEFAULT_KEY_PREFIX.into());
    for node in target.writers() {
        let mut conn = connect(&node.url()).await.ok()?;
        if let Ok(Some(count)) = redis::cmd("GET")
            .arg(format!("{prefix}:partitions"))
            .query_async::<Option<u16>>(&mut conn)
            .await
        {
            return Some(count);
        }
    }
    None
}

/// What an idle dispatcher costs the Redis processes, as differences between windows with it
/// running and with it stopped, in ms of CPU per second.
struct IdleCost {
    /// Masters (or the one Redis), one difference per pair.
    masters: Vec<f64>,
    /// Replicas, one difference per pair (empty without replicas).
    replicas: Vec<f64>,
    /// The dispatcher's own CPU while running, ms per second, per pair.
    callbackd: Vec<f64>,
    /// Seconds the dispatcher ran in the measured windows.
    running_secs: f64,
    /// Each master's `INFO commandstats` over the measured windows: (command, calls, µs).
    commands: Vec<Vec<(String, u64, u64)>>,
}

impl IdleCost {
    fn summary(&self) -> String {
        let replicas = if self.replicas.is_empty() {
            String::new()
        } else {
            format!("; replicas {}", spread(&self.replicas))
        };
        format!(
            "masters {}{replicas}; callbackd's own {}",
            spread(&self.masters),
            spread(&self.callbackd)
        )
    }
}

/// Alternates windows of `window` with the dispatcher running and stopped (idle.rs).
async fn idle_pairs(target: &Target, pid: u32, window: Duration) -> Result<IdleCost, String> {
    let secs = window.as_secs_f64();
    let mut cost = IdleCost {
        masters: Vec::new(),
        replicas: Vec::new(),
        callbackd: Vec::new(),
        running_secs: 0.0,
        commands: vec![Vec::new(); target.writers().count()],
    };
    let ms_per_sec = |a: &Sample, b: &Sample, writers: bool| -> f64 {
        target
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.serves_writes() == writers)
            .filter_map(|(i, _)| Some(b.nodes[i]? - a.nodes[i]?))
            .sum::<f64>()
            * 1e3
            / secs
    };
    let has_replicas = target.nodes.iter().any(|n| !n.serves_writes());
    // One poll's time first, so the first window does not take in the drain's tail.
    tokio::time::sleep(idle_window(0.0)).await;
    for _ in 0..IDLE_PAIRS {
        target.reset_stats().await?;
        let running = Sample::take(target, Some(pid));
        tokio::time::sleep(window).await;
        let running_end = Sample::take(target, Some(pid));
        signal(pid, "-STOP")?;
        let mut readings = Vec::new();
        for node in target.writers() {
            readings.push(command_stats_at(&node.url()).await);
        }
        let stopped = Sample::take(target, None);
        tokio::time::sleep(window).await;
        let stopped_end = Sample::take(target, None);
        // Resumed before any error is returned: a dispatcher left stopped would only be
        // killed when the phase drops it, with its log unread.
        signal(pid, "-CONT")?;
        for (reading, sum) in readings.into_iter().zip(cost.commands.iter_mut()) {
            add_stats(sum, reading?);
        }
        cost.masters.push(
            ms_per_sec(&running, &running_end, true) - ms_per_sec(&stopped, &stopped_end, true),
        );
        if has_replicas {
            cost.replicas.push(
                ms_per_sec(&running, &running_end, false)
                    - ms_per_sec(&stopped, &stopped_end, false),
            );
        }
        if let (Some(a), Some(b)) = (running.callbackd, running_end.callbackd) {
            cost.callbackd.push((b - a) * 1e3 / secs);
        }
        cost.running_secs += running_end.at.duration_since(running.at).as_secs_f64();
        tokio::time::sleep(settle_after_resume()).await;
    }
    for stats in &mut cost.commands {
        stats.sort_by_key(|s| std::cmp::Reverse(s.2));
    }
    Ok(cost)
}

/// Adds one reading of `INFO commandstats` to a running sum, command by command.
fn add_stats(sum: &mut Vec<(String, u64, u64)>, reading: Vec<(String, u64, u64)>) {
    for (name, calls, usec) in reading {
        match sum.iter_mut().find(|s| s.0 == name) {
            Some(s) => {
                s.1 += calls;
                s.2 += usec;
            }
            None => sum.push((name, calls, usec)),
        }
    }
}
