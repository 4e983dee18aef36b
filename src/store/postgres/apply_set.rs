//! Many messages' effects written as sets: a claim of many messages, a group-committed batch
//! of completions. One statement writes every message row (moving those that finish to their
//! day partition, with a first history row in it), one moves their history, one appends their
//! later history rows, and one takes the
//! finished off their queues and makes the next of each key its head: a batch costs the server
//! a handful of statements, not six round trips per message, which is what bounded a
//! dispatcher's deliveries per second.
//!
//! A set is written only where its effects cannot see each other: each message once, each
//! ordering key's queue moved once, no message joining a queue (only a resend, which writes
//! alone). And only from the live partition, which is where every message a claim or a
//! completion changes is: each statement names it (`end_day = 0`), so the planner prunes
//! every day partition away rather than joining the set with all of them. Any other batch is
//! written one effect at a time (`effects::apply`), in order, as before; so is the rare
//! history long enough to trim (`effects::tidy_history`).
//!
//! Each statement finds its rows by `id = ANY(<the set's ids>)` on the primary key, so its plan
//! stays an index lookup whatever the statistics say of the live partition's size (a hash join
//! with a scan of every live message would be as cheap while the table is small, and not
//! later). The message rows then take their values at their id's place in the set's arrays
//! rather than by a join with them ([`MessageRows::write`]).

use std::collections::{HashMap, HashSet};

use deadpool_postgres::Transaction;
use tokio_postgres::error::SqlState;

use super::days::{Days, end_day};
use super::effects::{Row, apply, is_first_row, missing_day, needs_tidy, tidy_history, to_i32};
use super::error::{Db, column, corrupt, db_error};
use super::listen::CHANNEL;
use super::locks::{Lock, lock_all};
use crate::clock::Millis;
use crate::store::StoreError;
use crate::store::lifecycle::{Effect, QueueMove};

/// A message's effect as a transaction applies it: the row it read under its lock, and the
/// rule's decision.
pub(super) struct Decided {
    pub id: String,
    pub row: Row,
    pub effect: Effect,
}

impl Decided {
    fn moves_in_queue(&self) -> bool {
        !matches!(self.effect.queue, QueueMove::Stay)
    }
}

/// Writes every effect of `decided`, read in this transaction. The caller holds the locks of
/// the ordering keys whose queue an effect moves in (`locks.rs`).
pub(super) async fn apply_set(
    tx: &Transaction<'_>,
    days: &Days,
    decided: Vec<Decided>,
) -> Result<(), StoreError> {
    if !writable_as_set(&decided) {
        for Decided { id, row, effect } in decided {
            apply(tx, days, &id, &row, effect).await?;
        }
        return Ok(());
    }
    let rows = MessageRows::of(&decided, days)?;
    let totals = rows.write(tx, days).await?;
    move_history(tx, &decided).await?;
    rows.append_later_history(tx, &totals).await?;
    leave_queues(tx, &decided).await
}

/// Makes the rest of the transaction plan each statement once, by its indexes: a claim or a
/// batch of completions runs the same few statements thousands of times a second, and their
/// arrays (`id = ANY($1)`, `unnest`) keep PostgreSQL's plan cache choosing a plan of its own
/// for every call (a custom plan knows the array's length), which cost the server about as
/// much as running them (BENCHMARKS.md, "Completions and claims as sets"). A generic plan is
/// kept per connection until the table's statistics change; built while a table looked empty,
/// it would scan and sort it, so it is built with sequential scans priced out: every statement
/// of these transactions reads by the primary key, the due or lease index, or the queue's key
/// index. Both settings end with the transaction.
pub(super) async fn plan_once_by_index(tx: &Transaction<'_>) -> Result<(), StoreError> {
    tx.batch_execute(
        "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off",
    )
    .await
    .db()
}

/// Takes the locks of the ordering keys whose queue an effect of `decided` moves in, for a
/// caller that has not: a claim, whose leases that ran out past their deadline leave their
/// queue.
pub(super) async fn lock_queues(
    tx: &Transaction<'_>,
    decided: &[Decided],
) -> Result<(), StoreError> {
    let keys: Vec<(Lock, &str)> = decided
        .iter()
        .filter(|d| d.moves_in_queue())
        .map(|d| (Lock::OrderingKey, d.row.ordering_key.as_str()))
        .collect();
    if keys.is_empty() {
        return Ok(());
    }
    lock_all(tx, &keys).await
}

