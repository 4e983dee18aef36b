//! A batch of accepts applied as sets: one statement reads every claim, seal, payment and
//! queue the batch names, the rules decide each accept in order in Rust, and one statement
//! writes everything they decided. A batch then costs the server a few statements, not ten
//! round trips per accept, which is what bounded group commit (`batch.rs`).
//!
//! The rules must see the batch as the one-by-one path would: each accept sees what the
//! accepts before it in the batch decided to write ([`Overlay`]). An accept the rules refuse
//! for a reason Rust can see (a day partition this process has not made) fails alone and
//! writes nothing. A write the server refuses (a message id already taken) fails the whole
//! statement: the caller rolls it back and runs the batch one accept at a time instead
//! (`accept.rs`), where that accept fails alone.

use std::collections::{BTreeMap, HashMap, HashSet};

use deadpool_postgres::Transaction;

use super::days::{Days, end_day};
use super::error::{Db, column, corrupt};
use super::listen::CHANNEL;
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::counts::minute_of;
use crate::store::lifecycle::{
    self, AcceptDecision, AcceptPlan, AcceptRead, Lifetimes, LiveClaim, QueueMove,
};
use crate::store::{
    AcceptOutcome, AcceptRequest, Arrival, InboundCount, StoreError, fingerprint_from_stored,
    record,
};

/// One accept of a batch: the request, the caller's time, the store's lifetimes.
pub(super) struct Queued {
    pub req: AcceptRequest,
    pub now: Millis,
    pub lifetimes: Lifetimes,
}

/// What the batch's keys hold, read once, whether alive or not: each accept checks liveness
/// at its own `now`.
#[derive(Default)]
struct Overlay {
    claims: HashMap<String, LiveClaim>,
    seals: HashMap<String, (String, Millis)>,
    payments: HashMap<String, (PaymentStatus, Millis)>,
    /// Ordering keys whose queue is not empty: a message joining them is not the head.
    queued: HashSet<String>,
}

/// The rows the batch writes, one per key (the last decision for it wins, as it would have
/// one by one), and the messages in acceptance order.
#[derive(Default)]
struct Writes {
    claims: HashMap<String, (String, String, Millis)>,
    seals: HashMap<String, (String, Millis)>,
    payments: HashMap<String, (String, Millis)>,
    messages: Vec<MessageRow>,
    wakes: bool,
    /// Inbound accepts per source, minute and slot (store/recoveries.rs): summed over the
    /// batch and upserted with the rest, sorted, so a batch adds to each row once.
    arrivals: Arrivals,
}

/// Inbound accepts by (source, minute, slot), in the order their rows are locked.
pub(super) type Arrivals = BTreeMap<(String, Millis, i16), InboundCount>;

/// Adds what an accept of `req` at `now` that answered `outcome` counts, if anything.
pub(super) fn count_arrival(
    arrivals: &mut Arrivals,
    req: &AcceptRequest,
    outcome: &AcceptOutcome,
    now: Millis,
) {
    if let Some((source, arrival)) = Arrival::of(req, outcome) {
        let slot = i16::from(req.message.id.partition());
        let sum = arrivals
            .entry((source.to_string(), minute_of(now), slot))
            .or_default();
        *sum = sum.plus(arrival.count());
    }
}

/// Upserts `arrivals` in one statement, in their order (the one-by-one path's count; the set
/// path writes them within its own statement).
pub(super) async fn write_arrivals(
    tx: &Transaction<'_>,
    arrivals: &Arrivals,
) -> Result<(), StoreError> {
    if arrivals.is_empty() {
        return Ok(());
    }
    let columns = ArrivalColumns::of(arrivals);
    let statement = tx
        .prepare_cached(&format!("{UPSERT_ARRIVALS} $1::text[], $2::int8[], $3::int2[], $4::int8[], $5::int8[]{UPSERT_ARRIVALS_END}"))
        .await
        .db()?;
    tx.execute(
        &statement,
        &[
            &columns.sources,
            &columns.minutes,
            &columns.slots,
            &columns.new,
            &columns.replays,
        ],
    )
    .await
    .db()?;
    Ok(())
}

/// The upsert of inbound counts, around the five arrays it reads.
const UPSERT_ARRIVALS: &str = "INSERT INTO inbound_counts (source, minute, slot, new, replays) \
     SELECT * FROM unnest(";
const UPSERT_ARRIVALS_END: &str = ") AS c (source, minute, slot, new, replays) \
     ORDER BY source, minute, slot \
     ON CONFLICT (source, minute, slot) DO UPDATE SET \
     new = inbound_counts.new + excluded.new, replays = inbound_counts.replays + excluded.replays";

