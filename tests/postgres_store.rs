//! The PostgreSQL engine's foundations against private servers (`support/postgres.rs`): the
//! layout and its version, the partition count, the durability check, the bounded calls (a
//! lost server or a held lock is a quick `Unavailable`, never a hang), a multi-host URL that
//! follows a failover, the reads over rows as the layout holds them, and retention by whole
//! day partitions that a resend cannot lose a message to.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use callbackd::clock::Millis;
use callbackd::durability::Verdict;
use callbackd::store::partitions::Partitions;
use callbackd::store::postgres::{LAYOUT_VERSION, PostgresOptions, PostgresStore};
use callbackd::store::{
    AcceptOutcome, AcceptRequest, Completion, DedupeClaim, DeliveryAttempt, HistoryEntry,
    ListFilter, MessageId, MessageKind, MessageState, NewMessage, OperationReservation,
    PaymentStatusRead, QueueDepth, ResendEffect, ResendMark, Store, StoreError,
};
use postgres_support::{PostgresServer, free_port};

/// 2025-11-30T00:00:00Z: ids encode creation time, so times must be realistic.
const T0: Millis = 1_764_460_800_000;
const DAY_MS: Millis = 86_400_000;
const RETENTION_SECS: u64 = 2_592_000;
const TIMEOUT: Duration = Duration::from_secs(2);

async fn migrated(server: &PostgresServer) -> PostgresStore {
    let mut store = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .expect("connects");
    store.migrate().await.expect("migrates");
    store
}

/// A client of the test's own, for what the engine cannot do yet or must not do.
async fn raw_client(server: &PostgresServer) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("a raw connection");
    tokio::spawn(connection);
    client
}

fn message(ordering_key: &str, source: Option<&str>, created_at: Millis) -> NewMessage {
    NewMessage {
        id: MessageId::generate(created_at, ordering_key, Partitions::DEFAULT),
        kind: MessageKind::Inbound,
        source: source.map(Into::into),
        payment_id: None,
        transaction_id: Some("tx-1".into()),
        ordering_key: ordering_key.to_string(),
        event: None,
        target_url: Some("http://127.0.0.1:9/cb".into()),
        headers: BTreeMap::new(),
        body: r#"{"id":"tx-1","status":"PAID"}"#.into(),
        created_at,
        deadline: created_at + 7 * DAY_MS,
    }
}

/// Writes a message row (and its history) as the layout holds it: `ends_at` `None` in the
/// live partition, else in the partition of its end day, created here.
async fn insert_message(
    client: &tokio_postgres::Client,
    message: &NewMessage,
    state: MessageState,
    ends_at: Option<Millis>,
    history: &[HistoryEntry],
) {
    let end_day: i32 = ends_at.map_or(0, |end| (end / DAY_MS + 1) as i32);
    if end_day != 0 {
        for table in ["messages", "history"] {
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {table}_d{end_day} PARTITION OF {table} \
                     FOR VALUES IN ({end_day})"
                ))
                .await
                .expect("a day partition");
        }
    }
    let json = serde_json::to_string(message).unwrap();
    let attempts = history.iter().filter(|h| h.delivery().is_some()).count() as i32;
    client
        .execute(
            "INSERT INTO messages (id, end_day, message_json, source, ordering_key, state, \
             deadline, due_at, ends_at, history_total, delivery_attempts) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            &[
                &message.id.as_str(),
                &end_day,
                &json,
                &message.source.as_deref(),
                &message.ordering_key,
                &state.as_str(),
                &message.deadline,
                &(state == MessageState::Pending).then_some(message.created_at),
                &ends_at,
                &(history.len() as i64),
                &attempts,
            ],
        )
        .await
        .expect("a message row");
    for (n, entry) in history.iter().enumerate() {
        client
            .execute(
                "INSERT INTO history (message_id, end_day, seq, entry_json) VALUES ($1, $2, $3, $4)",
                &[
                    &message.id.as_str(),
                    &end_day,
                    &(n as i64 + 1),
                    &serde_json::to_string(entry).unwrap(),
                ],
            )
            .await
            .expect("a history row");
    }
}

fn attempt(n: u32, at: Millis, status: u16) -> HistoryEntry {
    HistoryEntry::Delivery(DeliveryAttempt {
        attempt: n,
        at,
        status: Some(status),
        error: None,
        latency_ms: Some(12),
        response: None,
    })
}

