//! The accept transaction: the dedupe claim, the payment compare-and-set, the signature seal
//! and the new message, all or nothing (ARCHITECTURE.md §1.2), committed before the answer.
//! It reads what `store::lifecycle::accept` reads, under the locks of the dedupe key, the seal
//! and the payment (`locks.rs`: they may have no row to lock yet), and applies its decision.
//!
//! Accepts are group-committed (`batch.rs`): [`accept_batch`] runs several in one
//! transaction, each in a savepoint of its own, so one that fails is undone alone, and one
//! commit (one WAL flush, one wait for the synchronous standby) answers them all.

use deadpool_postgres::{Client, Transaction};
use futures_util::FutureExt;
use futures_util::future::BoxFuture;

use super::accept_set::{Arrivals, Queued, accept_as_sets, count_arrival, write_arrivals};
use super::batch::Committed;
use super::days::{Days, end_day};
use super::effects::move_in_queue;
use super::error::{Db, column, corrupt};
use super::locks::{Lock, lock_all};
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::lifecycle::{self, AcceptDecision, AcceptRead, Lifetimes, LiveClaim};
use crate::store::{AcceptOutcome, AcceptRequest, StoreError, fingerprint_from_stored, record};

/// [`accept_batch`] as the batcher runs it.
pub(super) fn run_accepts<'a>(
    client: &'a mut Client,
    days: &'a Days,
    batch: &'a [Queued],
) -> BoxFuture<'a, Result<Committed<AcceptOutcome>, StoreError>> {
    accept_batch(client, days, batch).boxed()
}

/// Runs `batch` in one transaction and commits once. `Err` is a failure of the whole batch
/// (beginning, locking, committing, or a connection lost part-way), after which none of it is
/// recorded.
///
/// The batch is first decided and written as sets (`accept_set.rs`); a write the server
/// refuses there fails every row of its statement, so the batch is then run again one accept
/// at a time, each in a savepoint, where that accept fails alone.
pub(super) async fn accept_batch(
    client: &mut Client,
    days: &Days,
    batch: &[Queued],
) -> Result<Committed<AcceptOutcome>, StoreError> {
    let tx = client.transaction().await.db()?;
    lock_all(&tx, &batch_locks(batch)).await?;
    let (outcomes, one_by_one) = match accept_as_sets(&tx, days, batch).await {
        Ok(outcomes) => (commit(tx, batch, outcomes).await?, false),
        Err(e) => {
            tracing::debug!(error = %e, accepts = batch.len(), "a batch's set write failed; accepting one by one");
            tx.rollback().await.db()?;
            (accept_one_by_one(client, days, batch).await?, true)
        }
    };
    Ok(Committed {
        outcomes,
        one_by_one,
    })
}

/// Every lock of the batch, taken first and in one order (`locks.rs`): two batches, here or
/// in other processes, then never wait for each other in a circle, whichever keys they share.
fn batch_locks(batch: &[Queued]) -> Vec<(Lock, &str)> {
    let mut locks: Vec<(Lock, &str)> = Vec::with_capacity(batch.len() * 4);
    for q in batch {
        let req = &q.req;
        locks.push((Lock::DedupeKey, &req.dedupe.key));
        if let Some(seal) = &req.seal {
            locks.push((Lock::Seal, &seal.key));
        }
        if let Some(p) = &req.payment {
            locks.push((Lock::Payment, &p.payment_id));
        }
        locks.push((Lock::OrderingKey, &req.message.ordering_key));
    }
    locks
}

