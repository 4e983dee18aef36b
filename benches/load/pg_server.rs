//! The PostgreSQL phase's private server (the tests' `support/postgres.rs`: `initdb` into a
//! temp dir, a free loopback port, `fsync`, `synchronous_commit` and `full_page_writes` on),
//! and what the phase reads from it: the CPU time of the postmaster and every process it
//! started, the size of a database's tables, and the statements it ran.

use std::path::Path;
use std::time::Duration;

use tokio_postgres::{Client, NoTls};

use crate::machine::{command_output, cpu_secs_fine};
use crate::pg_support::PostgresServer;

pub struct Pg {
    pub server: PostgresServer,
    /// `pg_stat_statements` is loaded (its library is installed): statements are counted.
    pub statements: bool,
}

impl Pg {
    /// A fresh server with the durable settings, `pg_stat_statements` loaded when installed,
    /// and room for pgbench's 64 clients next to callbackd's pools. Autovacuum wakes every
    /// 10 s instead of every minute: the retention run passes a virtual day in seconds, and
    /// with the default it would see one vacuum a week of virtual time where a real server
    /// sees hundreds.
    pub fn start() -> Result<Pg, String> {
        let pkglib = command_output("pg_config", &["--pkglibdir"]);
        let statements = Path::new(&pkglib).join("pg_stat_statements.so").exists();
        let mut settings = vec![("max_connections", "200"), ("autovacuum_naptime", "10s")];
        if statements {
            settings.push(("shared_preload_libraries", "pg_stat_statements"));
            // Planning is counted too: a statement planned anew on every call (a custom plan)
            // can cost the server more than running it.
            settings.push(("pg_stat_statements.track_planning", "on"));
        }
        let server = PostgresServer::try_start_with(&settings)?;
        if statements {
            server.try_psql("CREATE EXTENSION pg_stat_statements")?;
        }
        Ok(Pg { server, statements })
    }

    /// Creates database `name`; its URL.
    pub fn create_db(&self, name: &str) -> Result<String, String> {
        self.server
            .try_psql(&format!("CREATE DATABASE \"{name}\""))?;
        Ok(self.server.url_db(name))
    }

    /// `SHOW name`.
    pub fn show(&self, name: &str) -> String {
        self.server
            .try_psql(&format!("SHOW {name}"))
            .unwrap_or_else(|e| format!("? ({e})"))
    }

    /// CPU seconds (user + system) of the postmaster and every process it started: its own,
    /// what its reaped children used (cutime + cstime: backends of closed connections), and
    /// what its live children have used so far.
    pub fn cpu_secs(&self) -> Option<f64> {
        let postmaster = self.server.pid();
        let (own, reaped) = stat_times(postmaster)?;
        let children: f64 = children_of(postmaster)?
            .into_iter()
            .filter_map(|pid| Some(stat_times(pid)?.0))
            .sum();
        Some(own + reaped + children)
    }

    /// [`Pg::cpu_secs`] with the postmaster's and its live children's time to the nanosecond
    /// (schedstat), for windows of a few seconds, where clock ticks of 10 ms per process would
    /// be most of what is measured. What reaped children used (an autovacuum worker that ended
    /// in the window) is still counted in ticks.
    pub fn fine_cpu_secs(&self) -> Option<f64> {
        let postmaster = self.server.pid();
        let (_, reaped) = stat_times(postmaster)?;
        let children: f64 = children_of(postmaster)?
            .into_iter()
            .filter_map(|pid| cpu_secs_fine(Some(pid)))
            .sum();
        Some(cpu_secs_fine(Some(postmaster))? + reaped + children)
    }

    /// The client backends serving database `db` now (not an autovacuum worker there).
    pub fn backends_of(&self, db: &str) -> Result<Vec<u32>, String> {
        let pids = self.server.try_psql(&format!(
            "SELECT string_agg(pid::text, ' ') FROM pg_stat_activity \
             WHERE datname = '{db}' AND backend_type = 'client backend'"
        ))?;
        Ok(pids
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect())
    }

    /// Writes out what earlier phases left dirty (`CHECKPOINT`), so that a measurement of an
    /// idle server does not take in the checkpoint of the work before it.
    pub fn checkpoint(&self) -> Result<(), String> {
        self.server.try_psql("CHECKPOINT").map(|_| ())
    }

    /// Statements every database ran so far, from `pg_stat_statements` (top-level calls), or
    /// transactions (`pg_stat_database`: commits + rollbacks) when it is not loaded; minus
    /// those of the `postgres` database, where the bench's own queries run.
    pub fn statements_so_far(&self) -> Option<u64> {
        let sql = if self.statements {
            "SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s \
             JOIN pg_database d ON d.oid = s.dbid WHERE d.datname <> 'postgres'"
        } else {
            "SELECT coalesce(sum(xact_commit + xact_rollback), 0) FROM pg_stat_database \
             WHERE datname IS NOT NULL AND datname <> 'postgres'"
        };
        self.server.try_psql(sql).ok()?.parse().ok()
    }
}

impl Pg {
    /// Forgets what `pg_stat_statements` counted so far (nothing when it is not loaded).
    pub fn reset_statements(&self) {
        if self.statements {
            let _ = self.server.try_psql("SELECT pg_stat_statements_reset()");
        }
    }

