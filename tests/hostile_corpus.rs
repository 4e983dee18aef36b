//! Hostile-input corpus (issue 7, item 2): every file under `tests/corpus/` is one raw
//! HTTP/1.1 request that is sent byte for byte over a plain `TcpStream` (so malformed requests
//! really reach the wire) to ONE in-process server backed by a private Redis. Every case must
//! get its documented answer, never a 5xx, never a connection dropped without a response; and
//! after the whole corpus nothing may have been stored (`DBSIZE` 0) while a valid signed
//! callback is still accepted.
//!
//! # Case file format (`tests/corpus/<name>.http`)
//!
//! ```text
//! # about: what the case is and why the expected answer is right
//! # expect: 401 invalid_signature
//! POST /v1/callbacks/payzu HTTP/1.1
//! Host: callbackd
//! Content-Length: {{LEN}}
//! X-Callback-Signature: {{SIGN}}
//! Connection: close
//!
//! {"id":"tx1","status":"PAID"}
//! ```
//!
//! Leading lines that start with `#` are directives:
//!
//! - `# about: <text>` (required): what the case checks.
//! - `# expect: <status>[|<status>...] <what>` (required), `<what>` being
//!   - an error code: the answer is `{"error": "<code>", "message": "<text>"}` (JSON);
//!   - `json`: a JSON error body with any code;
//!   - `raw`: hyper answers the protocol-level error itself (bare status, no JSON body);
//! - `# expect: closed`: the server closes the connection without an answer (only the
//!   slowloris case: hyper cuts a client that does not finish its headers in time).
//! - `# sign-at: <+-secs>`: timestamp offset used by `{{SIGN}}`, `{{SIG_HEX}}` and `{{NOW}}`.
//! - `# sign-secret: <text>`: sign with this secret instead of `support::PAYZU_SECRET`.
//! - `# sign-body: <text>`: sign these bytes instead of the body actually sent.
//! - `# body-encoding: chunked`: send the body with chunked transfer coding (8 KiB chunks);
//!   the head must say `Transfer-Encoding: chunked` itself.
//! - `# head: unterminated`: do not send the empty line that ends the header section.
//!
//! After the directives come the request line and header lines (one per line; the runner sends
//! each with CRLF and ends the head with an empty CRLF line), an empty line, then the body:
//! the rest of the file byte for byte, except the one newline that ends the file.
//!
//! Placeholders, expanded in the body first and then in the head:
//!
//! - `{{REPEAT <n> <token>}}`: `<token>` (no spaces) `n` times, so big payloads are generated
//!   rather than committed;
//! - `{{HEX <hh> <hh> ...}}`: raw bytes (CR, LF, NUL, invalid UTF-8, a BOM ...);
//! - head only: `{{LEN}}` the body length in bytes; `{{NOW}}` the (offset) unix time;
//!   `{{SIGN}}` a PayZu signature header value `t=<now>, v1=<hex>` over the body;
//!   `{{SIG_HEX}}` only its hex part; `{{HEADERS <n>}}` n filler header lines.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use callbackd::webhook::sign_payzu;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use support::redis::RedisServer;
use support::{PAYZU_SECRET, TestServer, config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const READ_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_BODY: usize = 65_536;

#[derive(Debug, Clone, PartialEq)]
enum Expect {
    /// A JSON error body; `None` accepts any code.
    Json(Option<String>),
    /// A protocol-level answer from hyper (no JSON body).
    Raw,
}

#[derive(Debug)]
enum Outcome {
    Closed,
    Statuses(Vec<u16>, Expect),
}

#[derive(Debug)]
struct Case {
    name: String,
    about: String,
    expect: Outcome,
    sign_at: i64,
    sign_secret: Option<String>,
    sign_body: Option<Vec<u8>>,
    chunked: bool,
    unterminated_head: bool,
    head: String,
    body: String,
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus")
}

fn parse_case(path: &Path) -> Case {
    let name = path.file_stem().unwrap().to_string_lossy().into_owned();
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: cannot read: {e}", path.display()));
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let mut case = Case {
        name: name.clone(),
        about: String::new(),
        expect: Outcome::Closed,
        sign_at: 0,
        sign_secret: None,
        sign_body: None,
        chunked: false,
        unterminated_head: false,
        head: String::new(),
        body: String::new(),
    };
    let mut saw_expect = false;
    let mut rest = text;
    while rest.starts_with('#') {
        let (line, tail) = rest.split_once('\n').unwrap_or((rest, ""));
        rest = tail;
        let (key, value) = line[1..]
            .split_once(':')
            .unwrap_or_else(|| panic!("{name}: bad directive {line:?}"));
        let value = value.trim();
        match key.trim() {
            "about" => case.about = value.to_string(),
            "expect" => {
                saw_expect = true;
                case.expect = parse_expect(&name, value);
            }
            "sign-at" => case.sign_at = value.parse().expect("sign-at is an integer"),
            "sign-secret" => case.sign_secret = Some(value.to_string()),
            "sign-body" => case.sign_body = Some(value.as_bytes().to_vec()),
            "body-encoding" => {
                assert_eq!(value, "chunked", "{name}: unknown body-encoding");
                case.chunked = true;
            }
            "head" => {
                assert_eq!(value, "unterminated", "{name}: unknown head directive");
                case.unterminated_head = true;
            }
            other => panic!("{name}: unknown directive {other:?}"),
        }
    }
    assert!(saw_expect, "{name}: no `# expect:` directive");
    assert!(!case.about.is_empty(), "{name}: no `# about:` directive");
    match rest.split_once("\n\n") {
        Some((head, body)) => {
            case.head = head.to_string();
            case.body = body.to_string();
        }
        None => case.head = rest.to_string(),
    }
    case
}

fn parse_expect(name: &str, value: &str) -> Outcome {
    if value == "closed" {
        return Outcome::Closed;
    }
    let (statuses, what) = value
        .split_once(' ')
        .unwrap_or_else(|| panic!("{name}: `# expect: <status> <what>`"));
    let statuses = statuses
        .split('|')
        .map(|s| s.parse().unwrap_or_else(|_| panic!("{name}: bad status")))
        .collect();
    let what = match what.trim() {
        "raw" => Expect::Raw,
        "json" => Expect::Json(None),
        code => Expect::Json(Some(code.to_string())),
    };
    Outcome::Statuses(statuses, what)
}

/// Expands `{{...}}` placeholders; `head_vars` is only given for the head.
fn expand(name: &str, text: &str, head_vars: Option<&HeadVars>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        out.extend_from_slice(&rest.as_bytes()[..start]);
        let end = rest[start..]
            .find("}}")
            .unwrap_or_else(|| panic!("{name}: unclosed placeholder"))
            + start;
        let inner = &rest[start + 2..end];
        let mut words = inner.split(' ');
        let word = words.next().unwrap_or_default();
        match (word, head_vars) {
            ("REPEAT", _) => {
                let n: usize = words.next().and_then(|n| n.parse().ok()).expect("REPEAT n");
                let token = words.next().expect("REPEAT token");
                out.extend_from_slice(token.repeat(n).as_bytes());
            }
            ("HEX", _) => {
                for byte in words {
                    out.push(u8::from_str_radix(byte, 16).expect("HEX bytes"));
                }
            }
            ("LEN", Some(v)) => out.extend_from_slice(v.len.to_string().as_bytes()),
            ("NOW", Some(v)) => out.extend_from_slice(v.now.to_string().as_bytes()),
            ("SIGN", Some(v)) => out.extend_from_slice(v.sign.as_bytes()),
            ("SIG_HEX", Some(v)) => out.extend_from_slice(v.sig_hex.as_bytes()),
            ("HEADERS", Some(_)) => {
                let n: usize = words
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("HEADERS n");
                let lines: Vec<String> = (0..n).map(|i| format!("X-Filler-{i}: {i}")).collect();
                out.extend_from_slice(lines.join("\r\n").as_bytes());
            }
            _ => panic!("{name}: unknown placeholder {{{{{inner}}}}}"),
        }
        rest = &rest[end + 2..];
    }
    out.extend_from_slice(rest.as_bytes());
    out
}

