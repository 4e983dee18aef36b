//! Group commit of accepts: one task per partition sends the accepts queued for it as one call
//! of accept.lua, and answers each with its own outcome.
//!
//! A task sends as soon as it has something and no call of its own is in flight, so a lone
//! accept is never held back by a timer; accepts that arrive while a call runs form the next
//! group. Under load a group is what arrived during one round trip, at most [`MAX_GROUP`]
//! accepts. Groups stay within one partition, so every key a call touches is in one hash slot
//! (Redis Cluster), and partitions do not wait for each other.

use std::time::Duration;

use redis::Script;
use tokio::sync::{mpsc, oneshot};

use super::Link;
use super::commands::{AcceptCall, AcceptSettings, accept_group};
use crate::store::ids::PARTITIONS;
use crate::store::{AcceptOutcome, StoreError};

/// Most accepts in one call: bounds how long one call holds Redis (which runs scripts one at a
/// time) and how many requests a failed call fails.
const MAX_GROUP: usize = 64;
/// Most bytes of keys and values in one call, so large bodies make smaller groups.
const MAX_GROUP_BYTES: usize = 1 << 20;
/// Accepts waiting per partition; past it callers wait to enqueue (backpressure) instead of
/// growing memory without bound.
const QUEUE_CAPACITY: usize = 1024;

type Answer = Result<AcceptOutcome, StoreError>;

/// An accept waiting for its group, and where its outcome goes.
struct Queued {
    call: AcceptCall,
    reply: oneshot::Sender<Answer>,
}

/// The store's handle on the partition tasks.
pub(super) struct Batcher {
    queues: Vec<mpsc::Sender<Queued>>,
    timeout: Duration,
}

fn gone() -> StoreError {
    StoreError::Unavailable("the Redis accept task has stopped".into())
}

impl Batcher {
    /// Starts one task per partition on the current Tokio runtime. The tasks end when the
    /// store is dropped, after answering what was queued; if the runtime stops first, the
    /// callers waiting on them get [`StoreError::Unavailable`] rather than waiting forever.
    pub(super) fn start(
        link: Link,
        script: Script,
        settings: AcceptSettings,
        timeout: Duration,
    ) -> Batcher {
        let queues = (0..PARTITIONS)
            .map(|partition| {
                let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
                let committer = Committer {
                    link: link.clone(),
                    script: script.clone(),
                    settings,
                    partition,
                };
                tokio::spawn(committer.run(rx));
                tx
            })
            .collect();
        Batcher { queues, timeout }
    }

    /// Accepts queued and not yet taken into a group (not counting the groups being sent).
    pub(super) fn queued(&self) -> usize {
        self.queues
            .iter()
            .map(|queue| QUEUE_CAPACITY - queue.capacity())
            .sum()
    }

    /// Queues one accept for its partition's next group and waits for its outcome, at most
    /// `timeout` in all. A caller that gives up (timeout, or its future is dropped) before its
    /// group is sent is left out of it: its failure then means nothing was written.
    pub(super) async fn accept(&self, call: AcceptCall) -> Answer {
        let queue = self
            .queues
            .get(usize::from(call.partition()))
            .ok_or_else(gone)?;
        let (reply, answer) = oneshot::channel();
        let wait = async {
            queue
                .send(Queued { call, reply })
                .await
                .map_err(|_| gone())?;
            answer.await.map_err(|_| gone())?
        };
        tokio::time::timeout(self.timeout, wait)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Unavailable(format!(
                    "Redis did not answer an accept within {:?}",
                    self.timeout
                )))
            })
    }
}

/// One partition's task.
struct Committer {
    link: Link,
    script: Script,
    settings: AcceptSettings,
    partition: u8,
}

impl Committer {
    async fn run(self, mut queue: mpsc::Receiver<Queued>) {
        // An accept taken from the queue that did not fit the group before: it heads the next.
        let mut carried: Option<Queued> = None;
        loop {
            let first = match carried.take() {
                Some(queued) => queued,
                None => match queue.recv().await {
                    Some(queued) => queued,
                    None => return,
                },
            };
            let mut bytes = first.call.size();
            let mut group = vec![first];
            while group.len() < MAX_GROUP {
                let Ok(next) = queue.try_recv() else { break };
                bytes += next.call.size();
                if bytes > MAX_GROUP_BYTES {
                    carried = Some(next);
                    break;
                }
                group.push(next);
            }
            group.retain(|queued| !queued.reply.is_closed());
            if !group.is_empty() {
                self.commit(group).await;
            }
        }
    }

    /// Sends one group and answers each of its accepts. A failed call fails exactly its own
    /// accepts, each with the same error.
    async fn commit(&self, group: Vec<Queued>) {
        let calls: Vec<&AcceptCall> = group.iter().map(|queued| &queued.call).collect();
        let outcomes = accept_group(
            &self.link,
            &self.script,
            self.settings,
            self.partition,
            &calls,
        )
        .await;
        match outcomes {
            Ok(outcomes) => {
                for (queued, outcome) in group.into_iter().zip(outcomes) {
                    // A caller that gave up meanwhile no longer listens.
                    let _ = queued.reply.send(outcome);
                }
            }
            Err(e) => {
                for queued in group {
                    let _ = queued.reply.send(Err(same_error(&e)));
                }
            }
        }
    }
}

/// `StoreError` is not `Clone` (it need not be anywhere else): the group's error for each of
/// its accepts.
fn same_error(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(why) => StoreError::Unavailable(why.clone()),
        StoreError::Corrupt(why) => StoreError::Corrupt(why.clone()),
    }
}
