//! The lifecycle transactions after accept: lease, give back, resend. Each reads the
//! message under a row lock (`FOR UPDATE`) in its transaction, asks its `store::lifecycle`
//! rule, and writes the effect as it is (`effects.rs`, `apply_set.rs`), so the transaction
//! holds what the rule read (the guard of `lifecycle::Guard`, by construction) and decides
//! nothing itself.
//!
//! Claims take due messages with `FOR UPDATE SKIP LOCKED`: processes sharing the database
//! never wait for each other's claims, and never lease one message twice. A move in an
//! ordering key's queue runs under that key's lock (`locks.rs`). Completions, which are
//! group-committed, are in `complete.rs`.

use deadpool_postgres::Client;
use tokio_postgres::error::SqlState;

use super::apply_set::{Decided, apply_set, lock_queues, plan_once_by_index};
use super::days::Days;
use super::effects::{ROW_COLUMNS, apply, read_row, row_from};
use super::error::{Db, column, db_error};
use super::listen::CHANNEL;
use super::locks::{Lock, lock};
use super::{DB_NOW_MS, NOT_GONE, RECORD};
use crate::clock::Millis;
use crate::store::lifecycle;
use crate::store::{Lease, ResendEffect, ResendMark, StoreError, record};

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
    plan_once_by_index(&tx).await?;
    let lease_now: Millis = if database_clock {
        let statement = tx
            .prepare_cached(&format!("SELECT {DB_NOW_MS}"))
            .await
            .db()?;
        let row = tx.query_one(&statement, &[]).await.db()?;
        column(&row, 0)?
    } else {
        now
    };
    let lease_until = lease_now.saturating_add(i64::try_from(lease_ms).unwrap_or(i64::MAX));
    let expired = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS}, m.id FROM messages_live m WHERE m.lease_until <= $1 \
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
    lock_queues(&tx, &decided).await?;
    apply_set(&tx, days, decided).await?;
    let due = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS}, m.id, {RECORD} FROM messages_live m WHERE m.due_at <= $1 \
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
        let message = record::decode(column(&found, 13)?)?;
        let effect = lifecycle::claim(&row.snapshot, lease_until);
        let leased = effect.changes.applied_to(&row.snapshot);
        leases.push(Lease::of(message, &leased));
        decided.push(Decided {
            id: column(&found, 12)?,
            row,
            effect,
        });
    }
    lock_queues(&tx, &decided).await?;
    apply_set(&tx, days, decided).await?;
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
