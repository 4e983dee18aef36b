//! Connection-level limits of the HTTP server over real TCP (issue 10, item 8): an HTTP/2
//! connection is closed when idle whatever PINGs say, streams per connection are capped, and
//! request bodies buffered at once are bounded across all connections.

mod support;

use std::time::Duration;

use axum::body::Bytes;
use http_body_util::Empty;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use support::redis::RedisServer;
use support::{TestServer, config, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A guard against a hang, far above every limit these tests configure: not a timing check.
const HANG_GUARD: Duration = Duration::from_secs(60);

#[tokio::test]
async fn http2_connection_that_only_pings_is_closed_when_idle() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    // Idle limit = header + request timeout = 4 s. Not 1 s each: the one request must be
    // answered within the request timeout, which a busy 2-core machine can miss.
    cfg.server.header_timeout_secs = 2;
    cfg.server.request_timeout_secs = 2;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();

    let tcp = TcpStream::connect(&addr).await.unwrap();
    // The client PINGs every 100 ms and answers the server's PINGs: frames cross the
    // connection far more often than the idle limit, but no request does.
    let (mut send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .handshake::<_, Empty<Bytes>>(TokioIo::new(tcp))
        .await
        .expect("h2c handshake");
    let connection = tokio::spawn(connection);

    // One request proves the connection is served, over HTTP/2.
    let request = hyper::Request::get(format!("{}/healthz", server.url))
        .body(Empty::new())
        .unwrap();
    let response = send.send_request(request).await.expect("h2 request");
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), hyper::Version::HTTP_2);
    drop(response);

    let ended = tokio::time::timeout(HANG_GUARD, connection).await;
    let result = ended.expect("the server closed the PING-only connection");
    // A graceful GOAWAY ends the client's connection cleanly; its own keep-alive giving up
    // (the server not answering PINGs) would be an error instead.
    result
        .expect("connection task")
        .expect("closed by the server's GOAWAY, not by a failed PING");
    assert!(send.is_closed(), "no new request can be sent on it");
}

// ---------------------------------------------------------------------------------------
// Raw HTTP/2 frames: a hostile client ignores SETTINGS_MAX_CONCURRENT_STREAMS, which any
// real client library would honour for us.

const SETTINGS: u8 = 0x4;
const HEADERS: u8 = 0x1;
const DATA: u8 = 0x0;
const RST_STREAM: u8 = 0x3;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

async fn write_frame(tcp: &mut TcpStream, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    let mut frame = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    tcp.write_all(&frame).await.unwrap();
}

async fn read_frame(tcp: &mut TcpStream) -> Frame {
    let mut head = [0u8; 9];
    tokio::time::timeout(HANG_GUARD, tcp.read_exact(&mut head))
        .await
        .expect("a frame within the hang guard")
        .expect("the server keeps the connection open");
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let mut payload = vec![0u8; len];
    tcp.read_exact(&mut payload).await.unwrap();
    Frame {
        kind: head[3],
        flags: head[4],
        stream: u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff,
        payload,
    }
}

