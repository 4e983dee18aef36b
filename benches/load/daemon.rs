//! A `callbackd serve` child process of the release binary, started through the tests'
//! [`Process`] with the bench's own config file and log.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::client::{Conn, get_request};
use crate::support::process::{Process, StartError};
use crate::support::redis::free_port;
use crate::{ADMIN_TOKEN, CONNECTOR_TOKEN, SECRET};

/// Variables the bench owns; anything else `CALLBACKD__*` in the environment passes through
/// to the children (e.g. to try a setting) and is listed in the report.
pub const OWNED_ENV: [&str; 4] = [
    "CALLBACKD_CONFIG",
    "CALLBACKD__STORE__URL",
    "CALLBACKD__SERVER__LISTEN",
    "CALLBACKD__DISPATCH__ENABLED",
];

/// How long a process may take to answer `/readyz`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Daemon {
    process: Process,
    pub addr: SocketAddr,
    pub pid: u32,
    log: PathBuf,
}

impl Daemon {
    /// Writes `<dir>/<name>.toml` (a profile names the process by it, see BENCHMARKS.md),
    /// logs to `<dir>/<name>.log`, and waits until `/readyz` answers 200.
    pub async fn start(
        dir: &Path,
        name: &str,
        store_url: &str,
        dispatch: bool,
    ) -> Result<Daemon, String> {
        Self::start_with_env(dir, name, store_url, dispatch, &[]).await
    }

    /// [`Daemon::start`] with settings of its own in `CALLBACKD__*` variables, e.g. one run
    /// with `store.min_replicas_acked` set; they win over the environment's.
    pub async fn start_with_env(
        dir: &Path,
        name: &str,
        store_url: &str,
        dispatch: bool,
        settings: &[(&str, &str)],
    ) -> Result<Daemon, String> {
        let bin = env!("CARGO_BIN_EXE_callbackd");
        let port = free_port();
        // The queue-scale phase queues payzu callbacks for the sink on 127.0.0.1 straight
        // through the store; without `allow_private_forward_url` delivery refuses them.
        let config = format!(
            r#"[server]
listen = "127.0.0.1:{port}"
shutdown_grace_secs = 5

[store]
url = "{store_url}"

[auth]
connector_tokens = ["{CONNECTOR_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]

[dispatch]
allow_private_networks = true

[log]
level = "warn"

[sources.payzu]
secrets = ["{SECRET}"]
signature = "payzu"
allow_private_forward_url = true
"#
        );
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let log = dir.join(format!("{name}.log"));
        let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(bin);
        cmd.arg("serve")
            .arg("--config")
            .arg(&config_path)
            .env_remove("RUST_LOG")
            .env(
                "CALLBACKD__DISPATCH__ENABLED",
                if dispatch { "true" } else { "false" },
            )
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file));
        for var in OWNED_ENV
            .iter()
            .filter(|v| **v != "CALLBACKD__DISPATCH__ENABLED")
        {
            cmd.env_remove(var);
        }
        cmd.envs(settings.iter().copied());
        let deadline = Instant::now() + READY_TIMEOUT;
        let tail = || log_tail(&log);
        // On the blocking pool: the wait sleeps its thread, and the runtime's two workers
        // may be serving the sink meanwhile.
        let spawned = tokio::task::spawn_blocking(move || Process::spawn(cmd, port, READY_TIMEOUT))
            .await
            .map_err(|e| e.to_string())?;
        let process = match spawned {
            Ok(p) => p,
            Err(StartError::Spawn(e)) => return Err(format!("cannot start {bin}: {e}")),
            Err(StartError::Exited(status)) => {
                return Err(format!("callbackd exited ({status}): {}", tail()));
            }
            Err(StartError::NotReady(_)) => {
                return Err(format!("callbackd not ready after 20 s: {}", tail()));
            }
        };
        let mut daemon = Daemon {
            pid: process.pid(),
            process,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
        };
        let ready = get_request(&daemon.host(), "/readyz");
        loop {
            if let Ok(Some(status)) = daemon.process.child.try_wait() {
                return Err(format!(
                    "callbackd exited ({status}): {}",
                    daemon.log_tail()
                ));
            }
            let mut conn = Conn::new(daemon.addr);
            if let Ok(resp) = conn.send(&ready).await
                && resp.status == 200
            {
                return Ok(daemon);
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "callbackd not ready after 20 s: {}",
                    daemon.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    pub fn errors_logged(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .map(|t| {
                t.lines()
                    .filter(|l| l.contains("ERROR") || l.contains("WARN"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// SIGTERM, then SIGKILL after 15 s.
    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(15));
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}
