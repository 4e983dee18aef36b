//! A Redis Cluster on loopback: 3 masters and 3 replicas, each a private `redis-server
//! --cluster-enabled yes` ([`RedisServer`]: temp dir, AOF on), joined by `redis-cli --cluster
//! create`. Starting one takes a few seconds, so a test binary shares one
//! ([`RedisCluster::shared`]) and keeps its tests apart by key prefix
//! ([`RedisCluster::unique_prefix`]); a test that kills nodes starts its own.

use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{AclUser, RedisServer};

/// The cluster bus listens on port + 10000.
const BUS_OFFSET: u16 = 10_000;

/// How long a node may go unanswered before the others fail it over, for clusters no test
/// fails over on purpose: far above the tests' 2 s store timeouts and a busy 2-core machine's
/// stalls, so a slow node makes a store call time out (a 503 the test sees), never a failover
/// it did not ask for.
const NODE_TIMEOUT_MS: u64 = 15_000;

/// The node timeout of [`RedisCluster::start_for_failover`]: above callbackd's default 5 s
/// store timeout, so a store call that is merely slow ends before its master is given up, and
/// short enough for a failover test to see the replica take over within seconds.
const FAILOVER_NODE_TIMEOUT_MS: u64 = 6_000;

pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// A cluster of its own, stopped when dropped.
    pub fn start() -> RedisCluster {
        Self::start_with(Vec::new)
    }

    /// [`RedisCluster::start`] with settings of its own for each node (e.g. TLS on a port of
    /// its own, from [`cluster_port`]).
    pub fn start_with(node_args: impl Fn() -> Vec<String>) -> RedisCluster {
        Self::try_start(false, None, NODE_TIMEOUT_MS, node_args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A cluster of its own whose masters a test kills: it fails a master over after
    /// [`FAILOVER_NODE_TIMEOUT_MS`].
    pub fn start_for_failover() -> RedisCluster {
        Self::try_start(false, None, FAILOVER_NODE_TIMEOUT_MS, Vec::new)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`RedisCluster::start_with`] on nodes where only `user` may log in
    /// ([`AclUser::server_args`]): a client reaching any node without its password is
    /// refused.
    pub fn start_as(user: &AclUser, node_args: impl Fn() -> Vec<String>) -> RedisCluster {
        Self::try_start(false, Some(user), NODE_TIMEOUT_MS, node_args)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The cluster of this test binary, started by the first test that asks. Never dropped:
    /// its servers are watched, and go once the test process is gone.
    pub fn shared() -> &'static RedisCluster {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            Self::try_start(true, None, NODE_TIMEOUT_MS, Vec::new).unwrap_or_else(|e| panic!("{e}"))
        })
    }

    /// A key prefix no other test of this process uses.
    pub fn unique_prefix() -> String {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        format!("t{}", NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// A store on this cluster under a [`RedisCluster::unique_prefix`] of its own (returned
    /// with it), its leases timed by the caller's clock since the tests move a virtual one,
    /// and its layout stamped at `now`.
    pub async fn store_of_its_own(
        &self,
        retention_secs: u64,
        now: callbackd::clock::Millis,
    ) -> (callbackd::store::redis::RedisStore, String) {
        use callbackd::store::redis::{RedisOptions, RedisStore};
        let prefix = Self::unique_prefix();
        let options = RedisOptions {
            key_prefix: prefix.clone(),
            ..RedisOptions::default()
        };
        let store = RedisStore::connect_with(
            &self.url(),
            Duration::from_secs(2),
            retention_secs,
            &options,
        )
        .await
        .expect("connect to the cluster")
        .with_caller_clock_leases();
        store.upgrade(now).await.expect("stamp the layout version");
        (store, prefix)
    }

    fn try_start(
        watched: bool,
        user: Option<&AclUser>,
        node_timeout_ms: u64,
        node_args: impl Fn() -> Vec<String>,
    ) -> Result<RedisCluster, String> {
        let node_timeout = node_timeout_ms.to_string();
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let port = cluster_port();
            // Explicit, since the default follows the TLS port when there is one.
            let bus = (port + BUS_OFFSET).to_string();
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-port",
                &bus,
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                &node_timeout,
                "--repl-diskless-sync-delay",
                "0",
            ];
            let own = node_args();
            args.extend(own.iter().map(String::as_str));
            let acl = user.map(AclUser::server_args).unwrap_or_default();
            args.extend(acl.iter().map(String::as_str));
            nodes.push(RedisServer::try_start_on(
                port,
                "always",
                &args,
                watched,
                user.cloned(),
            )?);
        }
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut create = Command::new("redis-cli")
            .args(user.into_iter().flat_map(AclUser::cli_args))
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        // It waits for the nodes to meet, forever if they cannot.
        let deadline = Instant::now() + Duration::from_secs(30);
        while create.try_wait().map_err(|e| e.to_string())?.is_none() {
            if Instant::now() > deadline {
                let _ = create.kill();
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let out = create.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        let cluster = RedisCluster { nodes };
        cluster.wait_until_ok();
        Ok(cluster)
    }

    /// Waits until every running node sees the cluster as `ok` with every slot served, and
    /// every master's replica acknowledges its writes.
    pub fn wait_until_ok(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if self.running().all(sees_every_slot_served) {
                break;
            }
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(100));
        }
        for master in self.masters() {
            let probe = master.owned_key("cb-test-probe");
            master.wait_for_replicas_on(1, &probe);
        }
    }

    /// The URL of a running node: callbackd finds the others from it.
    pub fn url(&self) -> String {
        self.running().next().expect("a running node").url()
    }

    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    fn running(&self) -> impl Iterator<Item = &RedisServer> {
        self.nodes.iter().filter(|n| n.is_running())
    }

    /// The running masters.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.running()
            .filter(|n| n.cli(&["ROLE"]).lines().next() == Some("master"))
            .collect()
    }

    /// The master serving `slot`, as the cluster sees it now.
    pub fn master_of_slot(&self, slot: u16) -> &RedisServer {
        let nodes = self
            .running()
            .next()
            .expect("a running node")
            .cli(&["CLUSTER", "NODES"]);
        let port = nodes
            .lines()
            .find_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let flags = fields.get(2)?;
                if !flags.contains("master") || flags.contains("fail") {
                    return None;
                }
                let serves = fields.iter().skip(8).any(|range| {
                    let (from, to) = range.split_once('-').unwrap_or((range, range));
                    match (from.parse::<u16>(), to.parse::<u16>()) {
                        (Ok(from), Ok(to)) => (from..=to).contains(&slot),
                        _ => false,
                    }
                });
                let address = fields.get(1)?.split('@').next()?;
                serves.then(|| address.rsplit_once(':')?.1.parse::<u16>().ok())?
            })
            .unwrap_or_else(|| panic!("no master serves slot {slot}:\n{nodes}"));
        self.node(port)
    }

    /// The master serving `key`.
    pub fn master_of_key(&self, key: &str) -> &RedisServer {
        self.master_of_slot(slot_of(self.running().next().expect("a running node"), key))
    }

    fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// The running replica of the master on `port`.
    pub fn replica_of(&self, port: u16) -> &RedisServer {
        self.running()
            .find(|n| {
                let role = n.cli(&["ROLE"]);
                let mut lines = role.lines();
                lines.next() == Some("slave") && lines.nth(1) == Some(&port.to_string())
            })
            .unwrap_or_else(|| panic!("no replica of the master on port {port}"))
    }

    /// SIGKILL to the node on `port`.
    pub fn kill(&mut self, port: u16) {
        self.node_mut(port).stop(true);
    }

    /// Starts the node on `port` again with its data and `nodes.conf`: it rejoins the cluster,
    /// as a replica if its master role was handed over meanwhile.
    pub fn restart(&mut self, port: u16) {
        self.node_mut(port).start_again();
    }

    /// Whether a running node sees every slot served again, e.g. once a replica has taken over
    /// from a killed master.
    pub fn serves_every_slot(&self) -> bool {
        self.running().next().is_some_and(sees_every_slot_served)
    }

    fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// How many keys match `pattern` on all masters together (`SCAN MATCH`, since a shared
    /// cluster holds other tests' keys too).
    pub fn count_keys(&self, pattern: &str) -> u64 {
        self.masters()
            .iter()
            .map(|m| m.cli(&["--scan", "--pattern", pattern]).lines().count() as u64)
            .sum()
    }
}

