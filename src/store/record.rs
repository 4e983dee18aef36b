//! A message's record and its first history row, each kept compact: JSON compressed with
//! zstd against a fixed dictionary when that makes it smaller.
//!
//! The record is the [`NewMessage`] as JSON. Redis keeps it in its hash (`redis/record.rs`),
//! PostgreSQL in the `record` column of `messages`; SQLite keeps the JSON. Redis also keeps a
//! message's first history row in its hash in the [row form](encode_row) (layout 6).
//!
//! Why: the record is most of what a message keeps for its whole retention (a ~330-byte body
//! escaped inside ~670 bytes of JSON). JSON repeats its field names and escapes the body's
//! quotes, so zstd takes a third or more off (BENCHMARKS.md, "Redis layout 5" and "PostgreSQL
//! layout 4"). A record is too short for zstd to learn much from it alone; a dictionary of what
//! every record holds (the field names, the kinds, the shape of a notification's body) takes
//! off another 70 to 100 bytes (BENCHMARKS.md, "PostgreSQL layout 5"). A history row is
//! shorter still, and nearly all field names and status codes: alone, zstd cannot shorten it
//! at all; against [`ROW_DICTIONARY_1`] it shrinks by half or more. Nothing in the engines'
//! scripts or SQL reads inside a record or a first row, so their forms are this file's alone.
//!
//! The forms tell themselves apart by their first bytes: a zstd frame starts with its magic
//! number, JSON with `{`, a frame made with a dictionary with that dictionary's mark. So
//! records and rows written by older layouts stay readable as they are, and an upgrade
//! rewrites none of them.

use std::cell::RefCell;

use zstd::bulk::{Compressor, Decompressor};

use crate::store::{HistoryEntry, NewMessage, StoreError};

/// A zstd frame's first four bytes (RFC 8878, section 3.1.1).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// zstd's default level: on records of a few hundred bytes the faster levels save less, and
/// the slower ones little more.
const LEVEL: i32 = 3;

/// The first dictionary: what every record holds, whatever its body. A raw-content dictionary
/// (zstd finds matches in it as in earlier input; the nearer its end, the cheaper), so the
/// strings every record has come last.
///
/// **Never change these bytes**: every record written with them must stay readable for its
/// whole retention. A better dictionary is a new constant with a new mark, both kept for as
/// long as any record may use them.
pub(crate) const DICTIONARY_1: &[u8] = concat!(
    r#"{"status":"","amount":,"currency":"BRL","createdAt":"","updatedAt":"","type":"","event":""#,
    r#"undefined","approved","denied","cancelled","settled","refunded","Pix","BankInvoice""#,
    r#"{"id":"","kind":"notification","paymentId":"","orderingKey":"pay/","targetUrl":"https://","#,
    r#""headers":{"X-VTEX-API-AppKey":"","X-VTEX-API-AppToken":""},"#,
    r#""body":"{\"paymentId\":\"\",\"status\":\"approved\",\"callbackUrl\":\"https://\"}","#,
    r#""createdAt":17,"deadline":17}"#,
    r#"{"id":"","kind":"inbound","source":"","transactionId":"","orderingKey":"src/","event":"","#,
    r#""targetUrl":"https://","body":"{\"id\":\"","createdAt":17,"deadline":17}"#,
)
.as_bytes();

/// The byte before a frame compressed with [`DICTIONARY_1`]: neither JSON's `{` nor a frame's
/// first byte.
const DICTIONARY_1_MARK: u8 = 0x01;

