//! The state changes: each applies what its `store::lifecycle` rule decides, an accept in
//! one call of accept.lua, the rest through `apply.rs` (each script's header lists its `KEYS`
//! and `ARGV` in the order given here). Resend operations are plain commands: they belong to
//! no message.

use redis::{Cmd, Pipeline};

use super::apply::{self, Applied};
use super::connection::Sent;
use super::{RedisStore, corrupt, one_call, record, script_call};
use super::{counts, keys};
use crate::clock::Millis;
use crate::payment::PaymentStatus;
use crate::store::counts::Tally;
use crate::store::ids::claim_tail;
use crate::store::lifecycle::{self, Effect, QueueMove, Snapshot};
use crate::store::{
    AcceptOutcome, AcceptRequest, Completion, DeliveryAttempt, HistoryEntry, Lease, MessageId,
    MessageKind, OperationReservation, ResendEffect, ResendMark, SWEEP_LIMIT, StoreError,
    decode_operation, encode_finished_operation, encode_running_operation,
};

/// Applies store::lifecycle::accept in one call of accept.lua, fed the plan the rule makes
/// for recording (the script checks the claim, seal and payment as the rule does).
pub(super) async fn accept(
    store: &RedisStore,
    req: &AcceptRequest,
    now: Millis,
) -> Result<AcceptOutcome, StoreError> {
    let msg = &req.message;
    let keys = store.keys.of_id(&msg.id);
    let plan = lifecycle::accept_plan(req, now, store.lifetimes());
    let first = plan.message.state;
    // Without a payment or a seal the script still gets a key (one that is never written), so
    // the KEYS keep their positions.
    let (payment_key, to, allowed) = match &req.payment {
        Some(p) => (
            keys.payment(&p.payment_id),
            p.to.as_str(),
            p.allowed_from
                .iter()
                .map(|status| status.as_str())
                .collect::<Vec<_>>()
                .join(" "),
        ),
        None => (keys.payment(""), "", String::new()),
    };
    let payment_ends = plan.payment.as_ref().map(|(_, ends)| *ends).unwrap_or(now);
    let (seal_key, seal_until) = match &req.seal {
        Some(seal) => (keys.seal(&seal.key), seal.expires_at.to_string()),
        None => (keys.seal(""), String::new()),
    };
    let due_if_head = match plan.queue {
        QueueMove::Join { due_if_head } => due_if_head.to_string(),
        QueueMove::Stay | QueueMove::Leave { .. } => String::new(),
    };
    // An inbound callback is counted in its source's minute (recoveries.rs); other accepts
    // name a key of the same hour that is never written, so the KEYS keep their positions.
    let counted = match (msg.kind, msg.source.as_deref()) {
        (MessageKind::Inbound, Some(source)) => Some(source),
        _ => None,
    };
    let counts_key = keys.inbound_counts(counts::hour_of(now), counted.unwrap_or(""));
    let (count_field, count_lifetime) = match counted {
        Some(_) => (
            super::recoveries::field(now),
            super::recoveries::lifetime_ms(now).to_string(),
        ),
        None => (String::new(), String::new()),
    };
    let script = &store.scripts.accept;
    let mut call = script_call(
        script,
        &[
            keys.dedupe(&req.dedupe.key),
            keys.message(&msg.id),
            keys.queue(&msg.ordering_key),
            keys.due(),
            keys.index(first),
            keys.key_index(&msg.ordering_key).bucket,
            payment_key,
            keys.buckets(),
            seal_key,
            counts_key,
        ],
    );
    call.arg(plan.claim_ends)
        .arg(req.dedupe.stored_fingerprint())
        .arg(stored_response(&req.dedupe.response))
        .arg(msg.id.as_str())
        .arg(record::encode(msg)?)
        .arg(now)
        .arg(first.as_str())
        .arg(to)
        .arg(allowed)
        .arg(payment_ends)
        .arg(
            plan.message
                .ends_at
                .map(|at| at.to_string())
                .unwrap_or_default(),
        )
        .arg(seal_until)
        .arg(keys::key_hash(&msg.ordering_key))
        .arg(claim_tail(msg.id.partition(), &req.dedupe.key))
        .arg(compact_claim(req, now).unwrap_or_default())
        .arg(&due_if_head)
        // a payment the store does not know: never seen, or its state ended
        .arg(PaymentStatus::Undefined.as_str())
        .arg(count_field)
        .arg(count_lifetime);
    let reply: Vec<String> = store.eval(script, &call).await?;
    match reply.as_slice() {
        [ok] if ok == "ok" => {
            if !due_if_head.is_empty() {
                store.hints.wrote(msg.id.partition());
            }
            Ok(AcceptOutcome::Accepted)
        }
        [dup, stored] if dup == "dup" => Ok(AcceptOutcome::Replayed {
            response: stored_response_text(stored)?,
        }),
        [c] if c == "conflict" => Ok(AcceptOutcome::Conflict),
        [r] if r == "reused" => Ok(AcceptOutcome::SignatureReused),
        [t, from] if t == "transition" => {
            Ok(AcceptOutcome::InvalidTransition { from: from.clone() })
        }
        other => Err(corrupt(format!("accept script answered {other:?}"))),
    }
}

