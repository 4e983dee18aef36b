//! The lifecycle transactions after accept: lease, finish, give back, resend, sweep; and the
//! resend operations' reservations. Each runs inside the writer's transaction, in a savepoint
//! of its own: it reads the message, asks its `store::lifecycle` rule, and applies the
//! effect, so the transaction holds what the rule read.

use rusqlite::{Connection, OptionalExtension, params};

use super::error::{Db, corrupt};
use super::{secs_to_ms, wall_clock_ms};
use crate::clock::Millis;
use crate::store::counts::{self, Tally};
use crate::store::lifecycle::{self, Effect, Lifetimes, QueueMove, Snapshot};
use crate::store::recoveries::{self, Recovery};
use crate::store::{
    ANSWER_BODY_ROWS, Completion, HISTORY_TAIL, HistoryEntry, Lease, MessageState, NewMessage,
    OperationReservation, ResendEffect, ResendMark, SWEEP_LIMIT, StoreError, decode_operation,
    encode_finished_operation, encode_running_operation,
};

/// Applies a queue move of message `id` of `ordering_key` (the rule decided the times).
fn move_in_queue(
    conn: &Connection,
    ordering_key: &str,
    id: &str,
    queue: QueueMove,
) -> Result<(), StoreError> {
    match queue {
        QueueMove::Stay => Ok(()),
        QueueMove::Join { due_if_head } => {
            conn.prepare_cached("INSERT INTO queue (ordering_key, id) VALUES (?1, ?2)")
                .db()?
                .execute(params![ordering_key, id])
                .db()?;
            conn.prepare_cached(
                "UPDATE messages SET due_at = ?2 WHERE id = ?1 AND NOT EXISTS \
                 (SELECT 1 FROM queue WHERE ordering_key = ?3 AND id <> ?1)",
            )
            .db()?
            .execute(params![id, due_if_head, ordering_key])
            .db()?;
            Ok(())
        }
        QueueMove::Leave { next_due_at } => {
            conn.prepare_cached("DELETE FROM queue WHERE id = ?1")
                .db()?
                .execute(params![id])
                .db()?;
            conn.prepare_cached(
                "UPDATE messages SET due_at = ?2 WHERE id = \
                 (SELECT id FROM queue WHERE ordering_key = ?1 ORDER BY position LIMIT 1)",
            )
            .db()?
            .execute(params![ordering_key, next_due_at])
            .db()?;
            Ok(())
        }
    }
}

/// A message's row as the rules read it, with what applying an effect needs besides.
struct Row {
    snapshot: Snapshot,
    lease_until: Option<Millis>,
    ordering_key: String,
}

/// The columns a [`Row`] is read from, in the order [`raw_row`] takes them.
macro_rules! row_columns {
    () => {
        "state, lease_token, delivery_attempts, attempts_before_requeue, deadline, due_at, \
         resume_at, deliver_again, expires_at, lease_until, ordering_key"
    };
}

