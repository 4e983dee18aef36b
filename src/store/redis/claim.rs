//! Claiming: which partitions a claim asks, and for how many messages each.
//!
//! A caller sizes `limit` to its free workers, so a claim shares it among the partitions by
//! what each has claimable ([`spread`]) instead of asking each for `limit / partitions`. On
//! the default 64 partitions, counting every partition before every claim (two `ZCOUNT`s
//! each) was most of a claim's commands (BENCHMARKS.md, "Before and after"). So this process
//! remembers what each partition had ([`Hints`]), and counts only the partitions it knows
//! nothing current about:
//!
//! - claim.lua answers with what it left claimable in its partition, and when its next due
//!   entry and its earliest lease come due: a partition just claimed from is known without a
//!   count;
//! - what is known stands until one of those moments (a partition with nothing claimable is
//!   skipped until then), when a retry or a lease that ran out adds to it;
//! - a write of this process that may make work claimable there (an accept, a release, a
//!   resend, a completion that queued a retry or promoted the next message of its key) makes
//!   the next claim count it; what was known until then stays a lower bound, since this
//!   process's writes only add claimable work;
//! - whatever is known is counted again after [`RECOUNT_MS`]: other processes sharing the
//!   store write work this process hears nothing about;
//! - unless it hears of it: while this process is subscribed to the other processes' wake-ups
//!   (`wake.rs`), their work marks its partition for a count as a write of this process does,
//!   and what is known stands for [`HEARD_RECOUNT_MS`] instead. What no wake-up announces (a
//!   retry another process scheduled, the lease of a process that died) is then found within
//!   that, which is also how often an idle dispatcher polls.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use redis::{Pipeline, Value};

use super::connection::Sent;
use super::{RedisStore, corrupt, decode, one_call, record, script_call};
use crate::clock::Millis;
use crate::store::{Lease, MessageState, StoreError};

/// How long what a partition had claimable is trusted before it is counted again, by the
/// clock leases are timed by. Work another process writes (an accept, a retry it scheduled)
/// waits at most this long beyond an idle worker's poll to be noticed by a busy one: 50 ms
/// keeps that well inside the first attempt's 100 ms p99 target (issue 13), while a busy
/// dispatcher counts each partition at most 20 times a second rather than before every claim.
pub(super) const RECOUNT_MS: Millis = 50;

/// How long what a partition had is trusted while this process hears other processes' work
/// through its wake-up subscription: a little under the signalled dispatcher's idle poll
/// (5 s, `dispatch::SIGNALLED_IDLE_POLL`), so that what was learnt at one poll is stale at
/// the next even when the lease clock (a cluster node's `TIME`) runs a little behind. Without
/// it, every wake-up of a trickle of work would count all the partitions again.
pub(super) const HEARD_RECOUNT_MS: Millis = 4_500;

/// Most messages a partition is given per turn of a claim's share ([`spread`]). A call of
/// claim.lua costs Redis about as much for one message as for several (the call, `TIME`, its
/// range reads and count), and with every partition busy, one message per partition per turn
/// made it one call per message. 16 is `dispatch.per_host_concurrency`'s default, the most a
/// dispatcher claims at once for one host; partitions with work still take turns.
pub(super) const CLAIM_CHUNK: usize = 16;

/// What one partition had claimable when last counted or claimed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Known {
    /// The lease clock when it was learnt.
    pub(super) at: Millis,
    /// Messages claimable then: due entries and expired leases.
    pub(super) claimable: usize,
    /// When that grows by itself: the first entry of `due` not due then (by the caller's
    /// clock, as `due` is), and the earliest lease's end (by the lease clock); `None` when
    /// there is none. Until then, `claimable` is exact for this process's own work.
    pub(super) due_at: Option<Millis>,
    pub(super) lease_at: Option<Millis>,
}

