//! The way to Redis: one server, or a Redis Cluster, behind one `query`.
//!
//! `store.url` names one server or any node of a cluster; which it is, that node says
//! (`INFO cluster`, `cluster_enabled:1`), so no second setting is needed. On a cluster the
//! redis crate's cluster client takes over: it learns the other nodes from the first, sends
//! each command to the master of its key's slot, and follows MOVED and ASK. The URL's
//! password or ACL user, and the TLS certificates, apply to every node.
//!
//! Two things a single server does not ask for:
//!
//! - **One slot per pipeline.** The cluster client refuses a pipeline whose keys span slots,
//!   and every partition is a slot of its own: what spans partitions is sent as one pipeline
//!   per partition, a bounded number in flight ([`RedisStore::per_partition`]). On one server
//!   the same pipelines go out as one, in one round trip, as they always did: splitting them
//!   would only add work to the client, and callers cannot tell the difference.
//! - **Commands about the server** (`CONFIG GET`, `INFO`, `SCAN`, `SCRIPT LOAD`) go to every
//!   primary ([`Connection::on_every_primary`], [`Connection::query_at`]): each master has
//!   its own settings, replicas, keys and script cache.
//!
//! Keyless commands inside a pipeline (`WAIT`, `TIME`, `MULTI`/`EXEC`) follow the pipeline's
//! keyed commands to their master, so a `WAIT` always waits for the write it follows.

use std::time::Duration;

use futures_util::{StreamExt, stream};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo, SingleNodeRoutingInfo,
};
use redis::{Cmd, FromRedisValue, IntoConnectionInfo, Pipeline, RedisResult, Value};

use super::replaceable::{Replaceable, broken_cluster_connection, broken_server_connection};
use super::{RedisStore, RedisTls, decode, unavailable};
use crate::redact::url_credentials;
use crate::store::StoreError;

/// How many per-partition pipelines a cluster fan-out keeps in flight: enough for every master
/// of a large cluster to work at once, few enough not to flood the client's queues.
const FAN_OUT: usize = 32;

/// An open connection to one server or to a cluster. Clones share the connection.
#[derive(Clone)]
pub(super) enum Connection {
    /// One server (with whatever replicas it has): a reconnecting manager, so a Redis restart
    /// costs the requests in flight at that moment (503, the sender retries), not the process;
    /// replaced when it goes silent or is left with a cut reply.
    Single(Replaceable<ConnectionManager>),
    /// A Redis Cluster: connections to every master, refreshed as slots move; replaced when
    /// one goes silent.
    Cluster(Replaceable<ClusterConnection>),
}

/// TCP settings of every store connection: keepalive probes after 10 s idle, every 5 s, and
/// `TCP_USER_TIMEOUT` so that unacknowledged writes fail within `timeout` (at least 10 s),
/// instead of the kernel's 15 minutes of retransmissions.
fn tcp_settings(timeout: Duration) -> redis::io::tcp::TcpSettings {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(10))
        .with_interval(Duration::from_secs(5))
        .with_retries(3);
    redis::io::tcp::TcpSettings::default()
        .set_keepalive(keepalive)
        .set_user_timeout(timeout.max(Duration::from_secs(10)))
}

fn certificates(tls: &RedisTls) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: tls.client.as_ref().map(|c| redis::ClientTlsConfig {
            client_cert: c.cert_pem.clone(),
            client_key: c.key_pem.clone(),
        }),
        root_cert: Some(tls.ca_pem.clone()),
    }
}

/// A client of the one server at `url`, with the store's TCP settings and certificates.
pub(super) fn client(
    url: &str,
    timeout: Duration,
    tls: Option<&RedisTls>,
) -> Result<redis::Client, StoreError> {
    let info = url
        .into_connection_info()
        .map_err(unavailable)?
        .set_tcp_settings(tcp_settings(timeout));
    match tls {
        None => redis::Client::open(info),
        Some(tls) => redis::Client::build_with_tls(info, certificates(tls)),
    }
    .map_err(unavailable)
}

/// A client of the cluster `url` is a node of, with the same settings, to build.
pub(super) fn cluster_client(
    url: &str,
    timeout: Duration,
    tls: Option<&RedisTls>,
) -> ClusterClientBuilder {
    let builder = ClusterClientBuilder::new([url])
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .tcp_settings(tcp_settings(timeout));
    match tls {
        None => builder,
        Some(tls) => builder.certs(certificates(tls)),
    }
}

/// One primary of the store: the server itself, or a master of the cluster by address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Primary {
    Only,
    At { host: String, port: u16 },
}

impl Primary {
    /// `None` for a single server, whose messages need no node name.
    pub(super) fn name(&self) -> Option<String> {
        match self {
            Primary::Only => None,
            Primary::At { host, port } => Some(format!("{host}:{port}")),
        }
    }

