//! A message's record: the [`NewMessage`] as JSON, compressed with zstd when that makes it
//! smaller, kept in its hash in pieces `r0`, `r1`, … (layout 5); whole in `rec`, as JSON, in
//! layout 4 and before.
//!
//! Why: the record is most of a message's memory (a ~330-byte body escaped inside ~670 bytes
//! of JSON, kept for the whole retention), and Redis keeps it in an allocation of the next
//! size class up. JSON repeats its field names and escapes the body's quotes, so zstd takes
//! a third or more off (BENCHMARKS.md, "Redis layout 5"). And a hash with a value longer than
//! `hash-max-listpack-value` (64 bytes by default) is a hashtable, a dict with an entry and two
//! strings per field, where a listpack is one allocation: accept.lua cuts the record into
//! pieces that short (pieces.lua; a message's first history row too, history.lua), and
//! claim.lua and [`of_fields`] put them together again. Nothing in the scripts reads inside
//! the record, so its form is this file's alone.
//!
//! The two forms tell themselves apart by their first bytes: a zstd frame starts with its
//! magic number, JSON with `{`. So records of layout 4 and earlier stay readable as they are,
//! and an upgrade from layout 4 rewrites nothing.

use std::cell::RefCell;
use std::collections::HashMap;

use zstd::bulk::{Compressor, Decompressor};

use super::corrupt;
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

/// The `rec` field of `message`: compressed when that is smaller, else the JSON itself.
pub(super) fn encode(message: &NewMessage) -> Result<Vec<u8>, StoreError> {
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

/// The message of a hash's fields (`HGETALL`): its pieces put together, or its whole `rec`;
/// `None` when the hash has no record (the message is gone).
pub(super) fn of_fields(
    fields: &HashMap<String, Vec<u8>>,
) -> Result<Option<NewMessage>, StoreError> {
    if let Some(rec) = fields.get("rec") {
        return decode(rec).map(Some);
    }
    joined(fields, "r").map(|rec| decode(&rec)).transpose()
}

/// A value kept in pieces `<prefix>0`, `<prefix>1`, … of a hash (pieces.lua), put together;
/// `None` when it has none.
pub(super) fn joined(fields: &HashMap<String, Vec<u8>>, prefix: &str) -> Option<Vec<u8>> {
    let mut value = Vec::new();
    let mut piece = 0;
    while let Some(bytes) = fields.get(&format!("{prefix}{piece}")) {
        value.extend_from_slice(bytes);
        piece += 1;
    }
    (piece > 0).then_some(value)
}

/// The message a record holds, in either form.
pub(super) fn decode(rec: &[u8]) -> Result<NewMessage, StoreError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MessageId, MessageKind, Partitions};

    fn message(body: &str) -> NewMessage {
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
    fn a_record_in_pieces_is_put_together_in_their_order() {
        let original = message(&"y".repeat(500));
        let rec = encode(&original).unwrap();
        let mut fields: HashMap<String, Vec<u8>> = rec
            .chunks(7)
            .enumerate()
            .map(|(i, piece)| (format!("r{i}"), piece.to_vec()))
            .collect();
        fields.insert("state".into(), b"pending".to_vec());
        assert_eq!(of_fields(&fields).unwrap(), Some(original));
        assert_eq!(of_fields(&HashMap::new()).unwrap(), None);
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