/// Applies `decide`'s effect to message `id` of `ordering_key`, deciding first from `first`
/// (what the caller knows) and, whenever the guard finds the message changed, again from what
/// a fresh read finds. `None` from `decide`: the rule changes nothing.
async fn decide_and_apply<T>(
    store: &RedisStore,
    id: &MessageId,
    ordering_key: &str,
    first: Option<Snapshot>,
    now: Millis,
    tally: Option<Tally>,
    decide: impl Fn(Option<&Snapshot>) -> (T, Option<Effect>),
) -> Result<T, StoreError> {
    let mut snapshot = match first {
        Some(known) => Some(known),
        None => apply::read(store, id).await?.map(|(_, s)| s),
    };
    for _ in 0..apply::DECISIONS {
        let (answer, effect) = decide(snapshot.as_ref());
        let Some(effect) = effect else {
            return Ok(answer);
        };
        match apply::apply(store, id, ordering_key, &effect, tally, now).await? {
            Applied::Done { made_due } => {
                if made_due {
                    store.hints.wrote(id.partition());
                }
                return Ok(answer);
            }
            Applied::Stale => snapshot = apply::read(store, id).await?.map(|(_, s)| s),
        }
    }
    Err(StoreError::Unavailable(format!(
        "message {id} changed under each of {} attempts to apply a decision; try again",
        apply::DECISIONS
    )))
}

/// Applies store::lifecycle::complete, decided from what the claim read (the lease).
pub(super) async fn complete(
    store: &RedisStore,
    claimed: &Lease,
    attempt: DeliveryAttempt,
    completion: Completion,
    now: Millis,
) -> Result<bool, StoreError> {
    let lifetimes = store.lifetimes();
    let row = HistoryEntry::Delivery(attempt);
    decide_and_apply(
        store,
        &claimed.message.id,
        &claimed.message.ordering_key,
        Some(claimed.snapshot()),
        now,
        Some(Tally::of(completion)),
        |snapshot| {
            let effect = snapshot.and_then(|s| {
                lifecycle::complete(s, claimed.token, row.clone(), completion, now, lifetimes)
            });
            (effect.is_some(), effect)
        },
    )
    .await
}

/// Applies store::lifecycle::release, decided from the lease.
pub(super) async fn release(
    store: &RedisStore,
    claimed: &Lease,
    next_at: Millis,
) -> Result<bool, StoreError> {
    decide_and_apply(
        store,
        &claimed.message.id,
        &claimed.message.ordering_key,
        Some(claimed.snapshot()),
        // a release ends nothing: no expiry bucket is written
        next_at,
        None,
        |snapshot| {
            let effect = snapshot.and_then(|s| lifecycle::release(s, claimed.token, next_at));
            (effect.is_some(), effect)
        },
    )
    .await
}

/// Applies store::lifecycle::resend to what a read finds.
pub(super) async fn resend(
    store: &RedisStore,
    id: &MessageId,
    mark: ResendMark,
    fresh_deadline: Millis,
    now: Millis,
) -> Result<ResendEffect, StoreError> {
    // The ordering queue is named by the key, which only the record knows.
    let Some((message, snapshot)) = apply::read(store, id).await? else {
        return Ok(ResendEffect::Skipped);
    };
    decide_and_apply(
        store,
        id,
        &message.ordering_key,
        Some(snapshot),
        now,
        None,
        |snapshot| lifecycle::resend(snapshot, mark.clone(), fresh_deadline, now),
    )
    .await
}