/// [`Arrivals`] as the statement's arrays.
struct ArrivalColumns {
    sources: Vec<String>,
    minutes: Vec<Millis>,
    slots: Vec<i16>,
    new: Vec<i64>,
    replays: Vec<i64>,
}

impl ArrivalColumns {
    fn of(arrivals: &Arrivals) -> ArrivalColumns {
        let n = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        ArrivalColumns {
            sources: arrivals.keys().map(|k| k.0.clone()).collect(),
            minutes: arrivals.keys().map(|k| k.1).collect(),
            slots: arrivals.keys().map(|k| k.2).collect(),
            new: arrivals.values().map(|c| n(c.new)).collect(),
            replays: arrivals.values().map(|c| n(c.replays)).collect(),
        }
    }
}

struct MessageRow {
    id: String,
    end_day: i32,
    record: Vec<u8>,
    source: Option<String>,
    ordering_key: String,
    state: &'static str,
    deadline: Millis,
    ends_at: Option<Millis>,
    due_at: Option<Millis>,
    queued: bool,
}

/// Decides and applies `batch` as sets, under the batch's locks (the caller took them).
/// `Ok` holds each accept's outcome; `Err` means the write failed as a whole and nothing of
/// it may be kept: the caller rolls back to before it.
pub(super) async fn accept_as_sets(
    tx: &Transaction<'_>,
    days: &Days,
    batch: &[Queued],
) -> Result<Vec<Result<AcceptOutcome, StoreError>>, StoreError> {
    let mut overlay = read(tx, batch).await?;
    let mut writes = Writes::default();
    let mut outcomes = Vec::with_capacity(batch.len());
    for queued in batch {
        let outcome = decide(&mut overlay, &mut writes, days, queued);
        if let Ok(outcome) = &outcome {
            count_arrival(&mut writes.arrivals, &queued.req, outcome, queued.now);
        }
        outcomes.push(outcome);
    }
    write(tx, writes).await?;
    Ok(outcomes)
}

async fn read(tx: &Transaction<'_>, batch: &[Queued]) -> Result<Overlay, StoreError> {
    let claim_keys: Vec<&str> = batch.iter().map(|q| q.req.dedupe.key.as_str()).collect();
    let seal_keys: Vec<&str> = batch
        .iter()
        .filter_map(|q| q.req.seal.as_ref().map(|s| s.key.as_str()))
        .collect();
    let payment_ids: Vec<&str> = batch
        .iter()
        .filter_map(|q| q.req.payment.as_ref().map(|p| p.payment_id.as_str()))
        .collect();
    let ordering_keys: Vec<&str> = batch
        .iter()
        .map(|q| q.req.message.ordering_key.as_str())
        .collect();
    let statement = tx
        .prepare_cached(
            "SELECT 0, key, fingerprint, response, expires_at FROM dedupe_claims \
             WHERE key = ANY($1::text[]) \
             UNION ALL SELECT 1, key, NULL, response, expires_at FROM seals \
             WHERE key = ANY($2::text[]) \
             UNION ALL SELECT 2, payment_id, NULL, status, expires_at FROM payments \
             WHERE payment_id = ANY($3::text[]) \
             UNION ALL SELECT DISTINCT 3, ordering_key, NULL::text, NULL::text, NULL::int8 \
             FROM queue WHERE ordering_key = ANY($4::text[])",
        )
        .await
        .db()?;
    let rows = tx
        .query(
            &statement,
            &[&claim_keys, &seal_keys, &payment_ids, &ordering_keys],
        )
        .await
        .db()?;
    let mut overlay = Overlay::default();
    for row in rows {
        let kind: i32 = column(&row, 0)?;
        let key: String = column(&row, 1)?;
        match kind {
            0 => {
                let claim = LiveClaim {
                    fingerprint: fingerprint_from_stored(column(&row, 2)?),
                    response: column(&row, 3)?,
                    ends_at: column(&row, 4)?,
                };
                overlay.claims.insert(key, claim);
            }
            1 => {
                overlay
                    .seals
                    .insert(key, (column(&row, 3)?, column(&row, 4)?));
            }
            2 => {
                let status: String = column(&row, 3)?;
                let status = PaymentStatus::parse(&status)
                    .ok_or_else(|| corrupt(format!("payment status `{status}`")))?;
                overlay.payments.insert(key, (status, column(&row, 4)?));
            }
            _ => {
                overlay.queued.insert(key);
            }
        }
    }
    Ok(overlay)
}