impl RedisServer {
    /// A key starting with `stem` whose slot this cluster node serves, so a plain client's
    /// command on it is not redirected.
    pub fn owned_key(&self, stem: &str) -> String {
        let nodes = self.cli(&["CLUSTER", "NODES"]);
        let ranges: Vec<(u16, u16)> = nodes
            .lines()
            .find(|line| line.contains("myself"))
            .map(|line| {
                line.split_whitespace()
                    .skip(8)
                    .filter_map(|range| {
                        let (from, to) = range.split_once('-').unwrap_or((range, range));
                        Some((from.parse().ok()?, to.parse().ok()?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        (0..)
            .map(|i| format!("{stem}-{i}"))
            .find(|key| {
                let slot = slot_of(self, key);
                ranges
                    .iter()
                    .any(|(from, to)| (*from..=*to).contains(&slot))
            })
            .expect("a key in this node's slots")
    }
}

/// Whether `node` sees the cluster as `ok` with all 16384 slots served.
fn sees_every_slot_served(node: &RedisServer) -> bool {
    let info = node.cli(&["CLUSTER", "INFO"]);
    info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
}

/// `CLUSTER KEYSLOT` of `key`, asked of `node`.
fn slot_of(node: &RedisServer, key: &str) -> u16 {
    node.cli(&["CLUSTER", "KEYSLOT", key])
        .parse()
        .expect("CLUSTER KEYSLOT answers a number")
}

/// A free port below 65536 - 10000 whose bus port is free too.
pub fn cluster_port() -> u16 {
    loop {
        let port = super::free_port();
        if port <= u16::MAX - BUS_OFFSET
            && std::net::TcpListener::bind(("127.0.0.1", port + BUS_OFFSET)).is_ok()
        {
            return port;
        }
    }
}
