//! Message ids: `msg_` + 12 hex digits of the creation time in ms + 2 hex digits of the
//! partition + 14 hex digits that are random, or for an inbound callback a hash of its dedupe
//! claim key ([`MessageId::for_claim`]).
//!
//! Why this shape: ids sort by creation time (so a cursor is just "the last id seen", stable
//! while new messages arrive, and a time window is an id range), and the partition is inside
//! the id, so a lookup by id needs no secondary index to find its Redis hash slot.
//!
//! How many partitions there are is the store's ([`Partitions`], fixed when it is first used),
//! so generating an id takes the count; parsing one does not: any two digits parse, and an id
//! naming a partition the store does not have is simply not found there.
//!
//! Why a callback's id is derived: (acceptance ms, partition, claim key) then rebuild it, so
//! the Redis store keeps the claim as one integer, the acceptance ms and the lifetime
//! (redis/keys.rs), and a replay's answer is rebuilt from it. Two callbacks share an id only if they share the claim
//! key, the partition and the millisecond, and a claim key is accepted once while its claim
//! lasts (at least a second); distinct claim keys collide as rarely as random digits would.
//!
//! The other ids a message carries, [`PaymentId`], [`SourceName`] and [`TransactionId`], are
//! opaque strings the store keeps as given: typed so one cannot be passed for another, and
//! serialized as the bare string, so stored messages and API bodies keep their bytes.

use crate::clock::Millis;
use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::partitions::Partitions;

const PREFIX: &str = "msg_";
const LEN: usize = PREFIX.len() + 12 + 2 + TAIL_DIGITS;
/// Hex digits after the time and the partition.
const TAIL_DIGITS: usize = 14;
/// What [`MessageId::parse`] accepts, as a regular expression (the OpenAPI document's
/// pattern for ids and cursors): 12 digits of time, 2 of partition, 14 more.
pub const PATTERN: &str = "^msg_[0-9a-f]{28}$";

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MessageId(String);

impl MessageId {
    /// A new id of a message with `ordering_key`, in a store of `partitions`.
    pub fn generate(now: Millis, ordering_key: &str, partitions: Partitions) -> MessageId {
        let random: u64 = rand::random::<u64>() & 0x00ff_ffff_ffff_ffff;
        MessageId(format!(
            "{PREFIX}{:012x}{:02x}{random:014x}",
            now.max(0),
            partition_of(ordering_key, partitions)
        ))
    }

    /// The id of an inbound callback accepted at `now` whose dedupe claim key is
    /// `claim_key`: the same inputs always give the same id.
    pub fn for_claim(
        now: Millis,
        ordering_key: &str,
        partitions: Partitions,
        claim_key: &str,
    ) -> MessageId {
        MessageId::of_claim(now, partition_of(ordering_key, partitions), claim_key)
    }

    /// [`MessageId::for_claim`] in a known partition: how a store rebuilds the id from what
    /// it kept.
    pub fn of_claim(now: Millis, partition: u8, claim_key: &str) -> MessageId {
        MessageId(format!(
            "{PREFIX}{:012x}{}",
            now.max(0),
            claim_tail(partition, claim_key)
        ))
    }

    /// Parses an id from untrusted input (a URL path, a resend request).
    pub fn parse(s: &str) -> Option<MessageId> {
        let hex = s.strip_prefix(PREFIX)?;
        let well_formed = s.len() == LEN
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| MessageId(s.to_string()))
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

/// An opaque id string: serialized as the bare string, read as one (`Deref` to `str`), and
/// built from any string with `.into()`.
macro_rules! opaque_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl From<String> for $name {
            fn from(s: String) -> $name {
                $name(s)
            }
        }

