//! The sink's raw POST rate, measured by `wrk` (Debian: `apt-get install wrk`): what the
//! dispatch drain's deliveries/s is compared with. wrk opens as many connections as callbackd's
//! default `dispatch.per_host_concurrency` keeps to one host, and posts a notification's body,
//! so the ratio is callbackd's delivery rate against the fastest anything could POST into
//! the same sink on the same cores.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::machine::run_bounded;

/// Connections to the sink: callbackd's default `dispatch.per_host_concurrency`.
const CONNECTIONS: u32 = 16;

/// POSTs/s `wrk` reached into `url` over `secs`, posting `body`; `dir` takes its script and
/// output. The sink runs on this process' runtime, so this blocks a pool thread, not a worker.
pub async fn raw_post_rate(url: &str, body: &str, secs: u64, dir: &Path) -> Result<f64, String> {
    let script = dir.join("wrk-post.lua");
    let lua = format!(
        "wrk.method = \"POST\"\nwrk.body = {}\nwrk.headers[\"Content-Type\"] = \"application/json\"\n",
        lua_string(body)
    );
    std::fs::write(&script, lua).map_err(|e| e.to_string())?;
    let mut cmd = Command::new("wrk");
    cmd.arg("-t1")
        .arg(format!("-c{CONNECTIONS}"))
        .arg(format!("-d{secs}s"))
        .arg("-s")
        .arg(&script)
        .arg(url);
    let out_path = dir.join("wrk.out");
    let timeout = Duration::from_secs(secs + 30);
    let output = tokio::task::spawn_blocking(move || run_bounded(cmd, timeout, &out_path))
        .await
        .map_err(|e| e.to_string())??;
    requests_per_sec(&output).ok_or_else(|| format!("no `Requests/sec:` in wrk's output: {output}"))
}

/// `Requests/sec:` of wrk's summary.
fn requests_per_sec(output: &str) -> Option<f64> {
    output
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A Lua string literal of `s` (the body is JSON: quotes and backslashes need escaping).
fn lua_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}