/// An HPACK block with literal (never Huffman) values: `:method`, `:scheme http`, `:path`,
/// `:authority`.
fn request_headers(method: &str, path: &str) -> Vec<u8> {
    let method = match method {
        "GET" => 0x82,
        _ => 0x83,
    };
    let mut block = vec![method, 0x86];
    for (name_index, value) in [(0x04u8, path), (0x01, "callbackd")] {
        assert!(value.len() < 127);
        block.push(name_index);
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}

#[tokio::test]
async fn http2_streams_per_connection_are_capped() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    // Held streams wait for their bodies; nothing here may time out while the test runs.
    cfg.server.request_timeout_secs = 60;
    let cap = cfg.server.max_streams_per_connection;
    assert_eq!(cap, 32, "the documented default");
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();

    let mut tcp = TcpStream::connect(&addr).await.unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    write_frame(&mut tcp, SETTINGS, 0, 0, &[]).await;
    // The server announces its cap in its first SETTINGS.
    let settings = loop {
        let f = read_frame(&mut tcp).await;
        if f.kind == SETTINGS && f.flags & ACK == 0 {
            break f.payload;
        }
    };
    let announced = settings
        .chunks(6)
        .find(|s| u16::from_be_bytes([s[0], s[1]]) == SETTINGS_MAX_CONCURRENT_STREAMS)
        .map(|s| u32::from_be_bytes([s[2], s[3], s[4], s[5]]));
    assert_eq!(announced, Some(cap), "SETTINGS_MAX_CONCURRENT_STREAMS");
    write_frame(&mut tcp, SETTINGS, ACK, 0, &[]).await;

    // `cap` requests whose bodies have not ended hold every stream; one more is opened anyway.
    let held: Vec<u32> = (0..cap).map(|i| 1 + 2 * i).collect();
    let extra = 1 + 2 * cap;
    for &stream in held.iter().chain([&extra]) {
        let block = request_headers("POST", "/v1/callbacks/open");
        write_frame(&mut tcp, HEADERS, END_HEADERS, stream, &block).await;
    }
    loop {
        let f = read_frame(&mut tcp).await;
        assert_ne!(f.kind, GOAWAY, "the connection is not torn down");
        if f.kind == RST_STREAM {
            assert_eq!(f.stream, extra, "only the stream over the cap is refused");
            let code = u32::from_be_bytes(f.payload[..4].try_into().unwrap());
            assert_eq!(code, REFUSED_STREAM);
            break;
        }
    }

    // The held streams are being served: the first one finishes its body and is answered.
    let body = br#"{"id":"h2-stream-1","status":"PAID"}"#;
    write_frame(&mut tcp, DATA, END_STREAM, held[0], body).await;
    loop {
        let f = read_frame(&mut tcp).await;
        assert!(f.kind != RST_STREAM && f.kind != GOAWAY, "frame {}", f.kind);
        if f.stream == held[0] && f.flags & END_STREAM != 0 {
            break;
        }
    }
    // That freed a slot: a new stream is served, not refused.
    let next = extra + 2;
    let block = request_headers("GET", "/healthz");
    write_frame(&mut tcp, HEADERS, END_HEADERS | END_STREAM, next, &block).await;
    loop {
        let f = read_frame(&mut tcp).await;
        assert!(f.kind != RST_STREAM && f.kind != GOAWAY, "frame {}", f.kind);
        if f.stream == next && f.kind == HEADERS {
            // `:status 200` is static table entry 8.
            assert_eq!(f.payload.first(), Some(&0x88), "answered 200");
            break;
        }
    }
}

