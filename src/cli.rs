//! Parts of the `callbackd` command that are more than a call to the API: `send-test` (a
//! signed test callback, as the provider would send it) and the human table of
//! `messages list`.

use std::path::PathBuf;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use clap::Args;
use serde_json::{Value, json};

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, SignatureScheme};
use crate::webhook::{
    EVENT_HEADER, PAYZU_HEADER, decode_whsec, sign_hmac_sha256, sign_payzu,
    standard_webhook_headers,
};

#[derive(Debug, Args)]
pub struct SendTestArgs {
    /// Config file [default: $CALLBACKD_CONFIG, else ./config.toml]; the source's secret is
    /// read from it
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Source to post to (a `[sources.<name>]` table)
    #[arg(long)]
    pub source: String,
    /// `status` of the test event
    #[arg(long, default_value = "COMPLETED")]
    pub status: String,
    /// Transaction `id` of the test event [default: a new `test-...` id]
    #[arg(long)]
    pub id: Option<String>,
    /// `X-Callback-Event` header, e.g. INFRACTION_CHANGED
    #[arg(long)]
    pub event: Option<String>,
    /// Base URL of callbackd [default: http://<server.listen>]
    #[arg(long)]
    pub url: Option<String>,
}

/// The test event: a PayZu-style Pix deposit.
fn test_body(id: &str, status: &str) -> String {
    json!({"id": id, "status": status, "type": "DEPOSIT", "method": "PIX", "amount": 1.0})
        .to_string()
}

/// Signs `body` as the source's provider would, with the newest of its secrets.
fn sign(config: &Config, source: &str, body: &str, now_secs: i64) -> Result<HeaderMap, String> {
    let cfg = config.sources.get(source).ok_or_else(|| {
        let known: Vec<&str> = config.sources.keys().map(String::as_str).collect();
        format!(
            "no source `{source}` in the config (sources: {})",
            known.join(", ")
        )
    })?;
    let secret = cfg.secrets.last();
    let mut headers = HeaderMap::new();
    let mut put = |name: &str, value: String| -> Result<(), String> {
        let name = HeaderName::from_bytes(name.as_bytes()).map_err(|e| e.to_string())?;
        let value = HeaderValue::from_str(&value).map_err(|e| e.to_string())?;
        headers.insert(name, value);
        Ok(())
    };
    let missing = || format!("sources.{source}.secrets is empty");
    match cfg.signature {
        SignatureScheme::None => {}
        SignatureScheme::Payzu => {
            let secret = secret.ok_or_else(missing)?;
            put(
                PAYZU_HEADER,
                sign_payzu(secret.as_bytes(), now_secs, body.as_bytes()),
            )?;
        }
        SignatureScheme::StandardWebhooks => {
            let key = decode_whsec(secret.ok_or_else(missing)?)?;
            let id = format!("msg_test_{now_secs}_{:08x}", rand::random::<u32>());
            for (name, value) in standard_webhook_headers(&key, &id, now_secs, body.as_bytes()) {
                put(name, value)?;
            }
        }
        SignatureScheme::HmacSha256 => {
            let secret = secret.ok_or_else(missing)?;
            let header = cfg
                .signature_header
                .clone()
                .ok_or_else(|| format!("sources.{source}.signature_header is not set"))?;
            put(
                &header,
                sign_hmac_sha256(secret.as_bytes(), body.as_bytes()),
            )?;
        }
    }
    Ok(headers)
}

/// Posts a signed test callback to a running callbackd and prints its answer. Fails (exit 2)
/// when the answer is not a 2xx.
pub async fn send_test(args: SendTestArgs) -> Result<(), String> {
    let config =
        Config::load(args.config.as_deref(), std::env::vars()).map_err(|e| e.to_string())?;
    let id = args
        .id
        .unwrap_or_else(|| format!("test-{:012x}", rand::random::<u64>() >> 16));
    let body = test_body(&id, &args.status);
    let mut headers = sign(&config, &args.source, &body, SystemClock.now_secs())?;
    headers.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(event) = &args.event {
        let value = HeaderValue::from_str(event).map_err(|e| format!("--event: {e}"))?;
        headers.insert(EVENT_HEADER, value);
    }
    let base = args.url.unwrap_or_else(|| {
        let listen = config.server.listen;
        // A server listening on every interface is reached on loopback.
        let host = if listen.ip().is_unspecified() {
            format!("127.0.0.1:{}", listen.port())
        } else {
            listen.to_string()
        };
        format!("http://{host}")
    });
    let url = format!(
        "{}/v1/callbacks/{}",
        base.trim_end_matches('/'),
        args.source
    );
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        // Like the other commands: the target is named on purpose, not through a proxy.
        .no_proxy()
        .build()
        .map_err(|e| e.to_string())?;
    println!("POST {url}\n{body}");
    let response = client
        .post(&url)
        .headers(headers)
        .body(body)
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let status = response.status();
    let replayed = response
        .headers()
        .get(crate::http::REPLAYED_HEADER)
        .is_some();
    let text = response.text().await.map_err(|e| e.to_string())?;
    let answer = format!(
        "HTTP {status}{}\n{text}",
        if replayed { " (replayed)" } else { "" }
    );
    if status.is_success() {
        println!("{answer}");
        Ok(())
    } else {
        Err(answer)
    }
}

