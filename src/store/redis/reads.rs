//! The reads: plain commands, one pipeline per partition where they span partitions
//! ([`RedisStore::every_partition`]). None changes anything. Listing by state is one script
//! per partition (list.lua), which finds the buckets of an index as it reads them.

use std::collections::{BTreeMap, HashMap};

use redis::{Cmd, Pipeline, Value};

use super::connection::Sent;
use super::{RedisStore, corrupt, decode, field, one_call, record, script_call};
use crate::clock::Millis;
use crate::store::{
    HistoryEntry, ListFilter, MessageId, MessageRecord, MessageState, Page, QueueDepth, StoreError,
    matches_filter,
};

pub(super) async fn get(
    store: &RedisStore,
    id: &MessageId,
) -> Result<Option<MessageRecord>, StoreError> {
    Ok(records(store, std::slice::from_ref(id), true).await?.pop())
}

pub(super) async fn list(store: &RedisStore, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit.max(1);
    // Filters the indexes cannot answer (source, or state within one key's index) are
    // applied to loaded records; the scan is bounded so a sparse filter cannot make one
    // page read the whole keyspace: the caller continues from `next_after`.
    let max_scanned = limit * 10;
    let mut scanned = 0;
    let mut after = filter.after.clone();
    let mut messages = Vec::new();
    loop {
        let ids = scan_ids(store, filter, after.as_ref(), limit).await?;
        let exhausted = ids.len() < limit;
        scanned += ids.len();
        if let Some(last) = ids.last() {
            after = Some(last.clone());
        }
        // A match that does not fit on this page: the next page starts right before it,
        // even when this chunk ended the scan (else it would be silently skipped).
        let mut overflow = false;
        for record in records(store, &ids, false).await? {
            if !matches_filter(&record, filter) {
                continue;
            }
            if messages.len() >= limit {
                overflow = true;
                break;
            }
            after = Some(record.message.id.clone());
            messages.push(record);
        }
        if exhausted && !overflow {
            return Ok(Page {
                messages,
                next_after: None,
            });
        }
        if overflow || messages.len() >= limit || scanned >= max_scanned {
            return Ok(Page {
                messages,
                next_after: after,
            });
        }
    }
}

/// Up to `limit` ids above `after` (and within the filter's creation times), merged over the
/// partitions, or read from the key index of the filter's ordering keys.
async fn scan_ids(
    store: &RedisStore,
    filter: &ListFilter,
    after: Option<&MessageId>,
    limit: usize,
) -> Result<Vec<MessageId>, StoreError> {
    let range = IdRange::of(filter, after);
    let mut ids = match &filter.ordering_keys {
        Some(keys) => ids_of_keys(store, keys, &range, limit).await?,
        None => ids_by_state(store, filter, &range, limit).await?,
    };
    ids.sort();
    ids.dedup();
    ids.truncate(limit);
    Ok(ids)
}

/// The ids a listing page may hold: above `after` and from `created_from` (inclusive), before
/// `created_to`'s next millisecond.
struct IdRange {
    above: Option<MessageId>,
    from: Option<MessageId>,
    before: Option<MessageId>,
}

impl IdRange {
    fn of(filter: &ListFilter, after: Option<&MessageId>) -> IdRange {
        IdRange {
            above: after.cloned(),
            from: filter.created_from.map(MessageId::lower_bound),
            before: filter.created_to.map(|t| MessageId::lower_bound(t + 1)),
        }
    }

    /// The range as `ZRANGE … BYLEX` bounds over the members `<prefix><id>` of a sorted set:
    /// the state indexes' ids (`prefix` empty), or one key's members of the key index, whose
    /// prefix ends in `:` (`;` is the character after it, so `(<…>;` ends the key's range).
    fn lex(&self, prefix: &str) -> (String, String) {
        let min = match (&self.above, &self.from) {
            (Some(a), Some(f)) if f > a => format!("[{prefix}{f}"),
            (Some(a), _) => format!("({prefix}{a}"),
            (None, Some(f)) => format!("[{prefix}{f}"),
            (None, None) if prefix.is_empty() => "-".to_string(),
            (None, None) => format!("[{prefix}"),
        };
        let max = match (&self.before, prefix.strip_suffix(':')) {
            (Some(b), _) => format!("({prefix}{b}"),
            (None, Some(key)) => format!("({key};"),
            (None, None) => "+".to_string(),
        };
        (min, max)
    }
}

