//! The PostgreSQL engine shared by several processes and several callers, against real
//! servers (`support/postgres.rs`): work accepted through one process wakes the dispatcher of
//! another at once (LISTEN/NOTIFY), a lost listening connection is replaced, an idle
//! dispatcher costs the database next to nothing (measured), and concurrent accepts are
//! group-committed, each in a savepoint, durable before any answer; completions batched together
//! are written as sets and record each lease once.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use callbackd::app::Settings;
use callbackd::clock::{Clock, Millis, SystemClock};
use callbackd::dispatch::Dispatcher;
use callbackd::store::postgres::{ACCEPT_WORKERS, PostgresOptions, PostgresStore};
use callbackd::store::{AcceptOutcome, AcceptRequest, Store, StoreError};
use postgres_support::PostgresServer;
use support::sink::Sink;
use support::wake::{assert_woken_at_once, front_and_back};
use support::{TestServer, config, eventually, notification_request};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const RETENTION_SECS: u64 = 2_592_000;
const TIMEOUT: Duration = Duration::from_secs(5);
fn database_name(url: &str) -> &str {
    url.rsplit('/').next().unwrap_or_default()
}

fn now() -> Millis {
    SystemClock.now_ms()
}

async fn migrated(url: &str, options: &PostgresOptions) -> PostgresStore {
    let mut store = PostgresStore::connect_with(url, TIMEOUT, RETENTION_SECS, options)
        .await
        .expect("connects");
    store.migrate().await.expect("migrates");
    store
}

/// A client of the test's own, on database `url`.
async fn raw_client(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("a raw connection");
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_accepted_by_one_process_is_delivered_by_another_at_once() {
    let db = PostgresServer::shared().fresh_database();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&db, &sink).await;
    // The back's listener connects, and its first (empty) claims pass.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_woken_at_once(&front, &sink, 0).await;
}

/// The backends `LISTEN`ing on database `db`.
fn listeners(server: &PostgresServer, db: &str) -> Vec<String> {
    server
        .psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE datname = '{db}' \
             AND query LIKE 'LISTEN %' ORDER BY pid"
        ))
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listening_connection_is_replaced_and_wakes_again() {
    let server = PostgresServer::shared();
    let url = server.fresh_database();
    let db = database_name(&url).to_string();
    let sink = Sink::ok().await;
    let (front, _back) = front_and_back(&url, &sink).await;
    let first = eventually(10, "the back listens", || async {
        let found = listeners(server, &db);
        (found.len() == 1).then_some(found)
    })
    .await;
    server.psql(&format!("SELECT pg_terminate_backend({})", first[0]));
    eventually(10, "another connection listens", || async {
        let found = listeners(server, &db);
        (found.len() == 1 && found != first).then_some(())
    })
    .await;
    assert_woken_at_once(&front, &sink, 10).await;
}

