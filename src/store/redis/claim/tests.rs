//! The sharing and the count-or-skip rule, on a virtual clock.

use super::{Asked, CLAIM_CHUNK, HEARD_RECOUNT_MS, Hints, Known, RECOUNT_MS, spread};
use crate::clock::Millis;

const T0: Millis = 1_700_000_000_000;

fn counted(hints: &Hints, now: Millis, lease_now: Millis) -> Vec<usize> {
    hints
        .to_count(now, lease_now)
        .iter()
        .map(|a| a.partition)
        .collect()
}

/// Learns `known` for every partition, as a count of all of them would.
fn learn_all(hints: &Hints, now: Millis, known: impl Fn(usize) -> Known) {
    for asked in hints.to_count(now, now) {
        hints.learn(asked, Some(known(asked.partition)));
    }
}

fn claimable(at: Millis, n: usize) -> Known {
    Known {
        at,
        claimable: n,
        due_at: None,
        lease_at: None,
    }
}

#[test]
fn spread_never_exceeds_the_limit_nor_what_a_partition_has() {
    let available = [0, 3, 0, 1, 10, 0];
    for limit in 0..20 {
        for start in 0..available.len() {
            for chunk in 1..=CLAIM_CHUNK {
                let (quotas, _) = spread(limit, &available, start, chunk);
                let total: usize = quotas.iter().sum();
                assert_eq!(
                    total,
                    limit.min(14),
                    "limit {limit} start {start} chunk {chunk}"
                );
                assert!(quotas.iter().zip(&available).all(|(q, a)| q <= a));
            }
        }
    }
}

#[test]
fn spread_shares_round_robin_from_the_start() {
    assert_eq!(spread(3, &[5, 5, 5, 5], 1, 1), (vec![0, 1, 1, 1], 2));
    assert_eq!(spread(6, &[5, 5, 5, 5], 3, 1), (vec![2, 1, 1, 2], 0));
    assert_eq!(spread(4, &[0, 0], 0, 1), (vec![0, 0], 0));
    assert_eq!(spread(6, &[5, 5, 5, 5], 3, 4), (vec![2, 0, 0, 4], 0));
    assert_eq!(spread(12, &[5, 1, 0, 9], 0, 4), (vec![5, 1, 0, 6], 1));
    assert_eq!(spread(20, &[0, 1, 0, 9], 2, 4), (vec![0, 1, 0, 9], 0));
}

/// A limit above the chunk: the partition whose chunk the limit cut short leads the next
/// claim, so two busy partitions split the messages evenly (with the start after the last
/// partition served, one of them got 16 of every 20).
#[test]
fn a_limit_above_the_chunk_is_shared_evenly() {
    let available = [1_000_000, 0, 1_000_000];
    let mut totals = [0; 3];
    let mut start = 0;
    for _ in 0..1000 {
        let (quotas, next) = spread(20, &available, start, CLAIM_CHUNK);
        for (total, quota) in totals.iter_mut().zip(quotas) {
            *total += quota;
        }
        start = next;
    }
    assert_eq!(totals, [10_000, 0, 10_000]);
}

/// Claims of one message at a time over 128 partitions, two of them with work far apart:
/// they alternate, as they would with no idle partition between them, and the idle ones are
/// not counted again until the recount is due.
#[test]
fn busy_partitions_take_turns_however_many_are_idle() {
    let hints = Hints::new(128);
    learn_all(&hints, T0, |p| {
        if p == 3 || p == 90 {
            claimable(T0, 1000)
        } else {
            Known {
                due_at: Some(T0 + 3_600_000),
                ..claimable(T0, 0)
            }
        }
    });
    let mut served = Vec::new();
    for _ in 0..6 {
        assert!(counted(&hints, T0 + 1, T0 + 1).is_empty());
        let shares = hints.share(1);
        let [(asked, 1)] = shares.as_slice() else {
            panic!("one partition served once: {shares:?}")
        };
        served.push(asked.partition);
        // claim.lua's answer: one fewer left
        hints.learn(*asked, Some(claimable(T0 + 1, 999)));
    }
    assert_eq!(served, vec![3, 90, 3, 90, 3, 90]);
}

#[test]
fn a_new_table_counts_every_partition() {
    let hints = Hints::new(4);
    assert_eq!(counted(&hints, T0, T0), vec![0, 1, 2, 3]);
    assert!(hints.share(10).is_empty(), "nothing is known claimable");
}

