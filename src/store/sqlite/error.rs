//! SQLite failures as the store's errors.

use std::path::Path;

use rusqlite::ErrorCode;

use crate::store::StoreError;

/// Maps SQLite failures onto the store's: a damaged file is `Corrupt`, a full disk (or the size
/// cap) is `Full`, anything else (read-only file, I/O error, busy) is `Unavailable`. Each becomes a 503, never a 2xx.
pub(super) fn db_error(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
            StoreError::Corrupt(e.to_string())
        }
        Some(ErrorCode::DiskFull) => StoreError::Full(e.to_string()),
        Some(_) => StoreError::Unavailable(e.to_string()),
        None => match e {
            rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..)
            | rusqlite::Error::InvalidColumnType(..) => StoreError::Corrupt(e.to_string()),
            other => StoreError::Unavailable(other.to_string()),
        },
    }
}

pub(super) fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

/// `?` on rusqlite results inside functions returning `StoreError`, without a crate-wide
/// `From` impl that would hide which backend an error came from.
pub(super) trait Db<T> {
    fn db(self) -> Result<T, StoreError>;
}

impl<T> Db<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T, StoreError> {
        self.map_err(db_error)
    }
}

/// Names the database file in an error raised while opening it.
pub(super) fn context(path: &Path, e: StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => {
            StoreError::Unavailable(format!("SQLite database {}: {m}", path.display()))
        }
        StoreError::Corrupt(m) => {
            StoreError::Corrupt(format!("SQLite database {}: {m}", path.display()))
        }
        StoreError::Full(m) => StoreError::Full(format!("SQLite database {}: {m}", path.display())),
        StoreError::Unreachable(m) => {
            StoreError::Unreachable(format!("SQLite database {}: {m}", path.display()))
        }
        StoreError::Incompatible(m) => {
            StoreError::Incompatible(format!("SQLite database {}: {m}", path.display()))
        }
    }
}