/// Statements, and commits among them, that a dispatcher with no work sends to database `db`
/// over 10 s, from `pg_stat_statements` (which counts each statement as it ends).
async fn idle_cost(server: &PostgresServer, listen: bool) -> (u64, u64) {
    let url = server.fresh_database();
    let db = database_name(&url).to_string();
    let settings = Settings::from_config(&config(&url, None)).expect("settings");
    let options = PostgresOptions {
        listen,
        ..PostgresOptions::default()
    };
    let store: Arc<dyn Store> = Arc::new(migrated(&url, &options).await);
    let dispatcher = Dispatcher::new(
        &settings,
        store,
        Arc::new(SystemClock),
        Arc::new(tokio::sync::Notify::new()),
    )
    .expect("dispatcher");
    let stop = CancellationToken::new();
    let running = tokio::spawn(Arc::new(dispatcher).run(stop.clone(), Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.psql("SELECT pg_stat_statements_reset()");
    tokio::time::sleep(Duration::from_secs(10)).await;
    let counted = server.psql(&format!(
        "SELECT coalesce(sum(calls), 0), coalesce(sum(calls) FILTER (WHERE query = 'COMMIT'), 0) \
         FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{db}'"
    ));
    stop.cancel();
    running.await.expect("the dispatcher stops");
    let (statements, commits) = counted.trim().split_once('|').expect("two columns");
    (
        statements.parse().expect("a count"),
        commits.parse().expect("a count"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_dispatcher_costs_next_to_nothing_when_it_listens() {
    let server = PostgresServer::start_with(&[("shared_preload_libraries", "pg_stat_statements")]);
    server.psql("CREATE EXTENSION pg_stat_statements");
    let (polled, polled_commits) = idle_cost(&server, false).await;
    let (listening, listening_commits) = idle_cost(&server, true).await;
    eprintln!(
        "an idle dispatcher over 10 s: polling every 100 ms, {polled} statements \
         ({polled_commits} commits); listening, polling every 5 s, {listening} statements \
         ({listening_commits} commits)"
    );
    assert!(
        polled_commits >= 40,
        "the 100 ms poll claims: {polled_commits}"
    );
    assert!(
        listening_commits <= 7 && listening * 8 <= polled,
        "listening: {listening} statements ({listening_commits} commits), polling: {polled}"
    );
}

/// Every accept worker of `store` held up by a batch waiting for the test's lock on the
/// dedupe key `blocker` (held by `raw`): what the test queues next goes in one batch once the
/// lock is let go. The blocking accepts' handles are returned.
async fn occupy_workers(
    store: &Arc<PostgresStore>,
    raw: &tokio_postgres::Client,
) -> Vec<JoinHandle<Result<AcceptOutcome, StoreError>>> {
    raw.execute("SELECT pg_advisory_lock(1, hashtext('blocker'))", &[])
        .await
        .expect("locks");
    let mut blocked = Vec::new();
    for n in 0..ACCEPT_WORKERS {
        blocked.push(spawn_accept(
            store,
            notification_request("blocker", &format!("k-blocker-{n}"), now()),
        ));
        // One at a time, so each is a batch of its own on a worker of its own.
        let waiting = n + 1;
        eventually(10, "a worker waits for the lock", || async {
            let row = raw
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                     AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                    &[],
                )
                .await
                .ok()?;
            let count: i64 = row.get(0);
            (count as usize == waiting).then_some(())
        })
        .await;
    }
    blocked
}

/// Lets the workers go (after what the test queued has reached the queue) and checks the
/// blocking accepts: one accepted, the others replays of it.
async fn free_workers(
    raw: &tokio_postgres::Client,
    blocked: Vec<JoinHandle<Result<AcceptOutcome, StoreError>>>,
) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.execute("SELECT pg_advisory_unlock(1, hashtext('blocker'))", &[])
        .await
        .expect("unlocks");
    let mut accepted = 0;
    for outcome in blocked {
        match outcome.await.expect("joins").expect("accepts") {
            AcceptOutcome::Accepted => accepted += 1,
            AcceptOutcome::Replayed { .. } => {}
            other => panic!("blocking accept: {other:?}"),
        }
    }
    assert_eq!(accepted, 1);
}

fn spawn_accept(
    store: &Arc<PostgresStore>,
    req: AcceptRequest,
) -> JoinHandle<Result<AcceptOutcome, StoreError>> {
    let store = Arc::clone(store);
    tokio::spawn(async move { store.accept(req, now()).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_accepts_share_commits_and_are_all_durable() {
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    // The day's partitions exist before the burst.
    store
        .accept(notification_request("warm-up", "k-warm", now()), now())
        .await
        .expect("accepts");
    let before = store.accept_commits();
    const N: usize = 64;
    let requests: Vec<AcceptRequest> = (0..N)
        .map(|n| notification_request(&format!("burst-{n}"), &format!("k-{}", n % 8), now()))
        .collect();
    let ids: Vec<_> = requests.iter().map(|r| r.message.id.clone()).collect();
    let calls: Vec<_> = requests
        .into_iter()
        .map(|req| spawn_accept(&store, req))
        .collect();
    for call in calls {
        assert_eq!(
            call.await.expect("joins").expect("accepts"),
            AcceptOutcome::Accepted
        );
    }
    let commits = store.accept_commits() - before;
    eprintln!("{N} concurrent accepts committed in {commits} transactions");
    assert!(commits <= (N / 2) as u64, "{N} accepts, {commits} commits");
    assert_eq!(store.accept_batches_one_by_one(), 0, "written as sets");
    // Durable: another store, on connections of its own, reads every one.
    drop(store);
    let other = migrated(&url, &PostgresOptions::default()).await;
    for id in &ids {
        assert!(
            other.get(id).await.expect("reads").is_some(),
            "{id} recorded"
        );
    }
    assert_eq!(other.depth().await.expect("depth").pending, N as u64 + 1);
    // A batch made exactly one head per ordering key due, whatever its order: the first of
    // each key it wrote (8 keys, and the warm-up's own).
    let heads = other.claim_due(now(), N, 60_000).await.expect("claims");
    let mut keys: Vec<_> = heads
        .iter()
        .map(|l| l.message.ordering_key.clone())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!((heads.len(), keys.len()), (9, 9), "one head per key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_twice_in_one_batch_is_one_accept_and_one_replay() {
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    let raw = raw_client(&url).await;
    let blocked = occupy_workers(&store, &raw).await;
    let before = store.accept_commits();
    let first = notification_request("twice", "k-twice", now());
    let mut second = notification_request("twice", "k-twice", now());
    second.dedupe.response = first.dedupe.response.clone();
    let (first_id, second_id) = (first.message.id.clone(), second.message.id.clone());
    let calls = [spawn_accept(&store, first), spawn_accept(&store, second)];
    free_workers(&raw, blocked).await;
    let mut outcomes = Vec::new();
    for call in calls {
        outcomes.push(call.await.expect("joins").expect("answers"));
    }
    assert_eq!(
        store.accept_commits() - before,
        ACCEPT_WORKERS as u64 + 1,
        "the blocking batches, then both in one"
    );
    assert_eq!(store.accept_batches_one_by_one(), 0, "decided as a set");
    outcomes.sort_by_key(|o| format!("{o:?}"));
    assert!(
        matches!(
            outcomes.as_slice(),
            [AcceptOutcome::Accepted, AcceptOutcome::Replayed { .. }]
        ),
        "{outcomes:?}"
    );
    let recorded = [
        store.get(&first_id).await.expect("reads").is_some(),
        store.get(&second_id).await.expect("reads").is_some(),
    ];
    assert_eq!(
        recorded.iter().filter(|r| **r).count(),
        1,
        "one message recorded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accept_failing_in_a_batch_fails_alone() {
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    let raw = raw_client(&url).await;
    let blocked = occupy_workers(&store, &raw).await;
    let before = store.accept_commits();
    let good = notification_request("good", "k-good", now());
    // The same message id as `good`: whichever of the two the batch applies second is refused
    // by the queue after its dedupe claim was written. The tasks race into the batch, so which
    // one loses is not fixed; that exactly one does, alone, is.
    let mut bad = notification_request("bad", "k-bad", now());
    bad.message.id = good.message.id.clone();
    let also_good = notification_request("also-good", "k-also-good", now());
    let also_good_id = also_good.message.id.clone();
    let calls = [
        spawn_accept(&store, good),
        spawn_accept(&store, bad),
        spawn_accept(&store, also_good),
    ];
    free_workers(&raw, blocked).await;
    let mut outcomes = Vec::new();
    for call in calls {
        outcomes.push(call.await.expect("joins"));
    }
    assert_eq!(store.accept_commits() - before, ACCEPT_WORKERS as u64 + 1);
    assert_eq!(
        store.accept_batches_one_by_one(),
        1,
        "the set write was refused, then run one by one"
    );
    let failed = match (&outcomes[0], &outcomes[1]) {
        (Ok(AcceptOutcome::Accepted), Err(StoreError::Unavailable(_))) => ("bad", "k-bad"),
        (Err(StoreError::Unavailable(_)), Ok(AcceptOutcome::Accepted)) => ("good", "k-good"),
        _ => panic!("exactly one of the two sharing an id fails: {outcomes:?}"),
    };
    assert!(
        matches!(outcomes[2], Ok(AcceptOutcome::Accepted)),
        "{outcomes:?}"
    );
    assert!(store.get(&also_good_id).await.expect("reads").is_some());
    // The failed accept's claim was rolled back with it: its key is free.
    let retry = notification_request(failed.0, failed.1, now());
    assert_eq!(
        store.accept(retry, now()).await.expect("accepts"),
        AcceptOutcome::Accepted
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_fails_fails_every_caller_and_records_nothing() {
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    let raw = raw_client(&url).await;
    let blocked = occupy_workers(&store, &raw).await;
    // The batch will wait for this lock too, and lose its connection while waiting.
    raw.execute("SELECT pg_advisory_lock(1, hashtext('doomed'))", &[])
        .await
        .expect("locks");
    let requests = [
        notification_request("lost-1", "k-lost-1", now()),
        notification_request("lost-2", "k-lost-2", now()),
        notification_request("doomed", "k-doomed", now()),
    ];
    let ids: Vec<_> = requests.iter().map(|r| r.message.id.clone()).collect();
    let calls: Vec<_> = requests
        .into_iter()
        .map(|req| spawn_accept(&store, req))
        .collect();
    free_workers(&raw, blocked).await;
    let waiting = eventually(10, "the batch waits for `doomed`", || async {
        let row = raw
            .query_opt(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
                 AND classid = 1 AND objid = hashtext('doomed')::oid",
                &[],
            )
            .await
            .ok()??;
        Some(row.get::<_, i32>(0))
    })
    .await;
    raw.execute("SELECT pg_terminate_backend($1)", &[&waiting])
        .await
        .expect("terminates");
    for call in calls {
        let outcome = call.await.expect("joins");
        assert!(
            matches!(outcome, Err(StoreError::Unavailable(_))),
            "{outcome:?}"
        );
    }
    raw.execute("SELECT pg_advisory_unlock(1, hashtext('doomed'))", &[])
        .await
        .expect("unlocks");
    for id in &ids {
        assert!(
            store.get(id).await.expect("reads").is_none(),
            "{id} not recorded"
        );
    }
    // No key was burnt: each is accepted anew.
    for key in ["lost-1", "lost-2", "doomed"] {
        let again = notification_request(key, &format!("k-{key}"), now());
        assert_eq!(
            store.accept(again, now()).await.expect("accepts"),
            AcceptOutcome::Accepted
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_two_processes_sharing_keys_in_opposite_orders_never_deadlock() {
    let url = PostgresServer::shared().fresh_database();
    let stores = [
        Arc::new(migrated(&url, &PostgresOptions::default()).await),
        Arc::new(migrated(&url, &PostgresOptions::default()).await),
    ];
    for (n, store) in stores.iter().enumerate() {
        store
            .accept(
                notification_request(&format!("warm-{n}"), "k-warm", now()),
                now(),
            )
            .await
            .expect("accepts");
    }
    let before: u64 = stores.iter().map(|s| s.accept_commits()).sum();
    const N: usize = 32;
    const ROUNDS: usize = 3;
    for round in 0..ROUNDS {
        // Each process's burst takes the same ordering keys' locks, one in the opposite order
        // of the other.
        let mut calls = Vec::new();
        for i in 0..N {
            calls.push(spawn_accept(
                &stores[0],
                notification_request(&format!("a-{round}-{i}"), &format!("k-{i}"), now()),
            ));
            calls.push(spawn_accept(
                &stores[1],
                notification_request(
                    &format!("b-{round}-{i}"),
                    &format!("k-{}", N - 1 - i),
                    now(),
                ),
            ));
        }
        // PostgreSQL breaks a deadlock after `deadlock_timeout` by failing one side, which
        // this accept's caller would hear (`40P01`).
        for call in calls {
            assert_eq!(
                call.await.expect("joins").expect("accepts"),
                AcceptOutcome::Accepted
            );
        }
    }
    let commits = stores.iter().map(|s| s.accept_commits()).sum::<u64>() - before;
    assert!(
        commits < (2 * N * ROUNDS) as u64,
        "batches formed: {commits} commits"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_this_process_scheduled_is_made_on_time_despite_the_slow_poll() {
    let db = PostgresServer::shared().fresh_database();
    // The first attempt fails; the retry is due 100 ms later (`initial_backoff_ms`).
    let sink =
        Sink::start(|_, n| support::sink::Reply::status(if n == 0 { 500 } else { 204 })).await;
    let forward = format!("{}/forward", sink.url);
    let server = TestServer::start(config(&db, Some(&forward))).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let answer = server
        .post_callback(
            "payzu",
            r#"{"id":"tx-retry","status":"PAID","amount":1}"#,
            None,
        )
        .await;
    assert_eq!(answer.status(), 200);
    eventually(10, "the first attempt", || async {
        (sink.count() >= 1).then_some(())
    })
    .await;
    let failed = Instant::now();
    eventually(10, "the retry", || async {
        (sink.count() >= 2).then_some(())
    })
    .await;
    let took = failed.elapsed();
    assert!(
        took < Duration::from_millis(1200),
        "a retry due 100 ms after the failure was made {took:?} after it (the idle poll is 5 s)"
    );
}

/// Two retries this process scheduled, due at different times: each is made on time, the
/// later too (a dispatcher that remembered only the earliest found the later one at its idle
/// poll, seconds late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_retries_this_process_scheduled_are_each_made_on_time() {
    let db = PostgresServer::shared().fresh_database();
    // The first attempt of each callback fails; each retry is due 400 ms after its failure,
    // so the second failure is noted before the first retry is due, however slow the machine.
    let sink =
        Sink::start(|_, n| support::sink::Reply::status(if n < 2 { 500 } else { 204 })).await;
    let forward = format!("{}/forward", sink.url);
    let mut cfg = config(&db, Some(&forward));
    cfg.dispatch.initial_backoff_ms = 400;
    let server = TestServer::start(cfg).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut failed = Vec::new();
    for (i, tx) in ["tx-retry-a", "tx-retry-b"].iter().enumerate() {
        let body = format!(r#"{{"id":"{tx}","status":"PAID","amount":1}}"#);
        assert_eq!(
            server.post_callback("payzu", &body, None).await.status(),
            200
        );
        eventually(10, "the first attempt", || async {
            (sink.count() > i).then_some(())
        })
        .await;
        failed.push(Instant::now());
        // The second failure is noted after the first retry's time, and before it is due.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut made = Vec::new();
    for n in [3, 4] {
        eventually(10, "a retry", || async {
            (sink.count() >= n).then_some(())
        })
        .await;
        made.push(Instant::now());
    }
    for (i, (failed, made)) in failed.iter().zip(&made).enumerate() {
        let took = made.duration_since(*failed);
        assert!(
            took < Duration::from_millis(1500),
            "retry {i}, due 400 ms after its failure, was made {took:?} after it (the idle poll is 5 s)"
        );
    }
}

/// Claimers racing completers: a complete that finishes a message moves its row to the day
/// partition, and a concurrent claim whose scan had seen that row due fails to lock it with
/// `40001` ("already moved to another partition") instead of skipping it. The claim tries
/// again at once, so no claim fails, and every message is leased once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_racing_completions_that_finish_messages_never_fail() {
    use callbackd::store::Completion;
    const MESSAGES: usize = 2_000;
    const CLAIMERS: usize = 4;
    let db = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&db, &PostgresOptions::default()).await);
    let t0 = now();
    let accepts: Vec<_> = (0..MESSAGES)
        .map(|n| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let req = notification_request(&format!("race-{n}"), &format!("k-{n}"), t0);
                store.accept(req, t0).await.expect("accepts")
            })
        })
        .collect();
    for accept in accepts {
        assert_eq!(accept.await.expect("joins"), AcceptOutcome::Accepted);
    }
    let leased = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let claimers: Vec<_> = (0..CLAIMERS)
        .map(|_| {
            let (store, leased) = (Arc::clone(&store), Arc::clone(&leased));
            tokio::spawn(async move {
                let at = t0 + 1;
                loop {
                    let leases = store.claim_due(at, 8, 60_000).await.expect("claims");
                    if leases.is_empty() {
                        return;
                    }
                    for lease in leases {
                        assert!(
                            leased.lock().unwrap().insert(lease.message.id.clone()),
                            "leased twice"
                        );
                        store
                            .complete(&lease, delivered_at(at), Completion::Delivered, at)
                            .await
                            .expect("completes");
                    }
                }
            })
        })
        .collect();
    for claimer in claimers {
        claimer.await.expect("a claimer");
    }
    assert_eq!(leased.lock().unwrap().len(), MESSAGES, "each message once");
    // Every completion was recorded: nothing is left to claim, at any time.
    let much_later = t0 + 30 * 24 * 3_600_000;
    assert!(
        store
            .claim_due(much_later, 8, 60_000)
            .await
            .expect("claims")
            .is_empty()
    );
    assert_eq!(store.depth().await.expect("depth").pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_completions_share_commits_and_each_is_recorded() {
    use callbackd::store::{Completion, DeliveryAttempt};
    const N: usize = 64;
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    let t0 = now();
    for n in 0..N {
        let req = notification_request(&format!("done-{n}"), &format!("k-{n}"), t0);
        store.accept(req, t0).await.expect("accepts");
    }
    let leases = store.claim_due(t0 + 1, N, 60_000).await.expect("claims");
    assert_eq!(leases.len(), N);
    let before = store.completion_commits();
    let completions: Vec<_> = leases
        .into_iter()
        .enumerate()
        .map(|(n, lease)| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let attempt = DeliveryAttempt {
                    attempt: 1,
                    at: t0 + 1,
                    status: Some(if n % 2 == 0 { 204 } else { 500 }),
                    error: None,
                    latency_ms: Some(1),
                    response: None,
                };
                let completion = if n % 2 == 0 {
                    Completion::Delivered
                } else {
                    Completion::Dead
                };
                store
                    .complete(&lease, attempt, completion, t0 + 1)
                    .await
                    .expect("completes")
            })
        })
        .collect();
    for completion in completions {
        assert!(completion.await.expect("joins"), "recorded");
    }
    let commits = store.completion_commits() - before;
    eprintln!("{N} concurrent completions committed in {commits} transactions");
    assert!(
        commits <= (N / 2) as u64,
        "{N} completions, {commits} commits"
    );
    // Durable, each with its own outcome: another store reads them back.
    drop(store);
    let other = migrated(&url, &PostgresOptions::default()).await;
    let depth = other.depth().await.expect("depth");
    assert_eq!(
        (depth.pending, depth.in_flight, depth.dead),
        (0, 0, N as u64 / 2)
    );
}

/// A first attempt at `at` that the receiver answered 204.
fn delivered_at(at: Millis) -> callbackd::store::DeliveryAttempt {
    callbackd::store::DeliveryAttempt {
        attempt: 1,
        at,
        status: Some(204),
        error: None,
        latency_ms: Some(1),
        response: None,
    }
}

/// Completes every lease of `leases` from its own task, each `times` times at once; answers
/// how many completions of each lease were recorded.
async fn complete_concurrently(
    store: &Arc<PostgresStore>,
    leases: Vec<callbackd::store::Lease>,
    times: usize,
    at: Millis,
) -> Vec<usize> {
    use callbackd::store::Completion;
    let tasks: Vec<Vec<JoinHandle<bool>>> = leases
        .into_iter()
        .map(|lease| {
            (0..times)
                .map(|_| {
                    let store = Arc::clone(store);
                    let lease = lease.clone();
                    tokio::spawn(async move {
                        store
                            .complete(&lease, delivered_at(at), Completion::Delivered, at)
                            .await
                            .expect("completes")
                    })
                })
                .collect()
        })
        .collect();
    let mut recorded = Vec::new();
    for copies in tasks {
        let mut n = 0;
        for copy in copies {
            n += usize::from(copy.await.expect("joins"));
        }
        recorded.push(n);
    }
    recorded
}

/// Completions written as one set (`apply_set.rs`) finish each message into its day with its
/// history, and make the next message of each ordering key due; a batch that names one lease
/// twice records it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_batched_together_move_their_queues_and_record_each_once() {
    const KEYS: usize = 32;
    let url = PostgresServer::shared().fresh_database();
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    let t0 = now();
    for round in 0..2 {
        for k in 0..KEYS {
            let req = notification_request(&format!("m-{round}-{k}"), &format!("k-{k}"), t0);
            store.accept(req, t0).await.expect("accepts");
        }
    }
    let heads = store
        .claim_due(t0 + 1, 2 * KEYS, 60_000)
        .await
        .expect("claims");
    assert_eq!(heads.len(), KEYS, "only the head of each key is due");
    let before = store.completion_commits();
    let recorded = complete_concurrently(&store, heads.clone(), 1, t0 + 2).await;
    assert!(recorded.iter().all(|&n| n == 1), "{recorded:?}");
    let commits = store.completion_commits() - before;
    assert!(
        commits < KEYS as u64,
        "{KEYS} completions, {commits} commits"
    );
    for lease in &heads {
        let record = store.get(&lease.message.id).await.expect("reads");
        let record = record.expect("kept for its retention");
        assert_eq!(record.state, callbackd::store::MessageState::Delivered);
        assert_eq!((record.history.len(), record.history_total), (1, 1));
    }
    // The second message of every key became its head, due when the first finished.
    let behind = store
        .claim_due(t0 + 2, 2 * KEYS, 60_000)
        .await
        .expect("claims");
    assert_eq!(behind.len(), KEYS, "each key's next message is due");
    let recorded = complete_concurrently(&store, behind.clone(), 3, t0 + 3).await;
    assert!(recorded.iter().all(|&n| n == 1), "{recorded:?}");
    for lease in &behind {
        let record = store.get(&lease.message.id).await.expect("reads");
        let record = record.expect("kept for its retention");
        assert_eq!((record.history.len(), record.history_total), (1, 1));
    }
    let depth = store.depth().await.expect("depth");
    assert_eq!((depth.pending, depth.in_flight), (0, 0));
}

/// A worker whose lease ran out and the worker that took the message over complete it at
/// once, copies of each in whatever batches form: the taker's is recorded, the stale one's
/// never, also when a batch holds both with the stale one first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_and_a_current_lease_completed_together_record_only_the_current() {
    const KEYS: usize = 32;
    let url = PostgresServer::shared().fresh_database();
    let store = migrated(&url, &PostgresOptions::default()).await;
    let store = Arc::new(store.with_caller_clock_leases());
    let t0 = now();
    for k in 0..KEYS {
        let req = notification_request(&format!("s-{k}"), &format!("k-{k}"), t0);
        store.accept(req, t0).await.expect("accepts");
    }
    let stale = store.claim_due(t0 + 1, KEYS, 10).await.expect("claims");
    let current = store
        .claim_due(t0 + 20, KEYS, 60_000)
        .await
        .expect("claims");
    assert_eq!((stale.len(), current.len()), (KEYS, KEYS), "taken over");
    let mut both = Vec::new();
    for (old, new) in stale.iter().zip(&current) {
        assert_eq!(old.message.id, new.message.id);
        both.extend([old.clone(), new.clone()]);
    }
    let recorded = complete_concurrently(&store, both, 3, t0 + 21).await;
    let (olds, news): (Vec<_>, Vec<_>) = recorded.chunks(2).map(|c| (c[0], c[1])).unzip();
    assert!(
        olds.iter().all(|&n| n == 0),
        "stale leases recorded: {olds:?}"
    );
    assert!(news.iter().all(|&n| n == 1), "current leases: {news:?}");
    for lease in &current {
        let record = store.get(&lease.message.id).await.expect("reads");
        let record = record.expect("kept for its retention");
        assert_eq!((record.history.len(), record.history_total), (1, 1));
    }
}

/// Sequential scans of `table` so far, as the server counts them (its statistics reach the
/// view within a second or so of each transaction).
async fn seq_scans(raw: &tokio_postgres::Client, table: &str) -> i64 {
    raw.execute("SELECT pg_stat_clear_snapshot()", &[])
        .await
        .expect("clears");
    let row = raw
        .query_one(
            "SELECT coalesce(seq_scan, 0) FROM pg_stat_user_tables WHERE relname = $1",
            &[&table],
        )
        .await
        .expect("reads statistics");
    row.get(0)
}

/// Claims and completions plan their statements once per connection (generic plans), and a
/// plan made while the live partition looked empty still reads it by its indexes once it is
/// full: draining thousands of messages scans no table from end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_planned_on_an_empty_store_read_a_full_one_by_its_indexes() {
    const N: usize = 3_000;
    let url = PostgresServer::shared().fresh_database();
    let raw = raw_client(&url).await;
    let store = migrated(&url, &PostgresOptions::default()).await;
    // The statistics say the tables are empty, and every pooled connection plans its claim and
    // completion statements while they are.
    raw.batch_execute("VACUUM ANALYZE").await.expect("analyzes");
    let t0 = now();
    for round in 0..4 {
        let req = notification_request(&format!("warm-{round}"), &format!("w-{round}"), t0);
        store.accept(req, t0).await.expect("accepts");
    }
    let store = Arc::new(store);
    let warm = store.claim_due(t0 + 1, 64, 60_000).await.expect("claims");
    complete_concurrently(&store, warm, 1, t0 + 1).await;
    for n in 0..N {
        let req = notification_request(&format!("full-{n}"), &format!("k-{n}"), t0);
        store.accept(req, t0).await.expect("accepts");
    }
    let before = seq_scans(&raw, "messages_live").await;
    let mut drained = 0;
    while drained < N {
        let leases = store.claim_due(t0 + 2, 64, 60_000).await.expect("claims");
        assert!(!leases.is_empty(), "{drained} of {N} drained");
        drained += leases.len();
        complete_concurrently(&store, leases, 1, t0 + 2).await;
    }
    // Statistics arrive within a second or so of each transaction.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let scans = seq_scans(&raw, "messages_live").await - before;
    assert_eq!(
        scans, 0,
        "draining {N} messages scanned messages_live {scans} times"
    );
}

/// Claims of the due-message query `db` ran, from `pg_stat_statements`.
fn claims_run(server: &PostgresServer, db: &str) -> u64 {
    server
        .psql(&format!(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s \
             JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = '{db}' \
             AND s.query LIKE '%FROM messages_live m WHERE m.due_at <=%'"
        ))
        .trim()
        .parse()
        .expect("a count")
}

/// A claim is a durable commit: one host's worth per claim (here one message, its one slot)
/// capped a fast host at a slot per commit. While the host takes what it is sent, a claim
/// takes what the waiting room holds, and the messages wait for the slot in memory; 300 due
/// messages to a host with one slot then take far fewer claims than messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_host_with_one_slot_gets_more_than_one_message_per_claim() {
    let server = PostgresServer::start_with(&[("shared_preload_libraries", "pg_stat_statements")]);
    server.psql("CREATE EXTENSION pg_stat_statements");
    let url = server.fresh_database();
    let db = database_name(&url).to_string();
    let sink = Sink::ok().await;
    let store = Arc::new(migrated(&url, &PostgresOptions::default()).await);
    const MESSAGES: usize = 300;
    let at = now();
    for n in 0..MESSAGES {
        let mut req = notification_request(&format!("d-{n}"), &format!("k-{n}"), at);
        req.message.target_url = Some(format!("{}/hook", sink.url));
        assert_eq!(
            store.accept(req, at).await.expect("accepts"),
            AcceptOutcome::Accepted
        );
    }
    let mut cfg = config(&url, None);
    cfg.dispatch.per_host_concurrency = 1;
    let settings = Settings::from_config(&cfg).expect("settings");
    let dispatcher = Dispatcher::new(
        &settings,
        store as Arc<dyn Store>,
        Arc::new(SystemClock),
        Arc::new(tokio::sync::Notify::new()),
    )
    .expect("dispatcher");
    server.psql("SELECT pg_stat_statements_reset()");
    let stop = CancellationToken::new();
    let running = tokio::spawn(Arc::new(dispatcher).run(stop.clone(), Duration::from_secs(1)));
    eventually(60, "every message delivered", || async {
        (sink.count() >= MESSAGES).then_some(())
    })
    .await;
    stop.cancel();
    running.await.expect("the dispatcher stops");
    let claims = claims_run(&server, &db);
    eprintln!("{MESSAGES} messages to a host with one slot in {claims} claims");
    assert!(
        claims * 3 <= MESSAGES as u64,
        "{claims} claims for {MESSAGES} messages to one fast host"
    );
}
