//! The partition count of a Redis store (`store.partitions`), in `<prefix>:partitions`.
//!
//! Read when connecting, before anything is written: the count decides every key name
//! ([`KeySpace`](super::keys::KeySpace)). Recorded by [`RedisStore::upgrade`], which is where a
//! store is first written to. A store without the key was created before the count was
//! recorded, with 16 partitions, unless it holds nothing at all yet.

use super::RedisStore;
use crate::store::StoreError;
use crate::store::partitions::{Found, Partitions};

impl RedisStore {
    /// What the store says about its count: recorded, or not recorded in a store that was
    /// used (a layout version stamped, or partition keys), or nothing stored yet.
    pub(super) async fn found_partitions(&self) -> Result<Found, StoreError> {
        // Two reads: on a cluster the two keys may live on two masters.
        let recorded: Option<String> = self
            .send(&redis::Cmd::get(self.keys.partition_count()))
            .await?;
        let schema: Option<String> = self.send(&redis::Cmd::get(self.keys.schema())).await?;
        if let Some(recorded) = recorded {
            return self.parse_count(&recorded).map(Found::Recorded);
        }
        if schema.is_some() || self.has_data().await? {
            Ok(Found::Unrecorded)
        } else {
            Ok(Found::Empty)
        }
    }

    /// Records the store's count unless one is recorded already, and checks the record is this
    /// process's count: another process starting on the same new store at the same time with
    /// another `store.partitions` may have recorded its own first.
    pub(super) async fn record_partitions(&self) -> Result<(), StoreError> {
        let key = self.keys.partition_count();
        let count = self.keys.partitions();
        let mut record = redis::pipe();
        record
            .cmd("SET")
            .arg(&key)
            .arg(count.count())
            .arg("NX")
            .ignore()
            .get(&key);
        let (recorded,): (String,) = self.write(&record).await?;
        let recorded = self.parse_count(&recorded)?;
        if recorded == count {
            return Ok(());
        }
        Err(StoreError::Incompatible(format!(
            "this process opened the store with {count} partitions, but {key} now records \
             {recorded}: another process recorded its store.partitions first. Start again to \
             use the store's count"
        )))
    }

    fn parse_count(&self, recorded: &str) -> Result<Partitions, StoreError> {
        recorded
            .parse()
            .ok()
            .and_then(Partitions::new)
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "{} holds `{recorded}`, not a partition count of 1 to {}",
                    self.keys.partition_count(),
                    Partitions::MAX
                ))
            })
    }
}
