//! The round trips of the Redis engine: reads, writes that replicas acknowledge (`WAIT`), and
//! script calls by hash, loaded again where a server lost them. Every store call goes out
//! through one of these.

use std::time::Duration;

use redis::{Cmd, FromRedisValue, Pipeline, RedisResult, Value};

use super::connection::Request;
use super::scripts::LuaScript;
use super::{RedisStore, unavailable};
use crate::store::StoreError;

impl RedisStore {
    /// Sends one round trip: to the server, or to the master of its keys' slot.
    pub(super) async fn query<T: FromRedisValue>(&self, request: Request<'_>) -> RedisResult<T> {
        self.conn.query(request).await
    }

    /// Sends one round trip that only reads (writes go through [`RedisStore::write`] or
    /// [`RedisStore::eval`], which wait for replicas); a failure is the store being
    /// unavailable.
    pub(super) async fn send<'r, T: FromRedisValue>(
        &self,
        request: impl Into<Request<'r>>,
    ) -> Result<T, StoreError> {
        self.query(request.into()).await.map_err(unavailable)
    }

    /// Sends calls of `script` (see [`script_call`]), a script that writes, so this is a
    /// [`RedisStore::write`].
    pub(super) async fn eval<'r, T: FromRedisValue>(
        &self,
        script: &LuaScript,
        request: impl Into<Request<'r>>,
    ) -> Result<T, StoreError> {
        let request = request.into();
        let (reply, acked) = self
            .with_script(script, || self.query_acked(request))
            .await?;
        self.check_acks(acked)?;
        Ok(reply)
    }

    /// [`RedisStore::eval`] of a script that only reads (`list.lua`): a [`RedisStore::send`].
    pub(super) async fn eval_read<'r, T: FromRedisValue>(
        &self,
        script: &LuaScript,
        request: impl Into<Request<'r>>,
    ) -> Result<T, StoreError> {
        let request = request.into();
        self.with_script(script, || self.query(request)).await
    }

    /// Sends what calls `script` by its hash. A server that restarted since, another server
    /// behind the URL, or a replica promoted to master has no scripts in its cache: a NOSCRIPT
    /// reply loads `script` on every primary and sends the calls again.
    pub(super) async fn with_script<T, Reply>(
        &self,
        script: &LuaScript,
        send: impl Fn() -> Reply,
    ) -> Result<T, StoreError>
    where
        Reply: Future<Output = RedisResult<T>>,
    {
        match send().await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                let loads = self
                    .conn
                    .on_every_primary(&script.load())
                    .await
                    .map_err(unavailable)?;
                for (_, loaded) in loads {
                    loaded.map_err(unavailable)?;
                }
                send().await.map_err(unavailable)
            }
            other => other.map_err(unavailable),
        }
    }

    /// Sends a round trip that writes; with `store.min_replicas_acked = N > 0` it succeeds only
    /// once N replicas acknowledged the write.
    ///
    /// Fewer acknowledgements is `Unavailable` (503 + Retry-After). The write is not undone: it
    /// stays on the master, so the provider's retry is answered as a replay. A claim's leases
    /// stay too, and expire as any unfinished lease does.
    pub(super) async fn write<'r, T: FromRedisValue>(
        &self,
        request: impl Into<Request<'r>>,
    ) -> Result<T, StoreError> {
        let (reply, acked) = self
            .query_acked(request.into())
            .await
            .map_err(unavailable)?;
        self.check_acks(acked)?;
        Ok(reply)
    }

    /// Sends a write and, when replicas must acknowledge it, `WAIT N` in the same round trip,
    /// right after the write: a pipeline goes out as one buffer on one connection, so the
    /// `WAIT` covers this write even when the connection manager reconnects in between (a
    /// `WAIT` on a fresh connection would have nothing to wait for and answer at once). The
    /// manager multiplexes every task on that connection, and Redis waits for the
    /// connection's latest write: writes of other tasks sent before this `WAIT` are waited for
    /// too, which is correct, only possibly slower. On a cluster the keyless `WAIT` follows
    /// the pipeline's keyed write to its master. The reply, and how many replicas
    /// acknowledged (`None`: no `WAIT` was sent).
    pub(super) async fn query_acked<T: FromRedisValue>(
        &self,
        request: Request<'_>,
    ) -> RedisResult<(T, Option<u32>)> {
        if self.min_replicas_acked == 0 {
            return Ok((self.query(request).await?, None));
        }
        let mut pipe = match request {
            Request::One(cmd) => {
                let mut pipe = redis::pipe();
                pipe.add_command(cmd.clone());
                pipe
            }
            // `WAIT` inside MULTI does not block, so a transaction is spelled out with the
            // `WAIT` after its EXEC. Its reply keeps the replies of ignored commands; the one
            // transaction the engine sends (the upgrade's) discards its reply.
            Request::Pipeline(inner) if inner.is_transaction() => {
                let mut pipe = redis::pipe();
                pipe.cmd("MULTI").ignore();
                for cmd in inner.cmd_iter() {
                    pipe.add_command(cmd.clone()).ignore();
                }
                pipe.cmd("EXEC");
                pipe
            }
            Request::Pipeline(inner) => inner.clone(),
        };
        pipe.cmd("WAIT")
            .arg(self.min_replicas_acked)
            .arg(self.wait_timeout_ms);
        let mut replies: Vec<Value> = self.query((&pipe).into()).await?;
        let acked: u32 = redis::from_redis_value(replies.pop().unwrap_or(Value::Nil))?;
        let reply = match request {
            Request::Pipeline(inner) if !inner.is_transaction() => Value::Array(replies),
            _ => replies.pop().unwrap_or(Value::Nil),
        };
        Ok((redis::from_redis_value(reply)?, Some(acked)))
    }

    pub(super) fn check_acks(&self, acked: Option<u32>) -> Result<(), StoreError> {
        match acked {
            Some(acked) if acked < self.min_replicas_acked => {
                Err(StoreError::Unavailable(format!(
                    "{acked} of store.min_replicas_acked = {} replicas acknowledged the write within \
                 {} ms; it stays on the master, so a retry is answered as a replay",
                    self.min_replicas_acked, self.wait_timeout_ms
                )))
            }
            _ => Ok(()),
        }
    }
}

