//! PostgreSQL failures as the store's errors. Every one is a 503 to the HTTP layer; the kind
//! tells `/readyz` and the answer what an operator must fix, and tells `serve` at start-up
//! whether waiting can help.
//!
//! * A lost connection, a statement cancelled by `statement_timeout`, a server shutting down,
//!   a standby that refuses writes, a serialization failure: `Unavailable`, the sender retries.
//! * A full disk (`53100`): `Full`.
//! * Damaged data (`XX001`, `XX002`) or a column this version cannot read: `Corrupt`.
//! * While opening, a server that cannot be reached yet (refused, silent, starting up, only
//!   standbys answering during a failover): `Unreachable`, so `serve` waits for it; a server
//!   that answers with a refusal (a wrong password, a TLS certificate that does not verify)
//!   stays `Unavailable` and stops the start at once.

use std::error::Error as _;
use std::io;

use deadpool_postgres::PoolError;
use tokio_postgres::error::SqlState;

use crate::store::StoreError;

/// A failure of a call on an open store.
pub(super) fn db_error(e: tokio_postgres::Error) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let text = format!(
            "PostgreSQL {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        );
        return match db.code() {
            &SqlState::DISK_FULL => StoreError::Full(text),
            &SqlState::DATA_CORRUPTED | &SqlState::INDEX_CORRUPTED => StoreError::Corrupt(text),
            _ => StoreError::Unavailable(text),
        };
    }
    if e.is_closed() {
        return StoreError::Unavailable("the connection to PostgreSQL was lost".to_string());
    }
    StoreError::Unavailable(format!("PostgreSQL: {e}"))
}

/// A failure to get a connection from the pool (`shown_url` names the server).
pub(super) fn pool_error(e: PoolError, shown_url: &str) -> StoreError {
    match e {
        PoolError::Backend(e) => match open_error(e, shown_url) {
            // Past start-up every failure is the store being unavailable: the caller answers
            // 503 and the sender retries.
            StoreError::Unreachable(why) => StoreError::Unavailable(why),
            other => other,
        },
        PoolError::Timeout(_) => StoreError::Unavailable(format!(
            "no connection to PostgreSQL at {shown_url} within the store timeout"
        )),
        other => StoreError::Unavailable(format!("PostgreSQL at {shown_url}: {other}")),
    }
}

/// A failure to open a connection: [`StoreError::Unreachable`] when waiting may help.
pub(super) fn open_error(e: tokio_postgres::Error, shown_url: &str) -> StoreError {
    if let Some(db) = e.as_db_error() {
        let text = format!(
            "PostgreSQL at {shown_url}: {} {}: {}",
            db.severity(),
            db.code().code(),
            db.message()
        );
        return match db.code() {
            // Starting up, in crash recovery, or shutting down: it will take connections.
            &SqlState::CANNOT_CONNECT_NOW | &SqlState::ADMIN_SHUTDOWN => {
                StoreError::Unreachable(text)
            }
            &SqlState::DISK_FULL => StoreError::Full(text),
            // A wrong password, a role or database that does not exist, a pg_hba.conf rule, too
            // many connections: waiting changes none of them by itself.
            _ => StoreError::Unavailable(text),
        };
    }
    let text = format!("PostgreSQL at {shown_url}: {e}");
    let io_kind = e
        .source()
        .and_then(|cause| cause.downcast_ref::<io::Error>())
        .map(io::Error::kind);
    match io_kind {
        // A certificate that does not verify, or a host name TLS cannot check: a refusal.
        Some(io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput) => {
            StoreError::Unavailable(text)
        }
        // Refused, reset, silent, no route, a name that does not resolve yet, or every host a
        // standby (`target_session_attrs=read-write` during a failover).
        Some(_) => StoreError::Unreachable(text),
        // `connect_timeout` elapsed.
        None if text.contains("timeout waiting for server") => StoreError::Unreachable(text),
        None => StoreError::Unavailable(text),
    }
}

/// A column that does not hold what this version wrote.
pub(super) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// `?` on tokio-postgres results inside functions returning `StoreError`, without a
/// crate-wide `From` impl that would hide which engine an error came from.
pub(super) trait Db<T> {
    fn db(self) -> Result<T, StoreError>;
}

impl<T> Db<T> for Result<T, tokio_postgres::Error> {
    fn db(self) -> Result<T, StoreError> {
        self.map_err(db_error)
    }
}

/// Reads column `idx` of `row`; a value of another type is corrupt data, not an outage.
pub(super) fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    idx: usize,
) -> Result<T, StoreError> {
    row.try_get(idx).map_err(corrupt)
}