#[tokio::test]
async fn a_new_database_gets_the_layout_recorded_once_and_reads_empty() {
    let server = PostgresServer::start();
    let mut store = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    assert_eq!(store.migrate().await.unwrap(), 0, "an empty database");
    assert_eq!(store.partitions(), Partitions::DEFAULT);
    let mut again = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    assert_eq!(again.migrate().await.unwrap(), LAYOUT_VERSION);
    assert_eq!(
        server.psql("SELECT string_agg(version::text, ',' ORDER BY version) FROM callbackd_layout"),
        every_layout(),
        "each version recorded once"
    );

    let id = MessageId::generate(T0, "pay/1", store.partitions());
    assert_eq!(store.get(&id).await.unwrap(), None);
    let page = store
        .list(&ListFilter {
            limit: 10,
            ..ListFilter::default()
        })
        .await
        .unwrap();
    assert!(page.messages.is_empty() && page.next_after.is_none());
    assert_eq!(store.depth().await.unwrap(), QueueDepth::default());
    assert_eq!(store.oldest_unfinished().await.unwrap(), None);
    assert_eq!(store.payment_status("pay-1", T0).await.unwrap(), None);
    store.ping().await.unwrap();
}

#[tokio::test]
async fn two_processes_starting_at_once_migrate_once() {
    let server = PostgresServer::start();
    let url = server.url();
    let starts = (0..4).map(|_| {
        let url = url.clone();
        tokio::spawn(async move {
            let mut store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS).await?;
            store.migrate().await
        })
    });
    let mut found: Vec<i32> = futures::future::join_all(starts)
        .await
        .into_iter()
        .map(|r| r.expect("joins").expect("migrates"))
        .collect();
    found.sort();
    assert_eq!(
        found,
        [0, LAYOUT_VERSION, LAYOUT_VERSION, LAYOUT_VERSION],
        "one migrated, the others found it done"
    );
}

/// A start waits for another process's upgrade past the store timeout (up to the migration's
/// own bound): an upgrade may rebuild an index over every retained message, longer than any
/// other call may take, and a start that gave up would roll it back and repeat it forever.
#[tokio::test]
async fn a_start_waits_past_the_store_timeout_for_an_upgrade_under_way() {
    /// migrate.rs's LAYOUT_LOCK: "callbackd" in ASCII, cut to 63 bits.
    const LAYOUT_LOCK: i64 = 0x6361_6c6c_6261_636b;
    let server = PostgresServer::start();
    let upgrading = raw_client(&server).await;
    upgrading
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({LAYOUT_LOCK})"
        ))
        .await
        .unwrap();
    let timeout = Duration::from_millis(300);
    let finishing = tokio::spawn(async move {
        tokio::time::sleep(timeout * 4).await;
        upgrading.batch_execute("COMMIT").await.unwrap();
    });
    let mut store = PostgresStore::connect(&server.url(), timeout, RETENTION_SECS)
        .await
        .unwrap();
    let started = Instant::now();
    assert_eq!(store.migrate().await.unwrap(), 0, "an empty database");
    assert!(
        started.elapsed() >= timeout * 3,
        "it waited for the lock: {:?}",
        started.elapsed()
    );
    finishing.await.unwrap();
    assert_eq!(
        server.psql("SELECT string_agg(version::text, ',' ORDER BY version) FROM callbackd_layout"),
        every_layout()
    );
}

