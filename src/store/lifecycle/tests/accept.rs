//! Accepting: queues, dedupe claims, signature seals, payment transitions and their ends.

use super::*;
use crate::payment::PaymentStatus;

#[test]
fn accept_queues_a_message_and_only_the_head_is_due() {
    let mut m = Model::new(LIFETIMES);
    let first = accept_new(&mut m, "pay/1", T0);
    let second = accept_new(&mut m, "pay/1", T0 + 1);
    let other = accept_new(&mut m, "pay/2", T0 + 2);
    assert_eq!(m.queue("pay/1"), vec![first.clone(), second.clone()]);
    assert_eq!(msg(&m, &first).due_at, Some(T0));
    assert_eq!(msg(&m, &second).due_at, None);
    assert_eq!(msg(&m, &other).due_at, Some(T0 + 2));
    assert_eq!(msg(&m, &first).record().next_attempt_at, Some(T0));
    assert!(
        m.claim(T0 - 1, T0 - 1, 10, LEASE_MS).is_empty(),
        "not before its time"
    );
    assert_eq!(
        m.depth(),
        QueueDepth {
            pending: 3,
            in_flight: 0,
            dead: 0
        }
    );
    assert_eq!(m.oldest_unfinished(), Some(first));
}

#[test]
fn a_message_without_a_target_is_recorded_and_never_queued() {
    let mut m = Model::new(LIFETIMES);
    let id = accept_recorded(&mut m, T0);
    let record = msg(&m, &id);
    assert_eq!(record.state, MessageState::Recorded);
    assert_eq!(record.due_at, None);
    assert_eq!(record.ends_at, Some(T0 + 30 * DAY));
    assert!(m.queue("src/quiet/tx").is_empty());
    assert!(m.claim(T0 + DAY, T0 + DAY, 10, LEASE_MS).is_empty());
    assert_eq!(m.depth(), QueueDepth::default());
    assert_eq!(m.oldest_unfinished(), None);
    // It does not hold up a later deliverable message of the same key.
    let next = accept_new(&mut m, "src/quiet/tx", T0 + 1);
    claim_one(&mut m, T0 + 1, &next);
}

#[test]
fn a_replay_gets_the_first_answer_and_records_nothing() {
    let mut m = Model::new(LIFETIMES);
    let first = request("k", new_message("pay/1", T0));
    assert_eq!(m.accept(&first, T0), AcceptOutcome::Accepted);
    let repeat = request("k", new_message("pay/1", T0 + 5));
    assert_eq!(
        m.accept(&repeat, T0 + 5),
        AcceptOutcome::Replayed {
            response: first.dedupe.response.clone()
        }
    );
    assert!(m.message(&repeat.message.id).is_none());

    let mut other = request("k", new_message("pay/1", T0 + 6));
    other.dedupe.fingerprint = Some("another body".into());
    assert_eq!(m.accept(&other, T0 + 6), AcceptOutcome::Conflict);
    assert!(m.message(&other.message.id).is_none());
    assert_eq!(m.messages().count(), 1);
}

#[test]
fn a_dedupe_claim_ends_after_its_ttl() {
    let mut m = Model::new(LIFETIMES);
    let first = request("k", new_message("pay/1", T0));
    m.accept(&first, T0);
    let end = T0 + TTL_SECS as Millis * 1000;
    let before = request("k", new_message("pay/1", end - 1));
    assert!(matches!(
        m.accept(&before, end - 1),
        AcceptOutcome::Replayed { .. }
    ));
    // Ended, even before a sweep: a new event, whatever its fingerprint.
    let mut after = request("k", new_message("pay/1", end));
    after.dedupe.fingerprint = Some("another body".into());
    assert_eq!(m.accept(&after, end), AcceptOutcome::Accepted);
    assert!(
        m.message(&first.message.id).is_some(),
        "only the claim ended"
    );
}

fn sealed(dedupe_key: &str, seal: &str, expires_at: Millis, now: Millis) -> AcceptRequest {
    AcceptRequest {
        seal: Some(SignatureSeal {
            key: seal.to_string(),
            expires_at,
        }),
        ..request(dedupe_key, new_message("src/payzu/tx-1", now))
    }
}