pub(super) async fn reserve_operation(
    store: &RedisStore,
    key: &str,
    fingerprint: &str,
    ttl_secs: u64,
) -> Result<OperationReservation, StoreError> {
    let key = store.keys.operation(key);
    let mut reserve = redis::cmd("SET");
    reserve
        .arg(&key)
        .arg(encode_running_operation(fingerprint))
        .arg("NX")
        .arg("EX")
        .arg(ttl_secs);
    let set: Option<String> = store.write(&reserve).await?;
    if set.is_some() {
        return Ok(OperationReservation::Fresh);
    }
    let value: Option<String> = store.send(&Cmd::get(&key)).await?;
    // Gone between the two commands (it expired): the caller retries and reserves it.
    Ok(value.map_or(OperationReservation::InProgress, |v| {
        decode_operation(&v, fingerprint)
    }))
}

pub(super) async fn finish_operation(
    store: &RedisStore,
    key: &str,
    fingerprint: &str,
    response: &str,
    ttl_secs: u64,
) -> Result<(), StoreError> {
    store
        .write(&Cmd::set_ex(
            store.keys.operation(key),
            encode_finished_operation(fingerprint, response),
            ttl_secs,
        ))
        .await
}

/// Sweeps every partition; a partition whose master does not answer waits for the next sweep.
pub(super) async fn sweep(store: &RedisStore, now: Millis) -> Result<usize, StoreError> {
    let script = &store.scripts.sweep;
    let calls: Vec<Pipeline> = store
        .keys
        .all()
        .map(|keys| {
            let mut call = script_call(script, &[keys.buckets()]);
            call.arg(now).arg(SWEEP_LIMIT);
            one_call(call)
        })
        .collect();
    let mut swept = 0;
    let mut failure = None;
    for reply in store
        .per_partition::<(usize,)>(Sent::Script(script), &calls)
        .await
    {
        match reply {
            Ok((n,)) => swept += n,
            Err(e) => failure = Some(e),
        }
    }
    match failure {
        Some(e) if swept == 0 => Err(e),
        _ => Ok(swept),
    }
}

/// The longest lifetime a compact claim holds: 5 decimal digits of minutes (69 days).
const COMPACT_CLAIM_MAX_MINUTES: u64 = 99_999;

