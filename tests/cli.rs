//! `callbackd send-test` and `callbackd messages list` as a user runs them (issue 15): the
//! real binary against a server on 127.0.0.1.

mod support;

use std::process::{Command, Output};

use serde_json::Value;
use support::{ADMIN_TOKEN, TestServer, config};

fn callbackd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(args)
        .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
        .env_remove("CALLBACKD_CONFIG")
        .output()
        .expect("run callbackd")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The repository's example config signs what a server with the same secret accepts; the
/// same event again is a replay; a wrong secret is refused with exit code 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_test_signs_with_the_example_configs_secret() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("cli.db").display());
    let mut cfg = config(&store, None);
    cfg.sources.get_mut("payzu").unwrap().secrets = vec!["change-me-payzu-secret".into()];
    let server = TestServer::start(cfg).await;
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config.toml");
    let args = [
        "send-test",
        "--config",
        example,
        "--source",
        "payzu",
        "--url",
        &server.url,
        "--id",
        "tx-cli-1",
        "--status",
        "COMPLETED",
        "--event",
        "PAYMENT_UPDATED",
    ];
    let first = callbackd(&args);
    assert!(first.status.success(), "{first:?}");
    let out = stdout(&first);
    assert!(out.contains("HTTP 200 OK\n"), "{out}");
    assert!(out.contains("\"messageId\":\"msg_"), "{out}");
    let again = callbackd(&args);
    assert!(again.status.success());
    assert!(stdout(&again).contains("HTTP 200 OK (replayed)"));

    let page: Value = server
        .admin_get("/v1/messages?source=payzu&transactionId=tx-cli-1")
        .await
        .json()
        .await
        .unwrap();
    let messages = page["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0]["event"], "PAYMENT_UPDATED");
    assert_eq!(messages[0]["body"]["status"], "COMPLETED");

    let wrong = dir.path().join("wrong.toml");
    std::fs::write(
        &wrong,
        format!(
            "[store]\nurl = \"{store}\"\n[sources.payzu]\nsecrets = [\"not-the-secret\"]\nsignature = \"payzu\"\n"
        ),
    )
    .unwrap();
    let refused = callbackd(&[
        "send-test",
        "--config",
        wrong.to_str().unwrap(),
        "--source",
        "payzu",
        "--url",
        &server.url,
    ]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("HTTP 401"));
    let unknown = callbackd(&[
        "send-test",
        "--config",
        example,
        "--source",
        "nope",
        "--url",
        &server.url,
    ]);
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no source `nope`"));
    server.stop().await;
}

/// `messages list` prints JSON when asked or when piped, and a table on a terminal (run under
/// `script`, which gives it one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_list_is_a_table_on_a_terminal_and_json_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("sqlite://{}", dir.path().join("cli.db").display());
    let server = TestServer::start(config(&store, None)).await;
    let body =
        r#"{"id":"tx-table","status":"COMPLETED","type":"DEPOSIT","method":"PIX","amount":5}"#;
    assert_eq!(
        server.post_callback("payzu", body, None).await.status(),
        200
    );

    for args in [
        vec!["messages", "list", "--url", &server.url, "--json"],
        vec!["messages", "list", "--url", &server.url],
    ] {
        let out = callbackd(&args);
        assert!(out.status.success(), "{out:?}");
        let page: Value = serde_json::from_slice(&out.stdout).expect("JSON when not a terminal");
        assert_eq!(page["messages"][0]["transactionId"], "tx-table");
    }

    let command = format!(
        "{} messages list --url {}",
        env!("CARGO_BIN_EXE_callbackd"),
        server.url
    );
    let tty = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env("CALLBACKD_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("script (util-linux) gives the command a terminal");
    assert!(tty.status.success(), "{tty:?}");
    let table = stdout(&tty).replace('\r', "");
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("ID "), "{table}");
    assert!(lines[0].contains("STATE"), "{table}");
    assert!(lines[1].contains("payzu/tx-table"), "{table}");
    assert!(lines[1].contains("recorded"), "{table}");
    assert_eq!(lines[2], "1 message(s); end of the list");
    server.stop().await;
}

/// `check-config` refuses an alert URL on an internal literal, naming `alerts.webhook_url`
/// (every delivery to it would be refused and the operator never alerted), and accepts it
/// with `alerts.allow_private_webhook_url = true`.
#[test]
fn check_config_refuses_an_internal_alert_url_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, extra: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[store]\nurl = \"sqlite://{}\"\n[alerts]\n\
                 webhook_url = \"http://169.254.169.254/latest/hooks\"\n\
                 secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n{extra}",
                dir.path().join("a.db").display()
            ),
        )
        .unwrap();
        path
    };
    let refused = callbackd(&[
        "check-config",
        "--config",
        write("refused.toml", "").to_str().unwrap(),
    ]);
    assert!(!refused.status.success(), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("alerts.webhook_url"), "{stderr}");
    assert!(
        stderr.contains("alerts.allow_private_webhook_url"),
        "{stderr}"
    );

    let allowed = callbackd(&[
        "check-config",
        "--config",
        write("allowed.toml", "allow_private_webhook_url = true\n")
            .to_str()
            .unwrap(),
    ]);
    assert!(allowed.status.success(), "{allowed:?}");
}

/// `check-config` names a PostgreSQL URL the driver cannot read by its key, and shows it with
/// the password hidden, both the user info's and a `password` parameter's.
#[test]
fn check_config_names_a_bad_postgres_url_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pg.toml");
    std::fs::write(
        &path,
        "[store]\nurl = \"postgres://cb:pg-s3cret@db.example:5432/cb\
         ?sslmode=sometimes&password=pg-again\"\n",
    )
    .unwrap();
    let refused = callbackd(&["check-config", "--config", path.to_str().unwrap()]);
    assert!(!refused.status.success(), "{refused:?}");
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(output.contains("store.url"), "{output}");
    assert!(output.contains("cb:***@db.example"), "{output}");
    for secret in ["pg-s3cret", "pg-again"] {
        assert!(!output.contains(secret), "{secret} shown: {output}");
    }
}

/// `check-config` names the sources a recovery can reach and their provider API's URL, and
/// never prints the token, neither on success nor when the token is refused.
#[test]
fn check_config_shows_the_provider_api_but_never_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, token: &str| {
        let path = dir.path().join(name);
        std::fs::write(
            &path,
            format!(
                "[store]\nurl = \"sqlite://{}\"\n[sources.payzu]\nsignature = \"payzu\"\n\
                 secrets = [\"payzu-secret-1\"]\n\
                 provider_api_url = \"https://api.payzu.example\"\n\
                 provider_api_token = \"{token}\"\n",
                dir.path().join("a.db").display()
            ),
        )
        .unwrap();
        path
    };
    let token = "tok-s3cret-0123456789abcdef";
    let ok = callbackd(&[
        "check-config",
        "--config",
        write("ok.toml", token).to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{ok:?}");
    assert!(
        stdout.contains("source payzu reaches its provider's API at https://api.payzu.example"),
        "{stdout}"
    );
    assert!(!stdout.contains(token), "{stdout}");

    let short = "s3cr";
    let refused = callbackd(&[
        "check-config",
        "--config",
        write("short.toml", short).to_str().unwrap(),
    ]);
    assert!(!refused.status.success(), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("sources.payzu.provider_api_token"),
        "{stderr}"
    );
    assert!(!stderr.contains(short), "{stderr}");
}