/// What a partition had is trusted for RECOUNT_MS by the lease clock, whatever the caller's
/// clock says, so work other processes write is noticed; a lease clock that went back proves
/// nothing.
#[test]
fn everything_is_counted_again_after_the_recount_interval() {
    let hints = Hints::new(2);
    learn_all(&hints, T0, |p| claimable(T0, p));
    assert!(counted(&hints, T0, T0 + RECOUNT_MS - 1).is_empty());
    assert!(counted(&hints, T0 + 10 * RECOUNT_MS, T0 + RECOUNT_MS - 1).is_empty());
    assert_eq!(counted(&hints, T0, T0 + RECOUNT_MS), vec![0, 1]);
    assert_eq!(counted(&hints, T0, T0 - 1), vec![0, 1]);
}

/// While other processes' work is heard of, what is known stands for HEARD_RECOUNT_MS; a
/// wake-up (a write there, as this process's own) makes its partition alone counted again,
/// and losing the subscription brings the short interval back.
#[test]
fn heard_work_is_counted_where_it_was_written_and_the_rest_later() {
    let hints = Hints::new(3);
    hints.hear(true);
    learn_all(&hints, T0, |p| claimable(T0, p));
    assert!(counted(&hints, T0, T0 + RECOUNT_MS).is_empty());
    hints.wrote(1);
    assert_eq!(counted(&hints, T0, T0 + RECOUNT_MS), vec![1]);
    assert_eq!(counted(&hints, T0, T0 + HEARD_RECOUNT_MS), vec![0, 1, 2]);
    hints.hear(false);
    assert_eq!(counted(&hints, T0, T0 + RECOUNT_MS), vec![0, 1, 2]);
}

/// An empty partition is skipped until its next due entry comes due (caller's clock) or its
/// earliest lease ends (lease clock).
#[test]
fn an_empty_partition_is_skipped_until_its_next_due_entry_or_lease_end() {
    let hints = Hints::new(3);
    learn_all(&hints, T0, |p| Known {
        due_at: (p == 1).then_some(T0 + 10),
        lease_at: (p == 2).then_some(T0 + 20),
        ..claimable(T0, 0)
    });
    assert!(counted(&hints, T0 + 9, T0 + 19).is_empty());
    assert_eq!(counted(&hints, T0 + 10, T0 + 19), vec![1]);
    assert_eq!(counted(&hints, T0 + 9, T0 + 20), vec![2]);
    assert_eq!(counted(&hints, T0 + 20, T0 + 9), vec![1]);
}

/// A write of this process makes its partition counted at the next claim; what a count or
/// claim sent before that write learnt shares the claim at hand, as a lower bound, and is
/// counted again at the next.
#[test]
fn a_write_of_this_process_makes_its_partition_counted_at_once() {
    let hints = Hints::new(3);
    learn_all(&hints, T0, |_| claimable(T0, 0));
    let asked_before: Vec<Asked> = (0..3)
        .map(|partition| Asked {
            partition,
            writes: 0,
        })
        .collect();
    hints.wrote(1);
    assert_eq!(counted(&hints, T0, T0), vec![1]);
    hints.learn(asked_before[1], Some(claimable(T0, 3)));
    let shares = hints.share(5);
    assert_eq!(
        shares.len(),
        1,
        "what a raced count found is shared: {shares:?}"
    );
    assert_eq!((shares[0].0.partition, shares[0].1), (1, 3));
    assert_eq!(counted(&hints, T0, T0), vec![1], "learnt before the write");
    let [asked] = hints.to_count(T0, T0)[..] else {
        panic!("one to count")
    };
    hints.learn(asked, Some(claimable(T0, 2)));
    assert!(counted(&hints, T0, T0).is_empty());
    let shares = hints.share(5);
    assert_eq!(shares.len(), 1);
    assert_eq!((shares[0].0.partition, shares[0].1), (1, 2));
    hints.forget_all();
    assert_eq!(counted(&hints, T0, T0), vec![0, 1, 2]);
}

/// A failed count or claim (`None`) leaves the partition to be counted again.
#[test]
fn a_failed_call_leaves_the_partition_unknown() {
    let hints = Hints::new(2);
    learn_all(&hints, T0, |_| claimable(T0, 1));
    let shares = hints.share(2);
    assert_eq!(shares.len(), 2);
    hints.learn(shares[0].0, None);
    assert_eq!(counted(&hints, T0, T0), vec![shares[0].0.partition]);
}
