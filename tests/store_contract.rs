//! The Store contract (ARCHITECTURE.md, "The store seam"): the same tests against every backend.
//!
//! `contract!` turns each `async fn(&Harness)` below into one test per backend, in the modules
//! `redis` (a private `redis-server` per test), `redis_with_replica` (the same with a replica
//! acknowledging every write), `cluster` (a Redis Cluster of 3 masters and 3 replicas shared
//! by the tests of this binary, each test under its own key prefix, every write acknowledged
//! by a replica), `sqlite` (a temp file per test) and `postgres` (a database per test on one
//! private PostgreSQL shared by the tests of this binary). Time is
//! virtual: every call gets its `now`, starting at `T0`. Tests only one backend can run are in
//! `redis_only` and `sqlite_only`.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
#[path = "support/redis.rs"]
#[allow(dead_code)]
mod redis_support;

use callbackd::clock::Millis;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use callbackd::payment::{self, PaymentStatus};
use callbackd::store::counts;
use callbackd::store::ids::partition_of;
use callbackd::store::partitions::Partitions;
use callbackd::store::postgres::PostgresStore;
use callbackd::store::recoveries::{self, InboundCount, Recovery, RecoveryWindow, WindowState};
use callbackd::store::redis::RedisStore;
use callbackd::store::sqlite::{SqliteOptions, SqliteStore};
use callbackd::store::{
    AcceptOutcome, AcceptRequest, Completion, DedupeClaim, DeliveryAttempt, HistoryEntry,
    Inspectable, Lease, ListFilter, MessageId, MessageKind, MessageRecord, MessageState,
    MinuteCount, NewMessage, OperationReservation, PaymentTransition, QueueDepth, ReceiverAnswer,
    ResendEffect, ResendMark, SignatureSeal, Store, StoreError,
};
use postgres_support::PostgresServer;
use redis_support::RedisServer;
use redis_support::cluster::RedisCluster;

/// 2025-11-30T00:00:00Z: ids encode creation time, so times must be realistic.
const T0: Millis = 1_764_460_800_000;
const TTL_SECS: u64 = 2_592_000;
const RETENTION_SECS: u64 = 2_592_000;
const LEASE_MS: u64 = 30_000;
const DAY_MS: Millis = 86_400_000;

enum Backend {
    Redis(RedisServer),
    /// A master and its replica, every write waiting for the replica (`min_replicas_acked`).
    RedisWithReplica {
        master: RedisServer,
        _replica: RedisServer,
    },
    /// The shared cluster; the test's keys are those under `prefix`.
    Cluster {
        prefix: String,
    },
    /// A database of its own on the binary's shared PostgreSQL.
    Postgres {
        db: String,
    },
    /// The directory is kept only so that it outlives the store.
    Sqlite {
        store: std::sync::Arc<SqliteStore>,
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
    },
}

/// A store and what keeps it alive. `store` is declared first so it is dropped before the
/// server or directory behind it.
struct Harness {
    store: std::sync::Arc<dyn Inspectable>,
    backend: Backend,
}

impl Harness {
    async fn redis() -> Harness {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .expect("connect to the private redis-server")
            .with_caller_clock_leases();
        store.upgrade(T0).await.expect("stamp the layout version");
        Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Redis(server),
        }
    }

    /// The engine as `store.min_replicas_acked = 1` runs it: every reply decoded through the
    /// round trip that carries `WAIT`.
    async fn redis_with_replica() -> Harness {
        // No 5 s wait for more replicas before the first sync (Redis 7's diskless default).
        let master = RedisServer::start_with_args("always", &["--repl-diskless-sync-delay", "0"]);
        let port = master.port.to_string();
        let replica = RedisServer::start_with_args("always", &["--replicaof", "127.0.0.1", &port]);
        master.wait_for_replicas(1);
        let store = RedisStore::connect(&master.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .expect("connect to the private redis-server")
            .with_caller_clock_leases()
            .with_min_replicas_acked(1);
        store.upgrade(T0).await.expect("stamp the layout version");
        Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::RedisWithReplica {
                master,
                _replica: replica,
            },
        }
    }

    /// The engine on a Redis Cluster, as `store.min_replicas_acked = 1` runs it: every call
    /// fanned out per partition and every write acknowledged by its master's replica.
    async fn cluster() -> Harness {
        let (store, prefix) = RedisCluster::shared()
            .store_of_its_own(RETENTION_SECS, T0)
            .await;
        let store = store.with_min_replicas_acked(1);
        Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Cluster { prefix },
        }
    }

    /// The engine on a database of its own (on one private server for the binary), its leases
    /// timed by the caller's clock.
    async fn postgres() -> Harness {
        let url = PostgresServer::shared().fresh_database();
        let mut store = PostgresStore::connect(&url, Duration::from_secs(5), RETENTION_SECS)
            .await
            .expect("connect to the private PostgreSQL")
            .with_caller_clock_leases();
        store.migrate().await.expect("create the layout");
        let db = url.rsplit('/').next().expect("a database").to_string();
        Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Postgres { db },
        }
    }

    async fn sqlite() -> Harness {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cb.db");
        let store = std::sync::Arc::new(
            SqliteStore::open(&path, RETENTION_SECS).expect("open a fresh SQLite store"),
        );
        Harness {
            store: store.clone(),
            backend: Backend::Sqlite {
                store,
                _dir: dir,
                path,
            },
        }
    }

    /// Keys (Redis) or rows (SQLite) the store holds: what retention must bring back down.
    fn footprint(&self) -> u64 {
        match &self.backend {
            // Less the attempts-per-minute and inbound-count hashes, which end by their Redis
            // TTL (hours or days of the server's time, `minute_counts_end_with_their_lifetime`,
            // `inbound_accepts_are_counted_per_source_and_minute_until_their_lifetime`), not by
            // the virtual clock's sweep.
            Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => {
                let all: u64 = server.cli(&["DBSIZE"]).parse().expect("DBSIZE");
                let inbound = server
                    .cli(&["--scan", "--pattern", "*:in:*"])
                    .lines()
                    .count();
                all - h_count_hashes(server).len() as u64 - inbound as u64
            }
            Backend::Cluster { prefix } => {
                let cluster = RedisCluster::shared();
                cluster.count_keys(&format!("{prefix}:*"))
                    - cluster.count_keys(&format!("{prefix}:*:n:*"))
                    - cluster.count_keys(&format!("{prefix}:*:in:*"))
            }
            // A finished message at or below the sweep horizon is gone to every read, and its
            // day partition is dropped whole once the horizon passes the day's end: what
            // counts is what is not gone.
            Backend::Postgres { db } => PostgresServer::shared()
                .psql_db(
                    db,
                    "SELECT (SELECT count(*) FROM dedupe_claims) + (SELECT count(*) FROM payments) \
                       + (SELECT count(*) FROM seals) + (SELECT count(*) FROM queue) \
                       + (SELECT count(*) FROM messages m WHERE m.end_day = 0 \
                            OR m.ends_at > (SELECT swept_to FROM sweep_horizon)) \
                       + (SELECT count(*) FROM history h JOIN messages m \
                            ON m.id = h.message_id AND m.end_day = h.end_day \
                          WHERE m.end_day = 0 \
                            OR m.ends_at > (SELECT swept_to FROM sweep_horizon))",
                )
                .parse()
                .expect("a count"),
            Backend::Sqlite { path, .. } => {
                let conn = rusqlite::Connection::open(path).expect("open for counting");
                [
                    "dedupe_claims",
                    "payments",
                    "messages",
                    "queue",
                    "attempts",
                    "seals",
                ]
                .iter()
                .map(|t| {
                    conn.query_row(&format!("SELECT count(*) FROM {t}"), [], |r| {
                        r.get::<_, i64>(0)
                    })
                    .expect("count rows") as u64
                })
                .sum()
            }
        }
    }

    /// Leaves the store no room to grow: Redis at `maxmemory` with `noeviction` (a limit below
    /// what it holds), SQLite capped at its current size as on a full disk.
    async fn fill(&self) {
        match &self.backend {
            Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => {
                server.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
                server.cli(&["CONFIG", "SET", "maxmemory", "1"]);
            }
            Backend::Sqlite { store, .. } => {
                store.set_max_page_count(1).await.expect("cap the database");
            }
            Backend::Cluster { .. } => panic!("the shared cluster is never filled"),
            Backend::Postgres { .. } => panic!("the shared PostgreSQL is never filled"),
        }
    }

    /// Gives a filled store room again.
    async fn free_space(&self) {
        match &self.backend {
            Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => {
                server.cli(&["CONFIG", "SET", "maxmemory", "0"]);
            }
            Backend::Sqlite { store, .. } => {
                store
                    .set_max_page_count(1 << 30)
                    .await
                    .expect("lift the cap");
            }
            Backend::Cluster { .. } => panic!("the shared cluster is never filled"),
            Backend::Postgres { .. } => panic!("the shared PostgreSQL is never filled"),
        }
    }

    /// Whether a full store refuses every write that could grow it, whole (Redis, whose
    /// memory has no slack), rather than the writes that do not fit its free pages (SQLite).
    fn refuses_every_growing_write_when_full(&self) -> bool {
        !matches!(self.backend, Backend::Sqlite { .. })
    }

    /// Sweeps at `now` until nothing more is due.
    async fn sweep_all(&self, now: Millis) {
        for _ in 0..1000 {
            if self.s().sweep(now).await.expect("sweep") == 0 {
                return;
            }
        }
        panic!("sweep never finished");
    }

    fn s(&self) -> &dyn Inspectable {
        &*self.store
    }
}

/// The attempts-per-minute hashes of a Redis (`<prefix>:{pNN}:n:<hour>`) with their TTL in ms.
fn h_count_hashes(server: &RedisServer) -> Vec<(String, i64)> {
    server
        .cli(&["--scan", "--pattern", "*:n:*"])
        .lines()
        .map(|key| {
            let ttl = server.cli(&["PTTL", key]).trim().parse().expect("PTTL");
            (key.to_string(), ttl)
        })
        .collect()
}

macro_rules! contract {
    ($($name:ident),* $(,)?) => {
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::redis().await).await;
                }
            )*
        }
        mod redis_with_replica {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::redis_with_replica().await).await;
                }
            )*
        }
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::cluster().await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::sqlite().await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&super::Harness::postgres().await).await;
                }
            )*
        }
    };
}

contract!(
    accept_then_replay_returns_the_stored_response,
    a_different_fingerprint_is_a_conflict,
    payment_status_is_compare_and_set,
    racing_transitions_of_one_payment_have_one_winner,
    concurrent_duplicates_are_accepted_once,
    concurrent_accepts_of_one_key_are_accepted_once_and_replayed_alike,
    a_refused_transition_in_a_run_of_accepts_fails_only_itself,
    claim_due_leases_only_due_messages,
    an_expired_lease_is_claimed_again_with_a_new_token,
    claim_due_never_returns_more_than_the_limit,
    a_retry_is_not_due_before_its_time,
    one_ordering_key_is_delivered_in_order,
    release_gives_the_lease_back,
    completion_after_lease_expiry_but_before_a_new_lease_is_final,
    resend_requeues_dead_and_delivered_messages,
    resend_expedites_a_pending_message_and_the_schedule_resumes,
    resend_of_a_message_behind_another_is_queued,
    resend_in_flight_delivers_once_more_after_the_current_attempt,
    resend_in_flight_survives_an_attempt_that_ends_the_message,
    resend_skips_unknown_and_recorded_messages,
    recorded_messages_are_never_claimed,
    list_pages_have_no_gaps_or_duplicates,
    list_pages_stay_consistent_while_messages_arrive,
    list_filters_by_state_source_key_and_window,
    list_with_a_sparse_filter_loses_nothing,
    list_by_several_ordering_keys_merges_them_in_id_order,
    history_rows_are_kept_in_order,
    depth_counts_pending_in_flight_and_dead,
    operations_are_reserved_then_finished,
    an_operation_reused_with_another_fingerprint_is_a_mismatch,
    a_partial_answer_is_recorded_even_without_a_live_reservation,
    get_of_an_unknown_id_is_none,
    payment_state_outlives_its_dedupe_claims_then_ends_with_its_own_retention,
    an_expired_claim_is_a_new_event,
    a_signature_is_single_use_while_it_could_verify,
    a_seal_ends_with_its_claim_at_the_latest,
    history_keeps_the_first_and_the_latest_rows_and_counts_every_row,
    only_the_first_and_the_latest_rows_keep_answer_bodies,
    bodies_of_every_size_are_claimed_and_read_byte_for_byte,
    list_pages_carry_counts_but_no_histories,
    everything_of_a_finished_message_is_swept_after_the_retention,
    finished_messages_past_many_buckets_list_in_order_through_resends_and_sweeps,
    retries_days_ahead_become_due_exactly_at_their_time,
    order_per_key_is_kept_across_far_retries,
    resend_expedites_a_message_retried_days_ahead,
    a_message_retried_past_its_deadline_is_swept_after_the_retention,
    a_forty_day_clock_jump_claims_everything_due,
    a_recorded_message_is_kept_for_the_retention_not_its_claim_ttl,
    every_state_change_runs_in_every_partition,
    a_callback_claim_answers_with_its_derived_id,
    completions_are_counted_in_their_minute_in_every_partition,
    minute_counts_end_with_their_lifetime,
    inbound_accepts_are_counted_per_source_and_minute_until_their_lifetime,
    recoveries_are_kept_newest_first_bounded_and_for_their_lifetime,
);

/// The contract tests a store can be filled for: every engine, but not the cluster, which
/// the tests of this binary share.
macro_rules! contract_when_full {
    ($($name:ident),* $(,)?) => {
        mod full {
            mod redis {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$name(&super::super::Harness::redis().await).await;
                    }
                )*
            }
            mod redis_with_replica {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$name(&super::super::Harness::redis_with_replica().await)
                            .await;
                    }
                )*
            }
            mod sqlite {
                $(
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn $name() {
                        super::super::$name(&super::super::Harness::sqlite().await).await;
                    }
                )*
            }
        }
    };
}

contract_when_full!(a_full_store_refuses_growing_writes_whole_and_goes_on_once_space_frees);

/// A full store refuses with `Full`, recording nothing: the refused event's claim is not
/// burnt, a delivery's attempt is refused whole (Redis) or applied whole (SQLite, when it
/// fits a free page), `ping` says full, and the sweeper still frees what ended. Once space
/// frees, the refused event is accepted and the leased message is delivered.
async fn a_full_store_refuses_growing_writes_whole_and_goes_on_once_space_frees(h: &Harness) {
    let s = h.s();
    let leased = accept_new(s, "pay/leased", T0).await;
    let finished = accept_new(s, "pay/finished", T0).await;
    let mut claimed = claim_exactly(s, T0, &[&leased, &finished]).await;
    claimed.sort_by_key(|c| c.message.id != leased);
    let (lease, done) = (&claimed[0], &claimed[1]);
    assert!(complete(s, done, Completion::Delivered, T0).await);
    let history_before = get(s, &leased).await.history_total;
    h.fill().await;

    let mut refused = None;
    for i in 0..100_000 {
        let req = callback_request(
            &format!("tx-{i}/PAID"),
            &format!("tx-{i}"),
            TTL_SECS,
            Partitions::DEFAULT,
            T0 + 1,
        );
        match s.accept(req.clone(), T0 + 1).await {
            Ok(AcceptOutcome::Accepted) => {}
            Err(StoreError::Full(_)) => {
                refused = Some(req);
                break;
            }
            other => panic!("accept into a filling store: {other:?}"),
        }
    }
    let refused = refused.expect("a full store refuses an accept");
    assert!(
        matches!(s.ping().await, Err(StoreError::Full(_))),
        "ping says the store is full"
    );
    let delivered = ListFilter {
        limit: 10,
        state: Some(MessageState::Delivered),
        ..Default::default()
    };
    let listed = s.list(&delivered).await.expect("a full store still lists");
    assert_eq!(ids(&listed.messages), std::slice::from_ref(&finished));

    let attempt = DeliveryAttempt {
        response: Some(ReceiverAnswer {
            body: "x".repeat(2_000),
            ..delivery(1, T0 + 1_000, 500).response.unwrap()
        }),
        ..delivery(1, T0 + 1_000, 500)
    };
    let retry = Completion::Retry {
        next_at: T0 + 2_000,
    };
    let completed = s.complete(lease, attempt, retry, T0 + 1_000).await;
    let record = get(s, &leased).await;
    match &completed {
        Err(StoreError::Full(_)) => {
            assert_eq!(
                record.history_total, history_before,
                "nothing of it recorded"
            );
            assert_eq!(record.state, MessageState::InFlight, "the lease is kept");
        }
        Ok(true) => {
            assert!(!h.refuses_every_growing_write_when_full());
            assert_eq!(record.history_total, history_before + 1, "recorded whole");
        }
        other => panic!("completing in a full store: {other:?}"),
    }
    if h.refuses_every_growing_write_when_full() {
        assert!(
            matches!(completed, Err(StoreError::Full(_))),
            "an attempt is refused whole: {completed:?}"
        );
        let resent = s.resend(&finished, resend_mark(T0 + 2_000), T0 + DAY_MS, T0 + 2_000);
        assert!(matches!(resent.await, Err(StoreError::Full(_))));
    }

    // What ended is still swept, which is what frees a full store.
    h.sweep_all(T0 + RETENTION_SECS as Millis * 1000).await;
    assert_eq!(s.get(&finished).await.unwrap(), None, "swept while full");

    h.free_space().await;
    assert!(s.ping().await.is_ok(), "no longer full");
    assert_eq!(
        s.accept(refused, T0 + 3_000).await.unwrap(),
        AcceptOutcome::Accepted,
        "the refused event's claim was never taken"
    );
    let lease = match completed {
        Ok(_) => claim(s, T0 + 3_000, 100)
            .await
            .into_iter()
            .find(|c| c.message.id == leased)
            .expect("the retried message is due again"),
        Err(_) => lease.clone(),
    };
    assert!(complete(s, &lease, Completion::Delivered, T0 + 3_000).await);
    assert_eq!(get(s, &leased).await.state, MessageState::Delivered);
}

