//! Delivering: claims, leases, ordering, completion, resends, history and retention.

use super::*;

#[test]
fn claims_take_the_earliest_due_first_up_to_the_limit() {
    let mut m = Model::new(LIFETIMES);
    let a = accept_new(&mut m, "pay/a", T0 + 2);
    let b = accept_new(&mut m, "pay/b", T0);
    let c = accept_new(&mut m, "pay/c", T0 + 1);
    assert!(m.claim(T0 + 5, T0 + 5, 0, LEASE_MS).is_empty(), "limit 0");
    assert_eq!(ids(&m.claim(T0 + 5, T0 + 5, 2, LEASE_MS)), vec![b, c]);
    assert_eq!(ids(&m.claim(T0 + 5, T0 + 5, 2, LEASE_MS)), vec![a]);
    assert!(
        m.claim(T0 + 5, T0 + 5, 2, LEASE_MS).is_empty(),
        "all leased"
    );
}

#[test]
fn a_lease_carries_attempts_backoff_and_deadline() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let lease = claim_one(&mut m, T0, &id);
    assert_eq!(
        (
            lease.token,
            lease.attempts,
            lease.backoff_step,
            lease.deadline
        ),
        (1, 0, 0, T0 + 7 * DAY)
    );
    assert_eq!(lease.message, msg(&m, &id).message);
    assert!(finish(
        &mut m,
        &lease,
        Completion::Retry { next_at: T0 + 5 },
        T0 + 1
    ));
    assert!(
        m.claim(T0 + 4, T0 + 4, 10, LEASE_MS).is_empty(),
        "a retry waits"
    );
    let lease = claim_one(&mut m, T0 + 5, &id);
    assert_eq!((lease.token, lease.attempts, lease.backoff_step), (2, 1, 1));
}

#[test]
fn one_ordering_key_is_delivered_in_order() {
    let mut m = Model::new(LIFETIMES);
    let m1 = accept_new(&mut m, "pay/1", T0);
    let m2 = accept_new(&mut m, "pay/1", T0 + 1);
    let m3 = accept_new(&mut m, "pay/1", T0 + 2);
    let c1 = claim_one(&mut m, T0 + 10, &m1);
    // A retry keeps its place at the head.
    assert!(finish(
        &mut m,
        &c1,
        Completion::Retry {
            next_at: T0 + 1_000
        },
        T0 + 20
    ));
    assert!(m.claim(T0 + 30, T0 + 30, 10, LEASE_MS).is_empty());
    let c1 = claim_one(&mut m, T0 + 1_000, &m1);
    // Delivered: the next one is due at once; dead too.
    assert!(finish(&mut m, &c1, Completion::Delivered, T0 + 1_001));
    assert_eq!(msg(&m, &m2).due_at, Some(T0 + 1_001));
    assert_eq!(msg(&m, &m3).due_at, None);
    let c2 = claim_one(&mut m, T0 + 1_001, &m2);
    assert!(finish(&mut m, &c2, Completion::Dead, T0 + 1_002));
    let c3 = claim_one(&mut m, T0 + 1_002, &m3);
    assert!(finish(&mut m, &c3, Completion::Delivered, T0 + 1_003));
    assert!(m.queue("pay/1").is_empty());
}

#[test]
fn an_expired_lease_is_claimed_again_and_the_old_token_is_stale() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let first = claim_one(&mut m, T0, &id);
    assert!(
        m.claim(T0 + LEASE - 1, T0 + LEASE - 1, 10, LEASE_MS)
            .is_empty(),
        "still leased"
    );
    let second = claim_one(&mut m, T0 + LEASE, &id);
    assert_eq!(
        (second.token, second.attempts),
        (2, 0),
        "a lost lease is no attempt"
    );
    assert!(!finish(
        &mut m,
        &first,
        Completion::Delivered,
        T0 + LEASE + 1
    ));
    assert!(!m.release(&first, T0 + LEASE + 1));
    assert_eq!(msg(&m, &id).state, MessageState::InFlight);
    assert!(msg(&m, &id).history.is_empty());
    assert!(finish(
        &mut m,
        &second,
        Completion::Delivered,
        T0 + LEASE + 2
    ));
}

#[test]
fn a_lease_that_ran_out_may_still_be_finished_until_claimed_again() {
    let mut m = Model::new(LIFETIMES);
    let a = accept_new(&mut m, "pay/a", T0);
    let stale = claim_one(&mut m, T0, &a);
    let b = accept_new(&mut m, "pay/b", T0 + 10);
    // A's lease ran out and A is due again, but B (due earlier) takes the only slot.
    let expiry = T0 + LEASE;
    assert_eq!(ids(&m.claim(expiry, expiry, 1, LEASE_MS)), vec![b]);
    assert_eq!(msg(&m, &a).due_at, Some(expiry));
    assert!(finish(&mut m, &stale, Completion::Delivered, expiry + 1));
    let record = msg(&m, &a);
    assert_eq!(
        (record.state, record.due_at),
        (MessageState::Delivered, None)
    );
    assert!(
        m.claim(expiry + 2, expiry + 2, 10, LEASE_MS).is_empty(),
        "not back"
    );
}

