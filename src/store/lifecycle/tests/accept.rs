//! Accepting: queues, dedupe claims, signature seals, payment transitions and their ends.

use super::*;

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
        claim(&mut m, T0 - 1, 10, LEASE_MS).is_empty(),
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
    assert!(claim(&mut m, T0 + DAY, 10, LEASE_MS).is_empty());
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
    assert_eq!(accept(&mut m, &first, T0), AcceptOutcome::Accepted);
    let repeat = request("k", new_message("pay/1", T0 + 5));
    assert_eq!(
        accept(&mut m, &repeat, T0 + 5),
        AcceptOutcome::Replayed {
            response: first.dedupe.response.clone()
        }
    );
    assert!(m.message(&repeat.message.id).is_none());

    let mut other = request("k", new_message("pay/1", T0 + 6));
    other.dedupe.fingerprint = "another body".into();
    assert_eq!(accept(&mut m, &other, T0 + 6), AcceptOutcome::Conflict);
    assert!(m.message(&other.message.id).is_none());
    assert_eq!(m.messages().count(), 1);
}

#[test]
fn a_dedupe_claim_ends_after_its_ttl() {
    let mut m = Model::new(LIFETIMES);
    let first = request("k", new_message("pay/1", T0));
    accept(&mut m, &first, T0);
    let end = T0 + TTL_SECS as Millis * 1000;
    let before = request("k", new_message("pay/1", end - 1));
    assert!(matches!(
        accept(&mut m, &before, end - 1),
        AcceptOutcome::Replayed { .. }
    ));
    // Ended, even before a sweep: a new event, whatever its fingerprint.
    let mut after = request("k", new_message("pay/1", end));
    after.dedupe.fingerprint = "another body".into();
    assert_eq!(accept(&mut m, &after, end), AcceptOutcome::Accepted);
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
fn a_signature_answers_first_while_it_could_verify() {
    let mut m = Model::new(LIFETIMES);
    let until = T0 + 600_000;
    let first = sealed("tx-1/COMPLETED", "sig-1", until, T0);
    assert_eq!(accept(&mut m, &first, T0), AcceptOutcome::Accepted);
    let answer = AcceptOutcome::Replayed {
        response: first.dedupe.response.clone(),
    };
    // Another dedupe key (an unsigned header changed), even another fingerprint: the seal
    // answers before the claim is looked at.
    let mut reposted = sealed("tx-1/REFUNDED", "sig-1", until, T0 + 1);
    reposted.dedupe.fingerprint = "other".into();
    assert_eq!(accept(&mut m, &reposted, T0 + 1), answer);
    assert!(m.message(&reposted.message.id).is_none());
    // A replay of the claim with a new signature seals that signature to the same answer.
    let retry = sealed("tx-1/COMPLETED", "sig-2", until, T0 + 2);
    assert_eq!(accept(&mut m, &retry, T0 + 2), answer);
    let again = sealed("tx-1/REFUNDED", "sig-2", until, T0 + 3);
    assert_eq!(accept(&mut m, &again, T0 + 3), answer);
    // A conflict seals nothing.
    let mut conflict = sealed("tx-1/COMPLETED", "sig-3", until, T0 + 4);
    conflict.dedupe.fingerprint = "other".into();
    assert_eq!(accept(&mut m, &conflict, T0 + 4), AcceptOutcome::Conflict);
    let fresh = sealed("tx-1/REFUNDED", "sig-3", until, T0 + 5);
    assert_eq!(accept(&mut m, &fresh, T0 + 5), AcceptOutcome::Accepted);
    // Once the signature could no longer verify, its seal is gone.
    let later = sealed("tx-1/OTHER", "sig-1", until + 600_000, until);
    assert_eq!(accept(&mut m, &later, until), AcceptOutcome::Accepted);
}

fn notification(payment_id: &str, to: &str, from: &[&str], now: Millis) -> AcceptRequest {
    AcceptRequest {
        payment: Some(PaymentTransition {
            payment_id: payment_id.to_string(),
            to: to.to_string(),
            allowed_from: from.iter().map(|s| s.to_string()).collect(),
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
        accept(&mut m, &refund, T0),
        AcceptOutcome::InvalidTransition {
            from: "undefined".into()
        }
    );
    assert!(m.message(&refund.message.id).is_none(), "nothing recorded");
    let approve = notification("p", "approved", &["undefined"], T0 + 1);
    assert_eq!(accept(&mut m, &approve, T0 + 1), AcceptOutcome::Accepted);
    let settle = notification("p", "settled", &["approved"], T0 + 2);
    assert_eq!(accept(&mut m, &settle, T0 + 2), AcceptOutcome::Accepted);
    let refund = notification("p", "refunded", &["settled"], T0 + 3);
    assert_eq!(accept(&mut m, &refund, T0 + 3), AcceptOutcome::Accepted);
    assert_eq!(m.payment_status("p", T0 + 3).as_deref(), Some("refunded"));
    // It lives its retention from the last transition, then the payment is unknown again.
    let end = T0 + 3 + 400 * DAY;
    assert_eq!(m.payment_status("p", end - 1).as_deref(), Some("refunded"));
    assert_eq!(m.payment_status("p", end), None);
    let approve = notification("p", "approved", &["undefined"], end);
    assert_eq!(accept(&mut m, &approve, end), AcceptOutcome::Accepted);
}

#[test]
fn sweep_deletes_claims_seals_and_payments_past_their_end() {
    let mut m = Model::new(LIFETIMES);
    let req = AcceptRequest {
        payment: notification("p", "approved", &["undefined"], T0).payment,
        ..sealed("k", "sig", T0 + 600_000, T0)
    };
    assert_eq!(accept(&mut m, &req, T0), AcceptOutcome::Accepted);
    assert_eq!(sweep(&mut m, T0 + 600_000 - 1), 0);
    assert_eq!(sweep(&mut m, T0 + 600_000), 1, "the seal");
    assert_eq!(sweep(&mut m, T0 + 30 * DAY), 1, "the dedupe claim");
    assert_eq!(sweep(&mut m, T0 + 400 * DAY), 1, "the payment state");
    assert!(m.message(&req.message.id).is_some(), "pending: never swept");
}
