//! What a deployment relies on, with real `callbackd` processes on the embedded SQLite store:
//! proxy variables are ignored, `/readyz` turns 503 when shutdown begins, `check-config`
//! refuses guessable secrets off loopback, and `callbackd healthcheck` works for a container.

mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use support::process::Process;
use support::sink::Sink;
use support::{ADMIN_TOKEN, eventually, handoff};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};

fn sqlite_store(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("cb.db").display())
}

/// A listener that counts the connections it is offered and never answers: a proxy nobody
/// should use.
async fn silent_proxy() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    tokio::spawn({
        let connections = connections.clone();
        async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = listener.accept().await {
                connections.fetch_add(1, Ordering::SeqCst);
                held.push(stream);
            }
        }
    });
    (url, connections)
}

#[tokio::test]
async fn proxy_variables_are_ignored_by_deliveries_and_the_cli() {
    let dir = tempfile::tempdir().unwrap();
    let (proxy, proxied) = silent_proxy().await;
    let proxy_env: Vec<(&str, &str)> = [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ]
    .into_iter()
    .map(|var| (var, proxy.as_str()))
    .chain([("NO_PROXY", ""), ("no_proxy", "")])
    .collect();
    let sink = Sink::ok().await;
    let process = Process::start_with_env(&sqlite_store(&dir), "", &proxy_env);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = client
        .post(format!("{}/v1/notifications", process.url))
        .bearer_auth(support::CONNECTOR_TOKEN)
        .json(&handoff("p-proxy", "approved", &format!("{}/cb", sink.url)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["notificationId"]
        .as_str()
        .unwrap()
        .to_string();
    eventually(15, "delivered straight to the sink", || async {
        (sink.count() == 1).then_some(())
    })
    .await;

    // The CLI and the health check are clients too.
    let show = Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["messages", "show", &id, "--url", &process.url])
        .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
        .envs(proxy_env.iter().copied())
        .output()
        .unwrap();
    assert!(show.status.success(), "{show:?}");
    let health = Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["healthcheck", "--url", &process.url])
        .envs(proxy_env.iter().copied())
        .output()
        .unwrap();
    assert!(health.status.success(), "{health:?}");
    assert_eq!(proxied.load(Ordering::SeqCst), 0, "the proxy saw nothing");
}

/// A receiver that reports each request and answers 204 only when released.
async fn holding_sink() -> (String, mpsc::UnboundedReceiver<()>, Arc<Notify>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (arrived, arrivals) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    tokio::spawn({
        let release = release.clone();
        async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (arrived, release) = (arrived.clone(), release.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    if stream.read(&mut buf).await.unwrap_or(0) > 0 {
                        // Registered before reporting, so a release right after is not missed.
                        let released = release.notified();
                        tokio::pin!(released);
                        released.as_mut().enable();
                        let _ = arrived.send(());
                        released.await;
                        let _ = stream
                            .write_all(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
                            .await;
                    }
                });
            }
        }
    });
    (url, arrivals, release)
}

#[tokio::test]
async fn sigterm_refuses_new_connections_and_readyz_answers_503_on_open_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (sink, mut arrivals, release) = holding_sink().await;
    // The held attempt must not time out (the template's 1 s) before the test is done with
    // the drain: that would end the drain, and close the port, on the machine's schedule.
    let mut process = Process::start_with_env(
        &sqlite_store(&dir),
        "",
        &[
            ("CALLBACKD__SERVER__SHUTDOWN_GRACE_SECS", "120"),
            ("CALLBACKD__DISPATCH__REQUEST_TIMEOUT_MS", "120000"),
            ("CALLBACKD__DISPATCH__LEASE_SECS", "130"),
            // The test's connection stays open across the SIGTERM: it must not be closed as
            // idle (after the header timeout) while the test uses it.
            ("CALLBACKD__SERVER__HEADER_TIMEOUT_SECS", "120"),
        ],
    );
    // One kept-alive connection, opened before the SIGTERM: the only way in afterwards.
    let client = support::kept_alive_client();
    let readyz = || async {
        client
            .get(format!("{}/readyz", process.url))
            .send()
            .await
            .ok()
    };
    assert_eq!(readyz().await.expect("up").status(), 200);
    let r = client
        .post(format!("{}/v1/notifications", process.url))
        .bearer_auth(support::CONNECTOR_TOKEN)
        .json(&handoff("p-drain", "approved", &format!("{sink}/cb")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    arrivals.recv().await.expect("the delivery is held open");

    process.signal("TERM");
    let draining = eventually(10, "/readyz says 503", || async {
        readyz().await.filter(|r| r.status() == 503)
    })
    .await;
    let body: Value = draining.json().await.unwrap();
    assert_eq!(body["error"], "shutting_down");
    support::wait_until_refused(&process.url).await;
    // The open connection is still served while the delivery drains: a hand-off arriving
    // on it now is accepted.
    let late = client
        .post(format!("{}/v1/notifications", process.url))
        .bearer_auth(support::CONNECTOR_TOKEN)
        .json(&handoff("p-late", "approved", &format!("{sink}/cb")))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 202);

    release.notify_waiters();
    let status = tokio::task::spawn_blocking(move || {
        let status = process.child.wait().unwrap();
        (status, process)
    })
    .await
    .unwrap()
    .0;
    assert_eq!(
        status.code(),
        Some(0),
        "clean exit once the delivery is done"
    );
    // The draining process claimed nothing more: the late hand-off never reached the
    // receiver from it (it has exited, so it never will). The next start delivers it.
    assert!(
        arrivals.try_recv().is_err(),
        "a shutting-down process claimed a new message"
    );
    let _next = Process::start(&sqlite_store(&dir), "");
    arrivals
        .recv()
        .await
        .expect("the next start delivers p-late");
    release.notify_waiters();
}

