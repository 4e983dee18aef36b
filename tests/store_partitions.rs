//! `store.partitions` on real stores (a private `redis-server`, a SQLite file), opened the way
//! `callbackd serve` opens them (`callbackd::open_store` from a loaded config): a new store
//! records its count, a store from before the count was recorded keeps 16, a configured count
//! must agree with the store's, and a mismatch refuses to start, in process too.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use callbackd::StartError;
use callbackd::clock::{Clock, Millis, SystemClock};
use callbackd::config::Config;
use callbackd::store::ids::partition_of;
use callbackd::store::redis::{RedisOptions, RedisStore};
use callbackd::store::{
    AcceptOutcome, MessageId, Partitions, ResendEffect, ResendMark, Store, StoreError,
};
use support::notification_request;
use support::process::serve_until_refused;
use support::redis::RedisServer;

fn count(n: u16) -> Partitions {
    Partitions::new(n).expect("a valid count")
}

/// Opens the store at `url` as `callbackd serve` would, with `partitions` as
/// `store.partitions` (unset when `None`).
async fn open(url: &str, partitions: Option<u16>) -> Result<Arc<dyn Store>, StartError> {
    let mut text = format!("[store]\nurl = \"{url}\"\n");
    if let Some(n) = partitions {
        text.push_str(&format!("partitions = {n}\n"));
    }
    let config = Config::from_toml_str(&text, Path::new("test.toml"), std::iter::empty())
        .expect("a valid config");
    let settings = callbackd::app::Settings::from_config(&config).expect("settings");
    callbackd::open_store(&settings.store).await
}

async fn opened(url: &str, partitions: Option<u16>) -> Arc<dyn Store> {
    open(url, partitions).await.expect("the store opens")
}

/// The refusal of a configured count the store contradicts names the key, both counts and why.
fn assert_refused(result: Result<Arc<dyn Store>, StartError>, configured: u16, held: u16) {
    let why = match result {
        Err(StartError::Store(StoreError::Incompatible(why))) => why,
        Err(other) => panic!(
            "store.partitions = {configured} on a store of {held} must be refused as \
             incompatible, not with: {other}"
        ),
        Ok(_) => panic!("store.partitions = {configured} on a store of {held} must be refused"),
    };
    for part in [
        format!("store.partitions = {configured}"),
        format!("{held} partitions"),
        "orphan".to_string(),
    ] {
        assert!(why.contains(&part), "`{part}` in: {why}");
    }
}

/// Accepts a message of `ordering_key` with an id of the store's count.
async fn accept(store: &dyn Store, ordering_key: &str, now: Millis) -> MessageId {
    let mut request = notification_request(&format!("k-{ordering_key}"), ordering_key, now);
    request.message.id = MessageId::generate(now, ordering_key, store.partitions());
    let id = request.message.id.clone();
    assert_eq!(
        store.accept(request, now).await.expect("accepts"),
        AcceptOutcome::Accepted
    );
    id
}

fn now() -> Millis {
    SystemClock.now_ms()
}

/// The count each engine records, read from the store itself.
trait Recorded {
    fn recorded(&self) -> Option<u16>;
    /// Removes the record: what every release before `store.partitions` left.
    fn forget(&self);
}

/// One database of a Redis server.
struct Db<'s>(&'s RedisServer, u8);

impl Recorded for Db<'_> {
    fn recorded(&self) -> Option<u16> {
        let db = self.1.to_string();
        self.0
            .cli(&["-n", &db, "GET", "cb:partitions"])
            .parse()
            .ok()
    }
    fn forget(&self) {
        self.0
            .cli(&["-n", &self.1.to_string(), "DEL", "cb:partitions"]);
    }
}

struct SqliteFile(tempfile::TempDir);

impl SqliteFile {
    fn new() -> SqliteFile {
        SqliteFile(tempfile::tempdir().expect("temp dir"))
    }
    fn url(&self) -> String {
        format!("sqlite://{}", self.0.path().join("cb.db").display())
    }
    fn connection(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.0.path().join("cb.db")).expect("open the file")
    }
}

