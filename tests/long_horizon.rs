//! Month two and beyond, on a virtual clock, over HTTP, on every store: a payment's life over
//! 90 days with provider callbacks, failing receivers, retries and sweeps. Every transition
//! must be decided correctly long after its dedupe claims are gone, and at the end the store
//! must hold nothing but the payment's state.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use callbackd::clock::Millis;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use callbackd::clock::{Clock, ManualClock};
use callbackd::dispatch::Dispatcher;
use postgres_support::PostgresServer;
use serde_json::json;
use support::redis::RedisServer;
use support::sink::{Reply, Sink};
use support::{TestServer, handoff, virtual_server};

const DAY_MS: Millis = 86_400_000;

/// What the store holds: Redis keys, SQLite rows of every table, or PostgreSQL rows of every
/// table and partition of database `db`.
enum Footprint {
    Redis(RedisServer),
    Sqlite(std::path::PathBuf),
    Postgres { server: PostgresServer, db: String },
}

impl Footprint {
    fn count(&self) -> u64 {
        match self {
            // Less the attempts-per-minute hashes and the inbound counts, which end by their
            // Redis TTL (assert_only_a_payment_state_is_left checks they have one).
            Footprint::Redis(redis) => {
                let all: u64 = redis.cli(&["DBSIZE"]).parse().expect("DBSIZE");
                let counts: usize = ["*:n:*", "*:in:*"]
                    .iter()
                    .map(|p| redis.cli(&["--scan", "--pattern", p]).lines().count())
                    .sum();
                all - counts as u64
            }
            Footprint::Sqlite(path) => self.rows(path).values().sum(),
            Footprint::Postgres { server, db } => pg_rows(server, db).values().sum(),
        }
    }

    fn rows(&self, path: &std::path::Path) -> std::collections::BTreeMap<String, u64> {
        let conn = rusqlite::Connection::open(path).expect("open for counting");
        let tables: Vec<String> = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        tables
            .into_iter()
            .map(|t| {
                let n: i64 = conn
                    .query_row(&format!("SELECT count(*) FROM {t}"), [], |r| r.get(0))
                    .unwrap();
                (t, n as u64)
            })
            .collect()
    }

