//! A message's row as the lifecycle rules read it, and an effect written back one message at
//! a time: the row read under its lock (`FOR UPDATE`), its changes (moving it and its history
//! to the partition its end names), its history row, its move in its ordering key's queue.
//! Release, resend and the one-by-one paths write this way; claims and completions of many
//! messages write their effects as sets (`apply_set.rs`), with the same pieces.

use deadpool_postgres::Transaction;
use tokio_postgres::error::SqlState;

use super::NOT_GONE;
use super::days::{Days, end_day};
use super::error::{Db, column, corrupt, db_error};
use super::listen::CHANNEL;
use super::locks::{Lock, lock};
use crate::clock::Millis;
use crate::store::lifecycle::{Effect, QueueMove, Snapshot};
use crate::store::{ANSWER_BODY_ROWS, HISTORY_TAIL, HistoryEntry, MessageState, StoreError};

/// The columns [`row_from`] reads, from `messages m`.
pub(super) const ROW_COLUMNS: &str = "m.state, m.lease_token, m.delivery_attempts, \
                           m.attempts_before_requeue, m.deadline, m.due_at, m.resume_at, \
                           m.deliver_again, m.ends_at, m.lease_until, m.ordering_key, m.end_day";

/// A message's row as the rules read it, with what applying an effect needs besides.
pub(super) struct Row {
    pub snapshot: Snapshot,
    pub lease_until: Option<Millis>,
    pub ordering_key: String,
    /// The partition it is in.
    pub end_day: i32,
}

/// A [`Row`] from the first columns of `row`, [`ROW_COLUMNS`].
pub(super) fn row_from(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
    let state: String = column(row, 0)?;
    let token: i64 = column(row, 1)?;
    let attempts: i32 = column(row, 2)?;
    let backoff_from: i32 = column(row, 3)?;
    Ok(Row {
        snapshot: Snapshot {
            state: MessageState::parse(&state)
                .ok_or_else(|| corrupt(format!("a message has state `{state}`")))?,
            token: u64::try_from(token).map_err(corrupt)?,
            attempts: u32::try_from(attempts).map_err(corrupt)?,
            backoff_from: u32::try_from(backoff_from).map_err(corrupt)?,
            deadline: column(row, 4)?,
            due_at: column(row, 5)?,
            resume_at: column(row, 6)?,
            again: column(row, 7)?,
            ends_at: column(row, 8)?,
        },
        lease_until: column(row, 9)?,
        ordering_key: column(row, 10)?,
        end_day: column(row, 11)?,
    })
}

/// Reads message `id` (not gone) and locks its row until the transaction ends.
pub(super) async fn read_row(tx: &Transaction<'_>, id: &str) -> Result<Option<Row>, StoreError> {
    let statement = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS} FROM messages m WHERE m.id = $1 AND {NOT_GONE} FOR UPDATE"
        ))
        .await
        .db()?;
    match tx.query_opt(&statement, &[&id]).await.db()? {
        Some(row) => row_from(&row).map(Some),
        None => Ok(None),
    }
}

pub(super) fn to_i32(n: u32) -> Result<i32, StoreError> {
    i32::try_from(n).map_err(corrupt)
}

/// Writes `effect` to message `id`, read as `row` in this same transaction: its changes (in
/// the partition its end names, moving it and its history there when that changed), its
/// history row, its move in its queue.
pub(super) async fn apply(
    tx: &Transaction<'_>,
    days: &Days,
    id: &str,
    row: &Row,
    effect: Effect,
) -> Result<(), StoreError> {
    let after = effect.changes.applied_to(&row.snapshot);
    let lease_until = effect.changes.lease_until.unwrap_or(row.lease_until);
    let day = end_day(after.ends_at);
    if !days.known(day) {
        return Err(missing_day(day));
    }
    let statement = tx
        .prepare_cached(
            "UPDATE messages SET end_day = $3, state = $4, lease_token = $5, \
             delivery_attempts = $6, attempts_before_requeue = $7, deadline = $8, due_at = $9, \
             lease_until = $10, resume_at = $11, deliver_again = $12, ends_at = $13, \
             history_total = history_total + $14, \
             first_entry = CASE WHEN history_total = 0 THEN $15 ELSE first_entry END \
             WHERE id = $1 AND end_day = $2 RETURNING history_total",
        )
        .await
        .db()?;
    let recorded: i64 = effect.history.is_some().into();
    let entry = effect
        .history
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(corrupt)?;
    let updated = tx
        .query_one(
            &statement,
            &[
                &id,
                &row.end_day,
                &day,
                &after.state.as_str(),
                &i64::try_from(after.token).map_err(corrupt)?,
                &to_i32(after.attempts)?,
                &to_i32(after.backoff_from)?,
                &after.deadline,
                &after.due_at,
                &lease_until,
                &after.resume_at,
                &after.again,
                &after.ends_at,
                &recorded,
                &entry,
            ],
        )
        .await;
    let history_total: i64 = match updated {
        Ok(updated) => column(&updated, 0)?,
        // No partition for the day: another process dropped it. The retry creates it again.
        Err(e) if e.code() == Some(&SqlState::CHECK_VIOLATION) && day != 0 => {
            days.forget(day);
            return Err(missing_day(day));
        }
        Err(e) => return Err(db_error(e)),
    };
    if day != row.end_day {
        tx.execute(
            "UPDATE history SET end_day = $3 WHERE message_id = $1 AND end_day = $2",
            &[&id, &row.end_day, &day],
        )
        .await
        .db()?;
    }
    if let Some(entry) = entry
        && !is_first_row(history_total)
    {
        record_later_history(tx, id, day, history_total, &entry).await?;
    }
    move_in_queue(tx, &row.ordering_key, id, effect.queue).await
}

