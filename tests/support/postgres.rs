//! A private PostgreSQL server per test: `initdb` into a temp dir, a free port on 127.0.0.1,
//! durable settings (`fsync`, `synchronous_commit`, `full_page_writes` on), so a test can
//! kill, restart or fail it over without touching anyone else's data. The machine's shared
//! server on 5432 is never used: a test must be free to kill its own.
//!
//! `initdb` refuses to run as root, and the tests run as root, so every server program
//! (`initdb`, `pg_ctl`, `postgres`, `pg_basebackup`) runs as the `postgres` user
//! (`runuser -u postgres --`) on a temp dir handed to it (`chown`). The binaries are the ones
//! `pg_config --bindir` names (Debian: /usr/lib/postgresql/15/bin). Trust authentication on
//! loopback only: the tests connect as `postgres` without a password.
//!
//! A server is started with `pg_ctl start -w`, so the postmaster is not a child of the test;
//! its pid is read from `postmaster.pid`. Dropping the server stops it (`-m immediate`) and
//! removes its directory.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The user every server program runs as.
const SERVER_USER: &str = "postgres";

/// How long a start, a crash recovery or a promotion may take on a busy 2-core machine.
const READY_WITHIN: Duration = Duration::from_secs(60);

pub struct PostgresServer {
    pub port: u16,
    /// Holds `data/` (the cluster), `server.log` and the unix socket; owned by
    /// [`SERVER_USER`].
    dir: tempfile::TempDir,
    /// The postmaster's pid while running, from `postmaster.pid`.
    postmaster: Option<u32>,
}

impl PostgresServer {
    /// A fresh cluster with the durable settings, started.
    pub fn start() -> PostgresServer {
        Self::start_with(&[])
    }

    /// A fresh cluster with `settings` (`("fsync", "off")`, ...) written after the durable
    /// ones in `postgresql.conf`, so they win and last across restarts.
    pub fn start_with(settings: &[(&str, &str)]) -> PostgresServer {
        Self::try_start_with(settings).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Like [`PostgresServer::start_with`], but a server that cannot start is an error rather
    /// than a panic (a bench reports it and exits).
    pub fn try_start_with(settings: &[(&str, &str)]) -> Result<PostgresServer, String> {
        let server = PostgresServer::prepared(free_port())?;
        run_as_server_user(
            "initdb",
            &[
                "--pgdata",
                &server.data_dir().display().to_string(),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-instructions",
            ],
        )?;
        let mut conf = server.own_settings();
        conf.push_str(
            "fsync = on\n\
             synchronous_commit = on\n\
             full_page_writes = on\n\
             wal_level = replica\n\
             max_wal_senders = 10\n\
             hot_standby = on\n",
        );
        for (name, value) in settings {
            conf.push_str(&format!("{name} = '{}'\n", value.replace('\'', "''")));
        }
        server.append_conf(&conf)?;
        let mut server = server;
        server.try_start_again()?;
        Ok(server)
    }

    /// One server for a whole test binary, started on first use, for tests that need a
    /// database of their own but not a server ([`PostgresServer::fresh_database`]). A static's
    /// `Drop` never runs, so a watchdog stops the server and removes its dir once the test
    /// process is gone, however it ended.
    pub fn shared() -> &'static PostgresServer {
        static SHARED: OnceLock<PostgresServer> = OnceLock::new();
        SHARED.get_or_init(|| {
            let server = PostgresServer::start();
            server.watch();
            server
        })
    }

    /// Creates an empty database of a name no other call of this process takes, and returns
    /// its URL.
    pub fn fresh_database(&self) -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let db = format!(
            "cb_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        self.create_database(&db);
        self.url_db(&db)
    }

    /// Polls once a second: the server, and its dir, go at most a second after the test
    /// process. The loop runs in the background of a shell that exits at once, so it is no
    /// child of the test left unwaited.
    fn watch(&self) {
        let pg_ctl = binary("pg_ctl").unwrap_or_else(|e| panic!("{e}"));
        let watchdog = format!(
            "(while kill -0 {test} 2>/dev/null; do sleep 1; done\n\
              runuser -u {SERVER_USER} -- '{pg_ctl}' stop --pgdata '{data}' --mode immediate\n\
              rm -rf '{dir}') >/dev/null 2>&1 &",
            test = std::process::id(),
            pg_ctl = pg_ctl.display(),
            data = self.data_dir().display(),
            dir = self.dir.path().display()
        );
        let started = Command::new("sh")
            .arg("-c")
            .arg(watchdog)
            .current_dir("/")
            .stdin(Stdio::null())
            .status()
            .expect("sh for the watchdog");
        assert!(started.success(), "the watchdog did not start: {started}");
    }

