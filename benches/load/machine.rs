//! The machine the bench runs on: CPU model, load average, and each process's CPU time and
//! peak memory from /proc.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::rate;

pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub fn command_output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn clock_ticks() -> f64 {
    command_output("getconf", &["CLK_TCK"])
        .parse()
        .unwrap_or(100.0)
}

/// CPU seconds (user + system) used so far by `pid` (or this process).
pub fn cpu_secs(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".into(),
    };
    let stat = std::fs::read_to_string(path).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// Peak resident set size (VmHWM) in MiB.
pub fn peak_rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// CPU used by callbackd, Redis and the load generator between two snapshots.
pub struct CpuSnapshot {
    at: Instant,
    callbackd: Option<f64>,
    pub redis: Option<f64>,
    generator: Option<f64>,
}

impl CpuSnapshot {
    /// CPU µs per operation of each process, and the rate two idle cores could sustain if
    /// nothing else ran (2 s of CPU per second divided by the CPU one operation costs).
    pub fn per_op(&self, later: &CpuSnapshot, ops: u64) -> String {
        let us = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some((b - a) * 1e6 / ops.max(1) as f64),
            _ => None,
        };
        let parts = [
            us(self.callbackd, later.callbackd),
            us(self.redis, later.redis),
            us(self.generator, later.generator),
        ];
        let total: f64 = parts.iter().flatten().sum();
        let shown: Vec<String> = ["callbackd", "redis", "load generator"]
            .iter()
            .zip(parts)
            .filter_map(|(name, v)| v.map(|v| format!("{name} {v:.0}")))
            .collect();
        format!(
            "{} µs; ≈ {}/s if all of 2 cores were free",
            shown.join(" / "),
            rate(2e6 / total.max(1e-9))
        )
    }

    pub fn take(callbackd: u32, redis: u32) -> CpuSnapshot {
        CpuSnapshot {
            at: Instant::now(),
            callbackd: cpu_secs(Some(callbackd)),
            redis: cpu_secs(Some(redis)),
            generator: cpu_secs(None),
        }
    }

    pub fn describe(&self, later: &CpuSnapshot) -> String {
        let wall = later.at.duration_since(self.at).as_secs_f64().max(1e-9);
        let cores = |name: &str, a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(format!("{name} {:.2}", (b - a) / wall)),
            _ => None,
        };
        let parts: Vec<String> = [
            cores("callbackd", self.callbackd, later.callbackd),
            cores("redis", self.redis, later.redis),
            cores("load generator + sink", self.generator, later.generator),
        ]
        .into_iter()
        .flatten()
        .collect();
        format!("{} cores", parts.join(" / "))
    }
}

/// Runs `cmd`, killing it after `timeout`; returns stdout.
pub fn run_bounded(mut cmd: Command, timeout: Duration, out_path: &Path) -> Result<String, String> {
    let out = std::fs::File::create(out_path).map_err(|e| e.to_string())?;
    let mut child = cmd
        .stdout(Stdio::from(out))
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{:?} ran longer than {timeout:?}",
                    cmd.get_program()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.to_string()),
        }
    }
    std::fs::read_to_string(out_path).map_err(|e| e.to_string())
}

/// CPU seconds every core of the machine spent busy since boot (/proc/stat: all but idle and
/// iowait), to tell how much of the machine other work took during a measurement.
pub fn machine_busy_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<f64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let idle = ticks.get(3)? + ticks.get(4)?;
    // guest time is already counted in user and nice
    let total: f64 = ticks.iter().take(8).sum();
    Some((total - idle) / clock_ticks())
}

/// CPU seconds `pid` (or this process) has run so far, to the nanosecond: the sum of its
/// threads' /proc schedstat run times. [`cpu_secs`] counts in clock ticks (10 ms), too coarse
/// for a second of an idle process; this misses threads that have exited, which a running
/// Redis or callbackd hardly has.
pub fn cpu_secs_fine(pid: Option<u32>) -> Option<f64> {
    let tasks = match pid {
        Some(p) => format!("/proc/{p}/task"),
        None => "/proc/self/task".into(),
    };
    let mut ns = 0u64;
    for task in std::fs::read_dir(tasks).ok()?.flatten() {
        let stat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        ns += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Some(ns as f64 / 1e9)
}
