//! The Redis key layout, version [`SCHEMA_VERSION`]: every name the engine reads or writes.
//!
//! Ready for Redis Cluster: every key of a message lives under the hash tag of its partition,
//! `cb:{pNN}:` (`NN` in decimal, `00` up to the store's count, `store.partitions`), derived
//! from the ordering key, so each script touches one slot.
//!
//! `cb` is the default of `store.key_prefix` ([`KeySpace`]): every name below starts with the
//! configured prefix instead, so deployments sharing one Redis never see each other's keys.
//!
//! | key | type | holds |
//! |---|---|---|
//! | `d:<h16>` | string | dedupe claim: end ms `\|` fingerprint `\n` stored response (below), or a compact claim (below), `dedupe_ttl_secs` |
//! | `s:<hash>` | string | signature seal: end ms `\|` the first answer (stored response), while it is valid |
//! | `m:<id>` | hash | message record and mutable state (fields below) |
//! | `a:<id>` | list | attempt history (JSON rows) after the first row, which is in `m:<id>`: the latest 100 (written by layout 4 and before: the first row too) |
//! | `q:<kh>` | list | ids of one ordering key not yet finished; only the head is due |
//! | `due` | zset | due heads scored by next attempt time |
//! | `lease` | zset | in-flight ids scored by lease expiry |
//! | `ix:<state>` | zset (lex) | ids for listing by state: `pending`, `in_flight`, `dead` (and, written by layout 6 and before, `delivered` and `recorded`, read and swept until their messages end) |
//! | `fx:<state>` | zset (lex) | `delivered`, `recorded` (layout 7): the bounds of the state's buckets of ids, each bound `<b>` naming the bucket `fx:<state>:<b>`, a zset (lex) of at most 128 ids from `<b>` up to the next bound, so that it stays a listpack (index.lua) |
//! | `kx:<c>` | zset (lex) | the key index, for listing by ordering key: a member `<kh without c>:<id>` per message whose [`key_hash`] starts with the character `<c>`, 64 buckets a partition, so that a key's members are one lex range (layout 6; `ix:k:<kh>`, a zset of ids per ordering key, in layout 5 and before, read and swept until its messages end) |
//! | `pay:<hash>` | string | end ms `\|` payment status for the compare-and-set, `payment_retention_secs` |
//! | `x:<b>` | list | expiry bucket `b` of strings: `d:`, `s:`, `pay:` members whose end falls in hour `b` |
//! | `xm:<b>` | list | expiry bucket `b` of messages: `m:<id>` members of finished or recorded messages |
//! | `xb` | zset | the expiry buckets (`x:<b>`, `xm:<b>`) scored by their first ms |
//! | `n:<hour>` | hash | attempts per minute of the hour (counts.rs), with a TTL |
//! | `in:<hour>:<source>` | hash | inbound callbacks of the source per minute of the hour, new and replayed (recoveries.rs), with a TTL |
//!
//! `<h16>` is the first 16 characters (96 bits) of the short hash of the claim key, so the
//! whole name fits a 32-byte allocation. A stored response is `=` and the response, or `#` and
//! a message id when the response was exactly `{"messageId":"<id>"}` (rebuilt byte for byte),
//! which keeps a callback's claim within Redis' 44-byte embedded strings.
//!
//! A compact claim is an inbound callback's: no fingerprint, and the answer
//! `{"messageId":"<id>"}` naming the id derived from the acceptance ms and the claim key
//! ([`MessageId::of_claim`] in this partition). It is one integer, the acceptance ms followed
//! by the lifetime in whole minutes as 5 digits (`176446080000043200`: 30 days), which Redis
//! keeps in its 16-byte object header instead of a 64-byte embedded string. Its end is the
//! acceptance plus that lifetime, the one set when it was written, as for every string (a
//! later change of `dedupe_ttl_secs` applies to claims written after it); a replay rebuilds
//! the answer from the acceptance ms, the partition and its own claim key, and a request
//! with a fingerprint conflicts with it. A claim whose lifetime is not whole minutes, or over
//! 99 999 of them, keeps the string form.
//!
//! Every string carries its end, so one `SET ... PX` writes it with its Redis TTL and the
//! caller's clock judges it. Its member goes to the bucket of its end, and the sweeper deletes
//! a bucket's members whose end has come; string buckets have a Redis TTL too (a day past their
//! end), so strings stay bounded without a sweeper, as messages do not need (they are swept).
//!
//! `<kh>` is [`key_hash`] of the ordering key. The fields of `m:<id>` (absent means the
//! default, so a new message writes only the record, `state` and `kh`):
//!
//! | field | holds |
//! |---|---|
//! | `r0`, `r1`, … | the record, fixed at acceptance: the [`NewMessage`](crate::store::NewMessage) as JSON, zstd-compressed against a dictionary when that is smaller (without one in layout 5), in pieces of at most 64 bytes so the hash stays a listpack (record.rs); `rec`, the JSON whole, in layout 4 and before |
//! | `state` | [`MessageState`] |
//! | `kh` | [`key_hash`] of the ordering key, so the sweeper finds the message's key index entry |
//! | `end` | when a finished or recorded message ends (absent while there is work left) |
//! | `tries` | delivery attempts recorded (0) |
//! | `rb` | `tries` when a resend last requeued it: the backoff counts from there (0) |
//! | `lease` | token of the latest lease (0) |
//! | `dl` | current deadline (the record's): a resend of a finished message opens a fresh one |
//! | `resume` | the scheduled attempt a resend brought forward, to resume from (0: none) |
//! | `again` | 1 when a resend arrived while an attempt was in flight (0) |
//! | `hn` | history rows ever recorded, kept or dropped (0) |
//! | `h0`, `h1`, … | the first history row, compressed against a dictionary of rows when that is smaller (JSON in layout 5), in pieces as the record (history.lua; absent before the first row, and in layout 4 and before, whose first row is in `a:<id>`) |
//!
//! Each partition also has a channel, `<prefix>:{pNN}:wake`, named like its keys so that on a
//! cluster it is a shard channel of the partition's slot (`wake.rs`); nothing is stored there.
//!
//! Outside the partitions: `cb:schema` (the layout version), `cb:partitions` (the partition
//! count, fixed at first use; a store without it has 16), `cb:upgrading` (the upgrade lock)
//! `cb:op:<hash>` (resend operations, which belong to no message) and `cb:recoveries` (a hash
//! of the provider-side recoveries by id, recoveries.rs), all under the configured prefix
//! too.
//!
//! The scripts build some names themselves from the partition prefix (`m:` in claim.lua;
//! `m:`, `a:`, `fx:`, `ix:k:` and `kx:` in sweep.lua; a bucket's name from its index's, and
//! `ix:` from `fx:`, in index.lua and list.lua; the expiry buckets in expiry.lua), and `upgrade.rs`
//! names the keys of versions 1 and 2 on its own, since those layouts are fixed whatever this
//! one becomes. A change to this layout changes them too, and bumps
//! [`SCHEMA_VERSION`] with an upgrade from the old one.

