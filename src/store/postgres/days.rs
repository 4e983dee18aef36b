//! The day partitions of finished messages and their history (`migrations/0001_layout.sql`):
//! which day a finished message lives in, creating a day before the first message finishes
//! into it, and dropping the days the sweep horizon has passed, whole.
//!
//! Why days are created ahead: the rules give a finishing message its end (`now` plus the
//! retention) inside the write's transaction, and creating a partition there would need a lock
//! on the whole table while holding row locks: a write first makes sure the day of `now` plus
//! the retention exists ([`Days::ensure`]), in a short transaction of its own, once per day and
//! process. A write whose effect names another day (it never happens with these rules) fails
//! as unavailable, names the day, and the retry finds it created.

use std::collections::BTreeSet;
use std::sync::{Mutex, PoisonError};

use deadpool_postgres::Client;
use tokio_postgres::error::SqlState;

use super::error::{Db, column, db_error};
use super::locks::lock_day;
use crate::clock::Millis;
use crate::store::StoreError;

const DAY_MS: Millis = 86_400_000;

/// The day partition of a message that ends at `ends_at`; 0 (the live partition) while it has
/// no end. Day `d` holds the ends in `[(d - 1) * DAY_MS, d * DAY_MS)`.
pub(super) fn end_day(ends_at: Option<Millis>) -> i32 {
    match ends_at {
        None => 0,
        Some(end) => i32::try_from(end.max(0) / DAY_MS + 1).unwrap_or(i32::MAX),
    }
}

/// The last millisecond day `day` holds: once the sweep horizon reaches it, every message of
/// the day is gone.
fn last_ms(day: i32) -> Millis {
    Millis::from(day) * DAY_MS - 1
}

/// The day partitions this process knows exist, and the days a write found missing.
#[derive(Debug, Default)]
pub(super) struct Days {
    /// Why a std `Mutex`: it is never held across an await.
    known: Mutex<BTreeSet<i32>>,
}

impl Days {
    /// Whether day `day` is known to exist (the live partition always does).
    pub(super) fn known(&self, day: i32) -> bool {
        day == 0 || self.lock().contains(&day)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<i32>> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes sure the partitions of day `day` exist: created if no process has yet, under an
    /// advisory lock so that two creators wait for each other.
    pub(super) async fn ensure(&self, client: &mut Client, day: i32) -> Result<(), StoreError> {
        if self.known(day) {
            return Ok(());
        }
        let tx = client.transaction().await.db()?;
        lock_day(&tx, day).await?;
        for table in ["messages", "history"] {
            let created = tx
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {table}_d{day} PARTITION OF {table} \
                     FOR VALUES IN ({day})"
                ))
                .await;
            match created {
                Ok(()) => {}
                // Created by another process while this one waited: the name lookup of IF
                // NOT EXISTS may answer from a cache the lock wait did not refresh.
                Err(e)
                    if matches!(
                        e.code(),
                        Some(&SqlState::DUPLICATE_TABLE | &SqlState::UNIQUE_VIOLATION)
                    ) =>
                {
                    self.lock().insert(day);
                    return Ok(());
                }
                Err(e) => return Err(db_error(e)),
            }
        }
        tx.commit().await.db()?;
        self.lock().insert(day);
        Ok(())
    }

    /// Forgets day `day`: a write found it missing (another process dropped it).
    pub(super) fn forget(&self, day: i32) {
        self.lock().remove(&day);
    }

    /// Drops the day partitions whose every message is at or below `horizon`, each in a
    /// short transaction that gives up rather than wait long for the table lock it needs (the
    /// next sweep tries again). Returns how many days went.
    pub(super) async fn drop_passed(
        &self,
        client: &mut Client,
        horizon: Millis,
    ) -> Result<usize, StoreError> {
        let rows = client
            .query(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                 WHERE i.inhparent = 'messages'::regclass",
                &[],
            )
            .await
            .db()?;
        let mut passed = Vec::new();
        for row in &rows {
            let name: String = column(row, 0)?;
            if let Some(day) = name
                .strip_prefix("messages_d")
                .and_then(|d| d.parse::<i32>().ok())
                .filter(|day| last_ms(*day) <= horizon)
            {
                passed.push(day);
            }
        }
        let mut dropped = 0;
        for day in passed {
            let tx = client.transaction().await.db()?;
            tx.batch_execute(&format!(
                "SET LOCAL lock_timeout = '500ms'; \
                 DROP TABLE IF EXISTS messages_d{day}; DROP TABLE IF EXISTS history_d{day}"
            ))
            .await
            .db()?;
            tx.commit().await.db()?;
            self.forget(day);
            dropped += 1;
        }
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_day_holds_the_ends_of_one_utc_day_and_is_gone_after_its_last_millisecond() {
        assert_eq!(end_day(None), 0);
        let t0 = 1_764_460_800_000; // 2025-11-30T00:00:00Z
        let day = end_day(Some(t0));
        assert_eq!(end_day(Some(t0 + DAY_MS - 1)), day);
        assert_eq!(end_day(Some(t0 + DAY_MS)), day + 1);
        assert_eq!(end_day(Some(t0 - 1)), day - 1);
        assert_eq!(last_ms(day), t0 + DAY_MS - 1);
        assert_eq!(end_day(Some(0)), 1, "never the live partition");
    }
}
