//! How a store call fails: each variant is a cause the HTTP layer answers in its own way
//! (`http/error.rs` maps them once).

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached, refused the write, or did not answer within
    /// `store.timeout_ms`: the caller answers 503 and the sender retries. A store that refused
    /// recorded nothing; one that was only slow may still apply the write after the answer
    /// (a paused Redis, a hung fsync), and then the retry finds it and is answered as a replay.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The store is out of space (Redis at `maxmemory` with `noeviction`, SQLite at its size
    /// cap or on a full disk) and refuses every write that would grow it, whole: nothing was
    /// recorded. Deletions (the sweeper) still run, so it recovers as retention ends or an
    /// operator frees space. A 503 like `Unavailable`, told apart so that `/readyz` and the
    /// answer name the cause an operator must fix.
    #[error("store full: {0}")]
    Full(String),
    /// No connection to the store could be opened: refused, dropped, silent past
    /// `store.timeout_ms`, or a server still loading its data. Only opening a store says this,
    /// so that `serve` can wait for a store that is not up yet (a crash loop under an
    /// orchestrator otherwise) while a store that answers with a refusal (a wrong password, a
    /// TLS error) stops it at once.
    #[error("store unreachable: {0}")]
    Unreachable(String),
    /// The store answered something this version does not understand (a bug or a foreign
    /// writer). Also mapped to 503 rather than risking a wrong 2xx.
    #[error("store data corrupt: {0}")]
    Corrupt(String),
    /// The store was set up in a way the configuration contradicts (`store.partitions`): it
    /// refuses to start rather than serve a store it would damage.
    #[error("{0}")]
    Incompatible(String),
}

impl From<super::partitions::PartitionsMismatch> for StoreError {
    fn from(mismatch: super::partitions::PartitionsMismatch) -> StoreError {
        StoreError::Incompatible(mismatch.to_string())
    }
}