    /// Nothing is left but the layout version, the partition count and one payment state: on
    /// Redis its key, the expiry buckets holding its member (one per transition, each ending
    /// when a transition would have) and the partition's bucket index; on SQLite its row.
    fn assert_only_a_payment_state_is_left(&self) {
        match self {
            Footprint::Redis(redis) => {
                // The attempts-per-minute hashes (at most three hours of the server's time)
                // and the inbound counts per source (at most two days and an hour) end by
                // their Redis TTL, not by the virtual clock's sweep: each must have one.
                let mut keys: Vec<String> = Vec::new();
                for key in redis.cli(&["--scan"]).lines() {
                    let bound = if key.contains(":n:") {
                        Some(3 * 3_600_000)
                    } else if key.contains(":in:") {
                        Some(49 * 3_600_000)
                    } else {
                        None
                    };
                    if let Some(bound) = bound {
                        let ttl: i64 = redis.cli(&["PTTL", key]).trim().parse().unwrap();
                        assert!(ttl > 0 && ttl <= bound, "{key}: PTTL {ttl}");
                    } else {
                        keys.push(key.to_string());
                    }
                }
                keys.sort();
                let [partitions, schema, payment, buckets @ .., index] = &keys[..] else {
                    panic!("keys left: {keys:?}");
                };
                assert_eq!(partitions, "cb:partitions");
                assert_eq!(schema, "cb:schema");
                assert!(payment.contains(":pay:"), "{keys:?}");
                assert!(index.ends_with(":xb"), "{keys:?}");
                assert!(!buckets.is_empty(), "{keys:?}");
                for bucket in buckets {
                    assert!(bucket.contains(":x:"), "{keys:?}");
                    let members = redis.cli(&["LRANGE", bucket, "0", "-1"]);
                    assert!(
                        members.lines().all(|m| payment.ends_with(m)),
                        "{bucket} holds only the payment: {members}"
                    );
                }
            }
            Footprint::Sqlite(path) => {
                let left: Vec<(String, u64)> = self
                    .rows(path)
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .collect();
                assert_eq!(
                    left,
                    [("partitions".to_string(), 1), ("payments".to_string(), 1)]
                );
            }
            // The layout's version, the partition count, the sweep horizon and the payment's
            // row. Finished messages go by the horizon at once, their day partitions whole
            // once it has passed the day's last millisecond: a day may still hold rows, but
            // only rows at or below the horizon, which no read sees.
            Footprint::Postgres { server, db } => {
                let left: Vec<(String, u64)> = pg_rows(server, db)
                    .into_iter()
                    .filter(|(table, n)| *n > 0 && !is_day_partition(table))
                    .collect();
                let mut expected = [
                    "callbackd_layout",
                    "callbackd_partitions",
                    "payments",
                    "sweep_horizon",
                ]
                .map(|t| (t.to_string(), 1));
                // One row per layout version applied.
                expected[0].1 = callbackd::store::postgres::LAYOUT_VERSION as u64;
                assert_eq!(left, expected);
                let above_horizon = server.psql_db(
                    db,
                    "SELECT (SELECT count(*) FROM messages \
                       WHERE ends_at > (SELECT swept_to FROM sweep_horizon)) \
                     + (SELECT count(*) FROM history h JOIN messages m \
                       ON m.id = h.message_id AND m.end_day = h.end_day \
                       WHERE m.ends_at > (SELECT swept_to FROM sweep_horizon))",
                );
                assert_eq!(above_horizon, "0", "no message is left above the horizon");
            }
        }
    }
}

/// A day partition of finished messages or their history (`messages_d<day>`,
/// `history_d<day>`; days.rs).
fn is_day_partition(table: &str) -> bool {
    ["messages_d", "history_d"].iter().any(|prefix| {
        table
            .strip_prefix(prefix)
            .is_some_and(|day| day.parse::<i32>().is_ok())
    })
}

/// The rows of every table of `db` that holds rows (each partition on its own, the
/// partitioned parents not at all).
fn pg_rows(server: &PostgresServer, db: &str) -> std::collections::BTreeMap<String, u64> {
    let tables = server.psql_db(
        db,
        "SELECT relname FROM pg_class WHERE relkind = 'r' \
         AND relnamespace = 'public'::regnamespace ORDER BY relname",
    );
    tables
        .lines()
        .map(|t| {
            let n = server.psql_db(db, &format!("SELECT count(*) FROM \"{t}\""));
            (t.to_string(), n.parse().expect("a count"))
        })
        .collect()
}

struct World {
    server: TestServer,
    clock: Arc<ManualClock>,
    dispatcher: Arc<Dispatcher>,
    gateway: Sink,
    merchant: Sink,
    /// While set, both receivers answer 503 (an outage the retries must ride out).
    outage: Arc<AtomicBool>,
    start: Millis,
}

impl World {
    async fn new(store_url: &str) -> World {
        let outage = Arc::new(AtomicBool::new(false));
        let answer = |outage: Arc<AtomicBool>| {
            move |_: &support::sink::Received, _| {
                Reply::status(if outage.load(Ordering::SeqCst) {
                    503
                } else {
                    204
                })
            }
        };
        let gateway = Sink::start(answer(outage.clone())).await;
        let merchant = Sink::start(answer(outage.clone())).await;
        let forward = format!("{}/payzu-events", merchant.url);
        let (server, clock, dispatcher) = virtual_server(store_url, |c| {
            if let Some(source) = c.sources.get_mut("payzu") {
                source.forward_url = Some(forward);
            }
        })
        .await;
        let start = clock.now_ms();
        World {
            server,
            clock,
            dispatcher,
            gateway,
            merchant,
            outage,
            start,
        }
    }