    /// The statements database `db` spent most time in since the last reset, per item of `n`:
    /// calls and execution time (in the server, without parsing, the round trip or the commit
    /// that ends the transaction: a COMMIT's WAL flush is not in it), biggest first.
    pub fn top_statements(&self, db: &str, n: u64) -> Option<String> {
        if !self.statements {
            return None;
        }
        let out = self
            .server
            .try_psql(&format!(
                "SELECT s.calls || E'\\t' || s.total_exec_time || E'\\t' || s.plans || E'\\t' || \
                 s.total_plan_time || E'\\t' || regexp_replace(left(s.query, 70), '\\s+', ' ', 'g') \
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = '{db}' ORDER BY s.total_exec_time + s.total_plan_time DESC LIMIT 8"
            ))
            .ok()?;
        let n = n.max(1) as f64;
        let parts: Vec<String> = out
            .lines()
            .filter_map(|line| {
                let mut f = line.splitn(5, '\t');
                let calls: f64 = f.next()?.parse().ok()?;
                let ms: f64 = f.next()?.parse().ok()?;
                let plans: f64 = f.next()?.parse().ok()?;
                let plan_ms: f64 = f.next()?.parse().ok()?;
                let query = f.next()?.replace('|', "¦").replace('`', "'");
                Some(format!(
                    "`{query}` {:.2}× {:.0} µs, planned {:.2}× {:.0} µs",
                    calls / n,
                    ms * 1e3 / n,
                    plans / n,
                    plan_ms * 1e3 / n
                ))
            })
            .collect();
        Some(parts.join("; "))
    }
}

/// (utime + stime, cutime + cstime) of `pid` in seconds.
fn stat_times(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<f64> = rest
        .split_whitespace()
        .take(15)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    // USER_HZ: 100 on Linux.
    let ticks = 100.0;
    Some((
        (f.get(11)? + f.get(12)?) / ticks,
        (f.get(13)? + f.get(14)?) / ticks,
    ))
}

/// The live processes whose parent is `parent`.
fn children_of(parent: u32) -> Option<Vec<u32>> {
    Some(
        std::fs::read_dir("/proc")
            .ok()?
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| parent_of(*pid) == Some(parent))
            .collect(),
    )
}

fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// A connection of the bench's own to `url` (no TLS, on loopback).
pub async fn connect(url: &str) -> Result<Client, String> {
    let (client, connection) =
        tokio::time::timeout(Duration::from_secs(10), tokio_postgres::connect(url, NoTls))
            .await
            .map_err(|_| format!("connecting to {url}: timed out"))?
            .map_err(|e| format!("connecting to {url}: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// On-disk size of a database's tables, by what they hold: `pg_total_relation_size` (heap,
/// indexes, TOAST, free space and visibility maps) of every plain table of `public`, which
/// includes every partition (a partitioned parent has no storage of its own).
#[derive(Debug, Default, Clone, Copy)]
pub struct Sizes {
    /// Day partitions of finished messages and their history (`messages_d*`, `history_d*`).
    pub finished: i64,
    /// The live partitions and the queue (`messages_live`, `history_live`, `queue`).
    pub live: i64,
    /// Dedupe claims.
    pub claims: i64,
    /// Everything else (seals, payments, operations, the layout's own rows).
    pub other: i64,
    /// Of `finished`: the tables' main forks, and their indexes (the rest is TOAST and the
    /// free space and visibility maps).
    pub finished_heap: i64,
    pub finished_indexes: i64,
}

impl Sizes {
    /// Everything in the database's tables and partitions.
    pub fn total(&self) -> i64 {
        self.finished + self.live + self.claims + self.other
    }

    /// Bytes per item of each part between `self` and `later`.
    pub fn per_item(&self, later: &Sizes, n: u64) -> String {
        let per = |a: i64, b: i64| (b - a) as f64 / n.max(1) as f64;
        format!(
            "{:.0} B (finished days {:.0} [heap {:.0}, indexes {:.0}] + dedupe claims {:.0} + live partitions and queue {:.0} + other {:.0})",
            per(self.total(), later.total()),
            per(self.finished, later.finished),
            per(self.finished_heap, later.finished_heap),
            per(self.finished_indexes, later.finished_indexes),
            per(self.claims, later.claims),
            per(self.live, later.live),
            per(self.other, later.other),
        )
    }
}

pub async fn sizes(client: &Client) -> Result<Sizes, String> {
    let rows = client
        .query(
            "SELECT c.relname::text, pg_total_relation_size(c.oid), pg_relation_size(c.oid), \
             pg_indexes_size(c.oid) FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'public' AND c.relkind = 'r'",
            &[],
        )
        .await
        .map_err(|e| format!("table sizes: {e}"))?;
    let mut sizes = Sizes::default();
    for row in rows {
        let name: String = row.get(0);
        let bytes: i64 = row.get(1);
        let part = if name.starts_with("messages_d") || name.starts_with("history_d") {
            sizes.finished_heap += row.get::<_, i64>(2);
            sizes.finished_indexes += row.get::<_, i64>(3);
            &mut sizes.finished
        } else if matches!(name.as_str(), "messages_live" | "history_live" | "queue") {
            &mut sizes.live
        } else if name == "dedupe_claims" {
            &mut sizes.claims
        } else {
            &mut sizes.other
        };
        *part += bytes;
    }
    Ok(sizes)
}

pub fn mib(bytes: i64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}