use crate::digest::short_hash;
use crate::store::ids::partition_of;
use crate::store::partitions::Partitions;
use crate::store::{MessageId, MessageState};

/// The layout this binary writes. 1: the first release (TTLs only, global trims);
/// 2: the expiry index, `kh`/`hn` fields, signature seals, bounded history; 3: ends inside
/// the strings, hourly expiry buckets, no index of all messages, compact dedupe claims;
/// 4: a callback's dedupe claim may be one integer (its id is derived from the claim key);
/// 5: a message's record may be compressed and, with its first history row, is kept in
/// pieces in its hash (record.rs); 6: both compressed against dictionaries when that is
/// smaller (store/record.rs), and messages listed by ordering key through the shared key
/// index `kx:` instead of a sorted set per key; 7: delivered and recorded messages listed
/// through buckets of ids (`fx:`, index.lua) instead of a sorted set per state.
pub const SCHEMA_VERSION: u32 = 7;

/// Width of an expiry bucket: a member is deleted by the first sweep at or after its end, and
/// at the latest one bucket later when it was pushed behind a later end.
pub(super) const EXPIRY_BUCKET_MS: u64 = 3_600_000;

/// Characters of the claim key's hash in a dedupe key's name.
const DEDUPE_HASH_CHARS: usize = 16;

