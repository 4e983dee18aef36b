//! The reads, on the read-only connection: they see the last commit (WAL) and never wait for
//! the writer.

use rusqlite::types::Value as SqlValue;
use rusqlite::{Connection, OptionalExtension, params, params_from_iter};

use super::error::{Db, corrupt};
use crate::clock::Millis;
use crate::store::counts::{self, MinuteCount};
use crate::store::recoveries::{self, InboundCount, Recovery};
use crate::store::{
    HistoryEntry, ListFilter, MessageId, MessageRecord, MessageState, NewMessage, Page, QueueDepth,
    StoreError, matches_filter,
};

const RECORD_COLUMNS: &str =
    "id, message_json, state, deadline, due_at, history_total, delivery_attempts, expires_at";

/// A record from a row of [`RECORD_COLUMNS`]; its history only when a connection is given
/// (list pages never load histories).
fn record_from_row(
    conn: Option<&Connection>,
    row: &rusqlite::Row<'_>,
) -> Result<MessageRecord, StoreError> {
    let id: String = row.get(0).db()?;
    let message_json: String = row.get(1).db()?;
    let state: String = row.get(2).db()?;
    let message: NewMessage = serde_json::from_str(&message_json).map_err(corrupt)?;
    let state = MessageState::parse(&state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{state}`")))?;
    Ok(MessageRecord {
        message,
        state,
        deadline: row.get(3).db()?,
        next_attempt_at: row.get(4).db()?,
        history: match conn {
            Some(conn) => history(conn, &id)?,
            None => Vec::new(),
        },
        history_total: row.get::<_, i64>(5).db()?.max(0) as u64,
        delivery_attempts: row.get(6).db()?,
        ends_at: row.get(7).db()?,
    })
}

fn history(conn: &Connection, id: &str) -> Result<Vec<HistoryEntry>, StoreError> {
    let rows: Vec<String> = conn
        .prepare_cached("SELECT attempt_json FROM attempts WHERE message_id = ?1 ORDER BY seq")
        .db()?
        .query_map(params![id], |r| r.get(0))
        .db()?
        .collect::<rusqlite::Result<_>>()
        .db()?;
    rows.iter()
        .map(|row| serde_json::from_str(row).map_err(corrupt))
        .collect()
}

pub(super) fn get(conn: &Connection, id: &str) -> Result<Option<MessageRecord>, StoreError> {
    // One read transaction: the record and its history come from the same commit.
    let tx = conn.unchecked_transaction().db()?;
    let mut stmt = tx
        .prepare_cached(&format!(
            "SELECT {RECORD_COLUMNS} FROM messages WHERE id = ?1"
        ))
        .db()?;
    let mut rows = stmt.query(params![id]).db()?;
    match rows.next().db()? {
        Some(row) => record_from_row(Some(&tx), row).map(Some),
        None => Ok(None),
    }
}

/// Every filter is answered by SQL on an indexed column (ids sort by creation time, so the
/// time window is an id range), so a page reads `limit + 1` rows whatever the filter; the
/// extra row only tells whether the scan reached the end.
pub(super) fn list(conn: &Connection, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.clamp(1, 100_000);
    let mut sql = format!("SELECT {RECORD_COLUMNS} FROM messages WHERE 1 = 1");
    let mut args: Vec<SqlValue> = Vec::new();
    let mut bind = |sql: &mut String, clause: &str, value: SqlValue| {
        args.push(value);
        sql.push_str(&format!(" AND {clause} ?{}", args.len()));
    };
    if let Some(after) = &filter.after {
        bind(&mut sql, "id >", SqlValue::Text(after.to_string()));
    }
    if let Some(from) = filter.created_from {
        let bound = MessageId::lower_bound(from).to_string();
        bind(&mut sql, "id >=", SqlValue::Text(bound));
    }
    if let Some(to) = filter.created_to {
        let bound = MessageId::lower_bound(to.saturating_add(1)).to_string();
        bind(&mut sql, "id <", SqlValue::Text(bound));
    }
    if let Some(state) = filter.state {
        bind(
            &mut sql,
            "state =",
            SqlValue::Text(state.as_str().to_string()),
        );
    }
    if let Some(source) = &filter.source {
        bind(&mut sql, "source =", SqlValue::Text(source.clone()));
    }
    if let Some(keys) = &filter.ordering_keys {
        let mut placeholders = Vec::with_capacity(keys.len());
        for key in keys {
            args.push(SqlValue::Text(key.clone()));
            placeholders.push(format!("?{}", args.len()));
        }
        sql.push_str(&format!(
            " AND ordering_key IN ({})",
            placeholders.join(", ")
        ));
    }
    args.push(SqlValue::Integer(limit as i64 + 1));
    sql.push_str(&format!(" ORDER BY id LIMIT ?{}", args.len()));

    let tx = conn.unchecked_transaction().db()?;
    let mut stmt = tx.prepare(&sql).db()?;
    let mut rows = stmt.query(params_from_iter(args)).db()?;
    let mut messages = Vec::new();
    let mut scanned = 0;
    let mut last_scanned = None;
    let mut more = false;
    while let Some(row) = rows.next().db()? {
        if scanned == limit {
            more = true;
            break;
        }
        scanned += 1;
        let record = record_from_row(None, row)?;
        last_scanned = Some(record.message.id.clone());
        // SQL already applied every filter, with the id range standing for the creation
        // window; this applies the record's own `created_at`, as the Redis backend does.
        if matches_filter(&record, filter) {
            messages.push(record);
        }
    }
    // The cursor is the last row read, matched or not, so the next page goes on from there.
    let next_after = if more { last_scanned } else { None };
    Ok(Page {
        messages,
        next_after,
    })
}

pub(super) fn depth(conn: &Connection) -> Result<QueueDepth, StoreError> {
    let mut depth = QueueDepth::default();
    let mut stmt = conn
        .prepare_cached(
            "SELECT state, count(*) FROM messages \
             WHERE state IN ('pending', 'in_flight', 'dead') GROUP BY state",
        )
        .db()?;
    let counts = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
        .db()?;
    for count in counts {
        let (state, n) = count.db()?;
        let n = u64::try_from(n).unwrap_or(0);
        match state.as_str() {
            "pending" => depth.pending = n,
            "in_flight" => depth.in_flight = n,
            "dead" => depth.dead = n,
            _ => {}
        }
    }
    Ok(depth)
}

/// Store::minute_counts: the rows of the window from `since` at `now`.
pub(super) fn minute_counts(
    conn: &Connection,
    since: Millis,
    now: Millis,
) -> Result<Vec<MinuteCount>, StoreError> {
    let (first, last) = counts::window(since, now);
    let mut stmt = conn
        .prepare_cached(
            "SELECT minute, deliveries, failures, dead FROM delivery_counts \
             WHERE minute >= ?1 AND minute <= ?2 ORDER BY minute",
        )
        .db()?;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    let rows = stmt
        .query_map(params![first, last], |r| {
            Ok(MinuteCount {
                minute: r.get(0)?,
                deliveries: count(r.get(1)?),
                failures: count(r.get(2)?),
                dead: count(r.get(3)?),
            })
        })
        .db()?
        .collect::<Result<Vec<_>, _>>()
        .db()?;
    Ok(rows)
}

pub(super) fn payment_status(
    conn: &Connection,
    payment_id: &str,
    now: Millis,
) -> Result<Option<String>, StoreError> {
    conn.prepare_cached("SELECT status FROM payments WHERE payment_id = ?1 AND expires_at > ?2")
        .db()?
        .query_row(params![payment_id, now], |r| r.get(0))
        .optional()
        .db()
}

pub(super) fn oldest_unfinished(conn: &Connection) -> Result<Option<MessageId>, StoreError> {
    // Two lookups on the (state, id) index instead of a scan of both states.
    let oldest: Option<String> = conn
        .query_row(
            "SELECT min(id) FROM (\
               SELECT min(id) AS id FROM messages WHERE state = 'pending' \
               UNION ALL \
               SELECT min(id) FROM messages WHERE state = 'in_flight')",
            [],
            |r| r.get(0),
        )
        .db()?;
    oldest
        .map(|id| {
            MessageId::parse(&id).ok_or_else(|| StoreError::Corrupt(format!("message id `{id}`")))
        })
        .transpose()
}

/// Store::inbound_counts: the source's minutes of the window, summed.
pub(super) fn inbound_counts(
    conn: &Connection,
    source: &str,
    since: Millis,
    until: Millis,
    now: Millis,
) -> Result<InboundCount, StoreError> {
    let (first, last) = recoveries::count_window(since, until, now);
    let (new, replays): (i64, i64) = conn
        .prepare_cached(
            "SELECT coalesce(sum(new), 0), coalesce(sum(replays), 0) FROM inbound_counts \
             WHERE source = ?1 AND minute >= ?2 AND minute <= ?3",
        )
        .db()?
        .query_row(params![source, first, last], |r| Ok((r.get(0)?, r.get(1)?)))
        .db()?;
    Ok(InboundCount {
        new: u64::try_from(new).unwrap_or(0),
        replays: u64::try_from(replays).unwrap_or(0),
    })
}

/// Store::recoveries: the live ones, newest first.
pub(super) fn recoveries(conn: &Connection, now: Millis) -> Result<Vec<Recovery>, StoreError> {
    let rows = conn
        .prepare_cached(
            "SELECT recovery_json FROM recoveries WHERE started_at > ?1 ORDER BY id DESC LIMIT ?2",
        )
        .db()?
        .query_map(
            params![
                now - recoveries::RECOVERY_LIFETIME_MS,
                recoveries::MAX_RECOVERIES as i64
            ],
            |r| r.get::<_, String>(0),
        )
        .db()?
        .collect::<Result<Vec<_>, _>>()
        .db()?;
    rows.iter()
        .map(|json| serde_json::from_str(json).map_err(corrupt))
        .collect()
}

/// Store::recovery.
pub(super) fn recovery(
    conn: &Connection,
    id: &str,
    now: Millis,
) -> Result<Option<Recovery>, StoreError> {
    let json: Option<String> = conn
        .prepare_cached("SELECT recovery_json FROM recoveries WHERE id = ?1 AND started_at > ?2")
        .db()?
        .query_row(params![id, now - recoveries::RECOVERY_LIFETIME_MS], |r| {
            r.get(0)
        })
        .optional()
        .db()?;
    json.map(|json| serde_json::from_str(&json).map_err(corrupt))
        .transpose()
}
