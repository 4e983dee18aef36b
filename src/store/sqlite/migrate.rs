//! The layout version (`PRAGMA user_version`) and the upgrades from older layouts.
//!
//! A new database gets `schema.sql` at once. One written by an older callbackd is upgraded in
//! place, one version per transaction, so a crash mid-upgrade leaves a consistent older
//! version that the next start upgrades again. A database newer than this binary is refused:
//! its columns may mean things this code does not know.
//!
//! | version | written by | upgrade |
//! |---|---|---|
//! | 1 | the first release | seals, history counts, histories trimmed, payments kept longer |
//! | 2 | up to commit acd07d8 | columns named after what they hold (Lua-derived before) |
//! | 3 | up to the per-minute counts (#27) | the store-kept attempts per minute |
//! | 4 | up to the provider-side recoveries (#27) | inbound accepts per source and minute, recoveries |
//! | 5 | now | `schema.sql` |
//!
//! Beside the layout, the `partitions` table records the store's partition count
//! (`store.partitions`, [`settle_partitions`]). It is an addition, not a new layout: a store
//! without it was created before the count was recorded, with 16 partitions, and gets the table
//! when it is next opened.

use rusqlite::{Connection, OptionalExtension, params};

use super::error::Db;
use crate::store::StoreError;
use crate::store::partitions::{self, Found, Partitions};

/// The layout `schema.sql` creates.
pub(super) const VERSION: i64 = 5;

const SCHEMA: &str = include_str!("schema.sql");