impl Recorded for SqliteFile {
    fn recorded(&self) -> Option<u16> {
        self.connection()
            .query_row("SELECT count FROM partitions", [], |r| r.get(0))
            .ok()
    }
    fn forget(&self) {
        self.connection()
            .execute_batch("DROP TABLE partitions")
            .expect("drop the record");
    }
}

/// A new store with the setting unset takes the default and records it; the same count set
/// explicitly starts, another is refused, naming both. `url` names a store nothing has used
/// yet, and each store is closed (dropped) before the next open, as a restarted process would.
async fn a_new_store(url: &str, backend: &dyn Recorded) {
    let store = opened(url, None).await;
    assert_eq!(store.partitions(), Partitions::DEFAULT);
    assert_eq!(backend.recorded(), Some(Partitions::DEFAULT.count()));
    let id = accept(&*store, "pay/kept", now()).await;
    drop(store);
    let again = opened(url, Some(Partitions::DEFAULT.count())).await;
    assert!(again.get(&id).await.unwrap().is_some());
    drop(again);
    assert_refused(open(url, Some(128)).await, 128, Partitions::DEFAULT.count());
    assert_eq!(backend.recorded(), Some(Partitions::DEFAULT.count()));
}

/// A store from before the count was recorded has 16 partitions, with no config change: what
/// it queued is still found and claimed, and the count is recorded from then on. Set
/// explicitly, 16 starts and anything else is refused. `url` names a store nothing has used.
async fn a_store_from_before_the_record(url: &str, backend: &dyn Recorded) {
    // What an earlier release left: its 16-partition layout, without the record.
    let earlier = opened(url, Some(16)).await;
    let before = accept(&*earlier, "pay/before", now()).await;
    drop(earlier);
    backend.forget();

    assert_refused(open(url, Some(64)).await, 64, 16);
    assert_eq!(backend.recorded(), None, "a refused start records nothing");
    let legacy = opened(url, None).await;
    assert_eq!(legacy.partitions(), Partitions::LEGACY);
    assert_eq!(backend.recorded(), Some(16), "recorded from now on");
    let after = accept(&*legacy, "pay/after", now()).await;
    assert!(Partitions::LEGACY.contains(after.partition()));
    let claimed = legacy.claim_due(now(), 10, 30_000).await.unwrap();
    let mut ids: Vec<MessageId> = claimed.into_iter().map(|l| l.message.id).collect();
    ids.sort();
    let mut expected = vec![before, after];
    expected.sort();
    assert_eq!(ids, expected);
    drop(legacy);
    drop(opened(url, Some(16)).await);
    assert_refused(open(url, Some(64)).await, 64, 16);
}

#[tokio::test]
async fn redis_records_and_keeps_its_count() {
    let server = RedisServer::start();
    a_new_store(&server.url_db(1), &Db(&server, 1)).await;
    a_store_from_before_the_record(&server.url_db(2), &Db(&server, 2)).await;
}

#[tokio::test]
async fn sqlite_records_and_keeps_its_count() {
    let (new, old) = (SqliteFile::new(), SqliteFile::new());
    a_new_store(&new.url(), &new).await;
    a_store_from_before_the_record(&old.url(), &old).await;
}

/// A new store configured with a count records it, and keeps it with the setting removed.
#[tokio::test]
async fn a_configured_count_is_recorded_and_kept() {
    let server = RedisServer::start();
    let file = SqliteFile::new();
    let db = Db(&server, 0);
    for (url, backend) in [
        (server.url(), &db as &dyn Recorded),
        (file.url(), &file as &dyn Recorded),
    ] {
        drop(opened(&url, Some(128)).await);
        assert_eq!(backend.recorded(), Some(128));
        assert_eq!(opened(&url, None).await.partitions(), count(128));
        assert_refused(open(&url, Some(64)).await, 64, 128);
    }
}