/// Every layout version up to this binary's, as `callbackd_layout` lists them after an upgrade.
fn every_layout() -> String {
    (1..=LAYOUT_VERSION)
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Layouts 5 and 4 undone: what `migrations/0005_lean_finished_rows.sql` and
/// `0004_compact_records.sql` changed, put back as layout 3 had it (on a database whose rows
/// all keep `message_json` and their whole history in `history`).
const UNDO_LAYOUTS_5_AND_4: &str = "ALTER TABLE messages DROP COLUMN first_entry; \
    DROP INDEX messages_by_key; \
    CREATE INDEX messages_by_key ON messages (ordering_key, id); \
    DELETE FROM callbackd_layout WHERE version = 5; \
    DROP INDEX messages_by_state, messages_live_by_source; \
    ALTER TABLE messages DROP COLUMN record; \
    ALTER TABLE messages ALTER COLUMN message_json SET NOT NULL; \
    CREATE INDEX messages_by_state ON messages (state, id); \
    CREATE INDEX messages_by_source ON messages (source, id) WHERE source IS NOT NULL; \
    DELETE FROM callbackd_layout WHERE version = 4;";

/// A database of layout 1 (the first release's: layouts 2 and 3 only added tables, so this one
/// is the newest layout with those and layout 4 undone) is brought to the newest layout in
/// place: its messages stay as they were, and completions are counted from then on.
#[tokio::test]
async fn a_layout_1_database_gains_the_delivery_counts_and_keeps_its_rows() {
    let server = PostgresServer::start();
    drop(migrated(&server).await);
    server.psql(&format!(
        "{UNDO_LAYOUTS_5_AND_4} DROP TABLE delivery_counts, inbound_counts, recoveries; \
         DELETE FROM callbackd_layout WHERE version >= 2"
    ));
    let client = raw_client(&server).await;
    let kept = message("src/payzu/tx-1", Some("payzu"), T0);
    insert_message(&client, &kept, MessageState::Pending, None, &[]).await;
    let mut store = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap()
        .with_caller_clock_leases();
    assert_eq!(store.migrate().await.unwrap(), 1, "found layout 1");
    assert_eq!(
        store.get(&kept.id).await.unwrap().map(|r| r.state),
        Some(MessageState::Pending)
    );
    let lease = store.claim_due(T0, 10, 30_000).await.unwrap();
    assert_eq!(lease.len(), 1);
    let attempt = match attempt(1, T0 + 1, 200) {
        HistoryEntry::Delivery(a) => a,
        _ => unreachable!(),
    };
    assert!(
        store
            .complete(&lease[0], attempt, Completion::Delivered, T0 + 1)
            .await
            .unwrap()
    );
    let counted = store.minute_counts(T0, T0 + 1).await.unwrap();
    assert_eq!(
        counted
            .iter()
            .map(|m| (m.minute, m.deliveries))
            .collect::<Vec<_>>(),
        [(T0, 1)]
    );
}

/// A database of layout 2 (the per-minute counts' release: layout 3 only added
/// `inbound_counts` and `recoveries`) is brought to the newest layout in place: what it held
/// stays, inbound accepts are counted from then on and recoveries are kept.
#[tokio::test]
async fn a_layout_2_database_gains_the_recovery_tables_and_keeps_its_rows() {
    let server = PostgresServer::start();
    drop(migrated(&server).await);
    server.psql(&format!(
        "{UNDO_LAYOUTS_5_AND_4} DROP TABLE inbound_counts, recoveries; \
         DELETE FROM callbackd_layout WHERE version = 3; \
         INSERT INTO delivery_counts (minute, slot, deliveries) VALUES (0, 0, 7)"
    ));
    let client = raw_client(&server).await;
    let kept = message("src/payzu/tx-1", Some("payzu"), T0);
    insert_message(&client, &kept, MessageState::Pending, None, &[]).await;
    let mut store = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap()
        .with_caller_clock_leases();
    assert_eq!(store.migrate().await.unwrap(), 2, "found layout 2");
    assert_eq!(
        server.psql("SELECT string_agg(version::text, ',' ORDER BY version) FROM callbackd_layout"),
        every_layout()
    );
    assert_eq!(
        server.psql("SELECT sum(deliveries) FROM delivery_counts"),
        "7"
    );
    assert_eq!(
        store.get(&kept.id).await.unwrap().map(|r| r.state),
        Some(MessageState::Pending)
    );
    assert_eq!(
        store.inbound_counts("payzu", T0, T0, T0).await.unwrap(),
        callbackd::store::InboundCount::default()
    );
    let recovery = callbackd::store::Recovery {
        id: callbackd::store::Recovery::new_id(T0),
        source: "payzu".into(),
        started_at: T0,
        from: T0 - 1000,
        to: T0,
        count_until: T0 + 60_000,
        windows: vec![],
        baseline: Default::default(),
        settled: None,
    };
    store.save_recovery(&recovery, T0).await.unwrap();
    assert_eq!(store.recoveries(T0).await.unwrap(), [recovery]);
}

/// A database of layout 3 that a process of layout 3 still uses is not brought to layouts 4
/// and 5, whose rows that process could not read: the start names the connection and changes
/// nothing. Once that process is gone, the upgrade runs.
#[tokio::test]
async fn a_database_in_use_by_a_layout_3_callbackd_is_not_upgraded_under_it() {
    not_upgraded_under_an_older_process(3, include_str!("fixtures/postgres_v3.sql"), "callbackd")
        .await;
}

/// The same for layout 4, whose processes name their layout in their connections: they would
/// read a history without its first row.
#[tokio::test]
async fn a_database_in_use_by_a_layout_4_callbackd_is_not_upgraded_under_it() {
    not_upgraded_under_an_older_process(4, include_str!("fixtures/postgres_v4.sql"), "callbackd/4")
        .await;
}

/// A database of layout `found` restored from `fixture`, with a connection open named
/// `application_name` as a process of that layout names its own: the upgrade is refused, the
/// refusal names it, and nothing changes; once it is gone, the upgrade runs.
async fn not_upgraded_under_an_older_process(found: i32, fixture: &str, application_name: &str) {
    assert_eq!(
        LAYOUT_VERSION, 5,
        "the layouts whose processes are looked for"
    );
    let server = PostgresServer::start();
    server.create_database("older");
    server.psql_db("older", fixture);
    let url = server.url_db("older");
    let (older, connection) = tokio_postgres::connect(
        &format!("{url}?application_name={application_name}"),
        tokio_postgres::NoTls,
    )
    .await
    .expect("a connection as an older process makes it");
    let older_task = tokio::spawn(connection);
    older.simple_query("SELECT 1").await.unwrap();
    let mut store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    let Err(StoreError::Incompatible(why)) = store.migrate().await else {
        panic!("upgraded under a layout-{found} process");
    };
    assert!(
        why.contains(&format!("layout version {found}"))
            && why.contains("1 connection(s) of an older callbackd")
            && why.contains(&format!("as {application_name} from"))
            && why.contains("stop every older callbackd"),
        "{why}"
    );
    let layout = "SELECT string_agg(version::text, ',' ORDER BY version) FROM callbackd_layout";
    let before: String = (1..=found)
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(server.psql_db("older", layout), before, "nothing changed");

    drop(older);
    older_task.await.unwrap().unwrap();
    let gone = Instant::now();
    while server.psql_db(
        "older",
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{application_name}'"
        ),
    ) != "0"
    {
        assert!(
            gone.elapsed() < Duration::from_secs(10),
            "the older process stays"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(store.migrate().await.unwrap(), found);
    assert_eq!(server.psql_db("older", layout), every_layout());
}

#[tokio::test]
async fn a_newer_layout_refuses_this_binary_naming_both_versions() {
    let server = PostgresServer::start();
    migrated(&server).await;
    let newer = LAYOUT_VERSION + 1;
    server.psql(&format!(
        "INSERT INTO callbackd_layout (version) VALUES ({newer})"
    ));
    let Err(StoreError::Incompatible(why)) =
        PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS).await
    else {
        panic!("a newer layout must be refused");
    };
    assert!(
        why.contains(&format!("layout version {newer}"))
            && why.contains(&format!("this callbackd's {LAYOUT_VERSION}")),
        "{why}"
    );
}

#[tokio::test]
async fn the_partition_count_is_recorded_and_a_contradicting_one_refused() {
    let server = PostgresServer::start();
    let options = |count| PostgresOptions {
        partitions: Partitions::new(count),
        ..PostgresOptions::default()
    };
    let mut store =
        PostgresStore::connect_with(&server.url(), TIMEOUT, RETENTION_SECS, &options(8))
            .await
            .unwrap();
    store.migrate().await.unwrap();
    assert_eq!(server.psql("SELECT count FROM callbackd_partitions"), "8");
    let kept = PostgresStore::connect(&server.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    assert_eq!(kept.partitions().count(), 8, "unset keeps the store's own");
    let refused =
        PostgresStore::connect_with(&server.url(), TIMEOUT, RETENTION_SECS, &options(16)).await;
    assert!(
        matches!(refused, Err(StoreError::Incompatible(_))),
        "{refused:?}"
    );
}

#[tokio::test]
async fn fsync_off_or_an_asynchronous_role_is_refused_when_durability_is_required() {
    let lax = PostgresServer::start_with(&[("fsync", "off")]);
    let store = PostgresStore::connect(&lax.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    let Verdict::Refuse(why) = store.durability(true).await.unwrap() else {
        panic!("fsync = off must be refused");
    };
    assert!(why.contains("fsync is off"), "{why}");
    let Verdict::Start { warnings } = store.durability(false).await.unwrap() else {
        panic!("only a warning without require_durable");
    };
    assert!(
        warnings.iter().any(|w| w.contains("fsync is off")),
        "{warnings:?}"
    );

    let server = PostgresServer::start();
    server.psql("CREATE ROLE cb LOGIN SUPERUSER");
    server.psql("ALTER ROLE cb SET synchronous_commit = off");
    let url = server
        .url()
        .replace("postgres://postgres@", "postgres://cb@");
    let store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    let Verdict::Refuse(why) = store.durability(true).await.unwrap() else {
        panic!("the role's synchronous_commit = off must be refused");
    };
    assert!(
        why.contains("synchronous_commit is off (set for this role"),
        "{why}"
    );
}

#[tokio::test]
async fn no_synchronous_standby_is_a_warning_and_a_synchronous_one_silences_it() {
    let mut primary = PostgresServer::start();
    let store = PostgresStore::connect(&primary.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    let Verdict::Start { warnings } = store.durability(true).await.unwrap() else {
        panic!("a durable server alone starts");
    };
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("no synchronous standby"),
        "{warnings:?}"
    );

    let _standby = PostgresServer::standby_of(&primary);
    assert_eq!(
        store.durability(true).await.unwrap(),
        Verdict::Start { warnings: vec![] }
    );
    primary.kill9();
}

#[tokio::test]
async fn a_multi_host_url_finds_the_primary_and_follows_a_failover() {
    let mut primary = PostgresServer::start();
    let standby = PostgresServer::standby_of(&primary);
    let both = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port, primary.port
    );
    let mut store = PostgresStore::connect(&both, TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    store
        .migrate()
        .await
        .expect("the standby first in the URL is skipped");
    store.ping().await.unwrap();

    // A URL naming only the standby reaches it, and ping says it takes no writes.
    let standby_only = PostgresStore::connect(&standby.url(), TIMEOUT, RETENTION_SECS)
        .await
        .unwrap();
    let refused = standby_only.ping().await;
    assert!(
        matches!(&refused, Err(StoreError::Unavailable(why)) if why.contains("standby")),
        "{refused:?}"
    );

    primary.kill9();
    standby.promote();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.ping().await {
            Ok(()) => break,
            Err(StoreError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the promoted standby was not found: {e}"),
        }
    }
    assert_eq!(store.depth().await.unwrap(), QueueDepth::default());
}

#[tokio::test]
async fn a_lost_server_is_a_quick_unavailable_and_its_return_is_found() {
    let mut server = PostgresServer::start();
    let store = migrated(&server).await;
    store.ping().await.unwrap();
    server.kill9();
    let started = Instant::now();
    let lost = store.depth().await;
    assert!(matches!(lost, Err(StoreError::Unavailable(_))), "{lost:?}");
    assert!(
        started.elapsed() < TIMEOUT + Duration::from_secs(1),
        "within the store timeout: {:?}",
        started.elapsed()
    );
    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(20);
    while store.depth().await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the restarted server was not found"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_call_held_up_by_a_lock_fails_within_the_timeout_and_the_next_one_works() {
    let server = PostgresServer::start();
    let store = migrated(&server).await;
    let mut holder = raw_client(&server).await;
    let tx = holder.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE messages IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let started = Instant::now();
    let held = store.depth().await;
    assert!(matches!(held, Err(StoreError::Unavailable(_))), "{held:?}");
    assert!(
        started.elapsed() < TIMEOUT + Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    tx.rollback().await.unwrap();
    assert_eq!(store.depth().await.unwrap(), QueueDepth::default());
}

#[tokio::test]
async fn an_unreachable_server_is_unreachable_and_its_password_never_shown() {
    let url = format!("postgres://cb:s3cret@127.0.0.1:{}/cb", free_port());
    let err = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
        .await
        .expect_err("nothing listens there");
    assert!(matches!(err, StoreError::Unreachable(_)), "{err:?}");
    let text = err.to_string();
    assert!(!text.contains("s3cret"), "{text}");
    assert!(text.contains("cb:***@127.0.0.1"), "{text}");
}

#[tokio::test]
async fn reads_see_live_and_finished_messages_until_the_sweep_horizon_passes_them() {
    let server = PostgresServer::start();
    let store = migrated(&server).await;
    let raw = raw_client(&server).await;

    let pending = message("src/payzu/tx-1", Some("payzu"), T0);
    let delivered = message("src/payzu/tx-2", Some("payzu"), T0 + 1);
    let dead = message("pay/p-1", None, T0 + 2);
    let ends = T0 + 30 * DAY_MS;
    let history = [attempt(1, T0 + 10, 500), attempt(2, T0 + 20, 200)];
    insert_message(&raw, &pending, MessageState::Pending, None, &history[..1]).await;
    insert_message(
        &raw,
        &delivered,
        MessageState::Delivered,
        Some(ends),
        &history,
    )
    .await;
    insert_message(&raw, &dead, MessageState::Dead, Some(ends + DAY_MS), &[]).await;

    let got = store.get(&delivered.id).await.unwrap().expect("found");
    assert_eq!(got.message, delivered);
    assert_eq!(got.state, MessageState::Delivered);
    assert_eq!(
        got.history, history,
        "in order, from the message's partition"
    );
    assert_eq!((got.history_total, got.delivery_attempts), (2, 2));
    assert_eq!(got.ends_at, Some(ends));
    let got = store.get(&pending.id).await.unwrap().expect("found");
    assert_eq!(got.next_attempt_at, Some(T0));
    assert_eq!(got.history, history[..1]);

    assert_eq!(
        store.depth().await.unwrap(),
        QueueDepth {
            pending: 1,
            in_flight: 0,
            dead: 1
        }
    );
    assert_eq!(
        store.oldest_unfinished().await.unwrap(),
        Some(pending.id.clone())
    );

    // Pages in id order across partitions, with a cursor; filters by state, source, key.
    let list = |filter: ListFilter| {
        let store = &store;
        async move { store.list(&filter).await.unwrap() }
    };
    let first = list(ListFilter {
        limit: 2,
        ..ListFilter::default()
    })
    .await;
    let ids: Vec<_> = first
        .messages
        .iter()
        .map(|m| m.message.id.clone())
        .collect();
    assert_eq!(ids, [pending.id.clone(), delivered.id.clone()]);
    assert!(first.messages.iter().all(|m| m.history.is_empty()));
    assert_eq!(first.next_after, Some(delivered.id.clone()));
    let rest = list(ListFilter {
        limit: 2,
        after: first.next_after,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(rest.messages.len(), 1);
    assert_eq!(rest.messages[0].message.id, dead.id);
    assert_eq!(rest.next_after, None);
    let by_state = list(ListFilter {
        state: Some(MessageState::Dead),
        limit: 10,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(by_state.messages.len(), 1);
    let by_source = list(ListFilter {
        source: Some("payzu".into()),
        limit: 10,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(by_source.messages.len(), 2);
    let by_key = list(ListFilter {
        ordering_keys: Some(vec!["pay/p-1".into(), "src/payzu/tx-1".into()]),
        limit: 10,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(by_key.messages.len(), 2);
    let window = list(ListFilter {
        created_from: Some(T0 + 1),
        created_to: Some(T0 + 1),
        limit: 10,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(window.messages.len(), 1);
    assert_eq!(window.messages[0].message.id, delivered.id);

    // The horizon at the delivered message's end: it is gone to every read, the dead one
    // (ending a day later) and the pending one are not.
    raw.execute("UPDATE sweep_horizon SET swept_to = $1", &[&ends])
        .await
        .unwrap();
    assert_eq!(store.get(&delivered.id).await.unwrap(), None);
    assert!(store.get(&dead.id).await.unwrap().is_some());
    assert!(store.get(&pending.id).await.unwrap().is_some());
    let everything = list(ListFilter {
        limit: 10,
        ..ListFilter::default()
    })
    .await;
    assert_eq!(everything.messages.len(), 2);
    raw.execute(
        "UPDATE sweep_horizon SET swept_to = $1",
        &[&(ends + DAY_MS)],
    )
    .await
    .unwrap();
    assert_eq!(
        store.depth().await.unwrap(),
        QueueDepth {
            pending: 1,
            in_flight: 0,
            dead: 0
        }
    );
}

#[tokio::test]
async fn payment_states_are_read_until_their_end() {
    let server = PostgresServer::start();
    let store = migrated(&server).await;
    server.psql(&format!(
        "INSERT INTO payments (payment_id, status, expires_at) VALUES ('p-1', 'approved', {})",
        T0 + 400 * DAY_MS
    ));
    assert_eq!(
        store.payment_status("p-1", T0).await.unwrap().as_deref(),
        Some("approved")
    );
    assert_eq!(
        store
            .payment_status("p-1", T0 + 400 * DAY_MS)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn an_operation_is_reserved_once_and_answers_its_record() {
    let server = PostgresServer::start();
    let store = migrated(&server).await;
    assert_eq!(
        store.reserve_operation("op-1", "fp1", 60).await.unwrap(),
        OperationReservation::Fresh
    );
    assert_eq!(
        store.reserve_operation("op-1", "fp1", 60).await.unwrap(),
        OperationReservation::InProgress
    );
    assert_eq!(
        store.reserve_operation("op-1", "fp2", 60).await.unwrap(),
        OperationReservation::Mismatch
    );
    store
        .finish_operation("op-1", "fp1", r#"{"resent":1}"#, 60)
        .await
        .unwrap();
    assert_eq!(
        store.reserve_operation("op-1", "fp1", 60).await.unwrap(),
        OperationReservation::Done(r#"{"resent":1}"#.into())
    );
    // A reservation past its end (by the database's clock) is taken afresh.
    assert_eq!(
        store.reserve_operation("op-2", "fp1", 0).await.unwrap(),
        OperationReservation::Fresh
    );
    assert_eq!(
        store.reserve_operation("op-2", "fp1", 60).await.unwrap(),
        OperationReservation::Fresh
    );
    // Finishing a lapsed reservation creates its record.
    store
        .finish_operation("op-3", "fp1", "{}", 60)
        .await
        .unwrap();
    assert_eq!(
        store.reserve_operation("op-3", "fp1", 60).await.unwrap(),
        OperationReservation::Done("{}".into())
    );
}

/// Accepts a message for `ordering_key` at `now`, claims it and finishes it as `completion`.
async fn finished(store: &PostgresStore, ordering_key: &str, now: Millis) -> MessageId {
    let message = message(ordering_key, None, now);
    let id = message.id.clone();
    let request = AcceptRequest {
        dedupe: DedupeClaim {
            key: format!("{ordering_key}/claim"),
            ttl_secs: 60,
            fingerprint: Some("fp".into()),
            response: format!(r#"{{"messageId":"{id}"}}"#),
        },
        message,
        payment: None,
        seal: None,
    };
    assert_eq!(
        store.accept(request, now).await.unwrap(),
        AcceptOutcome::Accepted
    );
    let leases = store.claim_due(now, 10, 30_000).await.unwrap();
    let lease = leases.iter().find(|l| l.message.id == id).expect("claimed");
    let HistoryEntry::Delivery(attempt) = attempt(1, now, 200) else {
        unreachable!("a delivery")
    };
    assert!(
        store
            .complete(lease, attempt, Completion::Delivered, now)
            .await
            .unwrap()
    );
    id
}

fn day_partitions(server: &PostgresServer, db: &str) -> String {
    server.psql_db(
        db,
        "SELECT coalesce(string_agg(tablename, ',' ORDER BY tablename), '') FROM pg_tables \
         WHERE tablename ~ '^(messages|history)_d[0-9]+$'",
    )
}

#[tokio::test]
async fn a_finished_day_is_dropped_whole_once_the_horizon_passes_its_end() {
    let server = PostgresServer::shared();
    let url = server.fresh_database();
    let db = url.rsplit('/').next().unwrap().to_string();
    let mut store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
        .await
        .unwrap()
        .with_caller_clock_leases();
    store.migrate().await.unwrap();
    let id = finished(&store, "pay/day", T0).await;
    let ends = T0 + RETENTION_SECS as Millis * 1000;
    let day = ends / DAY_MS + 1;
    assert_eq!(
        day_partitions(server, &db),
        format!("history_d{day},messages_d{day}")
    );
    assert_eq!(
        server.psql_db(
            &db,
            &format!(
                "SELECT count(*) FILTER (WHERE first_entry IS NOT NULL), \
                 (SELECT count(*) FROM history_d{day}) FROM messages_d{day}"
            )
        ),
        "1|0",
        "its one history row moved inside its message's row"
    );

    // At its end it is gone to every read; its day, which ends later, stays until then.
    store.sweep(ends - 1).await.unwrap();
    assert!(store.get(&id).await.unwrap().is_some());
    store.sweep(ends).await.unwrap();
    assert_eq!(store.get(&id).await.unwrap(), None);
    assert_eq!(
        store
            .resend(
                &id,
                ResendMark {
                    at: ends,
                    request_id: None
                },
                ends + DAY_MS,
                ends
            )
            .await
            .unwrap(),
        ResendEffect::Skipped,
        "gone to a resend too"
    );
    assert_ne!(day_partitions(server, &db), "");
    let day_end = day * DAY_MS - 1;
    assert!(
        store.sweep(day_end).await.unwrap() >= 1,
        "the day counts as swept"
    );
    assert_eq!(day_partitions(server, &db), "", "dropped whole, no DELETE");
}

#[tokio::test]
async fn a_resent_message_leaves_its_day_before_the_day_is_dropped() {
    let server = PostgresServer::shared();
    let url = server.fresh_database();
    let db = url.rsplit('/').next().unwrap().to_string();
    let mut store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
        .await
        .unwrap()
        .with_caller_clock_leases();
    store.migrate().await.unwrap();
    let id = finished(&store, "pay/resent", T0).await;
    let old_day = (T0 + RETENTION_SECS as Millis * 1000) / DAY_MS + 1;

    let later = T0 + 5 * DAY_MS;
    let mark = ResendMark {
        at: later,
        request_id: Some("op-1".into()),
    };
    assert_eq!(
        store
            .resend(&id, mark, later + 7 * DAY_MS, later)
            .await
            .unwrap(),
        ResendEffect::Requeued
    );
    assert_eq!(
        server.psql_db(&db, &format!("SELECT count(*) FROM messages_d{old_day}")),
        "0",
        "back in the live partition"
    );
    // Long past the day it had ended in: the day is dropped, the resent message is not.
    let past = old_day * DAY_MS + DAY_MS;
    store.sweep(past).await.unwrap();
    assert!(!day_partitions(server, &db).contains(&format!("messages_d{old_day}")));
    let record = store
        .get(&id)
        .await
        .unwrap()
        .expect("the resent message stays");
    assert_eq!(record.state, MessageState::Pending);
    assert_eq!(record.history.len(), 2, "its attempt and the resend's mark");
    assert_eq!(record.ends_at, None);
    let leases = store.claim_due(past, 10, 30_000).await.unwrap();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].message.id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_database_deliver_each_message_once_in_order_per_key() {
    let server = PostgresServer::shared();
    let url = server.fresh_database();
    let connect = || async {
        let mut store = PostgresStore::connect(&url, TIMEOUT, RETENTION_SECS)
            .await
            .unwrap();
        store.migrate().await.unwrap();
        std::sync::Arc::new(store)
    };
    let stores = [connect().await, connect().await];
    const KEYS: usize = 12;
    const PER_KEY: usize = 10;
    let mut accepted: BTreeMap<String, Vec<MessageId>> = BTreeMap::new();
    for n in 0..KEYS * PER_KEY {
        let key = format!("pay/p{}", n % KEYS);
        let now = T0 + n as Millis;
        let message = message(&key, None, now);
        accepted
            .entry(key.clone())
            .or_default()
            .push(message.id.clone());
        let request = AcceptRequest {
            dedupe: DedupeClaim {
                key: format!("{key}/{n}"),
                ttl_secs: 60,
                fingerprint: Some("fp".into()),
                response: "{}".into(),
            },
            message,
            payment: None,
            seal: None,
        };
        let store = &stores[n % 2];
        assert_eq!(
            store.accept(request, now).await.unwrap(),
            AcceptOutcome::Accepted
        );
    }

    let delivered = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, MessageId)>::new()));
    let workers = (0..4).map(|w| {
        let store = std::sync::Arc::clone(&stores[w % 2]);
        let delivered = std::sync::Arc::clone(&delivered);
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            let now = T0 + 10_000;
            while delivered.lock().unwrap().len() < KEYS * PER_KEY {
                assert!(Instant::now() < deadline, "not all delivered in time");
                let leases = store.claim_due(now, 3, 30_000).await.expect("claims");
                for lease in leases {
                    delivered
                        .lock()
                        .unwrap()
                        .push((lease.message.ordering_key.clone(), lease.message.id.clone()));
                    let HistoryEntry::Delivery(attempt) = attempt(1, now, 200) else {
                        unreachable!("a delivery")
                    };
                    let done = store
                        .complete(&lease, attempt, Completion::Delivered, now)
                        .await
                        .expect("completes");
                    assert!(done, "the lease holds");
                }
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker.expect("a worker");
    }
    let delivered = delivered.lock().unwrap().clone();
    assert_eq!(delivered.len(), KEYS * PER_KEY, "each message once");
    let mut per_key: BTreeMap<String, Vec<MessageId>> = BTreeMap::new();
    for (key, id) in delivered {
        per_key.entry(key).or_default().push(id);
    }
    assert_eq!(per_key, accepted, "in acceptance order per key");
    assert_eq!(stores[0].depth().await.unwrap(), QueueDepth::default());
}