/// Hash of an ordering key in key names and in the `kh` field.
pub(super) fn key_hash(ordering_key: &str) -> String {
    short_hash(ordering_key.as_bytes())
}

/// Every key name of one deployment: all start with its prefix, and its messages' keys lie in
/// its partitions.
#[derive(Debug, Clone)]
pub(super) struct KeySpace {
    prefix: String,
    partitions: Partitions,
}

impl KeySpace {
    /// Takes a prefix [`key_prefix_problem`] accepted.
    pub(super) fn new(prefix: &str, partitions: Partitions) -> KeySpace {
        KeySpace {
            prefix: prefix.to_string(),
            partitions,
        }
    }
    pub(super) fn partitions(&self) -> Partitions {
        self.partitions
    }
    /// Whether `id` names one of the store's partitions: an id from another store (or made
    /// up) may not, and then names no key here.
    pub(super) fn holds(&self, id: &MessageId) -> bool {
        self.partitions.contains(id.partition())
    }
    /// Holds the layout version of the store.
    pub(super) fn schema(&self) -> String {
        format!("{}:schema", self.prefix)
    }
    /// Holds the partition count, fixed when the store was first used.
    pub(super) fn partition_count(&self) -> String {
        format!("{}:partitions", self.prefix)
    }
    /// Held by the one process upgrading an older layout.
    pub(super) fn upgrade_lock(&self) -> String {
        format!("{}:upgrading", self.prefix)
    }
    /// SCAN pattern of every partition key of every layout.
    pub(super) fn partition_pattern(&self) -> String {
        format!("{}:{{p*}}:*", self.prefix)
    }
    /// The provider-side recoveries, by id: one small hash (at most
    /// [`MAX_RECOVERIES`](crate::store::recoveries::MAX_RECOVERIES) fields).
    pub(super) fn recoveries(&self) -> String {
        format!("{}:recoveries", self.prefix)
    }
    /// The record of a resend operation.
    pub(super) fn operation(&self, key: &str) -> String {
        format!("{}:op:{}", self.prefix, short_hash(key.as_bytes()))
    }
    pub(super) fn of_partition(&self, partition: u8) -> Keys {
        Keys(format!("{}:{{p{partition:02}}}:", self.prefix))
    }
    /// Every partition of the store, in order.
    pub(super) fn all(&self) -> impl Iterator<Item = Keys> + '_ {
        self.partitions.all().map(|p| self.of_partition(p))
    }
    /// Takes an id the store [`holds`](KeySpace::holds): one it generated, or checked.
    pub(super) fn of_id(&self, id: &MessageId) -> Keys {
        self.of_partition(id.partition())
    }
    pub(super) fn of_ordering_key(&self, ordering_key: &str) -> Keys {
        self.of_partition(partition_of(ordering_key, self.partitions))
    }
}

/// Characters of an ordering key's hash that name its bucket of the key index: 64 buckets a
/// partition, so that a bucket holds many keys' members in one listpack rather than each key
/// a sorted set of its own (accept.lua and sweep.lua split the hash the same way). Past
/// Redis' `zset-max-listpack-entries` (128) a bucket is a skiplist, and a key's messages are
/// still one lex range of it.
const KEY_INDEX_BUCKET_CHARS: usize = 1;

