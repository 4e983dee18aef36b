//! Both engines held to the lifecycle model (ARCHITECTURE.md, "The store seam and the
//! lifecycle"): random sequences of operations (connectors' hand-offs with repeated dedupe
//! keys, seals and payment transitions, and providers' callbacks as `inbound::accept` makes
//! them, with ids derived from their claim keys and, on Redis, compact integer claims, on a
//! few shared ordering keys; claims with small and large limits, completions of every kind
//! with live and stale leases, releases, resends, sweeps; time jumping past leases, dedupe
//! TTLs and retentions, and onto the very millisecond a claim or seal ends) go to
//! `store::lifecycle::Model` and to the engine, and after every step both must agree: the
//! step's answer, every message as `get` reads it, the depth, the oldest unfinished message
//! and every payment's status.
//!
//! The engines: SQLite, one Redis (its leases timed by the caller's clock, so that time jumps
//! run leases out, and by its own `TIME` as in production, with leases that end as they
//! start), a Redis Cluster of 3 masters and 3 replicas, and PostgreSQL (a database per
//! sequence on one private server). The rules are the model's own
//! (`store::lifecycle`): what this holds the engines to is that each applies their decisions
//! faithfully.
//!
//! `PROPTEST_CASES` sets how many sequences each engine runs (64 by default). A failure
//! reports the shortest sequence proptest found that still fails, and its seed is kept in
//! `lifecycle_model.proptest-regressions` beside this file (commit it): every run replays the
//! seeds kept there first, on every engine.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
#[path = "support/redis.rs"]
#[allow(dead_code)]
mod redis_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use callbackd::clock::Millis;
use callbackd::inbound::accept::{self as inbound, Callback};
use callbackd::inbound::dedupe::DEFAULT_FIELDS;
use callbackd::payment::{self, PaymentStatus};
use callbackd::store::ids::partition_of;
use callbackd::store::lifecycle::{Lifetimes, Model};
use callbackd::store::partitions::Partitions;
use callbackd::store::postgres::PostgresStore;
use callbackd::store::redis::RedisStore;
use callbackd::store::sqlite::SqliteStore;
use callbackd::store::{
    AcceptRequest, Completion, DedupeClaim, DeliveryAttempt, Inspectable, Lease, MessageId,
    MessageKind, MessageState, NewMessage, PaymentTransition, ResendMark, SignatureSeal,
};
use postgres_support::PostgresServer;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};
use redis_support::RedisServer;
use redis_support::cluster::RedisCluster;

/// 2025-11-30T00:00:00Z: ids encode creation time, so times must be realistic.
const T0: Millis = 1_764_460_800_000;
const DAY: Millis = 86_400_000;
/// The defaults: dedupe claims and finished messages live 30 days, payment states 400.
const RETENTION_SECS: u64 = 2_592_000;
const LIFETIMES: Lifetimes = Lifetimes {
    retention_ms: 30 * DAY,
    payment_retention_ms: 400 * DAY,
};
const LEASE_MS: u64 = 30_000;
/// Payments, hence ordering keys, a sequence shares: few, so their queues grow.
const PAYMENTS: usize = 3;
/// Provider transactions (ordering keys `src/payzu/<id>`) a sequence shares.
const TRANSACTIONS: usize = 2;
/// A callback's dedupe key takes its status: the same one again is a replay, another is a new
/// event of the transaction.
const STATUSES: [&str; 3] = ["PAID", "COMPLETED", "REFUNDED"];
/// Dedupe TTLs of callbacks: whole minutes make compact claims on Redis (one of an hour, one
/// of the 30-day default), seconds keep the string form.
const CALLBACK_TTLS: [u64; 4] = [60, 3_600, 90, RETENTION_SECS];
const MAX_OPS: usize = 40;

#[derive(Debug, Clone, Copy)]
enum Outcome {
    Delivered,
    Retry { after_ms: u64 },
    Dead,
}