/// Ids name any two-digit partition; one the store does not have is simply not found, and a
/// resend of it is skipped: no key outside the store's partitions is ever named.
#[tokio::test]
async fn an_id_outside_the_stores_partitions_is_not_found() {
    let server = RedisServer::start();
    let file = SqliteFile::new();
    for url in [server.url(), file.url()] {
        let store = opened(&url, None).await;
        let foreign = MessageId::parse("msg_000000000001ff00000000000000").expect("parses");
        assert!(!store.partitions().contains(foreign.partition()));
        assert_eq!(store.get(&foreign).await.unwrap(), None);
        let mark = ResendMark {
            at: now(),
            request_id: None,
        };
        assert_eq!(
            store.resend(&foreign, mark, now(), now()).await.unwrap(),
            ResendEffect::Skipped
        );
    }
    let keys = server.cli(&["--scan", "--pattern", "cb:{p255}:*"]);
    assert!(keys.is_empty(), "{keys}");
}

/// Two processes start on a new Redis at once with different counts: both read an empty
/// store, one records its count, and the other is refused rather than writing keys of
/// another count.
#[tokio::test]
async fn a_race_to_record_the_count_has_one_winner() {
    let server = RedisServer::start();
    let connect = |n: u16| {
        let url = server.url();
        async move {
            let options = RedisOptions {
                partitions: Some(count(n)),
                ..RedisOptions::default()
            };
            RedisStore::connect_with(&url, Duration::from_secs(2), 3600, &options)
                .await
                .expect("connects: nothing is recorded yet")
        }
    };
    let (a, b) = (connect(32).await, connect(128).await);
    let (ra, rb) = tokio::join!(a.upgrade(now()), b.upgrade(now()));
    let recorded = server.cli(&["GET", "cb:partitions"]);
    let (winner, loser) = if recorded == "32" { (ra, rb) } else { (rb, ra) };
    winner.expect("the first to record starts");
    let Err(StoreError::Incompatible(why)) = loser else {
        panic!("the other is refused");
    };
    assert!(why.contains("Start again"), "{why}");
}

/// With 128 partitions and a claim limit of 1, two busy partitions far apart take turns
/// (the one after a long idle run is not served every turn that starts in it).
#[tokio::test]
async fn claims_serve_busy_partitions_in_turn() {
    let server = RedisServer::start();
    let store = opened(&server.url(), Some(128)).await;
    let partitions = store.partitions();
    let in_partition = |wanted: u8, n: usize| -> Vec<String> {
        (0..)
            .map(|i| format!("pay/{wanted}-{i}"))
            .filter(|k| partition_of(k, partitions) == wanted)
            .take(n)
            .collect()
    };
    let (low, high) = (in_partition(3, 12), in_partition(90, 12));
    let t = now();
    for key in low.iter().chain(&high) {
        accept(&*store, key, t).await;
    }
    let mut served = Vec::new();
    for _ in 0..12 {
        let lease = store.claim_due(now(), 1, 60_000).await.unwrap();
        let [lease] = &lease[..] else {
            panic!("one message per claim: {lease:?}");
        };
        served.push(lease.message.id.partition());
    }
    let turns: Vec<u8> = served.windows(2).map(|w| u8::from(w[0] != w[1])).collect();
    assert!(
        turns.iter().all(|t| *t == 1),
        "the two partitions alternate: {served:?}"
    );
}

/// `callbackd serve` refuses to start on a store that records another count, saying why.
#[tokio::test]
async fn serve_refuses_a_mismatch_naming_the_key() {
    let server = RedisServer::start();
    let file = SqliteFile::new();
    for url in [server.url(), file.url()] {
        drop(opened(&url, Some(32)).await);
        let (status, stderr) =
            serve_until_refused(&format!("url = \"{url}\"\npartitions = 64")).await;
        assert!(!status.success());
        assert!(
            stderr.contains("store.partitions = 64") && stderr.contains("32 partitions"),
            "{url}: {stderr}"
        );
    }
}