#[test]
fn expire_lease_takes_the_earliest_up_to_the_limit() {
    let mut m = Model::new(LIFETIMES);
    let a = accept_new(&mut m, "pay/a", T0);
    claim_one(&mut m, T0, &a);
    let b = accept_new(&mut m, "pay/b", T0 + 1);
    claim_one(&mut m, T0 + 1, &b);
    assert_eq!(m.expire_lease(T0 + LEASE - 1, T0 + LEASE - 1, 10), 0);
    assert_eq!(m.expire_lease(T0 + LEASE + 5, T0 + LEASE + 5, 1), 1);
    assert_eq!(msg(&m, &a).due_at, Some(T0 + LEASE + 5));
    assert_eq!(msg(&m, &b).lease_until, Some(T0 + 1 + LEASE));
    assert_eq!(m.expire_lease(T0 + LEASE + 6, T0 + LEASE + 6, 10), 1);
    assert_eq!(msg(&m, &a).state, MessageState::InFlight);
}

// ---------------------------------------------------------------------------------------
// Completion decisions

#[test]
fn after_attempt_decides_every_case() {
    use AfterAttempt::*;
    let now = T0 + 100;
    let retry = Completion::Retry { next_at: now + 50 };
    for (completion, resume, again, want) in [
        (
            Completion::Delivered,
            None,
            false,
            Finished(MessageState::Delivered),
        ),
        (Completion::Dead, None, false, Finished(MessageState::Dead)),
        (retry, None, false, DueAt(now + 50)),
        // A resend brought the attempt forward: the schedule resumes where it was...
        (retry, Some(now + 500), false, DueAt(now + 500)),
        (retry, Some(now), false, DueAt(now)),
        // ...unless that time has passed.
        (retry, Some(now - 1), false, DueAt(now + 50)),
        // A resend during the attempt: once more, now, even if the attempt ended it.
        (Completion::Delivered, None, true, DueAt(now)),
        (Completion::Dead, Some(now + 500), true, DueAt(now)),
        (retry, None, true, DueAt(now + 50)),
    ] {
        assert_eq!(
            after_attempt(completion, resume, again, now),
            want,
            "{completion:?} resume {resume:?} again {again}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Resend

#[test]
fn a_requeued_message_starts_its_backoff_over_with_a_fresh_window() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let c = claim_one(&mut m, T0, &id);
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry {
            next_at: T0 + 1_000
        },
        T0 + 1
    ));
    let c = claim_one(&mut m, T0 + 1_000, &id);
    assert!(finish(&mut m, &c, Completion::Dead, T0 + 1_001));
    let now = T0 + DAY;
    let fresh = now + 7 * DAY;
    assert_eq!(m.resend(&id, mark(now), fresh, now), ResendEffect::Requeued);
    assert_eq!(msg(&m, &id).ends_at, None, "live again");
    let c = claim_one(&mut m, now, &id);
    assert_eq!((c.attempts, c.backoff_step, c.deadline), (2, 0, fresh));
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry { next_at: now + 10 },
        now + 1
    ));
    let c = claim_one(&mut m, now + 10, &id);
    assert_eq!((c.attempts, c.backoff_step), (3, 1));
}

#[test]
fn a_requeued_message_waits_behind_the_pending_ones_of_its_key() {
    let mut m = Model::new(LIFETIMES);
    let done = accept_new(&mut m, "pay/1", T0);
    let c = claim_one(&mut m, T0, &done);
    assert!(finish(&mut m, &c, Completion::Delivered, T0 + 1));
    let next = accept_new(&mut m, "pay/1", T0 + 2);
    assert_eq!(
        m.resend(&done, mark(T0 + 3), T0 + DAY, T0 + 3),
        ResendEffect::Requeued
    );
    assert_eq!(m.queue("pay/1"), vec![next.clone(), done.clone()]);
    assert_eq!(msg(&m, &done).due_at, None);
    let c = claim_one(&mut m, T0 + 3, &next);
    assert!(finish(&mut m, &c, Completion::Delivered, T0 + 4));
    claim_one(&mut m, T0 + 4, &done);
}

#[test]
fn an_expedited_message_resumes_its_schedule() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let c = claim_one(&mut m, T0, &id);
    let original = T0 + 60_000;
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry { next_at: original },
        T0 + 1
    ));
    let now = T0 + 1_000;
    for at in [now, now + 1] {
        assert_eq!(
            m.resend(&id, mark(at), at + 7 * DAY, at),
            ResendEffect::Expedited
        );
    }
    let record = msg(&m, &id);
    assert_eq!(record.due_at, Some(now), "the second resend found it due");
    assert_eq!(record.resume_at, Some(original), "the first time is kept");
    assert_eq!(record.deadline, c.deadline, "expediting keeps the window");
    let c = claim_one(&mut m, now + 1, &id);
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry {
            next_at: now + 2_000
        },
        now + 2
    ));
    assert_eq!(msg(&m, &id).due_at, Some(original));
    assert_eq!(msg(&m, &id).resume_at, None);
}