/// The first dictionary of history rows: the shapes of [`HistoryEntry`]'s JSON, most common
/// last (a delivery answered with a status and no body, then with a JSON body). Raw content,
/// as [`DICTIONARY_1`]. **Never change these bytes**, for the same reason.
pub(crate) const ROW_DICTIONARY_1: &[u8] = concat!(
    r#"{"kind":"resend","at":1,"requestId":"op-"}"#,
    r#"{"kind":"delivery","attempt":2,"at":1,"error":"refused_address"}"#,
    r#"{"kind":"delivery","attempt":3,"at":1,"error":"bad_url"}"#,
    r#"{"kind":"delivery","attempt":4,"at":1,"error":"request","latencyMs":"#,
    r#"{"kind":"delivery","attempt":5,"at":1,"error":"connect","latencyMs":"#,
    r#"{"kind":"delivery","attempt":6,"at":1,"error":"timeout","latencyMs":10000}"#,
    r#","status":400,"status":401,"status":403,"status":404,"status":410,"status":422"#,
    r#","response":{"contentType":"text/html; charset=utf-8","body":"<html>","bodyDropped":true}}"#,
    r#","status":500,"status":502,"status":503,"status":504,"status":429"#,
    r#","response":{"contentType":"text/plain; charset=utf-8","retryAfter":"","body":"","bodyTruncated":true}}"#,
    r#"{"kind":"delivery","attempt":1,"at":1,"status":201,"latencyMs":1,"status":202"#,
    r#"{"kind":"delivery","attempt":1,"at":1,"status":204,"latencyMs":1,"response":{"body":""}}"#,
    r#"{"kind":"delivery","attempt":1,"at":1,"status":204,"latencyMs":1}"#,
    r#"{"kind":"delivery","attempt":1,"at":1,"status":200,"latencyMs":1,"#,
    r#""response":{"contentType":"application/json","body":"{"ok":true}"}}"#,
)
.as_bytes();

/// The byte before a row compressed with [`ROW_DICTIONARY_1`], whose frame follows without
/// its magic number: neither JSON's `{` nor a frame's first byte, nor a record's mark.
const ROW_DICTIONARY_1_MARK: u8 = 0x02;

/// The largest record kept compressed, and so the most a compressed field may unpack to: far
/// above any record of the default `server.max_body_bytes` (1 MiB, escaped at most 6× in the
/// JSON). A larger record is kept as JSON, so a corrupt field can never make a read allocate
/// more than this.
const MAX_COMPRESSED_RECORD: usize = 64 << 20;

thread_local! {
    /// One compression context per thread and dictionary, kept: making one costs more than
    /// compressing a record.
    #[cfg(test)]
    static COMPRESSOR: RefCell<Option<Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> = const { RefCell::new(None) };
    static DICTIONARY_1_COMPRESSOR: RefCell<Option<Compressor<'static>>> =
        const { RefCell::new(None) };
    static DICTIONARY_1_DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> =
        const { RefCell::new(None) };
    static ROW_DICTIONARY_1_COMPRESSOR: RefCell<Option<Compressor<'static>>> =
        const { RefCell::new(None) };
    static ROW_DICTIONARY_1_DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// The record of `message` compressed with [`DICTIONARY_1`] when that is smaller, else the
/// JSON itself. The form PostgreSQL from layout 5 and Redis from layout 6 write: older
/// layouts' readers do not know it.
pub(crate) fn encode(message: &NewMessage) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_vec(message).map_err(corrupt)?;
    let compressed = compress(&DICTIONARY_1_COMPRESSOR, &json, || {
        Compressor::with_dictionary(LEVEL, DICTIONARY_1)
    });
    Ok(smaller(json, compressed, &[DICTIONARY_1_MARK]))
}

/// The record of `message` compressed without a dictionary when that is smaller: the form
/// Redis layout 5 and PostgreSQL layout 4 wrote, which [`decode`] reads for as long as such
/// records are kept.
#[cfg(test)]
pub(crate) fn encode_without_dictionary(message: &NewMessage) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_vec(message).map_err(corrupt)?;
    let compressed = compress(&COMPRESSOR, &json, || Compressor::new(LEVEL));
    Ok(smaller(json, compressed, &[]))
}

/// The first history row `entry` in its kept form: compressed with [`ROW_DICTIONARY_1`] when
/// that is smaller, else its JSON (the form of every row in a history list). The form Redis
/// layout 6 keeps a message's first row in; older layouts' readers do not know it.
pub(crate) fn encode_row(entry: &HistoryEntry) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_vec(entry).map_err(corrupt)?;
    // The mark says what follows is a frame, so its magic number is left out: 4 bytes of a
    // row's 30 to 40.
    let compressed = compress(&ROW_DICTIONARY_1_COMPRESSOR, &json, || {
        Compressor::with_dictionary(LEVEL, ROW_DICTIONARY_1)
    })
    .and_then(|frame| Some(frame.strip_prefix(&ZSTD_MAGIC)?.to_vec()));
    Ok(smaller(json, compressed, &[ROW_DICTIONARY_1_MARK]))
}

