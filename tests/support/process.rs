//! Real `callbackd serve` processes for crash, scale-out and shutdown tests.

use std::fmt;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::redis::free_port;

pub struct Process {
    pub child: Child,
    pub url: String,
    /// The template's config file, kept as long as the process runs; `None` when the caller
    /// wrote its own ([`Process::spawn`]).
    _config: Option<tempfile::NamedTempFile>,
}

/// Runs `callbackd serve` with `store_toml` (the `[store]` table's keys) on port 0 and waits
/// for it to exit, as a refused start does; its exit status and standard error. Panics if it
/// is still serving after 30 s.
pub async fn serve_until_refused(store_toml: &str) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!("[store]\n{store_toml}\n[server]\nlisten = \"127.0.0.1:0\"\n"),
    )
    .expect("write the config");
    let serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn callbackd serve");
    let out = tokio::time::timeout(Duration::from_secs(30), serve.wait_with_output())
        .await
        .expect("it exits instead of serving")
        .expect("its output");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What a start waits for.
#[derive(Debug, Clone, Copy)]
pub enum Awaited {
    /// `GET /readyz` 200: serving, its store answering.
    Ready,
    /// `GET /healthz` 200: serving, whatever its store says (a process restarted while its
    /// Redis Cluster fails over answers `/readyz` 503 until every slot is served again).
    Alive,
}

impl Awaited {
    fn path(self) -> &'static str {
        match self {
            Awaited::Ready => "/readyz",
            Awaited::Alive => "/healthz",
        }
    }
}

/// Why [`Process::spawn`] has no ready process to give back.
#[derive(Debug)]
pub enum StartError {
    Spawn(std::io::Error),
    Exited(ExitStatus),
    NotReady(Duration),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StartError::Spawn(e) => write!(f, "cannot spawn: {e}"),
            StartError::Exited(status) => write!(f, "exited ({status})"),
            StartError::NotReady(after) => write!(f, "not answering 200 after {after:?}"),
        }
    }
}

impl Process {
    /// Starts `callbackd serve` on a free port with the test tokens, fast retries, private
    /// targets allowed, the given store and `extra` TOML appended (e.g. a source table).
    pub fn start(store_url: &str, extra: &str) -> Process {
        Process::start_with_env(store_url, extra, &[])
    }

    /// Like [`Process::start`], with `CALLBACKD__...` overrides of the template's keys, e.g.
    /// `("CALLBACKD__DISPATCH__LEASE_SECS", "600")`.
    pub fn start_with_env(store_url: &str, extra: &str, env: &[(&str, &str)]) -> Process {
        Process::try_start_with_env(store_url, extra, env, Duration::from_secs(15))
            .unwrap_or_else(|e| panic!("callbackd did not start: {e}"))
    }

    /// [`Process::start_with_env`], waiting only for it to serve ([`Awaited::Alive`]): a
    /// restart while the store is not whole. [`Process::is_ready`] says when it is.
    pub fn start_alive_with_env(store_url: &str, extra: &str, env: &[(&str, &str)]) -> Process {
        Process::try_start_awaiting(
            store_url,
            extra,
            env,
            Duration::from_secs(15),
            Awaited::Alive,
        )
        .unwrap_or_else(|e| panic!("callbackd did not start: {e}"))
    }

    /// [`Process::start_with_env`], waiting at most `timeout` for it to be ready, and saying
    /// why it is not rather than panicking.
    pub fn try_start_with_env(
        store_url: &str,
        extra: &str,
        env: &[(&str, &str)],
        timeout: Duration,
    ) -> Result<Process, StartError> {
        Process::try_start_awaiting(store_url, extra, env, timeout, Awaited::Ready)
    }

    fn try_start_awaiting(
        store_url: &str,
        extra: &str,
        env: &[(&str, &str)],
        timeout: Duration,
        awaited: Awaited,
    ) -> Result<Process, StartError> {
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            config.path(),
            format!(
                r#"
[store]
url = "{}"
[auth]
connector_tokens = ["{}"]
admin_tokens = ["{}"]
[dispatch]
allow_private_networks = true
initial_backoff_ms = 100
max_backoff_secs = 1
request_timeout_ms = 1000
lease_secs = 6
[server]
shutdown_grace_secs = 10
{extra}
"#,
                store_url,
                super::CONNECTOR_TOKEN,
                super::ADMIN_TOKEN
            ),
        )
        .unwrap();
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_callbackd"));
        cmd.arg("serve")
            .arg("--config")
            .arg(config.path())
            .env("CALLBACKD__SERVER__LISTEN", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut process = Process::spawn_awaiting(cmd, port, timeout, awaited)?;
        process._config = Some(config);
        Ok(process)
    }

    /// Spawns `cmd`, a `callbackd serve` the caller configured to listen on 127.0.0.1:`port`,
    /// and waits at most `timeout` for its `GET /readyz` to answer 200; a process that exits
    /// meanwhile is an error at once. For callers that need their own config file,
    /// environment or log (the load bench); tests use [`Process::start`].
    pub fn spawn(cmd: Command, port: u16, timeout: Duration) -> Result<Process, StartError> {
        Process::spawn_awaiting(cmd, port, timeout, Awaited::Ready)
    }

    fn spawn_awaiting(
        mut cmd: Command,
        port: u16,
        timeout: Duration,
        awaited: Awaited,
    ) -> Result<Process, StartError> {
        let child = cmd.spawn().map_err(StartError::Spawn)?;
        // Built before the wait, so a process that never listens is killed on the way out.
        let mut process = Process {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _config: None,
        };
        let deadline = std::time::Instant::now() + timeout;
        // An open port is not a ready process: the port is bound before the store is opened,
        // and a process whose store refuses it exits after taking connections.
        while !answers_200(port, awaited.path()) {
            if let Ok(Some(status)) = process.child.try_wait() {
                return Err(StartError::Exited(status));
            }
            if std::time::Instant::now() >= deadline {
                return Err(StartError::NotReady(timeout));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(process)
    }

    /// Whether its `GET /readyz` answers 200 now.
    pub fn is_ready(&self) -> bool {
        let port = self.url.rsplit(':').next().and_then(|p| p.parse().ok());
        port.is_some_and(|port| answers_200(port, Awaited::Ready.path()))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then SIGKILL if the process is still running after `grace`. Blocks the
    /// thread while it waits.
    pub fn stop(&mut self, grace: Duration) {
        // Once reaped, its pid may already belong to someone else.
        if !matches!(self.child.try_wait(), Ok(None)) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit, at most `secs`; panics if it does not.
    pub async fn exit_status(&mut self, secs: u64) -> std::process::ExitStatus {
        let deadline = std::time::Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for callbackd") {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "callbackd did not exit within {secs} s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Whether `GET <path>` on 127.0.0.1:`port` answers 200. Plain HTTP/1.1 on a socket, since
/// the wait blocks its thread (the load bench runs it on the blocking pool). A process still
/// starting holds the connection unanswered; the read gives up after a second so the caller
/// can look at the process again, and a process that exits closes it at once.
fn answers_200(port: u16, path: &str) -> bool {
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&address, Duration::from_secs(1)) else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    let mut status_line = [0u8; 12];
    stream
        .set_read_timeout(Some(Duration::from_secs(1)))
        .is_ok()
        && stream.write_all(request.as_bytes()).is_ok()
        && stream.read_exact(&mut status_line).is_ok()
        && &status_line == b"HTTP/1.1 200"
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