    /// A master named `host:port` as the cluster client names it.
    fn parse(address: &str) -> Option<Primary> {
        let (host, port) = address.rsplit_once(':')?;
        Some(Primary::At {
            host: host.to_string(),
            port: port.parse().ok()?,
        })
    }
}

/// What one round trip sends: a command, or a pipeline of them.
#[derive(Clone, Copy)]
pub(super) enum Request<'r> {
    One(&'r Cmd),
    Pipeline(&'r Pipeline),
}

impl<'r> From<&'r Cmd> for Request<'r> {
    fn from(cmd: &'r Cmd) -> Request<'r> {
        Request::One(cmd)
    }
}

impl<'r> From<&'r Pipeline> for Request<'r> {
    fn from(pipe: &'r Pipeline) -> Request<'r> {
        Request::Pipeline(pipe)
    }
}

impl Connection {
    /// Connects to the server at `url`, or to the cluster it is a node of.
    pub(super) async fn open(
        url: &str,
        timeout: Duration,
        tls: Option<&RedisTls>,
    ) -> Result<Connection, StoreError> {
        let client = client(url, timeout, tls)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let no_answer = || {
            StoreError::Unreachable(format!(
                "no answer from {} within {timeout:?}",
                url_credentials(url)
            ))
        };
        let mut single = tokio::time::timeout(
            timeout,
            ConnectionManager::new_with_config(client.clone(), config.clone()),
        )
        .await
        .map_err(|_| no_answer())?
        .map_err(not_connected)?;
        if !is_cluster_node(&mut single).await? {
            let open = move || ConnectionManager::new_with_config(client.clone(), config.clone());
            return Ok(Connection::Single(Replaceable::new(
                single,
                "Redis",
                timeout,
                broken_server_connection,
                open,
            )));
        }
        let cluster = cluster_client(url, timeout, tls)
            .build()
            .map_err(unavailable)?;
        let conn = tokio::time::timeout(timeout, cluster.get_async_connection())
            .await
            .map_err(|_| no_answer())?
            .map_err(not_connected)?;
        let open = move || {
            let cluster = cluster.clone();
            async move { cluster.get_async_connection().await }
        };
        Ok(Connection::Cluster(Replaceable::new(
            conn,
            "Redis Cluster",
            timeout,
            broken_cluster_connection,
            open,
        )))
    }

    /// Sends one round trip: on a cluster, to the master of its keys' slot.
    pub(super) async fn query<T: FromRedisValue>(&self, request: Request<'_>) -> RedisResult<T> {
        match self {
            Connection::Single(single) => {
                let reply = send(&mut single.get(), request).await;
                single.check(&reply);
                reply
            }
            Connection::Cluster(cluster) => {
                let reply = send(&mut cluster.get(), request).await;
                cluster.check(&reply);
                reply
            }
        }
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Connection::Cluster(_))
    }

    /// Sends `cmd` to every primary at once: each one's reply, a server's refusal included
    /// (`CONFIG` may be disabled on one node and not another).
    pub(super) async fn on_every_primary(
        &self,
        cmd: &Cmd,
    ) -> RedisResult<Vec<(Primary, RedisResult<Value>)>> {
        let conn = match self {
            Connection::Single(single) => {
                let reply = cmd.query_async(&mut single.get()).await;
                single.check(&reply);
                return match reply {
                    Err(e) if !is_refusal(&e) => Err(e),
                    reply => Ok(vec![(Primary::Only, reply)]),
                };
            }
            Connection::Cluster(cluster) => cluster,
        };
        let routing = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::Special),
        ));
        let replies = conn.get().route_command(cmd.clone(), routing).await;
        conn.check(&replies);
        let replies = replies?;
        let Value::Map(replies) = replies else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Parse,
                "a command to every master was not answered per master",
            )));
        };
        replies
            .into_iter()
            .map(|(address, reply)| {
                let address: String = redis::from_redis_value(address)?;
                let primary = Primary::parse(&address).ok_or_else(|| {
                    redis::RedisError::from((
                        redis::ErrorKind::Parse,
                        "a master's address is not host:port",
                    ))
                })?;
                Ok((primary, reply.extract_error()))
            })
            .collect()
    }

    /// Every primary: the server, or each master of the cluster.
    pub(super) async fn primaries(&self) -> RedisResult<Vec<Primary>> {
        let replies = self.on_every_primary(&redis::cmd("PING")).await?;
        Ok(replies.into_iter().map(|(primary, _)| primary).collect())
    }

    /// Sends `cmd` to one primary.
    pub(super) async fn query_at<T: FromRedisValue>(
        &self,
        primary: &Primary,
        cmd: &Cmd,
    ) -> RedisResult<T> {
        match (self, primary) {
            (Connection::Cluster(cluster), Primary::At { host, port }) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                let reply = cluster.get().route_command(cmd.clone(), routing).await;
                cluster.check(&reply);
                Ok(redis::from_redis_value(reply?)?)
            }
            _ => self.query(cmd.into()).await,
        }
    }
}