#[test]
fn a_released_expedited_attempt_keeps_the_first_time_to_resume_at() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let c = claim_one(&mut m, T0, &id);
    let original = T0 + 100_000;
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry { next_at: original },
        T0 + 1
    ));
    m.resend(&id, mark(T0 + 2), T0 + DAY, T0 + 2);
    let c = claim_one(&mut m, T0 + 2, &id);
    // Given back (shutdown) for later, then expedited again: neither the release nor the
    // second resend replaces the time the schedule resumes at.
    assert!(m.release(&c, T0 + 50_000));
    assert_eq!(msg(&m, &id).resume_at, Some(original));
    assert_eq!(
        m.resend(&id, mark(T0 + 3), T0 + DAY, T0 + 3),
        ResendEffect::Expedited
    );
    assert_eq!(msg(&m, &id).due_at, Some(T0 + 3));
    let c = claim_one(&mut m, T0 + 3, &id);
    assert!(finish(
        &mut m,
        &c,
        Completion::Retry {
            next_at: T0 + 4_000
        },
        T0 + 4
    ));
    assert_eq!(msg(&m, &id).due_at, Some(original));
}

#[test]
fn a_resend_in_flight_delivers_once_more_not_forever() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let c = claim_one(&mut m, T0, &id);
    let fresh = T0 + 8 * DAY;
    assert_eq!(
        m.resend(&id, mark(T0 + 1), fresh, T0 + 1),
        ResendEffect::AfterCurrent
    );
    assert!(finish(&mut m, &c, Completion::Dead, T0 + 100));
    assert_eq!(msg(&m, &id).state, MessageState::Pending);
    assert_eq!(msg(&m, &id).due_at, Some(T0 + 100));
    let c = claim_one(&mut m, T0 + 100, &id);
    assert_eq!((c.attempts, c.deadline), (1, fresh));
    assert!(finish(&mut m, &c, Completion::Delivered, T0 + 200));
    assert_eq!(msg(&m, &id).state, MessageState::Delivered);
}

// ---------------------------------------------------------------------------------------
// History and lifetimes

#[test]
fn history_keeps_the_first_and_the_latest_rows_and_counts_every_row() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_new(&mut m, "pay/1", T0);
    let mut now = T0;
    for n in 1..=150u32 {
        let c = claim_one(&mut m, now, &id);
        let row = delivery(n, now);
        assert!(m.complete(&c, row, Completion::Retry { next_at: now + 1 }, now));
        now += 1;
    }
    m.resend(&id, mark(now), now + DAY, now);
    let record = msg(&m, &id).record();
    assert_eq!((record.history_total, record.delivery_attempts), (151, 150));
    assert_eq!(record.history.len(), 1 + HISTORY_TAIL);
    let kept: Vec<u32> = record
        .history
        .iter()
        .map(|a| a.delivery().map_or(0, |d| d.attempt))
        .collect();
    let want: Vec<u32> = [1].into_iter().chain(52..=150).chain([0]).collect();
    assert_eq!(kept, want);
}

#[test]
fn finished_messages_end_after_the_retention_and_are_swept() {
    let mut m = Model::new(LIFETIMES);
    let delivered = accept_new(&mut m, "pay/a", T0);
    let dead = accept_new(&mut m, "pay/b", T0);
    let pending = accept_new(&mut m, "pay/c", T0 + 1);
    let recorded = accept_recorded(&mut m, T0);
    for lease in m.claim(T0, T0, 10, LEASE_MS) {
        let outcome = if lease.message.id == delivered {
            Completion::Delivered
        } else {
            Completion::Dead
        };
        assert!(finish(&mut m, &lease, outcome, T0));
    }
    assert_eq!(msg(&m, &pending).state, MessageState::Pending);
    let end = T0 + 30 * DAY;
    assert_eq!(m.sweep(end - 1), 0);
    for id in [&delivered, &dead, &recorded] {
        assert!(!msg(&m, id).ended(end - 1), "{id} kept until its end");
        assert!(msg(&m, id).ended(end));
    }
    // Ended: gone for a resend, though found by reads until swept.
    assert_eq!(
        m.resend(&dead, mark(end), end + DAY, end),
        ResendEffect::Skipped
    );
    assert_eq!(m.sweep(end), 6, "three messages and their dedupe claims");
    for id in [&delivered, &dead, &recorded] {
        assert!(m.message(id).is_none(), "{id} swept");
    }
    assert_eq!(m.sweep(end + 400 * DAY), 1, "the pending message's claim");
    assert!(m.message(&pending).is_some(), "unfinished work never ends");
}
