//! Message ids: `msg_` + 12 hex digits of the creation time in ms + 2 hex digits of the
//! partition + 14 random hex digits.
//!
//! Why this shape: ids sort by creation time (so a cursor is just "the last id seen", stable
//! while new messages arrive, and a time window is an id range), and the partition is inside
//! the id, so a lookup by id needs no secondary index to find its Redis hash slot.

use crate::clock::Millis;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Number of queue partitions. Each partition is one Redis hash tag (one cluster slot), so
/// all keys a script touches live together; workers claim from all of them.
pub const PARTITIONS: u8 = 16;

const PREFIX: &str = "msg_";
const LEN: usize = PREFIX.len() + 12 + 2 + 14;
/// What [`MessageId::parse`] accepts, as a regular expression (the OpenAPI document's
/// pattern for ids and cursors): the partition digits are `00` to `0f`.
pub const PATTERN: &str = "^msg_[0-9a-f]{12}0[0-9a-f]{15}$";

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageId(String);

impl MessageId {
    pub fn generate(now: Millis, ordering_key: &str) -> MessageId {
        let random: u64 = rand::random::<u64>() & 0x00ff_ffff_ffff_ffff;
        MessageId(format!(
            "{PREFIX}{:012x}{:02x}{random:014x}",
            now.max(0),
            partition_of(ordering_key)
        ))
    }

    /// Parses an id from untrusted input (a URL path, a resend request).
    pub fn parse(s: &str) -> Option<MessageId> {
        let hex = s.strip_prefix(PREFIX)?;
        let well_formed = s.len() == LEN
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        let id = MessageId(s.to_string());
        (well_formed && id.partition() < PARTITIONS).then_some(id)
    }

    /// The smallest id any message created at or after `at` can have.
    pub fn lower_bound(at: Millis) -> MessageId {
        MessageId(format!("{PREFIX}{:012x}", at.max(0)))
    }

    pub fn partition(&self) -> u8 {
        u8::from_str_radix(&self.0[PREFIX.len() + 12..PREFIX.len() + 14], 16).unwrap_or(0)
    }

    pub fn created_at(&self) -> Millis {
        i64::from_str_radix(&self.0[PREFIX.len()..PREFIX.len() + 12], 16).unwrap_or(0)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Stable partition of an ordering key (FNV-1a: stable across processes and versions, which
/// `std`'s randomly seeded hasher is not).
pub fn partition_of(ordering_key: &str) -> u8 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in ordering_key.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(PARTITIONS)) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sort_by_time() {
        let a = MessageId::generate(1_764_460_800_000, "payzu\u{0}tx1");
        let b = MessageId::generate(1_764_460_800_001, "payzu\u{0}tx1");
        assert!(a < b);
        assert_eq!(a.created_at(), 1_764_460_800_000);
        assert_eq!(a.partition(), partition_of("payzu\u{0}tx1"));
        assert_eq!(MessageId::parse(a.as_str()), Some(a.clone()));
        assert!(MessageId::lower_bound(1_764_460_800_000) < a);
        assert!(MessageId::lower_bound(1_764_460_800_001) > a);
    }

    #[test]
    fn parse_rejects_garbage() {
        for bad in [
            "",
            "msg_",
            "msg_zz",
            "msg_0000000000001g00000000000000",
            "../etc/passwd",
            "msg_00000000000120000000000000000",
        ] {
            assert_eq!(MessageId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn partitions_spread() {
        let mut seen = [false; PARTITIONS as usize];
        for i in 0..1000 {
            seen[partition_of(&format!("pay-{i}")) as usize] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