/// True when the server is a cluster node. A server that does not allow INFO is taken as a
/// single one: a cluster node refuses that client's commands on slots it does not own, loudly.
async fn is_cluster_node(conn: &mut ConnectionManager) -> Result<bool, StoreError> {
    let info: RedisResult<String> = redis::cmd("INFO").arg("cluster").query_async(conn).await;
    match info {
        Ok(info) => Ok(info.lines().any(|line| line.trim() == "cluster_enabled:1")),
        Err(e) if is_refusal(&e) => Ok(false),
        Err(e) => Err(not_connected(e)),
    }
}

/// A connection that could not be opened: `Unreachable` when the server is not there yet
/// (refused, dropped, timed out, loading its data, a cluster not yet formed), else a refusal
/// (wrong password, TLS) that waiting would not change.
fn not_connected(e: redis::RedisError) -> StoreError {
    use redis::{ErrorKind, ServerErrorKind};
    let not_up_yet = e.is_connection_refusal()
        || e.is_timeout()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::MasterDown
            )
        );
    if not_up_yet {
        StoreError::Unreachable(e.to_string())
    } else {
        unavailable(e)
    }
}

/// A server's refusal of one command (unknown, renamed, not permitted), as opposed to a
/// connection that failed.
pub(super) fn is_refusal(e: &redis::RedisError) -> bool {
    !(e.is_io_error() || e.is_timeout() || e.is_connection_dropped())
}

async fn send<C: redis::aio::ConnectionLike, T: FromRedisValue>(
    conn: &mut C,
    request: Request<'_>,
) -> RedisResult<T> {
    match request {
        Request::One(cmd) => cmd.query_async(conn).await,
        Request::Pipeline(pipe) => pipe.query_async(conn).await,
    }
}

/// How the pipelines of a fan-out are sent.
#[derive(Clone, Copy)]
pub(super) enum Sent<'s> {
    /// Reads: sent as they are.
    Read,
    /// Calls of one script: loaded where a server lacks it, acknowledged by replicas when
    /// `store.min_replicas_acked` asks for it ([`RedisStore::eval`]).
    Script(&'s super::scripts::LuaScript),
    /// Calls of one script that only reads: loaded where a server lacks it, and no replica
    /// has anything to acknowledge.
    ReadScript(&'s super::scripts::LuaScript),
}

impl RedisStore {
    /// Sends `pipes`, each touching one partition, and answers their replies in order, each
    /// decoded as `T` from the array of its pipeline's replies.
    ///
    /// On one server they go out as one pipeline, in one round trip; a failure fails them all.
    /// On a cluster each goes to its partition's master, [`FAN_OUT`] in flight, and each has
    /// its own answer: a master that is down fails only its partitions.
    pub(super) async fn per_partition<T: FromRedisValue>(
        &self,
        sent: Sent<'_>,
        pipes: &[Pipeline],
    ) -> Vec<Result<T, StoreError>> {
        if pipes.is_empty() {
            return Vec::new();
        }
        if !self.conn.is_cluster() {
            let mut all = redis::pipe();
            for pipe in pipes {
                for cmd in pipe.cmd_iter() {
                    all.add_command(cmd.clone());
                }
            }
            let replies: Vec<Value> = match self.send_as(sent, &all).await {
                Ok(replies) => replies,
                Err(e) => return pipes.iter().map(|_| Err(e.clone())).collect(),
            };
            let mut replies = replies.into_iter();
            return pipes
                .iter()
                .map(|pipe| decode(Value::Array(replies.by_ref().take(pipe.len()).collect())))
                .collect();
        }
        // Built before the stream: a closure in it would not be `Send` for every lifetime, as
        // the `Store` futures must be.
        let requests: Vec<_> = pipes.iter().map(|pipe| self.send_as(sent, pipe)).collect();
        stream::iter(requests).buffered(FAN_OUT).collect().await
    }

    /// [`RedisStore::per_partition`] where every partition must answer (reads that must see
    /// every partition, or report the store unavailable).
    pub(super) async fn every_partition<T: FromRedisValue>(
        &self,
        sent: Sent<'_>,
        pipes: &[Pipeline],
    ) -> Result<Vec<T>, StoreError> {
        self.per_partition(sent, pipes).await.into_iter().collect()
    }

    async fn send_as<T: FromRedisValue>(
        &self,
        sent: Sent<'_>,
        pipe: &Pipeline,
    ) -> Result<T, StoreError> {
        match sent {
            Sent::Read => self.send(pipe).await,
            Sent::Script(script) => self.eval(script, pipe).await,
            Sent::ReadScript(script) => self.eval_read(script, pipe).await,
        }
    }
}