impl Known {
    /// Whether this still stands at `now` (caller's clock) and `lease_now` (lease clock).
    fn trusted(&self, now: Millis, lease_now: Millis, trust_ms: Millis) -> bool {
        // A lease clock that went back (another Redis answering, a test's clock) proves
        // nothing about age: count again.
        if !(0..trust_ms).contains(&(lease_now - self.at)) {
            return false;
        }
        // A retry that came due or a lease that ran out since makes the count short: the
        // claim would take less than is there.
        self.due_at.is_none_or(|at| now < at) && self.lease_at.is_none_or(|at| lease_now < at)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Hint {
    known: Option<Known>,
    /// This process's writes to the partition, so that a count or claim can tell whether one
    /// happened while it was on its way.
    writes: u64,
    /// Set by a write of this process, and kept while what is learnt may predate one: `known`
    /// is then a lower bound, good for sharing the claim at hand (dropping it would give a
    /// partition this process keeps writing to no share at all), and counted again at the
    /// next claim.
    recount: bool,
}

/// What this process knows of every partition's claimable work, and where the next share
/// starts.
pub(super) struct Hints {
    table: Mutex<Table>,
    /// Whether other processes' work is heard of (`wake.rs`): what is known then stands for
    /// [`HEARD_RECOUNT_MS`], else for [`RECOUNT_MS`].
    heard: AtomicBool,
}

struct Table {
    partitions: Vec<Hint>,
    next_start: usize,
}

/// A partition about to be counted or claimed from, with its write count at that moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Asked {
    pub(super) partition: usize,
    writes: u64,
}

impl Hints {
    pub(super) fn new(partitions: usize) -> Hints {
        Hints {
            table: Mutex::new(Table {
                partitions: vec![Hint::default(); partitions],
                next_start: 0,
            }),
            heard: AtomicBool::new(false),
        }
    }

    /// The wake-up subscription is in place (`true`) or lost (`false`).
    pub(super) fn hear(&self, heard: bool) {
        self.heard.store(heard, Ordering::Relaxed);
    }

    /// A hint is only ever a reason to count or skip, and claim.lua decides what is leased,
    /// so a table left behind by a panic is still usable.
    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The partitions to count before sharing a claim at `now` / `lease_now`.
    pub(super) fn to_count(&self, now: Millis, lease_now: Millis) -> Vec<Asked> {
        let trust_ms = if self.heard.load(Ordering::Relaxed) {
            HEARD_RECOUNT_MS
        } else {
            RECOUNT_MS
        };
        let table = self.table();
        table
            .partitions
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                h.recount || !h.known.is_some_and(|k| k.trusted(now, lease_now, trust_ms))
            })
            .map(|(partition, h)| Asked {
                partition,
                writes: h.writes,
            })
            .collect()
    }

    /// Shares `limit` by what is known claimable ([`spread`]), moving the next start on.
    /// Returns the partitions with a share, each with its quota.
    pub(super) fn share(&self, limit: usize) -> Vec<(Asked, usize)> {
        let mut table = self.table();
        let available: Vec<usize> = table
            .partitions
            .iter()
            .map(|h| h.known.map_or(0, |k| k.claimable))
            .collect();
        let (quotas, next_start) = spread(limit, &available, table.next_start, CLAIM_CHUNK);
        table.next_start = next_start;
        quotas
            .into_iter()
            .enumerate()
            .filter(|(_, q)| *q > 0)
            .map(|(partition, quota)| {
                let writes = table.partitions[partition].writes;
                (Asked { partition, writes }, quota)
            })
            .collect()
    }

    /// What a count or a claim of `asked` found (`None`: it failed, so count again). If this
    /// process wrote there since it was asked, it is only a lower bound: the next claim
    /// counts again.
    pub(super) fn learn(&self, asked: Asked, known: Option<Known>) {
        let mut table = self.table();
        if let Some(hint) = table.partitions.get_mut(asked.partition) {
            hint.known = known;
            hint.recount = hint.writes != asked.writes;
        }
    }

    /// This process wrote to `partition` what may be claimable: the next claim counts it.
    pub(super) fn wrote(&self, partition: u8) {
        let mut table = self.table();
        if let Some(hint) = table.partitions.get_mut(usize::from(partition)) {
            hint.writes += 1;
            hint.recount = true;
        }
    }

    /// Forgets everything: after an upgrade rewrote the partitions, or when wake-ups of other
    /// processes' work may have been missed (`wake.rs`).
    pub(super) fn forget_all(&self) {
        let mut table = self.table();
        for hint in &mut table.partitions {
            hint.writes += 1;
            hint.known = None;
        }
    }
}