    /// Moves the clock to `day` (since the start) plus `ms`, delivering what falls due on
    /// the way, hour by hour, and sweeping as the sweeper would.
    async fn advance_to(&self, day: i64, ms: Millis) {
        let target = self.start + day * DAY_MS + ms;
        while self.clock.now_ms() < target {
            // Retries back off to at most an hour; a few hours a step is fine-grained enough
            // for the schedule and keeps 90 days to a few hundred steps.
            let step = (target - self.clock.now_ms()).min(6 * 3_600_000);
            self.clock.advance(step);
            self.dispatcher.tick().await;
            self.sweep().await;
        }
    }

    async fn sweep(&self) {
        let now = self.clock.now_ms();
        while self.server.app.store.sweep(now).await.expect("sweep") > 0 {}
    }

    async fn hand_off(&self, status: &str) -> u16 {
        let url = format!("{}/callback", self.gateway.url);
        self.server
            .notify(&handoff("pay-90", status, &url))
            .await
            .status()
            .as_u16()
    }

    async fn provider(&self, body: serde_json::Value, event: Option<&str>) -> (u16, bool) {
        let r = self
            .server
            .post_callback("payzu", &body.to_string(), event)
            .await;
        let replayed = r.headers().get("idempotent-replayed").is_some();
        (r.status().as_u16(), replayed)
    }
}

