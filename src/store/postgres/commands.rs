//! The lifecycle transactions after accept: lease, finish, give back, resend. Each reads the
//! message under a row lock (`FOR UPDATE`) in its transaction, asks its `store::lifecycle`
//! rule, and writes the effect as it is, so the transaction holds what the rule read (the
//! guard of `lifecycle::Guard`, by construction) and decides nothing itself.
//!
//! Claims take due messages with `FOR UPDATE SKIP LOCKED`: processes sharing the database
//! never wait for each other's claims, and never lease one message twice. A move in an
//! ordering key's queue runs under that key's lock (`locks.rs`). Completions, which are
//! group-committed, are in `complete.rs`.

use deadpool_postgres::{Client, Transaction};
use tokio_postgres::error::SqlState;

use super::days::{Days, end_day};
use super::error::{Db, column, corrupt, db_error};
use super::listen::CHANNEL;
use super::locks::{Lock, lock};
use super::{DB_NOW_MS, NOT_GONE};
use crate::clock::Millis;
use crate::store::lifecycle::{self, Effect, QueueMove, Snapshot};
use crate::store::{
    ANSWER_BODY_ROWS, HISTORY_TAIL, HistoryEntry, Lease, MessageState, NewMessage, ResendEffect,
    ResendMark, StoreError,
};

/// The columns [`row_from`] reads, from `messages m`.
const ROW_COLUMNS: &str = "m.state, m.lease_token, m.delivery_attempts, \
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
fn row_from(row: &tokio_postgres::Row) -> Result<Row, StoreError> {
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

fn to_i32(n: u32) -> Result<i32, StoreError> {
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
             history_total = history_total + $14 \
             WHERE id = $1 AND end_day = $2 RETURNING history_total",
        )
        .await
        .db()?;
    let recorded: i64 = effect.history.is_some().into();
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
    if let Some(entry) = &effect.history {
        record_history(tx, id, day, history_total, entry).await?;
    }
    move_in_queue(tx, &row.ordering_key, id, effect.queue).await
}

/// A message's effect as a claim transaction applies it: the row it read, and the rule's
/// decision.
struct Decided {
    id: String,
    row: Row,
    effect: Effect,
}

/// Writes `decided`. The effects that change only their message's own columns, in its own
/// partition (a lease taken, a lease run out: no history row, no queue move, no move between
/// partitions), go in one statement, so a claim of many messages is not a round trip each;
/// any other is written by [`apply`].
async fn apply_all(
    tx: &Transaction<'_>,
    days: &Days,
    decided: Vec<Decided>,
) -> Result<(), StoreError> {
    let mut in_place = InPlace::default();
    for Decided { id, row, effect } in decided {
        let after = effect.changes.applied_to(&row.snapshot);
        let stays = effect.history.is_none()
            && matches!(effect.queue, QueueMove::Stay)
            && end_day(after.ends_at) == row.end_day;
        if !stays {
            apply(tx, days, &id, &row, effect).await?;
            continue;
        }
        in_place
            .lease_until
            .push(effect.changes.lease_until.unwrap_or(row.lease_until));
        in_place.ids.push(id);
        in_place.days.push(row.end_day);
        in_place.states.push(after.state.as_str());
        in_place
            .tokens
            .push(i64::try_from(after.token).map_err(corrupt)?);
        in_place.attempts.push(to_i32(after.attempts)?);
        in_place.backoff_from.push(to_i32(after.backoff_from)?);
        in_place.deadlines.push(after.deadline);
        in_place.due_at.push(after.due_at);
        in_place.resume_at.push(after.resume_at);
        in_place.again.push(after.again);
        in_place.ends_at.push(after.ends_at);
    }
    if in_place.ids.is_empty() {
        return Ok(());
    }
    let statement = tx
        .prepare_cached(
            "UPDATE messages m SET state = u.state, lease_token = u.token, \
             delivery_attempts = u.attempts, attempts_before_requeue = u.backoff_from, \
             deadline = u.deadline, due_at = u.due_at, lease_until = u.lease_until, \
             resume_at = u.resume_at, deliver_again = u.again, ends_at = u.ends_at \
             FROM unnest($1::text[], $2::int4[], $3::text[], $4::int8[], $5::int4[], \
             $6::int4[], $7::int8[], $8::int8[], $9::int8[], $10::int8[], $11::bool[], \
             $12::int8[]) AS u (id, end_day, state, token, attempts, backoff_from, deadline, \
             due_at, lease_until, resume_at, again, ends_at) \
             WHERE m.id = u.id AND m.end_day = u.end_day",
        )
        .await
        .db()?;
    let i = &in_place;
    let updated = tx
        .execute(
            &statement,
            &[
                &i.ids,
                &i.days,
                &i.states,
                &i.tokens,
                &i.attempts,
                &i.backoff_from,
                &i.deadlines,
                &i.due_at,
                &i.lease_until,
                &i.resume_at,
                &i.again,
                &i.ends_at,
            ],
        )
        .await
        .db()?;
    // Every row was read under its lock in this transaction: one missing is not a race.
    if updated != i.ids.len() as u64 {
        return Err(corrupt(format!(
            "{} of {} locked messages were updated",
            updated,
            i.ids.len()
        )));
    }
    Ok(())
}