/// One ordering key's place in the key index: the sorted set `bucket`, whose members
/// `<member_prefix><id>` (score 0, ordered by id) are its messages.
pub(super) struct KeyIndex {
    pub(super) bucket: String,
    pub(super) member_prefix: String,
}

/// Key names of one partition.
pub(super) struct Keys(String);

impl Keys {
    pub(super) fn prefix(&self) -> &str {
        &self.0
    }
    fn key(&self, suffix: &str) -> String {
        format!("{}{suffix}", self.0)
    }
    /// A key's name within the partition: its member in an expiry bucket.
    pub(super) fn member<'k>(&self, key: &'k str) -> &'k str {
        key.strip_prefix(self.prefix()).unwrap_or(key)
    }
    pub(super) fn dedupe(&self, claim_key: &str) -> String {
        let hash = short_hash(claim_key.as_bytes());
        self.key(&format!("d:{}", &hash[..DEDUPE_HASH_CHARS]))
    }
    pub(super) fn seal(&self, seal_key: &str) -> String {
        self.key(&format!("s:{seal_key}"))
    }
    pub(super) fn message(&self, id: &MessageId) -> String {
        self.key(&format!("m:{id}"))
    }
    pub(super) fn attempts(&self, id: &MessageId) -> String {
        self.key(&format!("a:{id}"))
    }
    pub(super) fn queue(&self, ordering_key: &str) -> String {
        self.key(&format!("q:{}", key_hash(ordering_key)))
    }
    pub(super) fn due(&self) -> String {
        self.key("due")
    }
    pub(super) fn lease(&self) -> String {
        self.key("lease")
    }
    /// The partition's wake channel (`wake.rs`): a channel, not a key, named like one so that
    /// on a cluster it is a shard channel of the partition's slot. `wake.lua` builds it from
    /// [`Keys::due`].
    pub(super) fn wake(&self) -> String {
        self.key("wake")
    }
    /// The listing index of `state` (index.lua): delivered and recorded hold nearly all of
    /// the retention's messages, kept in buckets (`fx:`, layout 7); pending, in flight and
    /// dead a sorted set each (`ix:`), whose `ZCARD` is the queue depth.
    pub(super) fn index(&self, state: MessageState) -> String {
        match state {
            MessageState::Delivered | MessageState::Recorded => {
                self.key(&format!("fx:{}", state.as_str()))
            }
            MessageState::Pending | MessageState::InFlight | MessageState::Dead => {
                self.key(&format!("ix:{}", state.as_str()))
            }
        }
    }
    /// Layout 5 and before: one sorted set of ids per ordering key, still read and swept for
    /// the messages those layouts wrote.
    pub(super) fn index_of_key(&self, ordering_key: &str) -> String {
        self.key(&format!("ix:k:{}", key_hash(ordering_key)))
    }
    /// Where the key index keeps `ordering_key`'s messages (layout 6): its bucket, and the
    /// start of their members there.
    pub(super) fn key_index(&self, ordering_key: &str) -> KeyIndex {
        let hash = key_hash(ordering_key);
        let (bucket, rest) = hash.split_at(KEY_INDEX_BUCKET_CHARS);
        KeyIndex {
            bucket: self.key(&format!("kx:{bucket}")),
            member_prefix: format!("{rest}:"),
        }
    }
    pub(super) fn payment(&self, payment_id: &str) -> String {
        self.key(&format!("pay:{}", short_hash(payment_id.as_bytes())))
    }
    /// The index of expiry buckets.
    pub(super) fn buckets(&self) -> String {
        self.key("xb")
    }
    /// This partition's inbound callbacks of `source` per minute in `hour` (recoveries.rs).
    pub(super) fn inbound_counts(&self, hour: i64, source: &str) -> String {
        self.key(&format!("in:{hour}:{source}"))
    }
    /// This partition's attempts per minute in `hour` (counts.rs).
    pub(super) fn counts(&self, hour: i64) -> String {
        self.key(&format!("n:{hour}"))
    }
}
