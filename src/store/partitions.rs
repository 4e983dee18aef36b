//! How many partitions a store has (`store.partitions`): fixed when the store is first used,
//! and recorded in it.
//!
//! Why fixed: a message id carries its partition (`store/ids.rs`), and on Redis every key of a
//! message lives under its partition's hash tag, derived from the ordering key. With another
//! count the same ordering key would land in another partition, so messages already queued
//! would sit where nobody claims them any more. So a store keeps the count it was created
//! with, and a configuration that asks for another one is refused at start-up ([`settle`]).

use std::fmt;

/// A partition count, 1 to [`Partitions::MAX`]: every partition is numbered by one byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Partitions(u16);

impl Partitions {
    /// The count of every store created before the count was recorded.
    pub const LEGACY: Partitions = Partitions(16);
    /// A new store's count when `store.partitions` is not set. 64 spreads over a cluster of a
    /// dozen masters (5 or 6 each once slots are balanced) while every claim, listing and
    /// sweep, which ask each partition, stays a quarter of what 256 would cost; docs/storage.md,
    /// "Partitions", has the reasoning.
    pub const DEFAULT: Partitions = Partitions(64);
    /// The largest count: partition numbers are one byte (two hex digits in an id).
    pub const MAX: u16 = 256;

    /// `None` when `count` is 0 or above [`Partitions::MAX`].
    pub fn new(count: u16) -> Option<Partitions> {
        (1..=Partitions::MAX)
            .contains(&count)
            .then_some(Partitions(count))
    }

    pub fn count(self) -> u16 {
        self.0
    }

    /// Whether `partition` is one of this store's.
    pub fn contains(self, partition: u8) -> bool {
        u16::from(partition) < self.0
    }

    /// Every partition, in order.
    pub fn all(self) -> impl Iterator<Item = u8> {
        (0..self.0).filter_map(|p| u8::try_from(p).ok())
    }
}

impl fmt::Display for Partitions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What a store says about its partition count when it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Nothing stored yet: the store takes the configured count, or the default.
    Empty,
    /// The count the store recorded.
    Recorded(Partitions),
    /// A store used before the count was recorded, which therefore has [`Partitions::LEGACY`].
    Unrecorded,
}

/// A configured count that contradicts the store's: the store refuses to start
/// ([`super::StoreError::Incompatible`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PartitionsMismatch(String);

/// The count a store opens with: what it holds decides, and `configured` (`store.partitions`,
/// when set) must agree; a store with nothing in it yet takes `configured` or the default.
pub fn settle(
    configured: Option<Partitions>,
    found: Found,
) -> Result<Partitions, PartitionsMismatch> {
    let (held, how) = match found {
        Found::Empty => return Ok(configured.unwrap_or(Partitions::DEFAULT)),
        Found::Recorded(held) => (held, "records"),
        Found::Unrecorded => (
            Partitions::LEGACY,
            "was created before the count was recorded, by a release that always used",
        ),
    };
    match configured {
        Some(configured) if configured != held => Err(PartitionsMismatch(format!(
            "store.partitions = {configured}, but this store {how} {held} partitions: message \
             ids and key hash tags embed the partition, so another count would orphan the \
             messages already queued. Remove store.partitions to use the store's count, or \
             set it to {held}"
        ))),
        _ => Ok(held),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(n: u16) -> Partitions {
        Partitions::new(n).expect("a valid count")
    }

    #[test]
    fn counts_are_one_to_256() {
        assert_eq!(Partitions::new(0), None);
        assert_eq!(Partitions::new(257), None);
        assert_eq!(count(1).all().collect::<Vec<_>>(), vec![0]);
        assert_eq!(count(256).all().count(), 256);
        assert_eq!(count(256).all().last(), Some(255));
        assert!(count(64).contains(63));
        assert!(!count(64).contains(64));
        assert!(count(256).contains(255));
    }

    #[test]
    fn a_new_store_takes_the_configured_count_or_the_default() {
        assert_eq!(settle(None, Found::Empty).unwrap(), Partitions::DEFAULT);
        assert_eq!(settle(Some(count(128)), Found::Empty).unwrap(), count(128));
    }

    #[test]
    fn an_existing_store_keeps_its_count() {
        assert_eq!(
            settle(None, Found::Recorded(count(128))).unwrap(),
            count(128)
        );
        assert_eq!(
            settle(Some(count(128)), Found::Recorded(count(128))).unwrap(),
            count(128)
        );
        assert_eq!(settle(None, Found::Unrecorded).unwrap(), Partitions::LEGACY);
        assert_eq!(
            settle(Some(count(16)), Found::Unrecorded).unwrap(),
            Partitions::LEGACY
        );
    }

    #[test]
    fn another_configured_count_is_refused_naming_both() {
        let err = settle(Some(count(64)), Found::Recorded(count(128)))
            .unwrap_err()
            .to_string();
        for part in ["store.partitions = 64", "records 128 partitions", "orphan"] {
            assert!(err.contains(part), "{part} in: {err}");
        }
        let legacy = settle(Some(count(64)), Found::Unrecorded)
            .unwrap_err()
            .to_string();
        assert!(legacy.contains("always used 16 partitions"), "{legacy}");
    }
}
