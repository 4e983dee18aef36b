//! A message's record in its Redis hash: in pieces `r0`, `r1`, … (layout 5 and after), whole
//! in `rec` (layout 4 and before), in any of the forms of [`crate::store::record`]; and its
//! first history row, in pieces `h0`, `h1`, … in the row form of the same file (layout 6) or
//! as JSON (layout 5).
//!
//! Why pieces: a hash with a value longer than `hash-max-listpack-value` (64 bytes by default)
//! is a hashtable, a dict with an entry and two strings per field, where a listpack is one
//! allocation. accept.lua cuts the record into pieces that short (pieces.lua; a message's
//! first history row too, history.lua), and claim.lua and [`of_fields`] put them together.

use std::collections::HashMap;

pub(super) use crate::store::record::{decode, decode_row, encode, encode_row};
use crate::store::{NewMessage, StoreError};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::record::tests::message;

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
}
