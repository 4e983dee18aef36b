//! Completions, group-committed (`batch.rs`): concurrent completions share one transaction.
//! One statement reads every message of the batch under its row lock, `store::lifecycle::complete`
//! decides each in order, and the effects are written as sets (`apply_set.rs`); the batch's
//! attempts-per-minute counts are added last, in one statement.

use std::collections::{BTreeMap, HashMap};

use deadpool_postgres::{Client, Transaction};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::apply_set::{Decided, apply_set, plan_once_by_index};
use super::batch::Committed;
use super::days::Days;
use super::effects::{ROW_COLUMNS, Row, apply, read_row, row_from};
use super::error::{Db, column};
use super::locks::{Lock, lock, lock_all};
use crate::clock::Millis;
use crate::store::counts::{self, Tally};
use crate::store::lifecycle::{self, Effect, Lifetimes, Snapshot};
use crate::store::{Completion, HistoryEntry, Lease, StoreError};

/// One completion waiting for its batch (`batch.rs`).
pub(super) struct Completing {
    pub lease: Lease,
    pub attempt: HistoryEntry,
    pub completion: Completion,
    pub now: Millis,
    pub lifetimes: Lifetimes,
}

impl Completing {
    /// store::lifecycle::complete of this completion, on the message as `snapshot` holds it.
    fn decide(&self, snapshot: &Snapshot) -> Option<Effect> {
        lifecycle::complete(
            snapshot,
            self.lease.token,
            self.attempt.clone(),
            self.completion,
            self.now,
            self.lifetimes,
        )
    }
}

/// [`complete_batch`] as the batcher runs it.
pub(super) fn run_completions<'a>(
    client: &'a mut Client,
    days: &'a Days,
    batch: &'a [Completing],
) -> BoxFuture<'a, Result<Committed<bool>, StoreError>> {
    complete_batch(client, days, batch).boxed()
}

/// Applies store::lifecycle::complete to each of `batch`, in one transaction. The ordering
/// keys' locks come first, all in one order (`locks.rs`), then each row's. A completion that
/// fails (a day partition dropped under it, say) would abort the others: the batch is then
/// rolled back and each completion runs in a transaction of its own, failing alone.
async fn complete_batch(
    client: &mut Client,
    days: &Days,
    batch: &[Completing],
) -> Result<Committed<bool>, StoreError> {
    let tx = client.transaction().await.db()?;
    plan_once_by_index(&tx).await?;
    let keys: Vec<(Lock, &str)> = batch
        .iter()
        .map(|c| (Lock::OrderingKey, c.lease.message.ordering_key.as_str()))
        .collect();
    lock_all(&tx, &keys).await?;
    let mut failed = None;
    let outcomes = match complete_all_locked(&tx, days, batch).await {
        Ok(outcomes) => outcomes,
        Err(e) => {
            failed = Some(e);
            Vec::new()
        }
    };
    if failed.is_none()
        && let Err(e) = count_completions(&tx, batch, &outcomes).await
    {
        failed = Some(e);
    }
    if let Some(e) = failed {
        tracing::debug!(error = %e, completions = batch.len(), "a batch of completions failed; completing one by one");
        tx.rollback().await.db()?;
        let mut outcomes = Vec::with_capacity(batch.len());
        for completing in batch {
            outcomes.push(complete(client, days, completing).await);
        }
        return Ok(Committed {
            outcomes,
            one_by_one: true,
        });
    }
    tx.commit().await.db()?;
    Ok(Committed {
        outcomes,
        one_by_one: false,
    })
}

/// Applies store::lifecycle::complete in a transaction of its own.
async fn complete(
    client: &mut Client,
    days: &Days,
    completing: &Completing,
) -> Result<bool, StoreError> {
    let tx = client.transaction().await.db()?;
    // The key's lock before the row's, as every transaction takes them (locks.rs).
    lock(
        &tx,
        Lock::OrderingKey,
        &completing.lease.message.ordering_key,
    )
    .await?;
    let done = complete_locked(&tx, days, completing).await?;
    if done {
        count_completions(&tx, std::slice::from_ref(completing), &[Ok(true)]).await?;
        tx.commit().await.db()?;
    }
    Ok(done)
}