/// The history row `row` holds: JSON, or the form of [`encode_row`].
pub(crate) fn decode_row(row: &[u8]) -> Result<HistoryEntry, StoreError> {
    match row.split_first() {
        Some((&ROW_DICTIONARY_1_MARK, rest)) => {
            let frame = [&ZSTD_MAGIC[..], rest].concat();
            let json = decompress(&ROW_DICTIONARY_1_DECOMPRESSOR, &frame, || {
                Decompressor::with_dictionary(ROW_DICTIONARY_1)
            })?;
            serde_json::from_slice(&json).map_err(corrupt)
        }
        _ => serde_json::from_slice(row).map_err(corrupt),
    }
}

type Contexts<T> = std::thread::LocalKey<RefCell<Option<T>>>;

/// `json` compressed by this thread's context of `contexts`, made by `make` the first time;
/// `None` when it is too large to keep compressed, or zstd failed.
fn compress(
    contexts: &'static Contexts<Compressor<'static>>,
    json: &[u8],
    make: impl FnOnce() -> std::io::Result<Compressor<'static>>,
) -> Option<Vec<u8>> {
    if json.len() > MAX_COMPRESSED_RECORD {
        return None;
    }
    contexts
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            let compressor = match slot.as_mut() {
                Some(compressor) => compressor,
                None => slot.insert(make()?),
            };
            compressor.compress(json)
        })
        .ok()
}

/// `mark` and `compressed` when that is smaller than `json`, else `json`: a valid record
/// either way.
fn smaller(json: Vec<u8>, compressed: Option<Vec<u8>>, mark: &[u8]) -> Vec<u8> {
    match compressed {
        Some(compressed) if mark.len() + compressed.len() < json.len() => {
            [mark, &compressed].concat()
        }
        _ => json,
    }
}

/// The message a record holds, in any of its forms.
pub(crate) fn decode(rec: &[u8]) -> Result<NewMessage, StoreError> {
    let json = match rec.split_first() {
        Some((&DICTIONARY_1_MARK, frame)) => decompress(&DICTIONARY_1_DECOMPRESSOR, frame, || {
            Decompressor::with_dictionary(DICTIONARY_1)
        })?,
        _ if rec.starts_with(&ZSTD_MAGIC) => decompress(&DECOMPRESSOR, rec, Decompressor::new)?,
        _ => return serde_json::from_slice(rec).map_err(corrupt),
    };
    serde_json::from_slice(&json).map_err(corrupt)
}

/// The JSON `frame` holds, by this thread's context of `contexts`, made by `make` the first
/// time; an error, never a huge allocation, when its header says it holds more than a record
/// may.
fn decompress(
    contexts: &'static Contexts<Decompressor<'static>>,
    frame: &[u8],
    make: impl FnOnce() -> std::io::Result<Decompressor<'static>>,
) -> Result<Vec<u8>, StoreError> {
    if !frame.starts_with(&ZSTD_MAGIC) {
        return Err(corrupt("a compressed message record is not a zstd frame"));
    }
    let size = match zstd::zstd_safe::get_frame_content_size(frame) {
        Ok(Some(size)) if size <= MAX_COMPRESSED_RECORD as u64 => size as usize,
        other => {
            return Err(corrupt(format!(
                "a compressed message record says it holds {other:?} bytes"
            )));
        }
    };
    contexts
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            let decompressor = match slot.as_mut() {
                Some(decompressor) => decompressor,
                None => slot.insert(make()?),
            };
            decompressor.decompress(frame, size)
        })
        .map_err(corrupt)
}

