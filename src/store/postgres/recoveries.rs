//! Recoveries and the inbound counts they report (store/recoveries.rs): no lifecycle rule,
//! plain rows. The counts are written by the accepts (`accept_set.rs`); this reads them, and
//! keeps the recoveries.

use deadpool_postgres::Client;

use super::error::{Db, column, corrupt};
use crate::clock::Millis;
use crate::store::StoreError;
use crate::store::recoveries::{self, InboundCount, Recovery};

/// Store::inbound_counts: the source's minutes of the window, every slot summed.
pub(super) async fn inbound_counts(
    client: &Client,
    source: &str,
    since: Millis,
    until: Millis,
    now: Millis,
) -> Result<InboundCount, StoreError> {
    let (first, last) = recoveries::count_window(since, until, now);
    let statement = client
        .prepare_cached(
            "SELECT coalesce(sum(new), 0)::bigint, coalesce(sum(replays), 0)::bigint \
             FROM inbound_counts WHERE source = $1 AND minute >= $2 AND minute <= $3",
        )
        .await
        .db()?;
    let row = client
        .query_one(&statement, &[&source, &first, &last])
        .await
        .db()?;
    let count = |i: usize| -> Result<u64, StoreError> {
        Ok(u64::try_from(column::<i64>(&row, i)?).unwrap_or(0))
    };
    Ok(InboundCount {
        new: count(0)?,
        replays: count(1)?,
    })
}

/// Store::save_recovery: the row, then what [`recoveries::to_drop`] names, in one
/// transaction.
pub(super) async fn save(
    client: &mut Client,
    recovery: &Recovery,
    now: Millis,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(recovery).map_err(corrupt)?;
    let tx = client.transaction().await.db()?;
    tx.execute(
        "INSERT INTO recoveries (id, started_at, recovery_json) VALUES ($1, $2, $3) \
         ON CONFLICT (id) DO UPDATE SET recovery_json = excluded.recovery_json",
        &[&recovery.id, &recovery.started_at, &json],
    )
    .await
    .db()?;
    let held = tx
        .query("SELECT id, started_at FROM recoveries", &[])
        .await
        .db()?
        .iter()
        .map(|row| Ok((column::<String>(row, 0)?, column::<Millis>(row, 1)?)))
        .collect::<Result<Vec<_>, StoreError>>()?;
    let dropped = recoveries::to_drop(held, now);
    if !dropped.is_empty() {
        tx.execute("DELETE FROM recoveries WHERE id = ANY($1)", &[&dropped])
            .await
            .db()?;
    }
    tx.commit().await.db()
}

/// Store::recoveries: the live ones, newest first.
pub(super) async fn list(client: &Client, now: Millis) -> Result<Vec<Recovery>, StoreError> {
    let limit = recoveries::MAX_RECOVERIES as i64;
    let rows = client
        .query(
            "SELECT recovery_json FROM recoveries WHERE started_at > $1 \
             ORDER BY id DESC LIMIT $2",
            &[&(now - recoveries::RECOVERY_LIFETIME_MS), &limit],
        )
        .await
        .db()?;
    rows.iter()
        .map(|row| serde_json::from_str(&column::<String>(row, 0)?).map_err(corrupt))
        .collect()
}

/// Store::recovery.
pub(super) async fn get(
    client: &Client,
    id: &str,
    now: Millis,
) -> Result<Option<Recovery>, StoreError> {
    let row = client
        .query_opt(
            "SELECT recovery_json FROM recoveries WHERE id = $1 AND started_at > $2",
            &[&id, &(now - recoveries::RECOVERY_LIFETIME_MS)],
        )
        .await
        .db()?;
    row.map(|row| serde_json::from_str(&column::<String>(&row, 0)?).map_err(corrupt))
        .transpose()
}