/// A page of `GET /v1/messages` as a table for a terminal: one message a line, then how to
/// get the next page.
pub fn render_table(page: &Value) -> String {
    let columns = [
        "ID", "KIND", "STATE", "SUBJECT", "EVENT", "CREATED", "ATTEMPTS",
    ];
    let empty = Vec::new();
    let rows: Vec<[String; 7]> = page["messages"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .map(|m| {
            let text = |key: &str| m[key].as_str().unwrap_or_default().to_string();
            let subject = match (m["paymentId"].as_str(), m["transactionId"].as_str()) {
                (Some(p), _) => p.to_string(),
                (None, Some(t)) => format!("{}/{t}", text("source")),
                (None, None) => String::new(),
            };
            [
                text("id"),
                text("kind"),
                text("state"),
                subject,
                text("event"),
                text("createdAt"),
                m["attemptCount"].as_u64().unwrap_or(0).to_string(),
            ]
        })
        .collect();
    let mut widths = columns.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(&columns.map(String::from));
    out.push('\n');
    for row in &rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    match page["nextCursor"].as_str() {
        Some(cursor) => out.push_str(&format!(
            "{} message(s); next page: --cursor {cursor}\n",
            rows.len()
        )),
        None => out.push_str(&format!("{} message(s); end of the list\n", rows.len())),
    }
    out
}

/// A recovery's report (`GET /v1/admin/recoveries/{id}`) for a terminal: its figures, then
/// one line per window.
pub fn render_recovery(r: &Value) -> String {
    let text = |v: &Value| match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = format!(
        "recovery {} of {}: {} to {}\n",
        text(&r["id"]),
        text(&r["source"]),
        text(&r["from"]),
        text(&r["to"])
    );
    out.push_str(&format!(
        "requested {} callback(s); arrived: {} new, {} replayed ({} until {})\n",
        text(&r["requested"]),
        text(&r["new"]),
        text(&r["replays"]),
        if r["counting"] == Value::Bool(true) {
            "counting"
        } else {
            "counted"
        },
        text(&r["countUntil"])
    ));
    let empty = Vec::new();
    for w in r["windows"].as_array().unwrap_or(&empty) {
        let outcome = match w["state"].as_str() {
            Some("sent") => format!("total {}", text(&w["total"])),
            Some("failed") => format!("FAILED: {}", text(&w["error"])),
            _ => "pending".to_string(),
        };
        out.push_str(&format!(
            "  {} .. {}  {} ({} attempt(s))\n",
            text(&w["from"]),
            text(&w["to"]),
            outcome,
            text(&w["attempts"])
        ));
    }
    out.push_str(
        "new and replayed count every callback of the source in the period, its ordinary \
         traffic included\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::Verifier;

    #[test]
    fn table_lines_up_columns_and_names_the_next_page() {
        let page = json!({"messages": [
            {"id": "msg_1", "kind": "notification", "state": "dead", "paymentId": "pay-123",
             "createdAt": "2026-11-30T12:00:00Z", "attemptCount": 3},
            {"id": "msg_2", "kind": "inbound", "state": "delivered", "source": "payzu",
             "transactionId": "tx-1", "event": "INFRACTION_CHANGED",
             "createdAt": "2026-11-30T12:00:01Z", "attemptCount": 1},
        ], "nextCursor": "abc"});
        let table = render_table(&page);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("ID     KIND          STATE      SUBJECT"));
        assert!(lines[1].contains("pay-123"));
        assert!(lines[2].contains("payzu/tx-1"));
        assert_eq!(lines[1].find("dead"), lines[2].find("delivered"));
        assert_eq!(lines[3], "2 message(s); next page: --cursor abc");
    }

    #[test]
    fn signs_as_each_scheme_verifies() {
        let text = r#"
[store]
url = "sqlite:///tmp/x.db"
[sources.payzu]
secrets = ["old", "new-secret"]
signature = "payzu"
[sources.sw]
secrets = ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]
signature = "standard-webhooks"
[sources.plain]
secrets = ["s3cret"]
signature = "hmac-sha256"
signature_header = "X-Signature"
"#;
        let config =
            Config::from_toml_str(text, std::path::Path::new("t.toml"), std::iter::empty())
                .unwrap();
        let body = test_body("tx-1", "COMPLETED");
        let now = 1_764_460_800;
        for source in ["payzu", "sw", "plain"] {
            let headers = sign(&config, source, &body, now).unwrap();
            let verifier = Verifier::from_config(&config.sources[source]).unwrap();
            verifier
                .verify(&headers, body.as_bytes(), now)
                .unwrap_or_else(|e| panic!("{source}: {e}"));
        }
        assert!(
            sign(&config, "nope", &body, now)
                .unwrap_err()
                .contains("payzu")
        );
    }
}
