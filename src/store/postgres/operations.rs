//! Resend request ids (`Store::reserve_operation`, `Store::finish_operation`): no lifecycle
//! rule, each id's own record. Their lifetimes run on the database's clock, as on Redis: the
//! calls get no `now` from their caller, and every process must judge a reservation by one
//! clock.

use deadpool_postgres::Client;

use super::DB_NOW_MS;
use super::error::{Db, column};
use crate::store::{
    OperationReservation, StoreError, decode_operation, encode_finished_operation,
    encode_running_operation,
};

/// Reserves `key` unless a live record holds it; a record past its end is replaced.
pub(super) async fn reserve(
    client: &mut Client,
    key: &str,
    fingerprint: &str,
    ttl_secs: u64,
) -> Result<OperationReservation, StoreError> {
    let ttl_ms = i64::try_from(ttl_secs)
        .unwrap_or(i64::MAX / 1000)
        .saturating_mul(1000);
    let running = encode_running_operation(fingerprint);
    let tx = client.transaction().await.db()?;
    // Inserts, or replaces a lapsed record; a live one is left alone but locked (ON CONFLICT
    // locks the row it does not update), so the read below sees it as it stays.
    let reserve = tx
        .prepare_cached(&format!(
            "INSERT INTO operations AS o (key, response, expires_at) \
             VALUES ($1, $2, {DB_NOW_MS} + $3) \
             ON CONFLICT (key) DO UPDATE SET response = excluded.response, \
               expires_at = excluded.expires_at \
             WHERE o.expires_at <= {DB_NOW_MS}"
        ))
        .await
        .db()?;
    let reserved = tx
        .execute(&reserve, &[&key, &running, &ttl_ms])
        .await
        .db()?;
    let outcome = if reserved == 1 {
        OperationReservation::Fresh
    } else {
        let row = tx
            .query_one("SELECT response FROM operations WHERE key = $1", &[&key])
            .await
            .db()?;
        let stored: String = column(&row, 0)?;
        decode_operation(&stored, fingerprint)
    };
    tx.commit().await.db()?;
    Ok(outcome)
}

/// Records the answer of `key` for `ttl_secs`, replacing its reservation, or creating the
/// record if the reservation lapsed.
pub(super) async fn finish(
    client: &Client,
    key: &str,
    fingerprint: &str,
    response: &str,
    ttl_secs: u64,
) -> Result<(), StoreError> {
    let ttl_ms = i64::try_from(ttl_secs)
        .unwrap_or(i64::MAX / 1000)
        .saturating_mul(1000);
    let finished = encode_finished_operation(fingerprint, response);
    let statement = client
        .prepare_cached(&format!(
            "INSERT INTO operations (key, response, expires_at) \
             VALUES ($1, $2, {DB_NOW_MS} + $3) \
             ON CONFLICT (key) DO UPDATE SET response = excluded.response, \
               expires_at = excluded.expires_at"
        ))
        .await
        .db()?;
    client
        .execute(&statement, &[&key, &finished, &ttl_ms])
        .await
        .db()
        .map(|_| ())
}