/// Each accept of `batch` in a savepoint of its own, so one that fails is undone alone.
async fn accept_one_by_one(
    client: &mut Client,
    days: &Days,
    batch: &[Queued],
) -> Result<Vec<Result<AcceptOutcome, StoreError>>, StoreError> {
    let mut tx = client.transaction().await.db()?;
    lock_all(&tx, &batch_locks(batch)).await?;
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut arrivals = Arrivals::new();
    for queued in batch {
        let savepoint = tx.savepoint("accept").await.db()?;
        match accept_locked(&savepoint, days, &queued.req, queued.now, queued.lifetimes).await {
            Ok(outcome) => {
                savepoint.commit().await.db()?;
                count_arrival(&mut arrivals, &queued.req, &outcome, queued.now);
                outcomes.push(Ok(outcome));
            }
            Err(e) => {
                // Undoes this accept alone; a rollback that fails means the transaction
                // cannot go on, and the whole batch fails.
                savepoint.rollback().await.db()?;
                outcomes.push(Err(e));
            }
        }
    }
    // The accepts that stood, counted with them in one statement.
    write_arrivals(&tx, &arrivals).await?;
    commit(tx, batch, outcomes).await
}

async fn commit(
    tx: Transaction<'_>,
    batch: &[Queued],
    outcomes: Vec<Result<AcceptOutcome, StoreError>>,
) -> Result<Vec<Result<AcceptOutcome, StoreError>>, StoreError> {
    wait_for_the_standby_of_what_was_read(&tx, batch, &outcomes).await?;
    tx.commit().await.db()?;
    Ok(outcomes)
}

/// A batch that only answered from what it read (replays, conflicts) wrote nothing, so its
/// commit would not wait for a synchronous standby. Yet what it read may be a commit the
/// standby never acknowledged: one whose wait was cancelled, or that a restarted primary
/// replayed from its own WAL. Answering 2xx from it would acknowledge an event a failover can
/// lose. So where a synchronous standby is named, the batch touches one claim it read: its
/// commit then writes, and waits for the standby to hold a point past everything it read.
async fn wait_for_the_standby_of_what_was_read(
    tx: &Transaction<'_>,
    batch: &[Queued],
    outcomes: &[Result<AcceptOutcome, StoreError>],
) -> Result<(), StoreError> {
    if outcomes
        .iter()
        .any(|o| matches!(o, Ok(AcceptOutcome::Accepted)))
    {
        return Ok(());
    }
    let read_claim = batch.iter().zip(outcomes).find_map(|(queued, outcome)| {
        matches!(
            outcome,
            Ok(AcceptOutcome::Replayed { .. } | AcceptOutcome::Conflict)
        )
        .then_some(&queued.req.dedupe.key)
    });
    let Some(key) = read_claim else {
        return Ok(());
    };
    let touch = tx
        .prepare_cached(
            "UPDATE dedupe_claims SET expires_at = expires_at WHERE key = $1 \
             AND current_setting('synchronous_standby_names') <> ''",
        )
        .await
        .db()?;
    tx.execute(&touch, &[key]).await.db()?;
    Ok(())
}

