//! The advisory locks that make a write's read, decision and apply one atomic step where row
//! locks cannot: a dedupe key, a seal or a payment that has no row yet, and an ordering key's
//! queue, whose head one transaction takes off while another appends behind it (without the
//! lock, each would miss the other's uncommitted row and the new message would never become
//! due). Each lock lasts until its transaction ends.
//!
//! Every transaction takes them in the order of [`Lock`] (a dedupe key before a seal, before
//! a payment, before an ordering key), and a transaction that takes several of one kind (a
//! group-committed batch of accepts, [`lock_all`]) takes those in the order of their hashes,
//! so two never wait for each other in a circle. A name is hashed to 32 bits: two names that
//! collide only wait for each other.

use deadpool_postgres::Transaction;

use super::error::Db;
use crate::store::StoreError;

/// What a lock is on, in the order a transaction takes them; the number is the lock's first
/// key, so names of different kinds never share a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Lock {
    DedupeKey = 1,
    Seal = 2,
    Payment = 3,
    OrderingKey = 4,
}

/// Waits for the lock on `name` of kind `lock`.
pub(super) async fn lock(tx: &Transaction<'_>, lock: Lock, name: &str) -> Result<(), StoreError> {
    let statement = tx
        .prepare_cached("SELECT pg_advisory_xact_lock($1, hashtext($2))")
        .await
        .db()?;
    tx.execute(&statement, &[&(lock as i32), &name])
        .await
        .db()
        .map(|_| ())
}

/// Waits for the locks on all of `names`, in one statement and in the one order every
/// transaction follows: by kind, then by the name's hash (the lock's second key). A lock
/// named twice is taken once.
pub(super) async fn lock_all(
    tx: &Transaction<'_>,
    names: &[(Lock, &str)],
) -> Result<(), StoreError> {
    let (kinds, names): (Vec<i32>, Vec<&str>) = names
        .iter()
        .map(|&(kind, name)| (kind as i32, name))
        .unzip();
    // `OFFSET 0` keeps the sorted subquery a step of its own, so the locks are taken in the
    // order it sorts them.
    let statement = tx
        .prepare_cached(
            "SELECT pg_advisory_xact_lock(kind, hash) FROM \
             (SELECT DISTINCT kind, hashtext(name) AS hash \
              FROM unnest($1::int4[], $2::text[]) AS names (kind, name) \
              ORDER BY kind, hash OFFSET 0) AS ordered",
        )
        .await
        .db()?;
    tx.execute(&statement, &[&kinds, &names])
        .await
        .db()
        .map(|_| ())
}

/// The lock on creating day `day`'s partitions (a kind of its own, after every other).
pub(super) async fn lock_day(tx: &Transaction<'_>, day: i32) -> Result<(), StoreError> {
    tx.execute("SELECT pg_advisory_xact_lock(5, $1)", &[&day])
        .await
        .db()
        .map(|_| ())
}
