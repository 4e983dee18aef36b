//! The console in a real browser (issue 15): Debian's chromium, driven by chromedriver over
//! WebDriver, against a running callbackd with a real SQLite store, a real dispatcher and a
//! real sink. Nothing is downloaded: `.ci/run` installs `chromium` and `chromium-driver`.
//!
//! Screenshots land in `target/tmp/console-screenshots/`.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use callbackd::clock::Clock;
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use support::redis::free_port;
use support::sink::{Answer, Reply, Sink};
use support::{ADMIN_TOKEN, TestServer, config, eventually, handoff};

/// Upper bound for anything the page has to show; the tests wait on the page, not a clock.
const PAGE_WAIT: Duration = Duration::from_secs(30);

/// A private chromedriver on a free port, killed with the test.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start() -> Driver {
        let port = free_port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver on PATH (.ci/run installs Debian's chromium-driver)");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn browser(driver: &Driver, profile: &tempfile::TempDir) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,1000",
                format!("--user-data-dir={}", profile.path().display()),
            ],
        }),
    );
    caps.insert("goog:loggingPrefs".into(), json!({"browser": "ALL"}));
    ClientBuilder::new(HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .expect("a chromium session")
}

/// The browser's console messages since the last call (chromedriver's log endpoint).
async fn browser_log(driver: &Driver, c: &Client) -> Vec<Value> {
    let session = c.session_id().await.unwrap().expect("session id");
    let answer: Value = support::client()
        .post(format!("{}/session/{session}/se/log", driver.url))
        .json(&json!({"type": "browser"}))
        .send()
        .await
        .expect("log request")
        .json()
        .await
        .expect("log JSON");
    answer["value"].as_array().cloned().unwrap_or_default()
}

fn severe(log: &[Value]) -> Vec<String> {
    log.iter()
        .filter(|e| e["level"] == "SEVERE")
        .map(|e| e["message"].as_str().unwrap_or_default().to_string())
        .collect()
}

async fn css(c: &Client, selector: &str) -> fantoccini::elements::Element {
    c.wait()
        .at_most(PAGE_WAIT)
        .for_element(Locator::Css(selector))
        .await
        .unwrap_or_else(|e| panic!("`{selector}` never appeared: {e}"))
}

async fn text(c: &Client, selector: &str) -> String {
    css(c, selector).await.text().await.unwrap()
}

async fn count(c: &Client, selector: &str) -> usize {
    c.find_all(Locator::Css(selector)).await.unwrap().len()
}

/// Waits for the page at `path` to show `selector`.
async fn open(c: &Client, base: &str, path: &str, selector: &str) {
    c.goto(&format!("{base}{path}")).await.unwrap();
    css(c, selector).await;
}

fn screenshot_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn screenshot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    std::fs::write(screenshot_dir().join(name), png).unwrap();
}

/// Answers 410 with a JSON reason the first time a `/flip/...` path is called and 204 after
/// (a merchant that refused, then fixed its side), 204 to everything else.
async fn flip_sink() -> (Sink, Arc<Mutex<HashMap<String, usize>>>) {
    let calls = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let sink = Sink::answering({
        let calls = calls.clone();
        move |r, _| {
            let n = {
                let mut calls = calls.lock().unwrap();
                let n = calls.entry(r.uri.clone()).or_default();
                *n += 1;
                *n
            };
            if r.uri.starts_with("/flip/") && n == 1 {
                Answer {
                    reply: Reply::status(410),
                    content_type: Some("application/json".into()),
                    body: br#"{"error":"merchant order closed"}"#.to_vec(),
                }
            } else {
                Answer {
                    reply: Reply::status(204),
                    content_type: None,
                    body: Vec::new(),
                }
            }
        }
    })
    .await;
    (sink, calls)
}