/// [`apply_all`]'s in-place writes, a column each.
#[derive(Default)]
struct InPlace {
    ids: Vec<String>,
    days: Vec<i32>,
    states: Vec<&'static str>,
    tokens: Vec<i64>,
    attempts: Vec<i32>,
    backoff_from: Vec<i32>,
    deadlines: Vec<Millis>,
    due_at: Vec<Option<Millis>>,
    lease_until: Vec<Option<Millis>>,
    resume_at: Vec<Option<Millis>>,
    again: Vec<bool>,
    ends_at: Vec<Option<Millis>>,
}

fn missing_day(day: i32) -> StoreError {
    StoreError::Unavailable(format!(
        "the partition of day {day} of finished messages is missing; it is created on retry"
    ))
}

/// Appends history row number `seq` (the message's new `history_total`), keeping the first
/// row and the latest [`HISTORY_TAIL`]; the row that leaves the latest [`ANSWER_BODY_ROWS`]
/// (unless it is the first) drops its answer's body (store::lifecycle's rule).
async fn record_history(
    tx: &Transaction<'_>,
    id: &str,
    day: i32,
    seq: i64,
    entry: &HistoryEntry,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(entry).map_err(corrupt)?;
    let insert = tx
        .prepare_cached(
            "INSERT INTO history (message_id, end_day, seq, entry_json) VALUES ($1, $2, $3, $4)",
        )
        .await
        .db()?;
    tx.execute(&insert, &[&id, &day, &seq, &json]).await.db()?;
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

/// Applies store::lifecycle::expire_lease, then store::lifecycle::claim, to the messages the
/// rules' order picks that no other transaction holds: leases run out by the lease clock
/// (the database's, or `now` for tests on a virtual clock), then due by `now`, earliest first.
pub(super) async fn claim(
    client: &mut Client,
    days: &Days,
    now: Millis,
    limit: usize,
    lease_ms: u64,
    database_clock: bool,
) -> Result<Vec<Lease>, StoreError> {
    for _ in 0..CLAIM_TRIES {
        if let Some(leases) = claim_once(client, days, now, limit, lease_ms, database_clock).await?
        {
            return Ok(leases);
        }
    }
    // Raced every time: nothing is leased now, and the next claim (a wake-up or the poll)
    // finds the messages where the racing writes left them.
    Ok(Vec::new())
}

/// How often a claim is tried at once when it meets a row another transaction moved.
const CLAIM_TRIES: usize = 5;

/// One claim transaction; `None` when it met a row that a concurrent write moved to another
/// partition (a complete finishing a message into its day, a resend bringing one back).
/// `SKIP LOCKED` skips rows locked now, but a row already moved fails the lock with
/// `40001` instead, and the whole transaction with it; it leased nothing and is tried again.
async fn claim_once(
    client: &mut Client,
    days: &Days,
    now: Millis,
    limit: usize,
    lease_ms: u64,
    database_clock: bool,
) -> Result<Option<Vec<Lease>>, StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let tx = client.transaction().await.db()?;
    let lease_now: Millis = if database_clock {
        let row = tx
            .query_one(&format!("SELECT {DB_NOW_MS}"), &[])
            .await
            .db()?;
        column(&row, 0)?
    } else {
        now
    };
    let lease_until = lease_now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    let expired = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS}, m.id FROM messages m \
             WHERE m.end_day = 0 AND m.lease_until <= $1 \
             ORDER BY m.lease_until, m.id LIMIT $2 FOR UPDATE SKIP LOCKED"
        ))
        .await
        .db()?;
    let Some(expired) = unless_moved(tx.query(&expired, &[&lease_now, &limit]).await)? else {
        return Ok(None);
    };
    let mut decided = Vec::with_capacity(expired.len());
    for found in expired {
        let row = row_from(&found)?;
        let effect = lifecycle::expire_lease(&row.snapshot, now);
        decided.push(Decided {
            id: column(&found, 12)?,
            row,
            effect,
        });
    }
    apply_all(&tx, days, decided).await?;
    let due = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS}, m.id, m.message_json FROM messages m \
             WHERE m.end_day = 0 AND m.due_at <= $1 \
             ORDER BY m.due_at, m.id LIMIT $2 FOR UPDATE SKIP LOCKED"
        ))
        .await
        .db()?;
    let mut leases = Vec::new();
    let Some(due) = unless_moved(tx.query(&due, &[&now, &limit]).await)? else {
        return Ok(None);
    };
    let mut decided = Vec::with_capacity(due.len());
    for found in due {
        let row = row_from(&found)?;
        let message_json: String = column(&found, 13)?;
        let effect = lifecycle::claim(&row.snapshot, lease_until);
        let leased = effect.changes.applied_to(&row.snapshot);
        let message: NewMessage = serde_json::from_str(&message_json).map_err(corrupt)?;
        leases.push(Lease::of(message, &leased));
        decided.push(Decided {
            id: column(&found, 12)?,
            row,
            effect,
        });
    }
    apply_all(&tx, days, decided).await?;
    tx.commit().await.db()?;
    Ok(Some(leases))
}

