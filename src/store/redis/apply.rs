//! How the engine applies a lifecycle effect: it reads what the rule reads, asks the rule, and
//! sends the effect to `lua/apply.lua`, which writes it only if the message still reads as
//! the rule's guard says. A completion or release decides from its lease (what the claim
//! read), so it costs one call; a resend reads first. When something changed the message in
//! between (a resend raced an attempt), the guard fails, and the engine reads again and asks
//! the rule again.

use std::collections::HashMap;

use redis::{Cmd, Value};

use super::{RedisStore, corrupt, counts, decode, record, script_call, to_json};
use crate::clock::Millis;
use crate::store::counts::Tally;
use crate::store::lifecycle::{Effect, Field, QueueMove, Snapshot};
use crate::store::{ANSWER_BODY_ROWS, HISTORY_TAIL, MessageId, NewMessage, StoreError};

/// What applying an effect did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Applied {
    /// The guard failed: nothing was written.
    Stale,
    /// Written; `made_due` when something became due (the message, or the next of its key).
    Done { made_due: bool },
}

/// How many times an effect is decided again after its guard failed. Each failure is a write
/// that came between this call's read and its apply; several in a row mean the message is
/// hot, and the caller's retry (a resend's request, an attempt's completion) is the better
/// place to wait.
pub(super) const DECISIONS: usize = 5;

/// A `number` for the guard, 0 for none.
fn guard_number(value: Option<Millis>) -> String {
    value.unwrap_or(0).to_string()
}

/// The hash field and expected value of a guarded field (`@due` is the due zset's score).
fn guard_pair(field: Field, expected: &Snapshot) -> (&'static str, String) {
    match field {
        Field::State => ("state", expected.state.as_str().to_string()),
        Field::Token => ("lease", expected.token.to_string()),
        Field::ResumeAt => ("resume", guard_number(expected.resume_at)),
        Field::Again => ("again", u8::from(expected.again).to_string()),
        Field::EndsAt => ("end", guard_number(expected.ends_at)),
        Field::DueAt => ("@due", guard_number(expected.due_at)),
    }
}

/// An optional time as apply.lua takes it: `''` to leave it, `-` to clear it.
fn optional_time(change: Option<Option<Millis>>) -> String {
    match change {
        None => String::new(),
        Some(None) => "-".to_string(),
        Some(Some(at)) => at.to_string(),
    }
}

/// The call of apply.lua that writes `effect` to message `id` of `ordering_key`.
fn call(
    store: &RedisStore,
    id: &MessageId,
    ordering_key: &str,
    effect: &Effect,
    tally: Option<Tally>,
    now: Millis,
) -> Result<Cmd, StoreError> {
    let keys = store.keys.of_id(id);
    let before = effect.guard.expected.state;
    let after = effect.changes.state.unwrap_or(before);
    let mut names = vec![
        keys.message(id),
        keys.attempts(id),
        keys.due(),
        keys.lease(),
        keys.queue(ordering_key),
        keys.index(before),
        keys.index(after),
        keys.buckets(),
    ];
    if tally.is_some() {
        names.push(keys.counts(counts::hour_of(now)));
    }
    let mut call = script_call(&store.scripts.apply, &names);
    let history = effect.history.as_ref().map(to_json).transpose()?;
    // The script keeps this form only when the row is the message's first (history.lua);
    // it cannot tell before it runs, so both go.
    let first_form = effect
        .history
        .as_ref()
        .map(record::encode_row)
        .transpose()?;
    let (queue, queue_due) = match effect.queue {
        QueueMove::Stay => ("", String::new()),
        QueueMove::Join { due_if_head } => ("join", due_if_head.to_string()),
        QueueMove::Leave { next_due_at } => ("leave", next_due_at.to_string()),
    };
    call.arg(id.as_str())
        .arg(now)
        .arg(history.unwrap_or_default())
        .arg(first_form.unwrap_or_default())
        .arg(HISTORY_TAIL)
        .arg(ANSWER_BODY_ROWS)
        .arg(optional_time(effect.changes.due_at))
        .arg(optional_time(effect.changes.lease_until))
        .arg(optional_time(effect.changes.ends_at))
        .arg(queue)
        .arg(queue_due);
    call.arg(effect.guard.fields.len());
    for field in effect.guard.fields {
        let (name, expected) = guard_pair(*field, &effect.guard.expected);
        call.arg(name).arg(expected);
    }
    let c = &effect.changes;
    let mut sets: Vec<(&str, String)> = Vec::new();
    let mut dels: Vec<&str> = Vec::new();
    if let Some(state) = c.state {
        sets.push(("state", state.as_str().to_string()));
    }
    if let Some(token) = c.token {
        sets.push(("lease", token.to_string()));
    }
    if let Some(attempts) = c.attempts {
        sets.push(("tries", attempts.to_string()));
    }
    if let Some(backoff_from) = c.backoff_from {
        sets.push(("rb", backoff_from.to_string()));
    }
    if let Some(deadline) = c.deadline {
        sets.push(("dl", deadline.to_string()));
    }
    match c.resume_at {
        Some(Some(at)) => sets.push(("resume", at.to_string())),
        Some(None) => dels.push("resume"),
        None => {}
    }
    match c.again {
        Some(true) => sets.push(("again", "1".to_string())),
        Some(false) => dels.push("again"),
        None => {}
    }
    call.arg(sets.len());
    for (field, value) in &sets {
        call.arg(*field).arg(value);
    }
    call.arg(dels.len()).arg(&dels);
    let increments = tally.map_or_else(Vec::new, |t| counts::increments(t, now));
    call.arg(increments.len());
    for (field, n) in &increments {
        call.arg(field).arg(n);
    }
    call.arg(counts::lifetime_ms(now));
    Ok(call)
}