    /// A streaming standby of `primary`, taken with `pg_basebackup -R` (it connects to the
    /// primary by itself and replays its WAL), and made the primary's synchronous standby
    /// (`synchronous_standby_names = '*'`): from the return on, a commit on the primary is
    /// acknowledged only once this standby has flushed it.
    pub fn standby_of(primary: &PostgresServer) -> PostgresServer {
        Self::try_standby_of(primary).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_standby_of(primary: &PostgresServer) -> Result<PostgresServer, String> {
        let mut standby = PostgresServer::prepared(free_port())?;
        run_as_server_user(
            "pg_basebackup",
            &[
                "--pgdata",
                &standby.data_dir().display().to_string(),
                "--host",
                "127.0.0.1",
                "--port",
                &primary.port.to_string(),
                "--username",
                "postgres",
                "--write-recovery-conf",
                "--wal-method",
                "stream",
                "--checkpoint",
                "fast",
                "--no-password",
            ],
        )?;
        // The copied configuration names the primary's port and socket dir; later lines win.
        standby.append_conf(&standby.own_settings())?;
        standby.try_start_again()?;
        // Synchronous only once the standby streams: set earlier, every commit on the primary
        // would wait for a standby that is still starting.
        primary.wait_until(
            "the standby streams from the primary",
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
            "1",
        )?;
        primary.try_psql("ALTER SYSTEM SET synchronous_standby_names = '*'")?;
        primary.try_psql("SELECT pg_reload_conf()")?;
        primary.wait_until(
            "the standby becomes synchronous",
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            "1",
        )?;
        Ok(standby)
    }

    /// Promotes this standby to a primary (`pg_ctl promote`) and waits until it takes writes.
    pub fn promote(&self) {
        run_as_server_user(
            "pg_ctl",
            &[
                "promote",
                "--pgdata",
                &self.data_dir().display().to_string(),
                "--wait",
                "--timeout",
                &READY_WITHIN.as_secs().to_string(),
            ],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        self.wait_until(
            "the promoted standby leaves recovery",
            "SELECT pg_is_in_recovery()",
            "f",
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.url_db("postgres")
    }

    /// The URL of database `db` on this server (see [`PostgresServer::create_database`]).
    pub fn url_db(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates an empty database `db`, so that tests can share one server.
    pub fn create_database(&self, db: &str) {
        self.psql(&format!("CREATE DATABASE \"{db}\""));
    }

    /// Writes `contents` into the server's dir as `name`, owned by the server user and
    /// readable by it alone (as PostgreSQL wants a private key), and returns its path: for
    /// `ssl_cert_file` and the like.
    pub fn install_file(&self, name: &str, contents: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents).expect("writes into the server's dir");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
        chown_to_server_user(&path).unwrap_or_else(|e| panic!("{e}"));
        path
    }

    /// Puts `rules` before the `pg_hba.conf` rules initdb wrote (the first that matches a
    /// connection decides) and reloads the server.
    pub fn prepend_hba(&self, rules: &str) {
        let path = self.data_dir().join("pg_hba.conf");
        let written = std::fs::read_to_string(&path).expect("reads pg_hba.conf");
        std::fs::write(&path, format!("{rules}\n{written}")).expect("writes pg_hba.conf");
        self.reload();
    }

    /// `ALTER SYSTEM SET` each of `settings` (they last across restarts) and reloads; for the
    /// settings a reload applies (`ssl`, `synchronous_standby_names`, ...).
    pub fn reload_with(&self, settings: &[(&str, &str)]) {
        for (name, value) in settings {
            self.psql(&format!(
                "ALTER SYSTEM SET {name} = '{}'",
                value.replace('\'', "''")
            ));
        }
        self.reload();
    }

    /// Reloads the configuration and waits until new sessions have it: the postmaster
    /// rereads its files after the signal, and each new session inherits its load time.
    fn reload(&self) {
        let before = self.psql("SELECT pg_conf_load_time()");
        self.psql("SELECT pg_reload_conf()");
        let deadline = Instant::now() + READY_WITHIN;
        while self.psql("SELECT pg_conf_load_time()") == before {
            assert!(Instant::now() < deadline, "port {}: no reload", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The postmaster's pid (for its CPU time in /proc, or a signal).
    pub fn pid(&self) -> u32 {
        self.postmaster.expect("the server is running")
    }

    pub fn is_running(&self) -> bool {
        self.postmaster.is_some()
    }

    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// SIGKILL to the postmaster and every process it started, at once: what a crashed
    /// machine or container leaves is what reached the disk. (A postmaster killed alone leaves
    /// backends that hold its shared memory, and no new postmaster starts until they exit.)
    pub fn kill9(&mut self) {
        let Some(pid) = self.postmaster.take() else {
            return;
        };
        let mut pids = children_of(pid);
        pids.insert(0, pid);
        for pid in &pids {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        wait_for(&format!("the postmaster {pid} to die"), || {
            pids.iter().all(|pid| !alive(*pid))
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// SIGSTOP to the postmaster and every process it started: the server neither answers
    /// nor closes a connection, as a machine that hangs. A standby paused so stops
    /// acknowledging its primary's WAL. [`PostgresServer::resume`] undoes it; a server is
    /// resumed before it is dropped.
    pub fn pause(&self) {
        self.signal_all("STOP");
    }

    /// SIGCONT to the postmaster and every process it started.
    pub fn resume(&self) {
        self.signal_all("CONT");
    }

    /// The postmaster first, so it starts no new backend meanwhile; a backend may have
    /// exited since it was listed.
    fn signal_all(&self, signal: &str) {
        let postmaster = self.pid();
        let send = |pid: u32| {
            Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(pid.to_string())
                .status()
                .is_ok_and(|s| s.success())
        };
        assert!(
            send(postmaster),
            "kill -{signal} {postmaster} (port {})",
            self.port
        );
        for pid in children_of(postmaster) {
            send(pid);
        }
    }

    /// `pg_ctl stop -m immediate`: the postmaster tells every backend to quit at once, with no
    /// checkpoint, so the next start runs crash recovery, as after [`PostgresServer::kill9`].
    pub fn stop_immediate(&mut self) {
        if self.postmaster.is_none() {
            return;
        }
        match self.pg_ctl_stop("immediate") {
            Ok(()) => self.postmaster = None,
            Err(e) => {
                eprintln!("{e}; killing it instead");
                self.kill9();
            }
        }
    }

    /// Starts a stopped server again on the same data dir and port, and waits until it takes
    /// connections (crash recovery included).
    pub fn start_again(&mut self) {
        self.try_start_again().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Runs `sql` with psql as `postgres` on database `postgres`; its unaligned output.
    pub fn psql(&self, sql: &str) -> String {
        self.try_psql(sql).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`PostgresServer::psql`] on database `db`.
    pub fn psql_db(&self, db: &str, sql: &str) -> String {
        self.try_psql_db(db, sql).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs `sql` the server may refuse: its output, or what failed.
    pub fn try_psql(&self, sql: &str) -> Result<String, String> {
        self.try_psql_db("postgres", sql)
    }

    pub fn try_psql_db(&self, db: &str, sql: &str) -> Result<String, String> {
        let out = Command::new(binary("psql")?)
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--username", "postgres", "--dbname", db])
            .args(["--no-psqlrc", "--no-align", "--tuples-only", "--quiet"])
            .args(["--set", "ON_ERROR_STOP=1", "--command", sql])
            .env("PGCONNECT_TIMEOUT", "5")
            .output()
            .map_err(|e| format!("cannot run psql: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "psql -p {} -c {sql:?} failed ({}): {}",
                self.port,
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The end of the server's log, for a failure message.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// A temp dir for a new server, owned by [`SERVER_USER`], with no cluster in it yet.
    fn prepared(port: u16) -> Result<PostgresServer, String> {
        let dir = tempfile::Builder::new()
            .prefix("pg-test-")
            .tempdir()
            .map_err(|e| format!("temp dir for postgres: {e}"))?;
        chown_to_server_user(dir.path())?;
        Ok(PostgresServer {
            port,
            dir,
            postmaster: None,
        })
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// What is this server's own and not copied to a standby: where it listens.
    fn own_settings(&self) -> String {
        format!(
            "\n# tests/support/postgres.rs\n\
             listen_addresses = '127.0.0.1'\n\
             port = {}\n\
             unix_socket_directories = '{}'\n",
            self.port,
            self.dir.path().display()
        )
    }

    fn append_conf(&self, lines: &str) -> Result<(), String> {
        use std::io::Write;
        let path = self.data_dir().join("postgresql.conf");
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(lines.as_bytes()))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    fn try_start_again(&mut self) -> Result<(), String> {
        assert!(self.postmaster.is_none(), "already running");
        let log = self.dir.path().join("server.log");
        run_as_server_user(
            "pg_ctl",
            &[
                "start",
                "--pgdata",
                &self.data_dir().display().to_string(),
                "--log",
                &log.display().to_string(),
                "--wait",
                "--timeout",
                &READY_WITHIN.as_secs().to_string(),
            ],
        )
        .map_err(|e| format!("{e}\n{}", self.log_tail()))?;
        let pid_file = self.data_dir().join("postmaster.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|text| text.lines().next()?.trim().parse().ok())
            .ok_or_else(|| format!("no pid in {}", pid_file.display()))?;
        self.postmaster = Some(pid);
        // `pg_ctl -w` waits for connections; a query proves the server answers them.
        self.wait_until("the server answers", "SELECT 1", "1")
    }

    fn pg_ctl_stop(&self, mode: &str) -> Result<(), String> {
        run_as_server_user(
            "pg_ctl",
            &[
                "stop",
                "--pgdata",
                &self.data_dir().display().to_string(),
                "--mode",
                mode,
                "--wait",
                "--timeout",
                &READY_WITHIN.as_secs().to_string(),
            ],
        )
        .map(|_| ())
    }

    /// Polls `sql` until it prints `expected`.
    fn wait_until(&self, what: &str, sql: &str, expected: &str) -> Result<(), String> {
        let mut last = String::new();
        let deadline = Instant::now() + READY_WITHIN;
        while Instant::now() < deadline {
            match self.try_psql(sql) {
                Ok(out) if out == expected => return Ok(()),
                Ok(out) => last = out,
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "{what}: not within {READY_WITHIN:?} on port {} (last: {last})\n{}",
            self.port,
            self.log_tail()
        ))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if self.postmaster.is_some() && self.pg_ctl_stop("immediate").is_err() {
            self.kill9();
        }
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// A program of `pg_config --bindir`.
fn binary(name: &str) -> Result<PathBuf, String> {
    static BINDIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let bindir = BINDIR.get_or_init(|| {
        let out = Command::new("pg_config")
            .arg("--bindir")
            .output()
            .map_err(|e| {
                format!(
                    "cannot run pg_config ({e}): the tests need PostgreSQL's server binaries \
                 (Debian: apt-get install postgresql)"
                )
            })?;
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    });
    let path = bindir.clone()?.join(name);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: the tests need PostgreSQL's server binaries \
             (Debian: apt-get install postgresql)",
            path.display()
        ))
    }
}

/// Runs a server program as [`SERVER_USER`]; its output, or what failed with its stderr.
fn run_as_server_user(program: &str, args: &[&str]) -> Result<Output, String> {
    let path = binary(program)?;
    let out = Command::new("runuser")
        .args(["-u", SERVER_USER, "--"])
        .arg(&path)
        .args(args)
        // The server user cannot read the test's working directory.
        .current_dir("/")
        .output()
        .map_err(|e| format!("cannot run runuser -u {SERVER_USER} -- {program}: {e}"))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{program} {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn chown_to_server_user(path: &Path) -> Result<(), String> {
    let status = Command::new("chown")
        .arg(format!("{SERVER_USER}:{SERVER_USER}"))
        .arg(path)
        .status()
        .map_err(|e| format!("cannot run chown: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "chown {SERVER_USER} {} failed ({status}): is there a `{SERVER_USER}` user?",
            path.display()
        ))
    }
}

/// The pids whose parent is `parent`, from /proc.
fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // The command name, in parentheses, may hold spaces: fields follow its end.
                    let after_name = &stat[stat.rfind(')')? + 1..];
                    after_name.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

/// A process that still has a /proc entry. A killed postmaster lingers as a zombie until
/// init reaps it, and a new postmaster refuses the data dir while its old pid exists.
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn wait_for(what: &str, done: impl Fn() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + READY_WITHIN;
    while Instant::now() < deadline {
        if done() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("{what}: not within {READY_WITHIN:?}"))
}
