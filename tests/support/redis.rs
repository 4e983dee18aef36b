//! A private `redis-server` per test: free port, temp dir, AOF on, so a test can restart or
//! kill it without touching anyone else's data. `cluster.rs` builds a Redis Cluster of them.

#[path = "cluster.rs"]
pub mod cluster;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
    appendfsync: &'static str,
    extra_args: Vec<String>,
    /// Run under a watchdog that kills the server once the test process is gone, for servers
    /// a whole test binary shares (a static's Drop never runs).
    watched: bool,
    /// The `redis-server` process (under the watchdog's shell when watched).
    server_pid: u32,
    /// The ACL user the test's own redis-cli calls log in as, on a server whose `default`
    /// user is off.
    user: Option<AclUser>,
}

/// An ACL user and its password.
#[derive(Clone)]
pub struct AclUser {
    pub name: String,
    pub password: String,
}

impl AclUser {
    /// redis-cli's arguments to log in as this user.
    pub fn cli_args(&self) -> [&str; 5] {
        [
            "--user",
            &self.name,
            "--pass",
            &self.password,
            "--no-auth-warning",
        ]
    }

    /// redis-server's arguments that create this user, allowed everything, turn the
    /// passwordless `default` user off (a client that does not log in is refused), and have
    /// a replica log in to its master as this user.
    pub fn server_args(&self) -> Vec<String> {
        let password = format!(">{}", self.password);
        [
            "--user",
            "default",
            "off",
            "--user",
            &self.name,
            "on",
            &password,
            "~*",
            "&*",
            "+@all",
            "--masteruser",
            &self.name,
            "--masterauth",
            &self.password,
        ]
        .map(str::to_string)
        .to_vec()
    }
}

impl RedisServer {
    /// Starts a server with `appendonly yes` and `appendfsync always`.
    pub fn start() -> RedisServer {
        Self::start_with("always")
    }

    pub fn start_with(appendfsync: &'static str) -> RedisServer {
        Self::start_with_args(appendfsync, &[])
    }