/// A callback's claim replays the first answer byte for byte, conflicts with a request that
/// has a fingerprint, seals a new signature with that answer, and ends with the lifetime it
/// was written with, even when written again into a later hour before the sweeper reaches
/// the earlier one.
async fn a_callback_claim_answers_with_its_derived_id(h: &Harness) {
    const MINUTE_MS: Millis = 60_000;
    let s = h.s();
    let p = s.partitions();
    let first = callback_request("cb/tx-c", "tx-c", TTL_SECS, p, T0);
    let answer = first.dedupe.response.clone();
    assert_eq!(s.accept(first, T0).await.unwrap(), AcceptOutcome::Accepted);
    // A repeat a day later makes its own id, but gets the first answer.
    let day = T0 + DAY_MS;
    let repeat = callback_request("cb/tx-c", "tx-c", TTL_SECS, p, day);
    assert_ne!(repeat.dedupe.response, answer);
    let replayed = AcceptOutcome::Replayed {
        response: answer.clone(),
    };
    assert_eq!(s.accept(repeat.clone(), day).await.unwrap(), replayed);
    let mut fingerprinted = repeat.clone();
    fingerprinted.dedupe.fingerprint = Some("fp-1".into());
    assert_eq!(
        s.accept(fingerprinted, day).await.unwrap(),
        AcceptOutcome::Conflict
    );
    // A new signature of the repeat is sealed with the first answer (rebuilt from the compact
    // claim on Redis), which the signature then gets under this claim key only.
    let seal = SignatureSeal {
        key: "seal/tx-c".into(),
        expires_at: T0 + 40 * DAY_MS,
    };
    let resigned = AcceptRequest {
        seal: Some(seal.clone()),
        ..repeat
    };
    assert_eq!(s.accept(resigned.clone(), day).await.unwrap(), replayed);
    assert_eq!(s.accept(resigned, day + 1).await.unwrap(), replayed);
    let other_claim = AcceptRequest {
        seal: Some(seal),
        ..callback_request("cb/tx-c-other", "tx-c", TTL_SECS, p, day + 1)
    };
    assert_eq!(
        s.accept(other_claim, day + 1).await.unwrap(),
        AcceptOutcome::SignatureReused
    );

    // It ends with its lifetime: then the callback is a new event with an id of its own.
    let end = T0 + TTL_SECS as Millis * 1000;
    let at_end = |now| callback_request("cb/tx-c", "tx-c", TTL_SECS, p, now);
    assert_eq!(s.accept(at_end(end - 1), end - 1).await.unwrap(), replayed);
    let again = at_end(end);
    let second = AcceptOutcome::Replayed {
        response: again.dedupe.response.clone(),
    };
    assert_eq!(s.accept(again, end).await.unwrap(), AcceptOutcome::Accepted);
    assert_eq!(s.accept(at_end(end + 1), end + 1).await.unwrap(), second);

    // An hour's claim made at T0 + 30 min ends in the next hour; made again after that end,
    // it ends in the hour after. Sweeping the first of those hours keeps the live claim.
    let short = |now| callback_request("cb/tx-short", "tx-short", 3_600, p, now);
    let made = T0 + 30 * MINUTE_MS;
    assert_eq!(
        s.accept(short(made), made).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let remade = T0 + 91 * MINUTE_MS;
    let remade_answer = AcceptOutcome::Replayed {
        response: short(remade).dedupe.response,
    };
    assert_eq!(
        s.accept(short(remade), remade).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let swept = T0 + 125 * MINUTE_MS;
    h.sweep_all(swept).await;
    assert_eq!(s.accept(short(swept), swept).await.unwrap(), remade_answer);
    let over = remade + 60 * MINUTE_MS;
    h.sweep_all(over - 1).await;
    assert_eq!(
        s.accept(short(over - 1), over - 1).await.unwrap(),
        remade_answer
    );
    assert_eq!(
        s.accept(short(over), over).await.unwrap(),
        AcceptOutcome::Accepted
    );
}

// ---------------------------------------------------------------------------------------
// Helpers

/// A message of `ordering_key` for a new store, which has the default partition count.
fn new_message(ordering_key: &str, now: Millis) -> NewMessage {
    NewMessage {
        id: MessageId::generate(now, ordering_key, Partitions::DEFAULT),
        kind: MessageKind::Notification,
        source: None,
        payment_id: None,
        transaction_id: None,
        ordering_key: ordering_key.to_string(),
        event: None,
        target_url: Some("http://127.0.0.1:9/hook?X-VTEX-signature=a%2Fb".into()),
        headers: BTreeMap::from([("X-VTEX-API-AppKey".to_string(), "key".to_string())]),
        body: format!(r#"{{"orderingKey":"{ordering_key}","at":{now}}}"#),
        created_at: now,
        deadline: now + 7 * DAY_MS,
    }
}

/// An inbound callback of `source`, ordered by its transaction like the HTTP layer does.
fn inbound(source: &str, transaction_id: &str, now: Millis) -> NewMessage {
    let ordering_key = format!("src/{source}/{transaction_id}");
    NewMessage {
        kind: MessageKind::Inbound,
        source: Some(source.into()),
        transaction_id: Some(transaction_id.into()),
        event: Some("TRANSACTION_PAID".into()),
        ..new_message(&ordering_key, now)
    }
}

fn request(claim_key: &str, message: NewMessage) -> AcceptRequest {
    AcceptRequest {
        dedupe: DedupeClaim {
            key: claim_key.to_string(),
            ttl_secs: TTL_SECS,
            fingerprint: Some("fp-1".into()),
            response: format!(r#"{{"messageId":"{}"}}"#, message.id),
        },
        message,
        payment: None,
        seal: None,
    }
}

/// An inbound callback's request as the HTTP layer makes it (src/inbound/accept.rs): its id
/// derived from the claim key, no fingerprint, the answer naming the id. On Redis its claim
/// is one integer.
fn callback_request(
    claim_key: &str,
    transaction_id: &str,
    ttl_secs: u64,
    partitions: Partitions,
    now: Millis,
) -> AcceptRequest {
    let mut message = inbound("payzu", transaction_id, now);
    message.id = MessageId::for_claim(now, &message.ordering_key, partitions, claim_key);
    AcceptRequest {
        dedupe: DedupeClaim {
            key: claim_key.to_string(),
            ttl_secs,
            fingerprint: None,
            response: format!(r#"{{"messageId":"{}"}}"#, message.id),
        },
        message,
        payment: None,
        seal: None,
    }
}

fn status(name: &str) -> PaymentStatus {
    PaymentStatus::parse(name).unwrap_or_else(|| panic!("`{name}` is no payment status"))
}

fn notification(payment_id: &str, to: &str, allowed_from: &[&str], now: Millis) -> AcceptRequest {
    let message = NewMessage {
        payment_id: Some(payment_id.into()),
        ..new_message(&payment::ordering_key(payment_id), now)
    };
    AcceptRequest {
        payment: Some(PaymentTransition {
            payment_id: payment_id.into(),
            to: status(to),
            allowed_from: allowed_from.iter().map(|s| status(s)).collect(),
        }),
        ..request(&format!("notification/{payment_id}/{to}"), message)
    }
}

/// Accepts `message` under a claim key of its own and returns its id.
async fn accept(s: &dyn Store, message: NewMessage, now: Millis) -> MessageId {
    let id = message.id.clone();
    let outcome = s
        .accept(request(&format!("claim/{id}"), message), now)
        .await
        .expect("accept");
    assert_eq!(outcome, AcceptOutcome::Accepted);
    id
}

async fn accept_new(s: &dyn Store, ordering_key: &str, now: Millis) -> MessageId {
    accept(s, new_message(ordering_key, now), now).await
}

fn delivery(attempt: u32, at: Millis, status: u16) -> DeliveryAttempt {
    DeliveryAttempt {
        attempt,
        at,
        status: Some(status),
        error: None,
        latency_ms: Some(12),
        // Every store keeps the receiver's answer with the row, unchanged.
        response: Some(ReceiverAnswer {
            content_type: Some("application/json".into()),
            retry_after: None,
            body: format!("{{\"status\":{status}}}"),
            body_truncated: false,
            body_dropped: false,
        }),
    }
}

fn resend_mark(at: Millis) -> ResendMark {
    ResendMark {
        at,
        request_id: Some("op-1".into()),
    }
}

/// The attempt number of a history row, 0 for a resend mark (as the API shows it).
fn attempt_no(row: &HistoryEntry) -> u32 {
    row.delivery().map_or(0, |d| d.attempt)
}

async fn claim(s: &dyn Store, now: Millis, limit: usize) -> Vec<Lease> {
    s.claim_due(now, limit, LEASE_MS).await.expect("claim_due")
}

/// Claims at `now` and expects exactly the messages `ids` (in any order).
async fn claim_exactly(s: &dyn Store, now: Millis, ids: &[&MessageId]) -> Vec<Lease> {
    let claimed = claim(s, now, 100).await;
    let got: BTreeSet<_> = claimed.iter().map(|c| c.message.id.clone()).collect();
    let want: BTreeSet<_> = ids.iter().map(|id| (*id).clone()).collect();
    assert_eq!(got, want, "claimed at {}", now - T0);
    claimed
}

async fn claim_one(s: &dyn Store, now: Millis, id: &MessageId) -> Lease {
    claim_exactly(s, now, &[id]).await.remove(0)
}

async fn complete(s: &dyn Store, c: &Lease, completion: Completion, now: Millis) -> bool {
    let attempt = delivery(c.attempts + 1, now, 500);
    s.complete(c, attempt, completion, now)
        .await
        .expect("complete")
}

async fn get(s: &dyn Store, id: &MessageId) -> MessageRecord {
    s.get(id).await.expect("get").expect("message exists")
}

/// Every page of a listing, following `next_after` until the end.
async fn list_all(s: &dyn Store, filter: ListFilter) -> Vec<MessageRecord> {
    let mut filter = filter;
    let mut all = Vec::new();
    for _ in 0..1000 {
        let page = s.list(&filter).await.expect("list");
        assert!(page.messages.len() <= filter.limit.max(1));
        all.extend(page.messages);
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => return all,
        }
    }
    panic!("listing never reached its end");
}

fn ids(records: &[MessageRecord]) -> Vec<MessageId> {
    records.iter().map(|r| r.message.id.clone()).collect()
}

// ---------------------------------------------------------------------------------------
// Partitions

/// Payment ids whose hand-offs land in every partition, one each.
fn one_payment_per_partition() -> Vec<String> {
    let mut by_partition = BTreeMap::new();
    for i in 0..10_000 {
        let payment_id = format!("pay-{i}");
        by_partition
            .entry(partition_of(
                &payment::ordering_key(&payment_id),
                Partitions::DEFAULT,
            ))
            .or_insert(payment_id);
    }
    by_partition.into_values().collect()
}

/// Every state change in every partition, each step with every key its script takes (a
/// payment, a seal). Redis Cluster refuses a script whose keys span slots (CROSSSLOT), and
/// every debug build checks each script call's keys against one slot, so a call that mixes
/// partitions fails here on any Redis.
async fn every_state_change_runs_in_every_partition(h: &Harness) {
    let s = h.s();
    let payments = one_payment_per_partition();
    let mut ids = Vec::new();
    for payment_id in &payments {
        let mut req = notification(payment_id, "approved", &["undefined"], T0);
        req.seal = Some(SignatureSeal {
            key: format!("seal/{payment_id}"),
            expires_at: T0 + DAY_MS,
        });
        ids.push(req.message.id.clone());
        let outcome = s.accept(req, T0).await.expect("accept");
        assert_eq!(outcome, AcceptOutcome::Accepted);
    }
    let all: Vec<&MessageId> = ids.iter().collect();
    for lease in claim_exactly(s, T0, &all).await {
        assert!(s.release(&lease, T0).await.expect("release"));
    }
    let retry_at = T0 + 60_000;
    for lease in claim_exactly(s, T0 + 1, &all).await {
        let retry = Completion::Retry { next_at: retry_at };
        assert!(complete(s, &lease, retry, T0 + 1).await);
    }
    for id in &ids {
        let effect = s
            .resend(id, resend_mark(T0 + 2), T0 + 7 * DAY_MS, T0 + 2)
            .await
            .expect("resend");
        assert_eq!(effect, ResendEffect::Expedited, "{id}");
    }
    for lease in claim_exactly(s, T0 + 3, &all).await {
        assert!(complete(s, &lease, Completion::Delivered, T0 + 3).await);
    }
    for payment_id in &payments {
        let status = s.payment_status(payment_id, T0 + 3).await.expect("status");
        assert_eq!(status.as_deref(), Some("approved"), "{payment_id}");
    }
    let listed = list_all(
        s,
        ListFilter {
            limit: 7,
            ..ListFilter::default()
        },
    )
    .await;
    assert_eq!(listed.len(), ids.len());
    h.sweep_all(T0 + 3 + RETENTION_SECS as Millis * 1000 + 1)
        .await;
    for id in &ids {
        assert!(s.get(id).await.expect("get").is_none(), "{id} swept");
    }
}

// ---------------------------------------------------------------------------------------
// Attempts per minute (store/counts.rs)

fn minute(minute: Millis, deliveries: u64, failures: u64, dead: u64) -> MinuteCount {
    MinuteCount {
        minute,
        deliveries,
        failures,
        dead,
    }
}

/// Every recorded completion counts in the minute of its `now`, whatever its partition: a
/// delivery, a failure, and a death as a failure and a dead letter. A completion whose lease
/// is gone records nothing and counts nothing. A read sums the partitions, one row per
/// minute, from `since`'s minute to `now`'s.
async fn completions_are_counted_in_their_minute_in_every_partition(h: &Harness) {
    let s = h.s();
    assert_eq!(s.minute_counts(T0, T0).await.unwrap(), []);
    let payments = one_payment_per_partition();
    let mut ids = Vec::new();
    for payment_id in &payments {
        let req = notification(payment_id, "approved", &["undefined"], T0);
        ids.push(req.message.id.clone());
        assert_eq!(s.accept(req, T0).await.unwrap(), AcceptOutcome::Accepted);
    }
    let all: Vec<&MessageId> = ids.iter().collect();
    let leases = claim_exactly(s, T0, &all).await;
    let second = T0 + 60_000;
    for (i, lease) in leases.iter().enumerate() {
        let (completion, at) = match i % 3 {
            0 => (Completion::Delivered, T0 + 59_999),
            1 => (Completion::Retry { next_at: second }, second + 1),
            _ => (Completion::Dead, second + 2),
        };
        assert!(complete(s, lease, completion, at).await);
    }
    // The same lease again: already finished, nothing recorded, nothing counted.
    assert!(!complete(s, &leases[0], Completion::Delivered, second).await);
    let n = leases.len() as u64;
    let (delivered, retried, dead) = (n.div_ceil(3), (n + 1) / 3, n / 3);
    assert_eq!(
        s.minute_counts(T0, second + 2).await.unwrap(),
        [
            minute(T0, delivered, 0, 0),
            minute(second, 0, retried + dead, dead)
        ]
    );
    assert_eq!(
        s.minute_counts(second + 30_000, second + 30_000)
            .await
            .unwrap(),
        [minute(second, 0, retried + dead, dead)],
        "from `since`'s minute"
    );
    assert_eq!(
        s.minute_counts(T0, T0 + 59_999).await.unwrap(),
        [minute(T0, delivered, 0, 0)],
        "to `now`'s minute"
    );
}

/// A minute's counts are read until [`counts::COUNT_LIFETIME_MS`] after it starts, then gone
/// to every read on the caller's clock; the sweep deletes them (SQLite, PostgreSQL) and a Redis
/// hash ends by its TTL, at most three hours on.
async fn minute_counts_end_with_their_lifetime(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/counted", T0).await;
    let lease = claim_one(s, T0, &id).await;
    assert!(complete(s, &lease, Completion::Delivered, T0 + 1).await);
    let end = T0 + counts::COUNT_LIFETIME_MS;
    h.sweep_all(end - 1).await;
    assert_eq!(
        s.minute_counts(T0, end - 1).await.unwrap(),
        [minute(T0, 1, 0, 0)],
        "kept until its end"
    );
    assert_eq!(
        s.minute_counts(T0, end).await.unwrap(),
        [],
        "gone at its end"
    );
    // Gone from storage as well, not only from reads.
    let deleted = h.s().sweep(end).await.unwrap();
    match &h.backend {
        Backend::Sqlite { .. } | Backend::Postgres { .. } => {
            assert_eq!(deleted, 1, "the minute's row is swept")
        }
        Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => {
            let hashes = h_count_hashes(server);
            assert_eq!(hashes.len(), 1, "{hashes:?}");
            let ttl = hashes[0].1;
            assert!(
                ttl > 0 && ttl <= counts::COUNT_LIFETIME_MS + 3_600_000,
                "{hashes:?}"
            );
        }
        Backend::Cluster { prefix } => {
            assert_eq!(
                RedisCluster::shared().count_keys(&format!("{prefix}:*:n:*")),
                1
            );
        }
    }
    // A new count in a later minute starts from zero.
    let id = accept_new(s, "pay/counted-again", end).await;
    let lease = claim_one(s, end, &id).await;
    assert!(
        complete(
            s,
            &lease,
            Completion::Retry {
                next_at: end + DAY_MS
            },
            end
        )
        .await
    );
    assert_eq!(
        s.minute_counts(T0, end).await.unwrap(),
        [minute(end, 0, 1, 0)]
    );
}

/// Every inbound accept of a source counts in its minute, new or replayed (store/recoveries.rs),
/// in every partition; a notification or a refused accept counts nothing; the counts end with
/// their lifetime.
async fn inbound_accepts_are_counted_per_source_and_minute_until_their_lifetime(h: &Harness) {
    const MINUTE_MS: Millis = 60_000;
    let s = h.s();
    let p = s.partitions();
    let zero = InboundCount::default();
    let count = |new, replays| InboundCount { new, replays };
    // Twenty transactions land in many partitions.
    for i in 0..20 {
        let key = format!("cb/tx-{i}");
        let tx = format!("tx-{i}");
        let first = callback_request(&key, &tx, TTL_SECS, p, T0 + i);
        assert_eq!(
            s.accept(first, T0 + i).await.unwrap(),
            AcceptOutcome::Accepted
        );
        if i % 4 == 0 {
            let again = callback_request(&key, &tx, TTL_SECS, p, T0 + MINUTE_MS + i);
            assert!(matches!(
                s.accept(again, T0 + MINUTE_MS + i).await.unwrap(),
                AcceptOutcome::Replayed { .. }
            ));
        }
    }
    // A refused accept (another fingerprint), a notification and another source's callback
    // count nothing for `payzu`.
    let mut conflicting = callback_request("cb/tx-0", "tx-0", TTL_SECS, p, T0 + 2);
    conflicting.dedupe.fingerprint = Some("fp-other".into());
    assert_eq!(
        s.accept(conflicting, T0 + 2).await.unwrap(),
        AcceptOutcome::Conflict
    );
    accept(s, new_message("pay/not-counted", T0), T0).await;
    accept(s, inbound("other", "tx-o", T0), T0).await;

    let now = T0 + 2 * MINUTE_MS;
    assert_eq!(
        s.inbound_counts("payzu", T0, now, now).await.unwrap(),
        count(20, 5)
    );
    assert_eq!(
        s.inbound_counts("payzu", T0, T0, now).await.unwrap(),
        count(20, 0)
    );
    assert_eq!(
        s.inbound_counts("payzu", T0 + MINUTE_MS + 30_000, now, now)
            .await
            .unwrap(),
        count(0, 5),
        "from the minute of `since`"
    );
    assert_eq!(
        s.inbound_counts("payzu", T0, T0 + DAY_MS, T0 + 1)
            .await
            .unwrap(),
        count(20, 0),
        "not past `now`"
    );
    assert_eq!(
        s.inbound_counts("other", T0, now, now).await.unwrap(),
        count(1, 0)
    );
    assert_eq!(
        s.inbound_counts("nobody", T0, now, now).await.unwrap(),
        zero
    );

    let end = T0 + recoveries::INBOUND_COUNT_LIFETIME_MS;
    h.sweep_all(end - 1).await;
    assert_eq!(
        s.inbound_counts("payzu", T0, end, end - 1).await.unwrap(),
        count(20, 5),
        "kept until its end"
    );
    assert_eq!(
        s.inbound_counts("payzu", T0, end, end).await.unwrap(),
        count(0, 5),
        "the first minute is gone at its end"
    );
    let later = end + MINUTE_MS;
    h.sweep_all(later).await;
    assert_eq!(
        s.inbound_counts("payzu", T0, later, later).await.unwrap(),
        zero
    );
    match &h.backend {
        Backend::Sqlite { path, .. } => {
            let rows: i64 = rusqlite::Connection::open(path)
                .unwrap()
                .query_row("SELECT count(*) FROM inbound_counts", [], |r| r.get(0))
                .unwrap();
            assert_eq!(rows, 0, "swept from storage");
        }
        Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => {
            for key in server.cli(&["--scan", "--pattern", "*:in:*"]).lines() {
                let ttl: i64 = server.cli(&["PTTL", key]).trim().parse().unwrap();
                assert!(
                    ttl > 0 && ttl <= recoveries::INBOUND_COUNT_LIFETIME_MS + 3_600_000,
                    "{key} {ttl}"
                );
            }
        }
        Backend::Cluster { prefix } => {
            assert!(RedisCluster::shared().count_keys(&format!("{prefix}:*:in:*")) > 0);
        }
        Backend::Postgres { .. } => {}
    }
}

fn recovery_at(started_at: Millis) -> Recovery {
    Recovery {
        id: Recovery::new_id(started_at),
        source: "payzu".into(),
        started_at,
        from: started_at - 20 * DAY_MS,
        to: started_at,
        count_until: started_at + 3_600_000,
        windows: vec![RecoveryWindow {
            from: started_at - 20 * DAY_MS,
            to: started_at - 13 * DAY_MS,
            state: WindowState::Pending,
            total: None,
            error: None,
            attempts: 0,
        }],
        baseline: InboundCount::default(),
        settled: None,
    }
}

/// Recoveries are saved and replaced by id, listed newest first, at most MAX_RECOVERIES of
/// them, and gone after their lifetime.
async fn recoveries_are_kept_newest_first_bounded_and_for_their_lifetime(h: &Harness) {
    let s = h.s();
    assert_eq!(s.recoveries(T0).await.unwrap(), []);
    let first = recovery_at(T0);
    s.save_recovery(&first, T0).await.unwrap();
    let mut second = recovery_at(T0 + 1000);
    s.save_recovery(&second, T0 + 1000).await.unwrap();
    second.windows[0].state = WindowState::Failed;
    second.windows[0].error = Some("HTTP 401 Unauthorized: {}".into());
    second.windows[0].attempts = 1;
    second.settled = Some(InboundCount { new: 3, replays: 2 });
    s.save_recovery(&second, T0 + 2000).await.unwrap();
    assert_eq!(
        s.recoveries(T0 + 2000).await.unwrap(),
        [second.clone(), first.clone()]
    );
    assert_eq!(
        s.recovery(&second.id, T0 + 2000).await.unwrap(),
        Some(second.clone())
    );
    assert_eq!(
        s.recovery(&Recovery::new_id(T0), T0 + 2000).await.unwrap(),
        None
    );

    // Bounded: the oldest go first.
    let many: Vec<Recovery> = (0..recoveries::MAX_RECOVERIES as Millis)
        .map(|i| recovery_at(T0 + 10_000 + i))
        .collect();
    for r in &many {
        s.save_recovery(r, T0 + 20_000).await.unwrap();
    }
    let kept = s.recoveries(T0 + 20_000).await.unwrap();
    assert_eq!(kept.len(), recoveries::MAX_RECOVERIES);
    assert_eq!(kept[0], many[many.len() - 1]);
    assert_eq!(
        s.recovery(&first.id, T0 + 20_000).await.unwrap(),
        None,
        "dropped"
    );

    // Gone with their lifetime, from reads and then from storage.
    let end = T0 + 10_000 + recoveries::RECOVERY_LIFETIME_MS;
    assert_eq!(
        s.recoveries(end - 1).await.unwrap().len(),
        recoveries::MAX_RECOVERIES
    );
    assert_eq!(s.recoveries(end + 1000).await.unwrap(), []);
    assert_eq!(s.recovery(&many[0].id, end + 1000).await.unwrap(), None);
    h.sweep_all(end + 1000).await;
    let fresh = recovery_at(end + 2000);
    s.save_recovery(&fresh, end + 2000).await.unwrap();
    assert_eq!(s.recoveries(end + 2000).await.unwrap(), [fresh]);
}

// ---------------------------------------------------------------------------------------
// Accept, dedupe and payments

async fn accept_then_replay_returns_the_stored_response(h: &Harness) {
    let s = h.s();
    let first = request("k1", new_message("pay/1", T0));
    let stored = first.dedupe.response.clone();
    assert_eq!(
        s.accept(first.clone(), T0).await.unwrap(),
        AcceptOutcome::Accepted
    );

    // A repeat builds a new id and response; it gets the first answer and creates nothing.
    let mut repeat = request("k1", new_message("pay/1", T0 + 5));
    repeat.dedupe.response = r#"{"messageId":"something else"}"#.into();
    let repeat_id = repeat.message.id.clone();
    assert_eq!(
        s.accept(repeat, T0 + 5).await.unwrap(),
        AcceptOutcome::Replayed { response: stored }
    );
    assert_eq!(s.get(&repeat_id).await.unwrap(), None);
    let all = list_all(
        s,
        ListFilter {
            limit: 10,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&all), vec![first.message.id.clone()]);

    let record = get(s, &first.message.id).await;
    assert_eq!(record.message, first.message);
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.deadline, first.message.deadline);
    assert_eq!(record.next_attempt_at, Some(T0));
    assert!(record.history.is_empty());
}

async fn a_different_fingerprint_is_a_conflict(h: &Harness) {
    let s = h.s();
    let first = request("k1", new_message("pay/1", T0));
    assert_eq!(
        s.accept(first.clone(), T0).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let mut other = request("k1", new_message("pay/1", T0 + 1));
    other.dedupe.fingerprint = Some("fp-2".into());
    let other_id = other.message.id.clone();
    assert_eq!(
        s.accept(other, T0 + 1).await.unwrap(),
        AcceptOutcome::Conflict
    );
    assert_eq!(s.get(&other_id).await.unwrap(), None);
    // The conflict changed nothing: the original still replays.
    assert_eq!(
        s.accept(request("k1", new_message("pay/1", T0 + 2)), T0 + 2)
            .await
            .unwrap(),
        AcceptOutcome::Replayed {
            response: first.dedupe.response
        }
    );
}

async fn payment_status_is_compare_and_set(h: &Harness) {
    let s = h.s();
    assert_eq!(
        s.payment_status("p1", T0).await.unwrap(),
        None,
        "never seen"
    );

    let approve = notification("p1", "approved", &["undefined"], T0);
    assert_eq!(
        s.accept(approve, T0).await.unwrap(),
        AcceptOutcome::Accepted
    );
    assert_eq!(
        s.payment_status("p1", T0).await.unwrap().as_deref(),
        Some("approved")
    );

    // approved → approved is not a transition; a new key, so it is not a replay either.
    let mut again = notification("p1", "approved", &["undefined"], T0 + 1);
    again.dedupe.key = "notification/p1/approved/again".into();
    let again_id = again.message.id.clone();
    assert_eq!(
        s.accept(again, T0 + 1).await.unwrap(),
        AcceptOutcome::InvalidTransition {
            from: "approved".into()
        }
    );
    assert_eq!(s.get(&again_id).await.unwrap(), None, "nothing recorded");

    // A refused transition burns no key: the same key with a valid transition goes through.
    let refund = notification("p1", "refunded", &["settled"], T0 + 2);
    let refund_key = refund.dedupe.key.clone();
    assert_eq!(
        s.accept(refund, T0 + 2).await.unwrap(),
        AcceptOutcome::InvalidTransition {
            from: "approved".into()
        }
    );
    let settle = notification("p1", "settled", &["approved"], T0 + 3);
    assert_eq!(
        s.accept(settle, T0 + 3).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let mut refund = notification("p1", "refunded", &["settled"], T0 + 4);
    refund.dedupe.key = refund_key;
    assert_eq!(
        s.accept(refund, T0 + 4).await.unwrap(),
        AcceptOutcome::Accepted
    );
    assert_eq!(
        s.payment_status("p1", T0).await.unwrap().as_deref(),
        Some("refunded")
    );
    assert_eq!(s.payment_status("p2", T0).await.unwrap(), None);
}

async fn racing_transitions_of_one_payment_have_one_winner(h: &Harness) {
    let s = h.s();
    for i in 0..5 {
        let payment_id = format!("race-{i}");
        let now = T0 + i;
        let approve = notification(&payment_id, "approved", &["undefined"], now);
        let deny = notification(&payment_id, "denied", &["undefined"], now);
        let (a, d) = tokio::join!(s.accept(approve, now), s.accept(deny, now));
        let (a, d) = (a.unwrap(), d.unwrap());
        let winner = match (&a, &d) {
            (AcceptOutcome::Accepted, AcceptOutcome::InvalidTransition { from }) => {
                assert_eq!(from, "approved");
                "approved"
            }
            (AcceptOutcome::InvalidTransition { from }, AcceptOutcome::Accepted) => {
                assert_eq!(from, "denied");
                "denied"
            }
            other => panic!("exactly one transition must win, got {other:?}"),
        };
        assert_eq!(
            s.payment_status(&payment_id, T0).await.unwrap().as_deref(),
            Some(winner)
        );
        let key = payment::ordering_key(&payment_id);
        let listed = list_all(
            s,
            ListFilter {
                ordering_keys: Some(vec![key]),
                limit: 10,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(listed.len(), 1);
    }
}

async fn concurrent_duplicates_are_accepted_once(h: &Harness) {
    let s = h.s();
    let mut accepts = Vec::new();
    for i in 0..40 {
        // Every fourth request repeats one key; the others are distinct. A claim key always
        // comes with the same ordering key (the HTTP layer derives both from the same
        // request): Redis keeps a claim in its ordering key's partition.
        let (key, ordering_key) = if i % 4 == 0 {
            ("dup".to_string(), "o-dup".to_string())
        } else {
            (format!("k{i}"), format!("o{i}"))
        };
        accepts.push(s.accept(request(&key, new_message(&ordering_key, T0 + i)), T0 + i));
    }
    let outcomes = futures::future::join_all(accepts).await;
    let accepted = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(AcceptOutcome::Accepted)))
        .count();
    let replayed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(AcceptOutcome::Replayed { .. })))
        .count();
    assert_eq!((accepted, replayed), (31, 9), "{outcomes:?}");
    let all = list_all(
        s,
        ListFilter {
            limit: 100,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(all.len(), 31);
}

/// An accept started by [`start_together`]: in flight, or already answered.
type Accepting<'s> = futures::future::Either<
    std::future::Ready<Result<AcceptOutcome, StoreError>>,
    std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<AcceptOutcome, StoreError>> + Send + 's>,
    >,
>;

/// Starts `requests`, all in flight together: each is polled once, which sends it. Await them
/// with `join_all`.
async fn start_together(
    s: &dyn Store,
    requests: Vec<AcceptRequest>,
    now: Millis,
) -> Vec<Accepting<'_>> {
    let mut started = Vec::new();
    for req in requests {
        let mut accepting = s.accept(req, now);
        started.push(match futures::poll!(accepting.as_mut()) {
            std::task::Poll::Ready(outcome) => {
                futures::future::Either::Left(std::future::ready(outcome))
            }
            std::task::Poll::Pending => futures::future::Either::Right(accepting),
        });
    }
    started
}

/// The same event many times at once, each copy with its own message: one is accepted and
/// every other gets its stored response, byte for byte.
async fn concurrent_accepts_of_one_key_are_accepted_once_and_replayed_alike(h: &Harness) {
    let s = h.s();
    let copies = |claim_key: &str, n: i64| -> Vec<AcceptRequest> {
        (0..n)
            .map(|i| request(claim_key, new_message(&format!("o-{claim_key}"), T0 + i)))
            .collect()
    };

    let racing = copies("same-racing", 50);
    let responses: Vec<String> = racing.iter().map(|r| r.dedupe.response.clone()).collect();
    let outcomes = futures::future::join_all(racing.into_iter().map(|r| s.accept(r, T0))).await;
    let outcomes: Vec<AcceptOutcome> = outcomes.into_iter().map(Result::unwrap).collect();
    let winners: Vec<usize> = (0..outcomes.len())
        .filter(|i| outcomes[*i] == AcceptOutcome::Accepted)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    let stored = &responses[winners[0]];
    for (i, outcome) in outcomes.iter().enumerate() {
        if i != winners[0] {
            assert_eq!(
                outcome,
                &AcceptOutcome::Replayed {
                    response: stored.clone()
                }
            );
        }
    }
    let listed = list_all(
        s,
        ListFilter {
            ordering_keys: Some(vec!["o-same-racing".into()]),
            limit: 100,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(listed.len(), 1);
}

/// Accepts of one payment arriving together: each is judged after the ones before it, and the
/// refused transition (or the conflicting replay) changes nothing for the others.
/// Accepts of one payment, one after the other, and what each gets: each is judged after the
/// ones before it, and a refused transition or a conflicting replay changes nothing for the
/// others.
fn payment_sequence(payment_id: &str) -> (Vec<AcceptRequest>, Vec<AcceptOutcome>) {
    let approve = notification(payment_id, "approved", &["undefined"], T0);
    let deny = notification(payment_id, "denied", &["undefined"], T0 + 1);
    let mut other_fingerprint = notification(payment_id, "approved", &["undefined"], T0 + 2);
    other_fingerprint.dedupe.fingerprint = Some("fp-2".into());
    let settle = notification(payment_id, "settled", &["approved"], T0 + 3);
    let again = notification(payment_id, "approved", &["undefined"], T0 + 4);
    let outcomes = vec![
        AcceptOutcome::Accepted,
        AcceptOutcome::InvalidTransition {
            from: "approved".into(),
        },
        AcceptOutcome::Conflict,
        AcceptOutcome::Accepted,
        AcceptOutcome::Replayed {
            response: approve.dedupe.response.clone(),
        },
    ];
    (
        vec![approve, deny, other_fingerprint, settle, again],
        outcomes,
    )
}

/// After [`payment_sequence`]: the payment is settled, and of its messages only the two
/// accepted ones exist.
async fn check_payment_sequence(s: &dyn Inspectable, payment_id: &str, requests: &[AcceptRequest]) {
    assert_eq!(
        s.payment_status(payment_id, T0 + 5)
            .await
            .unwrap()
            .as_deref(),
        Some("settled")
    );
    let listed = list_all(
        s,
        ListFilter {
            ordering_keys: Some(vec![payment::ordering_key(payment_id)]),
            limit: 10,
            ..Default::default()
        },
    )
    .await;
    let sent: BTreeSet<MessageId> = requests.iter().map(|r| r.message.id.clone()).collect();
    let recorded: Vec<MessageId> = ids(&listed)
        .into_iter()
        .filter(|id| sent.contains(id))
        .collect();
    let accepted = vec![
        requests[0].message.id.clone(),
        requests[3].message.id.clone(),
    ];
    assert_eq!(recorded, accepted);
}

async fn a_refused_transition_in_a_run_of_accepts_fails_only_itself(h: &Harness) {
    let s = h.s();
    let (requests, want) = payment_sequence("p-mid");
    let mut outcomes = Vec::new();
    for req in requests.clone() {
        outcomes.push(s.accept(req, T0).await.unwrap());
    }
    assert_eq!(outcomes, want);
    check_payment_sequence(s, "p-mid", &requests).await;
}

// ---------------------------------------------------------------------------------------
// Claiming, leases, completion

async fn claim_due_leases_only_due_messages(h: &Harness) {
    let s = h.s();
    let m = new_message("pay/1", T0);
    let deadline = m.deadline;
    let id = accept(s, m, T0).await;
    assert!(
        claim(s, T0 - 1, 10).await.is_empty(),
        "not due before its time"
    );

    let c = claim_one(s, T0, &id).await;
    assert_eq!((c.attempts, c.backoff_step, c.deadline), (0, 0, deadline));
    assert_eq!(c.message, get(s, &id).await.message);
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::InFlight);
    assert_eq!(record.next_attempt_at, None);

    assert!(claim(s, T0 + 1_000, 10).await.is_empty(), "leased");
    assert!(
        claim(s, T0 + LEASE_MS as i64 - 1, 10).await.is_empty(),
        "still leased"
    );
    assert!(complete(s, &c, Completion::Delivered, T0 + 2_000).await);
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Delivered);
    assert_eq!(record.next_attempt_at, None);
    assert_eq!(record.history, vec![delivery(1, T0 + 2_000, 500).into()]);
    assert!(
        claim(s, T0 + 10 * DAY_MS, 10).await.is_empty(),
        "finished for good"
    );
}

async fn an_expired_lease_is_claimed_again_with_a_new_token(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let first = claim_one(s, T0, &id).await;
    let expiry = T0 + LEASE_MS as i64;
    let second = claim_one(s, expiry, &id).await;
    assert!(
        second.token > first.token,
        "{} then {}",
        first.token,
        second.token
    );
    assert_eq!(second.attempts, 0, "a lost lease is not an attempt");

    // The worker that lost its lease cannot record anything.
    assert!(!complete(s, &first, Completion::Delivered, expiry + 1).await);
    assert!(!s.release(&first, expiry + 1).await.unwrap());
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::InFlight);
    assert!(record.history.is_empty());

    assert!(complete(s, &second, Completion::Delivered, expiry + 2).await);
    assert_eq!(get(s, &id).await.state, MessageState::Delivered);
}

async fn claim_due_never_returns_more_than_the_limit(h: &Harness) {
    let s = h.s();
    let mut all = BTreeSet::new();
    for i in 0..40 {
        all.insert(accept_new(s, &format!("key-{i}"), T0 + i).await);
    }
    let now = T0 + 100;
    let mut claimed = BTreeSet::new();
    for limit in [1, 5, 3] {
        let got = claim(s, now, limit).await;
        assert_eq!(got.len(), limit, "asked for {limit}");
        claimed.extend(got.into_iter().map(|c| c.message.id));
    }
    let rest = claim(s, now, 100).await;
    assert_eq!(rest.len(), 31);
    claimed.extend(rest.into_iter().map(|c| c.message.id));
    assert_eq!(claimed, all, "each message claimed exactly once");
    assert!(claim(s, now, 100).await.is_empty());
}

async fn a_retry_is_not_due_before_its_time(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    let next_at = T0 + 5_000;
    assert!(complete(s, &c, Completion::Retry { next_at }, T0 + 10).await);
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.next_attempt_at, Some(next_at));
    assert_eq!(record.history.len(), 1);

    assert!(claim(s, next_at - 1, 10).await.is_empty());
    let c = claim_one(s, next_at, &id).await;
    assert_eq!((c.attempts, c.backoff_step), (1, 1));
    assert!(
        complete(
            s,
            &c,
            Completion::Retry {
                next_at: next_at + 10_000
            },
            next_at
        )
        .await
    );
    let c = claim_one(s, next_at + 10_000, &id).await;
    assert_eq!((c.attempts, c.backoff_step), (2, 2));
    assert!(complete(s, &c, Completion::Dead, next_at + 10_001).await);
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Dead);
    assert_eq!(record.next_attempt_at, None);
    assert_eq!(record.history.len(), 3);
}

async fn one_ordering_key_is_delivered_in_order(h: &Harness) {
    let s = h.s();
    let m1 = accept_new(s, "pay/1", T0).await;
    let m2 = accept_new(s, "pay/1", T0 + 1).await;
    let m3 = accept_new(s, "pay/1", T0 + 2).await;
    let other = accept_new(s, "pay/2", T0 + 3).await;

    // Only the head of each key is due.
    let claimed = claim_exactly(s, T0 + 10, &[&m1, &other]).await;
    let c1 = claimed.iter().find(|c| c.message.id == m1).unwrap().clone();
    assert_eq!(get(s, &m2).await.next_attempt_at, None);
    assert_eq!(get(s, &m2).await.state, MessageState::Pending);

    // A retry keeps its place: m2 waits even though m1 is not due.
    assert!(
        complete(
            s,
            &c1,
            Completion::Retry {
                next_at: T0 + 1_000
            },
            T0 + 20
        )
        .await
    );
    assert!(claim(s, T0 + 30, 10).await.is_empty());
    let c1 = claim_one(s, T0 + 1_000, &m1).await;

    // Delivered: the next message is due at once.
    assert!(complete(s, &c1, Completion::Delivered, T0 + 1_001).await);
    assert_eq!(get(s, &m2).await.next_attempt_at, Some(T0 + 1_001));
    assert_eq!(get(s, &m3).await.next_attempt_at, None);
    let c2 = claim_one(s, T0 + 1_001, &m2).await;

    // Dead also lets the next one go.
    assert!(complete(s, &c2, Completion::Dead, T0 + 1_002).await);
    let c3 = claim_one(s, T0 + 1_002, &m3).await;
    assert!(complete(s, &c3, Completion::Delivered, T0 + 1_003).await);

    assert_eq!(get(s, &m1).await.state, MessageState::Delivered);
    assert_eq!(get(s, &m2).await.state, MessageState::Dead);
    assert_eq!(get(s, &m3).await.state, MessageState::Delivered);
    assert_eq!(get(s, &other).await.state, MessageState::InFlight);
}

async fn release_gives_the_lease_back(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    assert!(s.release(&c, T0 + 500).await.unwrap());
    assert!(!s.release(&c, T0 + 500).await.unwrap(), "no longer leased");
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.next_attempt_at, Some(T0 + 500));
    assert!(record.history.is_empty(), "a release is not an attempt");

    assert!(claim(s, T0 + 499, 10).await.is_empty());
    let again = claim_one(s, T0 + 500, &id).await;
    assert!(again.token > c.token);
    assert_eq!(again.attempts, 0);
    assert!(!complete(s, &c, Completion::Delivered, T0 + 501).await);
    assert!(complete(s, &again, Completion::Delivered, T0 + 502).await);
}