pub(super) async fn claim(
    store: &RedisStore,
    now: Millis,
    limit: usize,
    lease_ms: u64,
) -> Result<Vec<Lease>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let lease_now = lease_clock(store, now).await?;
    let to_count = store.hints.to_count(now, lease_now);
    let count_failure = count(store, &to_count, now, lease_now).await;
    let shares = store.hints.share(limit);
    if shares.is_empty() {
        return count_failure.map_or(Ok(Vec::new()), Err);
    }
    // One call per partition with a share. A partition whose master does not answer keeps
    // its messages for a later claim; the others are delivered meanwhile.
    let script = &store.scripts.claim;
    let calls: Vec<Pipeline> = shares
        .iter()
        .map(|(asked, quota)| {
            let keys = store.keys.of_partition(partition_number(asked.partition));
            let mut call = script_call(
                script,
                &[
                    keys.due(),
                    keys.lease(),
                    keys.index(MessageState::Pending),
                    keys.index(MessageState::InFlight),
                ],
            );
            call.arg(now)
                .arg(quota)
                .arg(lease_ms)
                .arg(keys.prefix())
                .arg(if store.store_clock_leases { "1" } else { "0" })
                .arg(MessageState::InFlight.as_str());
            one_call(call)
        })
        .collect();
    let mut leases = Vec::new();
    let mut failure = None;
    let replies = store
        .per_partition::<(ClaimReply,)>(Sent::Script(script), &calls)
        .await;
    for ((asked, _), reply) in shares.iter().zip(replies) {
        match reply {
            Ok(((page, left, due_at, lease_at),)) => {
                store.hints.learn(
                    *asked,
                    Some(Known {
                        at: lease_now,
                        claimable: left,
                        due_at,
                        lease_at,
                    }),
                );
                leases.extend(page);
            }
            Err(e) => {
                store.hints.learn(*asked, None);
                failure = Some(e);
            }
        }
    }
    match failure {
        Some(e) if leases.is_empty() => Err(e),
        _ => leases.into_iter().map(decode_lease).collect(),
    }
}

/// claim.lua's reply: the leased rows, what it left claimable, when the next due entry and
/// the earliest lease come due.
type ClaimReply = (Vec<Value>, usize, Option<Millis>, Option<Millis>);

/// The clock leases are judged by: Redis' (`TIME`), or the caller's in tests. On a cluster,
/// leases are judged by the clock of the node that answers `TIME` here, and again by each
/// partition's master in claim.lua: masters whose clocks disagree only make the counts
/// approximate.
async fn lease_clock(store: &RedisStore, now: Millis) -> Result<Millis, StoreError> {
    if !store.store_clock_leases {
        return Ok(now);
    }
    let (secs, micros): (i64, i64) = store.send(&redis::cmd("TIME")).await?;
    Ok(secs * 1000 + micros / 1000)
}