        impl From<&str> for $name {
            fn from(s: &str) -> $name {
                $name(s.to_string())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    };
}

opaque_id!(
    /// A payment's id, as the connector sent it: it names the payment's status and the
    /// ordering key of its notifications.
    PaymentId
);
opaque_id!(
    /// A configured source's name (a provider): scopes its callbacks' dedupe keys and
    /// ordering keys.
    SourceName
);
opaque_id!(
    /// A provider's transaction id, read from a callback's body: callbacks of one transaction
    /// are delivered in order.
    TransactionId
);

/// The digits of [`MessageId::of_claim`] after the time: the partition, then the first 14
/// hex digits of the SHA-256 of the claim key.
pub fn claim_tail(partition: u8, claim_key: &str) -> String {
    let digest = Sha256::digest(claim_key.as_bytes());
    format!("{partition:02x}{}", hex::encode(&digest[..TAIL_DIGITS / 2]))
}

/// Stable partition of an ordering key among `partitions` (FNV-1a: stable across processes and
/// versions, which `std`'s randomly seeded hasher is not).
pub fn partition_of(ordering_key: &str, partitions: Partitions) -> u8 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in ordering_key.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    // Below the count, which is at most 256.
    u8::try_from(hash % u64::from(partitions.count())).unwrap_or(u8::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sort_by_time() {
        let p = Partitions::DEFAULT;
        let a = MessageId::generate(1_764_460_800_000, "payzu\u{0}tx1", p);
        let b = MessageId::generate(1_764_460_800_001, "payzu\u{0}tx1", p);
        assert!(a < b);
        assert_eq!(a.created_at(), 1_764_460_800_000);
        assert_eq!(a.partition(), partition_of("payzu\u{0}tx1", p));
        assert_eq!(MessageId::parse(a.as_str()), Some(a.clone()));
        assert!(MessageId::lower_bound(1_764_460_800_000) < a);
        assert!(MessageId::lower_bound(1_764_460_800_001) > a);
    }

    #[test]
    fn a_claim_id_is_rebuilt_from_its_time_partition_and_claim_key() {
        let p = Partitions::DEFAULT;
        let id = MessageId::for_claim(1_764_460_800_000, "src/payzu/tx1", p, "claim-a");
        assert_eq!(MessageId::parse(id.as_str()), Some(id.clone()));
        assert_eq!(id.created_at(), 1_764_460_800_000);
        assert_eq!(id.partition(), partition_of("src/payzu/tx1", p));
        assert_eq!(
            MessageId::of_claim(id.created_at(), id.partition(), "claim-a"),
            id,
            "rebuilt"
        );
        assert_eq!(
            &id.as_str()[PREFIX.len() + 12..],
            claim_tail(id.partition(), "claim-a")
        );
        // Fixed across versions: the Redis store rebuilds ids a former process made.
        assert_eq!(
            MessageId::of_claim(1_764_460_800_000, 3, "claim-a").as_str(),
            format!(
                "msg_019ad20f280003{}",
                &hex::encode(Sha256::digest(b"claim-a"))[..14]
            )
        );
        for other in [
            MessageId::for_claim(1_764_460_800_001, "src/payzu/tx1", p, "claim-a"),
            MessageId::for_claim(1_764_460_800_000, "src/payzu/tx1", p, "claim-b"),
            MessageId::of_claim(1_764_460_800_000, (id.partition() + 1) % 128, "claim-a"),
        ] {
            assert_ne!(other, id);
        }
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
            "msg_000000000001F0000000000000000",
        ] {
            assert_eq!(MessageId::parse(bad), None, "{bad}");
        }
    }

    /// Any two partition digits parse: whether the store has that partition is the store's
    /// question (an id it does not have is not found).
    #[test]
    fn parse_accepts_every_partition() {
        for partition in ["00", "0f", "10", "7f", "ff"] {
            let id = format!("msg_000000000001{partition}00000000000000");
            let parsed = MessageId::parse(&id).expect("parses");
            assert_eq!(format!("{:02x}", parsed.partition()), partition);
        }
    }

    #[test]
    fn partitions_spread_over_every_count() {
        for count in [1, 16, 64, 128, 256] {
            let partitions = Partitions::new(count).expect("a valid count");
            let mut seen = vec![false; usize::from(count)];
            for i in 0..20_000 {
                let p = partition_of(&format!("pay-{i}"), partitions);
                assert!(partitions.contains(p));
                seen[usize::from(p)] = true;
            }
            assert!(
                seen.iter().all(|s| *s),
                "every one of {count} partitions used"
            );
        }
    }

    /// The partition of an ordering key at the legacy count is what every earlier release
    /// computed, so their queued messages stay where they are.
    #[test]
    fn the_legacy_count_keeps_the_partition_of_earlier_releases() {
        assert_eq!(partition_of("payzu\u{0}tx1", Partitions::LEGACY), 3);
        assert_eq!(partition_of("pay/1", Partitions::LEGACY), 9);
        assert_eq!(partition_of("pay/1", Partitions::DEFAULT), 25);
    }
}