    /// Starts a server with extra command-line settings, e.g. `["--appendonly", "no"]`
    /// (later arguments win).
    pub fn start_with_args(appendfsync: &'static str, extra_args: &[&str]) -> RedisServer {
        Self::try_start_with_args(appendfsync, extra_args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`RedisServer::start_with_args`], but a server that cannot start is an error
    /// rather than a panic (the load bench reports it and exits).
    pub fn try_start_with_args(
        appendfsync: &'static str,
        extra_args: &[&str],
    ) -> Result<RedisServer, String> {
        Self::try_start_on(free_port(), appendfsync, extra_args, false, None)
    }

    /// Starts a server on `port`; `watched`: see [`RedisServer::watched`]. With `user`, the
    /// caller's `extra_args` create that user and turn `default` off, and this helper's own
    /// redis-cli calls log in as it.
    pub fn try_start_on(
        port: u16,
        appendfsync: &'static str,
        extra_args: &[&str],
        watched: bool,
        user: Option<AclUser>,
    ) -> Result<RedisServer, String> {
        let dir = tempfile::tempdir().map_err(|e| format!("temp dir for redis: {e}"))?;
        let mut server = RedisServer {
            port,
            dir,
            child: None,
            appendfsync,
            extra_args: extra_args.iter().map(|a| a.to_string()).collect(),
            watched,
            server_pid: 0,
            user,
        };
        server.try_spawn()?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        self.url_db(0)
    }

    /// The URL of logical database `db` (e.g. two stores side by side in one server).
    pub fn url_db(&self, db: u8) -> String {
        format!("redis://127.0.0.1:{}/{db}", self.port)
    }

    /// The server's process id (for its CPU time in /proc).
    pub fn pid(&self) -> u32 {
        assert!(self.child.is_some(), "redis is running");
        self.server_pid
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let mut command = if self.watched {
            // Polls once a second: the server, and the temp dir, go at most a second after the
            // test process, however it ended.
            let watchdog = format!(
                "redis-server \"$@\" & r=$!\n\
                 while kill -0 $r 2>/dev/null; do\n\
                   kill -0 {test} 2>/dev/null || {{ kill -9 $r; wait $r; rm -rf '{dir}'; exit; }}\n\
                   sleep 1\n\
                 done",
                test = std::process::id(),
                dir = self.dir.path().display()
            );
            let mut sh = Command::new("sh");
            sh.arg("-c").arg(watchdog).arg("redis-watchdog");
            sh
        } else {
            Command::new("redis-server")
        };
        let child = command
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--appendonly")
            .arg("yes")
            .arg("--appendfsync")
            .arg(self.appendfsync)
            .arg("--save")
            .arg("")
            .args(&self.extra_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start `redis-server` ({e}): the tests need Redis 7 on PATH \
                     (Debian: apt-get install redis-server)"
                )
            })?;
        self.server_pid = child.id();
        self.child = Some(child);
        wait_for_port(self.port, true, self.user.as_ref())?;
        if self.watched {
            self.server_pid = self
                .cli(&["INFO", "server"])
                .lines()
                .find_map(|line| line.trim().strip_prefix("process_id:")?.parse().ok())
                .ok_or_else(|| format!("redis on port {} did not name its process", self.port))?;
        }
        Ok(())
    }

    /// Stops the server (SIGKILL when `kill`, else a clean shutdown that finishes the AOF).
    pub fn stop(&mut self, kill: bool) {
        if let Some(mut child) = self.child.take() {
            if kill && self.watched {
                let _ = Command::new("kill")
                    .args(["-9", &self.server_pid.to_string()])
                    .status();
            } else if kill {
                let _ = child.kill();
            } else {
                let _ = redis_cli(self.port, self.user.as_ref())
                    .arg("shutdown")
                    .output();
            }
            let _ = child.wait();
            wait_for_port(self.port, false, None).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGSTOP: the server keeps its connections but answers nothing (a hung Redis).
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// SIGCONT after [`RedisServer::pause`]: it goes on with what is in its socket buffers.
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("kill on PATH");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "already running");
        self.try_spawn().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits until `n` replicas acknowledge a write to this master. Connected, even "online",
    /// is not enough: after a diskless sync the master streams writes to a replica only once
    /// its first ACK came in (up to a second later). The probe key is deleted again.
    pub fn wait_for_replicas(&self, n: usize) {
        self.wait_for_replicas_on(n, "cb-test-probe");
    }

    /// [`RedisServer::wait_for_replicas`] with the probe written to `probe` (on a cluster node,
    /// a key of its own slots).
    pub fn wait_for_replicas_on(&self, n: usize, probe: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let script = format!("SET {probe} 1\nWAIT {n} 1000\nDEL {probe}\n");
        while Instant::now() < deadline {
            let out = redis_cli(self.port, self.user.as_ref())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .and_then(|mut cli| {
                    use std::io::Write;
                    cli.stdin
                        .take()
                        .expect("a piped stdin")
                        .write_all(script.as_bytes())?;
                    cli.wait_with_output()
                })
                .expect("redis-cli on PATH");
            let replies = String::from_utf8_lossy(&out.stdout).to_string();
            if replies
                .lines()
                .nth(1)
                .and_then(|l| l.trim().parse::<usize>().ok())
                >= Some(n)
            {
                return;
            }
        }
        panic!(
            "{n} replica(s) did not acknowledge a write to port {}",
            self.port
        );
    }

    /// Runs a redis-cli command against this server and returns its stdout. Panics when
    /// redis-cli fails (cannot connect, or the server answers an error: `-e`), so a check
    /// that something is absent cannot pass on the empty output of a failed command.
    pub fn cli(&self, args: &[&str]) -> String {
        self.try_cli(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs a redis-cli command the server must refuse, and returns its error. Panics when
    /// the command succeeds.
    pub fn cli_error(&self, args: &[&str]) -> String {
        match self.try_cli(args) {
            Ok(out) => panic!(
                "redis-cli -p {} {} succeeded: {out}",
                self.port,
                args.join(" ")
            ),
            Err(e) => e,
        }
    }

    /// Runs a redis-cli command: its stdout, or what failed (redis-cli's exit status and the
    /// server's error).
    pub fn try_cli(&self, args: &[&str]) -> Result<String, String> {
        let out = redis_cli(self.port, self.user.as_ref())
            .arg("-e")
            .args(args)
            .output()
            .expect("redis-cli on PATH");
        if !out.status.success() {
            return Err(format!(
                "redis-cli -p {} {} failed ({}): {}{}",
                self.port,
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop(true);
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// redis-cli for the server on `port`, logged in as `user` if any.
fn redis_cli(port: u16, user: Option<&AclUser>) -> Command {
    let mut cli = Command::new("redis-cli");
    cli.args(["-p", &port.to_string()]);
    if let Some(user) = user {
        cli.args(user.cli_args());
    }
    cli
}

fn wait_for_port(port: u16, up: bool, user: Option<&AclUser>) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let open = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if open == up {
            if up {
                // Accepting connections is not yet loading the AOF: wait for PING.
                let ping = redis_cli(port, user).arg("ping").output();
                if ping.map(|o| o.stdout.starts_with(b"PONG")).unwrap_or(false) {
                    return Ok(());
                }
            } else {
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!(
        "redis on port {port} did not become {}",
        if up { "ready" } else { "stopped" }
    ))
}