/// One accept, as `accept.rs` decides it, against what the batch read and what the accepts
/// before it in the batch wrote.
fn decide(
    overlay: &mut Overlay,
    writes: &mut Writes,
    days: &Days,
    queued: &Queued,
) -> Result<AcceptOutcome, StoreError> {
    let (req, now) = (&queued.req, queued.now);
    let claim = overlay
        .claims
        .get(&req.dedupe.key)
        .filter(|c| c.ends_at > now);
    let seal = req
        .seal
        .as_ref()
        .and_then(|s| overlay.seals.get(&s.key))
        .filter(|(_, ends)| *ends > now)
        .map(|(response, _)| response.as_str());
    let payment = req
        .payment
        .as_ref()
        .and_then(|p| overlay.payments.get(p.payment_id.as_ref()))
        .filter(|(_, ends)| *ends > now)
        .map(|(status, _)| *status);
    let read = AcceptRead {
        claim,
        seal,
        payment,
    };
    match lifecycle::accept(read, req, now, queued.lifetimes) {
        AcceptDecision::Answer(outcome) => Ok(outcome),
        AcceptDecision::Replay {
            response,
            seal_until,
        } => {
            seal_to(overlay, writes, req, &response, seal_until);
            Ok(AcceptOutcome::Replayed { response })
        }
        AcceptDecision::Record(plan) => record(overlay, writes, days, req, plan),
    }
}

fn record(
    overlay: &mut Overlay,
    writes: &mut Writes,
    days: &Days,
    req: &AcceptRequest,
    plan: AcceptPlan,
) -> Result<AcceptOutcome, StoreError> {
    let msg = &req.message;
    let day = end_day(plan.message.ends_at);
    if !days.known(day) {
        return Err(StoreError::Unavailable(format!(
            "the partition of day {day} of finished messages is missing; it is created on retry"
        )));
    }
    let record = record::encode(msg)?;
    if let (Some(p), Some((status, ends_at))) = (&req.payment, plan.payment) {
        overlay
            .payments
            .insert(p.payment_id.to_string(), (status, ends_at));
        writes.payments.insert(
            p.payment_id.to_string(),
            (status.as_str().to_string(), ends_at),
        );
    }
    let claim = &req.dedupe;
    overlay.claims.insert(
        claim.key.clone(),
        LiveClaim {
            fingerprint: claim.fingerprint.clone(),
            response: claim.response.clone(),
            ends_at: plan.claim_ends,
        },
    );
    writes.claims.insert(
        claim.key.clone(),
        (
            claim.stored_fingerprint().to_string(),
            claim.response.clone(),
            plan.claim_ends,
        ),
    );
    seal_to(overlay, writes, req, &claim.response, plan.seal_ends);
    let (due_at, queued) = match plan.queue {
        QueueMove::Join { due_if_head } => {
            let head = overlay.queued.insert(msg.ordering_key.clone());
            (head.then_some(due_if_head), true)
        }
        QueueMove::Stay | QueueMove::Leave { .. } => (None, false),
    };
    writes.wakes |= due_at.is_some();
    writes.messages.push(MessageRow {
        id: msg.id.as_str().to_string(),
        end_day: day,
        record,
        source: msg.source.as_ref().map(|s| s.to_string()),
        ordering_key: msg.ordering_key.clone(),
        state: plan.message.state.as_str(),
        deadline: plan.message.deadline,
        ends_at: plan.message.ends_at,
        due_at,
        queued,
    });
    Ok(AcceptOutcome::Accepted)
}

fn seal_to(
    overlay: &mut Overlay,
    writes: &mut Writes,
    req: &AcceptRequest,
    response: &str,
    until: Option<Millis>,
) {
    if let (Some(seal), Some(until)) = (&req.seal, until) {
        overlay
            .seals
            .insert(seal.key.clone(), (response.to_string(), until));
        writes
            .seals
            .insert(seal.key.clone(), (response.to_string(), until));
    }
}

