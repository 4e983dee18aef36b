//! Real `callbackd serve` processes for crash, scale-out and shutdown tests.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::redis::free_port;

pub struct Process {
    pub child: Child,
    pub url: String,
    _config: tempfile::NamedTempFile,
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
        let child = cmd.spawn().expect("spawn callbackd");
        let url = format!("http://127.0.0.1:{port}");
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "callbackd did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Process {
            child,
            url,
            _config: config,
        }
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

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
