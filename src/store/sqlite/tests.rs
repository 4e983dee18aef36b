//! The group-commit engine and the schema version, driven through a real store on a temp file.

use super::*;
use rusqlite::params;
use tokio::sync::oneshot;

const T0: Millis = 1_764_460_800_000;

fn open() -> (tempfile::TempDir, SqliteStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(&dir.path().join("cb.db"), 3600).expect("open");
    (dir, store)
}

fn count(store: &SqliteStore, sql: &str) -> i64 {
    let conn = store.reader.lock().unwrap();
    conn.query_row(sql, [], |r| r.get(0)).unwrap()
}

/// Occupies the writer until the returned sender fires, so the commands sent meanwhile
/// queue up and go into one batch.
async fn hold_writer(
    store: &Arc<SqliteStore>,
) -> (
    std::sync::mpsc::Sender<()>,
    tokio::task::JoinHandle<Result<(), StoreError>>,
) {
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let (started, running) = oneshot::channel::<()>();
    let holder = {
        let store = Arc::clone(store);
        tokio::spawn(async move {
            store
                .writer
                .commit(None, move |_| {
                    let _ = started.send(());
                    let _ = wait.recv();
                    Ok(())
                })
                .await
        })
    };
    running.await.expect("the writer picked up the holder");
    (release, holder)
}

async fn until_queued(store: &SqliteStore, n: usize) {
    while store.queued() < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn insert_claim(key: &str) -> impl FnOnce(&Connection) -> Result<(), StoreError> + Send + use<> {
    let key = key.to_string();
    move |conn| {
        conn.execute(
            "INSERT INTO dedupe_claims (key, fingerprint, response, expires_at) \
             VALUES (?1, '', '', ?2)",
            params![key, i64::MAX],
        )
        .db()
        .map(|_| ())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_commands_share_one_commit() {
    let (_dir, store) = open();
    let store = Arc::new(store);
    let (release, holder) = hold_writer(&store).await;
    let before = store.commits();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..50 {
        let store = Arc::clone(&store);
        tasks.spawn(async move {
            store
                .writer
                .commit(Some(T0), insert_claim(&format!("k{i}")))
                .await
        });
    }
    until_queued(&store, 50).await;
    release.send(()).unwrap();
    holder.await.unwrap().unwrap();
    while let Some(done) = tasks.join_next().await {
        done.unwrap().unwrap();
    }
    // One commit for the holder's batch, one for the fifty.
    assert_eq!(store.commits() - before, 2);
    assert_eq!(count(&store, "SELECT count(*) FROM dedupe_claims"), 50);
}

type Command = Box<dyn FnOnce(&Connection) -> Result<(), StoreError> + Send>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_command_rolls_back_only_itself() {
    let (_dir, store) = open();
    let store = Arc::new(store);
    let (release, holder) = hold_writer(&store).await;
    let spawn = |op: Command| {
        let store = Arc::clone(&store);
        tokio::spawn(async move { store.writer.commit(None, op).await })
    };
    let a = spawn(Box::new(insert_claim("a")));
    until_queued(&store, 1).await;
    let b = spawn(Box::new(|conn: &Connection| {
        insert_claim("b")(conn)?;
        Err(StoreError::Corrupt("b changed its mind".into()))
    }));
    until_queued(&store, 2).await;
    let c = spawn(Box::new(|conn: &Connection| {
        insert_claim("c")(conn)?;
        // Printed by the panic hook on the writer thread; caught there.
        panic!("a bug in c (expected in the test output)")
    }));
    until_queued(&store, 3).await;
    let d = spawn(Box::new(insert_claim("d")));
    until_queued(&store, 4).await;
    let before = store.commits();
    release.send(()).unwrap();
    holder.await.unwrap().unwrap();

    a.await.unwrap().unwrap();
    assert!(matches!(b.await.unwrap(), Err(StoreError::Corrupt(_))));
    assert!(matches!(c.await.unwrap(), Err(StoreError::Unavailable(_))));
    d.await.unwrap().unwrap();
    // The holder's batch, then one batch for the four.
    assert_eq!(store.commits() - before, 2);
    assert_eq!(claim_keys(&store), ["a", "d"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_writer_answers_unavailable_within_the_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        timeout: Duration::from_millis(50),
        ..SqliteOptions::default()
    };
    let store = Arc::new(SqliteStore::open_with(&dir.path().join("cb.db"), 60, options).unwrap());
    let (release, holder) = hold_writer(&store).await;
    let err = store.ping().await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Unavailable(m) if m.contains("within")),
        "{err:?}"
    );
    // Reads do not wait for the writer.
    assert_eq!(store.depth().await.unwrap(), QueueDepth::default());
    release.send(()).unwrap();
    // The holder's own call may have timed out as well (its command ran either way).
    let _ = holder.await.unwrap();
    ping_until_the_writer_answers(&store).await;
}

/// Waits for a writer that was held to be back. The tests' short timeouts are what they
/// check; on a loaded machine one ping may miss one, so the writer gets a few.
async fn ping_until_the_writer_answers(store: &SqliteStore) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while let Err(e) = store.ping().await {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never came back: {e}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn claim_keys(store: &SqliteStore) -> Vec<String> {
    let conn = store.reader.lock().unwrap();
    conn.prepare("SELECT key FROM dedupe_claims ORDER BY key")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// A caller that gives up on a write the writer had not started withdraws it: it never
/// runs. One the writer had started (here: run, its commit held) commits after its caller
/// gave up, so a retry finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_write_runs_only_if_it_had_started() {
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteOptions {
        timeout: Duration::from_millis(200),
        ..SqliteOptions::default()
    };
    let store = Arc::new(SqliteStore::open_with(&dir.path().join("cb.db"), 60, options).unwrap());
    let stall = store.stall_commits();
    let (ran, has_run) = oneshot::channel();
    let started = tokio::spawn({
        let store = Arc::clone(&store);
        async move {
            store
                .writer
                .commit(None, move |conn| {
                    let _ = ran.send(());
                    insert_claim("started")(conn)
                })
                .await
        }
    });
    has_run.await.unwrap();
    started.abort();
    let _ = started.await;
    // Queued behind the held commit, it cannot start before its caller's timeout.
    let not_started = store.writer.commit(None, insert_claim("not-started")).await;
    assert!(
        matches!(&not_started, Err(StoreError::Unavailable(m)) if m.contains("withdrawn")),
        "{not_started:?}"
    );
    drop(stall);
    ping_until_the_writer_answers(&store).await;
    assert_eq!(claim_keys(&store), ["started"]);
}

/// A caller whose future is dropped (a client that hung up) withdraws its queued write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_caller_withdraws_its_queued_write() {
    let (_dir, store) = open();
    let store = Arc::new(store);
    let stall = store.stall_commits();
    let first = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.writer.commit(None, insert_claim("first")).await }
    });
    stall.holding().await;
    let dropped = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.writer.commit(None, insert_claim("dropped")).await }
    });
    until_queued(&store, 1).await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    drop(stall);
    first.await.unwrap().unwrap();
    store.ping().await.unwrap();
    assert_eq!(claim_keys(&store), ["first"]);
}