/// A hand-off for payment number `payment` under its dedupe key number `dedupe`.
#[derive(Debug, Clone)]
struct Handoff {
    payment: usize,
    dedupe: usize,
    /// Another request body under the same key: a conflict while the claim lives.
    other_body: bool,
    /// With a target (`pending`) or without (`recorded`).
    deliverable: bool,
    /// A signature seal (its number, and minutes it stays valid).
    seal: Option<(usize, i64)>,
    transition: Option<PaymentStatus>,
}

impl Handoff {
    fn deliverable(payment: usize) -> Handoff {
        Handoff {
            payment,
            dedupe: 0,
            other_body: false,
            deliverable: true,
            seal: None,
            transition: None,
        }
    }
}

/// A provider's callback of transaction number `transaction` with status number `status`.
#[derive(Debug, Clone)]
struct ProviderCallback {
    transaction: usize,
    status: usize,
    /// With a `forward_url` (`pending`) or without (`recorded`).
    forward: bool,
    ttl_secs: u64,
    /// A verified signature (its number, and seconds it stays valid): sealed.
    signature: Option<(u8, i64)>,
}

#[derive(Debug, Clone)]
enum Op {
    Accept(Handoff),
    Callback(ProviderCallback),
    Claim {
        limit: usize,
        /// A lease of 1 ms: any later claim finds it run out (time moves on by at least that
        /// between steps), while the second call of a claim split in two does not.
        short_lease: bool,
    },
    /// Completes one of the leases taken so far.
    Complete {
        lease: PickLease,
        outcome: Outcome,
    },
    Release {
        lease: PickLease,
        after_ms: u64,
    },
    /// Resends one of the ids made so far (some were replays, never recorded), by its
    /// number modulo how many there are.
    Resend {
        message: usize,
    },
    Sweep,
    Advance {
        ms: Millis,
    },
    /// Jumps to `offset` ms from the end of one of the dedupe claims or seals written so far
    /// (by its number modulo how many there are), unless that is past, and repeats the accept
    /// that wrote it there: a retry in its claim's (or seal's) last millisecond, or the first
    /// one after it.
    RepeatAtEnd {
        end: usize,
        offset: Millis,
    },
}

/// Which lease a completion or release uses: one that still holds its message (when there
/// is one), or any taken so far, most of which are stale by then; by its number modulo how
/// many there are.
#[derive(Debug, Clone)]
struct PickLease {
    live: bool,
    index: usize,
}

#[derive(Debug, Clone)]
struct Scenario {
    /// Ordering keys in different Redis partitions. With all in one, a claim with a small
    /// limit takes the same messages on both engines; across partitions, Redis shares the
    /// limit among them, so which messages it takes is its choice (not a lifecycle rule), and
    /// how many is compared.
    spread: bool,
    ops: Vec<Op>,
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        Just(Outcome::Delivered),
        prop_oneof![0..5_000u64, 0..120_000u64].prop_map(|after_ms| Outcome::Retry { after_ms }),
        Just(Outcome::Dead),
    ]
}

fn pick_lease() -> impl Strategy<Value = PickLease> {
    (prop::bool::weighted(0.8), 0..1000usize).prop_map(|(live, index)| PickLease { live, index })
}