/// Applies store::lifecycle::complete to each of `batch`, in order; the caller holds their
/// ordering keys' locks. One completion's outcome each.
async fn complete_all_locked(
    tx: &Transaction<'_>,
    days: &Days,
    batch: &[Completing],
) -> Result<Vec<Result<bool, StoreError>>, StoreError> {
    let ids: Vec<&str> = batch.iter().map(|c| c.lease.message.id.as_str()).collect();
    // Only the live partition: a message its lease still holds has work left. In id order,
    // the order every batch locks its rows in.
    let statement = tx
        .prepare_cached(&format!(
            "SELECT {ROW_COLUMNS}, m.id FROM messages_live m \
             WHERE m.id = ANY($1::text[]) ORDER BY m.id FOR UPDATE"
        ))
        .await
        .db()?;
    let mut rows: HashMap<String, Row> = HashMap::with_capacity(batch.len());
    for found in tx.query(&statement, &[&ids]).await.db()? {
        rows.insert(column(&found, 12)?, row_from(&found)?);
    }
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut decided = Vec::with_capacity(batch.len());
    for completing in batch {
        let id = completing.lease.message.id.as_str();
        let effect = rows
            .get(id)
            .and_then(|row| completing.decide(&row.snapshot));
        // A message's first effect takes its row: a later completion of it in the batch
        // finds it gone, as it would find it no longer held one at a time.
        let Some((effect, row)) = effect.and_then(|effect| Some((effect, rows.remove(id)?))) else {
            outcomes.push(Ok(false));
            continue;
        };
        let id = id.to_string();
        outcomes.push(Ok(true));
        decided.push(Decided { id, row, effect });
    }
    apply_set(tx, days, decided).await?;
    Ok(outcomes)
}

/// Applies store::lifecycle::complete; the caller holds the ordering key's lock.
async fn complete_locked(
    tx: &Transaction<'_>,
    days: &Days,
    completing: &Completing,
) -> Result<bool, StoreError> {
    let id = completing.lease.message.id.as_str();
    let Some(row) = read_row(tx, id).await? else {
        return Ok(false);
    };
    let Some(effect) = completing.decide(&row.snapshot) else {
        return Ok(false);
    };
    apply(tx, days, id, &row, effect).await?;
    Ok(true)
}

/// Adds the recorded completions of `batch` (those whose outcome is `true`) to their minutes'
/// counts. Last in the transaction, so the counts' row locks are held only until the commit,
/// and in one statement in the order of their keys, so two batches counting into the same
/// rows wait for each other in one order, never in a circle.
///
/// A batch counts into one slot of each minute, the partition of its first completion: a
/// slot per completed message's partition made a batch of a few messages lock as many rows,
/// and any two concurrent batches sharing one of them wait for each other's commit (its WAL
/// flush). Reads sum the slots, so which slot a count lands in changes nothing else.
async fn count_completions(
    tx: &Transaction<'_>,
    batch: &[Completing],
    outcomes: &[Result<bool, StoreError>],
) -> Result<(), StoreError> {
    let Some(first) = batch.first() else {
        return Ok(());
    };
    let slot = i16::from(first.lease.message.id.partition());
    let mut tallies: BTreeMap<(Millis, i16), Tally> = BTreeMap::new();
    for (completing, outcome) in batch.iter().zip(outcomes) {
        if matches!(outcome, Ok(true)) {
            let key = (counts::minute_of(completing.now), slot);
            let tally = Tally::of(completing.completion);
            tallies
                .entry(key)
                .and_modify(|t| *t = t.plus(tally))
                .or_insert(tally);
        }
    }
    if tallies.is_empty() {
        return Ok(());
    }
    let n = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let minutes: Vec<Millis> = tallies.keys().map(|k| k.0).collect();
    let slots: Vec<i16> = tallies.keys().map(|k| k.1).collect();
    let deliveries: Vec<i64> = tallies.values().map(|t| n(t.deliveries)).collect();
    let failures: Vec<i64> = tallies.values().map(|t| n(t.failures)).collect();
    let dead: Vec<i64> = tallies.values().map(|t| n(t.dead)).collect();
    let statement = tx
        .prepare_cached(
            "INSERT INTO delivery_counts (minute, slot, deliveries, failures, dead) \
             SELECT * FROM unnest($1::int8[], $2::int2[], $3::int8[], $4::int8[], $5::int8[]) \
             AS c (minute, slot, deliveries, failures, dead) ORDER BY minute, slot \
             ON CONFLICT (minute, slot) DO UPDATE SET \
             deliveries = delivery_counts.deliveries + excluded.deliveries, \
             failures = delivery_counts.failures + excluded.failures, \
             dead = delivery_counts.dead + excluded.dead",
        )
        .await
        .db()?;
    tx.execute(
        &statement,
        &[&minutes, &slots, &deliveries, &failures, &dead],
    )
    .await
    .db()?;
    Ok(())
}