/// Applies store::lifecycle::accept to what `tx` reads; the caller holds the locks of
/// `req`'s dedupe key, seal, payment and ordering key, and commits.
async fn accept_locked(
    tx: &Transaction<'_>,
    days: &Days,
    req: &AcceptRequest,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<AcceptOutcome, StoreError> {
    let claim = read_claim(tx, &req.dedupe.key, now).await?;
    let seal = match &req.seal {
        Some(seal) => read_text(tx, "SELECT response FROM seals", "key", &seal.key, now).await?,
        None => None,
    };
    let payment = match &req.payment {
        Some(p) => {
            read_text(
                tx,
                "SELECT status FROM payments",
                "payment_id",
                &p.payment_id,
                now,
            )
            .await?
        }
        None => None,
    };
    let payment = payment
        .map(|status| {
            PaymentStatus::parse(&status)
                .ok_or_else(|| corrupt(format!("payment status `{status}`")))
        })
        .transpose()?;
    let read = AcceptRead {
        claim: claim.as_ref(),
        seal: seal.as_deref(),
        payment,
    };
    let plan = match lifecycle::accept(read, req, now, lifetimes) {
        AcceptDecision::Answer(outcome) => return Ok(outcome),
        AcceptDecision::Replay {
            response,
            seal_until,
        } => {
            store_seal(tx, req, &response, seal_until).await?;
            return Ok(AcceptOutcome::Replayed { response });
        }
        AcceptDecision::Record(plan) => plan,
    };
    if let (Some(p), Some((status, ends_at))) = (&req.payment, &plan.payment) {
        tx.execute(
            "INSERT INTO payments (payment_id, status, expires_at) VALUES ($1, $2, $3) \
             ON CONFLICT (payment_id) DO UPDATE SET status = excluded.status, \
             expires_at = excluded.expires_at",
            &[&p.payment_id.as_str(), &status.as_str(), ends_at],
        )
        .await
        .db()?;
    }
    let claim = &req.dedupe;
    // An expired claim of the same key may still be there, not yet swept.
    let insert_claim = tx
        .prepare_cached(
            "INSERT INTO dedupe_claims (key, fingerprint, response, expires_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (key) DO UPDATE SET \
             fingerprint = excluded.fingerprint, response = excluded.response, \
             expires_at = excluded.expires_at",
        )
        .await
        .db()?;
    tx.execute(
        &insert_claim,
        &[
            &claim.key,
            &claim.stored_fingerprint(),
            &claim.response,
            &plan.claim_ends,
        ],
    )
    .await
    .db()?;
    store_seal(tx, req, &claim.response, plan.seal_ends).await?;

    let msg = &req.message;
    let start = &plan.message;
    let day = end_day(start.ends_at);
    if !days.known(day) {
        return Err(StoreError::Unavailable(format!(
            "the partition of day {day} of finished messages is missing; it is created on retry"
        )));
    }
    let record = record::encode(msg)?;
    let insert_message = tx
        .prepare_cached(
            "INSERT INTO messages \
             (id, end_day, record, source, ordering_key, state, deadline, ends_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .await
        .db()?;
    tx.execute(
        &insert_message,
        &[
            &msg.id.as_str(),
            &day,
            &record,
            &msg.source.as_deref(),
            &msg.ordering_key,
            &start.state.as_str(),
            &start.deadline,
            &start.ends_at,
        ],
    )
    .await
    .db()?;
    move_in_queue(tx, &msg.ordering_key, msg.id.as_str(), plan.queue).await?;
    Ok(AcceptOutcome::Accepted)
}

async fn read_claim(
    tx: &Transaction<'_>,
    key: &str,
    now: Millis,
) -> Result<Option<LiveClaim>, StoreError> {
    let statement = tx
        .prepare_cached(
            "SELECT fingerprint, response, expires_at FROM dedupe_claims \
             WHERE key = $1 AND expires_at > $2",
        )
        .await
        .db()?;
    match tx.query_opt(&statement, &[&key, &now]).await.db()? {
        Some(row) => Ok(Some(LiveClaim {
            fingerprint: fingerprint_from_stored(column(&row, 0)?),
            response: column(&row, 1)?,
            ends_at: column(&row, 2)?,
        })),
        None => Ok(None),
    }
}

/// `select` (one text column of a table with `expires_at`) of the row whose `key_column` is
/// `key`, while alive at `now`.
async fn read_text(
    tx: &Transaction<'_>,
    select: &str,
    key_column: &str,
    key: &str,
    now: Millis,
) -> Result<Option<String>, StoreError> {
    let statement = tx
        .prepare_cached(&format!(
            "{select} WHERE {key_column} = $1 AND expires_at > $2"
        ))
        .await
        .db()?;
    match tx.query_opt(&statement, &[&key, &now]).await.db()? {
        Some(row) => column(&row, 0).map(Some),
        None => Ok(None),
    }
}

/// Seals the request's signature, if any, to `response` until `until`.
async fn store_seal(
    tx: &Transaction<'_>,
    req: &AcceptRequest,
    response: &str,
    until: Option<Millis>,
) -> Result<(), StoreError> {
    if let (Some(seal), Some(until)) = (&req.seal, until) {
        let statement = tx
            .prepare_cached(
                "INSERT INTO seals (key, response, expires_at) VALUES ($1, $2, $3) \
                 ON CONFLICT (key) DO UPDATE SET response = excluded.response, \
                 expires_at = excluded.expires_at",
            )
            .await
            .db()?;
        tx.execute(&statement, &[&seal.key, &response, &until])
            .await
            .db()?;
    }
    Ok(())
}