/// Two ordering keys in one Redis partition, so one claim script sees both.
fn keys_sharing_a_partition() -> (String, String) {
    let a = "pay/a".to_string();
    let b = (0..)
        .map(|i| format!("pay/b{i}"))
        .find(|k| partition_of(k, Partitions::DEFAULT) == partition_of(&a, Partitions::DEFAULT))
        .expect("some key shares the partition");
    (a, b)
}

async fn completion_after_lease_expiry_but_before_a_new_lease_is_final(h: &Harness) {
    let s = h.s();
    let (key_a, key_b) = keys_sharing_a_partition();
    let a = accept_new(s, &key_a, T0).await;
    let stale = claim_one(s, T0, &a).await;
    let b = accept_new(s, &key_b, T0 + 10).await;

    // A's lease has expired: it is due again, but B (due earlier) takes the only slot.
    let expiry = T0 + LEASE_MS as i64;
    let claimed = claim(s, expiry, 1).await;
    assert_eq!(ids_of(&claimed), vec![b.clone()]);

    // Nobody took A over, so its worker may still finish it, and that is final.
    assert!(complete(s, &stale, Completion::Delivered, expiry + 1).await);
    let record = get(s, &a).await;
    assert_eq!(record.state, MessageState::Delivered);
    assert_eq!(record.next_attempt_at, None);
    assert!(
        claim(s, expiry + 2, 10).await.is_empty(),
        "a delivered message came back"
    );
    assert_eq!(get(s, &a).await.state, MessageState::Delivered);
}

fn ids_of(claimed: &[Lease]) -> Vec<MessageId> {
    claimed.iter().map(|c| c.message.id.clone()).collect()
}

// ---------------------------------------------------------------------------------------
// Resend

async fn resend_requeues_dead_and_delivered_messages(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    assert!(
        complete(
            s,
            &c,
            Completion::Retry {
                next_at: T0 + 1_000
            },
            T0 + 1
        )
        .await
    );
    let c = claim_one(s, T0 + 1_000, &id).await;
    assert!(complete(s, &c, Completion::Dead, T0 + 1_001).await);

    let now = T0 + DAY_MS;
    let fresh = now + 7 * DAY_MS;
    assert_eq!(
        s.resend(&id, resend_mark(now), fresh, now).await.unwrap(),
        ResendEffect::Requeued
    );
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.deadline, fresh);
    assert_eq!(record.next_attempt_at, Some(now));
    assert_eq!(record.history.last(), Some(&resend_mark(now).into()));

    // The backoff starts over, the attempt count goes on, the window is the fresh one.
    let c = claim_one(s, now, &id).await;
    assert_eq!((c.attempts, c.backoff_step, c.deadline), (2, 0, fresh));
    assert!(complete(s, &c, Completion::Retry { next_at: now + 10 }, now + 1).await);
    let c = claim_one(s, now + 10, &id).await;
    assert_eq!((c.attempts, c.backoff_step), (3, 1));
    assert!(complete(s, &c, Completion::Delivered, now + 11).await);

    // From delivered too.
    let later = now + 2 * DAY_MS;
    assert_eq!(
        s.resend(&id, resend_mark(later), later + 7 * DAY_MS, later)
            .await
            .unwrap(),
        ResendEffect::Requeued
    );
    let c = claim_one(s, later, &id).await;
    assert_eq!(
        (c.attempts, c.backoff_step, c.deadline),
        (4, 0, later + 7 * DAY_MS)
    );
}

async fn resend_expedites_a_pending_message_and_the_schedule_resumes(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    let original = T0 + 60_000;
    assert!(complete(s, &c, Completion::Retry { next_at: original }, T0 + 1).await);

    let now = T0 + 1_000;
    assert_eq!(
        s.resend(&id, resend_mark(now), now + 7 * DAY_MS, now)
            .await
            .unwrap(),
        ResendEffect::Expedited
    );
    let record = get(s, &id).await;
    assert_eq!(record.next_attempt_at, Some(now));
    assert_eq!(record.deadline, c.deadline, "expediting keeps the window");

    // A second resend before the attempt keeps the original time to resume at.
    assert_eq!(
        s.resend(&id, resend_mark(now + 1), now + 7 * DAY_MS, now + 1)
            .await
            .unwrap(),
        ResendEffect::Expedited
    );
    let c = claim_one(s, now + 1, &id).await;
    assert_eq!((c.attempts, c.backoff_step), (1, 1));
    // The expedited attempt fails with a short backoff: the schedule resumes where it was.
    assert!(
        complete(
            s,
            &c,
            Completion::Retry {
                next_at: now + 2_000
            },
            now + 2
        )
        .await
    );
    assert_eq!(get(s, &id).await.next_attempt_at, Some(original));
    assert!(claim(s, original - 1, 10).await.is_empty());

    // Due already: expedited, and nothing moves.
    assert_eq!(
        s.resend(
            &id,
            resend_mark(original + 5),
            original + 7 * DAY_MS,
            original + 5
        )
        .await
        .unwrap(),
        ResendEffect::Expedited
    );
    assert_eq!(get(s, &id).await.next_attempt_at, Some(original));

    // Without a resend in between, a retry is scheduled as asked.
    let c = claim_one(s, original + 5, &id).await;
    let scheduled = original + 9_000;
    let retry = |next_at| Completion::Retry { next_at };
    assert!(complete(s, &c, retry(scheduled), original + 6).await);
    assert_eq!(get(s, &id).await.next_attempt_at, Some(scheduled));

    // An expedited attempt whose retry would come later than the original time does not
    // push the schedule back either.
    let resend_at = |at: Millis| s.resend(&id, resend_mark(at), at + 7 * DAY_MS, at);
    assert_eq!(
        resend_at(original + 10).await.unwrap(),
        ResendEffect::Expedited
    );
    let c = claim_one(s, original + 10, &id).await;
    assert!(complete(s, &c, retry(original + 60_000), original + 11).await);
    assert_eq!(get(s, &id).await.next_attempt_at, Some(scheduled));

    // When the original time has passed by the time the expedited attempt ends, the retry
    // is scheduled as asked.
    assert_eq!(
        resend_at(original + 20).await.unwrap(),
        ResendEffect::Expedited
    );
    let c = claim_one(s, original + 20, &id).await;
    assert!(complete(s, &c, retry(original + 20_000), scheduled + 1).await);
    assert_eq!(get(s, &id).await.next_attempt_at, Some(original + 20_000));
}

async fn resend_of_a_message_behind_another_is_queued(h: &Harness) {
    let s = h.s();
    let first = accept_new(s, "pay/1", T0).await;
    let second = accept_new(s, "pay/1", T0 + 1).await;
    assert_eq!(
        s.resend(&second, resend_mark(T0 + 2), T0 + 7 * DAY_MS, T0 + 2)
            .await
            .unwrap(),
        ResendEffect::Queued
    );
    let record = get(s, &second).await;
    assert_eq!(record.next_attempt_at, None);
    assert_eq!(record.history, vec![resend_mark(T0 + 2).into()]);
    claim_exactly(s, T0 + 3, &[&first]).await;
}

async fn resend_in_flight_delivers_once_more_after_the_current_attempt(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    assert_eq!(
        s.resend(&id, resend_mark(T0 + 1), T0 + 7 * DAY_MS, T0 + 1)
            .await
            .unwrap(),
        ResendEffect::AfterCurrent
    );
    assert_eq!(get(s, &id).await.state, MessageState::InFlight);
    assert!(complete(s, &c, Completion::Delivered, T0 + 100).await);
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.next_attempt_at, Some(T0 + 100));

    let c = claim_one(s, T0 + 100, &id).await;
    assert_eq!(c.attempts, 1);
    assert!(complete(s, &c, Completion::Delivered, T0 + 200).await);
    assert_eq!(
        get(s, &id).await.state,
        MessageState::Delivered,
        "once more, not forever"
    );
}

async fn resend_in_flight_survives_an_attempt_that_ends_the_message(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    let fresh_deadline = T0 + 7 * DAY_MS;
    assert_eq!(
        s.resend(&id, resend_mark(T0 + 1), fresh_deadline, T0 + 1)
            .await
            .unwrap(),
        ResendEffect::AfterCurrent
    );
    // The attempt in flight ends the message (410 Gone, or its window ran out)...
    assert!(complete(s, &c, Completion::Dead, T0 + 100).await);
    // ...but the operator's order stands: once more, now, with the fresh window.
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.next_attempt_at, Some(T0 + 100));
    let again = claim_one(s, T0 + 100, &id).await;
    assert_eq!(again.deadline, fresh_deadline);
}

async fn resend_skips_unknown_and_recorded_messages(h: &Harness) {
    let s = h.s();
    let unknown = MessageId::generate(T0, "pay/none", Partitions::DEFAULT);
    assert_eq!(
        s.resend(&unknown, resend_mark(T0), T0 + DAY_MS, T0)
            .await
            .unwrap(),
        ResendEffect::Skipped
    );
    assert_eq!(s.get(&unknown).await.unwrap(), None);

    let recorded = accept(
        s,
        NewMessage {
            target_url: None,
            ..inbound("payzu", "tx1", T0)
        },
        T0,
    )
    .await;
    assert_eq!(
        s.resend(&recorded, resend_mark(T0 + 1), T0 + DAY_MS, T0 + 1)
            .await
            .unwrap(),
        ResendEffect::Skipped
    );
    let record = get(s, &recorded).await;
    assert_eq!(record.state, MessageState::Recorded);
    assert!(record.history.is_empty());
}

async fn recorded_messages_are_never_claimed(h: &Harness) {
    let s = h.s();
    let id = accept(
        s,
        NewMessage {
            target_url: None,
            ..inbound("payzu", "tx1", T0)
        },
        T0,
    )
    .await;
    let record = get(s, &id).await;
    assert_eq!(record.state, MessageState::Recorded);
    assert_eq!(record.next_attempt_at, None);
    assert!(claim(s, T0 + DAY_MS, 10).await.is_empty());
    assert_eq!(s.depth().await.unwrap(), QueueDepth::default());
    let listed = list_all(
        s,
        ListFilter {
            state: Some(MessageState::Recorded),
            limit: 10,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&listed), vec![id.clone()]);

    // A recorded message does not hold up a later deliverable one of the same key.
    let next = accept(s, inbound("payzu", "tx1", T0 + 1), T0 + 1).await;
    claim_exactly(s, T0 + 1, &[&next]).await;
}

// ---------------------------------------------------------------------------------------
// Listing

async fn list_pages_have_no_gaps_or_duplicates(h: &Harness) {
    let s = h.s();
    let mut all = Vec::new();
    for i in 0..25 {
        all.push(accept_new(s, &format!("pay/{}", i % 6), T0 + i * 1_000).await);
    }
    let mut filter = ListFilter {
        limit: 7,
        ..Default::default()
    };
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        let page = s.list(&filter).await.unwrap();
        pages += 1;
        assert!(page.messages.len() <= 7);
        seen.extend(ids(&page.messages));
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => break,
        }
        assert!(pages < 10);
    }
    assert_eq!(seen, all, "ascending by id, each once");
    assert!(pages <= 5, "{pages} pages");
}

async fn list_pages_stay_consistent_while_messages_arrive(h: &Harness) {
    let s = h.s();
    let mut all = Vec::new();
    for i in 0..25 {
        all.push(accept_new(s, &format!("pay/{}", i % 4), T0 + i * 1_000).await);
    }
    let mut filter = ListFilter {
        limit: 7,
        ..Default::default()
    };
    let mut seen = Vec::new();
    let mut now = T0 + 100_000;
    for _ in 0..20 {
        let page = s.list(&filter).await.unwrap();
        seen.extend(ids(&page.messages));
        let Some(after) = page.next_after else { break };
        filter.after = Some(after);
        // New messages between pages (newer ids) show up at the end, not as gaps.
        for _ in 0..2 {
            now += 1_000;
            all.push(accept_new(s, &format!("pay/new{now}"), now).await);
        }
    }
    assert_eq!(seen, all);
}