/// Whether no effect of `decided` could see another's write (each message once, each queue
/// moved once, no message joining one), and every message is in the live partition.
fn writable_as_set(decided: &[Decided]) -> bool {
    let mut ids = HashSet::with_capacity(decided.len());
    let mut keys = HashSet::new();
    decided.iter().all(|d| {
        d.row.end_day == 0
            && ids.insert(d.id.as_str())
            && !matches!(d.effect.queue, QueueMove::Join { .. })
            && (!d.moves_in_queue() || keys.insert(d.row.ordering_key.as_str()))
    })
}

/// Every message row of a set after its effect, a column each.
#[derive(Default)]
struct MessageRows {
    ids: Vec<String>,
    days_after: Vec<i32>,
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
    recorded: Vec<i64>,
    /// Each effect's history row as JSON, if it records one.
    entries: Vec<Option<String>>,
}

impl MessageRows {
    /// The rows `decided` writes; fails, as a write one at a time would, when one names a day
    /// partition this process has not made.
    fn of(decided: &[Decided], days: &Days) -> Result<MessageRows, StoreError> {
        let mut rows = MessageRows::default();
        for Decided { id, row, effect } in decided {
            let after = effect.changes.applied_to(&row.snapshot);
            let day = end_day(after.ends_at);
            if !days.known(day) {
                return Err(missing_day(day));
            }
            rows.ids.push(id.clone());
            rows.days_after.push(day);
            rows.states.push(after.state.as_str());
            rows.tokens
                .push(i64::try_from(after.token).map_err(corrupt)?);
            rows.attempts.push(to_i32(after.attempts)?);
            rows.backoff_from.push(to_i32(after.backoff_from)?);
            rows.deadlines.push(after.deadline);
            rows.due_at.push(after.due_at);
            rows.lease_until
                .push(effect.changes.lease_until.unwrap_or(row.lease_until));
            rows.resume_at.push(after.resume_at);
            rows.again.push(after.again);
            rows.ends_at.push(after.ends_at);
            rows.recorded.push(effect.history.is_some().into());
            rows.entries.push(
                effect
                    .history
                    .as_ref()
                    .map(serde_json::to_string)
                    .transpose()
                    .map_err(corrupt)?,
            );
        }
        Ok(rows)
    }

    /// Writes the rows in one statement; a row whose end day changed moves to that day's
    /// partition, and a message's first history row goes into it (`first_entry`, layout 5).
    /// Answers each message's `history_total` after it.
    ///
    /// Each row finds its values by its id's place in the arrays (`array_position`), not by a
    /// join with `unnest` of them: with layout 4's smaller rows, the generic plan, which
    /// reckons one row of a small live partition, ran that join as a nested loop that
    /// unnested all thirteen arrays again for every row, and the statement cost the server
    /// more than twice as much per message on a near-empty queue as with a backlog
    /// (BENCHMARKS.md, "PostgreSQL layout 4").
    async fn write(
        &self,
        tx: &Transaction<'_>,
        days: &Days,
    ) -> Result<HashMap<String, i64>, StoreError> {
        let statement = tx
            .prepare_cached(
                "UPDATE messages m SET (end_day, state, lease_token, delivery_attempts, \
                 attempts_before_requeue, deadline, due_at, lease_until, resume_at, \
                 deliver_again, ends_at, history_total, first_entry) = \
                 (SELECT ($2::int4[])[i], ($3::text[])[i], ($4::int8[])[i], ($5::int4[])[i], \
                 ($6::int4[])[i], ($7::int8[])[i], ($8::int8[])[i], ($9::int8[])[i], \
                 ($10::int8[])[i], ($11::bool[])[i], ($12::int8[])[i], \
                 m.history_total + ($13::int8[])[i], \
                 CASE WHEN m.history_total = 0 THEN ($14::text[])[i] ELSE m.first_entry END \
                 FROM (SELECT array_position($1::text[], m.id::text) AS i) p) \
                 WHERE m.end_day = 0 AND m.id = ANY($1::text[]) \
                 RETURNING m.id, m.history_total",
            )
            .await
            .db()?;
        let written = tx
            .query(
                &statement,
                &[
                    &self.ids,
                    &self.days_after,
                    &self.states,
                    &self.tokens,
                    &self.attempts,
                    &self.backoff_from,
                    &self.deadlines,
                    &self.due_at,
                    &self.lease_until,
                    &self.resume_at,
                    &self.again,
                    &self.ends_at,
                    &self.recorded,
                    &self.entries,
                ],
            )
            .await;
        let written = match written {
            Ok(written) => written,
            // No partition for a day: another process dropped it. The retry creates it again.
            Err(e) if e.code() == Some(&SqlState::CHECK_VIOLATION) => {
                let finished = self.days_after.iter().filter(|&&day| day != 0);
                finished.clone().for_each(|&day| days.forget(day));
                return Err(missing_day(finished.copied().next().unwrap_or_default()));
            }
            Err(e) => return Err(db_error(e)),
        };
        // Every row was read under its lock in this transaction: one missing is not a race.
        if written.len() != self.ids.len() {
            return Err(corrupt(format!(
                "{} of {} locked messages were updated",
                written.len(),
                self.ids.len()
            )));
        }
        written
            .iter()
            .map(|row| Ok((column(row, 0)?, column(row, 1)?)))
            .collect()
    }