struct HeadVars {
    len: usize,
    now: i64,
    sign: String,
    sig_hex: String,
}

/// The request bytes of a case, signed at `now`.
fn build_request(case: &Case, now: i64) -> Vec<u8> {
    let body = expand(&case.name, &case.body, None);
    let t = now + case.sign_at;
    let secret = case.sign_secret.as_deref().unwrap_or(PAYZU_SECRET);
    let signed = case.sign_body.as_deref().unwrap_or(&body);
    let sign = sign_payzu(secret.as_bytes(), t, signed);
    let sig_hex = {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(format!("{t}.").as_bytes());
        mac.update(signed);
        hex::encode(mac.finalize().into_bytes())
    };
    assert!(sign.ends_with(&sig_hex));
    let vars = HeadVars {
        len: body.len(),
        now: t,
        sign,
        sig_hex,
    };
    let head = case.head.replace('\n', "\r\n");
    let mut request = expand(&case.name, &head, Some(&vars));
    request.extend_from_slice(b"\r\n");
    if case.unterminated_head {
        return request;
    }
    request.extend_from_slice(b"\r\n");
    if case.chunked {
        for chunk in body.chunks(8192) {
            request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            request.extend_from_slice(chunk);
            request.extend_from_slice(b"\r\n");
        }
        request.extend_from_slice(b"0\r\n\r\n");
    } else {
        request.extend_from_slice(&body);
    }
    request
}