async fn list_filters_by_state_source_key_and_window(h: &Harness) {
    let s = h.s();
    let mut payzu = Vec::new();
    let mut payzu_tx1 = Vec::new();
    let mut other = Vec::new();
    for i in 0..10 {
        let now = T0 + i * 1_000;
        if i % 3 == 0 {
            other.push(accept(s, inbound("other", &format!("tx{i}"), now), now).await);
        } else {
            let tx = format!("tx{}", i % 2);
            let id = accept(s, inbound("payzu", &tx, now), now).await;
            if tx == "tx1" {
                payzu_tx1.push(id.clone());
            }
            payzu.push(id);
        }
    }
    let delivered = claim(s, T0 + 20_000, 100).await;
    let delivered = delivered.iter().find(|c| c.message.id == payzu[0]).unwrap();
    assert!(complete(s, delivered, Completion::Delivered, T0 + 20_001).await);

    let by = |filter: ListFilter| list_all(s, ListFilter { limit: 3, ..filter });
    let source = by(ListFilter {
        source: Some("payzu".into()),
        ..Default::default()
    })
    .await;
    assert_eq!(ids(&source), payzu);
    let source = by(ListFilter {
        source: Some("other".into()),
        ..Default::default()
    })
    .await;
    assert_eq!(ids(&source), other);
    assert!(
        by(ListFilter {
            source: Some("nobody".into()),
            ..Default::default()
        })
        .await
        .is_empty()
    );

    let done = by(ListFilter {
        state: Some(MessageState::Delivered),
        ..Default::default()
    })
    .await;
    assert_eq!(ids(&done), vec![payzu[0].clone()]);
    assert!(done.iter().all(|r| r.state == MessageState::Delivered));

    let key = by(ListFilter {
        ordering_keys: Some(vec!["src/payzu/tx1".into()]),
        ..Default::default()
    })
    .await;
    assert_eq!(ids(&key), payzu_tx1);
    assert_eq!(payzu_tx1.len(), 3);

    // Key and state together.
    let key_done = by(ListFilter {
        ordering_keys: Some(vec![delivered.message.ordering_key.clone()]),
        state: Some(MessageState::Delivered),
        ..Default::default()
    })
    .await;
    assert_eq!(ids(&key_done), vec![payzu[0].clone()]);

    // The window is inclusive at both ends.
    let window = by(ListFilter {
        created_from: Some(T0 + 3_000),
        created_to: Some(T0 + 6_000),
        ..Default::default()
    })
    .await;
    let times: Vec<_> = window.iter().map(|r| r.message.created_at - T0).collect();
    assert_eq!(times, vec![3_000, 4_000, 5_000, 6_000]);

    let window_source = by(ListFilter {
        created_from: Some(T0 + 3_000),
        created_to: Some(T0 + 6_000),
        source: Some("other".into()),
        ..Default::default()
    })
    .await;
    let times: Vec<_> = window_source
        .iter()
        .map(|r| r.message.created_at - T0)
        .collect();
    assert_eq!(times, vec![3_000, 6_000]);
}