async fn states(server: &TestServer) -> (usize, usize) {
    let r = server.admin_get("/v1/messages?limit=1000").await;
    let page: Value = r.json().await.unwrap();
    let list = page["messages"].as_array().unwrap();
    let of = |s: &str| list.iter().filter(|m| m["state"] == s).count();
    (of("dead"), of("delivered"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_console_in_chromium() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("console.db").display());
    let server = TestServer::start(config(&store, None)).await;
    let (sink, calls) = flip_sink().await;
    let calls_to = |path: &str| calls.lock().unwrap().get(path).copied().unwrap_or(0);
    for n in 1..=3 {
        server
            .hand_off_id(&handoff(
                &format!("p-dead-{n}"),
                "approved",
                &format!("{}/flip/{n}", sink.url),
            ))
            .await;
    }
    for n in 1..=4 {
        server
            .hand_off_id(&handoff(
                &format!("p-ok-{n}"),
                "approved",
                &format!("{}/ok/{n}", sink.url),
            ))
            .await;
    }
    eventually(30, "3 dead and 4 delivered", || async {
        (states(&server).await == (3, 4)).then_some(())
    })
    .await;

    let driver = Driver::start();
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, &profile).await;
    let base = server.url.clone();

    // Login: a wrong token shows an error and no data, then the right one shows the overview.
    open(&c, &base, "/console", "#login-form").await;
    css(&c, "#token")
        .await
        .send_keys("not-the-token")
        .await
        .unwrap();
    css(&c, "#login-form button").await.click().await.unwrap();
    assert!(text(&c, "#login-error").await.contains("refused"));
    assert_eq!(count(&c, "#overview").await, 0);
    assert_eq!(count(&c, "#nav:not([hidden])").await, 0);
    assert_eq!(
        c.execute(
            "return sessionStorage.getItem('callbackd.adminToken')",
            vec![]
        )
        .await
        .unwrap(),
        Value::Null,
        "a refused token is not kept"
    );
    screenshot(&c, "login-refused.png").await;
    // The refused API call is the only error the browser reports.
    for message in severe(&browser_log(&driver, &c).await) {
        assert!(
            message.contains("401"),
            "unexpected browser error: {message}"
        );
    }
    css(&c, "#token")
        .await
        .send_keys(ADMIN_TOKEN)
        .await
        .unwrap();
    css(&c, "#login-form button").await.click().await.unwrap();
    assert_eq!(text(&c, "#depth-dead .value").await, "3");
    assert_eq!(text(&c, "#depth-pending .value").await, "0");
    assert_eq!(count(&c, "#chart polyline").await, 2);
    screenshot(&c, "overview.png").await;

    // The dead-letter list, from the overview's card.
    css(&c, "#depth-dead").await.click().await.unwrap();
    css(&c, "#messages-table").await;
    assert!(
        c.current_url()
            .await
            .unwrap()
            .as_str()
            .ends_with("/console/messages?state=dead")
    );
    assert_eq!(count(&c, "tr.message-row").await, 3);
    assert_eq!(count(&c, "tr.message-row.state-dead").await, 3);
    screenshot(&c, "dead-letters.png").await;

    // A message's attempts, with the receiver's answer.
    let first = css(&c, "tr.message-row a").await;
    let id = first.text().await.unwrap();
    first.click().await.unwrap();
    css(&c, "#attempts li.attempt").await;
    assert_eq!(text(&c, "#message-state").await, "dead");
    let timeline = text(&c, "#attempts").await;
    assert!(timeline.contains("HTTP 410"), "{timeline}");
    assert!(timeline.contains("merchant order closed"), "{timeline}");
    assert!(
        timeline.contains("Content-Type: application/json"),
        "{timeline}"
    );
    screenshot(&c, "message.png").await;

    // Resend delivers it again to the sink.
    let view: Value = server
        .admin_get(&format!("/v1/messages/{id}"))
        .await
        .json()
        .await
        .unwrap();
    let path = view["targetUrl"]
        .as_str()
        .unwrap()
        .trim_start_matches(&sink.url)
        .to_string();
    assert_eq!(calls_to(&path), 1);
    css(&c, "#resend-button").await.click().await.unwrap();
    css(&c, "#confirm-resend").await.click().await.unwrap();
    assert!(text(&c, "#resend-done").await.starts_with("Resent"));
    eventually(30, "the resent message reaches the sink", || async {
        (calls_to(&path) == 2).then_some(())
    })
    .await;
    eventually(30, "the page shows it delivered", || async {
        c.refresh().await.unwrap();
        (text(&c, "#message-state").await == "delivered").then_some(())
    })
    .await;
    let timeline = text(&c, "#attempts").await;
    assert!(timeline.contains("resend (console-"), "{timeline}");
    assert!(timeline.contains("HTTP 204"), "{timeline}");

    // Filters: a payment id narrows the list to its message.
    open(&c, &base, "/console/messages", "#filter-form").await;
    css(&c, "#filter-paymentId")
        .await
        .send_keys("p-ok-2")
        .await
        .unwrap();
    css(&c, "#filter-form button").await.click().await.unwrap();
    c.wait()
        .at_most(PAGE_WAIT)
        .for_url(
            &format!("{base}/console/messages?paymentId=p-ok-2")
                .parse()
                .unwrap(),
        )
        .await
        .unwrap();
    css(&c, "#messages-table").await;
    assert_eq!(count(&c, "tr.message-row").await, 1);
    assert!(text(&c, "#messages-table").await.contains("p-ok-2"));
    css(&c, "#filter-state")
        .await
        .select_by_value("dead")
        .await
        .unwrap();
    css(&c, "#filter-form button").await.click().await.unwrap();
    css(&c, "#no-messages").await;

    // Paging: 7 messages, 3 a page, each seen once.
    open(&c, &base, "/console/messages?limit=3", "#messages-table").await;
    let mut seen = HashSet::new();
    let mut pages = 0;
    loop {
        pages += 1;
        for row in c.find_all(Locator::Css("tr.message-row")).await.unwrap() {
            assert!(seen.insert(row.attr("data-id").await.unwrap().unwrap()));
        }
        if count(&c, "#next-page").await == 0 {
            break;
        }
        let before = c.current_url().await.unwrap();
        css(&c, "#next-page").await.click().await.unwrap();
        eventually(30, "the next page", || async {
            (c.current_url().await.unwrap() != before).then_some(())
        })
        .await;
        css(&c, "#messages-table").await;
    }
    assert_eq!((seen.len(), pages), (7, 3));

    // Bulk resend of the two remaining dead letters, after a dry-run count.
    let from = callbackd::clock::format_iso(callbackd::clock::SystemClock.now_ms() - 3_600_000);
    open(
        &c,
        &base,
        &format!("/console/messages?state=dead&createdAtFrom={from}"),
        "#messages-table",
    )
    .await;
    assert_eq!(count(&c, "tr.message-row").await, 2);
    css(&c, "#resend-selection").await.click().await.unwrap();
    assert_eq!(
        text(&c, "#dry-run-count").await,
        "2 messages would be resent."
    );
    assert_eq!(states(&server).await.0, 2, "the dry run resent nothing");
    screenshot(&c, "bulk-resend.png").await;
    css(&c, "#confirm-bulk").await.click().await.unwrap();
    assert_eq!(text(&c, "#bulk-done").await, "Resent 2 messages.");
    eventually(30, "every dead letter delivered", || async {
        (states(&server).await == (0, 7)).then_some(())
    })
    .await;

    // Log out forgets the token.
    css(&c, "#logout").await.click().await.unwrap();
    css(&c, "#login-form").await;

    let errors = severe(&browser_log(&driver, &c).await);
    assert!(errors.is_empty(), "browser errors: {errors:?}");
    c.close().await.unwrap();
    server.stop().await;
}

