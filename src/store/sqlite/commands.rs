//! The lifecycle transactions after accept: lease, finish, give back, resend, sweep; and the
//! resend operations' reservations. Each runs inside the writer's transaction, in a savepoint
//! of its own, and names the lifecycle rule it implements.

use rusqlite::{Connection, OptionalExtension, params};

use super::error::{Db, corrupt};
use super::{secs_to_ms, wall_clock_ms};
use crate::clock::Millis;
use crate::store::{
    ANSWER_BODY_ROWS, Completion, HISTORY_TAIL, HistoryEntry, Lease, MessageState, NewMessage,
    OperationReservation, ResendEffect, SWEEP_LIMIT, StoreError, decode_operation,
    encode_finished_operation, encode_running_operation,
};

/// Appends a message to its ordering queue; alone there, it is the head and due at `now`.
pub(super) fn push_to_queue(
    conn: &Connection,
    ordering_key: &str,
    id: &str,
    now: Millis,
) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT INTO queue (ordering_key, id) VALUES (?1, ?2)")
        .db()?
        .execute(params![ordering_key, id])
        .db()?;
    let others: bool = conn
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM queue WHERE ordering_key = ?1 AND id <> ?2)")
        .db()?
        .query_row(params![ordering_key, id], |r| r.get(0))
        .db()?;
    if !others {
        conn.prepare_cached("UPDATE messages SET due_at = ?2 WHERE id = ?1")
            .db()?
            .execute(params![id, now])
            .db()?;
    }
    Ok(())
}

/// Implements store::lifecycle::expire_lease, then store::lifecycle::claim
/// (src/store/lifecycle.rs).
pub(super) fn claim(
    conn: &Connection,
    now: Millis,
    limit: usize,
    lease_ms: u64,
) -> Result<Vec<Lease>, StoreError> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let lease_until = now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    // Expired leases (their worker died) are due again, now. They stay `in_flight` until
    // re-leased: the old worker may still finish them with its token, as on Redis.
    conn.prepare_cached(
        "UPDATE messages SET due_at = ?1, lease_until = NULL WHERE id IN \
         (SELECT id FROM messages WHERE lease_until <= ?1 ORDER BY lease_until LIMIT ?2)",
    )
    .db()?
    .execute(params![now, limit])
    .db()?;
    let rows: Vec<(String, String, u32, u32, Millis, i64)> = conn
        .prepare_cached(
            "SELECT id, message_json, delivery_attempts, attempts_before_requeue, deadline, \
             lease_token FROM messages WHERE due_at <= ?1 ORDER BY due_at, id LIMIT ?2",
        )
        .db()?
        .query_map(params![now, limit], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    let mut lease = conn
        .prepare_cached(
            "UPDATE messages SET lease_token = ?2, state = 'in_flight', due_at = NULL, \
             lease_until = ?3 WHERE id = ?1",
        )
        .db()?;
    let mut leases = Vec::with_capacity(rows.len());
    for (id, message_json, attempts, attempts_before_requeue, deadline, token) in rows {
        let token = token.saturating_add(1);
        lease.execute(params![id, token, lease_until]).db()?;
        let message: NewMessage = serde_json::from_str(&message_json).map_err(corrupt)?;
        leases.push(Lease {
            message,
            token: u64::try_from(token).map_err(corrupt)?,
            attempts,
            backoff_step: attempts.saturating_sub(attempts_before_requeue),
            deadline,
        });
    }
    Ok(leases)
}

/// The mutable state `complete`, `release` and `resend` look at.
struct Current {
    state: String,
    /// SQLite integers are signed; tokens start at 1 and only grow.
    lease_token: i64,
    resume_at: Millis,
    deliver_again: bool,
    delivery_attempts: i64,
    due_at: Option<Millis>,
    ordering_key: String,
    /// When a finished message's retention ends; `None` while it is unfinished.
    expires_at: Option<Millis>,
}

fn current(conn: &Connection, id: &str) -> Result<Option<Current>, StoreError> {
    conn.prepare_cached(
        "SELECT state, lease_token, resume_at, deliver_again, delivery_attempts, due_at, \
         ordering_key, expires_at FROM messages WHERE id = ?1",
    )
    .db()?
    .query_row(params![id], |r| {
        Ok(Current {
            state: r.get(0)?,
            lease_token: r.get(1)?,
            resume_at: r.get(2)?,
            deliver_again: r.get(3)?,
            delivery_attempts: r.get(4)?,
            due_at: r.get(5)?,
            ordering_key: r.get(6)?,
            expires_at: r.get(7)?,
        })
    })
    .optional()
    .db()
}