fn check_config(config: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["check-config", "--config", config.to_str().unwrap()])
        .env_remove("CALLBACKD_CONFIG")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// `check-config` says which partition count a store will have, and refuses one out of range.
#[test]
fn check_config_reports_the_partition_count() {
    let example = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml"));
    let unset = check_config(example, &[]);
    let stdout = String::from_utf8_lossy(&unset.stdout);
    assert!(
        stdout.contains("partitions: the store's own") && stdout.contains("64 for a new store"),
        "{stdout}"
    );
    let set = check_config(example, &[("CALLBACKD__STORE__PARTITIONS", "128")]);
    let stdout = String::from_utf8_lossy(&set.stdout);
    assert!(
        stdout.contains("partitions: 128 (store.partitions)"),
        "{stdout}"
    );
    let zero = check_config(example, &[("CALLBACKD__STORE__PARTITIONS", "0")]);
    assert_eq!(zero.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&zero.stderr);
    assert!(
        stderr.contains("store.partitions") && stderr.contains("must be 1 to 256"),
        "{stderr}"
    );
}

#[test]
fn check_config_refuses_the_example_secrets_off_loopback() {
    let example = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml"));
    let ok = check_config(example, &[]);
    assert!(ok.status.success(), "fine on 127.0.0.1: {ok:?}");

    let public = [("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")];
    let refused = check_config(example, &public);
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("auth.connector_tokens[0]") && stderr.contains("placeholder"),
        "{stderr}"
    );

    let strong = "0123456789abcdef0123456789abcdef";
    let list = format!("[\"{strong}\"]");
    let mut replaced = public.to_vec();
    replaced.extend([
        ("CALLBACKD__AUTH__CONNECTOR_TOKENS", list.as_str()),
        ("CALLBACKD__AUTH__ADMIN_TOKENS", list.as_str()),
        ("CALLBACKD__SOURCES__PAYZU__SECRETS", list.as_str()),
    ]);
    let ok = check_config(example, &replaced);
    assert!(ok.status.success(), "with real secrets: {ok:?}");

    replaced.push(("CALLBACKD__AUTH__ADMIN_TOKENS", "[\"short-token-123\"]"));
    let short = check_config(example, &replaced);
    let stderr = String::from_utf8_lossy(&short.stderr);
    assert_eq!(short.status.code(), Some(2));
    assert!(
        stderr.contains("auth.admin_tokens[0]") && stderr.contains("15 bytes"),
        "{stderr}"
    );

    let empty = check_config(example, &[("CALLBACKD__SOURCES__PAYZU__SECRETS", "[\"\"]")]);
    let stderr = String::from_utf8_lossy(&empty.stderr);
    assert_eq!(empty.status.code(), Some(2));
    assert!(
        stderr.contains("sources.payzu.secrets[0]") && stderr.contains("empty"),
        "even on loopback: {stderr}"
    );
}

/// A token or secret of digits set in the environment (as a `.env` file or an orchestrator
/// would) is a string, not a number that then fails as a token.
#[test]
fn check_config_reads_digit_tokens_from_the_environment() {
    let example = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml"));
    let ok = check_config(
        example,
        &[
            ("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080"),
            ("CALLBACKD__AUTH__CONNECTOR_TOKENS", "1234567890123456"),
            ("CALLBACKD__AUTH__ADMIN_TOKENS", "[\"6543210987654321\"]"),
            ("CALLBACKD__SOURCES__PAYZU__SECRETS", "9081726354453627"),
        ],
    );
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{ok:?}");
    assert!(
        stdout.contains("1 connector token(s), 1 admin token(s)"),
        "{stdout}"
    );
}

#[tokio::test]
async fn healthcheck_exits_0_for_a_live_server_and_1_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let process = Process::start(&sqlite_store(&dir), "");
    let port = process.url.rsplit(':').next().unwrap().to_string();
    // As in the image: no --url, the port comes from a wildcard server.listen.
    let config = dir.path().join("health.toml");
    std::fs::write(&config, "").unwrap();
    let healthcheck = |listen: String| {
        Command::new(env!("CARGO_BIN_EXE_callbackd"))
            .args(["healthcheck", "--config", config.to_str().unwrap()])
            .env_remove("CALLBACKD_URL")
            .env("CALLBACKD__SERVER__LISTEN", listen)
            .output()
            .unwrap()
    };
    let up = healthcheck(format!("0.0.0.0:{port}"));
    assert!(up.status.success(), "{up:?}");
    drop(process);
    let down = healthcheck(format!("0.0.0.0:{port}"));
    assert_eq!(down.status.code(), Some(1), "Docker reads 1 as unhealthy");
    assert!(String::from_utf8_lossy(&down.stderr).contains("unhealthy"));
}
