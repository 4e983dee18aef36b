//! Applies store::lifecycle::sweep: what ends at or before `now` is gone.
//!
//! * Dedupe claims, seals, payment states and operation records are rows of plain tables,
//!   deleted in bounded batches ([`SWEEP_LIMIT`] per table and call) that skip rows another
//!   transaction holds, so a sweep never waits for a writer. Vacuum reuses their space: those
//!   tables stay the size of what is alive.
//! * A minute's delivery counts (store/counts.rs) and inbound counts, and recoveries
//!   (store/recoveries.rs), go once their lifetime is over, in the same bounded, skip-locked
//!   batches.
//! * Finished messages go by the sweep horizon, raised to `now`: every read and resend treats
//!   a message whose end is at or below it as gone, at once, without touching its row. Their
//!   day partitions, once the horizon passed each one's last millisecond, are dropped whole
//!   (`days.rs`): no DELETE of messages or history at all, and no bloat left behind.

use deadpool_postgres::Client;
use tokio_postgres::types::ToSql;

use super::DB_NOW_MS;
use super::days::Days;
use super::error::{Db, column};
use crate::clock::Millis;
use crate::store::counts::COUNT_LIFETIME_MS;
use crate::store::recoveries;
use crate::store::{SWEEP_LIMIT, StoreError};

/// Each expiring table and its key column.
const EXPIRING: [(&str, &str); 4] = [
    ("dedupe_claims", "key"),
    ("payments", "payment_id"),
    ("seals", "key"),
    ("operations", "key"),
];

/// Deletes what ended, raises the horizon and drops the days it passed. Returns the rows
/// deleted and the days dropped.
pub(super) async fn sweep(
    client: &mut Client,
    days: &Days,
    now: Millis,
) -> Result<usize, StoreError> {
    let limit = i64::try_from(SWEEP_LIMIT).unwrap_or(i64::MAX);
    let mut deleted = 0;
    for (table, key) in EXPIRING {
        // Operation records expire by the database's clock they were set with; the rest by
        // the caller's.
        let (end, params): (&str, &[&(dyn ToSql + Sync)]) = if table == "operations" {
            (DB_NOW_MS, &[&limit])
        } else {
            ("$2", &[&limit, &now])
        };
        let statement = client
            .prepare_cached(&format!(
                "DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {table} \
                 WHERE expires_at <= {end} LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ))
            .await
            .db()?;
        let gone = client.execute(&statement, params).await.db()?;
        deleted += usize::try_from(gone).unwrap_or(usize::MAX);
    }
    let statement = client
        .prepare_cached(
            "DELETE FROM delivery_counts WHERE (minute, slot) IN (SELECT minute, slot \
             FROM delivery_counts WHERE minute <= $2 LIMIT $1 FOR UPDATE SKIP LOCKED)",
        )
        .await
        .db()?;
    let gone = client
        .execute(&statement, &[&limit, &(now - COUNT_LIFETIME_MS)])
        .await
        .db()?;
    deleted += usize::try_from(gone).unwrap_or(usize::MAX);
    // Inbound counts and recoveries past their lifetimes (store/recoveries.rs), alike.
    for (sql, end) in [
        (
            "DELETE FROM inbound_counts WHERE (source, minute, slot) IN (SELECT source, minute, \
             slot FROM inbound_counts WHERE minute <= $2 LIMIT $1 FOR UPDATE SKIP LOCKED)",
            now - recoveries::INBOUND_COUNT_LIFETIME_MS,
        ),
        (
            "DELETE FROM recoveries WHERE id IN (SELECT id FROM recoveries \
             WHERE started_at <= $2 LIMIT $1 FOR UPDATE SKIP LOCKED)",
            now - recoveries::RECOVERY_LIFETIME_MS,
        ),
    ] {
        let statement = client.prepare_cached(sql).await.db()?;
        let gone = client.execute(&statement, &[&limit, &end]).await.db()?;
        deleted += usize::try_from(gone).unwrap_or(usize::MAX);
    }
    let row = client
        .query_one(
            "UPDATE sweep_horizon SET swept_to = greatest(swept_to, $1) RETURNING swept_to",
            &[&now],
        )
        .await
        .db()?;
    let horizon: Millis = column(&row, 0)?;
    Ok(deleted + days.drop_passed(client, horizon).await?)
}
