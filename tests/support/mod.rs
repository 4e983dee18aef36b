//! Test support: a private Redis, the server in-process on port 0, HTTP sinks on 127.0.0.1.
#![allow(dead_code)]

pub mod fault_proxy;
pub mod payzu;
pub mod process;
pub mod redis;
pub mod sink;
pub mod wake;

use std::path::Path;
use std::sync::Arc;

use callbackd::app::App;
use callbackd::app::Settings;
use callbackd::clock::{Clock, ManualClock, SystemClock};
use callbackd::config::Config;
use callbackd::store::Inspectable;
use callbackd::webhook::sign_payzu;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const CONNECTOR_TOKEN: &str = "connector-token-1";
pub const ADMIN_TOKEN: &str = "admin-token-1";
pub const PAYZU_SECRET: &str = "payzu-secret-1";

/// A config for tests: fast retries, private addresses allowed for callbackUrls and every
/// source's forward_url (sinks are on 127.0.0.1).
pub fn config(store_url: &str, forward_url: Option<&str>) -> Config {
    let forward = forward_url
        .map(|u| format!("forward_url = \"{u}\""))
        .unwrap_or_default();
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
shutdown_grace_secs = 5
[store]
url = "{store_url}"
timeout_ms = 1000
[auth]
connector_tokens = ["{CONNECTOR_TOKEN}"]
admin_tokens = ["{ADMIN_TOKEN}"]
[dispatch]
allow_private_networks = true
initial_backoff_ms = 100
max_backoff_secs = 1
request_timeout_ms = 2000
lease_secs = 7
[sources.payzu]
secrets = ["old-secret", "{PAYZU_SECRET}"]
signature = "payzu"
allow_private_forward_url = true
{forward}
[sources.open]
signature = "none"
allow_private_forward_url = true
"#
    );
    Config::from_toml_str(&text, Path::new("test.toml"), std::iter::empty()).expect("test config")
}

pub struct TestServer {
    pub url: String,
    pub app: Arc<App>,
    /// The store `app` runs on, as a handle that also reads what only tests read (a
    /// payment's status).
    pub store: Arc<dyn Inspectable>,
    pub shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    pub client: reqwest::Client,
}

impl TestServer {
    pub async fn start(config: Config) -> TestServer {
        Self::start_with_clock(config, Arc::new(SystemClock)).await
    }

