//! Provider-side recovery (issue #27), with real `callbackd serve` processes, real HTTP on
//! loopback and a fake PayZu API (support/payzu.rs) that answers the resend requests and then
//! posts signed callbacks: some callbackd already has, some new. The report must give exactly
//! the new and replayed counts the provider produced, read from any process of the store, on
//! SQLite, Redis and PostgreSQL.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;
mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use callbackd::clock::{Clock, format_iso, parse_rfc3339};
use postgres_support::PostgresServer;
use serde_json::{Value, json};
use support::payzu::{API_TOKEN, FakePayzu, Transaction};
use support::process::Process;
use support::redis::RedisServer;
use support::{ADMIN_TOKEN, PAYZU_SECRET};

const DAY_MS: i64 = 86_400_000;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The sources: `payzu` with the fake's API, `quiet` without one.
fn sources(fake: &FakePayzu) -> String {
    format!(
        r#"
[sources.payzu]
secrets = ["{PAYZU_SECRET}"]
signature = "payzu"
provider_api_url = "{}"
provider_api_token = "{API_TOKEN}"
[sources.quiet]
signature = "none"
"#,
        fake.url
    )
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn post_recovery(url: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(format!("{url}/v1/admin/recoveries"))
        .bearer_auth(ADMIN_TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn admin_get(url: &str, path: &str) -> Value {
    let r = client()
        .get(format!("{url}{path}"))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r.json().await.unwrap()
}

/// Reads the recovery at `url` until `new + replays` reaches `expected`, then a little
/// longer, so a figure that overshoots is seen too.
async fn settled_figures(url: &str, id: &str, expected: u64) -> (u64, u64) {
    let path = format!("/v1/admin/recoveries/{id}");
    let figures = |r: &Value| (r["new"].as_u64().unwrap(), r["replays"].as_u64().unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (new, replays) = figures(&admin_get(url, &path).await);
        if new + replays >= expected || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    figures(&admin_get(url, &path).await)
}

/// Five transactions over the last 20 days; `tx-a` and `tx-c` reached callbackd before.
fn transactions(from: i64) -> Vec<Transaction> {
    vec![
        Transaction::new(from + DAY_MS, "tx-a", "COMPLETED"),
        Transaction::new(from + 8 * DAY_MS, "tx-b", "COMPLETED"),
        Transaction::new(from + 9 * DAY_MS, "tx-c", "REFUNDED"),
        Transaction::new(from + 15 * DAY_MS, "tx-d", "COMPLETED"),
        Transaction::new(from + 19 * DAY_MS, "tx-e", "COMPLETED"),
    ]
}

/// A recovery over 20 days sends three windows of at most 7 days with the token, and reports
/// exactly the new and replayed callbacks the provider sent, in every process.
async fn recovery_reports_what_the_provider_resent(fake: &FakePayzu, urls: &[&str]) {
    let now = now_ms();
    let (from, to) = (now - 20 * DAY_MS, now);
    let txs = transactions(from);
    fake.add(txs.clone());
    fake.target(urls);
    // What callbackd had before the recovery: in the minute it starts, too, which is not its;
    // signed earlier, so the resends are replays of the event, not of the signature.
    for tx in [&txs[0], &txs[2]] {
        assert_eq!(fake.post_signed_ago(tx, 30).await, (200, false));
    }

    let (status, started) = post_recovery(
        urls[0],
        &json!({"source": "payzu", "from": format_iso(from), "to": format_iso(to)}),
    )
    .await;
    assert_eq!(status, 201, "{started}");
    let id = started["id"].as_str().unwrap().to_string();
    let windows = started["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 3, "{started}");
    let mut at = from;
    for (w, total) in windows.iter().zip([1, 2, 2]) {
        let (wf, wt) = (
            parse_rfc3339(w["from"].as_str().unwrap()).unwrap(),
            parse_rfc3339(w["to"].as_str().unwrap()).unwrap(),
        );
        assert_eq!(wf, at, "contiguous: {started}");
        assert!(wt - wf <= 7 * DAY_MS && wt > wf);
        assert_eq!(
            (w["state"].clone(), w["total"].clone()),
            (json!("sent"), json!(total))
        );
        at = wt;
    }
    assert_eq!(at, to);
    assert_eq!(started["requested"], 5);
    let calls = fake.calls();
    assert_eq!(calls.len(), 3);
    for (call, w) in calls.iter().zip(windows) {
        assert_eq!(
            call.authorization.as_deref(),
            Some(format!("Bearer {API_TOKEN}").as_str())
        );
        assert_eq!(
            (json!(call.from), json!(call.to)),
            (w["from"].clone(), w["to"].clone())
        );
    }

    // Read from the last process: the counts are the store's, not the one that was asked.
    let (new, replays) = settled_figures(urls[urls.len() - 1], &id, 5).await;
    let posted = fake.posted();
    let resent = &posted[2..];
    assert_eq!(resent.len(), 5);
    let provider_new = resent.iter().filter(|(s, r)| *s == 200 && !r).count() as u64;
    let provider_replays = resent.iter().filter(|(s, r)| *s == 200 && *r).count() as u64;
    assert_eq!((provider_new, provider_replays), (3, 2), "{posted:?}");
    assert_eq!((new, replays), (3, 2));
    for url in urls {
        let listed = admin_get(url, "/v1/admin/recoveries").await;
        let first = &listed["recoveries"][0];
        assert_eq!(first["id"], json!(id));
        assert_eq!(
            (first["new"].clone(), first["replays"].clone()),
            (json!(3), json!(2))
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_reports_new_and_replayed_callbacks_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let process = Process::start(&store, &sources(&fake));
    recovery_reports_what_the_provider_resent(&fake, &[&process.url]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_reports_new_and_replayed_callbacks_across_processes_on_redis() {
    let redis = RedisServer::start();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let a = Process::start(&redis.url(), &sources(&fake));
    let b = Process::start(&redis.url(), &sources(&fake));
    recovery_reports_what_the_provider_resent(&fake, &[&a.url, &b.url]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_reports_new_and_replayed_callbacks_across_processes_on_postgres() {
    let url = PostgresServer::shared().fresh_database();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let a = Process::start(&url, &sources(&fake));
    let b = Process::start(&url, &sources(&fake));
    recovery_reports_what_the_provider_resent(&fake, &[&a.url, &b.url]).await;
}

/// Each refusal is a 400 naming the field and the limit, sends nothing and records nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_recoveries_name_the_field_and_record_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let process = Process::start(&store, &sources(&fake));
    let now = now_ms();
    let ask = |source: &str, from: i64, to: i64| json!({"source": source, "from": format_iso(from), "to": format_iso(to)});
    let cases = [
        (ask("payzu", now - 31 * DAY_MS, now), "`from`", "30 days"),
        (
            ask("payzu", now - DAY_MS, now - DAY_MS),
            "`from`",
            "before `to`",
        ),
        (
            ask("payzu", now - 2 * DAY_MS, now - 3 * DAY_MS),
            "`from`",
            "before `to`",
        ),
        (
            ask("payzu", now - DAY_MS, now + 3_600_000),
            "`to`",
            "in the future",
        ),
        (ask("nope", now - DAY_MS, now), "`source`", "payzu, quiet"),
        (
            ask("quiet", now - DAY_MS, now),
            "`source`",
            "provider_api_url",
        ),
        (
            json!({"source": "payzu", "from": "yesterday", "to": format_iso(now)}),
            "`from`",
            "RFC 3339",
        ),
        (
            json!({"source": "payzu", "from": format_iso(now - DAY_MS), "to": format_iso(now),
                   "countSecs": 0}),
            "`countSecs`",
            "1 to 86400",
        ),
    ];
    for (body, field, limit) in cases {
        let (status, answer) = post_recovery(&process.url, &body).await;
        assert_eq!(status, 422, "{body}: {answer}");
        assert_eq!(answer["error"], "invalid_recovery", "{answer}");
        let message = answer["message"].as_str().unwrap();
        assert!(
            message.contains(field) && message.contains(limit),
            "{body}: {message}"
        );
    }
    let listed = admin_get(&process.url, "/v1/admin/recoveries").await;
    assert_eq!(listed["recoveries"], json!([]), "nothing recorded");
    assert!(fake.calls().is_empty(), "nothing sent");
}

/// A window the provider answers 500 is retried and goes through; one it answers 401 is
/// recorded with the status and the body, and the other windows are still sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_window_is_retried_or_recorded_while_the_others_are_sent() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let process = Process::start(&store, &sources(&fake));
    fake.target(&[&process.url]);
    let now = now_ms();
    let body = json!({"source": "payzu", "from": format_iso(now - 20 * DAY_MS),
                      "to": format_iso(now)});

    fake.fail_next(&[(500, "try later")]);
    let (status, retried) = post_recovery(&process.url, &body).await;
    assert_eq!(status, 201, "{retried}");
    let attempts: Vec<&Value> = retried["windows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| &w["attempts"])
        .collect();
    assert_eq!(attempts, [&json!(2), &json!(1), &json!(1)], "{retried}");
    assert!(
        retried["windows"]
            .as_array()
            .unwrap()
            .iter()
            .all(|w| w["state"] == "sent")
    );
    assert_eq!(retried["failedWindows"], 0);
    assert_eq!(fake.calls().len(), 4);

    fake.fail_next(&[(401, r#"{"message":"Unauthorized"}"#)]);
    let (status, refused) = post_recovery(&process.url, &body).await;
    assert_eq!(status, 201, "{refused}");
    let windows = refused["windows"].as_array().unwrap();
    assert_eq!(windows[0]["state"], "failed", "{refused}");
    assert_eq!(windows[0]["attempts"], 1, "a 401 is not retried");
    let error = windows[0]["error"].as_str().unwrap();
    assert!(
        error.contains("401") && error.contains("Unauthorized"),
        "{error}"
    );
    assert!(!error.contains(API_TOKEN));
    assert_eq!(
        (windows[1]["state"].clone(), windows[2]["state"].clone()),
        (json!("sent"), json!("sent"))
    );
    assert_eq!(refused["failedWindows"], 1);
    assert_eq!(fake.calls().len(), 7, "the other windows were sent");
    // Recorded as answered: the list has both, newest first.
    let listed = admin_get(&process.url, "/v1/admin/recoveries").await;
    let ids: Vec<&Value> = listed["recoveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["id"])
        .collect();
    assert_eq!(ids, [&refused["id"], &retried["id"]]);
    assert_eq!(listed["recoveries"][0]["windows"][0]["error"], json!(error));

    // An answer that does not end is not read into memory, nor asked for again.
    let endless = format!(r#"{{"message":"{}","total":1}}"#, "x".repeat(100_000));
    fake.fail_next(&[(200, &endless)]);
    let (status, cut) = post_recovery(&process.url, &body).await;
    assert_eq!(status, 201, "{cut}");
    let window = &cut["windows"][0];
    assert_eq!(window["state"], "failed", "{cut}");
    assert_eq!(window["attempts"], 1, "an oversized answer is not retried");
    assert!(
        window["error"]
            .as_str()
            .unwrap()
            .contains("over 65536 bytes"),
        "{cut}"
    );
    assert_eq!(fake.calls().len(), 10, "the other windows were sent");
}

/// `callbackd recover --wait` starts the recovery, follows it and prints the report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_recovers_and_prints_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let process = Process::start(&store, &sources(&fake));
    let now = now_ms();
    let from = now - 20 * DAY_MS;
    let txs = transactions(from);
    fake.add(txs.clone());
    fake.target(&[&process.url]);
    for tx in [&txs[0], &txs[2]] {
        assert_eq!(fake.post(tx).await, (200, false));
    }
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["recover", "--source", "payzu", "--from"])
        .arg(format_iso(from))
        .arg("--to")
        .arg(format_iso(now))
        .args(["--wait", "30", "--url", &process.url])
        .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("requested 5 callback(s); arrived: 3 new, 2 replayed"),
        "{stdout}"
    );
    assert_eq!(stdout.matches("total ").count(), 3, "{stdout}");
    assert!(!stdout.contains(API_TOKEN) && !stderr.contains(API_TOKEN));
    let report: Value = serde_json::from_str(&stdout[stdout.find('{').unwrap()..]).unwrap();
    assert_eq!(
        (report["new"].clone(), report["replays"].clone()),
        (json!(3), json!(2))
    );

    // A refusal exits 2 with the server's message.
    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["recover", "--source", "quiet", "--from"])
        .arg(format_iso(now - DAY_MS))
        .arg("--to")
        .arg(format_iso(now))
        .args(["--url", &process.url])
        .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .await
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("invalid_recovery") && stderr.contains("provider_api_url"),
        "{stderr}"
    );
}

/// On a virtual clock: once its counting window is over, a recovery's figures are written into
/// it at its next read and outlive the counts; one nobody read in time shows none. Two
/// recoveries of one source counting at once count the same callbacks (documented).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn figures_are_settled_when_counting_ends_and_outlive_the_counts() {
    let dir = tempfile::tempdir().unwrap();
    let fake = FakePayzu::start(PAYZU_SECRET).await;
    let store = format!("sqlite://{}", dir.path().join("cb.db").display());
    let mut config = support::config(&store, None);
    let payzu = config.sources.get_mut("payzu").unwrap();
    payzu.provider_api_url = Some(fake.url.clone());
    payzu.provider_api_token = Some(callbackd::redact::Secret::new(API_TOKEN));
    let start = now_ms();
    let clock = std::sync::Arc::new(callbackd::clock::ManualClock::new(start));
    let server = support::TestServer::start_with_clock(config, clock.clone()).await;
    fake.target(&[&server.url]);
    let from = start - 20 * DAY_MS;
    fake.add(transactions(from));
    let body = json!({"source": "payzu", "from": format_iso(from), "to": format_iso(start),
                      "countSecs": 60});

    let (status, first) = post_recovery(&server.url, &body).await;
    assert_eq!(status, 201, "{first}");
    let first = first["id"].as_str().unwrap().to_string();
    assert_eq!(settled_figures(&server.url, &first, 5).await, (5, 0));
    let (status, second) = post_recovery(&server.url, &body).await;
    assert_eq!(status, 201, "{second}");
    let second = second["id"].as_str().unwrap().to_string();
    assert_eq!(settled_figures(&server.url, &second, 5).await, (0, 5));
    assert_eq!(
        settled_figures(&server.url, &first, 10).await,
        (5, 5),
        "overlapping windows count the same callbacks"
    );

    clock.advance(2 * 60_000);
    let read = admin_get(&server.url, &format!("/v1/admin/recoveries/{first}")).await;
    assert_eq!(read["counting"], false);
    assert_eq!(
        (read["new"].clone(), read["replays"].clone()),
        (json!(5), json!(5))
    );

    // Days later the counts are gone: the first kept its figures, the second, never read
    // since its window ended, has none.
    clock.advance(3 * DAY_MS);
    server.app.store.sweep(clock.now_ms()).await.unwrap();
    let read = admin_get(&server.url, &format!("/v1/admin/recoveries/{first}")).await;
    assert_eq!(
        (read["new"].clone(), read["replays"].clone()),
        (json!(5), json!(5))
    );
    let read = admin_get(&server.url, &format!("/v1/admin/recoveries/{second}")).await;
    assert_eq!(
        (read["new"].clone(), read["replays"].clone()),
        (json!(null), json!(null))
    );
    server.stop().await;
}