/// The value of a compact dedupe claim (keys.rs) for `req` accepted at `now`, when it can be
/// one: the message id is the one derived from `now` and the claim key in its partition, the
/// answer is exactly `{"messageId":"<id>"}` and there is no fingerprint, so the acceptance ms
/// and the claim key rebuild the answer of every replay byte for byte, and the lifetime is
/// whole minutes. It is the acceptance ms followed by the lifetime in minutes as 5 digits, a
/// canonical decimal that fits an `i64`, which Redis keeps as an integer.
fn compact_claim(req: &AcceptRequest, now: Millis) -> Option<String> {
    let claim = &req.dedupe;
    let id = &req.message.id;
    let minutes = claim.ttl_secs / 60;
    let derivable = now > 0
        && claim.fingerprint.is_none()
        && claim.ttl_secs.is_multiple_of(60)
        && (1..=COMPACT_CLAIM_MAX_MINUTES).contains(&minutes)
        && *id == MessageId::of_claim(now, id.partition(), &claim.key)
        && claim.response == format!(r#"{{"messageId":"{id}"}}"#);
    derivable
        .then(|| format!("{now}{minutes:05}"))
        .filter(|value| value.parse::<i64>().is_ok())
}

/// The start of a response that [`stored_response`] keeps as the message id alone.
const MESSAGE_ID_RESPONSE: (&str, &str) = (r#"{"messageId":""#, r#""}"#);

/// Every message id starts with it; a stored response leaves it out.
const ID_PREFIX: &str = "msg_";

/// How a dedupe claim or seal stores the response a repeat gets (keys.rs): `#` and the id
/// without its `msg_` when it is exactly `{"messageId":"<id>"}` (so a callback's claim fits
/// Redis' 44-byte embedded strings), else `=` and the response.
pub(super) fn stored_response(response: &str) -> String {
    let (open, close) = MESSAGE_ID_RESPONSE;
    match response
        .strip_prefix(open)
        .and_then(|rest| rest.strip_suffix(close))
        .filter(|id| MessageId::parse(id).is_some())
        .and_then(|id| id.strip_prefix(ID_PREFIX))
    {
        Some(id) => format!("#{id}"),
        None => format!("={response}"),
    }
}

/// The response [`stored_response`] stored, byte for byte.
pub(super) fn stored_response_text(stored: &str) -> Result<String, StoreError> {
    let (open, close) = MESSAGE_ID_RESPONSE;
    if let Some(id) = stored.strip_prefix('#') {
        Ok(format!("{open}{ID_PREFIX}{id}{close}"))
    } else if let Some(response) = stored.strip_prefix('=') {
        Ok(response.to_string())
    } else {
        Err(corrupt(format!("stored response `{stored}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::{compact_claim, stored_response, stored_response_text};
    use crate::store::{
        AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, Partitions,
    };

    const NOW: i64 = 1_764_460_800_000;

    /// An inbound callback's request as `inbound::accept` makes it: the id derived from the
    /// claim key, no fingerprint, the answer naming the id.
    fn callback(claim_key: &str, ttl_secs: u64) -> AcceptRequest {
        let ordering_key = "src/payzu/tx1";
        let id = MessageId::for_claim(NOW, ordering_key, Partitions::DEFAULT, claim_key);
        AcceptRequest {
            dedupe: DedupeClaim {
                key: claim_key.into(),
                ttl_secs,
                fingerprint: None,
                response: format!(r#"{{"messageId":"{id}"}}"#),
            },
            message: NewMessage {
                id,
                kind: MessageKind::Inbound,
                source: Some("payzu".into()),
                payment_id: None,
                transaction_id: Some("tx1".into()),
                ordering_key: ordering_key.into(),
                event: None,
                target_url: None,
                headers: Default::default(),
                body: "{}".into(),
                created_at: NOW,
                deadline: NOW + 1,
            },
            payment: None,
            seal: None,
        }
    }

    #[test]
    fn a_claim_is_compact_only_when_its_answer_is_rebuilt_from_it() {
        let compact = compact_claim(&callback("claim-a", 2_592_000), NOW).unwrap();
        assert_eq!(
            compact,
            format!("{NOW}43200"),
            "acceptance ms, 30 days in minutes"
        );
        assert_eq!(
            compact.parse::<i64>().unwrap().to_string(),
            compact,
            "canonical"
        );

        let mut fingerprinted = callback("claim-a", 2_592_000);
        fingerprinted.dedupe.fingerprint = Some("fp".into());
        let mut other_answer = callback("claim-a", 2_592_000);
        other_answer.dedupe.response.push(' ');
        let mut random_id = callback("claim-a", 2_592_000);
        random_id.message.id = MessageId::generate(NOW, "src/payzu/tx1", Partitions::DEFAULT);
        random_id.dedupe.response = format!(r#"{{"messageId":"{}"}}"#, random_id.message.id);
        for (why, req, now) in [
            ("a fingerprint", fingerprinted, NOW),
            ("another answer", other_answer, NOW),
            ("a random id", random_id, NOW),
            (
                "an id of another time",
                callback("claim-a", 2_592_000),
                NOW + 1,
            ),
            ("seconds", callback("claim-a", 2_592_030), NOW),
            ("over 69 days", callback("claim-a", 100_000 * 60), NOW),
        ] {
            assert_eq!(compact_claim(&req, now), None, "{why}");
        }
        assert_eq!(
            compact_claim(&callback("claim-a", 60), NOW),
            Some(format!("{NOW}00001"))
        );
    }

    #[test]
    fn stored_responses_come_back_byte_for_byte() {
        let id = crate::store::MessageId::parse("msg_019ad20f28c800d9e31f585ae352").unwrap();
        for response in [
            format!(r#"{{"messageId":"{id}"}}"#),
            format!(r#"{{"messageId": "{id}"}}"#),
            format!(r#"{{"messageId":"{id}","x":1}}"#),
            r#"{"messageId":"msg_nope"}"#.to_string(),
            "#not json".to_string(),
            String::new(),
        ] {
            let stored = stored_response(&response);
            assert_eq!(stored_response_text(&stored).unwrap(), response);
        }
        let stored = stored_response(&format!(r#"{{"messageId":"{id}"}}"#));
        assert_eq!(stored, format!("#{}", &id.as_str()[4..]));
        // end ms, `|`, no fingerprint, `\n`, the stored response: an embedded string
        assert!(13 + 1 + 1 + stored.len() <= 44, "{stored}");
    }

    #[test]
    fn the_lua_expiry_bucket_is_the_one_the_upgrade_uses() {
        assert!(include_str!("lua/expiry.lua").contains(&format!(
            "local EXPIRY_BUCKET_MS = {}\n",
            super::keys::EXPIRY_BUCKET_MS
        )));
    }
}
