//! The layout version, recorded in the database (`callbackd_layout`), and the migrations that
//! bring a database to it: the SQL files of `migrations/`, numbered, applied in order.
//!
//! Why this way:
//!
//! - **One transaction under one lock.** Every start takes the same advisory transaction lock
//!   first, so two processes starting on one database never migrate at once: the second waits,
//!   then finds the layout done. PostgreSQL's DDL is transactional, so the files that are due
//!   and the rows recording their versions commit together or not at all; a crash mid-way
//!   leaves the older layout, and the next start applies them again.
//! - **A newer layout refuses an older binary**, naming both versions: its tables may mean
//!   things this code does not know, and writing them could damage them. The check runs at
//!   every start ([`read_layout`]), before anything is written.
//! - **The next layout** is a file `000N_<what>.sql` added to [`MIGRATIONS`] that changes the
//!   tables in place (`ALTER TABLE`, new tables and indexes; on a partitioned table, the
//!   parent, which PostgreSQL carries to every partition). It is applied by the first
//!   callbackd of the new layout that starts. A layout that only adds (a table, a column with
//!   a default: layouts 2 and 3) lets processes of the layout before it run on beside it. One
//!   that writes rows they cannot read (layout 4: `message_json` NULL; layout 5: a history's
//!   first row outside `history`, records compressed with a dictionary) is not applied while
//!   one of them is connected
//!   ([`refuse_older_peers`]): every older process is stopped first, as for a Redis layout
//!   change. Processes of an older layout started after the upgrade refuse to start
//!   ([`check_version`]).
//!
//! Beside the layout, `callbackd_partitions` records the store's partition count
//! (`store.partitions`, [`crate::store::partitions::settle`]) in the same transaction.

use std::time::Duration;

use deadpool_postgres::Client;

use super::error::{Db, column, corrupt};
use crate::store::StoreError;
use crate::store::partitions::{self, Found, Partitions};

/// The layout this binary reads and writes: the last of [`MIGRATIONS`].
pub const LAYOUT_VERSION: i32 = 5;

/// Each layout version and the SQL that builds it from the one before.
const MIGRATIONS: [(i32, &str); 5] = [
    (1, include_str!("migrations/0001_layout.sql")),
    (2, include_str!("migrations/0002_delivery_counts.sql")),
    (3, include_str!("migrations/0003_recoveries.sql")),
    (4, include_str!("migrations/0004_compact_records.sql")),
    (5, include_str!("migrations/0005_lean_finished_rows.sql")),
];

/// The layouts whose rows the processes of the layouts before them cannot read (4: a NULL
/// `message_json`; 5: a first history row in `messages.first_entry`, a record compressed with a
/// dictionary): neither is applied while one of those processes is connected
/// ([`refuse_older_peers`]).
const UNREADABLE_TO_OLDER: [i32; 2] = [4, 5];

/// The `application_name` this binary's connections carry when the URL names none: its layout
/// rides in it, so that a later upgrade can tell this process from a newer one.
pub(super) fn application_name() -> String {
    application_name_of(LAYOUT_VERSION)
}

/// The `application_name` a process of `layout` gives its connections when its URL names
/// none: layouts 1 to 3 did not name their layout.
fn application_name_of(layout: i32) -> String {
    if layout < 4 {
        "callbackd".to_string()
    } else {
        format!("callbackd/{layout}")
    }
}

/// Whether bringing a database from layout `found` to this binary's writes rows that the
/// processes using it now cannot read: not for an empty database, which none uses.
fn upgrade_unreadable_to_older(found: i32) -> bool {
    found >= 1
        && UNREADABLE_TO_OLDER
            .iter()
            .any(|&layout| layout > found && layout <= LAYOUT_VERSION)
}