/// A port nothing listens on: connections to it are refused.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// A gateway that refuses connections opens its host's breaker; the overview lists the host
/// as open, since when, and with the waiting count the admin API gives, and the chart counts
/// the failed attempts the store recorded.
#[tokio::test]
async fn the_overview_shows_a_host_whose_breaker_is_open_with_its_waiting_messages() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("console.db").display());
    let mut cfg = config(&store, None);
    cfg.dispatch.breaker.failures = 3;
    // Open for the whole test: one probe a minute at most.
    cfg.dispatch.breaker.probe_secs = 60;
    cfg.dispatch.breaker.max_probe_secs = 60;
    let server = TestServer::start(cfg).await;
    let port = closed_port();
    let host = format!("127.0.0.1:{port}");
    for n in 0..8 {
        server
            .hand_off_id(&handoff(
                &format!("p-held-{n}"),
                "approved",
                &format!("http://{host}/cb/{n}"),
            ))
            .await;
    }
    let held = || async {
        let listed: Value = server
            .admin_get("/v1/admin/hosts")
            .await
            .json()
            .await
            .unwrap();
        listed["hosts"][0].clone()
    };
    let waiting = eventually(30, "the host open with messages waiting", || async {
        let entry = held().await;
        (entry["host"] == host.as_str() && entry["waiting"].as_u64().unwrap_or(0) >= 1)
            .then(|| entry["waiting"].as_u64().unwrap())
    })
    .await;

    let driver = Driver::start();
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, &profile).await;
    open(&c, &server.url, "/console", "#login-form").await;
    css(&c, "#token")
        .await
        .send_keys(ADMIN_TOKEN)
        .await
        .unwrap();
    css(&c, "#login-form button").await.click().await.unwrap();
    let row = format!("#held-hosts-table .held-host[data-host=\"{host}\"]");
    css(&c, &row).await;
    assert_eq!(text(&c, &format!("{row} .badge")).await, "open");
    let since = text(&c, &format!("{row} td:nth-child(3)")).await;
    let open_since = held().await["openSince"].as_str().unwrap().to_string();
    assert_eq!(since, format!("open since {open_since}"));
    // Messages go on being held while the page loads: the page shows what the API said then.
    let shown: u64 = text(&c, &format!("{row} .waiting")).await.parse().unwrap();
    let now = held().await["waiting"].as_u64().unwrap();
    assert!(
        (waiting..=now).contains(&shown),
        "{shown} waiting shown, the API said {waiting} then {now}"
    );
    let failures: u64 = text(&c, "#total-failures")
        .await
        .trim_start_matches("failures (")
        .trim_end_matches(')')
        .parse()
        .unwrap();
    assert!(
        failures >= 3,
        "the attempts that opened the breaker: {failures}"
    );
    screenshot(&c, "held-host.png").await;
    c.close().await.unwrap();
    server.stop().await;
}