/// Each partition's first `limit` ids in range from its state indexes (the filter's state,
/// or all of them): the `limit` smallest of them all are the next ids of the merged order,
/// whatever the partitions' sizes. A partition's indexes are read by one script (list.lua),
/// so without a state filter a message is seen once, never zero times, as it moves.
async fn ids_by_state(
    store: &RedisStore,
    filter: &ListFilter,
    range: &IdRange,
    limit: usize,
) -> Result<Vec<MessageId>, StoreError> {
    let (min, max) = range.lex("");
    let states: &[MessageState] = match &filter.state {
        Some(state) => std::slice::from_ref(state),
        None => &MessageState::ALL,
    };
    let ranges: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let indexes: Vec<String> = states.iter().map(|s| keys.index(*s)).collect();
            let mut call = script_call(&store.scripts.list, &indexes);
            call.arg(&min).arg(&max).arg(limit);
            one_call(call)
        })
        .collect();
    let replies: Vec<(Vec<String>,)> = store
        .every_partition(Sent::ReadScript(&store.scripts.list), &ranges)
        .await?;
    Ok(replies
        .into_iter()
        .flat_map(|(ids,)| ids)
        .filter_map(|s| MessageId::parse(&s))
        .collect())
}

fn lex_range(pipe: &mut Pipeline, index: &str, min: &str, max: &str, limit: usize) {
    pipe.cmd("ZRANGE")
        .arg(index)
        .arg(min)
        .arg(max)
        .arg("BYLEX")
        .arg("LIMIT")
        .arg(0)
        .arg(limit);
}

/// The first `limit` ids in range of each of `keys`' messages: from the key index (layout 6),
/// and from the sorted set of each key that layout 5 and before kept, for the messages they
/// wrote. A key's messages are one lex range of its bucket, as they were the whole of its
/// own set, so a page reads `limit` of them, whatever the bucket holds.
async fn ids_of_keys(
    store: &RedisStore,
    keys: &[String],
    range: &IdRange,
    limit: usize,
) -> Result<Vec<MessageId>, StoreError> {
    let (min, max) = range.lex("");
    let places: Vec<_> = keys
        .iter()
        .map(|k| {
            let keys = store.keys.of_ordering_key(k);
            (keys.index_of_key(k), keys.key_index(k))
        })
        .collect();
    let reads: Vec<Pipeline> = places
        .iter()
        .map(|(older, index)| {
            let (from, to) = range.lex(&index.member_prefix);
            let mut pipe = redis::pipe();
            lex_range(&mut pipe, older, &min, &max, limit);
            lex_range(&mut pipe, &index.bucket, &from, &to, limit);
            pipe
        })
        .collect();
    let replies: Vec<(Vec<String>, Vec<String>)> =
        store.every_partition(Sent::Read, &reads).await?;
    let mut ids = Vec::new();
    for ((older, members), (_, index)) in replies.into_iter().zip(&places) {
        ids.extend(older.iter().filter_map(|s| MessageId::parse(s)));
        ids.extend(
            members
                .iter()
                .filter_map(|m| MessageId::parse(m.strip_prefix(&index.member_prefix)?)),
        );
    }
    Ok(ids)
}

/// Loads records, in the order of `ids`, skipping ids that are gone: one pipeline per
/// partition; histories only when asked (a list page never loads them).
async fn records(
    store: &RedisStore,
    ids: &[MessageId],
    with_history: bool,
) -> Result<Vec<MessageRecord>, StoreError> {
    let mut by_partition: BTreeMap<u8, Vec<&MessageId>> = BTreeMap::new();
    for id in ids {
        by_partition.entry(id.partition()).or_default().push(id);
    }
    let reads: Vec<Pipeline> = by_partition
        .values()
        .map(|ids| {
            let mut pipe = redis::pipe();
            for id in ids {
                let keys = store.keys.of_id(id);
                pipe.hgetall(keys.message(id))
                    .zscore(keys.due(), id.as_str());
                if with_history {
                    pipe.lrange(keys.attempts(id), 0, -1);
                }
            }
            pipe
        })
        .collect();
    let replies: Vec<Vec<Value>> = store.every_partition(Sent::Read, &reads).await?;
    let mut found: HashMap<&MessageId, MessageRecord> = HashMap::with_capacity(ids.len());
    for (ids, replies) in by_partition.values().zip(replies) {
        let mut replies = replies.into_iter();
        let mut next = || {
            replies
                .next()
                .ok_or_else(|| corrupt("short pipeline reply"))
        };
        for id in ids {
            let fields: HashMap<String, Vec<u8>> = decode(next()?)?;
            let next_attempt_at: Option<f64> = decode(next()?)?;
            let history: Option<Vec<String>> = if with_history {
                Some(decode(next()?)?)
            } else {
                None
            };
            if let Some(record) = message_record(&fields, next_attempt_at, history.as_deref())? {
                found.insert(id, record);
            }
        }
    }
    Ok(ids.iter().filter_map(|id| found.remove(id)).collect())
}

