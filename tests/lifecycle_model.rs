//! Both engines held to the lifecycle model (ARCHITECTURE.md, "The store seam and the
//! lifecycle"): random sequences of operations (accepts with repeated dedupe keys, seals and
//! payment transitions on a few shared ordering keys; claims, completions of every kind with
//! live and stale leases, releases, resends, sweeps; time jumping past leases, dedupe TTLs and
//! retentions) go to `store::lifecycle::Model` and to the engine, and after every step both
//! must agree: the step's answer, every message as `get` reads it, the depth, the oldest
//! unfinished message and every payment's status.
//!
//! The engines: SQLite, one Redis, and a Redis Cluster of 3 masters and 3 replicas.
//!
//! `PROPTEST_CASES` sets how many sequences each engine runs (64 by default). A failure
//! reports the shortest sequence proptest found that still fails.

#[path = "support/redis.rs"]
#[allow(dead_code)]
mod redis_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use callbackd::clock::Millis;
use callbackd::payment::{self, PaymentStatus};
use callbackd::store::ids::partition_of;
use callbackd::store::lifecycle::{self, Lifetimes, Model};
use callbackd::store::partitions::Partitions;
use callbackd::store::redis::RedisStore;
use callbackd::store::sqlite::SqliteStore;
use callbackd::store::{
    AcceptRequest, Completion, DedupeClaim, DeliveryAttempt, Lease, MessageId, MessageKind,
    MessageState, NewMessage, PaymentTransition, ResendMark, SignatureSeal, Store,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
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

#[derive(Debug, Clone)]
enum Op {
    Accept(Handoff),
    Claim {
        limit: usize,
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
    /// Payments in different Redis partitions. With all in one, a claim with a small limit
    /// takes the same messages on both engines; across partitions, Redis shares the limit
    /// among them (its choice, not a lifecycle rule), so claims ask for all that is due.
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

fn op(spread: bool) -> impl Strategy<Value = Op> {
    let limit = if spread {
        Just(100).boxed()
    } else {
        prop_oneof![1..=3usize, Just(100)].boxed()
    };
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
        4 => limit.prop_map(|limit| Op::Claim { limit }),
        5 => (pick_lease(), outcome()).prop_map(|(lease, outcome)| Op::Complete { lease, outcome }),
        1 => (pick_lease(), 0..60_000u64).prop_map(|(lease, after_ms)| Op::Release { lease, after_ms }),
        3 => (0..1000usize).prop_map(|message| Op::Resend { message }),
        1 => Just(Op::Sweep),
        3 => advance().prop_map(|ms| Op::Advance { ms }),
    ]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    any::<bool>().prop_flat_map(|spread| {
        prop::collection::vec(op(spread), 1..=MAX_OPS).prop_map(move |ops| Scenario { spread, ops })
    })
}

/// Payment ids whose ordering keys share one partition, or lie in different ones.
fn payment_ids(spread: bool) -> Vec<String> {
    let partition = |id: &String| partition_of(&payment::ordering_key(id), Partitions::DEFAULT);
    let mut ids: Vec<String> = Vec::new();
    for n in 0.. {
        let id = format!("p{n}");
        let fits = match ids.first() {
            None => true,
            Some(first) if !spread => partition(&id) == partition(first),
            Some(_) => ids.iter().all(|other| partition(other) != partition(&id)),
        };
        if fits {
            ids.push(id);
        }
        if ids.len() == PAYMENTS {
            return ids;
        }
    }
    unreachable!("the search above only ends by returning")
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
    store: &'a dyn Store,
    model: Model,
    now: Millis,
    payments: Vec<String>,
    /// Claims of one call are compared in order (one partition) or as sets.
    ordered_claims: bool,
    /// Every id made so far, recorded or not.
    ids: Vec<MessageId>,
    /// Every lease handed out so far.
    leases: Vec<Lease>,
}

impl Run<'_> {
    async fn step(&mut self, op: &Op) -> Result<(), String> {
        // Time always moves on, so ids (which carry it) sort in the order they were made.
        self.now += 1;
        let now = self.now;
        let err = |e: callbackd::store::StoreError| e.to_string();
        match op {
            Op::Accept(handoff) => {
                let req = self.request(handoff);
                self.ids.push(req.message.id.clone());
                let want = lifecycle::accept(&mut self.model, &req, now);
                let got = self.store.accept(req, now).await.map_err(err)?;
                same("accept", got, want)?;
            }
            Op::Claim { limit } => {
                let mut want = lifecycle::claim(&mut self.model, now, *limit, LEASE_MS);
                let mut got = self
                    .store
                    .claim_due(now, *limit, LEASE_MS)
                    .await
                    .map_err(err)?;
                if !self.ordered_claims {
                    want.sort_by(|a, b| a.message.id.cmp(&b.message.id));
                    got.sort_by(|a, b| a.message.id.cmp(&b.message.id));
                }
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
                let want =
                    lifecycle::complete(&mut self.model, &lease, attempt.clone(), completion, now);
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
                let want = lifecycle::release(&mut self.model, &lease, next_at);
                let got = self.store.release(&lease, next_at).await.map_err(err)?;
                same("release", got, want)?;
            }
            Op::Resend { message } => {
                if self.ids.is_empty() {
                    return Ok(());
                }
                let id = self.ids[message % self.ids.len()].clone();
                let fresh = now + 7 * DAY;
                let want = lifecycle::resend(&mut self.model, &id, resend_mark(now), fresh, now);
                let got = self
                    .store
                    .resend(&id, resend_mark(now), fresh, now)
                    .await
                    .map_err(err)?;
                same("resend", got, want)?;
            }
            Op::Sweep => {
                // Engines count what went in their own units (keys, rows): not compared.
                lifecycle::sweep(&mut self.model, now);
                self.store.sweep(now).await.map_err(err)?;
            }
            Op::Advance { ms } => self.now += ms,
        }
        self.compare().await
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
            payment_id: Some(payment_id.clone()),
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
                fingerprint: if other_body { "fp-b" } else { "fp-a" }.into(),
                response: format!(r#"{{"messageId":"{id}"}}"#),
            },
            message,
            payment: transition.map(|to| PaymentTransition {
                payment_id: payment_id.clone(),
                to: to.as_str().into(),
                allowed_from: payment::allowed_from(to)
                    .into_iter()
                    .map(|s| s.as_str().into())
                    .collect(),
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

async fn check(store: &dyn Store, scenario: &Scenario) -> Result<(), String> {
    let mut run = Run {
        store,
        model: Model::new(LIFETIMES),
        now: T0,
        payments: payment_ids(scenario.spread),
        ordered_claims: !scenario.spread,
        ids: Vec::new(),
        leases: Vec::new(),
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
    let claim = Claim { limit: 100 };
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
            Claim { limit: 1 },
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
    /// One private server for all the sequences, emptied before each.
    Redis(RedisServer),
    /// One private cluster of 3 masters and 3 replicas for all the sequences, each under a key
    /// prefix of its own.
    Cluster(RedisCluster),
}

impl Engine {
    fn name(&self) -> &'static str {
        match self {
            Engine::Sqlite => "SQLite",
            Engine::Redis(_) => "Redis",
            Engine::Cluster(_) => "Redis Cluster",
        }
    }
}

/// A fresh store for one sequence, and the directory that keeps a SQLite file alive.
async fn open(engine: &Engine) -> (Box<dyn Store>, Option<tempfile::TempDir>) {
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
        Engine::Cluster(cluster) => {
            let (store, _prefix) = cluster.store_of_its_own(RETENTION_SECS, T0).await;
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
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let config = Config {
        cases,
        failure_persistence: None,
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
            if let Err(e) = check(&*store, &scenario).await {
                panic!("{name} disagrees with the lifecycle model: {e}\nin {scenario:#?}");
            }
        }
    });
    let result = TestRunner::new(config).run(&scenario(), |scenario| {
        runtime.block_on(async {
            let (store, _dir) = open(&engine).await;
            check(&*store, &scenario).await.map_err(TestCaseError::fail)
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
fn cluster_agrees_with_the_model() {
    agrees_with_the_model(Engine::Cluster(RedisCluster::start()));
}
