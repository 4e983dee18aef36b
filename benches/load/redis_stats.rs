//! The bench's Redis: the tests' private `redis-server` (tests/support/redis.rs) with AOF
//! `everysec`, and the queries the report reads from it (memory, command statistics, keys).

use std::time::Duration;

use crate::support::redis::RedisServer;

pub struct Redis {
    server: RedisServer,
}

impl Redis {
    pub fn start() -> Result<Redis, String> {
        let server = RedisServer::try_start_with_args("everysec", &[])?;
        Ok(Redis { server })
    }

    pub fn port(&self) -> u16 {
        self.server.port
    }

    pub fn url(&self) -> String {
        self.server.url()
    }

    pub fn url_db(&self, db: u8) -> String {
        self.server.url_db(db)
    }

    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, String> {
        self.conn_db(0).await
    }

    pub async fn conn_db(&self, db: u8) -> Result<redis::aio::MultiplexedConnection, String> {
        connect(&self.url_db(db)).await
    }

    pub async fn flushall(&self) -> Result<(), String> {
        let mut c = self.conn().await?;
        redis::cmd("FLUSHALL")
            .query_async::<()>(&mut c)
            .await
            .map_err(|e| e.to_string())
    }

    pub async fn used_memory(&self) -> Result<u64, String> {
        let mut c = self.conn().await?;
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut c)
            .await
            .map_err(|e| e.to_string())?;
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| "no used_memory in INFO memory".into())
    }

    pub async fn reset_stats(&self) -> Result<(), String> {
        reset_stats_at(&self.url()).await
    }

    /// `INFO commandstats`: (command, calls, total µs), busiest first.
    pub async fn command_stats(&self) -> Result<Vec<(String, u64, u64)>, String> {
        command_stats_at(&self.url()).await
    }

    pub async fn dbsize(&self, db: u8) -> Result<u64, String> {
        let mut c = self.conn_db(db).await?;
        redis::cmd("DBSIZE")
            .query_async(&mut c)
            .await
            .map_err(|e| e.to_string())
    }
}

/// A plain connection to the one server at `url` (a cluster node answers it for itself:
/// its statistics, its keys).
pub async fn connect(url: &str) -> Result<redis::aio::MultiplexedConnection, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    // FLUSHALL of a million keys and big SCANs take longer than the default 500 ms.
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(120)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| e.to_string())
}

pub async fn reset_stats_at(url: &str) -> Result<(), String> {
    let mut c = connect(url).await?;
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut c)
        .await
        .map_err(|e| e.to_string())
}

/// `INFO commandstats` of the server at `url`: (command, calls, total µs), busiest first.
/// What the report's own queries and a cluster client's topology lookups cost is left out.
pub async fn command_stats_at(url: &str) -> Result<Vec<(String, u64, u64)>, String> {
    let mut c = connect(url).await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .map_err(|e| e.to_string())?;
    let mut stats = Vec::new();
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(key))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        if name.starts_with("config")
            || name.starts_with("cluster")
            || name == "info"
            || name == "ping"
        {
            continue;
        }
        stats.push((name.to_string(), field("calls="), field("usec=")));
    }
    stats.sort_by_key(|s| std::cmp::Reverse(s.2));
    Ok(stats)
}

/// The eight busiest commands of `stats` per operation: calls and Redis µs.
pub fn per_op(stats: &[(String, u64, u64)], ops: u64) -> String {
    let per = |n: u64| n as f64 / ops.max(1) as f64;
    stats
        .iter()
        .take(8)
        .map(|(name, calls, usec)| format!("{name} {:.2}× {:.1} µs", per(*calls), per(*usec)))
        .collect::<Vec<_>>()
        .join("; ")
}