/// How long a start may take to bring the layout up to date, waiting for another process's
/// upgrade included: layouts 4 and 5 each build an index over every retained message (layout
/// 4's took 0.44 s a million from memory, BENCHMARKS.md "PostgreSQL layout 4"), minutes for a
/// large month read from disk, far past the store timeout that bounds every other call.
pub(super) const MIGRATION_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The advisory lock every start takes before reading or changing the layout: a constant of
/// this engine ("callbackd" in ASCII, cut to 63 bits).
const LAYOUT_LOCK: i64 = 0x6361_6c6c_6261_636b;

/// What a start found: the layout version recorded (0 for an empty database) and the
/// partition count recorded, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    pub version: i32,
    pub partitions: Option<Partitions>,
}

/// Reads the recorded layout without writing anything, and refuses one newer than this
/// binary's.
pub(super) async fn read_layout(client: &Client) -> Result<Layout, StoreError> {
    let layout = read_recorded(client).await?;
    check_version(layout.version)?;
    Ok(layout)
}

/// Brings the database to [`LAYOUT_VERSION`] and records the partition count the store opens
/// with (`configured`, settled against what is recorded). Returns the version found.
pub(super) async fn migrate(
    client: &mut Client,
    configured: Option<Partitions>,
) -> Result<(i32, Partitions), StoreError> {
    let tx = client.transaction().await.db()?;
    // The connection's statement_timeout is the store timeout (connection.rs); this
    // transaction is bounded by MIGRATION_TIMEOUT instead, by the server too.
    tx.batch_execute(&format!(
        "SET LOCAL statement_timeout = {}",
        MIGRATION_TIMEOUT.as_millis()
    ))
    .await
    .db()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LAYOUT_LOCK])
        .await
        .db()?;
    // Read again under the lock: another process may have migrated while this one waited.
    let found = read_recorded(&tx).await?;
    check_version(found.version)?;
    if upgrade_unreadable_to_older(found.version) {
        refuse_older_peers(&tx, found.version).await?;
    }
    for (version, sql) in MIGRATIONS {
        if version > found.version {
            tx.batch_execute(sql).await.db()?;
            tx.execute(
                "INSERT INTO callbackd_layout (version) VALUES ($1)",
                &[&version],
            )
            .await
            .db()?;
        }
    }
    let recorded = match found.partitions {
        Some(held) => Found::Recorded(held),
        None => Found::Empty,
    };
    let partitions = partitions::settle(configured, recorded)?;
    tx.execute(
        "INSERT INTO callbackd_partitions (count) VALUES ($1) ON CONFLICT (only_row) DO NOTHING",
        &[&i32::from(partitions.count())],
    )
    .await
    .db()?;
    tx.commit().await.db()?;
    Ok((found.version, partitions))
}

/// The newest version `callbackd_layout` records (0 when there is no such table), and the
/// recorded partition count.
async fn read_recorded(
    client: &impl deadpool_postgres::GenericClient,
) -> Result<Layout, StoreError> {
    // The catalog read as a table, by this statement's snapshot: a name lookup
    // (`to_regclass`) may answer from a cache that a wait on the advisory lock did not
    // refresh, and miss the tables another process has just created.
    let row = client
        .query_one(
            "SELECT \
               EXISTS (SELECT FROM pg_tables \
                       WHERE schemaname = current_schema() AND tablename = 'callbackd_layout'), \
               EXISTS (SELECT FROM pg_tables \
                       WHERE schemaname = current_schema() AND tablename = 'callbackd_partitions')",
            &[],
        )
        .await
        .db()?;
    let (has_layout, has_partitions): (bool, bool) = (column(&row, 0)?, column(&row, 1)?);
    let version = if has_layout {
        let row = client
            .query_one(
                "SELECT coalesce(max(version), 0) FROM callbackd_layout",
                &[],
            )
            .await
            .db()?;
        column(&row, 0)?
    } else {
        0
    };
    let partitions = if has_partitions {
        let rows = client
            .query("SELECT count FROM callbackd_partitions", &[])
            .await
            .db()?;
        match rows.first() {
            Some(row) => {
                let count: i32 = column(row, 0)?;
                Some(
                    u16::try_from(count)
                        .ok()
                        .and_then(Partitions::new)
                        .ok_or_else(|| {
                            corrupt(format!(
                                "callbackd_partitions holds {count}, not a count of 1 to {}",
                                Partitions::MAX
                            ))
                        })?,
                )
            }
            None => None,
        }
    } else {
        None
    };
    Ok(Layout {
        version,
        partitions,
    })
}