fn advance() -> impl Strategy<Value = Millis> {
    prop_oneof![
        6 => 0..2_000 as Millis,
        3 => 0..2 * LEASE_MS as Millis,
        1 => 0..2 * DAY,
        1 => 29 * DAY..31 * DAY,
        1 => Just(400 * DAY),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let limit = prop_oneof![1..=3usize, Just(100)];
    let callback = (
        0..TRANSACTIONS,
        0..STATUSES.len(),
        prop::bool::weighted(0.7),
        prop::sample::select(CALLBACK_TTLS.to_vec()),
        prop::option::weighted(0.3, (0..2u8, 1..600 as Millis)),
    )
        .prop_map(|(transaction, status, forward, ttl_secs, signature)| {
            Op::Callback(ProviderCallback {
                transaction,
                status,
                forward,
                ttl_secs,
                signature,
            })
        });
    let transitions = PaymentStatus::ALL[1..].to_vec();
    let accept = (
        0..PAYMENTS,
        0..3usize,
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.85),
        prop::option::weighted(0.3, (0..2usize, 10..120 as Millis)),
        prop::option::weighted(0.3, prop::sample::select(transitions)),
    )
        .prop_map(
            |(payment, dedupe, other_body, deliverable, seal, transition)| {
                Op::Accept(Handoff {
                    payment,
                    dedupe,
                    other_body,
                    deliverable,
                    seal,
                    transition,
                })
            },
        );
    prop_oneof![
        3 => accept,
        3 => callback,
        4 => (limit, prop::bool::weighted(0.2))
            .prop_map(|(limit, short_lease)| Op::Claim { limit, short_lease }),
        5 => (pick_lease(), outcome()).prop_map(|(lease, outcome)| Op::Complete { lease, outcome }),
        1 => (pick_lease(), 0..60_000u64).prop_map(|(lease, after_ms)| Op::Release { lease, after_ms }),
        3 => (0..1000usize).prop_map(|message| Op::Resend { message }),
        1 => Just(Op::Sweep),
        3 => advance().prop_map(|ms| Op::Advance { ms }),
        2 => (0..1000usize, -1..=0 as Millis)
            .prop_map(|(end, offset)| Op::RepeatAtEnd { end, offset }),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (any::<bool>(), prop::collection::vec(op(), 1..=MAX_OPS))
        .prop_map(|(spread, ops)| Scenario { spread, ops })
}

/// The ordering keys of a sequence: payment ids and provider transaction ids whose ordering
/// keys share one partition, or lie in different ones.
fn ordering_keys(spread: bool) -> (Vec<String>, Vec<String>) {
    let partition = |key: &String| partition_of(key, Partitions::DEFAULT);
    let mut keys: Vec<String> = Vec::new();
    let mut pick = |candidates: &mut dyn Iterator<Item = (String, String)>, n: usize| {
        let mut ids = Vec::new();
        for (id, key) in candidates {
            let fits = match keys.first() {
                None => true,
                Some(first) if !spread => partition(&key) == partition(first),
                Some(_) => keys.iter().all(|other| partition(other) != partition(&key)),
            };
            if fits {
                keys.push(key);
                ids.push(id);
            }
            if ids.len() == n {
                return ids;
            }
        }
        unreachable!("the candidates never run out")
    };
    let payments = pick(
        &mut (0..).map(|n| format!("p{n}")).map(|id| {
            let key = payment::ordering_key(&id);
            (id, key)
        }),
        PAYMENTS,
    );
    let transactions = pick(
        &mut (0..).map(|n| format!("tx{n}")).map(|id| {
            let key = inbound::ordering_key("payzu", &id);
            (id, key)
        }),
        TRANSACTIONS,
    );
    (payments, transactions)
}

fn delivery(attempt: u32, at: Millis, status: u16) -> DeliveryAttempt {
    DeliveryAttempt {
        attempt,
        at,
        status: Some(status),
        error: None,
        latency_ms: Some(7),
        response: None,
    }
}

fn resend_mark(at: Millis) -> ResendMark {
    ResendMark {
        at,
        request_id: Some(format!("op-{at}")),
    }
}

fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "{what}: the engine says\n  {got:?}\nthe model\n  {want:?}"
        ))
    }
}