fn corrupt(what: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(what.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::store::{MessageId, MessageKind, Partitions};

    /// A callback of PayZu's shape with `body`.
    pub(crate) fn message(body: &str) -> NewMessage {
        NewMessage {
            id: MessageId::generate(1_764_460_800_000, "k", Partitions::DEFAULT),
            kind: MessageKind::Inbound,
            source: Some("payzu".into()),
            payment_id: None,
            transaction_id: Some("tx-1".into()),
            ordering_key: "src/payzu/tx-1".into(),
            event: None,
            target_url: Some("https://merchant.example/hooks/payzu".into()),
            headers: Default::default(),
            body: body.into(),
            created_at: 1_764_460_800_000,
            deadline: 1_765_065_600_000,
        }
    }

    #[test]
    fn a_record_is_kept_compressed_and_read_back_byte_for_byte() {
        let body = r#"{"id":"tx-1","status":"PAID","amount":12345,"currency":"BRL","payer":{"name":"Fulano de Tal","document":"12345678900"},"pix":{"endToEndId":"E1234567820261205120000000000001"}}"#;
        let original = message(body);
        let rec = encode_without_dictionary(&original).unwrap();
        let json = serde_json::to_vec(&original).unwrap();
        assert!(rec.starts_with(&ZSTD_MAGIC));
        assert!(rec.len() < json.len(), "{} vs {}", rec.len(), json.len());
        let read = decode(&rec).unwrap();
        assert_eq!(read, original);
        assert_eq!(read.body.as_bytes(), body.as_bytes());
    }

    #[test]
    fn a_record_of_an_older_layout_is_read_as_json() {
        let original = message(r#"{"id":"tx-1"}"#);
        let json = serde_json::to_vec(&original).unwrap();
        assert_eq!(decode(&json).unwrap(), original);
    }

    /// A gateway notification: the record the dictionary knows best.
    fn notification() -> NewMessage {
        NewMessage {
            id: MessageId::for_claim(
                1_764_460_800_000,
                "pay/pay-8812",
                Partitions::DEFAULT,
                "notification/pay-8812/approved",
            ),
            kind: MessageKind::Notification,
            source: None,
            transaction_id: None,
            payment_id: Some("pay-8812".into()),
            ordering_key: "pay/pay-8812".into(),
            headers: [
                ("X-VTEX-API-AppKey", "key"),
                ("X-VTEX-API-AppToken", "token"),
            ]
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .into(),
            ..message(
                r#"{"paymentId":"pay-8812","status":"approved","callbackUrl":"https://gateway.example/cb"}"#,
            )
        }
    }

    #[test]
    fn a_record_compressed_with_the_dictionary_is_smaller_and_read_back_byte_for_byte() {
        let payzu = message(
            r#"{"id":"tx-1","status":"PAID","amount":12345,"currency":"BRL","createdAt":"2026-12-05T12:00:00Z"}"#,
        );
        for original in [payzu, notification()] {
            let with = encode(&original).unwrap();
            let without = encode_without_dictionary(&original).unwrap();
            assert_eq!(with[0], DICTIONARY_1_MARK);
            assert!(
                with.len() + 40 < without.len(),
                "{} with the dictionary, {} without",
                with.len(),
                without.len()
            );
            let read = decode(&with).unwrap();
            assert_eq!(read, original);
            assert_eq!(read.body.as_bytes(), original.body.as_bytes());
        }
    }

    /// A record PostgreSQL layout 5 wrote with [`DICTIONARY_1`] when it was first released:
    /// it must read the same for as long as such a record may be kept, so neither the
    /// dictionary nor its mark may change.
    #[test]
    fn a_record_written_with_the_first_dictionary_reads_the_same_in_every_later_release() {
        const WRITTEN: &str = concat!(
            "0128b52ffd608a007d04008246171c706975405413294cb54dfa4fd2a40c00e0272464f98d628afe",
            "ffe1058bff7faabccaeb33a524705c44c35598660ec6660745c39c5b8e2ebcb6890640661736743b",
            "e23e74548db88f93d3dc4b212b905619f915ada36405e703a5690110002384001c6b3048c23a5398",
            "0cc8818ebdc07f199dbfcbb05f8e650d5a7b51003426419b59794300d1e0935c0304",
        );
        let rec = hex::decode(WRITTEN).expect("hex");
        assert_eq!(decode(&rec).unwrap(), notification());
        // The record above reads only the parts of the dictionary it matched; records with
        // other bodies read the rest, so every byte is pinned.
        assert_eq!(
            crate::digest::short_hash(DICTIONARY_1),
            "-IT62raBTA7A6XGLv4zuYQ",
            "DICTIONARY_1 changed: records written with it would no longer read"
        );
    }

    #[test]
    fn a_corrupt_record_of_the_dictionary_is_an_error() {
        let rec = encode(&notification()).unwrap();
        assert!(decode(&rec[..rec.len() / 2]).is_err(), "cut short");
        assert!(decode(&[DICTIONARY_1_MARK, b'{']).is_err(), "not a frame");
        assert!(
            decode(&[DICTIONARY_1_MARK]).is_err(),
            "nothing after the mark"
        );
    }

    #[test]
    fn a_corrupt_compressed_record_is_an_error_not_a_panic_or_a_huge_allocation() {
        let rec = encode_without_dictionary(&message(&"x".repeat(2_000))).unwrap();
        assert!(rec.starts_with(&ZSTD_MAGIC));
        assert!(decode(&rec[..rec.len() / 2]).is_err(), "cut short");
        // A frame header claiming 2^40 bytes of content.
        let mut huge = ZSTD_MAGIC.to_vec();
        huge.extend_from_slice(&[0xC0, 0, 0, 0, 0, 0, 1, 0, 0]);
        assert!(decode(&huge).is_err());
    }

    /// First rows of each shape a delivery or a resend leaves.
    fn rows() -> Vec<HistoryEntry> {
        use crate::store::{DeliveryAttempt, ReceiverAnswer, ResendMark};
        let delivery =
            |status: Option<u16>, error: Option<&str>, answer: Option<ReceiverAnswer>| {
                HistoryEntry::from(DeliveryAttempt {
                    attempt: 1,
                    at: 1_764_460_812_345,
                    status,
                    error: error.map(str::to_string),
                    latency_ms: Some(37),
                    response: answer,
                })
            };
        let json = ReceiverAnswer::new(Some("application/json"), None, br#"{"ok":true}"#, false);
        let refusal = ReceiverAnswer::new(
            Some("text/plain; charset=utf-8"),
            Some("120"),
            b"maintenance window, try later",
            false,
        );
        vec![
            delivery(Some(204), None, None),
            delivery(Some(204), None, Some(ReceiverAnswer::default())),
            delivery(Some(200), None, Some(json)),
            delivery(Some(503), None, Some(refusal)),
            delivery(None, Some("timeout"), None),
            HistoryEntry::from(ResendMark {
                at: 1_764_460_900_000,
                request_id: Some("op-7f3a".into()),
            }),
        ]
    }

    #[test]
    fn a_first_row_is_kept_at_most_two_thirds_of_its_json_and_read_back_as_it_was() {
        for row in rows() {
            let json = serde_json::to_vec(&row).unwrap();
            let kept = encode_row(&row).unwrap();
            assert_eq!(
                kept[0],
                ROW_DICTIONARY_1_MARK,
                "{}",
                String::from_utf8_lossy(&json)
            );
            assert!(
                kept.len() * 3 <= json.len() * 2,
                "{} bytes kept for {} of JSON: {}",
                kept.len(),
                json.len(),
                String::from_utf8_lossy(&json)
            );
            assert_eq!(decode_row(&kept).unwrap(), row);
            // A row of layout 5, and every row of a history list, is JSON.
            assert_eq!(decode_row(&json).unwrap(), row);
        }
    }

    #[test]
    fn a_corrupt_first_row_is_an_error() {
        let kept = encode_row(&rows()[2]).unwrap();
        assert!(decode_row(&kept[..kept.len() / 2]).is_err(), "cut short");
        assert!(
            decode_row(&[ROW_DICTIONARY_1_MARK]).is_err(),
            "nothing after the mark"
        );
        assert!(decode_row(b"").is_err(), "empty");
    }
}
