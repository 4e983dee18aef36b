//! The reads: each is one statement, so it sees one snapshot (a record and its history come
//! from the same commit) and costs one round trip. None waits for a writer: PostgreSQL's
//! readers never block on row locks.
//!
//! A finished message whose end is at or below the sweep horizon is gone ([`NOT_GONE`]), though
//! its day partition may not have been dropped yet: reads agree with the sweep, not with what
//! happens to be on disk.

use deadpool_postgres::Client;
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use super::error::{Db, column, corrupt};
use super::{NOT_GONE, RECORD};
use crate::clock::Millis;
use crate::store::counts::{self, MinuteCount};
use crate::store::{
    HistoryEntry, ListFilter, MessageId, MessageRecord, MessageState, Page, QueueDepth, StoreError,
    matches_filter, record,
};

/// What a record is read from: `m.id, {RECORD}, ` and these.
const STATE_COLUMNS: &str =
    "m.state, m.deadline, m.due_at, m.history_total, m.delivery_attempts, m.ends_at";

/// A record from a row of `m.id, {RECORD}, {STATE_COLUMNS}`, with `history` (empty on list pages, which
/// never load histories).
fn record_from_row(row: &Row, history: Vec<HistoryEntry>) -> Result<MessageRecord, StoreError> {
    let id: String = column(row, 0)?;
    let message = record::decode(column(row, 1)?)?;
    let state: String = column(row, 2)?;
    let state = MessageState::parse(&state)
        .ok_or_else(|| corrupt(format!("message {id} has state `{state}`")))?;
    let history_total: i64 = column(row, 5)?;
    let delivery_attempts: i32 = column(row, 6)?;
    Ok(MessageRecord {
        message,
        state,
        deadline: column(row, 3)?,
        next_attempt_at: column(row, 4)?,
        history,
        history_total: u64::try_from(history_total).map_err(corrupt)?,
        delivery_attempts: u32::try_from(delivery_attempts).map_err(corrupt)?,
        ends_at: column(row, 7)?,
    })
}

pub(super) async fn get(client: &Client, id: &str) -> Result<Option<MessageRecord>, StoreError> {
    let statement = client
        .prepare_cached(&format!(
            "SELECT m.id, {RECORD}, {STATE_COLUMNS}, m.first_entry, \
               ARRAY(SELECT h.entry_json FROM history h \
                     WHERE h.message_id = m.id AND h.end_day = m.end_day ORDER BY h.seq) \
             FROM messages m WHERE m.id = $1 AND {NOT_GONE}"
        ))
        .await
        .db()?;
    let rows = client.query(&statement, &[&id]).await.db()?;
    let row = match rows.as_slice() {
        [] => return Ok(None),
        [row] => row,
        _ => {
            return Err(corrupt(format!(
                "message {id} is in more than one partition"
            )));
        }
    };
    // Layout 5 keeps the first row in the message's row; a message written before keeps
    // it in `history`, as its row number 1, and has no `first_entry`.
    let first: Option<String> = column(row, 8)?;
    let later: Vec<String> = column(row, 9)?;
    let history = first
        .iter()
        .chain(&later)
        .map(|entry| serde_json::from_str(entry).map_err(corrupt))
        .collect::<Result<_, _>>()?;
    record_from_row(row, history).map(Some)
}

/// Every filter is answered by SQL, every partition's rows merged in id order (ids sort by
/// creation time, so the time window is an id range); the extra row of `limit + 1` only tells
/// whether the scan reached the end. Pending, in-flight and dead messages are read by index, a
/// page's worth; ordering keys by a hash index (layout 5), every row of the keys, a handful
/// each (a transaction's or a payment's), sorted. Delivered and recorded messages, and a
/// source's finished ones, are read by walking the finished days' primary keys (layout 4 keeps
/// no index of them there): a page reads the rows it skips too, few for what finished days are
/// made of, more for a rare source.
pub(super) async fn list(client: &Client, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.clamp(1, 100_000);
    let mut sql =
        format!("SELECT m.id, {RECORD}, {STATE_COLUMNS} FROM messages m WHERE {NOT_GONE}");
    let mut args: Vec<Box<dyn ToSql + Sync + Send>> = Vec::new();
    let mut bind = |sql: &mut String, clause: &str, value: Box<dyn ToSql + Sync + Send>| {
        args.push(value);
        sql.push_str(&format!(" AND {clause} ${}", args.len()));
    };
    if let Some(after) = &filter.after {
        bind(&mut sql, "m.id >", Box::new(after.to_string()));
    }
    if let Some(from) = filter.created_from {
        bind(
            &mut sql,
            "m.id >=",
            Box::new(MessageId::lower_bound(from).to_string()),
        );
    }
    if let Some(to) = filter.created_to {
        let bound = MessageId::lower_bound(to.saturating_add(1)).to_string();
        bind(&mut sql, "m.id <", Box::new(bound));
    }
    if let Some(state) = filter.state {
        // A literal, so that the plan sees whether `messages_by_state` (partial) holds it,
        // and the partition it lives in, so that a finished state never walks the live
        // partition's backlog nor an unfinished one the finished days.
        let lives_in = match state {
            MessageState::Pending | MessageState::InFlight => "m.end_day = 0",
            MessageState::Delivered | MessageState::Dead | MessageState::Recorded => {
                "m.end_day <> 0"
            }
        };
        sql.push_str(&format!(
            " AND m.state = '{}' AND {lives_in}",
            state.as_str()
        ));
    }
    if let Some(source) = &filter.source {
        bind(&mut sql, "m.source =", Box::new(source.clone()));
    }
    if let Some(keys) = &filter.ordering_keys {
        args.push(Box::new(keys.clone()));
        sql.push_str(&format!(" AND m.ordering_key = ANY(${})", args.len()));
    }
    args.push(Box::new(i64::try_from(limit).unwrap_or(i64::MAX) + 1));
    sql.push_str(&format!(" ORDER BY m.id LIMIT ${}", args.len()));

    let params: Vec<&(dyn ToSql + Sync)> = args
        .iter()
        .map(|arg| &**arg as &(dyn ToSql + Sync))
        .collect();
    let rows = client.query(&sql, &params).await.db()?;
    let mut messages = Vec::new();
    let mut last_scanned = None;
    for row in rows.iter().take(limit) {
        let record = record_from_row(row, Vec::new())?;
        last_scanned = Some(record.message.id.clone());
        // SQL already applied every filter, with the id range standing for the creation
        // window; this applies the record's own `created_at`, as the other engines do.
        if matches_filter(&record, filter) {
            messages.push(record);
        }
    }
    // The cursor is the last row read, matched or not, so the next page goes on from there.
    let next_after = if rows.len() > limit {
        last_scanned
    } else {
        None
    };
    Ok(Page {
        messages,
        next_after,
    })
}