/// Everything the batch decided, in one statement: each table's rows as arrays. The queue's
/// rows go in acceptance order, which their positions keep.
async fn write(tx: &Transaction<'_>, writes: Writes) -> Result<(), StoreError> {
    if writes.claims.is_empty() && writes.seals.is_empty() && writes.arrivals.is_empty() {
        return Ok(());
    }
    let arrivals = ArrivalColumns::of(&writes.arrivals);
    let (payment_ids, (statuses, payment_ends)): (Vec<String>, (Vec<String>, Vec<Millis>)) =
        writes.payments.into_iter().unzip();
    let (claim_keys, claim_rows): (Vec<String>, Vec<(String, String, Millis)>) =
        writes.claims.into_iter().unzip();
    let (fingerprints, claim_responses, claim_ends) = columns3(claim_rows);
    let (seal_keys, (seal_responses, seal_ends)): (Vec<String>, (Vec<String>, Vec<Millis>)) =
        writes.seals.into_iter().unzip();
    let m = &writes.messages;
    let ids: Vec<&str> = m.iter().map(|r| r.id.as_str()).collect();
    let end_days: Vec<i32> = m.iter().map(|r| r.end_day).collect();
    let records: Vec<&[u8]> = m.iter().map(|r| r.record.as_slice()).collect();
    let sources: Vec<Option<&str>> = m.iter().map(|r| r.source.as_deref()).collect();
    let keys: Vec<&str> = m.iter().map(|r| r.ordering_key.as_str()).collect();
    let states: Vec<&str> = m.iter().map(|r| r.state).collect();
    let deadlines: Vec<Millis> = m.iter().map(|r| r.deadline).collect();
    let ends: Vec<Option<Millis>> = m.iter().map(|r| r.ends_at).collect();
    let dues: Vec<Option<Millis>> = m.iter().map(|r| r.due_at).collect();
    let queued: Vec<bool> = m.iter().map(|r| r.queued).collect();
    let statement = tx
        .prepare_cached(&format!(
            "WITH payment_rows AS (INSERT INTO payments (payment_id, status, expires_at) \
               SELECT * FROM unnest($1::text[], $2::text[], $3::int8[]) \
               ON CONFLICT (payment_id) DO UPDATE SET status = excluded.status, \
               expires_at = excluded.expires_at), \
             claim_rows AS (INSERT INTO dedupe_claims (key, fingerprint, response, expires_at) \
               SELECT * FROM unnest($4::text[], $5::text[], $6::text[], $7::int8[]) \
               ON CONFLICT (key) DO UPDATE SET fingerprint = excluded.fingerprint, \
               response = excluded.response, expires_at = excluded.expires_at), \
             seal_rows AS (INSERT INTO seals (key, response, expires_at) \
               SELECT * FROM unnest($8::text[], $9::text[], $10::int8[]) \
               ON CONFLICT (key) DO UPDATE SET response = excluded.response, \
               expires_at = excluded.expires_at), \
             new_messages AS (SELECT * FROM unnest($11::text[], $12::int4[], $13::bytea[], \
               $14::text[], $15::text[], $16::text[], $17::int8[], $18::int8[], $19::int8[], \
               $20::bool[]) WITH ORDINALITY AS m (id, end_day, record, source, \
               ordering_key, state, deadline, ends_at, due_at, queued, n)), \
             message_rows AS (INSERT INTO messages (id, end_day, record, source, \
               ordering_key, state, deadline, ends_at, due_at) \
               SELECT id, end_day, record, source, ordering_key, state, deadline, \
               ends_at, due_at FROM new_messages), \
             queue_rows AS (INSERT INTO queue (ordering_key, id) \
               SELECT ordering_key, id FROM new_messages WHERE queued ORDER BY n), \
             count_rows AS ({UPSERT_ARRIVALS} $22::text[], $23::int8[], $24::int2[], \
               $25::int8[], $26::int8[]{UPSERT_ARRIVALS_END}) \
             SELECT pg_notify('{CHANNEL}', '') WHERE $21::bool"
        ))
        .await
        .db()?;
    tx.execute(
        &statement,
        &[
            &payment_ids,
            &statuses,
            &payment_ends,
            &claim_keys,
            &fingerprints,
            &claim_responses,
            &claim_ends,
            &seal_keys,
            &seal_responses,
            &seal_ends,
            &ids,
            &end_days,
            &records,
            &sources,
            &keys,
            &states,
            &deadlines,
            &ends,
            &dues,
            &queued,
            &writes.wakes,
            &arrivals.sources,
            &arrivals.minutes,
            &arrivals.slots,
            &arrivals.new,
            &arrivals.replays,
        ],
    )
    .await
    .db()?;
    Ok(())
}

fn columns3<A, B, C>(rows: Vec<(A, B, C)>) -> (Vec<A>, Vec<B>, Vec<C>) {
    let mut columns = (
        Vec::with_capacity(rows.len()),
        Vec::with_capacity(rows.len()),
        Vec::with_capacity(rows.len()),
    );
    for (a, b, c) in rows {
        columns.0.push(a);
        columns.1.push(b);
        columns.2.push(c);
    }
    columns
}