pub(super) fn missing_day(day: i32) -> StoreError {
    StoreError::Unavailable(format!(
        "the partition of day {day} of finished messages is missing; it is created on retry"
    ))
}

/// Whether history row number `seq` is its message's first, which layout 5 keeps in the
/// message's row (`first_entry`), written with it, rather than in `history`: most messages
/// have no other, and a row of its own cost more than the entry (BENCHMARKS.md, "PostgreSQL
/// layout 5").
pub(super) fn is_first_row(seq: i64) -> bool {
    seq == 1
}

/// Appends history row number `seq` (the message's new `history_total`, after its first) as
/// `json`, then [`tidy_history`].
async fn record_later_history(
    tx: &Transaction<'_>,
    id: &str,
    day: i32,
    seq: i64,
    json: &str,
) -> Result<(), StoreError> {
    let insert = tx
        .prepare_cached(
            "INSERT INTO history (message_id, end_day, seq, entry_json) VALUES ($1, $2, $3, $4)",
        )
        .await
        .db()?;
    tx.execute(&insert, &[&id, &day, &seq, &json]).await.db()?;
    tidy_history(tx, id, day, seq).await
}

/// Whether appending row number `seq` leaves older rows for [`tidy_history`] to trim or to
/// drop an answer's body from: not before the history is longer than the rows it keeps whole.
pub(super) fn needs_tidy(seq: i64) -> bool {
    let whole = i64::try_from(ANSWER_BODY_ROWS.min(HISTORY_TAIL)).unwrap_or(i64::MAX);
    seq > whole.saturating_add(1)
}

/// After row number `seq` was appended: keeps the first row and the latest [`HISTORY_TAIL`];
/// the row that leaves the latest [`ANSWER_BODY_ROWS`] (unless it is the first) drops its
/// answer's body (store::lifecycle's rule).
pub(super) async fn tidy_history(
    tx: &Transaction<'_>,
    id: &str,
    day: i32,
    seq: i64,
) -> Result<(), StoreError> {
    if !needs_tidy(seq) {
        return Ok(());
    }
    let tail = i64::try_from(HISTORY_TAIL).map_err(corrupt)?;
    if seq > tail + 1 {
        let trim = tx
            .prepare_cached(
                "DELETE FROM history WHERE message_id = $1 AND end_day = $2 \
                 AND seq > 1 AND seq <= $3",
            )
            .await
            .db()?;
        tx.execute(&trim, &[&id, &day, &(seq - tail)]).await.db()?;
    }
    let older = seq - i64::try_from(ANSWER_BODY_ROWS).map_err(corrupt)?;
    if older < 2 {
        return Ok(());
    }
    let read = tx
        .prepare_cached(
            "SELECT entry_json FROM history WHERE message_id = $1 AND end_day = $2 AND seq = $3",
        )
        .await
        .db()?;
    let Some(found) = tx.query_opt(&read, &[&id, &day, &older]).await.db()? else {
        return Ok(());
    };
    let json: String = column(&found, 0)?;
    let mut entry: HistoryEntry = serde_json::from_str(&json).map_err(corrupt)?;
    if !entry.drop_answer_body() {
        return Ok(());
    }
    let json = serde_json::to_string(&entry).map_err(corrupt)?;
    tx.execute(
        "UPDATE history SET entry_json = $4 WHERE message_id = $1 AND end_day = $2 AND seq = $3",
        &[&id, &day, &older, &json],
    )
    .await
    .db()
    .map(|_| ())
}

/// Applies a queue move of message `id` of `ordering_key` (the rule decided the times), under
/// the ordering key's lock.
pub(super) async fn move_in_queue(
    tx: &Transaction<'_>,
    ordering_key: &str,
    id: &str,
    queue: QueueMove,
) -> Result<(), StoreError> {
    match queue {
        QueueMove::Stay => Ok(()),
        QueueMove::Join { due_if_head } => {
            lock(tx, Lock::OrderingKey, ordering_key).await?;
            let insert = tx
                .prepare_cached("INSERT INTO queue (ordering_key, id) VALUES ($1, $2)")
                .await
                .db()?;
            tx.execute(&insert, &[&ordering_key, &id]).await.db()?;
            // Made the head: due now, so other processes' dispatchers are woken on commit.
            let head = tx
                .prepare_cached(&format!(
                    "WITH head AS (UPDATE messages SET due_at = $3 WHERE id = $2 AND end_day = 0 \
                     AND NOT EXISTS (SELECT 1 FROM queue WHERE ordering_key = $1 AND id <> $2) \
                     RETURNING 1) SELECT pg_notify('{CHANNEL}', '') FROM head"
                ))
                .await
                .db()?;
            tx.execute(&head, &[&ordering_key, &id, &due_if_head])
                .await
                .db()
                .map(|_| ())
        }
        QueueMove::Leave { next_due_at } => {
            lock(tx, Lock::OrderingKey, ordering_key).await?;
            let delete = tx
                .prepare_cached("DELETE FROM queue WHERE id = $1")
                .await
                .db()?;
            tx.execute(&delete, &[&id]).await.db()?;
            // The next of the key, if any, is the head now: woken as a new message is.
            let next = tx
                .prepare_cached(&format!(
                    "WITH next AS (UPDATE messages SET due_at = $2 WHERE end_day = 0 AND id = \
                     (SELECT id FROM queue WHERE ordering_key = $1 ORDER BY position LIMIT 1) \
                     RETURNING 1) SELECT pg_notify('{CHANNEL}', '') FROM next"
                ))
                .await
                .db()?;
            tx.execute(&next, &[&ordering_key, &next_due_at])
                .await
                .db()
                .map(|_| ())
        }
    }
}
