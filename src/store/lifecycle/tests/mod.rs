//! Every rule from every state here; the details of accepting in `accept`, of delivering
//! (ordering, leases, resends, lifetimes) in `delivery`.

mod accept;
mod delivery;

use std::collections::BTreeMap;

use super::*;
use crate::clock::Millis;
use crate::store::{
    AcceptOutcome, AcceptRequest, Completion, DeliveryAttempt, HISTORY_TAIL, Lease, MessageId,
    MessageState, NewMessage, QueueDepth, ResendEffect, ResendMark,
};
use crate::store::{DedupeClaim, MessageKind, Partitions, PaymentTransition, SignatureSeal};

/// 2025-11-30T00:00:00Z: ids encode creation time, so times must be realistic.
const T0: Millis = 1_764_460_800_000;
const DAY: Millis = 86_400_000;
const LEASE_MS: u64 = 30_000;
const LEASE: Millis = LEASE_MS as Millis;
const TTL_SECS: u64 = 30 * 86_400;
const LIFETIMES: Lifetimes = Lifetimes {
    retention_ms: 30 * DAY,
    payment_retention_ms: 400 * DAY,
};

fn new_message(ordering_key: &str, now: Millis) -> NewMessage {
    NewMessage {
        id: MessageId::generate(now, ordering_key, Partitions::DEFAULT),
        kind: MessageKind::Notification,
        source: None,
        payment_id: None,
        transaction_id: None,
        ordering_key: ordering_key.to_string(),
        event: None,
        target_url: Some("http://127.0.0.1:9/hook".into()),
        headers: BTreeMap::new(),
        body: "{}".into(),
        created_at: now,
        deadline: now + 7 * DAY,
    }
}

fn request(dedupe_key: &str, message: NewMessage) -> AcceptRequest {
    AcceptRequest {
        dedupe: DedupeClaim {
            key: dedupe_key.to_string(),
            ttl_secs: TTL_SECS,
            fingerprint: Some("fp".into()),
            response: format!("answer for {}", message.id),
        },
        message,
        payment: None,
        seal: None,
    }
}

/// Accepts a message of `ordering_key` under a dedupe key of its own.
fn accept_new(m: &mut Model, ordering_key: &str, now: Millis) -> MessageId {
    let message = new_message(ordering_key, now);
    let id = message.id.clone();
    let outcome = m.accept(&request(&format!("claim/{id}"), message), now);
    assert_eq!(outcome, AcceptOutcome::Accepted);
    id
}

fn accept_recorded(m: &mut Model, now: Millis) -> MessageId {
    let message = NewMessage {
        target_url: None,
        ..new_message("src/quiet/tx", now)
    };
    let id = message.id.clone();
    assert_eq!(
        m.accept(&request(&format!("claim/{id}"), message), now),
        AcceptOutcome::Accepted
    );
    id
}

fn delivery(attempt: u32, at: Millis) -> DeliveryAttempt {
    DeliveryAttempt {
        attempt,
        at,
        status: Some(500),
        error: None,
        latency_ms: Some(5),
        response: None,
    }
}

fn mark(at: Millis) -> ResendMark {
    ResendMark {
        at,
        request_id: Some("op".into()),
    }
}

fn ids(leases: &[Lease]) -> Vec<MessageId> {
    leases.iter().map(|l| l.message.id.clone()).collect()
}

/// Claims at `now` and expects exactly `id`.
fn claim_one(m: &mut Model, now: Millis, id: &MessageId) -> Lease {
    let leases = m.claim(now, now, 100, LEASE_MS);
    assert_eq!(ids(&leases), vec![id.clone()], "claimed at T0+{}", now - T0);
    leases.into_iter().next().expect("one lease")
}

fn finish(m: &mut Model, lease: &Lease, completion: Completion, now: Millis) -> bool {
    m.complete(lease, delivery(lease.attempts + 1, now), completion, now)
}

fn msg<'a>(m: &'a Model, id: &MessageId) -> &'a Message {
    m.message(id).expect("message kept")
}

// ---------------------------------------------------------------------------------------
// Every rule from every state