    /// Appends each history row after a message's first (which [`MessageRows::write`] put in
    /// its row) as number `history_total` of its message, in one statement, then trims the few
    /// histories long enough to need it.
    async fn append_later_history(
        &self,
        tx: &Transaction<'_>,
        totals: &HashMap<String, i64>,
    ) -> Result<(), StoreError> {
        let mut ids = Vec::new();
        let mut days = Vec::new();
        let mut seqs = Vec::new();
        let mut entries = Vec::new();
        for ((id, day), entry) in self.ids.iter().zip(&self.days_after).zip(&self.entries) {
            let Some(entry) = entry else {
                continue;
            };
            let seq = *totals
                .get(id)
                .ok_or_else(|| corrupt(format!("message {id} was not updated")))?;
            if is_first_row(seq) {
                continue;
            }
            ids.push(id.as_str());
            days.push(*day);
            seqs.push(seq);
            entries.push(entry.as_str());
        }
        if ids.is_empty() {
            return Ok(());
        }
        let statement = tx
            .prepare_cached(
                "INSERT INTO history (message_id, end_day, seq, entry_json) \
                 SELECT * FROM unnest($1::text[], $2::int4[], $3::int8[], $4::text[])",
            )
            .await
            .db()?;
        tx.execute(&statement, &[&ids, &days, &seqs, &entries])
            .await
            .db()?;
        for ((id, day), seq) in ids.iter().zip(&days).zip(&seqs) {
            if needs_tidy(*seq) {
                tidy_history(tx, id, *day, *seq).await?;
            }
        }
        Ok(())
    }
}

/// Moves the history of each message that changed partition along with it (out of the live
/// partition, as every message of a set is).
async fn move_history(tx: &Transaction<'_>, decided: &[Decided]) -> Result<(), StoreError> {
    let mut ids = Vec::new();
    let mut after = Vec::new();
    for d in decided {
        let day = end_day(d.effect.changes.applied_to(&d.row.snapshot).ends_at);
        if day != d.row.end_day {
            ids.push(d.id.as_str());
            after.push(day);
        }
    }
    if ids.is_empty() {
        return Ok(());
    }
    let statement = tx
        .prepare_cached(
            "UPDATE history h SET end_day = u.day_after \
             FROM unnest($1::text[], $2::int4[]) AS u (id, day_after) \
             WHERE h.end_day = 0 AND h.message_id = ANY($1::text[]) AND h.message_id = u.id",
        )
        .await
        .db()?;
    tx.execute(&statement, &[&ids, &after])
        .await
        .db()
        .map(|_| ())
}

/// Takes the messages whose effect leaves their queue off it, makes the next of each key
/// (if any) its head, due when the rule said, and wakes other processes' dispatchers on
/// commit when one became due.
async fn leave_queues(tx: &Transaction<'_>, decided: &[Decided]) -> Result<(), StoreError> {
    let mut ids = Vec::new();
    let mut keys = Vec::new();
    let mut next_due = Vec::new();
    for d in decided {
        if let QueueMove::Leave { next_due_at } = d.effect.queue {
            ids.push(d.id.as_str());
            keys.push(d.row.ordering_key.as_str());
            next_due.push(next_due_at);
        }
    }
    if ids.is_empty() {
        return Ok(());
    }
    let delete = tx
        .prepare_cached("DELETE FROM queue WHERE id = ANY($1::text[])")
        .await
        .db()?;
    tx.execute(&delete, &[&ids]).await.db()?;
    let heads = tx
        .prepare_cached(&format!(
            "WITH next AS (UPDATE messages m SET due_at = u.due_at \
             FROM unnest($1::text[], $2::int8[]) AS u (ordering_key, due_at) \
             WHERE m.end_day = 0 AND m.id = (SELECT q.id FROM queue q \
             WHERE q.ordering_key = u.ordering_key ORDER BY q.position LIMIT 1) RETURNING 1) \
             SELECT pg_notify('{CHANNEL}', '') WHERE EXISTS (SELECT 1 FROM next)"
        ))
        .await
        .db()?;
    tx.execute(&heads, &[&keys, &next_due])
        .await
        .db()
        .map(|_| ())
}
