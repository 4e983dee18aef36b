//! The accept transaction: the dedupe claim, the payment compare-and-set, the signature seal
//! and the new message, all or nothing (ARCHITECTURE.md §1.2). It runs inside the writer's
//! transaction, in a savepoint of its own, and applies what `store::lifecycle::accept`
//! decides from what it reads.

use rusqlite::{Connection, OptionalExtension, params};

use super::commands::join_queue;
use super::error::{Db, corrupt};
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::counts;
use crate::store::lifecycle::{self, AcceptDecision, AcceptRead, Lifetimes, LiveClaim};
use crate::store::{AcceptOutcome, AcceptRequest, Arrival, StoreError, fingerprint_from_stored};

/// Applies store::lifecycle::accept to what this transaction reads, and counts an inbound
/// callback recorded or replayed in its source's minute (store/recoveries.rs) in the same
/// savepoint, so a count never exists without its accept.
pub(super) fn accept(
    conn: &Connection,
    req: &AcceptRequest,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<AcceptOutcome, StoreError> {
    let outcome = decide_and_write(conn, req, now, lifetimes)?;
    if let Some((source, arrival)) = Arrival::of(req, &outcome) {
        let added = arrival.count();
        conn.prepare_cached(
            "INSERT INTO inbound_counts (source, minute, new, replays) VALUES (?1, ?2, ?3, ?4) \
             ON CONFLICT (source, minute) DO UPDATE SET new = new + excluded.new, \
             replays = replays + excluded.replays",
        )
        .db()?
        .execute(params![
            source,
            counts::minute_of(now),
            added.new as i64,
            added.replays as i64
        ])
        .db()?;
    }
    Ok(outcome)
}

fn decide_and_write(
    conn: &Connection,
    req: &AcceptRequest,
    now: Millis,
    lifetimes: Lifetimes,
) -> Result<AcceptOutcome, StoreError> {
    let claim: Option<LiveClaim> = conn
        .prepare_cached(
            "SELECT fingerprint, response, expires_at FROM dedupe_claims \
             WHERE key = ?1 AND expires_at > ?2",
        )
        .db()?
        .query_row(params![req.dedupe.key, now], |r| {
            Ok(LiveClaim {
                fingerprint: fingerprint_from_stored(r.get(0)?),
                response: r.get(1)?,
                ends_at: r.get(2)?,
            })
        })
        .optional()
        .db()?;
    let seal: Option<String> = match &req.seal {
        Some(seal) => conn
            .prepare_cached("SELECT response FROM seals WHERE key = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![seal.key, now], |r| r.get(0))
            .optional()
            .db()?,
        None => None,
    };
    let payment: Option<String> = match &req.payment {
        Some(p) => conn
            .prepare_cached("SELECT status FROM payments WHERE payment_id = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![p.payment_id.as_str(), now], |r| r.get(0))
            .optional()
            .db()?,
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
            store_seal(conn, req, &response, seal_until)?;
            return Ok(AcceptOutcome::Replayed { response });
        }
        AcceptDecision::Record(plan) => plan,
    };
    if let (Some(p), Some((status, ends_at))) = (&req.payment, &plan.payment) {
        conn.prepare_cached(
            "INSERT INTO payments (payment_id, status, expires_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT (payment_id) DO UPDATE SET status = excluded.status, \
             expires_at = excluded.expires_at",
        )
        .db()?
        .execute(params![p.payment_id.as_str(), status.as_str(), ends_at])
        .db()?;
    }
    let claim = &req.dedupe;
    // REPLACE: an expired claim of the same key may still be there, not yet swept.
    conn.prepare_cached(
        "INSERT OR REPLACE INTO dedupe_claims (key, fingerprint, response, expires_at) \
         VALUES (?1, ?2, ?3, ?4)",
    )
    .db()?
    .execute(params![
        claim.key,
        claim.stored_fingerprint(),
        claim.response,
        plan.claim_ends
    ])
    .db()?;
    store_seal(conn, req, &claim.response, plan.seal_ends)?;

    let msg = &req.message;
    let start = &plan.message;
    let message_json = serde_json::to_string(msg).map_err(corrupt)?;
    conn.prepare_cached(
        "INSERT INTO messages \
         (id, message_json, source, ordering_key, state, deadline, expires_at) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )
    .db()?
    .execute(params![
        msg.id.as_str(),
        message_json,
        msg.source.as_deref(),
        msg.ordering_key,
        start.state.as_str(),
        start.deadline,
        start.ends_at,
    ])
    .db()?;
    join_queue(conn, &msg.ordering_key, msg.id.as_str(), plan.queue)?;
    Ok(AcceptOutcome::Accepted)
}

/// Seals the request's signature, if any, to `response` until `until`.
fn store_seal(
    conn: &Connection,
    req: &AcceptRequest,
    response: &str,
    until: Option<Millis>,
) -> Result<(), StoreError> {
    if let (Some(seal), Some(until)) = (&req.seal, until) {
        conn.prepare_cached(
            "INSERT OR REPLACE INTO seals (key, response, expires_at) VALUES (?1, ?2, ?3)",
        )
        .db()?
        .execute(params![seal.key, response, until])
        .db()?;
    }
    Ok(())
}