#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug)]
enum Received {
    Response(Response),
    /// EOF with no (complete) response; `partial` is whatever arrived.
    Closed {
        partial: Vec<u8>,
    },
    Reset {
        error: String,
        partial: Vec<u8>,
    },
    Timeout,
}

/// Parses the first final (non-1xx) response in `buf`, if it is complete. At EOF, a response
/// without a Content-Length ends with the connection.
fn parse_response(buf: &[u8], eof: bool) -> Option<Response> {
    let mut offset = 0;
    loop {
        let rest = &buf[offset..];
        let head_end = rest.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&rest[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status_line = lines.next()?;
        let status: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
            .collect();
        let body_start = head_end + 4;
        if (100..200).contains(&status) {
            offset += body_start;
            continue;
        }
        let length = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse::<usize>().ok());
        let body = match length {
            Some(len) if rest.len() >= body_start + len => {
                rest[body_start..body_start + len].to_vec()
            }
            Some(_) => return None,
            None if eof => rest[body_start..].to_vec(),
            None => return None,
        };
        return Some(Response {
            status,
            headers,
            body,
        });
    }
}

/// Sends `request` while reading the answer, so an early answer (a 413 before the body is
/// read) is seen even when the server stops reading. The write half stays open until the
/// answer is in: a body shorter than its Content-Length must time out on the server.
async fn exchange(addr: &str, request: &[u8]) -> Received {
    let mut stream = TcpStream::connect(addr).await.expect("connect to server");
    let (mut reader, mut writer) = stream.split();
    let write = async {
        let _ = writer.write_all(request).await;
        let _ = writer.flush().await;
        std::future::pending::<()>().await
    };
    let read = async {
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            match reader.read(&mut chunk).await {
                Ok(0) => {
                    return match parse_response(&buf, true) {
                        Some(r) => Received::Response(r),
                        None => Received::Closed { partial: buf },
                    };
                }
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(r) = parse_response(&buf, false) {
                        return Received::Response(r);
                    }
                }
                Err(e) => {
                    return match parse_response(&buf, true) {
                        Some(r) => Received::Response(r),
                        None => Received::Reset {
                            error: e.to_string(),
                            partial: buf,
                        },
                    };
                }
            }
        }
    };
    let timed = async {
        tokio::select! {
            received = read => received,
            _ = write => unreachable!("the write future never ends"),
        }
    };
    match tokio::time::timeout(READ_TIMEOUT, timed).await {
        Ok(received) => received,
        Err(_) => Received::Timeout,
    }
}

/// Checks one answer against its case; returns the problems found.
fn check(case: &Case, received: &Received, elapsed: Duration) -> Vec<String> {
    let mut problems = Vec::new();
    let shown = |bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes);
        text.chars().take(300).collect::<String>()
    };
    match (&case.expect, received) {
        (Outcome::Closed, Received::Closed { partial } | Received::Reset { partial, .. })
            if partial.is_empty() => {}
        (Outcome::Closed, other) => {
            problems.push(format!("expected a close without answer, got {other:?}"))
        }
        (Outcome::Statuses(statuses, expect), Received::Response(r)) => {
            if r.status >= 500 {
                problems.push(format!("5xx answer {}: {}", r.status, shown(&r.body)));
            }
            if !statuses.contains(&r.status) {
                problems.push(format!(
                    "status {} (expected {statuses:?}), body {:?}",
                    r.status,
                    shown(&r.body)
                ));
            }
            if let Expect::Json(code) = expect {
                let content_type = r.header("content-type").unwrap_or("");
                if !content_type.starts_with("application/json") {
                    problems.push(format!(
                        "content-type {content_type:?}, expected application/json; body {:?}",
                        shown(&r.body)
                    ));
                }
                match serde_json::from_slice::<serde_json::Value>(&r.body) {
                    Ok(v) => {
                        let error = v.get("error").and_then(|e| e.as_str());
                        let message_ok = v.get("message").is_some_and(|m| m.is_string());
                        if error.is_none() || !message_ok {
                            problems.push(format!("not an error body: {v}"));
                        }
                        if let (Some(want), Some(got)) = (code, error)
                            && want != got
                        {
                            problems.push(format!("error code {got:?}, expected {want:?}: {v}"));
                        }
                    }
                    Err(_) => problems.push(format!("body is not JSON: {:?}", shown(&r.body))),
                }
            }
        }
        (Outcome::Statuses(..), Received::Closed { partial }) => problems.push(format!(
            "connection closed without an answer after {elapsed:?}; got {:?}",
            shown(partial)
        )),
        (Outcome::Statuses(..), Received::Reset { error, partial }) => problems.push(format!(
            "connection reset without an answer ({error}) after {elapsed:?}; got {:?}",
            shown(partial)
        )),
        (Outcome::Statuses(..), Received::Timeout) => {
            problems.push(format!("no answer within {READ_TIMEOUT:?}"))
        }
    }
    problems
}