/// Refuses to upgrade a database in use by a process of an older layout, which would misread
/// the rows written after the upgrade; names their server pids and where they connect from.
/// It sees them by the `application_name` each older layout gives its connections, so one
/// whose URL sets another is not seen, nor is one with no connection open at this instant; and
/// when this process carries one of those names itself (its URL sets it), it cannot tell older
/// ones from its own connections and does not look: docs/storage.md asks to stop every older
/// process first.
async fn refuse_older_peers(
    tx: &deadpool_postgres::Transaction<'_>,
    found: i32,
) -> Result<(), StoreError> {
    let mut older: Vec<String> = (1..LAYOUT_VERSION).map(application_name_of).collect();
    older.dedup();
    let row = tx
        .query_one(
            "SELECT count(*), coalesce(string_agg(pid || ' as ' || application_name || ' from ' || \
               coalesce(host(client_addr), 'a local socket or an address hidden from this role'), \
               ', ' ORDER BY pid), '') \
             FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
               AND application_name = ANY($1) \
               AND current_setting('application_name') <> ALL($1)",
            &[&older],
        )
        .await
        .db()?;
    let (count, from): (i64, String) = (column(&row, 0)?, column(&row, 1)?);
    if count == 0 {
        return Ok(());
    }
    Err(StoreError::Incompatible(format!(
        "the PostgreSQL store has layout version {found}, and {count} connection(s) of an older \
         callbackd (application_name {}; server pid {from}) are open: layout {LAYOUT_VERSION} \
         stores messages in a form layout {found} cannot read; stop every older callbackd, then \
         start this one",
        older
            .iter()
            .map(|name| format!("'{name}'"))
            .collect::<Vec<_>>()
            .join(" or ")
    )))
}

/// Refuses a layout newer than this binary's, naming both.
fn check_version(found: i32) -> Result<(), StoreError> {
    if found > LAYOUT_VERSION {
        return Err(StoreError::Incompatible(format!(
            "the PostgreSQL store has layout version {found}, newer than this callbackd's \
             {LAYOUT_VERSION}: it was upgraded by a newer callbackd; run that version or a \
             later one"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migrations_are_numbered_in_order_up_to_the_layout_version() {
        for (n, (version, _)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*version, n as i32 + 1);
        }
        assert_eq!(MIGRATIONS.last().map(|(v, _)| *v), Some(LAYOUT_VERSION));
    }

    #[test]
    fn an_upgrade_looks_for_older_processes_only_where_its_rows_are_new_to_them() {
        assert!(!upgrade_unreadable_to_older(0), "an empty database");
        for found in 1..LAYOUT_VERSION {
            assert!(upgrade_unreadable_to_older(found), "from layout {found}");
        }
        assert!(!upgrade_unreadable_to_older(LAYOUT_VERSION));
        assert_eq!(application_name_of(3), "callbackd");
        assert_eq!(application_name(), format!("callbackd/{LAYOUT_VERSION}"));
    }

    #[test]
    fn a_newer_layout_is_refused_naming_both_versions() {
        assert!(check_version(LAYOUT_VERSION).is_ok());
        assert!(check_version(0).is_ok());
        let Err(StoreError::Incompatible(why)) = check_version(LAYOUT_VERSION + 1) else {
            panic!("refused");
        };
        assert!(
            why.contains(&format!("layout version {}", LAYOUT_VERSION + 1))
                && why.contains(&format!("this callbackd's {LAYOUT_VERSION}")),
            "{why}"
        );
    }
}