#[tokio::test]
async fn expired_rows_are_swept_in_bounded_batches() {
    let (_dir, store) = open();
    store
        .writer
        .commit(None, |conn| {
            let mut insert = conn
                .prepare(
                    "INSERT INTO dedupe_claims (key, fingerprint, response, expires_at) \
                     VALUES (?1, '', '', ?2)",
                )
                .db()?;
            for i in 0..2_500 {
                insert.execute(params![format!("old{i}"), T0 + i]).db()?;
            }
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(count(&store, "SELECT count(*) FROM dedupe_claims"), 2_500);
    let later = T0 + 10_000;
    for remaining in [1_500, 500, 0] {
        store.writer.commit(Some(later), |_| Ok(())).await.unwrap();
        assert_eq!(
            count(&store, "SELECT count(*) FROM dedupe_claims"),
            remaining
        );
    }
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cb.db");
    drop(SqliteStore::open(&path, 60).unwrap());
    {
        let conn = Connection::open(&path).unwrap();
        assert_eq!(
            conn.pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))
                .unwrap(),
            migrate::VERSION
        );
        conn.pragma_update(None, "user_version", 99).unwrap();
    }
    let err = SqliteStore::open(&path, 60).unwrap_err();
    assert!(err.to_string().contains("newer"), "{err}");
}

/// A layout 4 database (the per-minute counts' release: layout 5 only added `inbound_counts`
/// and `recoveries`, so this one is a new database with those undone) is upgraded in place to
/// [`migrate::VERSION`]: what it held stays, and inbound accepts are counted from then on.
#[tokio::test]
async fn a_layout_4_database_gains_the_recovery_tables_and_keeps_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cb.db");
    drop(SqliteStore::open(&path, 60).unwrap());
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "DROP TABLE inbound_counts; DROP TABLE recoveries; \
             INSERT INTO delivery_counts (minute, deliveries) VALUES (0, 7); \
             PRAGMA user_version = 4;",
        )
        .unwrap();
    }
    let store = SqliteStore::open(&path, 60).unwrap();
    let version: i64 = Connection::open(&path)
        .unwrap()
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .unwrap();
    assert_eq!((version, migrate::VERSION), (5, 5));
    assert_eq!(count(&store, "SELECT deliveries FROM delivery_counts"), 7);
    assert_eq!(count(&store, "SELECT count(*) FROM recoveries"), 0);
    let recovery = crate::store::Recovery {
        id: crate::store::Recovery::new_id(T0),
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