#[test]
fn a_signature_answers_for_its_own_dedupe_key_while_it_could_verify() {
    let mut m = Model::new(LIFETIMES);
    let until = T0 + 600_000;
    let first = sealed("tx-1/COMPLETED", "sig-1", until, T0);
    assert_eq!(m.accept(&first, T0), AcceptOutcome::Accepted);
    let answer = AcceptOutcome::Replayed {
        response: first.dedupe.response.clone(),
    };
    // The same signature and dedupe key, even another fingerprint: the seal answers first.
    let mut again = sealed("tx-1/COMPLETED", "sig-1", until, T0 + 1);
    again.dedupe.fingerprint = Some("other".into());
    assert_eq!(m.accept(&again, T0 + 1), answer);
    // Another dedupe key (an unsigned header changed): refused, and nothing recorded, no key
    // claimed: the real event, signed again, is accepted.
    let reposted = sealed("tx-1/REFUNDED", "sig-1", until, T0 + 2);
    assert_eq!(m.accept(&reposted, T0 + 2), AcceptOutcome::SignatureReused);
    assert!(m.message(&reposted.message.id).is_none());
    let resigned = sealed("tx-1/REFUNDED", "sig-9", until, T0 + 3);
    assert_eq!(m.accept(&resigned, T0 + 3), AcceptOutcome::Accepted);
    // A replay of the claim with a new signature seals that signature to the same answer;
    // under another claim that signature is refused, even where that claim lives.
    let retry = sealed("tx-1/COMPLETED", "sig-2", until, T0 + 4);
    assert_eq!(m.accept(&retry, T0 + 4), answer);
    let elsewhere = sealed("tx-1/REFUNDED", "sig-2", until, T0 + 5);
    assert_eq!(m.accept(&elsewhere, T0 + 5), AcceptOutcome::SignatureReused);
    // A conflict seals nothing.
    let mut conflict = sealed("tx-1/COMPLETED", "sig-3", until, T0 + 6);
    conflict.dedupe.fingerprint = Some("other".into());
    assert_eq!(m.accept(&conflict, T0 + 6), AcceptOutcome::Conflict);
    let fresh = sealed("tx-1/OTHER", "sig-3", until, T0 + 7);
    assert_eq!(m.accept(&fresh, T0 + 7), AcceptOutcome::Accepted);
    // Once the signature could no longer verify, its seal is gone.
    let later = sealed("tx-1/LATER", "sig-1", until + 600_000, until);
    assert_eq!(m.accept(&later, until), AcceptOutcome::Accepted);
}

#[test]
fn a_seal_ends_with_its_claim_at_the_latest() {
    let mut m = Model::new(LIFETIMES);
    let claim_ends = T0 + TTL_SECS as Millis * 1000;
    let first = request("tx-1/COMPLETED", new_message("src/payzu/tx-1", T0));
    assert_eq!(m.accept(&first, T0), AcceptOutcome::Accepted);
    // A signature that would verify past the claim (hmac-sha256 has no timestamp), sealed by
    // a replay a day before the claim ends.
    let replayed_at = claim_ends - 86_400_000;
    let forever = claim_ends + 30 * 86_400_000;
    let resigned = sealed("tx-1/COMPLETED", "sig-1", forever, replayed_at);
    assert!(matches!(
        m.accept(&resigned, replayed_at),
        AcceptOutcome::Replayed { .. }
    ));
    // Past the claim's end the seal is gone with it: the same bytes are a new event, as for
    // a signature first accepted then.
    let after = sealed("tx-1/COMPLETED", "sig-1", forever, claim_ends);
    assert_eq!(m.accept(&after, claim_ends), AcceptOutcome::Accepted);
}

fn notification(payment_id: &str, to: &str, from: &[&str], now: Millis) -> AcceptRequest {
    AcceptRequest {
        payment: Some(PaymentTransition {
            payment_id: payment_id.into(),
            to: PaymentStatus::parse(to).expect("a payment status"),
            allowed_from: from
                .iter()
                .map(|s| PaymentStatus::parse(s).expect("a payment status"))
                .collect(),
        }),
        ..request(
            &format!("n/{payment_id}/{to}"),
            new_message(&format!("pay/{payment_id}"), now),
        )
    }
}

#[test]
fn a_payment_transition_is_a_compare_and_set_that_burns_no_key() {
    let mut m = Model::new(LIFETIMES);
    assert_eq!(m.payment_status("p", T0), None);
    let refund = notification("p", "refunded", &["settled"], T0);
    assert_eq!(
        m.accept(&refund, T0),
        AcceptOutcome::InvalidTransition {
            from: "undefined".into()
        }
    );
    assert!(m.message(&refund.message.id).is_none(), "nothing recorded");
    let approve = notification("p", "approved", &["undefined"], T0 + 1);
    assert_eq!(m.accept(&approve, T0 + 1), AcceptOutcome::Accepted);
    let settle = notification("p", "settled", &["approved"], T0 + 2);
    assert_eq!(m.accept(&settle, T0 + 2), AcceptOutcome::Accepted);
    let refund = notification("p", "refunded", &["settled"], T0 + 3);
    assert_eq!(m.accept(&refund, T0 + 3), AcceptOutcome::Accepted);
    assert_eq!(m.payment_status("p", T0 + 3).as_deref(), Some("refunded"));
    // It lives its retention from the last transition, then the payment is unknown again.
    let end = T0 + 3 + 400 * DAY;
    assert_eq!(m.payment_status("p", end - 1).as_deref(), Some("refunded"));
    assert_eq!(m.payment_status("p", end), None);
    let approve = notification("p", "approved", &["undefined"], end);
    assert_eq!(m.accept(&approve, end), AcceptOutcome::Accepted);
}

#[test]
fn sweep_deletes_claims_seals_and_payments_past_their_end() {
    let mut m = Model::new(LIFETIMES);
    let req = AcceptRequest {
        payment: notification("p", "approved", &["undefined"], T0).payment,
        ..sealed("k", "sig", T0 + 600_000, T0)
    };
    assert_eq!(m.accept(&req, T0), AcceptOutcome::Accepted);
    assert_eq!(m.sweep(T0 + 600_000 - 1), 0);
    assert_eq!(m.sweep(T0 + 600_000), 1, "the seal");
    assert_eq!(m.sweep(T0 + 30 * DAY), 1, "the dedupe claim");
    assert_eq!(m.sweep(T0 + 400 * DAY), 1, "the payment state");
    assert!(m.message(&req.message.id).is_some(), "pending: never swept");
}