/// A claim query's rows, or `None` when a row it tried to lock had been moved to another
/// partition by a concurrent update (SQLSTATE `40001`).
fn unless_moved(
    rows: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
) -> Result<Option<Vec<tokio_postgres::Row>>, StoreError> {
    match rows {
        Ok(rows) => Ok(Some(rows)),
        Err(e) if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE) => Ok(None),
        Err(e) => Err(db_error(e)),
    }
}

/// Applies store::lifecycle::release.
pub(super) async fn release(
    client: &mut Client,
    days: &Days,
    lease: &Lease,
    next_at: Millis,
) -> Result<bool, StoreError> {
    let id = lease.message.id.as_str();
    let tx = client.transaction().await.db()?;
    let Some(row) = read_row(&tx, id).await? else {
        return Ok(false);
    };
    let Some(effect) = lifecycle::release(&row.snapshot, lease.token, next_at) else {
        return Ok(false);
    };
    apply(&tx, days, id, &row, effect).await?;
    // A lease given back due now (a process shutting down) is for another process to take
    // at once; one given back for later (a busy host) wakes nobody.
    tx.execute(
        &format!("SELECT pg_notify('{CHANNEL}', '') WHERE $1 <= {DB_NOW_MS}"),
        &[&next_at],
    )
    .await
    .db()?;
    tx.commit().await.db()?;
    Ok(true)
}

/// Applies store::lifecycle::resend. The sweep horizon is read under a share lock, so a sweep
/// that raises it (and drops the days it passes) waits for this transaction: a message this
/// resend moves back to the live partition is out of every day a drop takes.
pub(super) async fn resend(
    client: &mut Client,
    days: &Days,
    id: &str,
    mark: ResendMark,
    fresh_deadline: Millis,
    now: Millis,
) -> Result<ResendEffect, StoreError> {
    let tx = client.transaction().await.db()?;
    tx.execute("SELECT swept_to FROM sweep_horizon FOR SHARE", &[])
        .await
        .db()?;
    let ordering_key = tx
        .query_opt(
            &format!("SELECT m.ordering_key FROM messages m WHERE m.id = $1 AND {NOT_GONE}"),
            &[&id],
        )
        .await
        .db()?;
    let row = match ordering_key {
        Some(found) => {
            let ordering_key: String = column(&found, 0)?;
            lock(&tx, Lock::OrderingKey, &ordering_key).await?;
            read_row(&tx, id).await?
        }
        None => None,
    };
    let snapshot = row.as_ref().map(|r| r.snapshot);
    let (outcome, effect) = lifecycle::resend(snapshot.as_ref(), mark, fresh_deadline, now);
    if let (Some(row), Some(effect)) = (&row, effect) {
        apply(&tx, days, id, row, effect).await?;
        // A resend brings a delivery forward, usually to now: other processes' dispatchers
        // are woken on commit (a requeue's queue move already notified; a second notification
        // of one transaction is folded into the first).
        tx.execute(&format!("SELECT pg_notify('{CHANNEL}', '')"), &[])
            .await
            .db()?;
        tx.commit().await.db()?;
    }
    Ok(outcome)
}
