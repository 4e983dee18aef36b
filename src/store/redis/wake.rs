//! The wake-up across processes on Redis: a script that makes work due now (an accept that
//! heads its queue, a completion that promotes the next message of its key, a resend, a
//! release due now) sends an empty message on its partition's wake channel (`wake.lua`), and
//! every store whose dispatcher runs holds one subscription to every partition's channel,
//! turning each message into a change of its [`WorkSignal`](crate::store::WorkSignal).
//!
//! Why it is built this way:
//!
//! - **In the script, so only once written.** The message goes out inside the script that
//!   made the work due, so no dispatcher is woken for a write that failed, and none misses one
//!   that succeeded while it was subscribed.
//! - **A channel per partition, sharded on a cluster.** On a cluster the scripts `SPUBLISH`
//!   to the partition's shard channel, which stays on the master of the partition's slot;
//!   a plain `PUBLISH` would cross the cluster bus to every node for every accept. The
//!   cluster client here subscribes to each channel at its master, and subscribes again by
//!   itself after a failover or a slot move. One server takes `PUBLISH`/`SUBSCRIBE`.
//! - **Heard work is counted where it was written.** Each message marks its partition for a
//!   count, and while the subscription is in place the claim trusts what it knows of the
//!   other partitions for 4.5 s (under the 5 s poll) instead of 50 ms (`claim.rs`), so a
//!   trickle of work from other processes does not count every partition at every wake-up.
//! - **Lost messages are assumed.** A subscription that drops or goes silent (a `PING`
//!   unanswered within the store timeout) is opened again with backoff, and the moment it
//!   is back counts as a wake: what was published while it was gone is claimed then. The
//!   dispatcher's slow poll (5 s) stays as the last bound, also for what no script announces
//!   (a retry another process scheduled, a lease that ran out).
//! - **A refusal ends it.** A user whose ACL allows no channels (Redis 7 gives new users
//!   none: the ACL needs `&<prefix>:*`) is told once, and the signal ends, so the dispatcher
//!   polls often as without one; the scripts' messages are sent with `pcall`, so writes go on.
//! - **Started lazily.** Only a store whose dispatcher asks for the signal subscribes; stores
//!   opened by tools and tests that never dispatch do not.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use redis::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::RedisTls;
use super::claim::Hints;
use super::connection::{client, cluster_client};
use crate::store::WorkSignal;

/// The first wait before subscribing again after a loss, doubled up to [`MAX_BACKOFF`] while
/// it keeps failing.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// How often a quiet subscription is asked for a `PING`: a connection that went silent is
/// replaced within this plus the store timeout.
const HEARTBEAT: Duration = Duration::from_secs(10);

/// Where to subscribe and to what.
#[derive(Clone)]
pub(super) struct WakeConfig {
    pub url: String,
    pub timeout: Duration,
    pub tls: Option<RedisTls>,
    pub cluster: bool,
    /// Every partition's wake channel (`Keys::wake`), with its partition.
    pub channels: HashMap<String, u8>,
    /// What this process knows of each partition: a wake-up makes its partition counted
    /// again, since another process wrote there (`claim.rs`). Without this, a wake-up within
    /// the hints' trust of a count that found nothing would be skipped until the next poll.
    pub hints: Arc<Hints>,
    /// The URL without its credentials, for logs.
    pub shown_url: String,
}

/// The running subscription: its task ends when the store (which owns this) is dropped, or
/// when the server refuses it; the task holds the only sender, so the signal ends with it.
pub(super) struct Waker {
    signal: WorkSignal,
    task: JoinHandle<()>,
}

impl Waker {
    /// Subscribes in a task of the current runtime.
    pub(super) fn start(config: WakeConfig) -> Waker {
        let (sender, signal) = watch::channel(0);
        let task = tokio::spawn(run(config, Arc::new(sender)));
        Waker { signal, task }
    }

    pub(super) fn subscribe(&self) -> WorkSignal {
        self.signal.clone()
    }
}

/// Why a subscription ended.
enum Lost {
    /// The connection failed or went silent: subscribe again.
    Gone(String),
    /// The server refuses it (the user's ACL): subscribing again would be refused again.
    Refused(String),
}