/// Every place a message can be, each reached through the rules themselves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spot {
    /// Pending, head of its queue, due now.
    DueHead,
    /// Pending, head of its queue, its retry due later.
    WaitingHead,
    /// Pending behind another message of its key: not due.
    Behind,
    InFlight,
    /// In flight, its lease ran out and made it due again, not claimed again yet.
    Expired,
    Delivered,
    Dead,
    Recorded,
}

const SPOTS: [Spot; 8] = [
    Spot::DueHead,
    Spot::WaitingHead,
    Spot::Behind,
    Spot::InFlight,
    Spot::Expired,
    Spot::Delivered,
    Spot::Dead,
    Spot::Recorded,
];

struct Fixture {
    model: Model,
    id: MessageId,
    /// The last lease taken on the message (stale unless it is in flight), or one that was
    /// never handed out.
    lease: Lease,
    now: Millis,
}

fn fixture(spot: Spot) -> Fixture {
    let mut m = Model::new(LIFETIMES);
    let now = T0 + 10;
    let id = match spot {
        Spot::Recorded => accept_recorded(&mut m, T0),
        Spot::Behind => {
            accept_new(&mut m, "pay/1", T0);
            accept_new(&mut m, "pay/1", T0 + 1)
        }
        _ => accept_new(&mut m, "pay/1", T0),
    };
    let unleased = Lease {
        message: msg(&m, &id).message.clone(),
        token: 1,
        attempts: 0,
        backoff_step: 0,
        deadline: msg(&m, &id).deadline,
        resume_at: None,
        again: false,
    };
    let (lease, now) = match spot {
        Spot::DueHead | Spot::Behind | Spot::Recorded => (unleased, now),
        Spot::WaitingHead => {
            let lease = claim_one(&mut m, T0 + 1, &id);
            let retry = Completion::Retry {
                next_at: T0 + 60_000,
            };
            assert!(finish(&mut m, &lease, retry, T0 + 2));
            (lease, now)
        }
        Spot::InFlight => (claim_one(&mut m, T0 + 1, &id), now),
        Spot::Expired => {
            let lease = claim_one(&mut m, T0 + 1, &id);
            let now = T0 + 1 + LEASE;
            assert_eq!(m.expire_lease(now, now, 10), 1);
            (lease, now)
        }
        Spot::Delivered | Spot::Dead => {
            let lease = claim_one(&mut m, T0 + 1, &id);
            let completion = if spot == Spot::Dead {
                Completion::Dead
            } else {
                Completion::Delivered
            };
            assert!(finish(&mut m, &lease, completion, T0 + 2));
            (lease, now)
        }
    };
    Fixture {
        model: m,
        id,
        lease,
        now,
    }
}

#[test]
fn fixtures_are_in_the_state_they_name() {
    use MessageState::*;
    for (spot, state, due) in [
        (Spot::DueHead, Pending, Some(T0)),
        (Spot::WaitingHead, Pending, Some(T0 + 60_000)),
        (Spot::Behind, Pending, None),
        (Spot::InFlight, InFlight, None),
        (Spot::Expired, InFlight, Some(T0 + 1 + LEASE)),
        (Spot::Delivered, Delivered, None),
        (Spot::Dead, Dead, None),
        (Spot::Recorded, Recorded, None),
    ] {
        let f = fixture(spot);
        let m = msg(&f.model, &f.id);
        assert_eq!((m.state, m.due_at), (state, due), "{spot:?}");
    }
}

#[test]
fn claim_from_each_state() {
    for spot in SPOTS {
        let mut f = fixture(spot);
        let token = msg(&f.model, &f.id).token;
        let claimed = f.model.claim(f.now, f.now, 100, LEASE_MS);
        let claimed: Vec<_> = claimed.iter().filter(|l| l.message.id == f.id).collect();
        let claimable = matches!(spot, Spot::DueHead | Spot::Expired);
        assert_eq!(claimed.len(), usize::from(claimable), "{spot:?}");
        if let Some(lease) = claimed.first() {
            assert_eq!(lease.token, token + 1, "{spot:?}: a new token");
            let m = msg(&f.model, &f.id);
            assert_eq!(m.state, MessageState::InFlight);
            assert_eq!(m.due_at, None);
            assert_eq!(m.lease_until, Some(f.now + LEASE));
        }
    }
}