/// Writes `effect` to message `id` of `ordering_key` if its guard still holds, and then counts
/// `tally` (a completion's) in `now`'s minute.
pub(super) async fn apply(
    store: &RedisStore,
    id: &MessageId,
    ordering_key: &str,
    effect: &Effect,
    tally: Option<Tally>,
    now: Millis,
) -> Result<Applied, StoreError> {
    let call = call(store, id, ordering_key, effect, tally, now)?;
    let reply: i64 = store.eval(&store.scripts.apply, &call).await?;
    Ok(match reply {
        0 => Applied::Stale,
        2 => Applied::Done { made_due: true },
        _ => Applied::Done { made_due: false },
    })
}

/// Message `id` as the rules read it, with its record; `None` when there is none.
pub(super) async fn read(
    store: &RedisStore,
    id: &MessageId,
) -> Result<Option<(NewMessage, Snapshot)>, StoreError> {
    let keys = store.keys.of_id(id);
    let mut pipe = redis::pipe();
    pipe.hgetall(keys.message(id))
        .zscore(keys.due(), id.as_str());
    let (fields, due): (HashMap<String, Vec<u8>>, Option<f64>) = store.send(&pipe).await?;
    let Some(message) = record::of_fields(&fields)? else {
        return Ok(None);
    };
    let Some(state) = fields.get("state") else {
        return Ok(None);
    };
    let state = std::str::from_utf8(state)
        .ok()
        .and_then(crate::store::MessageState::parse)
        .ok_or_else(|| {
            corrupt(format!(
                "message {id} has state `{}`",
                String::from_utf8_lossy(state)
            ))
        })?;
    let number = |name: &str| -> Result<Option<Millis>, StoreError> {
        match fields.get(name) {
            None => Ok(None),
            Some(bytes) => {
                decode::<Millis>(Value::BulkString(bytes.clone())).map(|n| (n != 0).then_some(n))
            }
        }
    };
    let count = |name: &str| -> Result<u32, StoreError> {
        u32::try_from(number(name)?.unwrap_or(0)).map_err(corrupt)
    };
    let snapshot = Snapshot {
        state,
        token: u64::try_from(number("lease")?.unwrap_or(0)).map_err(corrupt)?,
        attempts: count("tries")?,
        backoff_from: count("rb")?,
        // no `dl` is the record's deadline
        deadline: number("dl")?.unwrap_or(message.deadline),
        // scores are whole milliseconds
        due_at: due.map(|score| score as Millis),
        resume_at: number("resume")?,
        again: number("again")? == Some(1),
        ends_at: number("end")?,
    };
    Ok(Some((message, snapshot)))
}