/// Version 1 → 2. Version 1 expired payment states with their dedupe claims, and kept every
/// history row.
const TO_V2: &str = r#"
CREATE TABLE seals (
    key        TEXT PRIMARY KEY NOT NULL,
    response   TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX seals_by_expiry ON seals (expires_at);

ALTER TABLE messages ADD COLUMN history_total INTEGER NOT NULL DEFAULT 0;
UPDATE messages SET history_total =
    (SELECT count(*) FROM attempts WHERE attempts.message_id = messages.id);

-- Version 1 kept every row: keep the first and the latest 100 of each message.
DELETE FROM attempts WHERE seq IN (
    SELECT seq FROM (
        SELECT seq,
               row_number() OVER (PARTITION BY message_id ORDER BY seq) AS n,
               count(*) OVER (PARTITION BY message_id) AS total
        FROM attempts
    ) WHERE n > 1 AND n <= total - 100
);
"#;

/// Version 2 → 3: the names the Redis hash fields had (`rec`, `rb`, `resume`, `again`...)
/// become names that say what the columns hold. Renames only: no row changes.
const TO_V3: &str = r#"
ALTER TABLE messages RENAME COLUMN rec TO message_json;
ALTER TABLE messages RENAME COLUMN tries TO delivery_attempts;
ALTER TABLE messages RENAME COLUMN rb TO attempts_before_requeue;
ALTER TABLE messages RENAME COLUMN lease TO lease_token;
ALTER TABLE messages RENAME COLUMN resume TO resume_at;
ALTER TABLE messages RENAME COLUMN again TO deliver_again;
ALTER TABLE queue RENAME COLUMN pos TO position;
ALTER TABLE attempts RENAME COLUMN "row" TO attempt_json;
ALTER TABLE claims RENAME TO dedupe_claims;
DROP INDEX claims_by_expiry;
CREATE INDEX dedupe_claims_by_expiry ON dedupe_claims (expires_at);
"#;

/// Version 3 → 4: attempts per minute, counted by the store (store/counts.rs). A new table
/// only: version 3 kept its counts in process memory, so there is nothing to carry over.
const TO_V4: &str = r#"
CREATE TABLE delivery_counts (
    minute     INTEGER PRIMARY KEY NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 0,
    failures   INTEGER NOT NULL DEFAULT 0,
    dead       INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
"#;

/// Version 4 → 5: inbound accepts per source and minute (store/recoveries.rs), counted by
/// each accept in its transaction, and the recoveries that report them. New tables only:
/// nothing was counted before, so a recovery counts from the upgrade on.
const TO_V5: &str = r#"
CREATE TABLE inbound_counts (
    source  TEXT NOT NULL,
    minute  INTEGER NOT NULL,
    new     INTEGER NOT NULL DEFAULT 0,
    replays INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source, minute)
) WITHOUT ROWID;
CREATE INDEX inbound_counts_by_minute ON inbound_counts (minute);
CREATE TABLE recoveries (
    id            TEXT PRIMARY KEY NOT NULL,
    started_at    INTEGER NOT NULL,
    recovery_json TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX recoveries_by_start ON recoveries (started_at);
"#;

/// One row: the partition count, fixed when the store was first used.
const PARTITIONS_TABLE: &str = "
CREATE TABLE IF NOT EXISTS partitions (
    only  INTEGER PRIMARY KEY CHECK (only = 1),
    count INTEGER NOT NULL
)";

/// Brings the database to [`VERSION`] and returns the version it found (0: a new database).
/// `payment_extension_ms`: how much longer payment states live now than in version 1, where
/// they expired with the dedupe claims.
pub(super) fn migrate(conn: &Connection, payment_extension_ms: i64) -> Result<i64, StoreError> {
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .db()?;
    if version > VERSION {
        return Err(StoreError::Unavailable(format!(
            "schema version {version} is newer than this callbackd understands ({VERSION}); \
             run a newer callbackd"
        )));
    }
    if version <= 0 {
        step(conn, VERSION, |tx| tx.execute_batch(SCHEMA).db())?;
        return Ok(0);
    }
    if version < 2 {
        step(conn, 2, |tx| {
            tx.execute_batch(TO_V2).db()?;
            tx.execute(
                "UPDATE payments SET expires_at = expires_at + ?1",
                params![payment_extension_ms],
            )
            .db()
            .map(|_| ())
        })?;
    }
    if version < 3 {
        step(conn, 3, |tx| tx.execute_batch(TO_V3).db())?;
    }
    if version < 4 {
        step(conn, 4, |tx| tx.execute_batch(TO_V4).db())?;
    }
    if version < 5 {
        step(conn, 5, |tx| tx.execute_batch(TO_V5).db())?;
    }
    Ok(version)
}

/// The partition count of the store, recorded on first use: `configured` (`store.partitions`,
/// when set) must agree with what the database holds ([`partitions::settle`]). `found_version`
/// is what [`migrate`] found: 0 for a new database, which takes `configured` or the default;
/// any other without a record was created when every store had 16 partitions.
pub(super) fn settle_partitions(
    conn: &Connection,
    configured: Option<Partitions>,
    found_version: i64,
) -> Result<Partitions, StoreError> {
    let tx = conn.unchecked_transaction().db()?;
    tx.execute_batch(PARTITIONS_TABLE).db()?;
    let recorded: Option<i64> = tx
        .query_row("SELECT count FROM partitions", [], |r| r.get(0))
        .optional()
        .db()?;
    let found = match recorded {
        Some(count) => Found::Recorded(
            u16::try_from(count)
                .ok()
                .and_then(Partitions::new)
                .ok_or_else(|| {
                    StoreError::Corrupt(format!(
                        "the partitions table holds {count}, not a count of 1 to {}",
                        Partitions::MAX
                    ))
                })?,
        ),
        None if found_version <= 0 => Found::Empty,
        None => Found::Unrecorded,
    };
    let partitions = partitions::settle(configured, found)?;
    tx.execute(
        "INSERT OR IGNORE INTO partitions (only, count) VALUES (1, ?1)",
        params![partitions.count()],
    )
    .db()?;
    tx.commit().db()?;
    Ok(partitions)
}

/// Runs one upgrade and stamps its version in the same transaction.
fn step(
    conn: &Connection,
    to: i64,
    upgrade: impl FnOnce(&Connection) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let tx = conn.unchecked_transaction().db()?;
    upgrade(&tx)?;
    tx.pragma_update(None, "user_version", to).db()?;
    tx.commit().db()
}