/// A filter that matches few messages must page through without dropping any, even when
/// the matches bunch up at the end of the scan.
async fn list_with_a_sparse_filter_loses_nothing(h: &Harness) {
    let s = h.s();
    let mut wanted = Vec::new();
    for (i, source) in ["a", "b", "b", "a", "a", "a"].iter().enumerate() {
        let now = T0 + i as i64 * 1_000;
        let id = accept(s, inbound(source, &format!("tx{i}"), now), now).await;
        if *source == "a" {
            wanted.push(id);
        }
    }
    for limit in 1..=6 {
        let listed = list_all(
            s,
            ListFilter {
                source: Some("a".into()),
                limit,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(ids(&listed), wanted, "limit {limit}");
    }
}

/// One transaction id in several sources (issue 22, item 8): a filter with several ordering
/// keys lists the messages of any of them, merged in id order across partitions and pages,
/// and combines with the other filters; an empty list selects nothing.
async fn list_by_several_ordering_keys_merges_them_in_id_order(h: &Harness) {
    let s = h.s();
    let mut wanted = Vec::new();
    for i in 0..12 {
        let now = T0 + i * 1_000;
        let source = ["a", "b", "c"][i as usize % 3];
        let tx = if i % 4 == 3 { "tx-other" } else { "tx-1" };
        let id = accept(s, inbound(source, tx, now), now).await;
        if tx == "tx-1" {
            wanted.push(id);
        }
    }
    let keys: Vec<String> = ["a", "b", "c", "nobody"]
        .iter()
        .map(|source| format!("src/{source}/tx-1"))
        .collect();
    for limit in [1, 2, 5, 100] {
        let listed = list_all(
            s,
            ListFilter {
                ordering_keys: Some(keys.clone()),
                limit,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(ids(&listed), wanted, "limit {limit}");
    }
    let in_b = list_all(
        s,
        ListFilter {
            ordering_keys: Some(keys.clone()),
            source: Some("b".into()),
            limit: 2,
            ..Default::default()
        },
    )
    .await;
    assert!(!in_b.is_empty());
    assert!(in_b.iter().all(|r| r.message.ordering_key == "src/b/tx-1"));
    let none = list_all(
        s,
        ListFilter {
            ordering_keys: Some(Vec::new()),
            limit: 5,
            ..Default::default()
        },
    )
    .await;
    assert!(none.is_empty(), "{none:?}");
}

// ---------------------------------------------------------------------------------------
// History, depth, operations, get

async fn history_rows_are_kept_in_order(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    let first = DeliveryAttempt {
        error: Some("timeout".into()),
        status: None,
        latency_ms: Some(10_000),
        ..delivery(1, T0 + 10_000, 0)
    };
    assert!(
        s.complete(
            &c,
            first.clone(),
            Completion::Retry {
                next_at: T0 + 20_000
            },
            T0 + 10_000
        )
        .await
        .unwrap()
    );
    let c = claim_one(s, T0 + 20_000, &id).await;
    let second = delivery(2, T0 + 20_100, 503);
    assert!(
        s.complete(&c, second.clone(), Completion::Dead, T0 + 20_100)
            .await
            .unwrap()
    );
    let mark = resend_mark(T0 + 30_000);
    s.resend(&id, mark.clone(), T0 + 8 * DAY_MS, T0 + 30_000)
        .await
        .unwrap();
    let c = claim_one(s, T0 + 30_000, &id).await;
    let third = delivery(3, T0 + 30_050, 204);
    assert!(
        s.complete(&c, third.clone(), Completion::Delivered, T0 + 30_050)
            .await
            .unwrap()
    );
    assert_eq!(
        get(s, &id).await.history,
        vec![first.into(), second.into(), mark.into(), third.into()]
    );
}

async fn depth_counts_pending_in_flight_and_dead(h: &Harness) {
    let s = h.s();
    assert_eq!(s.depth().await.unwrap(), QueueDepth::default());
    let dead = accept_new(s, "pay/1", T0).await;
    let delivered = accept_new(s, "pay/2", T0 + 1).await;
    let in_flight = accept_new(s, "pay/3", T0 + 2).await;
    accept_new(s, "pay/4", T0 + 3).await;
    accept_new(s, "pay/4", T0 + 4).await;
    accept(
        s,
        NewMessage {
            target_url: None,
            ..inbound("payzu", "tx", T0 + 5)
        },
        T0 + 5,
    )
    .await;
    assert_eq!(
        s.depth().await.unwrap(),
        QueueDepth {
            pending: 5,
            in_flight: 0,
            dead: 0
        }
    );
    let claimed = claim(s, T0 + 10, 10).await;
    assert_eq!(claimed.len(), 4);
    let by_id = |id: &MessageId| claimed.iter().find(|c| &c.message.id == id).unwrap();
    assert!(complete(s, by_id(&dead), Completion::Dead, T0 + 11).await);
    assert!(complete(s, by_id(&delivered), Completion::Delivered, T0 + 11).await);
    assert_eq!(get(s, &in_flight).await.state, MessageState::InFlight);
    assert_eq!(
        s.depth().await.unwrap(),
        QueueDepth {
            pending: 1,
            in_flight: 2,
            dead: 1
        }
    );
}

async fn operations_are_reserved_then_finished(h: &Harness) {
    let s = h.s();
    assert_eq!(
        s.reserve_operation("req-1", "fp-a", 60).await.unwrap(),
        OperationReservation::Fresh
    );
    assert_eq!(
        s.reserve_operation("req-1", "fp-a", 60).await.unwrap(),
        OperationReservation::InProgress
    );
    s.finish_operation("req-1", "fp-a", r#"{"resent":2}"#, 60)
        .await
        .unwrap();
    assert_eq!(
        s.reserve_operation("req-1", "fp-a", 60).await.unwrap(),
        OperationReservation::Done(r#"{"resent":2}"#.into())
    );
    assert_eq!(
        s.reserve_operation("req-2", "fp-a", 60).await.unwrap(),
        OperationReservation::Fresh
    );
    s.ping().await.unwrap();
}

async fn an_operation_reused_with_another_fingerprint_is_a_mismatch(h: &Harness) {
    let s = h.s();
    s.reserve_operation("req-1", "fp-a", 60).await.unwrap();
    // While it runs, and once it is done, another request body under the same id is refused
    // and changes nothing.
    assert_eq!(
        s.reserve_operation("req-1", "fp-b", 60).await.unwrap(),
        OperationReservation::Mismatch
    );
    assert_eq!(
        s.reserve_operation("req-1", "fp-a", 60).await.unwrap(),
        OperationReservation::InProgress
    );
    s.finish_operation("req-1", "fp-a", r#"{"resent":1}"#, 60)
        .await
        .unwrap();
    assert_eq!(
        s.reserve_operation("req-1", "fp-b", 60).await.unwrap(),
        OperationReservation::Mismatch
    );
    assert_eq!(
        s.reserve_operation("req-1", "fp-a", 60).await.unwrap(),
        OperationReservation::Done(r#"{"resent":1}"#.into())
    );
}

async fn a_partial_answer_is_recorded_even_without_a_live_reservation(h: &Harness) {
    let s = h.s();
    // The resend path after a store error: its reservation may have lapsed by the time the
    // store takes writes again; recording the (partial) answer must still stick, so the same
    // id never walks again.
    let partial = r#"{"resent":1,"messageIds":["m"],"more":false,"incomplete":true}"#;
    s.finish_operation("req-lapsed", "fp-a", partial, 60)
        .await
        .unwrap();
    assert_eq!(
        s.reserve_operation("req-lapsed", "fp-a", 60).await.unwrap(),
        OperationReservation::Done(partial.into())
    );
    // Recording again (a retried write that had landed) keeps one answer.
    s.finish_operation("req-lapsed", "fp-a", partial, 60)
        .await
        .unwrap();
    assert_eq!(
        s.reserve_operation("req-lapsed", "fp-a", 60).await.unwrap(),
        OperationReservation::Done(partial.into())
    );
}

async fn get_of_an_unknown_id_is_none(h: &Harness) {
    let s = h.s();
    accept_new(s, "pay/1", T0).await;
    assert_eq!(
        s.get(&MessageId::generate(T0, "pay/1", Partitions::DEFAULT))
            .await
            .unwrap(),
        None
    );
}

// ---------------------------------------------------------------------------------------
// Month two: lifetimes, seals, bounded history, sweeping

const PAYMENT_RETENTION_MS: Millis = 400 * DAY_MS;

async fn payment_state_outlives_its_dedupe_claims_then_ends_with_its_own_retention(h: &Harness) {
    let s = h.s();
    let step = |to: &str, from: &[&str], at: Millis| notification("p1", to, from, at);
    assert_eq!(
        s.accept(step("approved", &["undefined"], T0), T0)
            .await
            .unwrap(),
        AcceptOutcome::Accepted
    );
    let day1 = T0 + DAY_MS;
    assert_eq!(
        s.accept(step("settled", &["approved"], day1), day1)
            .await
            .unwrap(),
        AcceptOutcome::Accepted
    );
    // Day 60: every dedupe claim of the payment is gone (30-day TTL), its state is not.
    let day60 = T0 + 60 * DAY_MS;
    h.sweep_all(day60).await;
    assert_eq!(
        s.payment_status("p1", day60).await.unwrap().as_deref(),
        Some("settled")
    );
    assert_eq!(
        s.accept(step("refunded", &["settled"], day60), day60)
            .await
            .unwrap(),
        AcceptOutcome::Accepted,
        "a refund on day 60 finds the payment settled"
    );
    let day61 = T0 + 61 * DAY_MS;
    assert_eq!(
        s.accept(step("approved", &["undefined"], day61), day61)
            .await
            .unwrap(),
        AcceptOutcome::InvalidTransition {
            from: "refunded".into()
        },
        "a refunded payment is never approved again"
    );
    // The retention counts from the last transition (day 60), not from the first.
    let before_end = day60 + PAYMENT_RETENTION_MS - 1;
    assert_eq!(
        s.payment_status("p1", before_end).await.unwrap().as_deref(),
        Some("refunded")
    );
    let after_end = day60 + PAYMENT_RETENTION_MS;
    assert_eq!(s.payment_status("p1", after_end).await.unwrap(), None);
    h.sweep_all(after_end).await;
    assert_eq!(
        s.accept(step("approved", &["undefined"], after_end), after_end)
            .await
            .unwrap(),
        AcceptOutcome::Accepted,
        "past its retention the payment is unknown"
    );
}

async fn an_expired_claim_is_a_new_event(h: &Harness) {
    let s = h.s();
    let first = request("k", new_message("pay/1", T0));
    assert_eq!(
        s.accept(first.clone(), T0).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let end = T0 + TTL_SECS as Millis * 1000;
    let before = request("k", new_message("pay/1", end - 1));
    assert_eq!(
        s.accept(before, end - 1).await.unwrap(),
        AcceptOutcome::Replayed {
            response: first.dedupe.response.clone()
        }
    );
    let after = request("k", new_message("pay/1", end));
    assert_eq!(s.accept(after, end).await.unwrap(), AcceptOutcome::Accepted);
}

fn sealed(claim_key: &str, seal: &str, expires_at: Millis, now: Millis) -> AcceptRequest {
    AcceptRequest {
        seal: Some(SignatureSeal {
            key: seal.to_string(),
            expires_at,
        }),
        ..request(claim_key, inbound("payzu", "tx-1", now))
    }
}

async fn a_signature_is_single_use_while_it_could_verify(h: &Harness) {
    let s = h.s();
    let valid_until = T0 + 600_000;
    let first = sealed("tx-1/COMPLETED", "sig-1", valid_until, T0);
    assert_eq!(
        s.accept(first.clone(), T0).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let answer = AcceptOutcome::Replayed {
        response: first.dedupe.response.clone(),
    };
    // The same signature with the same dedupe key: a replay of the first answer.
    let again = sealed("tx-1/COMPLETED", "sig-1", valid_until, T0 + 500);
    let again_id = again.message.id.clone();
    assert_eq!(s.accept(again, T0 + 500).await.unwrap(), answer);
    assert_eq!(s.get(&again_id).await.unwrap(), None);
    // The same signature with another unsigned event header, so another dedupe key: refused
    // (issue 22, item 9), with nothing recorded and no key claimed.
    let reposted = sealed("tx-1/REFUNDED", "sig-1", valid_until, T0 + 1_000);
    let reposted_id = reposted.message.id.clone();
    assert_eq!(
        s.accept(reposted, T0 + 1_000).await.unwrap(),
        AcceptOutcome::SignatureReused
    );
    assert_eq!(s.get(&reposted_id).await.unwrap(), None);
    assert_eq!(
        s.depth().await.unwrap().pending,
        1,
        "only the first event is queued"
    );
    // The provider's real second event, signed again, claims that key as its own.
    let refund = sealed("tx-1/REFUNDED", "sig-refund", valid_until, T0 + 1_500);
    let refund_answer = AcceptOutcome::Replayed {
        response: refund.dedupe.response.clone(),
    };
    assert_eq!(
        s.accept(refund.clone(), T0 + 1_500).await.unwrap(),
        AcceptOutcome::Accepted
    );
    // A provider retry of the first event with a fresh signature is a replay, and seals that
    // signature to the same answer: under the other, live, claim it is refused too.
    let retry = sealed("tx-1/COMPLETED", "sig-2", valid_until, T0 + 2_000);
    assert_eq!(s.accept(retry, T0 + 2_000).await.unwrap(), answer);
    let elsewhere = sealed("tx-1/REFUNDED", "sig-2", valid_until, T0 + 3_000);
    assert_eq!(
        s.accept(elsewhere, T0 + 3_000).await.unwrap(),
        AcceptOutcome::SignatureReused
    );
    let refund_again = sealed("tx-1/REFUNDED", "sig-refund", valid_until, T0 + 3_500);
    assert_eq!(
        s.accept(refund_again, T0 + 3_500).await.unwrap(),
        refund_answer
    );
    assert_eq!(s.depth().await.unwrap().pending, 2);
    // Once the signature could no longer verify, the seal is gone: a new signature on
    // another event is that event.
    let later = sealed(
        "tx-1/CHARGEBACK",
        "sig-3",
        valid_until + 600_000,
        valid_until,
    );
    assert_eq!(
        s.accept(later.clone(), valid_until).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let sig1_later = sealed("tx-1/OTHER", "sig-1", valid_until + 600_000, valid_until);
    assert_eq!(
        s.accept(sig1_later, valid_until).await.unwrap(),
        AcceptOutcome::Accepted,
        "sig-1's seal ended at its time"
    );
}

/// A seal never outlives the claim it is sealed to: a signature that would verify longer
/// (`hmac-sha256` has no timestamp), sealed by a replay near the claim's end, ends with it,
/// so a live seal's claim is always live.
async fn a_seal_ends_with_its_claim_at_the_latest(h: &Harness) {
    let s = h.s();
    let first = request("tx-1/COMPLETED", inbound("payzu", "tx-1", T0));
    let first_answer = first.dedupe.response.clone();
    assert_eq!(s.accept(first, T0).await.unwrap(), AcceptOutcome::Accepted);
    let claim_ends = T0 + TTL_SECS as Millis * 1000;
    let replayed_at = claim_ends - DAY_MS;
    let forever = claim_ends + 30 * DAY_MS;
    let resigned = sealed("tx-1/COMPLETED", "sig-1", forever, replayed_at);
    assert_eq!(
        s.accept(resigned, replayed_at).await.unwrap(),
        AcceptOutcome::Replayed {
            response: first_answer
        }
    );
    // Past the claim's end the same bytes are a new event (as for a signature first accepted
    // then), before and after a sweep.
    let after = sealed("tx-1/COMPLETED", "sig-1", forever, claim_ends);
    assert_eq!(
        s.accept(after, claim_ends).await.unwrap(),
        AcceptOutcome::Accepted
    );
    h.sweep_all(claim_ends + DAY_MS).await;
    let swept = sealed("tx-1/OTHER", "sig-1", forever, claim_ends + DAY_MS);
    assert_eq!(
        s.accept(swept, claim_ends + DAY_MS).await.unwrap(),
        AcceptOutcome::SignatureReused,
        "the new event's seal is live, and this is another key"
    );
}

async fn history_keeps_the_first_and_the_latest_rows_and_counts_every_row(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/hostile", T0).await;
    let mut now = T0;
    for n in 1..=150u32 {
        let c = claim_one(s, now, &id).await;
        let row = delivery(n, now, 503);
        assert!(
            s.complete(&c, row, Completion::Retry { next_at: now + 1 }, now)
                .await
                .unwrap()
        );
        now += 1;
    }
    s.resend(&id, resend_mark(now), now + DAY_MS, now)
        .await
        .unwrap();
    let record = get(s, &id).await;
    assert_eq!(record.history_total, 151);
    assert_eq!(record.delivery_attempts, 150);
    assert_eq!(record.history.len(), 1 + callbackd::store::HISTORY_TAIL);
    assert_eq!(
        attempt_no(&record.history[0]),
        1,
        "the first attempt is kept"
    );
    let tail: Vec<u32> = record.history[1..].iter().map(attempt_no).collect();
    let want: Vec<u32> = (52..=150).chain([0]).collect();
    assert_eq!(tail, want, "then the latest 100 rows, in order");
}

/// A receiver's answer body is kept in the first row and the latest `ANSWER_BODY_ROWS` rows
/// (resend marks count as rows); an older row keeps everything else and says its body was
/// dropped, so a message retried for days stores a handful of bodies.
/// Bodies empty, short, compressible, incompressible and large (Redis keeps a record in
/// pieces, compressed when that is smaller: record.rs), with bytes JSON escapes, come back
/// from a claim and a read exactly as they were accepted.
async fn bodies_of_every_size_are_claimed_and_read_byte_for_byte(h: &Harness) {
    let s = h.s();
    let noise = |len: usize| -> String {
        // Incompressible: a xorshift stream of printable characters.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b' ' + (x % 94) as u8)
            })
            .collect()
    };
    let bodies = [
        String::new(),
        r#"{"a":1}"#.to_string(),
        format!(
            r#"{{"quoted":"\"\u00e9\n","text":"{}"}}"#,
            "pix ".repeat(400)
        ),
        noise(700),
        noise(70_000),
        r"ação — 支払い — \u0000 ".repeat(300),
    ];
    let mut ids = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        let message = NewMessage {
            body: body.clone(),
            ..new_message(&format!("bodies/{i}"), T0)
        };
        ids.push(accept(s, message, T0).await);
    }
    let refs: Vec<&MessageId> = ids.iter().collect();
    let leases = claim_exactly(s, T0, &refs).await;
    for (id, body) in ids.iter().zip(&bodies) {
        let lease = leases
            .iter()
            .find(|l| &l.message.id == id)
            .expect("claimed");
        assert_eq!(
            lease.message.body.as_bytes(),
            body.as_bytes(),
            "claimed {id}"
        );
        assert_eq!(
            get(s, id).await.message.body.as_bytes(),
            body.as_bytes(),
            "read {id}"
        );
    }
}

async fn only_the_first_and_the_latest_rows_keep_answer_bodies(h: &Harness) {
    use callbackd::store::ANSWER_BODY_ROWS;
    let s = h.s();
    let id = accept_new(s, "pay/chatty", T0).await;
    let mut now = T0;
    let mut rows: Vec<HistoryEntry> = Vec::new();
    for n in 1..=9u32 {
        let c = claim_one(s, now, &id).await;
        let row = delivery(n, now, 503);
        rows.push(row.clone().into());
        assert!(
            s.complete(&c, row, Completion::Retry { next_at: now + 1 }, now)
                .await
                .unwrap()
        );
        now += 1;
    }
    let mark = resend_mark(now);
    s.resend(&id, mark.clone(), now + DAY_MS, now)
        .await
        .unwrap();
    rows.push(mark.into());
    let c = claim_one(s, now, &id).await;
    let last = delivery(10, now, 503);
    assert!(
        s.complete(&c, last.clone(), Completion::Delivered, now)
            .await
            .unwrap()
    );
    rows.push(last.into());
    let kept_from = rows.len() - ANSWER_BODY_ROWS;
    let expected: Vec<HistoryEntry> = rows
        .into_iter()
        .enumerate()
        .map(|(i, mut row)| {
            if i >= 1 && i < kept_from {
                assert!(row.drop_answer_body());
            }
            row
        })
        .collect();
    let history = get(s, &id).await.history;
    let with_bodies: Vec<u32> = history
        .iter()
        .filter_map(|r| r.delivery())
        .filter(|d| d.response.as_ref().is_some_and(|a| !a.body.is_empty()))
        .map(|d| d.attempt)
        .collect();
    assert_eq!(with_bodies, vec![1, 7, 8, 9, 10]);
    assert_eq!(history, expected);
}

async fn list_pages_carry_counts_but_no_histories(h: &Harness) {
    let s = h.s();
    let id = accept_new(s, "pay/1", T0).await;
    let c = claim_one(s, T0, &id).await;
    complete(s, &c, Completion::Retry { next_at: T0 + 10 }, T0).await;
    let listed = list_all(
        s,
        ListFilter {
            limit: 10,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(listed.len(), 1);
    assert!(listed[0].history.is_empty(), "a list page loads no history");
    assert_eq!(listed[0].history_total, 1);
    assert_eq!(listed[0].delivery_attempts, 1);
    assert_eq!(get(s, &id).await.history.len(), 1, "the detail view does");
}

async fn everything_of_a_finished_message_is_swept_after_the_retention(h: &Harness) {
    let s = h.s();
    let baseline = h.footprint();
    let delivered = accept_new(s, "pay/a", T0).await;
    let dead = accept_new(s, "pay/b", T0).await;
    let mut recorded = inbound("quiet", "tx-9", T0);
    recorded.target_url = None;
    let recorded = accept(s, recorded, T0).await;
    let sealed_req = sealed("tx-1/COMPLETED", "sig", T0 + 600_000, T0);
    let sealed_id = sealed_req.message.id.clone();
    s.accept(sealed_req, T0).await.unwrap();
    for c in &claim_exactly(s, T0, &[&delivered, &dead, &sealed_id]).await {
        let outcome = if c.message.id == delivered {
            Completion::Delivered
        } else {
            Completion::Dead
        };
        complete(s, c, outcome, T0).await;
    }
    assert!(h.footprint() > baseline);
    // Nothing goes early: one millisecond before the retention ends, every message is there.
    let end = T0 + RETENTION_SECS as Millis * 1000;
    h.sweep_all(end - 1).await;
    for id in [&delivered, &dead, &recorded, &sealed_id] {
        assert!(
            s.get(id).await.unwrap().is_some(),
            "{id} kept until its end"
        );
    }
    h.sweep_all(end).await;
    for id in [&delivered, &dead, &recorded, &sealed_id] {
        assert_eq!(s.get(id).await.unwrap(), None, "{id} swept");
    }
    assert_eq!(h.footprint(), baseline, "no key or row left behind");
    let everything = list_all(
        s,
        ListFilter {
            limit: 50,
            ..Default::default()
        },
    )
    .await;
    assert!(everything.is_empty(), "no index entry left behind");
}

/// Checks a Redis partition's buckets of `state` (index.lua) hold exactly `ids`: each bucket
/// is named by a bound of the index, holds 1 to 128 ids from its bound up to the next one,
/// and is a listpack. Answers how many buckets there are.
fn redis_buckets_hold(
    server: &RedisServer,
    partition: u8,
    state: MessageState,
    ids: &[MessageId],
) -> usize {
    let index = format!("cb:{{p{partition:02}}}:fx:{}", state.as_str());
    let lines =
        |args: &[&str]| -> Vec<String> { server.cli(args).lines().map(str::to_string).collect() };
    let bounds = lines(&["ZRANGE", &index, "0", "-1"]);
    let mut names: Vec<String> = lines(&["KEYS", &format!("{index}:*")])
        .into_iter()
        .map(|k| k[index.len() + 1..].to_string())
        .collect();
    names.sort();
    assert_eq!(
        names, bounds,
        "every bucket is named by a bound, and only those"
    );
    let mut held = Vec::new();
    for (i, bound) in bounds.iter().enumerate() {
        let bucket = format!("{index}:{bound}");
        let members = lines(&["ZRANGE", &bucket, "0", "-1"]);
        assert!(
            (1..=128).contains(&members.len()),
            "{bucket}: {}",
            members.len()
        );
        assert_eq!(
            server.cli(&["OBJECT", "ENCODING", &bucket]),
            "listpack",
            "{bucket}"
        );
        let next = bounds.get(i + 1);
        for id in &members {
            assert!(
                id >= bound && next.is_none_or(|n| id < n),
                "{id} in {bucket}"
            );
        }
        held.extend(members);
    }
    let mut want: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    want.sort();
    assert_eq!(held, want);
    bounds.len()
}

/// Hundreds of finished messages in one partition, finished out of order: more than a Redis
/// bucket of the finished states' index holds (index.lua), so buckets fill, split in the
/// middle and at the end, and empty. Listing by state finds each message once, in order, a
/// page at a time and within a window, while resends take messages out of the middle and
/// bring them back, and the sweep leaves nothing behind.
async fn finished_messages_past_many_buckets_list_in_order_through_resends_and_sweeps(h: &Harness) {
    const N: usize = 300;
    let s = h.s();
    let baseline = h.footprint();
    let partition = partition_of("pay/fin-0", s.partitions());
    let in_partition = |key: &String| partition_of(key, s.partitions()) == partition;
    let keys: Vec<String> = (0..)
        .map(|i| format!("pay/fin-{i}"))
        .filter(in_partition)
        .take(N)
        .collect();
    let mut accepted = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        accepted.push(accept_new(s, key, T0 + i as Millis).await);
    }
    let recorded: Vec<MessageId> = {
        let mut recorded = Vec::new();
        for tx in (0..)
            .map(|i| format!("tx-fin-{i}"))
            .filter(|tx| in_partition(&format!("src/quiet/{tx}")))
            .take(40)
        {
            let mut message = inbound("quiet", &tx, T0 + 50 + recorded.len() as Millis);
            message.target_url = None;
            recorded.push(accept(s, message, T0 + 1_000).await);
        }
        recorded
    };
    // Claimed all, finished in an order that is not the ids' (7 is prime to N), and that
    // starts above the least of them.
    let now = T0 + 1_000;
    let mut leases = Vec::new();
    while leases.len() < N {
        let claimed = claim(s, now, 100).await;
        assert!(!claimed.is_empty(), "{} of {N} claimed", leases.len());
        leases.extend(claimed);
    }
    leases.sort_by(|a, b| a.message.id.cmp(&b.message.id));
    for i in 0..N {
        assert!(complete(s, &leases[(i * 7 + 3) % N], Completion::Delivered, now).await);
    }
    let listed_in = |state: MessageState, limit: usize| {
        list_all(
            s,
            ListFilter {
                limit,
                state: Some(state),
                ..Default::default()
            },
        )
    };
    let mut delivered = accepted.clone();
    delivered.sort();
    for limit in [7, 100, 1_000] {
        assert_eq!(
            ids(&listed_in(MessageState::Delivered, limit).await),
            delivered,
            "limit {limit}"
        );
    }
    assert_eq!(ids(&listed_in(MessageState::Recorded, 9).await), recorded);
    let window = list_all(
        s,
        ListFilter {
            limit: 13,
            state: Some(MessageState::Delivered),
            created_from: Some(T0 + 100),
            created_to: Some(T0 + 199),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&window), accepted[100..200]);
    let mut everything: Vec<MessageId> = delivered.iter().chain(&recorded).cloned().collect();
    everything.sort();
    let all = list_all(
        s,
        ListFilter {
            limit: 17,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&all), everything);
    // On Redis, the buckets themselves (the listings above cannot see an id left behind in
    // a bucket, since a record is listed only in its state).
    let buckets_hold = |ids: &[MessageId]| match &h.backend {
        Backend::Redis(server) | Backend::RedisWithReplica { master: server, .. } => Some(
            redis_buckets_hold(server, partition, MessageState::Delivered, ids),
        ),
        _ => None,
    };
    if let Some(buckets) = buckets_hold(&delivered) {
        assert!(buckets >= 3, "{buckets} buckets");
    }

    // Every third delivered message is resent, out of the middle of its bucket, and delivered
    // again.
    let later = now + DAY_MS;
    let resent: Vec<&MessageId> = delivered.iter().step_by(3).collect();
    for id in &resent {
        let effect = s
            .resend(id, resend_mark(later), later + 7 * DAY_MS, later)
            .await;
        assert_eq!(effect.unwrap(), ResendEffect::Requeued);
    }
    let left: Vec<MessageId> = delivered
        .iter()
        .filter(|id| !resent.contains(id))
        .cloned()
        .collect();
    assert_eq!(ids(&listed_in(MessageState::Delivered, 11).await), left);
    let pending: Vec<MessageId> = resent.iter().map(|id| (*id).clone()).collect();
    assert_eq!(ids(&listed_in(MessageState::Pending, 11).await), pending);
    let mut again = Vec::new();
    while again.len() < resent.len() {
        let claimed = claim(s, later, 100).await;
        assert!(!claimed.is_empty());
        again.extend(claimed);
    }
    buckets_hold(&left);
    for c in again.iter().rev() {
        assert!(complete(s, c, Completion::Delivered, later).await);
    }
    assert_eq!(
        ids(&listed_in(MessageState::Delivered, 50).await),
        delivered
    );
    buckets_hold(&delivered);

    // Those finished first end first: the sweep empties their buckets and leaves the others'.
    h.sweep_all(now + RETENTION_SECS as Millis * 1000).await;
    assert_eq!(ids(&listed_in(MessageState::Delivered, 50).await), pending);
    buckets_hold(&pending);
    h.sweep_all(later + RETENTION_SECS as Millis * 1000).await;
    assert!(listed_in(MessageState::Delivered, 50).await.is_empty());
    assert!(listed_in(MessageState::Recorded, 50).await.is_empty());
    assert_eq!(h.footprint(), baseline, "no bucket or key left behind");
}

// ---------------------------------------------------------------------------------------
// Retries scheduled days ahead

/// Accepts a message of `key` at `now`, claims it and schedules its retry at `next_at`.
async fn retried_at(s: &dyn Store, key: &str, now: Millis, next_at: Millis) -> MessageId {
    let id = accept_new(s, key, now).await;
    let c = claim_one(s, now, &id).await;
    assert!(complete(s, &c, Completion::Retry { next_at }, now).await);
    id
}

async fn retries_days_ahead_become_due_exactly_at_their_time(h: &Harness) {
    let s = h.s();
    let (key_a, key_b) = keys_sharing_a_partition();
    // Times on a minute boundary, just before and after one, hours apart, and two in one
    // minute of one partition; one released (not retried) days ahead.
    let minute = 60_000;
    let day3 = (T0 + 3 * DAY_MS) / minute * minute;
    let plan = [
        (key_a.as_str(), day3),
        (key_b.as_str(), day3 + 1),
        ("far/3", day3 - 1),
        ("far/4", day3 + minute - 1),
        ("far/5", day3 + 12 * 3_600_000 + 7),
        ("far/6", T0 + 30 * DAY_MS + 5),
    ];
    let mut due = Vec::new();
    for (i, (key, at)) in plan.iter().enumerate() {
        let id = retried_at(s, key, T0 + i as Millis, *at).await;
        due.push((*at, id));
    }
    let released = accept_new(s, "far/released", T0 + 10).await;
    let lease = claim_one(s, T0 + 10, &released).await;
    let released_at = T0 + 4 * DAY_MS + 3;
    assert!(s.release(&lease, released_at).await.unwrap());
    due.push((released_at, released));
    for (at, id) in &due {
        assert_eq!(get(s, id).await.next_attempt_at, Some(*at), "{id}");
    }
    // Claims along the way (a day before, minutes before, the millisecond before) take
    // nothing early, and each message is claimed at its time, with its history.
    due.sort();
    let mut last = T0 + 10;
    for (at, id) in &due {
        for probe in [at - DAY_MS, at - 2 * minute, at - minute / 2, at - 1] {
            if probe > last {
                assert!(
                    claim(s, probe, 100).await.is_empty(),
                    "nothing due at {} (next {id} at {})",
                    probe - T0,
                    at - T0
                );
                last = probe;
            }
        }
        assert_eq!(get(s, id).await.next_attempt_at, Some(*at), "{id}");
        let c = claim_one(s, *at, id).await;
        last = *at;
        assert!(complete(s, &c, Completion::Delivered, *at).await);
        assert_eq!(get(s, id).await.state, MessageState::Delivered);
    }
    assert!(claim(s, T0 + 60 * DAY_MS, 100).await.is_empty());
}

async fn order_per_key_is_kept_across_far_retries(h: &Harness) {
    let s = h.s();
    let (key, neighbour) = keys_sharing_a_partition();
    let first = accept_new(s, &key, T0).await;
    let second = accept_new(s, &key, T0 + 1).await;
    let third = accept_new(s, &key, T0 + 2).await;
    let day2 = T0 + 2 * DAY_MS;
    let c = claim_one(s, T0 + 3, &first).await;
    assert!(complete(s, &c, Completion::Retry { next_at: day2 }, T0 + 3).await);
    // Another key of the partition waits in the same minute.
    let other = retried_at(s, &neighbour, T0 + 4, day2 + 10).await;
    for probe in [T0 + DAY_MS, day2 - 60_000, day2 - 1] {
        assert!(claim(s, probe, 100).await.is_empty(), "{}", probe - T0);
    }
    assert_eq!(
        get(s, &second).await.next_attempt_at,
        None,
        "behind the head"
    );

    // Retried again, days ahead: its successors keep waiting behind it.
    let c = claim_one(s, day2, &first).await;
    let day7 = day2 + 5 * DAY_MS;
    assert!(complete(s, &c, Completion::Retry { next_at: day7 }, day2).await);
    let c = claim_one(s, day2 + 10, &other).await;
    assert!(complete(s, &c, Completion::Delivered, day2 + 10).await);
    assert!(claim(s, day7 - 1, 100).await.is_empty());
    let c = claim_one(s, day7, &first).await;
    assert!(complete(s, &c, Completion::Delivered, day7).await);

    // The successor is due at once; its own retry days ahead holds the third back.
    let c = claim_one(s, day7, &second).await;
    let day8 = day7 + DAY_MS;
    assert!(complete(s, &c, Completion::Retry { next_at: day8 }, day7).await);
    assert!(claim(s, day8 - 1, 100).await.is_empty());
    let c = claim_one(s, day8, &second).await;
    assert!(complete(s, &c, Completion::Dead, day8).await);
    let c = claim_one(s, day8, &third).await;
    assert!(complete(s, &c, Completion::Delivered, day8).await);
    let states = [
        get(s, &first).await.state,
        get(s, &second).await.state,
        get(s, &third).await.state,
    ];
    assert_eq!(
        states,
        [
            MessageState::Delivered,
            MessageState::Dead,
            MessageState::Delivered
        ]
    );
}

async fn resend_expedites_a_message_retried_days_ahead(h: &Harness) {
    let s = h.s();
    let (key, neighbour) = keys_sharing_a_partition();
    let original = T0 + 3 * DAY_MS;
    let id = retried_at(s, &key, T0, original).await;
    // A neighbour in the same minute is not disturbed by the expedite.
    let other = retried_at(s, &neighbour, T0 + 1, original + 1).await;

    let now = T0 + 1_000;
    assert_eq!(
        s.resend(&id, resend_mark(now), now + 7 * DAY_MS, now)
            .await
            .unwrap(),
        ResendEffect::Expedited
    );
    assert_eq!(get(s, &id).await.next_attempt_at, Some(now));
    let c = claim_one(s, now, &id).await;
    assert_eq!((c.attempts, c.backoff_step), (1, 1));
    // The expedited attempt fails with a short backoff: the schedule resumes days ahead.
    let retry = Completion::Retry {
        next_at: now + 2_000,
    };
    assert!(complete(s, &c, retry, now + 1).await);
    assert_eq!(get(s, &id).await.next_attempt_at, Some(original));
    assert_eq!(get(s, &other).await.next_attempt_at, Some(original + 1));
    assert!(
        claim(s, now + 2_000, 100).await.is_empty(),
        "resumed, not early"
    );
    assert!(claim(s, original - 1, 100).await.is_empty());
    let both = claim_exactly(s, original + 1, &[&id, &other]).await;
    for c in &both {
        assert!(complete(s, c, Completion::Delivered, original + 1).await);
    }

    // Expedited after its time has passed (no claim in between): due already, nothing moves.
    let late = retried_at(s, "far/late", original + 2, original + 2 * DAY_MS).await;
    let after = original + 3 * DAY_MS;
    assert_eq!(
        s.resend(&late, resend_mark(after), after + 7 * DAY_MS, after)
            .await
            .unwrap(),
        ResendEffect::Expedited
    );
    assert_eq!(
        get(s, &late).await.next_attempt_at,
        Some(original + 2 * DAY_MS)
    );
    claim_one(s, after, &late).await;
}

async fn a_message_retried_past_its_deadline_is_swept_after_the_retention(h: &Harness) {
    let s = h.s();
    let baseline = h.footprint();
    let m = new_message("far/deadline", T0);
    let deadline = m.deadline;
    let id = accept(s, m, T0).await;
    let c = claim_one(s, T0, &id).await;
    let next_at = deadline + 3 * DAY_MS;
    assert!(complete(s, &c, Completion::Retry { next_at }, T0).await);
    h.sweep_all(next_at - 1).await;
    assert_eq!(
        get(s, &id).await.state,
        MessageState::Pending,
        "never swept while unfinished"
    );
    assert!(claim(s, next_at - 1, 100).await.is_empty());
    // Due at its time with the deadline passed: the dispatcher ends it.
    let c = claim_one(s, next_at, &id).await;
    assert_eq!(c.deadline, deadline);
    assert!(complete(s, &c, Completion::Dead, next_at).await);
    let end = next_at + RETENTION_SECS as Millis * 1000;
    h.sweep_all(end - 1).await;
    assert_eq!(get(s, &id).await.state, MessageState::Dead);
    h.sweep_all(end).await;
    assert_eq!(s.get(&id).await.unwrap(), None);
    assert_eq!(h.footprint(), baseline, "no key or row left behind");
}

async fn a_forty_day_clock_jump_claims_everything_due(h: &Harness) {
    let s = h.s();
    let mut due = BTreeSet::new();
    let mut later = BTreeSet::new();
    let mut behind = BTreeSet::new();
    for i in 0..60i64 {
        let key = format!("jump/{i}");
        // Spread over the 40 days, a few of them past the jump.
        let at = T0 + (1 + i * 17 % 44) * DAY_MS + i * 3_600_007 % DAY_MS;
        let id = retried_at(s, &key, T0 + i, at).await;
        if at <= T0 + 40 * DAY_MS {
            due.insert(id);
        } else {
            later.insert(id);
        }
        if i % 10 == 0 {
            behind.insert(accept_new(s, &key, T0 + 100 + i).await);
        }
    }
    assert!(!due.is_empty() && !later.is_empty());
    let jump = T0 + 40 * DAY_MS;
    let mut claimed = BTreeSet::new();
    for _ in 0..100 {
        let got = claim(s, jump, 7).await;
        if got.is_empty() {
            break;
        }
        for c in &got {
            assert!(claimed.insert(c.message.id.clone()), "claimed twice");
            assert!(complete(s, c, Completion::Dead, jump).await);
        }
    }
    let due_heads: BTreeSet<_> = due.iter().cloned().collect();
    let successors: BTreeSet<_> = claimed.difference(&due_heads).cloned().collect();
    assert!(due_heads.is_subset(&claimed), "every due head is claimed");
    assert!(successors.is_subset(&behind), "then only their successors");
    assert!(claimed.is_disjoint(&later), "nothing early");
    // Each successor of a due head is due once its head is done.
    let waiting: BTreeSet<_> = behind.difference(&successors).cloned().collect();
    for id in &waiting {
        assert_eq!(
            get(s, id).await.next_attempt_at,
            None,
            "behind a later head"
        );
    }
    let rest = claim(s, T0 + 46 * DAY_MS, 1000).await;
    let rest: BTreeSet<_> = rest.into_iter().map(|c| c.message.id).collect();
    assert_eq!(rest, later);
}

// ---------------------------------------------------------------------------------------
// Upgrades from the first release's layout (fixtures written by it: tests/fixtures/)

/// What the fixture's traffic left behind, checked on a store upgraded from it at `now`
/// (shortly after the fixture was written, as far as its lifetimes are concerned).
async fn the_upgraded_fixture_keeps_its_data(h: &Harness, now: Millis) {
    let s = h.s();
    assert_eq!(
        s.partitions(),
        Partitions::LEGACY,
        "a store of the first release keeps its 16 partitions"
    );
    // A provider retry of a callback acknowledged before the upgrade is still a replay.
    let body = serde_json::json!({"id": "tx-1", "status": "COMPLETED", "type": "DEPOSIT", "method": "PIX"});
    let key = callbackd::inbound::dedupe::derive(
        "payzu",
        &body,
        None,
        &callbackd::inbound::dedupe::DEFAULT_FIELDS,
    )
    .expect("fixture body has a key");
    let ordering_key = format!("src/payzu/{}", key.transaction_id);
    let retry = AcceptRequest {
        dedupe: DedupeClaim {
            key: key.key,
            ttl_secs: TTL_SECS,
            fingerprint: None,
            response: "not the stored one".into(),
        },
        ..request(
            "unused",
            NewMessage {
                id: MessageId::generate(now, &ordering_key, s.partitions()),
                ..new_message(&ordering_key, now)
            },
        )
    };
    let AcceptOutcome::Replayed { response } = s.accept(retry, now).await.unwrap() else {
        panic!("a callback acknowledged by the old layout must replay");
    };
    assert!(response.contains("msg_"), "{response}");

    // Payment states survive, and now outlive the 30 days their claims had.
    let day40 = now + 40 * DAY_MS;
    for (payment, status) in [
        ("pay-ok", "settled"),
        ("pay-fail", "approved"),
        ("pay-gone", "approved"),
    ] {
        assert_eq!(
            s.payment_status(payment, day40).await.unwrap().as_deref(),
            Some(status),
            "{payment}"
        );
    }

    let all = list_all(
        s,
        ListFilter {
            limit: 100,
            ..Default::default()
        },
    )
    .await;
    let state_of = |payment: &str| {
        all.iter()
            .filter(|r| r.message.payment_id.as_deref() == Some(payment))
            .map(|r| (r.state, r.message.id.clone()))
            .collect::<Vec<_>>()
    };
    let [(MessageState::Dead, dead)] = &state_of("pay-gone")[..] else {
        panic!("pay-gone: {:?}", state_of("pay-gone"));
    };
    let dead = get(s, dead).await;
    assert_eq!((dead.history.len(), dead.history_total), (1, 1));
    assert_eq!(dead.history[0].delivery().and_then(|d| d.status), Some(410));
    assert_eq!(state_of("pay-ok").len(), 2);
    assert!(
        state_of("pay-ok")
            .iter()
            .all(|(st, _)| *st == MessageState::Delivered)
    );
    assert_eq!(
        all.iter()
            .filter(|r| r.state == MessageState::Recorded)
            .count(),
        3,
        "the payzu callbacks"
    );

    // The pending retry is due at its old schedule (initial backoff 1 h) and goes on.
    let [(MessageState::Pending, pending)] = &state_of("pay-fail")[..] else {
        panic!("pay-fail: {:?}", state_of("pay-fail"));
    };
    let later = now + 2 * 3_600_000;
    let claimed = claim_one(s, later, pending).await;
    assert_eq!(
        claimed.attempts, 1,
        "its first failed attempt is remembered"
    );
    complete(s, &claimed, Completion::Dead, later).await;
    let record = get(s, pending).await;
    assert_eq!(record.history_total, 2);
    assert_eq!(record.delivery_attempts, 2);

    // Past every retention, everything of the old messages is gone too, index entries
    // included; only the payment states (400 days) remain.
    let past = later + RETENTION_SECS as Millis * 1000;
    h.sweep_all(past).await;
    let left = list_all(
        s,
        ListFilter {
            limit: 100,
            ..Default::default()
        },
    )
    .await;
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        s.payment_status("pay-ok", past).await.unwrap().as_deref(),
        Some("settled")
    );
}

/// Accepts a message under `ordering_key` whose body (a payment of 20 items, about 700 bytes of
/// JSON) compresses well, as a store upgraded from a release's fixture would take it: its id,
/// its body, and the length of its record as JSON.
async fn accept_compressible(
    s: &dyn Inspectable,
    ordering_key: &str,
    now: Millis,
) -> (MessageId, String, usize) {
    let body = serde_json::json!({
        "paymentId": "pay-after-upgrade",
        "status": "approved",
        "items": (0..20)
            .map(|i| serde_json::json!({"sku": format!("sku-{i}"), "quantity": 1}))
            .collect::<Vec<_>>(),
    })
    .to_string();
    let mut fresh = NewMessage {
        body: body.clone(),
        ..new_message(ordering_key, now)
    };
    fresh.id = MessageId::generate(now, &fresh.ordering_key, s.partitions());
    let id = fresh.id.clone();
    let json_len = serde_json::to_string(&fresh).unwrap().len();
    assert_eq!(
        s.accept(request(&format!("claim/{ordering_key}"), fresh), now)
            .await
            .unwrap(),
        AcceptOutcome::Accepted
    );
    (id, body, json_len)
}

/// What the second release's fixtures (tests/fixtures/make_sqlite_v2.rs, make_redis_v2.rs:
/// the same story on a virtual clock starting at `T0`) left behind, checked on a store
/// upgraded from one: every record, history, claim, payment state, seal and operation is
/// still there, and every message goes on from where it was. Redis layout 3's fixture
/// (make_redis_v3.rs) tells the same story under `v3` names instead of `v2`.
async fn the_release_fixture_goes_on(s: &dyn Inspectable, v: &str) {
    const HOUR_MS: Millis = 3_600_000;
    // New requests name a partition of this store (an old store keeps its 16).
    let in_store = |mut req: AcceptRequest| {
        req.message.id = MessageId::generate(
            req.message.created_at,
            &req.message.ordering_key,
            s.partitions(),
        );
        req
    };
    let now = T0 + 10_000;
    let all = list_all(
        s,
        ListFilter {
            limit: 100,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(all.len(), 11);
    let of_key = |key: &str| -> Vec<MessageRecord> {
        all.iter()
            .filter(|r| r.message.ordering_key == key)
            .cloned()
            .collect()
    };
    let one = |key: &str| -> MessageRecord {
        let [record] = &of_key(key)[..] else {
            panic!("{key}: {:?}", of_key(key));
        };
        record.clone()
    };
    let statuses = |r: &MessageRecord| {
        r.history
            .iter()
            .map(|a| a.delivery().and_then(|d| d.status))
            .collect::<Vec<_>>()
    };
    let kinds = |r: &MessageRecord| {
        r.history
            .iter()
            .map(HistoryEntry::kind)
            .collect::<Vec<_>>()
            .join(",")
    };

    let delivered = get(s, &one(&format!("{v}/delivered")).message.id).await;
    assert_eq!(delivered.state, MessageState::Delivered);
    assert_eq!(statuses(&delivered), [Some(503), Some(200)]);
    assert_eq!(
        (delivered.history_total, delivered.delivery_attempts),
        (2, 2)
    );
    let dead = get(s, &one(&format!("{v}/dead")).message.id).await;
    assert_eq!(dead.state, MessageState::Dead);
    assert_eq!(statuses(&dead), [Some(410)]);
    let retrying = get(s, &one(&format!("{v}/retrying")).message.id).await;
    assert_eq!(retrying.state, MessageState::Pending);
    assert_eq!(retrying.next_attempt_at, Some(T0 + HOUR_MS));
    assert_eq!(retrying.delivery_attempts, 1);
    let expedited = get(s, &one(&format!("{v}/expedited")).message.id).await;
    assert_eq!(expedited.next_attempt_at, Some(T0 + 900));
    assert_eq!(kinds(&expedited), "delivery,resend");
    let requeued = get(s, &one(&format!("{v}/requeued")).message.id).await;
    assert_eq!(requeued.state, MessageState::Pending);
    assert_eq!(requeued.next_attempt_at, Some(T0 + 900));
    assert_eq!(requeued.deadline, T0 + 900 + 7 * DAY_MS);
    assert_eq!(kinds(&requeued), "delivery,resend");
    let leased = one(&format!("{v}/leased"));
    assert_eq!(leased.state, MessageState::InFlight);
    let leased_resent = get(s, &one(&format!("{v}/leased-resent")).message.id).await;
    assert_eq!(leased_resent.state, MessageState::InFlight);
    assert_eq!(leased_resent.deadline, T0 + 800 + 7 * DAY_MS);
    assert_eq!(kinds(&leased_resent), "resend");
    let fresh = one(&format!("{v}/fresh"));
    assert_eq!(fresh.state, MessageState::Pending);
    assert_eq!(fresh.next_attempt_at, Some(T0 + 1_000));
    let payments = of_key(&payment::ordering_key(&format!("pay-{v}")));
    let [pay1, pay2] = &payments[..] else {
        panic!("pay-{v}: {payments:?}");
    };
    assert_eq!(
        (
            pay1.state,
            pay1.next_attempt_at,
            pay2.state,
            pay2.next_attempt_at
        ),
        (
            MessageState::Pending,
            Some(T0 + 1_000),
            MessageState::Pending,
            None
        ),
        "only the head of the payment's queue is due"
    );
    let recorded = one(&format!("src/payzu/tx-{v}"));
    assert_eq!(recorded.state, MessageState::Recorded);
    assert_eq!(
        s.depth().await.unwrap(),
        QueueDepth {
            pending: 6,
            in_flight: 2,
            dead: 1
        }
    );
    assert_eq!(
        s.oldest_unfinished().await.unwrap().as_ref(),
        Some(&requeued.message.id)
    );

    // Every acknowledged request still replays its first answer, or conflicts.
    let answer = |id: &MessageId| format!(r#"{{"messageId":"{id}"}}"#);
    for record in all
        .iter()
        .filter(|r| r.message.ordering_key.starts_with(&format!("{v}/")))
    {
        let key = &record.message.ordering_key;
        let mut retry = in_store(request(&format!("claim/{key}"), new_message(key, now)));
        assert_eq!(
            s.accept(retry.clone(), now).await.unwrap(),
            AcceptOutcome::Replayed {
                response: answer(&record.message.id)
            },
            "{key}"
        );
        retry.dedupe.fingerprint = Some("another request".into());
        assert_eq!(s.accept(retry, now).await.unwrap(), AcceptOutcome::Conflict);
    }
    assert_eq!(
        s.accept(
            in_store(notification(
                &format!("pay-{v}"),
                "settled",
                &["approved"],
                now
            )),
            now
        )
        .await
        .unwrap(),
        AcceptOutcome::Replayed {
            response: answer(&pay2.message.id)
        }
    );
    assert_eq!(
        s.accept(
            in_store(notification(
                &format!("pay-{v}"),
                "refunded",
                &["approved"],
                now
            )),
            now
        )
        .await
        .unwrap(),
        AcceptOutcome::InvalidTransition {
            from: "settled".into()
        }
    );
    assert_eq!(
        s.payment_status(&format!("pay-{v}"), now)
            .await
            .unwrap()
            .as_deref(),
        Some("settled")
    );
    // The seal the older release wrote (its first answer) still answers the same signature
    // under its own claim key, and refuses it under any other (of the same transaction: on
    // Redis a seal lives in its transaction's partition).
    let resigned = |claim_key: &str| AcceptRequest {
        seal: Some(SignatureSeal {
            key: format!("seal/{v}"),
            expires_at: T0 + 300_000,
        }),
        ..request(claim_key, inbound("payzu", &format!("tx-{v}"), now))
    };
    assert_eq!(
        s.accept(in_store(resigned(&format!("claim/src/payzu/tx-{v}"))), now)
            .await
            .unwrap(),
        AcceptOutcome::Replayed {
            response: answer(&recorded.message.id)
        }
    );
    assert_eq!(
        s.accept(in_store(resigned("another/claim")), now)
            .await
            .unwrap(),
        AcceptOutcome::SignatureReused
    );
    for (key, fingerprint, found) in [
        (
            &format!("op/{v}-done"),
            "fp-op",
            OperationReservation::Done(r#"{"resent":1}"#.into()),
        ),
        (
            &format!("op/{v}-running"),
            "fp-op",
            OperationReservation::InProgress,
        ),
        (
            &format!("op/{v}-running"),
            "fp-other",
            OperationReservation::Mismatch,
        ),
    ] {
        assert_eq!(
            s.reserve_operation(key, fingerprint, 3600).await.unwrap(),
            found,
            "{key}"
        );
    }

    // The due messages are claimed, with their counts and lease tokens carried over.
    let leases = claim_exactly(
        s,
        now,
        &[
            &fresh.message.id,
            &expedited.message.id,
            &requeued.message.id,
            &pay1.message.id,
        ],
    )
    .await;
    let lease_of = |id: &MessageId| {
        leases
            .iter()
            .find(|l| l.message.id == *id)
            .expect("leased")
            .clone()
    };
    let requeued_lease = lease_of(&requeued.message.id);
    assert_eq!(
        (
            requeued_lease.token,
            requeued_lease.attempts,
            requeued_lease.backoff_step
        ),
        (2, 1, 0),
        "a resend of a finished message starts its backoff over"
    );
    let expedited_lease = lease_of(&expedited.message.id);
    assert_eq!(
        (expedited_lease.attempts, expedited_lease.backoff_step),
        (1, 1)
    );
    assert_eq!(lease_of(&fresh.message.id).token, 1);

    // The expedited attempt fails: the schedule resumes at the time the resend moved.
    let next_at = Completion::Retry {
        next_at: now + 1_000,
    };
    assert!(complete(s, &expedited_lease, next_at, now).await);
    assert_eq!(
        get(s, &expedited.message.id).await.next_attempt_at,
        Some(T0 + 2 * HOUR_MS)
    );
    for id in [&fresh.message.id, &requeued.message.id, &pay1.message.id] {
        assert!(complete(s, &lease_of(id), Completion::Delivered, now).await);
    }
    let pay2_lease = claim_one(s, now + 1, &pay2.message.id).await;
    assert!(complete(s, &pay2_lease, Completion::Delivered, now + 1).await);

    // The lease taken before the upgrade still finishes its attempt; the resend that
    // arrived meanwhile delivers once more.
    let old_lease = Lease {
        message: leased_resent.message.clone(),
        token: 1,
        attempts: 0,
        backoff_step: 0,
        deadline: leased_resent.deadline,
        resume_at: None,
        again: false,
    };
    assert!(complete(s, &old_lease, Completion::Delivered, now + 2).await);
    let again = claim_one(s, now + 2, &leased_resent.message.id).await;
    assert_eq!((again.token, again.attempts), (2, 1));
    assert!(complete(s, &again, Completion::Delivered, now + 3).await);

    // The other lease runs out at T0 + 30.7 s and is taken over with a new token.
    let taken_over = claim_one(s, T0 + 31_000, &leased.message.id).await;
    assert_eq!(taken_over.token, 2);
    assert!(complete(s, &taken_over, Completion::Dead, T0 + 31_000).await);
    assert_eq!(
        s.depth().await.unwrap(),
        QueueDepth {
            pending: 2,
            in_flight: 0,
            dead: 2
        }
    );
}

#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct RedisFixture {
    dumped_at_ms: Millis,
    keys: Vec<FixtureKey>,
}

#[derive(serde::Deserialize)]
struct FixtureKey {
    key: String,
    #[serde(rename = "type")]
    kind: String,
    pttl: i64,
    value: serde_json::Value,
}

// ---------------------------------------------------------------------------------------
// Backend-specific

mod redis_only {
    use super::*;

    /// Writes the fixture's keys as the first release left them, TTLs included.
    async fn load_fixture(url: &str) -> Millis {
        load_redis_fixture(url, include_str!("fixtures/redis_v1.json")).await
    }

    /// A dumped value: text, or `{"hex": ...}` when it is not UTF-8 (make_redis_fixture.rs).
    fn fixture_bytes(value: &serde_json::Value) -> Vec<u8> {
        match value.as_str() {
            Some(text) => text.as_bytes().to_vec(),
            None => hex::decode(value["hex"].as_str().expect("text or hex")).expect("hex"),
        }
    }

    /// Writes a dumped fixture's keys (tests/fixtures/redis_v*.json), TTLs included, and
    /// answers when it was dumped.
    async fn load_redis_fixture(url: &str, dumped: &str) -> Millis {
        let fixture: RedisFixture = serde_json::from_str(dumped).expect("fixture");
        let client = ::redis::Client::open(url).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let mut pipe = ::redis::pipe();
        for k in &fixture.keys {
            let v = &k.value;
            match k.kind.as_str() {
                "string" => pipe.set(&k.key, v.as_str().unwrap()),
                "hash" => pipe.hset_multiple(
                    &k.key,
                    &v.as_object()
                        .unwrap()
                        .iter()
                        .map(|(f, x)| (f.clone(), fixture_bytes(x)))
                        .collect::<Vec<_>>(),
                ),
                "list" => pipe.rpush(
                    &k.key,
                    v.as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_str().unwrap().to_string())
                        .collect::<Vec<_>>(),
                ),
                "zset" => pipe.zadd_multiple(
                    &k.key,
                    &v.as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[1].as_f64().unwrap(), p[0].as_str().unwrap().to_string()))
                        .collect::<Vec<_>>(),
                ),
                other => panic!("fixture type {other}"),
            };
            if k.pttl > 0 {
                pipe.pexpire(&k.key, k.pttl);
            }
        }
        pipe.query_async::<()>(&mut conn).await.unwrap();
        fixture.dumped_at_ms
    }

    #[tokio::test]
    async fn a_first_release_store_is_upgraded_in_place() {
        let server = RedisServer::start();
        let dumped_at = load_fixture(&server.url()).await;
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap()
            .with_caller_clock_leases();
        // The fixture's TTLs are relative: "now" for the upgrade is when it was dumped.
        assert_eq!(store.upgrade(dumped_at).await.unwrap(), 1);
        let current = callbackd::store::redis::SCHEMA_VERSION;
        assert_eq!(server.cli(&["GET", "cb:schema"]), current.to_string());
        assert_eq!(
            store.upgrade(dumped_at).await.unwrap(),
            current,
            "a second start finds the new layout"
        );
        // Redis itself must keep payment states past the 30 days v1 gave them.
        let payments = server.cli(&["KEYS", "cb:*:pay:*"]);
        assert_eq!(payments.lines().count(), 3);
        for key in payments.lines() {
            let pttl: i64 = server.cli(&["PTTL", key]).parse().unwrap();
            assert!(pttl > 300 * DAY_MS, "{key} expires in {pttl} ms");
        }
        let h = Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Redis(server),
        };
        the_upgraded_fixture_keeps_its_data(&h, dumped_at).await;
    }

    /// Layout version 2, written by the store of commit 164acf3 on a virtual clock starting at
    /// `T0` (tests/fixtures/make_redis_v2.rs): upgraded in place, everything goes on, and
    /// what ends is still swept when it ends.
    #[tokio::test]
    async fn a_second_release_redis_store_is_upgraded_in_place() {
        let server = RedisServer::start();
        let dumped_at =
            load_redis_fixture(&server.url(), include_str!("fixtures/redis_v2.json")).await;
        assert_eq!(dumped_at, T0 + 2_000);
        assert!(server.cli(&["KEYS", "cb:*}:x"]).lines().count() > 0);
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap()
            .with_caller_clock_leases();
        assert_eq!(store.upgrade(T0 + 5_000).await.unwrap(), 2);
        assert_eq!(
            server.cli(&["GET", "cb:schema"]),
            callbackd::store::redis::SCHEMA_VERSION.to_string()
        );
        for gone in ["cb:*}:x", "cb:*}:ix", "cb:*}:d:claim/*"] {
            assert_eq!(server.cli(&["KEYS", gone]), "", "{gone}");
        }
        // Claims and payments keep their remaining Redis TTL.
        for pattern in ["cb:*}:d:*", "cb:*}:pay:*"] {
            let keys = server.cli(&["KEYS", pattern]);
            assert!(keys.lines().count() > 0, "{pattern}");
            for key in keys.lines() {
                let pttl: i64 = server.cli(&["PTTL", key]).parse().unwrap();
                assert!(pttl > 29 * DAY_MS, "{key} expires in {pttl} ms");
            }
        }
        let h = Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Redis(server),
        };
        let s = h.s();
        the_release_fixture_goes_on(s, "v2").await;

        // Past the claims' 30 days every claim and seal is swept; payment states stay.
        let day31 = T0 + 31 * DAY_MS;
        h.sweep_all(day31).await;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        for pattern in ["cb:*}:d:*", "cb:*}:s:*"] {
            assert_eq!(server.cli(&["KEYS", pattern]), "", "{pattern}");
        }
        assert_eq!(
            s.payment_status("pay-v2", day31).await.unwrap().as_deref(),
            Some("settled")
        );
        let delivered = list_all(
            s,
            ListFilter {
                limit: 100,
                state: Some(MessageState::Delivered),
                ..Default::default()
            },
        )
        .await;
        assert!(delivered.is_empty(), "{delivered:?}");
    }

    /// The upgrade's pages are writes too: with `store.min_replicas_acked = 1` each waits for
    /// the replica, which ends up with the upgraded layout.
    #[tokio::test]
    async fn an_upgrade_that_needs_replica_acks_reaches_the_replica() {
        // No 5 s wait for more replicas before the first sync (Redis 7's diskless default).
        let master = RedisServer::start_with_args("always", &["--repl-diskless-sync-delay", "0"]);
        let port = master.port.to_string();
        let replica = RedisServer::start_with_args("always", &["--replicaof", "127.0.0.1", &port]);
        master.wait_for_replicas(1);
        let dumped_at = load_fixture(&master.url()).await;
        let store = RedisStore::connect(&master.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap()
            .with_min_replicas_acked(1);
        let from = store.upgrade(dumped_at).await.unwrap();
        assert_eq!(from, 1);
        assert_eq!(
            replica.cli(&["GET", "cb:schema"]),
            callbackd::store::redis::SCHEMA_VERSION.to_string()
        );
        assert_eq!(replica.cli(&["DBSIZE"]), master.cli(&["DBSIZE"]));
        assert!(
            master
                .cli(&["INFO", "commandstats"])
                .contains("cmdstat_wait:")
        );
    }

    /// Two processes start on a first-release store at once, and one of its messages has a
    /// history longer than v2 keeps: one upgrades while the other waits, and the history is
    /// brought down to the first row and the latest 100, its total kept.
    #[tokio::test]
    async fn a_long_history_is_trimmed_and_only_one_process_upgrades() {
        let server = RedisServer::start();
        let dumped_at = load_fixture(&server.url()).await;
        // The pending message's history is the one attempts list without a TTL.
        let pending_history = server
            .cli(&["--scan", "--pattern", "cb:*:a:*"])
            .lines()
            .find(|k| server.cli(&["PTTL", k]) == "-1")
            .expect("the pending message's history")
            .to_string();
        for n in 2..=150 {
            let row =
                serde_json::to_string(&HistoryEntry::from(delivery(n, dumped_at, 503))).unwrap();
            server.cli(&["RPUSH", &pending_history, &row]);
        }
        let id = MessageId::parse(pending_history.rsplit(':').next().unwrap()).unwrap();
        let connect = || async {
            RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
                .await
                .unwrap()
        };
        let (a, b) = (connect().await, connect().await);
        let (ra, rb) = tokio::join!(a.upgrade(dumped_at), b.upgrade(dumped_at));
        assert_eq!((ra.unwrap(), rb.unwrap()), (1, 1));
        assert_eq!(server.cli(&["EXISTS", "cb:upgrading"]), "0");
        let record = a.get(&id).await.unwrap().unwrap();
        assert_eq!(record.history_total, 150);
        assert_eq!(record.history.len(), 1 + callbackd::store::HISTORY_TAIL);
        assert_eq!(attempt_no(&record.history[0]), 1, "the first row is kept");
        assert_eq!(attempt_no(&record.history[1]), 51);
        assert_eq!(attempt_no(&record.history[100]), 150);
    }

    /// A callback's claim is one integer: Redis keeps it in its 16-byte object header instead
    /// of the 64-byte embedded string of the string form, and deletes it at its end.
    #[tokio::test]
    async fn a_callback_claim_is_one_integer() {
        let h = Harness::redis().await;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let s = h.s();
        let claim_of = |req: &AcceptRequest| {
            let partition = req.message.id.partition();
            let claims = server.cli(&["KEYS", &format!("cb:{{p{partition:02}}}:d:*")]);
            let [claim] = claims.lines().collect::<Vec<_>>()[..] else {
                panic!("one claim: {claims}");
            };
            claim.to_string()
        };
        let req = callback_request("cb/int", "tx-int", TTL_SECS, s.partitions(), T0);
        assert_eq!(
            s.accept(req.clone(), T0).await.unwrap(),
            AcceptOutcome::Accepted
        );
        let compact = claim_of(&req);
        assert_eq!(server.cli(&["GET", &compact]), format!("{T0}43200"));
        assert_eq!(server.cli(&["OBJECT", "ENCODING", &compact]), "int");
        let ttl: u64 = server.cli(&["TTL", &compact]).parse().expect("a TTL");
        assert!((TTL_SECS - 10..=TTL_SECS).contains(&ttl), "TTL {ttl}");
        let compact_bytes: u64 = server.cli(&["MEMORY", "USAGE", &compact]).parse().unwrap();

        // The same callback with a random id keeps the string form of layout 3.
        let mut random = callback_request("cb/str", "tx-int", TTL_SECS, s.partitions(), T0);
        random.message.id = MessageId::generate(T0, &random.message.ordering_key, s.partitions());
        random.dedupe.response = format!(r#"{{"messageId":"{}"}}"#, random.message.id);
        assert_eq!(
            s.accept(random.clone(), T0).await.unwrap(),
            AcceptOutcome::Accepted
        );
        let claims = server.cli(&[
            "KEYS",
            &format!("cb:{{p{:02}}}:d:*", req.message.id.partition()),
        ]);
        let string_form = claims
            .lines()
            .find(|c| *c != compact)
            .expect("the string claim")
            .to_string();
        assert_eq!(server.cli(&["OBJECT", "ENCODING", &string_form]), "embstr");
        let string_bytes: u64 = server
            .cli(&["MEMORY", "USAGE", &string_form])
            .parse()
            .unwrap();
        assert_eq!(
            string_bytes - compact_bytes,
            48,
            "MEMORY USAGE {compact_bytes} B against {string_bytes} B"
        );

        // Swept at its end, not before.
        let end = T0 + TTL_SECS as Millis * 1000;
        h.sweep_all(end - 1).await;
        assert_eq!(server.cli(&["EXISTS", &compact]), "1");
        h.sweep_all(end).await;
        assert_eq!(server.cli(&["EXISTS", &compact]), "0");
        assert_eq!(server.cli(&["EXISTS", &string_form]), "0");
    }

    /// A Redis store loaded from a release's fixture (`tests/fixtures/redis_v*.json`) and
    /// upgraded in place at `T0 + 5 000`: it reports version `from`, holds this layout's
    /// version, and nothing was rewritten.
    async fn upgraded_fixture(fixture: &str, from: u32) -> Harness {
        let server = RedisServer::start();
        let dumped_at = load_redis_fixture(&server.url(), fixture).await;
        assert_eq!(dumped_at, T0 + 2_000);
        let before = server.cli(&["DBSIZE"]);
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap()
            .with_caller_clock_leases();
        assert_eq!(store.upgrade(T0 + 5_000).await.unwrap(), from);
        assert_eq!(
            server.cli(&["GET", "cb:schema"]),
            callbackd::store::redis::SCHEMA_VERSION.to_string()
        );
        assert_eq!(server.cli(&["DBSIZE"]), before, "nothing rewritten");
        Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Redis(server),
        }
    }

    /// The one recorded message of a release's story: its signed inbound callback.
    async fn the_recorded_callback(s: &dyn Store) -> MessageRecord {
        let recorded = list_all(
            s,
            ListFilter {
                limit: 100,
                state: Some(MessageState::Recorded),
                ..Default::default()
            },
        )
        .await;
        let [recorded] = &recorded[..] else {
            panic!("{recorded:?}");
        };
        recorded.clone()
    }

    /// Layout version 3, written by the store of commit bb1ae44 (tests/fixtures/
    /// make_redis_v3.rs): nothing is rewritten, its string claims replay their random ids
    /// until they end, everything goes on, and new callbacks get integer claims.
    #[tokio::test]
    async fn a_third_release_redis_store_is_upgraded_in_place() {
        let h = upgraded_fixture(include_str!("fixtures/redis_v3.json"), 3).await;
        let s = h.s();
        let now = T0 + 10_000;
        // The recorded callback's claim names its random id (no fingerprint, as a callback).
        let recorded = &the_recorded_callback(s).await;
        let mut retry = request("claim/src/payzu/tx-v3", inbound("payzu", "tx-v3", now));
        retry.message.id = MessageId::for_claim(
            now,
            &retry.message.ordering_key,
            s.partitions(),
            "claim/src/payzu/tx-v3",
        );
        retry.dedupe.fingerprint = None;
        retry.dedupe.response = format!(r#"{{"messageId":"{}"}}"#, retry.message.id);
        assert_eq!(
            s.accept(retry, now).await.unwrap(),
            AcceptOutcome::Replayed {
                response: format!(r#"{{"messageId":"{}"}}"#, recorded.message.id)
            }
        );
        the_release_fixture_goes_on(s, "v3").await;

        // A new callback's claim is an integer beside the old strings.
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let fresh = callback_request("cb/after-upgrade", "tx-new", TTL_SECS, s.partitions(), now);
        let partition = fresh.message.id.partition();
        let claims_before = server.cli(&["KEYS", &format!("cb:{{p{partition:02}}}:d:*")]);
        assert_eq!(s.accept(fresh, now).await.unwrap(), AcceptOutcome::Accepted);
        let claims = server.cli(&["KEYS", &format!("cb:{{p{partition:02}}}:d:*")]);
        let new = claims
            .lines()
            .find(|c| !claims_before.lines().any(|b| b == *c))
            .expect("a new claim");
        assert_eq!(server.cli(&["OBJECT", "ENCODING", new]), "int");

        // Past the old claims' 30 days every claim and seal is swept.
        let day31 = T0 + 31 * DAY_MS;
        h.sweep_all(day31).await;
        for pattern in ["cb:*}:d:*", "cb:*}:s:*"] {
            assert_eq!(server.cli(&["KEYS", pattern]), "", "{pattern}");
        }
        assert_eq!(
            s.payment_status("pay-v3", day31).await.unwrap().as_deref(),
            Some("settled")
        );
    }

    /// The recorded callback of release `v`'s story: its integer claim rebuilds the id it
    /// was accepted under.
    async fn the_integer_claim_replays(s: &dyn Store, v: &str, now: Millis) {
        let recorded = &the_recorded_callback(s).await;
        let retry = callback_request(
            &format!("claim/src/payzu/tx-{v}"),
            &format!("tx-{v}"),
            RETENTION_SECS,
            s.partitions(),
            now,
        );
        assert_eq!(
            s.accept(retry, now).await.unwrap(),
            AcceptOutcome::Replayed {
                response: format!(r#"{{"messageId":"{}"}}"#, recorded.message.id)
            }
        );
    }

    /// The one message of a story's ordering key, as listed.
    async fn message_of_key(s: &dyn Store, ordering_key: &str) -> MessageRecord {
        let all = ListFilter {
            limit: 100,
            ..Default::default()
        };
        list_all(s, all)
            .await
            .into_iter()
            .find(|r| r.message.ordering_key == ordering_key)
            .unwrap_or_else(|| panic!("no message of {ordering_key}"))
    }

    /// A message accepted after an upgrade keeps its record compressed against the record
    /// dictionary and in pieces, in a listpack hash, and its first history row compressed
    /// against the row dictionary in that hash, with no list; the rows after it go to the
    /// list; all read back byte for byte.
    async fn new_messages_are_kept_compact(h: &Harness, now: Millis) {
        let s = h.s();
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let older_keys = server.cli(&["KEYS", "cb:*:ix:k:*"]).lines().count();
        let (id, body, json_len) = accept_compressible(s, "v6/after-upgrade", now).await;
        let key = format!("cb:{{p{:02}}}:m:{id}", id.partition());
        let pieces: Vec<usize> = (0..)
            .map(|i| {
                server
                    .cli(&["HSTRLEN", &key, &format!("r{i}")])
                    .parse()
                    .unwrap()
            })
            .take_while(|&len: &usize| len > 0)
            .collect();
        let stored: usize = pieces.iter().sum();
        assert!(
            stored * 2 < json_len && pieces.iter().all(|&len| len <= 64),
            "{pieces:?}: {stored} bytes stored for {json_len} bytes of JSON"
        );
        assert_eq!(server.cli(&["OBJECT", "ENCODING", &key]), "listpack");
        assert_eq!(
            first_byte(server, &key, "r0").await,
            0x01,
            "the record's mark"
        );
        // It is listed by its ordering key from the shared key index, which has no key of
        // its own per ordering key.
        assert_eq!(
            listed_by_key(s, "v6/after-upgrade").await,
            std::slice::from_ref(&id)
        );
        assert_eq!(
            server.cli(&["KEYS", "cb:*:ix:k:*"]).lines().count(),
            older_keys
        );
        assert_eq!(get(s, &id).await.message.body.as_bytes(), body.as_bytes());
        let leases = s.claim_due(now, 100, 30_000).await.unwrap();
        let lease = leases
            .iter()
            .find(|l| l.message.id == id)
            .expect("the new message is due");
        assert_eq!(lease.message.body.as_bytes(), body.as_bytes());

        // Its first history row is kept in its hash, so a message with one row has no list;
        // the rows after it go to the list.
        let attempts_key = format!("cb:{{p{:02}}}:a:{id}", id.partition());
        let retry = Completion::Retry { next_at: now + 10 };
        assert!(complete(s, lease, retry, now).await);
        assert_eq!(server.cli(&["EXISTS", &attempts_key]), "0");
        assert_eq!(server.cli(&["OBJECT", "ENCODING", &key]), "listpack");
        assert_eq!(
            first_byte(server, &key, "h0").await,
            0x02,
            "the first row's mark"
        );
        assert_eq!(server.cli(&["HEXISTS", &key, "h1"]), "0", "one piece");
        let second = claim_one(s, now + 10, &id).await;
        assert!(complete(s, &second, Completion::Delivered, now + 10).await);
        assert_eq!(server.cli(&["LLEN", &attempts_key]), "1");
        let fresh = get(s, &id).await;
        let attempts: Vec<u32> = fresh.history.iter().map(attempt_no).collect();
        assert_eq!((attempts, fresh.history_total), (vec![1, 2], 2));
        assert_eq!(fresh.history[0], HistoryEntry::from(delivery(1, now, 500)));
    }

    /// The ids listed by `ordering_key`, a page at a time.
    async fn listed_by_key(s: &dyn Store, ordering_key: &str) -> Vec<MessageId> {
        let of_key = ListFilter {
            limit: 1,
            ordering_keys: Some(vec![ordering_key.to_string()]),
            ..Default::default()
        };
        list_all(s, of_key)
            .await
            .into_iter()
            .map(|r| r.message.id)
            .collect()
    }

    /// The first byte of field `field` of hash `key`.
    async fn first_byte(server: &RedisServer, key: &str, field: &str) -> u8 {
        let client = ::redis::Client::open(server.url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let value: Vec<u8> = ::redis::cmd("HGET")
            .arg(key)
            .arg(field)
            .query_async(&mut conn)
            .await
            .unwrap();
        *value
            .first()
            .unwrap_or_else(|| panic!("{key} {field} is empty"))
    }

    /// Layout version 4, written by the store of commit 97e6d0c (tests/fixtures/
    /// make_redis_fixture.rs): nothing is rewritten, its JSON records are read as they are (the
    /// story is listed, claimed and delivered on), its integer claim still replays, and new
    /// messages keep their records compressed and in pieces, in a listpack hash, beside the old
    /// ones, and read them back byte for byte.
    #[tokio::test]
    async fn a_fourth_release_redis_store_is_upgraded_in_place() {
        let h = upgraded_fixture(include_str!("fixtures/redis_v4.json"), 4).await;
        let s = h.s();
        let now = T0 + 10_000;
        the_integer_claim_replays(s, "v4", now).await;
        the_release_fixture_goes_on(s, "v4").await;

        new_messages_are_kept_compact(&h, now).await;

        // A message of layout 4 keeps its first row in its list, and appends after it.
        let expedited = message_of_key(s, "v4/expedited").await;
        let expedited = get(s, &expedited.message.id).await;
        let kinds: Vec<&str> = expedited.history.iter().map(HistoryEntry::kind).collect();
        assert_eq!(kinds, ["delivery", "resend", "delivery"]);
        assert_eq!(expedited.history_total, 3);
    }

    /// Layout version 5, written by the store of commit c9e9a2b (tests/fixtures/
    /// make_redis_fixture.rs): nothing is rewritten; its records, compressed without a
    /// dictionary, and its first history rows, JSON in the hash, are read as they are (the
    /// story is listed, claimed and delivered on); its integer claim still replays; new
    /// messages keep both forms against the dictionaries beside them.
    #[tokio::test]
    async fn a_fifth_release_redis_store_is_upgraded_in_place() {
        let h = upgraded_fixture(include_str!("fixtures/redis_v5.json"), 5).await;
        let s = h.s();
        let now = T0 + 10_000;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let dead = message_of_key(s, "v5/dead").await;
        let id = &dead.message.id;
        // Listed by its ordering key from the sorted set layout 5 kept for it.
        assert!(!server.cli(&["KEYS", "cb:*:ix:k:*"]).is_empty());
        assert_eq!(listed_by_key(s, "v5/dead").await, std::slice::from_ref(id));
        let key = format!("cb:{{p{:02}}}:m:{id}", id.partition());
        assert_eq!(
            first_byte(server, &key, "r0").await,
            0x28,
            "zstd's magic, no mark"
        );
        assert_eq!(first_byte(server, &key, "h0").await, b'{', "a JSON row");

        the_integer_claim_replays(s, "v5", now).await;
        the_release_fixture_goes_on(s, "v5").await;
        new_messages_are_kept_compact(&h, now).await;

        // The sweeper empties layout 5's set of a key as its message ends.
        let older = format!(
            "cb:{{p{:02}}}:ix:k:{}",
            id.partition(),
            callbackd::digest::short_hash(b"v5/dead")
        );
        assert_eq!(server.cli(&["EXISTS", &older]), "1");
        h.sweep_all(T0 + 40 * DAY_MS).await;
        assert_eq!(server.cli(&["EXISTS", &older]), "0");
        assert!(s.get(id).await.unwrap().is_none());
    }

    /// Layout version 6, written by the store of commit f577cd9 (tests/fixtures/
    /// make_redis_fixture.rs): nothing is rewritten; its delivered and recorded messages are
    /// listed by state from the sorted set it kept for each state, beside the buckets layout 7
    /// keeps (index.lua), and are swept out of it as they end.
    #[tokio::test]
    async fn a_sixth_release_redis_store_is_upgraded_in_place() {
        let h = upgraded_fixture(include_str!("fixtures/redis_v6.json"), 6).await;
        let s = h.s();
        let now = T0 + 10_000;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let older = |state: MessageState| {
            let key = server.cli(&["KEYS", &format!("cb:*:ix:{}", state.as_str())]);
            assert!(key.lines().count() <= 1, "{key}");
            key
        };
        let listed = |state: MessageState| async move {
            let of_state = ListFilter {
                limit: 1,
                state: Some(state),
                ..Default::default()
            };
            ids(&list_all(s, of_state).await)
        };
        assert_eq!(server.cli(&["KEYS", "cb:*:fx:*"]), "", "nothing rewritten");
        let delivered = message_of_key(s, "v6/delivered").await.message.id;
        let recorded = the_recorded_callback(s).await.message.id;
        for (state, id) in [
            (MessageState::Delivered, &delivered),
            (MessageState::Recorded, &recorded),
        ] {
            assert_eq!(
                server.cli(&["ZRANGE", &older(state), "0", "-1"]),
                id.as_str()
            );
            assert_eq!(listed(state).await, std::slice::from_ref(id), "{state:?}");
        }

        the_integer_claim_replays(s, "v6", now).await;
        the_release_fixture_goes_on(s, "v6").await;
        new_messages_are_kept_compact(&h, now).await;

        // A callback recorded now is kept in a bucket, and listed after the one layout 6 kept.
        let mut quiet = inbound("quiet", "tx-after-upgrade", now);
        quiet.id = MessageId::generate(now, &quiet.ordering_key, s.partitions());
        quiet.target_url = None;
        let fresh = accept(s, quiet, now).await;
        assert_eq!(
            server.cli(&["KEYS", "cb:*:fx:recorded:*"]).lines().count(),
            1
        );
        assert_eq!(
            listed(MessageState::Recorded).await,
            [recorded.clone(), fresh]
        );
        h.sweep_all(T0 + 40 * DAY_MS).await;
        for state in [MessageState::Delivered, MessageState::Recorded] {
            assert_eq!(older(state), "", "{state:?} swept out of layout 6's set");
            assert!(listed(state).await.is_empty());
        }
        assert_eq!(server.cli(&["KEYS", "cb:*:fx:*"]), "");
    }

    /// Layout 6's delivered message, resent: it leaves layout 6's set, and once delivered again
    /// it is in a bucket of layout 7.
    #[tokio::test]
    async fn a_sixth_release_delivered_message_is_resent_out_of_its_older_set() {
        let h = upgraded_fixture(include_str!("fixtures/redis_v6.json"), 6).await;
        let s = h.s();
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let now = T0 + 10_000;
        let id = message_of_key(s, "v6/delivered").await.message.id;
        let older = format!("cb:{{p{:02}}}:ix:delivered", id.partition());
        assert_eq!(server.cli(&["ZRANGE", &older, "0", "-1"]), id.as_str());
        let effect = s.resend(&id, resend_mark(now), now + 7 * DAY_MS, now).await;
        assert_eq!(effect.unwrap(), ResendEffect::Requeued);
        assert_eq!(server.cli(&["EXISTS", &older]), "0");
        let lease = claim(s, now, 100)
            .await
            .into_iter()
            .find(|c| c.message.id == id)
            .expect("the resent message is due");
        assert!(complete(s, &lease, Completion::Delivered, now).await);
        redis_buckets_hold(
            server,
            id.partition(),
            MessageState::Delivered,
            std::slice::from_ref(&id),
        );
        let of_state = ListFilter {
            limit: 10,
            state: Some(MessageState::Delivered),
            ..Default::default()
        };
        assert_eq!(super::ids(&list_all(s, of_state).await), [id]);
    }

    /// Ids in order fill each bucket to 127 and start the next; ids a little out of order (as
    /// completions of concurrent attempts come) fill them nearly as well: a full bucket's
    /// newest id moves to the next bucket rather than starting one of its own.
    #[tokio::test]
    async fn buckets_of_ids_stay_full_in_order_and_a_little_out_of_it() {
        let h = Harness::redis().await;
        let s = h.s();
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let partition = partition_of("src/quiet/tx-b-0", s.partitions());
        let txs: Vec<String> = (0..)
            .map(|i| format!("tx-b-{i}"))
            .filter(|tx| partition_of(&format!("src/quiet/{tx}"), s.partitions()) == partition)
            .take(601)
            .collect();
        let record = |tx: &str, at: Millis| {
            let mut message = inbound("quiet", tx, at);
            message.id = MessageId::generate(at, &message.ordering_key, s.partitions());
            message.target_url = None;
            accept(s, message, at)
        };
        let mut ids = Vec::new();
        for (i, tx) in txs[..300].iter().enumerate() {
            ids.push(record(tx, T0 + i as Millis).await);
        }
        let sizes = |index: &str| -> Vec<String> {
            let bounds = server.cli(&["ZRANGE", index, "0", "-1"]);
            bounds
                .lines()
                .map(|b| server.cli(&["ZCARD", &format!("{index}:{b}")]))
                .collect()
        };
        let index = format!("cb:{{p{partition:02}}}:fx:recorded");
        assert_eq!(sizes(&index), ["127", "127", "46"]);
        redis_buckets_hold(server, partition, MessageState::Recorded, &ids);
        // The next 300 in blocks of 8, each block newest first.
        let later = T0 + 10_000;
        for block in (300..600).collect::<Vec<usize>>().chunks(8) {
            for &i in block.iter().rev() {
                ids.push(record(&txs[i], later + i as Millis).await);
            }
        }
        redis_buckets_hold(server, partition, MessageState::Recorded, &ids);
        assert_eq!(sizes(&index), ["127", "127", "127", "127", "92"]);

        // A bucket lost (evicted, deleted by hand) loses its ids' entries, not the index: an
        // id below every bound still goes in, where the first bucket was.
        let first = server.cli(&["ZRANGE", &index, "0", "0"]);
        assert_eq!(server.cli(&["DEL", &format!("{index}:{first}")]), "1");
        let early = record(&txs[600], T0 - 1_000).await;
        let of_state = ListFilter {
            limit: 1,
            state: Some(MessageState::Recorded),
            ..Default::default()
        };
        assert_eq!(
            super::ids(&s.list(&of_state).await.unwrap().messages),
            [early]
        );
    }

    /// A bucket of the key index too large for a listpack (a skiplist to Redis) still lists
    /// each of its keys whole and only it, a page at a time.
    #[tokio::test]
    async fn a_key_index_bucket_past_a_listpack_lists_each_key_whole_a_page_at_a_time() {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap();
        store.upgrade(T0).await.unwrap();
        let s: &dyn Store = &store;
        // Another ordering key in the same bucket: its hash starts with the same character,
        // and it lies in the same partition.
        let bucket_of = |key: &str| {
            let hash = callbackd::digest::short_hash(key.as_bytes());
            (partition_of(key, s.partitions()), hash.chars().next())
        };
        let busy = "src/payzu/tx-busy";
        let neighbour = (0..)
            .map(|i| format!("src/payzu/tx-{i}"))
            .find(|key| bucket_of(key) == bucket_of(busy))
            .expect("a key in the same bucket");
        let mut wanted = Vec::new();
        for i in 0..2_500 {
            wanted.push(accept_new(s, busy, T0 + i).await);
        }
        let theirs = vec![
            accept_new(s, &neighbour, T0).await,
            accept_new(s, &neighbour, T0 + 5_000).await,
        ];
        let bucket = server.cli(&["KEYS", "cb:*:kx:*"]);
        assert_eq!(bucket.lines().count(), 1, "{bucket}");
        assert_eq!(server.cli(&["ZCARD", &bucket]), "2502");
        assert_eq!(server.cli(&["OBJECT", "ENCODING", &bucket]), "skiplist");
        wanted.sort();
        for limit in [7, 100, 3_000] {
            let listed = list_all(
                s,
                ListFilter {
                    limit,
                    ordering_keys: Some(vec![busy.to_string()]),
                    ..Default::default()
                },
            )
            .await;
            assert_eq!(ids(&listed), wanted, "limit {limit}");
        }
        assert_eq!(listed_by_key(s, &neighbour).await, theirs);
    }

    #[tokio::test]
    async fn a_store_newer_than_this_binary_is_refused() {
        let server = RedisServer::start();
        server.cli(&["SET", "cb:schema", "99"]);
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap();
        let err = store.upgrade(T0).await.unwrap_err().to_string();
        assert!(err.contains("version 99") && err.contains("newer"), "{err}");
    }

    /// Two workers whose clocks disagree by more than the lease: the one running ahead must
    /// not take over a lease that has not expired by the store's clock.
    #[tokio::test]
    async fn leases_are_timed_by_the_store_clock() {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url(), Duration::from_secs(2), RETENTION_SECS)
            .await
            .unwrap();
        let now = callbackd::clock::Clock::now_ms(&callbackd::clock::SystemClock);
        let id = accept_new(&store, "pay/skew", now).await;
        let first = store.claim_due(now, 10, 60_000).await.unwrap();
        assert_eq!(first.len(), 1);
        let ahead = now + 10 * 60_000;
        assert!(
            store.claim_due(ahead, 10, 60_000).await.unwrap().is_empty(),
            "a clock 10 minutes ahead does not expire a 1-minute lease"
        );
        // A lease that has run out by the store's clock is taken over.
        let short = accept_new(&store, "pay/short", now).await;
        let leased = store.claim_due(now, 10, 1).await.unwrap();
        assert_eq!(ids_of(&leased), vec![short.clone()]);
        let mut again = Vec::new();
        for _ in 0..200 {
            again = store.claim_due(now, 10, 60_000).await.unwrap();
            if !again.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(ids_of(&again), vec![short]);
        assert_ne!(id, again[0].message.id);
    }

    /// Redis expires claims on its own clock; check the TTL it was given.
    #[tokio::test]
    async fn the_dedupe_claim_carries_its_ttl() {
        let h = Harness::redis().await;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let req = request("k-ttl", new_message("pay/1", T0));
        let partition = partition_of("pay/1", Partitions::DEFAULT);
        h.s().accept(req, T0).await.unwrap();
        let claims = server.cli(&["KEYS", &format!("cb:{{p{partition:02}}}:d:*")]);
        let [claim] = claims.lines().collect::<Vec<_>>()[..] else {
            panic!("one claim: {claims}");
        };
        let ttl: u64 = server.cli(&["TTL", claim]).parse().expect("a TTL");
        assert!(
            (TTL_SECS - 10..=TTL_SECS).contains(&ttl),
            "TTL {ttl}, expected about {TTL_SECS}"
        );
    }

    /// A server that lost its script cache (a restart, a failover) still runs every script,
    /// called alone (accept, complete, resend) or pipelined over the partitions (claim, sweep,
    /// a listing by state).
    #[tokio::test]
    async fn scripts_the_server_lost_are_loaded_again() {
        let h = Harness::redis().await;
        let Backend::Redis(server) = &h.backend else {
            unreachable!()
        };
        let flush = || assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
        flush();
        let first = accept_new(h.s(), "pay/flush-1", T0).await;
        flush();
        let second = accept_new(h.s(), "pay/flush-2", T0).await;
        flush();
        let leased = h.s().claim_due(T0, 10, LEASE_MS).await.unwrap();
        let ids: BTreeSet<MessageId> = ids_of(&leased).into_iter().collect();
        assert_eq!(ids, BTreeSet::from([first, second]));
        flush();
        let done = h
            .s()
            .complete(&leased[0], delivery(1, T0, 200), Completion::Delivered, T0)
            .await
            .unwrap();
        assert!(done);
        flush();
        let delivered = &leased[0].message.id;
        let of_state = ListFilter {
            limit: 10,
            state: Some(MessageState::Delivered),
            ..Default::default()
        };
        let listed = h.s().list(&of_state).await.unwrap();
        assert_eq!(
            super::ids(&listed.messages),
            std::slice::from_ref(delivered)
        );
        flush();
        let mark = resend_mark(T0);
        let effect = h
            .s()
            .resend(delivered, mark, T0 + DAY_MS, T0)
            .await
            .unwrap();
        assert_eq!(effect, ResendEffect::Requeued);
        flush();
        assert_eq!(h.s().sweep(T0).await.unwrap(), 0);
    }
    /// A store on `server` whose calls give up after `timeout`.
    async fn connected(server: &RedisServer, timeout: Duration) -> RedisStore {
        let store = RedisStore::connect(&server.url(), timeout, RETENTION_SECS)
            .await
            .expect("connect to the private redis-server")
            .with_caller_clock_leases();
        store.upgrade(T0).await.expect("stamp the layout version");
        store
    }

    async fn until_answering(store: &RedisStore) {
        for _ in 0..200 {
            if store.ping().await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the store never answered again");
    }

    /// Redis dies with accepts of one partition sent and unanswered: each fails on its own as
    /// unavailable (503), and none burnt its key: after the restart every event is accepted as
    /// new, not replayed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn accepts_lost_with_redis_fail_each_and_burn_no_key() {
        let mut server = RedisServer::start();
        let store = connected(&server, Duration::from_secs(5)).await;
        let key = "pay/lost";
        // Loads the script, so what is sent below is the accepts themselves.
        accept_new(&store, "pay/lost/warm", T0).await;
        server.pause();
        let requests: Vec<AcceptRequest> = (0..8)
            .map(|i| request(&format!("lost-{i}"), new_message(key, T0 + i)))
            .collect();
        let started = start_together(&store, requests.clone(), T0).await;
        // SIGKILL while stopped: the server never reads what was sent to it.
        server.stop(true);
        for outcome in futures::future::join_all(started).await {
            assert!(
                matches!(outcome, Err(StoreError::Unavailable(_))),
                "{outcome:?}"
            );
        }
        server.start_again();
        until_answering(&store).await;
        for req in requests {
            assert_eq!(
                store.accept(req, T0).await.unwrap(),
                AcceptOutcome::Accepted
            );
        }
    }

    /// Many accepts at once over every partition: each one acknowledged is on disk (AOF,
    /// `appendfsync always`) when Redis is killed right after.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_acknowledged_accept_survives_a_crash() {
        let mut server = RedisServer::start();
        let store = connected(&server, Duration::from_secs(10)).await;
        let requests: Vec<AcceptRequest> = (0..400)
            .map(|i| {
                request(
                    &format!("durable-{i}"),
                    new_message(&format!("pay/durable-{}", i % 193), T0 + i),
                )
            })
            .collect();
        let outcomes =
            futures::future::join_all(requests.iter().map(|r| store.accept(r.clone(), T0))).await;
        for outcome in outcomes {
            assert_eq!(outcome.unwrap(), AcceptOutcome::Accepted);
        }
        let partitions: BTreeSet<u8> = requests.iter().map(|r| r.message.id.partition()).collect();
        assert_eq!(partitions.len(), usize::from(Partitions::DEFAULT.count()));
        server.stop(true);
        server.start_again();
        until_answering(&store).await;
        for req in requests {
            let id = req.message.id.clone();
            let response = req.dedupe.response.clone();
            assert!(store.get(&id).await.unwrap().is_some(), "{id} survived");
            assert_eq!(
                store.accept(req, T0).await.unwrap(),
                AcceptOutcome::Replayed { response }
            );
        }
    }
}

mod sqlite_only {
    use super::*;
    use std::path::PathBuf;

    #[tokio::test]
    async fn a_long_first_release_history_is_trimmed_by_the_migration() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cb.db");
        std::fs::copy("tests/fixtures/sqlite_v1.db", &path).unwrap();
        let id = {
            let conn = rusqlite::Connection::open(&path).unwrap();
            let id: String = conn
                .query_row("SELECT id FROM messages WHERE state = 'pending'", [], |r| {
                    r.get(0)
                })
                .unwrap();
            for n in 2..=150 {
                let row = serde_json::to_string(&HistoryEntry::from(delivery(n, T0, 503))).unwrap();
                conn.execute(
                    "INSERT INTO attempts (message_id, row) VALUES (?1, ?2)",
                    rusqlite::params![id, row],
                )
                .unwrap();
            }
            MessageId::parse(&id).unwrap()
        };
        let store = SqliteStore::open(&path, RETENTION_SECS).unwrap();
        let record = store.get(&id).await.unwrap().unwrap();
        assert_eq!(record.history_total, 150);
        assert_eq!(record.history.len(), 1 + callbackd::store::HISTORY_TAIL);
        assert_eq!(attempt_no(&record.history[0]), 1, "the first row is kept");
        assert_eq!(attempt_no(&record.history[1]), 51);
        assert_eq!(attempt_no(&record.history[100]), 150);
    }

    #[tokio::test]
    async fn a_first_release_database_is_migrated_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cb.db");
        std::fs::copy("tests/fixtures/sqlite_v1.db", &path).unwrap();
        let written_at = {
            let conn = rusqlite::Connection::open(&path).unwrap();
            let version: i64 = conn
                .query_row("PRAGMA user_version", [], |r| r.get(0))
                .unwrap();
            assert_eq!(version, 1, "the fixture is the first release's schema");
            let newest: String = conn
                .query_row("SELECT max(id) FROM messages", [], |r| r.get(0))
                .unwrap();
            MessageId::parse(&newest).unwrap().created_at()
        };
        let store = std::sync::Arc::new(SqliteStore::open(&path, RETENTION_SECS).unwrap());
        let h = Harness {
            store: store.clone(),
            backend: Backend::Sqlite {
                store,
                _dir: dir,
                path,
            },
        };
        the_upgraded_fixture_keeps_its_data(&h, written_at + 5_000).await;
    }

    /// Layout version 2, written by the store of commit acd07d8 on a virtual clock starting at
    /// `T0` (tests/fixtures/make_sqlite_v2.rs tells what happened when). Its columns are
    /// renamed on open, and everything goes on.
    #[tokio::test]
    async fn a_second_release_database_is_migrated_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cb.db");
        std::fs::copy("tests/fixtures/sqlite_v2.db", &path).unwrap();
        assert_eq!(user_version(&path), 2, "the fixture is layout version 2");
        let s = SqliteStore::open(&path, RETENTION_SECS).unwrap();
        let columns = columns_of(&path, "messages");
        for old in ["rec", "rb", "resume", "again", "lease", "tries"] {
            assert!(!columns.iter().any(|c| c == old), "{old} in {columns:?}");
        }
        // Through every later layout to the newest: the recovery tables (layout 5) too.
        assert_eq!(user_version(&path), 5);
        assert_eq!(
            columns_of(&path, "inbound_counts"),
            ["source", "minute", "new", "replays"]
        );
        assert_eq!(
            columns_of(&path, "recoveries"),
            ["id", "started_at", "recovery_json"]
        );

        the_release_fixture_goes_on(&s, "v2").await;
    }

    /// Databases upgraded from either older layout have exactly the tables, columns and
    /// indexes of a new one (schema.sql), so no engine code has to care where a file came from.
    #[tokio::test]
    async fn upgraded_layouts_equal_a_new_one() {
        let layout = |fixture: Option<&str>| {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("cb.db");
            if let Some(fixture) = fixture {
                std::fs::copy(fixture, &path).unwrap();
            }
            drop(SqliteStore::open(&path, RETENTION_SECS).unwrap());
            describe_schema(&path)
        };
        let new = layout(None);
        assert!(
            new.iter().any(|line| line.contains("message_json")),
            "{new:#?}"
        );
        for fixture in ["tests/fixtures/sqlite_v1.db", "tests/fixtures/sqlite_v2.db"] {
            assert_eq!(layout(Some(fixture)), new, "{fixture}");
        }
        // Layout 4 (a new database with layout 5's tables undone), upgraded by TO_V5.
        let dir = tempfile::tempdir().unwrap();
        let v4 = dir.path().join("v4.db");
        drop(SqliteStore::open(&v4, RETENTION_SECS).unwrap());
        rusqlite::Connection::open(&v4)
            .unwrap()
            .execute_batch(
                "DROP TABLE inbound_counts; DROP TABLE recoveries; PRAGMA user_version = 4;",
            )
            .unwrap();
        assert_eq!(layout(Some(v4.to_str().unwrap())), new, "layout 4");
        assert!(
            new.iter().any(|line| line.contains("inbound_counts")),
            "{new:#?}"
        );
    }

    fn user_version(path: &std::path::Path) -> i64 {
        rusqlite::Connection::open(path)
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap()
    }

    fn columns_of(path: &std::path::Path, table: &str) -> Vec<String> {
        rusqlite::Connection::open(path)
            .unwrap()
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .unwrap()
            .query_map([table], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// One line per table column and per index, with the version: what two databases must
    /// share to be the same layout. Index statements are compared without quotes and spacing
    /// (SQLite quotes a renamed column in the statement it keeps).
    fn describe_schema(path: &std::path::Path) -> Vec<String> {
        let conn = rusqlite::Connection::open(path).unwrap();
        let objects: Vec<(String, String, String)> = conn
            .prepare(
                "SELECT type, name, sql FROM sqlite_master \
                 WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' ORDER BY type, name",
            )
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let mut lines = vec![format!("version {}", user_version(path))];
        for (kind, name, sql) in objects {
            if kind == "index" {
                let sql = sql.replace('"', "");
                lines.push(sql.split_whitespace().collect::<Vec<_>>().join(" "));
                continue;
            }
            lines.push(format!(
                "{kind} {name} without_rowid={}",
                sql.contains("WITHOUT ROWID")
            ));
            let mut columns = conn
                .prepare(
                    "SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info(?1)",
                )
                .unwrap();
            let columns = columns
                .query_map([&name], |r| {
                    Ok(format!(
                        "  {name}.{} {} notnull={} default={:?} pk={}",
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, Option<String>>(3)?,
                        r.get::<_, i64>(4)?
                    ))
                })
                .unwrap();
            for column in columns {
                lines.push(column.unwrap());
            }
        }
        lines
    }

    fn fresh() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("cb.db");
        (dir, path)
    }

    #[tokio::test]
    async fn an_expired_claim_does_not_block_a_new_accept() {
        let (_dir, path) = fresh();
        let s = SqliteStore::open(&path, RETENTION_SECS).unwrap();
        let mut first = request("k", new_message("pay/1", T0));
        first.dedupe.ttl_secs = 60;
        assert_eq!(
            s.accept(first.clone(), T0).await.unwrap(),
            AcceptOutcome::Accepted
        );

        let mut before = request("k", new_message("pay/1", T0 + 59_999));
        before.dedupe.ttl_secs = 60;
        assert_eq!(
            s.accept(before, T0 + 59_999).await.unwrap(),
            AcceptOutcome::Replayed {
                response: first.dedupe.response.clone()
            }
        );
        let later = T0 + 61_000;
        let mut after = request("k", new_message("pay/1", later));
        after.dedupe.ttl_secs = 60;
        after.dedupe.fingerprint = Some("another request".into());
        let after_id = after.message.id.clone();
        assert_eq!(
            s.accept(after, later).await.unwrap(),
            AcceptOutcome::Accepted
        );
        assert!(s.get(&after_id).await.unwrap().is_some());
        assert!(
            s.get(&first.message.id).await.unwrap().is_some(),
            "only the claim expired"
        );
    }

    #[tokio::test]
    async fn finished_messages_are_purged_after_the_retention() {
        let (_dir, path) = fresh();
        let s = SqliteStore::open(&path, 60).unwrap();
        let id = accept_new(&s, "pay/1", T0).await;
        let c = claim_one(&s, T0, &id).await;
        assert!(complete(&s, &c, Completion::Delivered, T0 + 1).await);
        let pending = accept_new(&s, "pay/2", T0 + 2).await;
        accept_new(&s, "pay/3", T0 + 30_000).await;
        assert!(
            s.get(&id).await.unwrap().is_some(),
            "kept for the retention"
        );
        accept_new(&s, "pay/3", T0 + 61_001).await;
        assert_eq!(s.get(&id).await.unwrap(), None);
        assert!(
            s.get(&pending).await.unwrap().is_some(),
            "unfinished work is never purged"
        );
    }

    #[tokio::test]
    async fn a_second_open_of_the_same_file_is_refused() {
        let (_dir, path) = fresh();
        let first = SqliteStore::open(&path, RETENTION_SECS).unwrap();
        let err = SqliteStore::open(&path, RETENTION_SECS).unwrap_err();
        assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
        assert!(
            err.to_string().contains("another callbackd process"),
            "unclear error: {err}"
        );
        drop(first);
        SqliteStore::open(&path, RETENTION_SECS).expect("free again once the first is gone");
    }

    // A second *process* on the same file is refused: tests/sqlite_processes.rs starts two
    // `callbackd serve` on one database.

    #[tokio::test]
    async fn everything_survives_a_reopen() {
        let (_dir, path) = fresh();
        let req = request("k", new_message("pay/1", T0));
        let id = req.message.id.clone();
        {
            let s = SqliteStore::open(&path, RETENTION_SECS).unwrap();
            assert_eq!(
                s.accept(req.clone(), T0).await.unwrap(),
                AcceptOutcome::Accepted
            );
            let c = claim_one(&s, T0, &id).await;
            assert!(
                complete(
                    &s,
                    &c,
                    Completion::Retry {
                        next_at: T0 + 5_000
                    },
                    T0 + 1
                )
                .await
            );
        }
        let s = SqliteStore::open(&path, RETENTION_SECS).unwrap();
        assert_eq!(
            s.accept(request("k", new_message("pay/1", T0 + 2)), T0 + 2)
                .await
                .unwrap(),
            AcceptOutcome::Replayed {
                response: req.dedupe.response
            }
        );
        let record = get(&s, &id).await;
        assert_eq!(record.state, MessageState::Pending);
        assert_eq!(record.next_attempt_at, Some(T0 + 5_000));
        assert_eq!(record.history.len(), 1);
        let c = claim_one(&s, T0 + 5_000, &id).await;
        assert_eq!(c.attempts, 1);
    }

    /// A full disk (here a page cap) fails the accept with `Full` (a 503) and burns nothing:
    /// once there is room, the same request is accepted.
    #[tokio::test]
    async fn a_full_disk_is_full_and_burns_no_key() {
        let (_dir, path) = fresh();
        let s = SqliteStore::open_with(&path, RETENTION_SECS, SqliteOptions::default()).unwrap();
        accept_new(&s, "pay/0", T0).await;
        s.set_max_page_count(1).await.unwrap();

        // Bigger than a page: it needs new pages, which the cap refuses.
        let mut big = request("k-big", new_message("pay/1", T0 + 1));
        big.message.body = format!(r#"{{"blob":"{}"}}"#, "x".repeat(64 * 1024));
        let err = s.accept(big.clone(), T0 + 1).await.unwrap_err();
        assert!(matches!(err, StoreError::Full(_)), "{err:?}");
        assert_eq!(s.get(&big.message.id).await.unwrap(), None);

        s.set_max_page_count(1 << 30).await.unwrap();
        assert_eq!(
            s.accept(big.clone(), T0 + 2).await.unwrap(),
            AcceptOutcome::Accepted
        );
        assert!(s.get(&big.message.id).await.unwrap().is_some());
    }

    /// The same cap given at open time, and a store that outlives the failure.
    #[tokio::test]
    async fn a_page_cap_at_open_fails_writes_but_not_reads() {
        let (_dir, path) = fresh();
        {
            SqliteStore::open(&path, RETENTION_SECS).unwrap();
        }
        let options = SqliteOptions {
            max_page_count: Some(1),
            ..SqliteOptions::default()
        };
        let s = SqliteStore::open_with(&path, RETENTION_SECS, options).unwrap();
        let mut big = request("k", new_message("pay/1", T0));
        big.message.body = "y".repeat(64 * 1024);
        assert!(matches!(s.accept(big, T0).await, Err(StoreError::Full(_))));
        assert_eq!(s.depth().await.unwrap(), QueueDepth::default());
        // Reads still work; readiness says why writes do not.
        assert!(matches!(s.ping().await, Err(StoreError::Full(_))));
    }

    #[tokio::test]
    async fn a_file_that_is_not_a_database_is_refused() {
        let (_dir, path) = fresh();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(
            &path,
            b"this is not a SQLite database, not even close.......",
        )
        .unwrap();
        let err = SqliteStore::open(&path, RETENTION_SECS).unwrap_err();
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
    }

    /// Group commit: accepts that queue while a commit is in progress all go into the next
    /// transaction together, one fsync for all of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn accepts_queued_behind_a_commit_share_the_next_one() {
        let (_dir, path) = fresh();
        let options = SqliteOptions {
            timeout: Duration::from_secs(60),
            ..SqliteOptions::default()
        };
        let s =
            std::sync::Arc::new(SqliteStore::open_with(&path, RETENTION_SECS, options).unwrap());
        let accept = |i: i64| {
            let s = std::sync::Arc::clone(&s);
            async move {
                let now = T0 + i;
                s.accept(
                    request(&format!("k{i}"), new_message(&format!("o{i}"), now)),
                    now,
                )
                .await
            }
        };
        let before = s.commits();
        let stall = s.stall_commits();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(accept(0));
        stall.holding().await;
        for i in 1..200 {
            tasks.spawn(accept(i));
        }
        while s.queued() < 199 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(stall);
        while let Some(outcome) = tasks.join_next().await {
            assert_eq!(outcome.unwrap().unwrap(), AcceptOutcome::Accepted);
        }
        assert_eq!(
            s.commits() - before,
            2,
            "the first accept's commit, then one for the 199 that queued behind it"
        );
        let all = list_all(
            &*s,
            ListFilter {
                limit: 500,
                ..Default::default()
            },
        )
        .await;
        assert_eq!(all.len(), 200);
    }
}

mod postgres_only {
    use super::*;

    /// Columns and indexes of `db`'s tables, day partitions left out (a new database has none).
    fn describe(server: &PostgresServer, db: &str) -> String {
        server.psql_db(
            db,
            "SELECT string_agg(x, E'\\n' ORDER BY x) FROM ( \
               SELECT format('%s.%s %s %s %s', table_name, column_name, data_type, \
                             is_nullable, coalesce(column_default, '')) AS x \
               FROM information_schema.columns \
               WHERE table_schema = 'public' AND table_name !~ '_d[0-9]+$' \
               UNION ALL SELECT indexdef FROM pg_indexes \
               WHERE schemaname = 'public' AND tablename !~ '_d[0-9]+$') described",
        )
    }

    /// Every layout version up to this binary's, as `callbackd_layout` lists them.
    fn every_layout() -> String {
        (1..=callbackd::store::postgres::LAYOUT_VERSION)
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A database restored from a release's `fixture` (tests/fixtures/make_postgres_fixture.rs)
    /// of layout `found`, brought to this binary's layout: the versions are recorded, and the
    /// tables and indexes are then a new database's.
    async fn upgraded(fixture: &str, found: i32) -> (&'static PostgresServer, String, Harness) {
        let server = PostgresServer::shared();
        let url = server.fresh_database();
        let db = url.rsplit('/').next().expect("a database").to_string();
        server.psql_db(&db, fixture);
        assert_eq!(server.psql_db(&db, "SELECT count(*) FROM messages"), "11");
        let mut store = PostgresStore::connect(&url, Duration::from_secs(5), RETENTION_SECS)
            .await
            .unwrap()
            .with_caller_clock_leases();
        assert_eq!(
            store.migrate().await.unwrap(),
            found,
            "found layout {found}"
        );
        assert_eq!(
            server.psql_db(
                &db,
                "SELECT string_agg(version::text, ',' ORDER BY version) FROM callbackd_layout"
            ),
            every_layout()
        );
        let new = server.fresh_database();
        let new_db = new.rsplit('/').next().expect("a database").to_string();
        PostgresStore::connect(&new, Duration::from_secs(5), RETENTION_SECS)
            .await
            .unwrap()
            .migrate()
            .await
            .unwrap();
        assert_eq!(describe(server, &db), describe(server, &new_db));
        let h = Harness {
            store: std::sync::Arc::new(store),
            backend: Backend::Postgres { db: db.clone() },
        };
        (server, db, h)
    }

    /// Layout 3, written by the PostgreSQL store of commit 800f655 (tests/fixtures/
    /// make_postgres_fixture.rs), brought to the newest layout in place: no row is rewritten
    /// (each keeps its JSON text and is read as it is), the story goes on, and a new message
    /// keeps its record compressed in `record` and reads back byte for byte.
    #[tokio::test]
    async fn a_third_layout_postgres_store_is_upgraded_in_place() {
        let (server, db, h) = upgraded(include_str!("fixtures/postgres_v3.sql"), 3).await;
        assert_eq!(
            server.psql_db(
                &db,
                "SELECT count(*) FILTER (WHERE record IS NULL AND message_json IS NOT NULL) \
                 FROM messages"
            ),
            "11",
            "nothing rewritten"
        );
        let s = h.s();
        the_release_fixture_goes_on(s, "pg3").await;

        // A new message's record is kept compressed with the dictionary (its mark first), and
        // read back byte for byte.
        let now = T0 + 10_000;
        let (id, body, json_len) = accept_compressible(s, "pg4/after-upgrade", now).await;
        let stored = server.psql_db(
            &db,
            &format!(
                "SELECT octet_length(record), message_json IS NULL, get_byte(record, 0) \
                 FROM messages WHERE id = '{id}'"
            ),
        );
        let [record_len, no_json, first_byte] = stored.split('|').collect::<Vec<_>>()[..] else {
            panic!("one row: {stored}");
        };
        let record_len: usize = record_len.parse().unwrap();
        assert!(
            record_len * 2 < json_len && no_json == "t" && first_byte == "1",
            "{record_len} bytes stored for {json_len} bytes of JSON ({stored})"
        );
        assert_eq!(get(s, &id).await.message.body.as_bytes(), body.as_bytes());
        let leases = s.claim_due(now, 100, LEASE_MS).await.unwrap();
        let lease = leases
            .iter()
            .find(|l| l.message.id == id)
            .expect("the new message is due");
        assert_eq!(lease.message.body.as_bytes(), body.as_bytes());
        assert!(complete(s, lease, Completion::Delivered, now).await);
        let delivered = list_all(
            s,
            ListFilter {
                limit: 100,
                state: Some(MessageState::Delivered),
                ..Default::default()
            },
        )
        .await;
        assert!(
            delivered.iter().any(|r| r.message.id == id),
            "listed among the delivered: {delivered:?}"
        );
    }

    /// Layout 4, written by the PostgreSQL store of commit 7e1b5bf (tests/fixtures/
    /// make_postgres_fixture.rs), brought to layout 5 in place: no row is rewritten (every
    /// history row stays in `history`, the first included), the story goes on, histories read
    /// the same whether their first row is in `history` or in the message's row, and a message
    /// with one attempt after the upgrade has no row in `history` at all.
    #[tokio::test]
    async fn a_fourth_layout_postgres_store_is_upgraded_in_place() {
        let (server, db, h) = upgraded(include_str!("fixtures/postgres_v4.sql"), 4).await;
        let first_rows = "SELECT count(*) FILTER (WHERE first_entry IS NOT NULL), \
                          (SELECT count(*) FROM history WHERE seq = 1) FROM messages";
        let held = server.psql_db(&db, first_rows);
        assert_eq!(
            held, "0|6",
            "nothing rewritten: six first rows, all in `history`"
        );
        let s = h.s();
        let mut before = std::collections::HashMap::new();
        for r in list_all(
            s,
            ListFilter {
                limit: 100,
                ..Default::default()
            },
        )
        .await
        {
            before.insert(r.message.id.clone(), get(s, &r.message.id).await.history);
        }
        the_release_fixture_goes_on(s, "pg4").await;

        // A history begun before the upgrade goes on in `history`, after its first row there;
        // one begun after it keeps its first row in the message's row, and the next in
        // `history`. Both read as one history, in order.
        let key_of = |v: &str| format!("pg4/{v}");
        let all = list_all(
            s,
            ListFilter {
                limit: 100,
                ..Default::default()
            },
        )
        .await;
        let id_of = |key: &str| {
            all.iter()
                .find(|r| r.message.ordering_key == key)
                .map(|r| r.message.id.clone())
                .expect("in the fixture")
        };
        let expedited = id_of(&key_of("expedited"));
        let history = get(s, &expedited).await.history;
        assert_eq!(history[..2], before[&expedited][..], "kept as it was");
        assert_eq!(
            history.iter().map(HistoryEntry::kind).collect::<Vec<_>>(),
            ["delivery", "resend", "delivery"],
            "the attempt after the upgrade appended to it"
        );
        let fresh = id_of(&key_of("fresh"));
        assert!(
            before[&fresh].is_empty(),
            "never attempted before the upgrade"
        );
        let attempts = get(s, &fresh).await;
        assert_eq!(attempts.history.len(), 1);
        assert_eq!(attempts.history_total, 1);
        let fresh_rows = |id: &MessageId| {
            server.psql_db(
                &db,
                &format!(
                    "SELECT (SELECT count(*) FROM history WHERE message_id = '{id}'), \
                     first_entry IS NOT NULL FROM messages WHERE id = '{id}'"
                ),
            )
        };
        assert_eq!(
            fresh_rows(&fresh),
            "0|t",
            "its one row is in its message's row"
        );
        let resent = s
            .resend(
                &fresh,
                ResendMark {
                    at: T0 + 20_000,
                    request_id: None,
                },
                T0 + 20_000 + 7 * DAY_MS,
                T0 + 20_000,
            )
            .await
            .unwrap();
        assert_eq!(resent, ResendEffect::Requeued);
        assert_eq!(fresh_rows(&fresh), "1|t", "the second row is in `history`");
        let read = get(s, &fresh).await;
        assert_eq!(read.history[0], attempts.history[0]);
        assert_eq!(
            read.history
                .iter()
                .map(HistoryEntry::kind)
                .collect::<Vec<_>>(),
            ["delivery", "resend"]
        );
        assert_eq!(read.history_total, 2);
    }
}

/// A recorded message (nothing to deliver) is kept for the message retention, like a finished
/// one, even when its dedupe claim lives shorter: the claim ends, the record stays listable.
async fn a_recorded_message_is_kept_for_the_retention_not_its_claim_ttl(h: &Harness) {
    let s = h.s();
    let message = NewMessage {
        target_url: None,
        ..inbound("payzu", "tx-short-claim", T0)
    };
    let id = message.id.clone();
    let mut req = request(&format!("claim/{id}"), message);
    req.dedupe.ttl_secs = 60;
    assert_eq!(s.accept(req, T0).await.unwrap(), AcceptOutcome::Accepted);
    let past_the_claim = T0 + 3_600_000;
    s.sweep(past_the_claim).await.unwrap();
    assert_eq!(get(s, &id).await.state, MessageState::Recorded);
    let end = T0 + RETENTION_SECS as Millis * 1000;
    while s.sweep(end).await.unwrap() > 0 {}
    assert!(
        s.get(&id).await.unwrap().is_none(),
        "gone after the retention"
    );
}