/// Counts what each of `asked` could hand out at `now`: due entries plus expired leases
/// (which claim.lua makes due again first), and when the next of each comes. Returns a failure, if any partition's count failed (it then counts as having
/// nothing, and is counted again at the next claim).
async fn count(
    store: &RedisStore,
    asked: &[Asked],
    now: Millis,
    lease_now: Millis,
) -> Option<StoreError> {
    let counts: Vec<Pipeline> = asked
        .iter()
        .map(|a| {
            let keys = store.keys.of_partition(partition_number(a.partition));
            let mut pipe = redis::pipe();
            pipe.zcount(keys.due(), "-inf", now)
                .zcount(keys.lease(), "-inf", lease_now)
                .zrangebyscore_limit_withscores(keys.due(), format!("({now}"), "+inf", 0, 1)
                .zrange_withscores(keys.lease(), 0, 0);
            pipe
        })
        .collect();
    let mut failure = None;
    let replies = store
        .per_partition::<(usize, usize, Value, Value)>(Sent::Read, &counts)
        .await;
    for (a, reply) in asked.iter().zip(replies) {
        let known = reply.and_then(|(due, expired, due_head, lease_head)| {
            Ok(Known {
                at: lease_now,
                claimable: due + expired,
                due_at: head_score(due_head)?,
                lease_at: head_score(lease_head)?,
            })
        });
        match known {
            Ok(known) => store.hints.learn(*a, Some(known)),
            Err(e) => {
                store.hints.learn(*a, None);
                failure = Some(e);
            }
        }
    }
    failure
}

/// The score of a one-entry range `WITHSCORES`: a flat `[member, score]` (RESP2) or
/// `[[member, score]]` (RESP3).
fn head_score(reply: Value) -> Result<Option<Millis>, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(corrupt(format!("ZRANGE WITHSCORES answered {reply:?}")));
    };
    if let [Value::Array(pair)] = items.as_mut_slice() {
        items = std::mem::take(pair);
    }
    match items.into_iter().nth(1) {
        None => Ok(None),
        // Scores are whole milliseconds; a double is read as Redis prints it.
        Some(score) => decode::<f64>(score).map(|s| Some(s as Millis)),
    }
}

/// One row of claim.lua's reply: record, lease token, tries, `rb`, deadline (empty: the
/// record's), `resume` and `again` (0: none).
fn decode_lease(row: Value) -> Result<Lease, StoreError> {
    let (rec, token, tries, rb, deadline, resume, again): (
        Vec<u8>,
        u64,
        u32,
        u32,
        String,
        Millis,
        u8,
    ) = decode(row)?;
    let message = record::decode(&rec)?;
    Ok(Lease {
        deadline: deadline.parse().unwrap_or(message.deadline),
        message,
        token,
        attempts: tries,
        backoff_step: tries.saturating_sub(rb),
        resume_at: (resume != 0).then_some(resume),
        again: again == 1,
    })
}

/// Partition numbers are one byte ([`crate::store::Partitions::MAX`]).
fn partition_number(partition: usize) -> u8 {
    u8::try_from(partition).unwrap_or(u8::MAX)
}

/// Shares `limit` among partitions round-robin from `start`, up to `chunk` messages to a
/// partition per turn, never giving a partition more than it has available. The quotas sum to
/// at most `limit`. Also returns where the next claim starts: after the first partition this
/// one served, so every partition with work gets its turn in order, however many idle
/// partitions lie between them (a start that merely moved by one would hand the first busy
/// partition after a long idle run every turn that starts in that run), and the one whose
/// chunk the limit cut short leads the next claim (a start after the last one served would
/// give the same partition the full chunk every time).
fn spread(limit: usize, available: &[usize], start: usize, chunk: usize) -> (Vec<usize>, usize) {
    let n = available.len();
    let mut quotas = vec![0; n];
    let mut first_served = None;
    let mut left = limit;
    loop {
        let mut gave = false;
        for i in 0..n {
            if left == 0 {
                return (quotas, after(first_served, start, n));
            }
            let p = (start + i) % n;
            let give = (available[p] - quotas[p]).min(chunk.max(1)).min(left);
            if give > 0 {
                quotas[p] += give;
                left -= give;
                gave = true;
                first_served.get_or_insert(p);
            }
        }
        if !gave {
            return (quotas, after(first_served, start, n));
        }
    }
}

/// Where the claim after one that first served `first_served` starts (`start` again when it
/// served none).
fn after(first_served: Option<usize>, start: usize, n: usize) -> usize {
    first_served.map_or(start, |p| (p + 1) % n)
}

#[cfg(test)]
mod tests;