/// A valid `open`-source callback of exactly `len` bytes.
fn callback_of_len(id: &str, len: usize) -> String {
    let head = format!(r#"{{"id":"{id}","status":"PAID","pad":""#);
    let pad = len - head.len() - 2;
    format!(r#"{head}{}"}}"#, "x".repeat(pad))
}

#[tokio::test]
async fn buffered_request_bodies_share_one_budget() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.max_body_bytes = 1000;
    cfg.server.max_buffered_bytes = 1500;
    // The held body must outlive the test's other requests.
    cfg.server.request_timeout_secs = 60;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();
    let budget = server.app.body_budget.clone();

    // A declares 1000 bytes and sends only the first 10: its whole declared size is held.
    let held = callback_of_len("held", 1000);
    let mut a = TcpStream::connect(&addr).await.unwrap();
    a.write_all(
        format!(
            "POST /v1/callbacks/open HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{}",
            held.len(),
            &held[..10]
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    eventually(10, "A's declared body is reserved", || async {
        (budget.available_permits() == 500).then_some(())
    })
    .await;
    let metrics = server
        .client
        .get(format!("{}/metrics", server.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("callbackd_http_buffered_bytes 1000"),
        "the gauge shows the held bytes"
    );

    // B needs 600 of the 500 left: told to come back, and nothing is recorded.
    let keys_before = redis.cli(&["dbsize"]);
    let b = callback_of_len("second", 600);
    let post_b = || {
        server
            .client
            .post(format!("{}/v1/callbacks/open", server.url))
            .header("content-type", "application/json")
            .body(b.clone())
            .send()
    };
    let refused = post_b().await.unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(
        refused.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let error: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(error["error"], "server_busy", "{error}");
    assert_eq!(budget.available_permits(), 500, "B gave back what it took");
    assert_eq!(redis.cli(&["dbsize"]), keys_before, "nothing recorded");

    // A finishes and is accepted; its share goes back, and B then fits.
    a.write_all(&held.as_bytes()[10..]).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(HANG_GUARD, a.read_to_end(&mut answer))
        .await
        .expect("A is answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    eventually(10, "A's share is given back", || async {
        (budget.available_permits() == 1500).then_some(())
    })
    .await;
    let accepted = post_b().await.unwrap();
    assert_eq!(accepted.status(), 200);
    assert_eq!(budget.available_permits(), 1500);
}

#[tokio::test]
async fn http1_keep_alive_connection_is_closed_when_idle_after_a_request() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    // 2 s each, not 1: the first request must be read and answered within them on a busy
    // machine too.
    cfg.server.header_timeout_secs = 2;
    cfg.server.request_timeout_secs = 2;
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut tcp = TcpStream::connect(&addr).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // The next request's headers never come: the connection is closed (by hyper's header
    // timer, which runs between keep-alive requests too, or at the latest by the idle limit).
    let mut answer = Vec::new();
    tokio::time::timeout(HANG_GUARD, tcp.read_to_end(&mut answer))
        .await
        .expect("the idle keep-alive connection is closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Issue 22, item 7: a connection that never sends a byte is closed once the header timeout
/// has passed since its accept, not after the idle limit (header + request timeout).
#[tokio::test]
async fn a_connection_that_never_sends_a_byte_is_closed_at_the_header_timeout() {
    let redis = RedisServer::start();
    let mut cfg = config(&redis.url(), None);
    cfg.server.header_timeout_secs = 1;
    // An idle limit far beyond the header timeout, so closing at the idle limit fails.
    cfg.server.request_timeout_secs = 60;
    let header_timeout = Duration::from_secs(cfg.server.header_timeout_secs);
    let server = TestServer::start(cfg).await;
    let addr = server.url.trim_start_matches("http://").to_string();

    let started = tokio::time::Instant::now();
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(3 * header_timeout, silent.read_to_end(&mut buf)).await;
    let held = started.elapsed();
    assert!(
        closed.is_ok(),
        "a silent connection is still open {held:?} after its accept (header timeout {header_timeout:?})"
    );
    assert!(
        buf.is_empty(),
        "nothing is answered to a request never sent"
    );
    assert!(
        held >= header_timeout,
        "closed only once its time was up: {held:?}"
    );

    // A client that sends its request in time on a fresh connection is still served.
    let mut prompt = TcpStream::connect(&addr).await.unwrap();
    prompt
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(HANG_GUARD, prompt.read_to_end(&mut answer))
        .await
        .expect("answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// Issue 22, item 11: every API answer, errors and the unrouted ones included, tells the
/// browser not to sniff its type.
#[tokio::test]
async fn every_api_answer_says_nosniff() {
    let redis = RedisServer::start();
    let server = TestServer::start(config(&redis.url(), None)).await;
    let client = &server.client;
    let url = |path: &str| format!("{}{path}", server.url);
    let answers = [
        (
            "/healthz",
            client.get(url("/healthz")).send().await.unwrap(),
        ),
        ("/readyz", client.get(url("/readyz")).send().await.unwrap()),
        (
            "/metrics",
            client.get(url("/metrics")).send().await.unwrap(),
        ),
        (
            "/openapi.json",
            client.get(url("/openapi.json")).send().await.unwrap(),
        ),
        ("/", client.get(url("/")).send().await.unwrap()),
        ("a list", server.admin_get("/v1/messages").await),
        (
            "unknown id",
            server.admin_get("/v1/messages/msg_nope").await,
        ),
        (
            "no token",
            client.get(url("/v1/messages")).send().await.unwrap(),
        ),
        (
            "unknown route",
            client.get(url("/no/such/route")).send().await.unwrap(),
        ),
        (
            "wrong method",
            client.delete(url("/v1/messages")).send().await.unwrap(),
        ),
        (
            "bad callback",
            client
                .post(url("/v1/callbacks/open"))
                .body("not json")
                .send()
                .await
                .unwrap(),
        ),
    ];
    let mut statuses = Vec::new();
    for (what, answer) in answers {
        statuses.push(answer.status().as_u16());
        assert_eq!(
            answer
                .headers()
                .get("x-content-type-options")
                .and_then(|v| v.to_str().ok()),
            Some("nosniff"),
            "{what} ({})",
            answer.status()
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 200, 404, 401, 404, 405, 400]
    );
}