/// One message from its hash fields, its score in `due` and its history list (`None`: the
/// history is not wanted); `None` when the message is gone.
fn message_record(
    fields: &HashMap<String, Vec<u8>>,
    next_attempt_at: Option<f64>,
    listed: Option<&[String]>,
) -> Result<Option<MessageRecord>, StoreError> {
    let Some(message) = record::of_fields(fields)? else {
        return Ok(None);
    };
    let state = fields
        .get("state")
        .and_then(|s| MessageState::parse(std::str::from_utf8(s).ok()?))
        .ok_or_else(|| corrupt(format!("message {} has no valid state", message.id)))?;
    // The first row in the hash (history.lua), the rows after it in the list; or, written
    // by layout 4 and before, all of them in the list.
    let first = listed.and(record::joined(fields, "h"));
    let history = first
        .iter()
        .map(|row| record::decode_row(row))
        .chain(
            listed
                .unwrap_or_default()
                .iter()
                .map(|row| serde_json::from_str::<HistoryEntry>(row).map_err(corrupt)),
        )
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(MessageRecord {
        state,
        deadline: field(fields, "dl").unwrap_or(message.deadline),
        next_attempt_at: next_attempt_at.map(|s| s as Millis),
        history_total: field(fields, "hn").unwrap_or(history.len() as u64),
        delivery_attempts: field(fields, "tries").unwrap_or(0),
        ends_at: field(fields, "end"),
        history,
        message,
    }))
}

pub(super) async fn payment_status(
    store: &RedisStore,
    payment_id: &str,
    now: Millis,
) -> Result<Option<String>, StoreError> {
    let keys = store
        .keys
        .of_ordering_key(&crate::payment::ordering_key(payment_id));
    let value: Option<String> = store.send(&Cmd::get(keys.payment(payment_id))).await?;
    // `<end ms>|<status>` (keys.rs)
    Ok(value.and_then(|v| {
        let (ends, status) = v.split_once('|')?;
        (ends.parse::<Millis>().ok()? > now).then(|| status.to_string())
    }))
}

pub(super) async fn depth(store: &RedisStore) -> Result<QueueDepth, StoreError> {
    const COUNTED: [MessageState; 3] = [
        MessageState::Pending,
        MessageState::InFlight,
        MessageState::Dead,
    ];
    let counts: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let mut pipe = redis::pipe();
            for state in COUNTED {
                pipe.zcard(keys.index(state));
            }
            pipe
        })
        .collect();
    let counts: Vec<(u64, u64, u64)> = store.every_partition(Sent::Read, &counts).await?;
    let mut depth = QueueDepth::default();
    for (pending, in_flight, dead) in counts {
        depth.pending += pending;
        depth.in_flight += in_flight;
        depth.dead += dead;
    }
    Ok(depth)
}

pub(super) async fn oldest_unfinished(store: &RedisStore) -> Result<Option<MessageId>, StoreError> {
    // Ids sort by creation time and the state indexes are lexical: the first member of
    // each is its oldest.
    let firsts: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let mut pipe = redis::pipe();
            for state in [MessageState::Pending, MessageState::InFlight] {
                pipe.zrange(keys.index(state), 0, 0);
            }
            pipe
        })
        .collect();
    let firsts: Vec<(Vec<String>, Vec<String>)> =
        store.every_partition(Sent::Read, &firsts).await?;
    firsts
        .into_iter()
        .flat_map(|(pending, in_flight)| pending.into_iter().chain(in_flight))
        .min()
        .map(|id| MessageId::parse(&id).ok_or_else(|| corrupt(format!("message id `{id}`"))))
        .transpose()
}