pub(super) async fn depth(client: &Client) -> Result<QueueDepth, StoreError> {
    let statement = client
        .prepare_cached(&format!(
            "SELECT m.state, count(*) FROM messages m \
             WHERE m.state IN ('pending', 'in_flight', 'dead') AND {NOT_GONE} GROUP BY m.state"
        ))
        .await
        .db()?;
    let mut depth = QueueDepth::default();
    for row in client.query(&statement, &[]).await.db()? {
        let state: String = column(&row, 0)?;
        let n: i64 = column(&row, 1)?;
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

/// Store::minute_counts: the window from `since` at `now`, every slot of a minute summed.
pub(super) async fn minute_counts(
    client: &Client,
    since: Millis,
    now: Millis,
) -> Result<Vec<MinuteCount>, StoreError> {
    let (first, last) = counts::window(since, now);
    let statement = client
        .prepare_cached(
            "SELECT minute, sum(deliveries)::bigint, sum(failures)::bigint, sum(dead)::bigint \
             FROM delivery_counts WHERE minute >= $1 AND minute <= $2 \
             GROUP BY minute ORDER BY minute",
        )
        .await
        .db()?;
    let rows = client.query(&statement, &[&first, &last]).await.db()?;
    let count = |row: &Row, i: usize| -> Result<u64, StoreError> {
        Ok(u64::try_from(column::<i64>(row, i)?).unwrap_or(0))
    };
    let rows = rows
        .iter()
        .map(|row| {
            Ok(MinuteCount {
                minute: column(row, 0)?,
                deliveries: count(row, 1)?,
                failures: count(row, 2)?,
                dead: count(row, 3)?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    Ok(rows)
}

pub(super) async fn payment_status(
    client: &Client,
    payment_id: &str,
    now: Millis,
) -> Result<Option<String>, StoreError> {
    let statement = client
        .prepare_cached("SELECT status FROM payments WHERE payment_id = $1 AND expires_at > $2")
        .await
        .db()?;
    match client
        .query_opt(&statement, &[&payment_id, &now])
        .await
        .db()?
    {
        Some(row) => column(&row, 0).map(Some),
        None => Ok(None),
    }
}

/// Every message of the live partition is unfinished (pending or in flight): its smallest id
/// is the oldest, read from the primary key's first entry.
pub(super) async fn oldest_unfinished(client: &Client) -> Result<Option<MessageId>, StoreError> {
    let statement = client
        .prepare_cached("SELECT min(id) FROM messages WHERE end_day = 0")
        .await
        .db()?;
    let row = client.query_one(&statement, &[]).await.db()?;
    let oldest: Option<String> = column(&row, 0)?;
    oldest
        .map(|id| MessageId::parse(&id).ok_or_else(|| corrupt(format!("message id `{id}`"))))
        .transpose()
}

/// Readiness: the server answers, and takes writes (a standby answers reads only).
pub(super) async fn ping(client: &Client) -> Result<(), StoreError> {
    let statement = client
        .prepare_cached("SELECT pg_is_in_recovery()")
        .await
        .db()?;
    let row = client.query_one(&statement, &[]).await.db()?;
    if column::<bool>(&row, 0)? {
        return Err(StoreError::Unavailable(
            "connected to a PostgreSQL standby, which takes no writes".to_string(),
        ));
    }
    Ok(())
}