async fn ninety_days(store_url: &str, footprint: Footprint) {
    let w = World::new(store_url).await;
    let baseline = footprint.count();

    // Day 0: approved, while both receivers are down for a few hours.
    w.outage.store(true, Ordering::SeqCst);
    assert_eq!(w.hand_off("approved").await, 202);
    let paid = json!({"id": "tx-90", "status": "COMPLETED", "type": "DEPOSIT", "method": "PIX", "amount": 100.0});
    assert_eq!(w.provider(paid.clone(), None).await, (200, false));
    assert_eq!(w.provider(paid.clone(), None).await, (200, true), "retry");
    for hour in 1..=3 {
        w.advance_to(0, hour * 3_600_000).await;
    }
    let failed = w.gateway.count();
    assert!(failed >= 3, "retried through the outage: {failed}");
    let failed_forwards = w.merchant.count();
    assert!(
        failed_forwards >= 3,
        "forwards retried through the outage: {failed_forwards}"
    );
    w.outage.store(false, Ordering::SeqCst);
    w.advance_to(0, 5 * 3_600_000).await;
    assert_eq!(w.gateway.count(), failed + 1, "delivered once it came back");
    assert_eq!(
        w.merchant.count(),
        failed_forwards + 1,
        "forwarded once it came back"
    );

    // Day 1: settled.
    w.advance_to(1, 0).await;
    assert_eq!(w.hand_off("settled").await, 202);
    assert_eq!(w.hand_off("settled").await, 202, "an idempotent repeat");

    // Day 45: every dedupe claim of days 0 and 1 is gone (30 days); the payment is not.
    w.advance_to(45, 0).await;
    assert_eq!(
        w.hand_off("approved").await,
        409,
        "settled is never approved again"
    );
    let partial = json!({"id": "tx-90", "status": "COMPLETED", "refundStatus": "PARTIAL", "refundAmount": 10.0});
    assert_eq!(w.provider(partial.clone(), None).await, (200, false));
    assert_eq!(w.provider(partial.clone(), None).await, (200, true));
    let infraction = json!({"id": "tx-90", "status": "COMPLETED", "infraction": {"id": "inf-1", "status": "OPEN"}});
    assert_eq!(
        w.provider(infraction.clone(), Some("INFRACTION_CHANGED"))
            .await,
        (200, false)
    );

    // Day 60: refunded, then nothing may go back.
    w.advance_to(60, 0).await;
    assert_eq!(w.hand_off("refunded").await, 202, "a refund on day 60");
    assert_eq!(w.hand_off("approved").await, 409);
    assert_eq!(w.hand_off("settled").await, 409);
    w.advance_to(60, 3_600_000).await;
    // Every attempt the receivers saw, failed ones included: during the outage only the
    // first event of each was attempted, and after it each event arrived exactly once.
    let statuses: Vec<String> = w
        .gateway
        .received()
        .iter()
        .map(|r| r.json()["status"].as_str().unwrap_or_default().to_string())
        .collect();
    let mut expected = vec!["approved"; failed + 1];
    expected.extend(["settled", "refunded"]);
    assert_eq!(
        statuses, expected,
        "each transition delivered once, in order"
    );
    let forwarded: Vec<serde_json::Value> =
        w.merchant.received().iter().map(|r| r.json()).collect();
    let mut expected = vec![paid; failed_forwards + 1];
    expected.extend([partial, infraction]);
    assert_eq!(forwarded, expected, "each provider event forwarded once");

    // Day 90: the refund of day 60 (delivered an hour later) is kept until its 30 days are
    // up, and it is all that is kept of the messages.
    w.advance_to(90, 0).await;
    let page = w
        .server
        .app
        .store
        .list(&callbackd::store::ListFilter {
            limit: 100,
            ..Default::default()
        })
        .await
        .expect("lists");
    let kept: Vec<_> = page
        .messages
        .iter()
        .map(|m| {
            (
                m.message.payment_id.as_deref(),
                m.message.body.as_str(),
                m.state,
            )
        })
        .collect();
    assert_eq!(
        kept,
        [(
            Some("pay-90"),
            r#"{"paymentId":"pay-90","status":"refunded"}"#,
            callbackd::store::MessageState::Delivered
        )],
        "the refund is still kept"
    );
    // A day later, past every retention but the payment's, only the payment's state is left.
    w.advance_to(91, 0).await;
    footprint.assert_only_a_payment_state_is_left();
    assert_eq!(
        w.server
            .store
            .payment_status("pay-90", w.clock.now_ms())
            .await
            .unwrap()
            .as_deref(),
        Some("refunded")
    );
    // Past the payment's own retention from its last transition (day 60), the store is back
    // at its baseline exactly. Nothing is due any more, so the clock jumps there at once.
    let retention_days =
        (callbackd::store::DEFAULT_PAYMENT_RETENTION_SECS * 1_000) as Millis / DAY_MS;
    w.clock.set(w.start + (60 + retention_days + 1) * DAY_MS);
    w.sweep().await;
    assert_eq!(
        w.server
            .store
            .payment_status("pay-90", w.clock.now_ms())
            .await
            .unwrap(),
        None
    );
    assert_eq!(footprint.count(), baseline, "back at the baseline");
    w.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ninety_days_on_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    ninety_days(&url, Footprint::Redis(redis)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ninety_days_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cb.db");
    ninety_days(
        &format!("sqlite://{}", path.display()),
        Footprint::Sqlite(path),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ninety_days_on_postgres() {
    let server = PostgresServer::start();
    let db = "horizon";
    server.create_database(db);
    let url = server.url_db(db);
    ninety_days(
        &url,
        Footprint::Postgres {
            server,
            db: db.to_string(),
        },
    )
    .await;
}

/// The sweeper runs inside `serve` on its interval: no test call deletes anything here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_server_sweeps_on_its_own() {
    let redis = RedisServer::start();
    let (server, clock, _dispatcher) =
        virtual_server(&redis.url(), |c| c.store.sweep_interval_secs = 1).await;
    let r = server
        .post_callback("payzu", r#"{"id":"tx-s","status":"PAID"}"#, None)
        .await;
    assert_eq!(r.status(), 200);
    let messages = || redis.cli(&["--scan", "--pattern", "cb:*:m:*"]);
    assert_eq!(messages().lines().count(), 1);
    clock.advance(31 * DAY_MS);
    support::eventually(10, "the sweeper deletes the expired message", || async {
        messages().is_empty().then_some(())
    })
    .await;
    server.stop().await;
}
