//! The operator's console over plain HTTP (issue 15): each attempt keeps the receiver's
//! answer, the console's JSON endpoint, its pages' security headers, the resend dry run,
//! dead-letter alerts and the new metrics. The browser drives the same server in
//! `console_browser.rs`.

mod support;

use serde_json::Value;
use support::sink::{Answer, Reply, Sink};
use support::{TestServer, handoff, virtual_server};

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("console.db").display())
}

async fn view(server: &TestServer, id: &str) -> Value {
    let r = server.admin_get(&format!("/v1/messages/{id}")).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// A receiver that refuses with a long JSON body and `Retry-After`, then accepts with a short
/// text one: both answers are in the attempts, the long one cut at 2 KB and marked.
#[tokio::test]
async fn each_attempt_keeps_the_receivers_answer() {
    let dir = tempfile::tempdir().unwrap();
    let (server, clock, d) = virtual_server(&sqlite_url(&dir), |_| {}).await;
    let long = format!("{{\"error\":\"{}\"}}", "x".repeat(3000));
    let sink = Sink::answering({
        let long = long.clone();
        move |_, n| {
            if n == 0 {
                Answer {
                    reply: Reply {
                        retry_after: Some("7".into()),
                        ..Reply::status(503)
                    },
                    content_type: Some("application/json".into()),
                    body: long.clone().into_bytes(),
                }
            } else {
                Answer {
                    reply: Reply::status(200),
                    content_type: Some("text/plain; charset=utf-8".into()),
                    body: b"thanks".to_vec(),
                }
            }
        }
    })
    .await;
    let id = server
        .hand_off_id(&handoff(
            "p-answer",
            "approved",
            &format!("{}/cb", sink.url),
        ))
        .await;
    d.tick().await;
    let v = view(&server, &id).await;
    let first = &v["attempts"][0];
    assert_eq!(first["status"], 503);
    let answer = &first["response"];
    assert_eq!(answer["contentType"], "application/json");
    assert_eq!(answer["retryAfter"], "7");
    assert_eq!(answer["bodyTruncated"], true);
    let kept = answer["body"].as_str().unwrap();
    assert_eq!(kept.len(), 2048);
    assert_eq!(kept, &long[..2048]);

    clock.advance(7_000);
    d.tick().await;
    let v = view(&server, &id).await;
    assert_eq!(v["state"], "delivered");
    let second = &v["attempts"][1]["response"];
    assert_eq!(second["contentType"], "text/plain; charset=utf-8");
    assert_eq!(second["body"], "thanks");
    assert!(second.get("bodyTruncated").is_none());
    assert!(second.get("retryAfter").is_none());
    server.stop().await;
}