impl Drop for Waker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(config: WakeConfig, signal: Arc<watch::Sender<u64>>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let lost = if config.cluster {
            subscribe_cluster(&config, &signal, &mut backoff).await
        } else {
            subscribe_server(&config, &signal, &mut backoff).await
        };
        // Other processes' work is unheard of until subscribed again: count as often as
        // without a subscription.
        config.hints.hear(false);
        let lost = match lost {
            Lost::Gone(why) => why,
            Lost::Refused(why) => {
                tracing::error!(store = %config.shown_url, error = %why,
                    "Redis refuses the wake-up subscription (the user's ACL needs the channels of the key prefix, &<prefix>:*); the dispatcher polls every 100 ms instead");
                return;
            }
        };
        tracing::warn!(store = %config.shown_url, error = %lost, retry_in = ?backoff,
            "the Redis wake-up subscription is lost; other processes' work is found by polling until it is back");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn wake(signal: &watch::Sender<u64>) {
    signal.send_modify(|n| *n = n.wrapping_add(1));
}

/// A message on `channel`: its partition has new work of another process, and the
/// dispatcher is woken for it.
fn woken_on(config: &WakeConfig, signal: &watch::Sender<u64>, channel: &[u8]) {
    let partition = std::str::from_utf8(channel)
        .ok()
        .and_then(|name| config.channels.get(name));
    if let Some(partition) = partition {
        config.hints.wrote(*partition);
    }
    wake(signal);
}

/// Bounds `step` by the store timeout, naming what did not answer.
async fn within<T>(
    config: &WakeConfig,
    what: &str,
    step: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, Lost> {
    match tokio::time::timeout(config.timeout, step).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(e)) if e.code() == Some("NOPERM") => Err(Lost::Refused(format!("{what}: {e}"))),
        Ok(Err(e)) => Err(Lost::Gone(format!("{what}: {e}"))),
        Err(_) => Err(Lost::Gone(format!(
            "{what}: no answer within {:?}",
            config.timeout
        ))),
    }
}

/// One server: `SUBSCRIBE` on a connection of its own, signalling each message until the
/// connection is lost or goes silent;
/// returns why.
async fn subscribe_server(
    config: &WakeConfig,
    signal: &watch::Sender<u64>,
    backoff: &mut Duration,
) -> Lost {
    let client = match client(&config.url, config.timeout, config.tls.as_ref()) {
        Ok(client) => client,
        Err(e) => return Lost::Gone(e.to_string()),
    };
    let pubsub = match within(config, "connecting", client.get_async_pubsub()).await {
        Ok(pubsub) => pubsub,
        Err(e) => return e,
    };
    let (mut sink, mut messages) = pubsub.split();
    let channels: Vec<&String> = config.channels.keys().collect();
    if let Err(e) = within(config, "SUBSCRIBE", sink.subscribe(&channels)).await {
        return e;
    }
    *backoff = MIN_BACKOFF;
    tracing::debug!(store = %config.shown_url, "subscribed to work of other processes");
    // Whatever was published while nothing was subscribed is counted and claimed now.
    config.hints.forget_all();
    config.hints.hear(true);
    wake(signal);
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    heartbeat.tick().await;
    loop {
        tokio::select! {
            message = messages.next() => match message {
                Some(message) => woken_on(config, signal, message.get_channel_name().as_bytes()),
                None => return Lost::Gone("the connection closed".to_string()),
            },
            _ = heartbeat.tick() => {
                if let Err(e) = within(config, "PING", sink.ping::<Value>()).await {
                    return e;
                }
            }
        }
    }
}

/// A cluster: `SSUBSCRIBE` of each channel at the master of its slot, through a cluster
/// client that delivers every push (a message, or a subscription renewed after a failover)
/// as a wake; returns why it was given up.
async fn subscribe_cluster(
    config: &WakeConfig,
    signal: &Arc<watch::Sender<u64>>,
    backoff: &mut Duration,
) -> Lost {
    let pushed = Arc::clone(signal);
    let pushed_config = config.clone();
    let built = cluster_client(&config.url, config.timeout, config.tls.as_ref())
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(move |push: redis::PushInfo| {
            // A message names its channel first; a renewed subscription wakes for all.
            match (push.kind, push.data.first()) {
                (redis::PushKind::SMessage, Some(Value::BulkString(channel))) => {
                    woken_on(&pushed_config, &pushed, channel)
                }
                _ => {
                    pushed_config.hints.forget_all();
                    wake(&pushed);
                }
            }
            Ok::<(), redis::aio::SendError>(())
        })
        .build();
    let cluster = match built {
        Ok(cluster) => cluster,
        Err(e) => return Lost::Gone(e.to_string()),
    };
    let mut conn = match within(config, "connecting", cluster.get_async_connection()).await {
        Ok(conn) => conn,
        Err(e) => return e,
    };
    // One channel per call: channels of several slots in one SSUBSCRIBE are refused.
    for channel in config.channels.keys() {
        if let Err(e) = within(config, "SSUBSCRIBE", conn.ssubscribe(channel)).await {
            return e;
        }
    }
    *backoff = MIN_BACKOFF;
    tracing::debug!(store = %config.shown_url, "subscribed to work of other processes");
    config.hints.forget_all();
    config.hints.hear(true);
    wake(signal);
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        let ping = redis::cmd("PING");
        if let Err(e) = within(config, "PING", ping.query_async::<Value>(&mut conn)).await {
            return e;
        }
    }
}