/// The message, if it is in flight under `lease`'s token.
fn leased(conn: &Connection, lease: &Lease) -> Result<Option<Current>, StoreError> {
    Ok(current(conn, lease.message.id.as_str())?.filter(|cur| {
        cur.state == MessageState::InFlight.as_str()
            && u64::try_from(cur.lease_token).ok() == Some(lease.token)
    }))
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

/// Implements store::lifecycle::complete (src/store/lifecycle.rs).
pub(super) fn complete(
    conn: &Connection,
    lease: &Lease,
    attempt_json: &str,
    completion: Completion,
    now: Millis,
    retention_ms: i64,
) -> Result<bool, StoreError> {
    let id = lease.message.id.as_str();
    let Some(cur) = leased(conn, lease)? else {
        return Ok(false);
    };
    record_history(conn, id, attempt_json)?;
    let stays_queued = match completion {
        // An operator's resend brought this attempt forward: the automatic schedule resumes
        // where it was, neither shortened nor pushed back (unless that time has passed).
        Completion::Retry { .. } if cur.resume_at != 0 && cur.resume_at >= now => {
            Some(cur.resume_at)
        }
        Completion::Retry { next_at } => Some(next_at),
        // A resend arrived while this attempt was in flight: deliver once more, now, even if
        // this attempt ended the message (the resend gave it a fresh window).
        Completion::Delivered | Completion::Dead if cur.deliver_again => Some(now),
        Completion::Delivered | Completion::Dead => None,
    };
    if let Some(next_at) = stays_queued {
        conn.prepare_cached(
            "UPDATE messages SET delivery_attempts = delivery_attempts + 1, state = 'pending', \
             resume_at = 0, deliver_again = 0, due_at = ?2, lease_until = NULL WHERE id = ?1",
        )
        .db()?
        .execute(params![id, next_at])
        .db()?;
        return Ok(true);
    }
    let state = match completion {
        Completion::Dead => MessageState::Dead,
        _ => MessageState::Delivered,
    };
    conn.prepare_cached(
        "UPDATE messages SET delivery_attempts = delivery_attempts + 1, state = ?2, \
         resume_at = 0, deliver_again = 0, due_at = NULL, lease_until = NULL, \
         expires_at = ?3 WHERE id = ?1",
    )
    .db()?
    .execute(params![
        id,
        state.as_str(),
        now.saturating_add(retention_ms)
    ])
    .db()?;
    conn.prepare_cached("DELETE FROM queue WHERE id = ?1")
        .db()?
        .execute(params![id])
        .db()?;
    // The next message of the same key becomes the head, due now.
    conn.prepare_cached(
        "UPDATE messages SET due_at = ?2 WHERE id = \
         (SELECT id FROM queue WHERE ordering_key = ?1 ORDER BY position LIMIT 1)",
    )
    .db()?
    .execute(params![cur.ordering_key, now])
    .db()?;
    Ok(true)
}

/// Implements store::lifecycle::release (src/store/lifecycle.rs).
pub(super) fn release(
    conn: &Connection,
    lease: &Lease,
    next_at: Millis,
) -> Result<bool, StoreError> {
    if leased(conn, lease)?.is_none() {
        return Ok(false);
    }
    conn.prepare_cached(
        "UPDATE messages SET state = 'pending', due_at = ?2, lease_until = NULL WHERE id = ?1",
    )
    .db()?
    .execute(params![lease.message.id.as_str(), next_at])
    .db()?;
    Ok(true)
}

/// Implements store::lifecycle::resend (src/store/lifecycle.rs).
pub(super) fn resend(
    conn: &Connection,
    id: &str,
    mark_json: &str,
    fresh_deadline: Millis,
    now: Millis,
) -> Result<ResendEffect, StoreError> {
    let Some(cur) = current(conn, id)? else {
        return Ok(ResendEffect::Skipped);
    };
    let state = MessageState::parse(&cur.state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{}`", cur.state)))?;
    // A finished message whose retention ended is gone, swept or not.
    let ended = cur.expires_at.is_some_and(|end| end <= now);
    if state == MessageState::Recorded || ended {
        return Ok(ResendEffect::Skipped);
    }
    record_history(conn, id, mark_json)?;
    match state {
        MessageState::Delivered | MessageState::Dead => {
            // A fresh window, and the backoff starts over from the attempts made so far.
            conn.prepare_cached(
                "UPDATE messages SET state = 'pending', deadline = ?2, \
                 attempts_before_requeue = ?3, expires_at = NULL WHERE id = ?1",
            )
            .db()?
            .execute(params![id, fresh_deadline, cur.delivery_attempts])
            .db()?;
            push_to_queue(conn, &cur.ordering_key, id, now)?;
            Ok(ResendEffect::Requeued)
        }
        MessageState::Pending => match cur.due_at {
            None => Ok(ResendEffect::Queued),
            Some(due) if due > now => {
                // Remember the original time (only the first time) so a failed expedited
                // attempt does not pull the rest of the schedule forward.
                let resume_at = if cur.resume_at == 0 {
                    due
                } else {
                    cur.resume_at
                };
                conn.prepare_cached(
                    "UPDATE messages SET due_at = ?2, resume_at = ?3 WHERE id = ?1",
                )
                .db()?
                .execute(params![id, now, resume_at])
                .db()?;
                Ok(ResendEffect::Expedited)
            }
            Some(_) => Ok(ResendEffect::Expedited),
        },
        MessageState::InFlight => {
            conn.prepare_cached(
                "UPDATE messages SET deliver_again = 1, deadline = ?2 WHERE id = ?1",
            )
            .db()?
            .execute(params![id, fresh_deadline])
            .db()?;
            Ok(ResendEffect::AfterCurrent)
        }
        MessageState::Recorded => Ok(ResendEffect::Skipped),
    }
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

/// Implements store::lifecycle::sweep (src/store/lifecycle.rs): deletes up to [`SWEEP_LIMIT`]
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