#[tokio::test]
async fn hostile_corpus_gets_documented_answers_and_stores_nothing() {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("tests/corpus exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "http"))
        .collect();
    paths.sort();
    let cases: Vec<Case> = paths.iter().map(|p| parse_case(p)).collect();
    // README.md and RELIABILITY.md state the size of the corpus: keep them in step.
    const DOCUMENTED_CASES: usize = 145;
    assert_eq!(
        cases.len(),
        DOCUMENTED_CASES,
        "the corpus has {} cases but the docs claim {DOCUMENTED_CASES}: update README.md, \
         RELIABILITY.md and this constant together",
        cases.len()
    );

    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.max_body_bytes = MAX_BODY;
    cfg.server.request_timeout_secs = 1;
    cfg.server.header_timeout_secs = 1;
    // The SSRF guard is on (the default in production), so private callbackUrls are refused;
    // this server has no forward_url, so nothing ever needs to reach 127.0.0.1.
    cfg.dispatch.allow_private_networks = false;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();
    // The keys a fresh store has: its layout version and its partition count.
    assert_eq!(
        redis.cli(&["dbsize"]),
        "2",
        "Redis holds only cb:schema and cb:partitions before the corpus"
    );

    let mut failures = Vec::new();
    let mut failed_cases = Vec::new();
    for case in &cases {
        let request = build_request(case, server.app.clock.now_secs());
        let started = Instant::now();
        let received = exchange(&addr, &request).await;
        let elapsed = started.elapsed();
        let problems = check(case, &received, elapsed);
        let status = match &received {
            Received::Response(r) => format!(
                "{} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
                    .chars()
                    .take(100)
                    .collect::<String>()
            ),
            Received::Closed { .. } => "closed".into(),
            Received::Reset { .. } => "reset".into(),
            Received::Timeout => "timeout".into(),
        };
        eprintln!(
            "{:<4} {:>6} ms  {}  ({})",
            if problems.is_empty() { "ok" } else { "FAIL" },
            elapsed.as_millis(),
            case.name,
            status
        );
        if !problems.is_empty() {
            failed_cases.push(case.name.as_str());
            failures.push(format!(
                "{} ({}):\n    {}",
                case.name,
                case.about,
                problems.join("\n    ")
            ));
        }
    }

    let dbsize = redis.cli(&["dbsize"]);
    if dbsize != "2" {
        let keys = redis.cli(&["--scan"]);
        failures.push(format!(
            "DBSIZE is {dbsize} after the corpus: something was stored:\n{keys}"
        ));
    }

    // The server survived: a valid signed callback is still accepted and stored.
    let ok = server
        .post_callback("payzu", r#"{"id":"tx-after","status":"PAID"}"#, None)
        .await;
    let status = ok.status();
    let text = ok.text().await.unwrap_or_default();
    if status != 200 {
        failures.push(format!("valid callback after the corpus: {status} {text}"));
    }
    if redis.cli(&["dbsize"]) == "2" {
        failures.push(
            "the valid callback stored nothing: is DBSIZE looking at the right Redis?".into(),
        );
    }

    assert!(
        failures.is_empty(),
        "{} of {} cases failed ({}); all problems:\n{}",
        failed_cases.len(),
        cases.len(),
        failed_cases.join(", "),
        failures.join("\n")
    );
}