#[test]
fn complete_from_each_state() {
    for spot in SPOTS {
        for completion in [
            Completion::Delivered,
            Completion::Dead,
            Completion::Retry { next_at: T0 + DAY },
        ] {
            let mut f = fixture(spot);
            let before = msg(&f.model, &f.id).clone();
            let held = matches!(spot, Spot::InFlight | Spot::Expired);
            assert_eq!(
                finish(&mut f.model, &f.lease, completion, f.now),
                held,
                "{spot:?} {completion:?}"
            );
            let after = msg(&f.model, &f.id);
            if !held {
                assert_eq!(after, &before, "{spot:?}: nothing changed");
                continue;
            }
            assert_eq!(after.attempts, before.attempts + 1);
            assert_eq!(after.history_total, before.history_total + 1);
            assert_eq!(after.lease_until, None);
            let (state, due, ends) = match completion {
                Completion::Delivered => (MessageState::Delivered, None, Some(f.now + 30 * DAY)),
                Completion::Dead => (MessageState::Dead, None, Some(f.now + 30 * DAY)),
                Completion::Retry { next_at } => (MessageState::Pending, Some(next_at), None),
            };
            assert_eq!(
                (after.state, after.due_at, after.ends_at),
                (state, due, ends)
            );
        }
    }
}

#[test]
fn release_from_each_state() {
    for spot in SPOTS {
        let mut f = fixture(spot);
        let before = msg(&f.model, &f.id).clone();
        let held = matches!(spot, Spot::InFlight | Spot::Expired);
        assert_eq!(f.model.release(&f.lease, f.now + 500), held, "{spot:?}");
        let after = msg(&f.model, &f.id);
        if held {
            assert_eq!(after.state, MessageState::Pending);
            assert_eq!(after.due_at, Some(f.now + 500));
            assert_eq!(after.lease_until, None);
            assert_eq!(after.history_total, 0, "a release is not an attempt");
            assert_eq!(after.attempts, before.attempts);
        } else {
            assert_eq!(after, &before, "{spot:?}: nothing changed");
        }
    }
}

#[test]
fn resend_from_each_state() {
    use ResendEffect::*;
    for (spot, effect) in [
        (Spot::DueHead, Expedited),
        (Spot::WaitingHead, Expedited),
        (Spot::Behind, Queued),
        (Spot::InFlight, AfterCurrent),
        (Spot::Expired, AfterCurrent),
        (Spot::Delivered, Requeued),
        (Spot::Dead, Requeued),
        (Spot::Recorded, Skipped),
    ] {
        let mut f = fixture(spot);
        let before = msg(&f.model, &f.id).clone();
        let fresh = f.now + 7 * DAY;
        assert_eq!(
            f.model.resend(&f.id, mark(f.now), fresh, f.now),
            effect,
            "{spot:?}"
        );
        let after = msg(&f.model, &f.id);
        if effect == Skipped {
            assert_eq!(after, &before, "recorded: no mark");
            continue;
        }
        assert_eq!(
            after.history.last(),
            Some(&mark(f.now).into()),
            "{spot:?}: marked"
        );
        let (state, due, deadline) = match spot {
            Spot::DueHead => (MessageState::Pending, Some(T0), before.deadline),
            Spot::WaitingHead => (MessageState::Pending, Some(f.now), before.deadline),
            Spot::Behind => (MessageState::Pending, None, before.deadline),
            Spot::InFlight => (MessageState::InFlight, None, fresh),
            Spot::Expired => (MessageState::InFlight, before.due_at, fresh),
            _ => (MessageState::Pending, Some(f.now), fresh),
        };
        assert_eq!(
            (after.state, after.due_at, after.deadline),
            (state, due, deadline)
        );
    }
}

#[test]
fn resend_of_an_unknown_id_is_skipped() {
    let mut m = Model::new(LIFETIMES);
    let unknown = MessageId::generate(T0, "pay/none", Partitions::DEFAULT);
    assert_eq!(
        m.resend(&unknown, mark(T0), T0 + DAY, T0),
        ResendEffect::Skipped
    );
    assert!(m.message(&unknown).is_none());
}
