//! A message's record: the [`NewMessage`] as JSON, compressed with zstd when that makes it
//! smaller. Redis keeps it in its hash (layout 5, `redis/record.rs`), PostgreSQL in the
//! `record` column of `messages` (layout 4); SQLite keeps the JSON.
//!
//! Why: the record is most of what a message keeps for its whole retention (a ~330-byte body
//! escaped inside ~670 bytes of JSON). JSON repeats its field names and escapes the body's
//! quotes, so zstd takes a third or more off (BENCHMARKS.md, "Redis layout 5" and "PostgreSQL
//! layout 4"). Nothing in the engines' scripts or SQL reads inside the record, so its form is
//! this file's alone.
//!
//! The two forms tell themselves apart by their first bytes: a zstd frame starts with its
//! magic number, JSON with `{`. So records written as JSON by older layouts stay readable as
//! they are, and an upgrade rewrites none of them.

use std::cell::RefCell;

use zstd::bulk::{Compressor, Decompressor};

use crate::store::{NewMessage, StoreError};

/// A zstd frame's first four bytes (RFC 8878, section 3.1.1).
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// zstd's default level: on records of a few hundred bytes the faster levels save less, and
/// the slower ones little more.
const LEVEL: i32 = 3;

/// The largest record kept compressed, and so the most a compressed field may unpack to: far
/// above any record of the default `server.max_body_bytes` (1 MiB, escaped at most 6× in the
/// JSON). A larger record is kept as JSON, so a corrupt field can never make a read allocate
/// more than this.
const MAX_COMPRESSED_RECORD: usize = 64 << 20;

thread_local! {
    /// One compression context per thread, kept: making one costs more than compressing a
    /// record.
    static COMPRESSOR: RefCell<Option<Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> = const { RefCell::new(None) };
}

/// The record of `message`: compressed when that is smaller, else the JSON itself.
pub(crate) fn encode(message: &NewMessage) -> Result<Vec<u8>, StoreError> {
    let json = serde_json::to_vec(message).map_err(corrupt)?;
    if json.len() > MAX_COMPRESSED_RECORD {
        return Ok(json);
    }
    let compressed = COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        let compressor = match slot.as_mut() {
            Some(compressor) => compressor,
            None => slot.insert(Compressor::new(LEVEL)?),
        };
        compressor.compress(&json)
    });
    match compressed {
        Ok(compressed) if compressed.len() < json.len() => Ok(compressed),
        // Incompressible, or zstd failed: the JSON is a valid record either way.
        _ => Ok(json),
    }
}

/// The message a record holds, in either form.
pub(crate) fn decode(rec: &[u8]) -> Result<NewMessage, StoreError> {
    if !rec.starts_with(&ZSTD_MAGIC) {
        return serde_json::from_slice(rec).map_err(corrupt);
    }
    let size = match zstd::zstd_safe::get_frame_content_size(rec) {
        Ok(Some(size)) if size <= MAX_COMPRESSED_RECORD as u64 => size as usize,
        other => {
            return Err(corrupt(format!(
                "a compressed message record says it holds {other:?} bytes"
            )));
        }
    };
    let json = DECOMPRESSOR
        .with(|cell| {
            let mut slot = cell.borrow_mut();
            let decompressor = match slot.as_mut() {
                Some(decompressor) => decompressor,
                None => slot.insert(Decompressor::new()?),
            };
            decompressor.decompress(rec, size)
        })
        .map_err(corrupt)?;
    serde_json::from_slice(&json).map_err(corrupt)
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
        let rec = encode(&original).unwrap();
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

    #[test]
    fn a_corrupt_compressed_record_is_an_error_not_a_panic_or_a_huge_allocation() {
        let rec = encode(&message(&"x".repeat(2_000))).unwrap();
        assert!(rec.starts_with(&ZSTD_MAGIC));
        assert!(decode(&rec[..rec.len() / 2]).is_err(), "cut short");
        // A frame header claiming 2^40 bytes of content.
        let mut huge = ZSTD_MAGIC.to_vec();
        huge.extend_from_slice(&[0xC0, 0, 0, 0, 0, 0, 1, 0, 0]);
        assert!(decode(&huge).is_err());
    }
}