/// A [`Row`] from the columns of [`row_columns`] starting at `at`, with its state and token as
/// stored (checked by [`checked_row`]).
fn raw_row(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<(String, i64, Row)> {
    let resume_at: Millis = r.get(at + 6)?;
    let row = Row {
        snapshot: Snapshot {
            state: MessageState::Pending,
            token: 0,
            attempts: r.get(at + 2)?,
            backoff_from: r.get(at + 3)?,
            deadline: r.get(at + 4)?,
            due_at: r.get(at + 5)?,
            // 0 is none (schema.sql)
            resume_at: (resume_at != 0).then_some(resume_at),
            again: r.get(at + 7)?,
            ends_at: r.get(at + 8)?,
        },
        lease_until: r.get(at + 9)?,
        ordering_key: r.get(at + 10)?,
    };
    Ok((r.get(at)?, r.get(at + 1)?, row))
}

fn checked_row(id: &str, (state, token, mut row): (String, i64, Row)) -> Result<Row, StoreError> {
    row.snapshot.state = MessageState::parse(&state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{state}`")))?;
    // SQLite integers are signed; tokens start at 1 and only grow.
    row.snapshot.token = u64::try_from(token).map_err(corrupt)?;
    Ok(row)
}

fn read_row(conn: &Connection, id: &str) -> Result<Option<Row>, StoreError> {
    conn.prepare_cached(concat!(
        "SELECT ",
        row_columns!(),
        " FROM messages WHERE id = ?1"
    ))
    .db()?
    .query_row(params![id], |r| raw_row(r, 0))
    .optional()
    .db()?
    .map(|raw| checked_row(id, raw))
    .transpose()
}

/// Writes `effect` to message `id`, read as `row` in this same transaction: its changes, its
/// history row, its move in its queue.
fn apply(conn: &Connection, id: &str, row: &Row, effect: Effect) -> Result<(), StoreError> {
    let after = effect.changes.applied_to(&row.snapshot);
    let lease_until = effect.changes.lease_until.unwrap_or(row.lease_until);
    conn.prepare_cached(
        "UPDATE messages SET state = ?2, lease_token = ?3, delivery_attempts = ?4, \
         attempts_before_requeue = ?5, deadline = ?6, due_at = ?7, lease_until = ?8, \
         resume_at = ?9, deliver_again = ?10, expires_at = ?11 WHERE id = ?1",
    )
    .db()?
    .execute(params![
        id,
        after.state.as_str(),
        i64::try_from(after.token).map_err(corrupt)?,
        after.attempts,
        after.backoff_from,
        after.deadline,
        after.due_at,
        lease_until,
        after.resume_at.unwrap_or(0),
        after.again,
        after.ends_at,
    ])
    .db()?;
    if let Some(history) = &effect.history {
        record_history(conn, id, &serde_json::to_string(history).map_err(corrupt)?)?;
    }
    move_in_queue(conn, &row.ordering_key, id, effect.queue)
}

/// The accept's queue move (store::lifecycle::accept): the only effect applied to a row just
/// inserted.
pub(super) fn join_queue(
    conn: &Connection,
    ordering_key: &str,
    id: &str,
    queue: QueueMove,
) -> Result<(), StoreError> {
    move_in_queue(conn, ordering_key, id, queue)
}

/// Applies store::lifecycle::expire_lease, then store::lifecycle::claim, to the messages the
/// rules' order picks: leases run out by `now`, then due by `now`, earliest first.
pub(super) fn claim(
    conn: &Connection,
    now: Millis,
    limit: usize,
    lease_ms: u64,
) -> Result<Vec<Lease>, StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let lease_until = now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    let expired: Vec<String> = conn
        .prepare_cached(
            "SELECT id FROM messages WHERE lease_until <= ?1 ORDER BY lease_until, id LIMIT ?2",
        )
        .db()?
        .query_map(params![now, limit], |r| r.get(0))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    for id in &expired {
        if let Some(row) = read_row(conn, id)? {
            let effect = lifecycle::expire_lease(&row.snapshot, now);
            apply(conn, id, &row, effect)?;
        }
    }
    // Each due message with what its rule reads, in one query.
    let due: Vec<(String, String, (String, i64, Row))> = conn
        .prepare_cached(concat!(
            "SELECT id, message_json, ",
            row_columns!(),
            " FROM messages WHERE due_at <= ?1 ORDER BY due_at, id LIMIT ?2"
        ))
        .db()?
        .query_map(params![now, limit], |r| {
            Ok((r.get(0)?, r.get(1)?, raw_row(r, 2)?))
        })
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    let mut leases = Vec::with_capacity(due.len());
    for (id, message_json, raw) in due {
        let row = checked_row(&id, raw)?;
        let effect = lifecycle::claim(&row.snapshot, lease_until);
        let leased = effect.changes.applied_to(&row.snapshot);
        apply(conn, &id, &row, effect)?;
        let message: NewMessage = serde_json::from_str(&message_json).map_err(corrupt)?;
        leases.push(Lease::of(message, &leased));
    }
    Ok(leases)
}

/// Appends a history row, keeping the first row and the latest [`HISTORY_TAIL`]; the row that
/// leaves the latest [`ANSWER_BODY_ROWS`] drops its answer's body (store::lifecycle's rule).
fn record_history(conn: &Connection, id: &str, attempt_json: &str) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT INTO attempts (message_id, attempt_json) VALUES (?1, ?2)")
        .db()?
        .execute(params![id, attempt_json])
        .db()?;
    conn.prepare_cached("UPDATE messages SET history_total = history_total + 1 WHERE id = ?1")
        .db()?
        .execute(params![id])
        .db()?;
    conn.prepare_cached(
        "DELETE FROM attempts WHERE seq IN (SELECT seq FROM attempts WHERE message_id = ?1 \
         ORDER BY seq LIMIT 1 OFFSET 1) \
         AND (SELECT count(*) FROM attempts WHERE message_id = ?1) > ?2",
    )
    .db()?
    .execute(params![id, HISTORY_TAIL as i64 + 1])
    .db()?;
    drop_older_answer_body(conn, id)
}

/// The row [`ANSWER_BODY_ROWS`] before the newest, unless it is the first, without its body.
fn drop_older_answer_body(conn: &Connection, id: &str) -> Result<(), StoreError> {
    let older: Option<(i64, String)> = conn
        .prepare_cached(
            "SELECT seq, attempt_json FROM attempts WHERE message_id = ?1 \
             AND seq > (SELECT min(seq) FROM attempts WHERE message_id = ?1) \
             ORDER BY seq DESC LIMIT 1 OFFSET ?2",
        )
        .db()?
        .query_row(params![id, ANSWER_BODY_ROWS as i64], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()
        .db()?;
    let Some((seq, json)) = older else {
        return Ok(());
    };
    let mut row: HistoryEntry = serde_json::from_str(&json).map_err(corrupt)?;
    if !row.drop_answer_body() {
        return Ok(());
    }
    let json = serde_json::to_string(&row).map_err(corrupt)?;
    conn.prepare_cached("UPDATE attempts SET attempt_json = ?1 WHERE seq = ?2")
        .db()?
        .execute(params![json, seq])
        .db()
        .map(|_| ())
}

/// Applies store::lifecycle::complete.
pub(super) fn complete(
    conn: &Connection,
    lease: &Lease,
    attempt: HistoryEntry,
    completion: Completion,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<bool, StoreError> {
    let id = lease.message.id.as_str();
    let Some(row) = read_row(conn, id)? else {
        return Ok(false);
    };
    match lifecycle::complete(
        &row.snapshot,
        lease.token,
        attempt,
        completion,
        now,
        lifetimes,
    ) {
        Some(effect) => {
            apply(conn, id, &row, effect)?;
            count(conn, Tally::of(completion), now)?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Adds a completion to its minute's counts (store/counts.rs), in the completion's savepoint.
fn count(conn: &Connection, tally: Tally, now: Millis) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO delivery_counts (minute, deliveries, failures, dead) VALUES (?1, ?2, ?3, ?4) \
         ON CONFLICT (minute) DO UPDATE SET deliveries = deliveries + excluded.deliveries, \
         failures = failures + excluded.failures, dead = dead + excluded.dead",
    )
    .db()?
    .execute(params![
        counts::minute_of(now),
        tally.deliveries as i64,
        tally.failures as i64,
        tally.dead as i64
    ])
    .db()?;
    Ok(())
}

/// Applies store::lifecycle::release.
pub(super) fn release(
    conn: &Connection,
    lease: &Lease,
    next_at: Millis,
) -> Result<bool, StoreError> {
    let id = lease.message.id.as_str();
    let Some(row) = read_row(conn, id)? else {
        return Ok(false);
    };
    match lifecycle::release(&row.snapshot, lease.token, next_at) {
        Some(effect) => apply(conn, id, &row, effect).map(|()| true),
        None => Ok(false),
    }
}

/// Applies store::lifecycle::resend.
pub(super) fn resend(
    conn: &Connection,
    id: &str,
    mark: ResendMark,
    fresh_deadline: Millis,
    now: Millis,
) -> Result<ResendEffect, StoreError> {
    let row = read_row(conn, id)?;
    let snapshot = row.as_ref().map(|r| r.snapshot);
    let (outcome, effect) = lifecycle::resend(snapshot.as_ref(), mark, fresh_deadline, now);
    if let (Some(row), Some(effect)) = (&row, effect) {
        apply(conn, id, row, effect)?;
    }
    Ok(outcome)
}

/// Store::reserve_operation: no lifecycle rule, the resend request id's own record.
pub(super) fn reserve_operation(
    conn: &Connection,
    key: &str,
    fingerprint: &str,
    ttl_secs: u64,
) -> Result<OperationReservation, StoreError> {
    let now = wall_clock_ms();
    let existing: Option<Option<String>> = conn
        .prepare_cached("SELECT response FROM operations WHERE key = ?1 AND expires_at > ?2")
        .db()?
        .query_row(params![key, now], |r| r.get(0))
        .optional()
        .db()?;
    match existing {
        Some(Some(stored)) => Ok(decode_operation(&stored, fingerprint)),
        // A reservation written before fingerprints were stored.
        Some(None) => Ok(OperationReservation::InProgress),
        None => {
            store_operation(
                conn,
                key,
                &encode_running_operation(fingerprint),
                now.saturating_add(secs_to_ms(ttl_secs)),
            )?;
            Ok(OperationReservation::Fresh)
        }
    }
}

/// Store::finish_operation: replaces the reservation, or creates the record if it lapsed.
pub(super) fn finish_operation(
    conn: &Connection,
    key: &str,
    fingerprint: &str,
    response: &str,
    ttl_secs: u64,
) -> Result<(), StoreError> {
    store_operation(
        conn,
        key,
        &encode_finished_operation(fingerprint, response),
        wall_clock_ms().saturating_add(secs_to_ms(ttl_secs)),
    )
}

fn store_operation(
    conn: &Connection,
    key: &str,
    stored: &str,
    expires_at: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR REPLACE INTO operations (key, response, expires_at) VALUES (?1, ?2, ?3)",
    )
    .db()?
    .execute(params![key, stored, expires_at])
    .db()
    .map(|_| ())
}

/// Applies store::lifecycle::sweep (src/store/lifecycle/rules.rs): deletes up to [`SWEEP_LIMIT`]
/// expired rows of each kind. `now` is the caller's time; operation reservations expire on
/// the wall clock they were set with.
pub(super) fn sweep(conn: &Connection, now: Millis) -> Result<usize, StoreError> {
    let mut deleted = 0;
    for (sql, at) in [
        (
            "DELETE FROM dedupe_claims WHERE key IN \
             (SELECT key FROM dedupe_claims WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM payments WHERE payment_id IN \
             (SELECT payment_id FROM payments WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM seals WHERE key IN \
             (SELECT key FROM seals WHERE expires_at <= ?1 LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM operations WHERE key IN \
             (SELECT key FROM operations WHERE expires_at <= ?1 LIMIT ?2)",
            wall_clock_ms(),
        ),
        // A minute's counts end their lifetime after the minute starts (counts::is_gone).
        (
            "DELETE FROM delivery_counts WHERE minute IN \
             (SELECT minute FROM delivery_counts WHERE minute <= ?1 LIMIT ?2)",
            now - counts::COUNT_LIFETIME_MS,
        ),
        (
            "DELETE FROM inbound_counts WHERE (source, minute) IN \
             (SELECT source, minute FROM inbound_counts WHERE minute <= ?1 LIMIT ?2)",
            now - recoveries::INBOUND_COUNT_LIFETIME_MS,
        ),
        (
            "DELETE FROM recoveries WHERE id IN \
             (SELECT id FROM recoveries WHERE started_at <= ?1 LIMIT ?2)",
            now - recoveries::RECOVERY_LIFETIME_MS,
        ),
        // History first, then the messages: the same subquery picks the same rows twice.
        (
            "DELETE FROM attempts WHERE message_id IN \
             (SELECT id FROM messages WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
            now,
        ),
        (
            "DELETE FROM messages WHERE id IN \
             (SELECT id FROM messages WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
            now,
        ),
    ] {
        deleted += conn
            .prepare_cached(sql)
            .db()?
            .execute(params![at, SWEEP_LIMIT as i64])
            .db()?;
    }
    Ok(deleted)
}

/// Store::save_recovery: the row, then what [`recoveries::to_drop`] names, in one
/// transaction.
pub(super) fn save_recovery(
    conn: &Connection,
    recovery: &Recovery,
    now: Millis,
) -> Result<(), StoreError> {
    let json = serde_json::to_string(recovery).map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT OR REPLACE INTO recoveries (id, started_at, recovery_json) VALUES (?1, ?2, ?3)",
    )
    .db()?
    .execute(params![recovery.id, recovery.started_at, json])
    .db()?;
    let held = conn
        .prepare_cached("SELECT id, started_at FROM recoveries")
        .db()?
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, Millis>(1)?)))
        .db()?
        .collect::<Result<Vec<_>, _>>()
        .db()?;
    let mut delete = conn
        .prepare_cached("DELETE FROM recoveries WHERE id = ?1")
        .db()?;
    for id in recoveries::to_drop(held, now) {
        delete.execute(params![id]).db()?;
    }
    Ok(())
}