    pub async fn start_with_clock(config: Config, clock: Arc<dyn Clock>) -> TestServer {
        // What `callbackd::build` does, keeping the store's inspectable handle.
        let settings = Settings::from_config(&config).expect("server builds");
        let store = callbackd::open_inspectable_store(&settings.store)
            .await
            .expect("server builds");
        let app = Arc::new(App::with_settings(settings, store.clone(), clock));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let task = tokio::spawn({
            let app = app.clone();
            let shutdown = shutdown.clone();
            async move {
                callbackd::serve(app, listener, shutdown)
                    .await
                    .expect("server runs");
            }
        });
        TestServer {
            url,
            app,
            store,
            shutdown,
            task: Some(task),
            client: reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(20))
                .pool_idle_timeout(std::time::Duration::from_secs(5))
                .no_proxy()
                .build()
                .unwrap(),
        }
    }

    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Posts a PayZu-signed callback (signed at the app clock's now).
    pub async fn post_callback(
        &self,
        source: &str,
        body: &str,
        event: Option<&str>,
    ) -> reqwest::Response {
        let signature = sign_payzu(
            PAYZU_SECRET.as_bytes(),
            self.app.clock.now_secs(),
            body.as_bytes(),
        );
        self.post_signed(source, body, &signature, event).await
    }

    /// Posts a callback with the given `X-Callback-Signature` value.
    pub async fn post_signed(
        &self,
        source: &str,
        body: &str,
        signature: &str,
        event: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self
            .client
            .post(format!("{}/v1/callbacks/{source}", self.url))
            .header("x-callback-signature", signature)
            .header("content-type", "application/json")
            .body(body.to_string());
        if let Some(e) = event {
            req = req.header("x-callback-event", e);
        }
        req.send().await.expect("callback request")
    }

    /// Hands off a notification that must be accepted, and returns its id.
    pub async fn hand_off_id(&self, body: &serde_json::Value) -> String {
        let r = self.notify(body).await;
        assert_eq!(r.status(), 202, "hand-off accepted");
        let answer: serde_json::Value = r.json().await.expect("JSON answer");
        answer["notificationId"]
            .as_str()
            .expect("notificationId")
            .to_string()
    }

    pub async fn notify(&self, body: &serde_json::Value) -> reqwest::Response {
        self.client
            .post(format!("{}/v1/notifications", self.url))
            .bearer_auth(CONNECTOR_TOKEN)
            .json(body)
            .send()
            .await
            .expect("notification request")
    }

    pub async fn admin_get(&self, path: &str) -> reqwest::Response {
        self.client
            .get(format!("{}{path}", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("admin request")
    }

    pub async fn admin_post(&self, path: &str, body: &serde_json::Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .bearer_auth(ADMIN_TOKEN)
            .json(body)
            .send()
            .await
            .expect("admin request")
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// An HTTP client for talking to a callbackd under test. It drops pooled connections after
/// 5 s idle, before the server's own idle close (`server.header_timeout_secs`, 10 s): a
/// request sent on a keep-alive connection at the instant the server closes it would fail
/// with a reset, a race every HTTP/1.1 client has and that real clients handle by retrying.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(std::time::Duration::from_secs(5))
        .no_proxy()
        .build()
        .expect("HTTP client")
}

/// A client that keeps its connections open as long as the server does: a test that sends
/// SIGTERM reaches the draining process only through a connection opened before it (new ones
/// are refused). Give the process a long `server.header_timeout_secs` so it keeps the
/// connection too.
pub fn kept_alive_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(None)
        .no_proxy()
        .build()
        .expect("HTTP client")
}

/// Waits until a new TCP connection to `url` (`http://host:port`) is refused.
pub async fn wait_until_refused(url: &str) {
    let addr = url.trim_start_matches("http://").to_string();
    eventually(10, "new connections refused", || async {
        tokio::net::TcpStream::connect(&addr)
            .await
            .is_err()
            .then_some(())
    })
    .await;
}

pub fn manual_clock() -> Arc<ManualClock> {
    let now = SystemClock.now_ms();
    Arc::new(ManualClock::new(now))
}

/// Polls `check` every 20 ms until it returns Some, or panics after `secs`.
pub async fn eventually<T, F, Fut>(secs: u64, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out after {secs}s waiting for: {what}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A notification hand-off body.
pub fn handoff(payment: &str, status: &str, url: &str) -> serde_json::Value {
    serde_json::json!({"paymentId": payment, "status": status, "callbackUrl": url})
}

/// A server on a virtual clock (default 1 s / 1 h backoff), its dispatcher driven by the
/// test through `tick()`. `tweak` adjusts the config first.
pub async fn virtual_server(
    store_url: &str,
    tweak: impl FnOnce(&mut Config),
) -> (
    TestServer,
    Arc<ManualClock>,
    Arc<callbackd::dispatch::Dispatcher>,
) {
    let clock = manual_clock();
    let mut cfg = config(store_url, None);
    cfg.dispatch.enabled = false;
    cfg.dispatch.initial_backoff_ms = 1000;
    cfg.dispatch.max_backoff_secs = 3600;
    // All sinks are one host; let a tick deliver everything due at once.
    cfg.dispatch.per_host_concurrency = cfg.dispatch.concurrency;
    tweak(&mut cfg);
    let server = TestServer::start_with_clock(cfg, clock.clone()).await;
    let app = &server.app;
    let dispatcher = Arc::new(
        callbackd::dispatch::Dispatcher::new(
            &app.settings,
            app.store.clone(),
            clock.clone(),
            app.wake.clone(),
        )
        .expect("dispatcher"),
    );
    (server, clock, dispatcher)
}

/// A server on a virtual clock whose dispatcher is the real `run` loop users get (default
/// 1 s / 1 h backoff, default host caps): it claims what is due at the clock's time, so a
/// retry happens only once the test moves the clock to it.
pub async fn virtual_loop_server(
    store_url: &str,
    tweak: impl FnOnce(&mut Config),
) -> (TestServer, Arc<ManualClock>) {
    let clock = manual_clock();
    let mut cfg = config(store_url, None);
    let defaults = callbackd::config::DispatchConfig::default();
    cfg.dispatch.initial_backoff_ms = defaults.initial_backoff_ms;
    cfg.dispatch.max_backoff_secs = defaults.max_backoff_secs;
    cfg.dispatch.concurrency = defaults.concurrency;
    cfg.dispatch.per_host_concurrency = defaults.per_host_concurrency;
    tweak(&mut cfg);
    assert!(cfg.dispatch.enabled, "the loop under test must run");
    let server = TestServer::start_with_clock(cfg, clock.clone()).await;
    (server, clock)
}

/// A notification's accept request with `dedupe_key`, ordered by `ordering_key`, accepted at
/// `now` into a new store (the default partition count): what tests of the store's plumbing
/// (TLS, key prefixes) send through it.
pub fn notification_request(
    dedupe_key: &str,
    ordering_key: &str,
    now: callbackd::clock::Millis,
) -> callbackd::store::AcceptRequest {
    use callbackd::store::{
        AcceptRequest, DedupeClaim, MessageId, MessageKind, NewMessage, Partitions,
    };
    let id = MessageId::generate(now, ordering_key, Partitions::DEFAULT);
    AcceptRequest {
        dedupe: DedupeClaim {
            key: dedupe_key.to_string(),
            ttl_secs: 3600,
            fingerprint: Some("fp".into()),
            response: format!(r#"{{"messageId":"{id}"}}"#),
        },
        message: NewMessage {
            id,
            kind: MessageKind::Notification,
            source: None,
            payment_id: None,
            transaction_id: None,
            ordering_key: ordering_key.to_string(),
            event: None,
            target_url: Some("http://127.0.0.1:9/hook".into()),
            headers: std::collections::BTreeMap::new(),
            body: "{}".into(),
            created_at: now,
            deadline: now + 86_400_000,
        },
        payment: None,
        seal: None,
    }
}