/// One sequence on one engine, next to the model.
struct Run<'a> {
    store: &'a dyn Inspectable,
    model: Model,
    now: Millis,
    payments: Vec<String>,
    transactions: Vec<String>,
    /// Claims of one call are compared in order (one partition), or by count and then as
    /// sets.
    ordered_claims: bool,
    /// Where every dedupe claim and seal written so far ends, and the accept that wrote it.
    ends: Vec<(Millis, Op)>,
    /// Every id made so far, recorded or not.
    ids: Vec<MessageId>,
    /// Every lease handed out so far.
    leases: Vec<Lease>,
    /// Leases timed by the store's clock (Redis' `TIME`, as in production): the model's lease
    /// clock, moved on by each claim. `None`: leases are timed by the caller's `now`.
    store_clock: Option<Millis>,
}

impl Run<'_> {
    async fn step(&mut self, op: &Op) -> Result<(), String> {
        // Time always moves on, so ids (which carry it) sort in the order they were made.
        self.now += 1;
        let now = self.now;
        let err = |e: callbackd::store::StoreError| e.to_string();
        match op {
            Op::Accept(_) | Op::Callback(_) => self.accept(op).await?,
            Op::Claim { limit, short_lease } if self.ordered_claims => {
                let (lease_now, lease_ms) = self.lease_clock(*short_lease).await;
                let want = self.model.claim(now, lease_now, *limit, lease_ms);
                let got = self
                    .store
                    .claim_due(now, *limit, lease_ms)
                    .await
                    .map_err(err)?;
                same("claim_due", &got, &want)?;
                self.leases.extend(got);
            }
            Op::Claim { limit, short_lease } => {
                // Across partitions the engine chooses which due messages a small limit takes,
                // never how many. A second claim at the same moment takes the rest, so that
                // together they hold the leases the model hands out for everything due.
                let (lease_now, lease_ms) = self.lease_clock(*short_lease).await;
                let mut want = self.model.claim(now, lease_now, MAX_OPS, lease_ms);
                let mut got = self
                    .store
                    .claim_due(now, *limit, lease_ms)
                    .await
                    .map_err(err)?;
                same("claim_due count", got.len(), want.len().min(*limit))?;
                let rest = self
                    .store
                    .claim_due(now, MAX_OPS, lease_ms)
                    .await
                    .map_err(err)?;
                got.extend(rest);
                want.sort_by(|a, b| a.message.id.cmp(&b.message.id));
                got.sort_by(|a, b| a.message.id.cmp(&b.message.id));
                same("claim_due", &got, &want)?;
                self.leases.extend(got);
            }
            Op::Complete { lease, outcome } => {
                let Some(lease) = self.pick_lease(lease) else {
                    return Ok(());
                };
                let (completion, status) = match *outcome {
                    Outcome::Delivered => (Completion::Delivered, 204),
                    Outcome::Retry { after_ms } => (
                        Completion::Retry {
                            next_at: now + after_ms as Millis,
                        },
                        503,
                    ),
                    Outcome::Dead => (Completion::Dead, 410),
                };
                let attempt = delivery(lease.attempts + 1, now, status);
                let want = self
                    .model
                    .complete(&lease, attempt.clone(), completion, now);
                let got = self
                    .store
                    .complete(&lease, attempt, completion, now)
                    .await
                    .map_err(err)?;
                same("complete", got, want)?;
            }
            Op::Release { lease, after_ms } => {
                let Some(lease) = self.pick_lease(lease) else {
                    return Ok(());
                };
                let next_at = now + *after_ms as Millis;
                let want = self.model.release(&lease, next_at);
                let got = self.store.release(&lease, next_at).await.map_err(err)?;
                same("release", got, want)?;
            }
            Op::Resend { message } => {
                if self.ids.is_empty() {
                    return Ok(());
                }
                let id = self.ids[message % self.ids.len()].clone();
                let fresh = now + 7 * DAY;
                let want = self.model.resend(&id, resend_mark(now), fresh, now);
                let got = self
                    .store
                    .resend(&id, resend_mark(now), fresh, now)
                    .await
                    .map_err(err)?;
                same("resend", got, want)?;
            }
            Op::Sweep => {
                // Engines count what went in their own units (keys, rows): not compared.
                self.model.sweep(now);
                self.store.sweep(now).await.map_err(err)?;
            }
            Op::Advance { ms } => self.now += ms,
            Op::RepeatAtEnd { end, offset } => {
                if !self.ends.is_empty() {
                    let (at, accept) = self.ends[end % self.ends.len()].clone();
                    self.now = self.now.max(at + offset);
                    self.accept(&accept).await?;
                }
            }
        }
        self.compare().await
    }

    /// The lease clock of a claim now and its lease's length. On the store's clock, the
    /// model's moves on by 1 ms per claim and the test waits 2 ms, so that Redis' `TIME`
    /// orders the claims as the model does (leases that ran out are taken earliest first),
    /// and a short lease has always run out by the next claim, on both; a full lease never
    /// runs out within a sequence.
    async fn lease_clock(&mut self, short_lease: bool) -> (Millis, u64) {
        let lease_ms = if short_lease { 1 } else { LEASE_MS };
        match &mut self.store_clock {
            Some(clock) => {
                *clock += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
                (*clock, lease_ms)
            }
            None => (self.now, lease_ms),
        }
    }

    /// Accepts a hand-off or a callback at the current time.
    async fn accept(&mut self, op: &Op) -> Result<(), String> {
        let now = self.now;
        let req = match op {
            Op::Accept(handoff) => self.request(handoff),
            Op::Callback(callback) => self.callback(callback),
            other => unreachable!("not an accept: {other:?}"),
        };
        self.ids.push(req.message.id.clone());
        let claim_ends = now + req.dedupe.ttl_secs as Millis * 1_000;
        self.ends.push((claim_ends, op.clone()));
        if let Some(seal) = &req.seal {
            self.ends.push((seal.expires_at, op.clone()));
        }
        let want = self.model.accept(&req, now);
        let got = self
            .store
            .accept(req, now)
            .await
            .map_err(|e| e.to_string())?;
        same("accept", got, want)
    }

    /// The accept request of a provider callback, made by the code that makes it for
    /// `POST /v1/callbacks/payzu`.
    fn callback(&self, callback: &ProviderCallback) -> AcceptRequest {
        let ProviderCallback {
            transaction,
            status,
            forward,
            ttl_secs,
            signature,
        } = *callback;
        let now = self.now;
        let fields: Vec<String> = DEFAULT_FIELDS.iter().map(|f| f.to_string()).collect();
        let settings = inbound::Settings {
            name: "payzu",
            dedupe_fields: &fields,
            forward_url: forward.then_some("http://127.0.0.1:9/payzu"),
            window: Duration::from_secs(7 * 86_400),
            dedupe_ttl: Duration::from_secs(ttl_secs),
            partitions: Partitions::DEFAULT,
        };
        let json = serde_json::json!({
            "id": self.transactions[transaction],
            "status": STATUSES[status],
            "at": now,
        });
        let body = json.to_string();
        let verified = signature.map(|(n, secs)| callbackd::webhook::Verified {
            // An HMAC of the body: one signature never signs two transactions.
            signature: vec![transaction as u8, n],
            valid_until_secs: Some(now / 1_000 + secs),
        });
        inbound::accept_request(
            &settings,
            Callback {
                body: body.as_bytes(),
                json: &json,
                event: None,
                verified,
                headers: BTreeMap::new(),
            },
            now,
        )
        .expect("a callback with an id and a status")
    }

    fn pick_lease(&self, pick: &PickLease) -> Option<Lease> {
        let holding: Vec<&Lease> = self
            .leases
            .iter()
            .filter(|l| {
                self.model
                    .message(&l.message.id)
                    .is_some_and(|m| m.state == MessageState::InFlight && m.token == l.token)
            })
            .collect();
        if pick.live && !holding.is_empty() {
            return Some(holding[pick.index % holding.len()].clone());
        }
        (!self.leases.is_empty()).then(|| self.leases[pick.index % self.leases.len()].clone())
    }

    fn request(&self, handoff: &Handoff) -> AcceptRequest {
        let Handoff {
            payment,
            dedupe,
            other_body,
            deliverable,
            seal,
            transition,
        } = *handoff;
        let now = self.now;
        let payment_id = &self.payments[payment];
        let ordering_key = payment::ordering_key(payment_id);
        let id = MessageId::generate(now, &ordering_key, Partitions::DEFAULT);
        let message = NewMessage {
            id: id.clone(),
            kind: MessageKind::Notification,
            source: None,
            payment_id: Some(payment_id.clone().into()),
            transaction_id: None,
            ordering_key: ordering_key.clone(),
            event: None,
            target_url: deliverable.then(|| "http://127.0.0.1:9/hook".to_string()),
            headers: BTreeMap::new(),
            body: format!(r#"{{"paymentId":"{payment_id}","at":{now}}}"#),
            created_at: now,
            deadline: now + 7 * DAY,
        };
        // Dedupe keys, seals and payments belong to one ordering key, as the HTTP layer makes
        // them (Redis keeps them in its partition).
        AcceptRequest {
            dedupe: DedupeClaim {
                key: format!("{ordering_key}/d{dedupe}"),
                ttl_secs: RETENTION_SECS,
                fingerprint: Some(if other_body { "fp-b" } else { "fp-a" }.into()),
                response: format!(r#"{{"messageId":"{id}"}}"#),
            },
            message,
            payment: transition.map(|to| PaymentTransition {
                payment_id: payment_id.clone().into(),
                to,
                allowed_from: payment::allowed_from(to),
            }),
            seal: seal.map(|(n, minutes)| SignatureSeal {
                key: format!("{ordering_key}/s{n}"),
                expires_at: now + minutes * 60_000,
            }),
        }
    }

    /// Everything readable agrees. A finished message past its retention counts as gone, but
    /// reads may find it until a sweep deletes it (docs/storage.md, "Retention").
    async fn compare(&self) -> Result<(), String> {
        let err = |e: callbackd::store::StoreError| e.to_string();
        let got = futures::future::try_join_all(self.ids.iter().map(|id| self.store.get(id)))
            .await
            .map_err(err)?;
        for (id, got) in self.ids.iter().zip(got) {
            let model = self.model.message(id);
            let want = model.map(|m| m.record());
            let lingering = model.is_some_and(|m| m.ended(self.now)) && got.is_none();
            if !lingering {
                same(&format!("get {id}"), got, want)?;
            }
        }
        let depth = self.store.depth().await.map_err(err)?;
        let want = self.model.depth();
        let ended_dead = self
            .model
            .messages()
            .filter(|m| m.ended(self.now) && m.state == MessageState::Dead)
            .count() as u64;
        let dead_ok = (want.dead - ended_dead..=want.dead).contains(&depth.dead);
        if !dead_ok || (depth.pending, depth.in_flight) != (want.pending, want.in_flight) {
            return Err(format!(
                "depth: the engine says {depth:?}, the model {want:?} ({ended_dead} dead ended)"
            ));
        }
        same(
            "oldest_unfinished",
            self.store.oldest_unfinished().await.map_err(err)?,
            self.model.oldest_unfinished(),
        )?;
        for payment_id in &self.payments {
            same(
                &format!("payment_status {payment_id}"),
                self.store
                    .payment_status(payment_id, self.now)
                    .await
                    .map_err(err)?,
                self.model.payment_status(payment_id, self.now),
            )?;
        }
        Ok(())
    }
}

async fn check(
    store: &dyn Inspectable,
    scenario: &Scenario,
    store_clock: bool,
) -> Result<(), String> {
    // On the store's clock, a claim split in two calls could find the first call's short
    // leases run out: one partition, one call.
    let spread = scenario.spread && !store_clock;
    let (payments, transactions) = ordering_keys(spread);
    let mut run = Run {
        store,
        model: Model::new(LIFETIMES),
        now: T0,
        payments,
        transactions,
        ordered_claims: !spread,
        ends: Vec::new(),
        ids: Vec::new(),
        leases: Vec::new(),
        store_clock: store_clock.then_some(0),
    };
    for (n, op) in scenario.ops.iter().enumerate() {
        run.step(op)
            .await
            .map_err(|e| format!("step {n}, {op:?}, at T0 + {} ms: {e}", run.now - T0))?;
    }
    Ok(())
}

fn deliverable(payment: usize) -> Op {
    Op::Accept(Handoff::deliverable(payment))
}

/// A deliverable hand-off of payment 0 under dedupe key `dedupe`, sealed with signature
/// `seal` for an hour.
fn sealed(dedupe: usize, seal: usize) -> Op {
    Op::Accept(Handoff {
        dedupe,
        seal: Some((seal, 60)),
        ..Handoff::deliverable(0)
    })
}

fn live(outcome: Outcome) -> Op {
    Op::Complete {
        lease: PickLease {
            live: true,
            index: 0,
        },
        outcome,
    }
}

/// Paths too long to count on chance, run on every engine before the random sequences.
fn known_sequences() -> Vec<Scenario> {
    use Op::*;
    let claim = Claim {
        limit: 100,
        short_lease: false,
    };
    let release = |after_ms| Release {
        lease: PickLease {
            live: true,
            index: 0,
        },
        after_ms,
    };
    let resend = Resend { message: 0 };
    let one_partition = |ops| Scenario { spread: false, ops };
    vec![
        // An expedited attempt given back and expedited again still resumes the schedule
        // first brought forward.
        one_partition(vec![
            deliverable(0),
            claim.clone(),
            live(Outcome::Retry { after_ms: 100_000 }),
            resend.clone(),
            claim.clone(),
            release(50_000),
            resend.clone(),
            claim.clone(),
            live(Outcome::Retry { after_ms: 1_000 }),
        ]),
        // A lease that ran out is finished by its worker before anyone claims it again.
        one_partition(vec![
            deliverable(0),
            claim.clone(),
            deliverable(1),
            Advance {
                ms: LEASE_MS as Millis,
            },
            Claim {
                limit: 1,
                short_lease: false,
            },
            Complete {
                lease: PickLease {
                    live: false,
                    index: 0,
                },
                outcome: Outcome::Delivered,
            },
            claim.clone(),
        ]),
        // A resend during an attempt that ends the message; a requeue behind a pending one.
        one_partition(vec![
            deliverable(0),
            claim.clone(),
            resend.clone(),
            live(Outcome::Dead),
            claim.clone(),
            live(Outcome::Delivered),
            deliverable(0),
            resend.clone(),
            claim.clone(),
            live(Outcome::Delivered),
            claim.clone(),
        ]),
        // A replay seals its new signature to the first answer; the signature under another
        // dedupe key is refused; a seal ends when its signature could no longer verify.
        one_partition(vec![
            sealed(0, 0),
            sealed(0, 1),
            sealed(1, 1),
            Advance { ms: 61 * 60_000 },
            sealed(2, 1),
        ]),
        // A finished message past its retention, resent before and after a sweep.
        one_partition(vec![
            deliverable(0),
            claim.clone(),
            live(Outcome::Delivered),
            Advance { ms: 31 * DAY },
            resend.clone(),
            Sweep,
            resend,
        ]),
    ]
}

enum Engine {
    Sqlite,
    /// One private server for all the sequences, emptied before each, its leases timed by
    /// the caller's clock.
    Redis(RedisServer),
    /// The same, its leases timed by Redis' `TIME`, as in production.
    RedisClock(RedisServer),
    /// One private cluster of 3 masters and 3 replicas for all the sequences, each under a key
    /// prefix of its own.
    Cluster(RedisCluster),
    /// One private PostgreSQL for all the sequences, a database of its own for each, leases
    /// timed by the caller's clock.
    Postgres(&'static PostgresServer),
}

impl Engine {
    fn name(&self) -> &'static str {
        match self {
            Engine::Sqlite => "SQLite",
            Engine::Redis(_) => "Redis",
            Engine::RedisClock(_) => "Redis on its own clock",
            Engine::Cluster(_) => "Redis Cluster",
            Engine::Postgres(_) => "PostgreSQL",
        }
    }
}

/// A fresh store for one sequence, and the directory that keeps a SQLite file alive.
async fn open(engine: &Engine) -> (Box<dyn Inspectable>, Option<tempfile::TempDir>) {
    match engine {
        Engine::Redis(server) => {
            server.cli(&["FLUSHALL"]);
            let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
                .await
                .expect("connect to the private redis-server")
                .with_caller_clock_leases();
            store.upgrade(T0).await.expect("stamp the layout version");
            (Box::new(store), None)
        }
        Engine::RedisClock(server) => {
            server.cli(&["FLUSHALL"]);
            let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
                .await
                .expect("connect to the private redis-server");
            store.upgrade(T0).await.expect("stamp the layout version");
            (Box::new(store), None)
        }
        Engine::Cluster(cluster) => {
            let (store, _prefix) = cluster.store_of_its_own(RETENTION_SECS, T0).await;
            (Box::new(store), None)
        }
        Engine::Postgres(server) => {
            let url = server.fresh_database();
            let mut store = PostgresStore::connect(&url, Duration::from_secs(5), RETENTION_SECS)
                .await
                .expect("connect to the private PostgreSQL")
                .with_caller_clock_leases();
            store.migrate().await.expect("create the layout");
            (Box::new(store), None)
        }
        Engine::Sqlite => {
            let dir = tempfile::tempdir().expect("temp dir");
            let store = SqliteStore::open(&dir.path().join("cb.db"), RETENTION_SECS)
                .expect("open a fresh SQLite store");
            (Box::new(store), Some(dir))
        }
    }
}

fn agrees_with_the_model(engine: Engine) {
    let name = engine.name();
    let store_clock = matches!(engine, Engine::RedisClock(_));
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let config = Config {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/lifecycle_model.proptest-regressions"
        )))),
        max_shrink_iters: 512,
        ..Config::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let started = Instant::now();
    runtime.block_on(async {
        for scenario in known_sequences() {
            let (store, _dir) = open(&engine).await;
            if let Err(e) = check(&*store, &scenario, store_clock).await {
                panic!("{name} disagrees with the lifecycle model: {e}\nin {scenario:#?}");
            }
        }
    });
    let result = TestRunner::new(config).run(&scenario(), |scenario| {
        runtime.block_on(async {
            let (store, _dir) = open(&engine).await;
            check(&*store, &scenario, store_clock)
                .await
                .map_err(TestCaseError::fail)
        })
    });
    eprintln!(
        "{name}: {cases} sequences of up to {MAX_OPS} operations in {:.1?}",
        started.elapsed()
    );
    if let Err(e) = result {
        panic!("{name} disagrees with the lifecycle model: {e}");
    }
}

#[test]
fn sqlite_agrees_with_the_model() {
    agrees_with_the_model(Engine::Sqlite);
}

#[test]
fn redis_agrees_with_the_model() {
    agrees_with_the_model(Engine::Redis(RedisServer::start()));
}

#[test]
fn redis_on_its_own_clock_agrees_with_the_model() {
    agrees_with_the_model(Engine::RedisClock(RedisServer::start()));
}

#[test]
fn postgres_agrees_with_the_model() {
    agrees_with_the_model(Engine::Postgres(PostgresServer::shared()));
}

#[test]
fn cluster_agrees_with_the_model() {
    agrees_with_the_model(Engine::Cluster(RedisCluster::start()));
}
