//! The accept transaction: the dedupe claim, the payment compare-and-set, the signature seal
//! and the new message, all or nothing (ARCHITECTURE.md §1.2). It runs inside the writer's
//! transaction, in a savepoint of its own.

use rusqlite::{Connection, OptionalExtension, params};

use super::commands::push_to_queue;
use super::error::{Db, corrupt};
use super::secs_to_ms;
use crate::clock::Millis;
use crate::store::{AcceptOutcome, AcceptRequest, MessageState, StoreError};

/// Implements store::lifecycle::accept (src/store/lifecycle.rs).
pub(super) fn accept(
    conn: &Connection,
    req: &AcceptRequest,
    now: Millis,
    retention_ms: i64,
    payment_retention_ms: i64,
) -> Result<AcceptOutcome, StoreError> {
    let claim = &req.dedupe;
    let existing: Option<(String, String, Millis)> = conn
        .prepare_cached(
            "SELECT fingerprint, response, expires_at FROM dedupe_claims \
             WHERE key = ?1 AND expires_at > ?2",
        )
        .db()?
        .query_row(params![claim.key, now], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .optional()
        .db()?;
    if let Some(seal) = &req.seal {
        let first: Option<String> = conn
            .prepare_cached("SELECT response FROM seals WHERE key = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![seal.key, now], |r| r.get(0))
            .optional()
            .db()?;
        // The seal holds the answer of the claim its signature was accepted under, which
        // names that claim's message: any other claim is the same signed bytes re-posted
        // under another dedupe key.
        if let Some(response) = first {
            return Ok(match &existing {
                Some((_, claimed, _)) if *claimed == response => {
                    AcceptOutcome::Replayed { response }
                }
                _ => AcceptOutcome::SignatureReused,
            });
        }
    }
    if let Some((fingerprint, response, claim_ends)) = existing {
        if fingerprint != claim.fingerprint {
            return Ok(AcceptOutcome::Conflict);
        }
        seal(conn, req, &response, claim_ends)?;
        return Ok(AcceptOutcome::Replayed { response });
    }
    let expires_at = now.saturating_add(secs_to_ms(claim.ttl_secs));
    if let Some(p) = req.payment.as_ref().filter(|p| !p.to.is_empty()) {
        let current: String = conn
            .prepare_cached("SELECT status FROM payments WHERE payment_id = ?1 AND expires_at > ?2")
            .db()?
            .query_row(params![p.payment_id, now], |r| r.get(0))
            .optional()
            .db()?
            .unwrap_or_else(|| "undefined".to_string());
        if !p.allowed_from.contains(&current) {
            return Ok(AcceptOutcome::InvalidTransition { from: current });
        }
        conn.prepare_cached(
            "INSERT INTO payments (payment_id, status, expires_at) VALUES (?1, ?2, ?3) \
             ON CONFLICT (payment_id) DO UPDATE SET status = excluded.status, \
             expires_at = excluded.expires_at",
        )
        .db()?
        .execute(params![
            p.payment_id,
            p.to,
            now.saturating_add(payment_retention_ms)
        ])
        .db()?;
    }
    // REPLACE: an expired claim of the same key may still be there, not yet swept.
    conn.prepare_cached(
        "INSERT OR REPLACE INTO dedupe_claims (key, fingerprint, response, expires_at) \
         VALUES (?1, ?2, ?3, ?4)",
    )
    .db()?
    .execute(params![
        claim.key,
        claim.fingerprint,
        claim.response,
        expires_at
    ])
    .db()?;
    seal(conn, req, &claim.response, expires_at)?;

    let msg = &req.message;
    let pending = msg.target_url.is_some();
    let state = if pending {
        MessageState::Pending
    } else {
        MessageState::Recorded
    };
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
        msg.source,
        msg.ordering_key,
        state.as_str(),
        msg.deadline,
        // A recorded message has nothing left to do: it is kept for the message retention,
        // like a finished one (store::lifecycle::accept), whatever its claim's TTL.
        (!pending).then_some(now.saturating_add(retention_ms)),
    ])
    .db()?;
    if pending {
        push_to_queue(conn, &msg.ordering_key, msg.id.as_str(), now)?;
    }
    Ok(AcceptOutcome::Accepted)
}

/// Remembers a signature's first answer, that of the claim it was accepted under, until the
/// signature could no longer be accepted or that claim ends, whichever comes first.
fn seal(
    conn: &Connection,
    req: &AcceptRequest,
    response: &str,
    claim_ends: Millis,
) -> Result<(), StoreError> {
    if let Some(seal) = &req.seal {
        conn.prepare_cached(
            "INSERT OR REPLACE INTO seals (key, response, expires_at) VALUES (?1, ?2, ?3)",
        )
        .db()?
        .execute(params![seal.key, response, seal.expires_at.min(claim_ends)])
        .db()?;
    }
    Ok(())
}
