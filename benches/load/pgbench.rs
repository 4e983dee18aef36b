//! What PostgreSQL itself does on the same server: `pgbench` (64 clients, prepared statements,
//! custom scripts with random keys) running the shape of an accept's transaction (one
//! insert-on-conflict dedupe claim and one message row, committed together) and a lone
//! insert-on-conflict, into tables of their own in a database of their own. The PostgreSQL
//! phase's ingest is compared with the first.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::machine::{command_output, run_bounded};

/// pgbench's clients: as many as the ingest phase's connections.
const CLIENTS: u32 = 64;

/// The tables the scripts write: the columns the engine's `dedupe_claims` and `messages`
/// rows fill at an accept, without its partitioning, queue and secondary indexes.
pub const SCHEMA: &str = "\
CREATE TABLE claims (key text COLLATE \"C\" PRIMARY KEY, fingerprint text NOT NULL, \
 response text NOT NULL, expires_at bigint NOT NULL); \
CREATE TABLE msgs (id text COLLATE \"C\" PRIMARY KEY, message_json text NOT NULL, \
 ordering_key text COLLATE \"C\" NOT NULL, state text NOT NULL, deadline bigint NOT NULL);";

/// pgbench reads `:name` as a variable even inside a string literal, so no literal holds a
/// colon before a letter; in prepared mode a variable is a parameter, cast to give it a type.
///
/// One accept's shape: a claim and a message row (about the size of the engine's
/// `message_json` of a bench callback), in one transaction.
const ACCEPT_SHAPE: &str = "\
\\set k random(1, 1000000000000)
BEGIN;
INSERT INTO claims (key, fingerprint, response, expires_at) VALUES ('payzu/tx-' || (:k)::text, '', '{\"messageId\":\"m-' || (:k)::text || '\"}', 1) ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, response = excluded.response, expires_at = excluded.expires_at;
INSERT INTO msgs (id, message_json, ordering_key, state, deadline) VALUES ('m-' || (:k)::text || '-' || (:client_id)::text, repeat('x', 700), 'src/payzu/tx-' || (:k)::text, 'pending', 1) ON CONFLICT (id) DO NOTHING;
END;
";

/// A lone insert-on-conflict claim, committed by itself.
const LONE_CLAIM: &str = "\
\\set k random(1, 1000000000000)
INSERT INTO claims (key, fingerprint, response, expires_at) VALUES ('payzu/lone-' || (:k)::text, '', '{\"messageId\":\"m-' || (:k)::text || '\"}', 1) ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, response = excluded.response, expires_at = excluded.expires_at;
";

pub enum Script {
    AcceptShape,
    LoneClaim,
}

impl Script {
    pub fn describe(&self) -> &'static str {
        match self {
            Script::AcceptShape => {
                "BEGIN; INSERT … ON CONFLICT claim; INSERT message row (~700 B); END"
            }
            Script::LoneClaim => "INSERT … ON CONFLICT claim, autocommit",
        }
    }
}

/// Transactions/s pgbench reached (`tps = … (without initial connection time)`) running
/// `script` for `secs` against database `db` on `port`; `dir` takes the script and output.
pub async fn tps(
    port: u16,
    db: &str,
    script: Script,
    secs: u64,
    dir: &Path,
) -> Result<f64, String> {
    if command_output("pgbench", &["--version"]).is_empty() {
        return Err("pgbench is not installed (Debian: apt-get install postgresql-client)".into());
    }
    let (name, text) = match script {
        Script::AcceptShape => ("pgbench-accept.sql", ACCEPT_SHAPE),
        Script::LoneClaim => ("pgbench-claim.sql", LONE_CLAIM),
    };
    let path = dir.join(name);
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("pgbench");
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(["-n", "-M", "prepared", "-j", "2"])
        .arg(format!("-c{CLIENTS}"))
        .arg(format!("-T{secs}"))
        .arg("-f")
        .arg(&path)
        .arg(db);
    let out_path = dir.join(format!("{name}.out"));
    let timeout = Duration::from_secs(secs + 60);
    let output = tokio::task::spawn_blocking(move || run_bounded(cmd, timeout, &out_path))
        .await
        .map_err(|e| e.to_string())??;
    output
        .lines()
        .find_map(|l| l.trim().strip_prefix("tps = "))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("no `tps = ` in pgbench's output: {output}"))
}
