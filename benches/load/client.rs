//! A minimal HTTP/1.1 keep-alive client over raw sockets, and the requests the bench sends,
//! formatted before they are timed so the generator takes little CPU from the server.

use std::io;
use std::net::SocketAddr;

use callbackd::clock::{Clock, SystemClock};
use callbackd::webhook::sign_payzu;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::{CONNECTOR_TOKEN, REQUEST_TIMEOUT, SECRET};

pub struct Resp {
    pub status: u16,
    pub replayed: bool,
    pub body: Vec<u8>,
}

pub struct Conn {
    addr: SocketAddr,
    stream: Option<TcpStream>,
    buf: Vec<u8>,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        Conn {
            addr,
            stream: None,
            buf: Vec::with_capacity(4096),
        }
    }

    pub async fn send(&mut self, request: &[u8]) -> io::Result<Resp> {
        match tokio::time::timeout(REQUEST_TIMEOUT, self.exchange(request)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                self.stream = None;
                Err(e)
            }
            Err(_) => {
                self.stream = None;
                Err(io::Error::new(io::ErrorKind::TimedOut, "request timed out"))
            }
        }
    }

    async fn exchange(&mut self, request: &[u8]) -> io::Result<Resp> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).await?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
            self.buf.clear();
        }
        let Conn { stream, buf, .. } = self;
        let s = stream.as_mut().expect("connected above");
        s.write_all(request).await?;
        loop {
            if let Some((resp, used, close)) = parse_response(buf)? {
                buf.drain(..used);
                if close {
                    *stream = None;
                }
                return Ok(resp);
            }
            if s.read_buf(buf).await? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_response(buf: &[u8]) -> io::Result<Option<(Resp, usize, bool)>> {
    let Some(head_end) = find(buf, b"\r\n\r\n") else {
        return Ok(None);
    };
    let bad = |m: &str| io::Error::new(io::ErrorKind::InvalidData, m.to_string());
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("non-UTF-8 head"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let (mut length, mut replayed, mut close) = (0usize, false, false);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = value.parse().map_err(|_| bad("bad content-length"))?;
        } else if name.eq_ignore_ascii_case("idempotent-replayed") {
            replayed = value == "true";
        } else if name.eq_ignore_ascii_case("connection") {
            close = value.eq_ignore_ascii_case("close");
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(bad(
                "chunked responses are not supported by the bench client",
            ));
        }
    }
    let total = head_end + 4 + length;
    if buf.len() < total {
        return Ok(None);
    }
    let resp = Resp {
        status,
        replayed,
        body: buf[head_end + 4..total].to_vec(),
    };
    Ok(Some((resp, total, close)))
}

pub fn get_request(host: &str, path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n").into_bytes()
}

/// A realistic PayZu `callbackUrl` notification (~330 bytes).
pub fn payzu_body(tx: &str) -> String {
    format!(
        r#"{{"id":"{tx}","status":"COMPLETED","type":"PIX","amount":15990,"currency":"BRL","endToEndId":"E18236120202611301200s0a1b2c3d4e","txid":"{tx}","payer":{{"name":"Bench Payer","taxId":"***.456.789-**","bank":"18236120"}},"createdAt":"2026-11-30T12:00:00.000Z","updatedAt":"2026-11-30T12:00:03.125Z"}}"#
    )
}

pub fn callback_request(host: &str, body: &str) -> Vec<u8> {
    let signature = sign_payzu(SECRET.as_bytes(), SystemClock.now_secs(), body.as_bytes());
    format!(
        "POST /v1/callbacks/payzu HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\nx-callback-signature: {signature}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The JSON a connector hands off for one payment.
pub fn notification_body(payment_id: &str, callback_url: &str) -> String {
    format!(r#"{{"paymentId":"{payment_id}","status":"approved","callbackUrl":"{callback_url}"}}"#)
}

pub fn notification_request(host: &str, payment_id: &str, callback_url: &str) -> Vec<u8> {
    let body = notification_body(payment_id, callback_url);
    format!(
        "POST /v1/notifications HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {CONNECTOR_TOKEN}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

pub fn json_field(body: &[u8], field: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let start = text.find(&format!("\"{field}\":\""))? + field.len() + 4;
    let end = text[start..].find('"')? + start;
    Some(text[start..end].to_string())
}