/// How long a `WAIT` blocks: four fifths of the round-trip timeout, leaving the rest for the
/// write and the network, so a missing replica is reported as such rather than as a timeout.
/// At least 1 ms, since `WAIT 0` would block forever.
pub(super) fn wait_timeout_ms(timeout: Duration) -> u64 {
    (u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX) / 5 * 4).max(1)
}

/// A call of `script` with its `KEYS`, in the order of the script's header; the caller adds
/// its `ARGV`. Sent alone or added to a pipeline, always through [`RedisStore::eval`] (or
/// [`RedisStore::eval_read`] for a script that only reads).
///
/// Redis Cluster runs a script only when all its keys are in one slot, so a call whose keys
/// span slots is a bug of this engine, caught here in every debug build and test run.
pub(super) fn script_call(script: &LuaScript, keys: &[String]) -> Cmd {
    debug_assert!(
        in_one_slot(keys),
        "the keys of one script call span slots: {keys:?}"
    );
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.hash()).arg(keys.len()).arg(keys);
    cmd
}

/// A pipeline of one command, for [`RedisStore::per_partition`].
pub(super) fn one_call(call: Cmd) -> Pipeline {
    let mut pipe = redis::pipe();
    pipe.add_command(call);
    pipe
}

/// True when every key hashes to the slot of the first, as Redis Cluster computes it.
fn in_one_slot(keys: &[String]) -> bool {
    use redis::cluster_routing::Slot;
    keys.iter().all(|key| {
        keys.first()
            .is_some_and(|first| Slot::for_key(key) == Slot::for_key(first))
    })
}
