//! The start-up check of a PostgreSQL store: will an acknowledged callback survive? The
//! settings come from `pg_settings` as this role's sessions see them, so a value set for the
//! role or the database (`ALTER ROLE ... SET`) counts as much as the server's, and each
//! message says where the value was set.
//!
//! * `fsync = off`: a crash of the machine can lose or corrupt what was committed. Refused
//!   under `store.require_durable = true`, else a warning.
//! * `synchronous_commit = off`: a commit is acknowledged before its WAL is flushed, so a crash
//!   of the server loses the last acknowledged callbacks. Refused or warned the same way.
//! * `full_page_writes = off`: a page torn by a power loss cannot be repaired. A warning.
//! * No synchronous standby (`synchronous_standby_names` empty): a 2xx survives a crash of the
//!   server, not the loss of its disk, and a failover to an asynchronous standby may lose the
//!   last acknowledged callbacks. A warning: many deployments accept that.
//! * A synchronous standby named but `synchronous_commit` weaker than `on` (`local`,
//!   `remote_write`), or none connected (every commit waits for one, and answers 503 after
//!   the store timeout): warnings.
//!
//! The decision ([`judge`]) is pure; [`read_settings`] is the one query.

use deadpool_postgres::Client;

use super::error::{Db, column};
use crate::durability::Verdict;
use crate::store::StoreError;

/// A setting's value for this role's sessions, and where it was set (`pg_settings.source`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    pub value: String,
    pub source: String,
}

impl Setting {
    pub fn new(value: &str, source: &str) -> Setting {
        Setting {
            value: value.to_string(),
            source: source.to_string(),
        }
    }

    /// Where the value comes from, for a message an operator acts on.
    fn origin(&self) -> String {
        ORIGINS
            .iter()
            .find(|(source, _)| *source == self.source)
            .map_or_else(
                || format!("set in the server's configuration ({})", self.source),
                |(_, origin)| origin.to_string(),
            )
    }
}

/// `pg_settings.source` values that are not the server's configuration, and what they mean.
const ORIGINS: [(&str, &str); 5] = [
    ("user", "set for this role (ALTER ROLE ... SET)"),
    ("database", "set for this database (ALTER DATABASE ... SET)"),
    (
        "database user",
        "set for this role in this database (ALTER ROLE ... IN DATABASE ... SET)",
    ),
    ("client", "set by the connection (the options of store.url)"),
    ("default", "the server's default"),
];

/// What decides whether an acknowledged write survives, as the server reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurabilitySettings {
    pub fsync: Setting,
    pub synchronous_commit: Setting,
    pub full_page_writes: Setting,
    pub synchronous_standby_names: Setting,
    /// Standbys `pg_stat_replication` shows as synchronous (`sync` or `quorum`); it shows
    /// them only to a role allowed to see replication (`pg_monitor`), so 0 may mean unseen.
    pub synchronous_standbys: i64,
}

/// Reads the settings in one query.
pub(super) async fn read_settings(client: &Client) -> Result<DurabilitySettings, StoreError> {
    let row = client
        .query_one(
            "SELECT \
               (SELECT array[setting, source] FROM pg_settings WHERE name = 'fsync'), \
               (SELECT array[setting, source] FROM pg_settings WHERE name = 'synchronous_commit'), \
               (SELECT array[setting, source] FROM pg_settings WHERE name = 'full_page_writes'), \
               (SELECT array[setting, source] FROM pg_settings \
                  WHERE name = 'synchronous_standby_names'), \
               (SELECT count(*) FROM pg_stat_replication \
                  WHERE sync_state IN ('sync', 'quorum'))",
            &[],
        )
        .await
        .db()?;
    let setting = |idx: usize| -> Result<Setting, StoreError> {
        let pair: Vec<String> = column(&row, idx)?;
        match pair.as_slice() {
            [value, source] => Ok(Setting::new(value, source)),
            _ => Err(StoreError::Corrupt(format!(
                "pg_settings answered {pair:?} for a setting"
            ))),
        }
    };
    Ok(DurabilitySettings {
        fsync: setting(0)?,
        synchronous_commit: setting(1)?,
        full_page_writes: setting(2)?,
        synchronous_standby_names: setting(3)?,
        synchronous_standbys: column(&row, 4)?,
    })
}

/// Refuses (`require_durable`) or warns about what could lose an acknowledged callback.
pub fn judge(settings: &DurabilitySettings, require_durable: bool) -> Verdict {
    let mut doubts = Vec::new();
    if settings.fsync.value == "off" {
        doubts.push(format!(
            "PostgreSQL fsync is off ({}): a crash of its machine can lose or corrupt \
             acknowledged callbacks; set fsync = on",
            settings.fsync.origin()
        ));
    }
    if settings.synchronous_commit.value == "off" {
        doubts.push(format!(
            "PostgreSQL synchronous_commit is off ({}): a commit is acknowledged before it is \
             on disk, so a crash of the server loses the last acknowledged callbacks; set \
             synchronous_commit = on",
            settings.synchronous_commit.origin()
        ));
    }
    if require_durable && !doubts.is_empty() {
        return Verdict::Refuse(format!(
            "{}; or set store.require_durable = false to start anyway",
            doubts.join("; ")
        ));
    }
    let mut warnings = doubts;
    if !warnings.is_empty() {
        warnings.push("set store.require_durable = true to refuse to start like this".into());
    }
    if settings.full_page_writes.value == "off" {
        warnings.push(format!(
            "PostgreSQL full_page_writes is off ({}): a page torn by a power loss cannot be \
             repaired from the WAL",
            settings.full_page_writes.origin()
        ));
    }
    if settings.synchronous_standby_names.value.trim().is_empty() {
        warnings.push(
            "PostgreSQL has no synchronous standby (synchronous_standby_names is empty): a \
             2xx survives a crash of the server, not the loss of its disk, and a failover to \
             an asynchronous standby may lose the last acknowledged callbacks"
                .into(),
        );
    } else {
        match settings.synchronous_commit.value.as_str() {
            "local" | "remote_write" => warnings.push(format!(
                "PostgreSQL synchronous_commit is {} ({}): a commit does not wait for the \
                 synchronous standby to flush it, so a failover may lose the last \
                 acknowledged callbacks; set synchronous_commit = on",
                settings.synchronous_commit.value,
                settings.synchronous_commit.origin()
            )),
            _ => {}
        }
        if settings.synchronous_standbys == 0 {
            warnings.push(format!(
                "PostgreSQL names synchronous standbys ({}) but none is connected as one (or \
                 this role may not see pg_stat_replication): every commit waits for one, and \
                 callbackd answers 503 after store.timeout_ms until it connects",
                settings.synchronous_standby_names.value
            ));
        }
    }
    Verdict::Start { warnings }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn durable() -> DurabilitySettings {
        DurabilitySettings {
            fsync: Setting::new("on", "default"),
            synchronous_commit: Setting::new("on", "default"),
            full_page_writes: Setting::new("on", "default"),
            synchronous_standby_names: Setting::new("*", "configuration file"),
            synchronous_standbys: 1,
        }
    }

    fn warnings(verdict: Verdict) -> Vec<String> {
        match verdict {
            Verdict::Start { warnings } => warnings,
            Verdict::Refuse(why) => panic!("refused: {why}"),
        }
    }

    #[test]
    fn a_durable_server_with_a_synchronous_standby_starts_silently() {
        for require_durable in [true, false] {
            assert_eq!(
                warnings(judge(&durable(), require_durable)),
                Vec::<String>::new()
            );
        }
    }

    #[test]
    fn fsync_or_synchronous_commit_off_is_refused_when_durability_is_required() {
        let mut no_fsync = durable();
        no_fsync.fsync = Setting::new("off", "configuration file");
        let mut role_async = durable();
        role_async.synchronous_commit = Setting::new("off", "user");
        for (settings, expected) in [
            (no_fsync, "fsync is off (set in the server's configuration"),
            (role_async, "synchronous_commit is off (set for this role"),
        ] {
            let Verdict::Refuse(why) = judge(&settings, true) else {
                panic!("{expected}: not refused");
            };
            assert!(why.contains(expected), "{why}");
            assert!(why.contains("store.require_durable = false"), "{why}");
            let w = warnings(judge(&settings, false));
            assert!(w.iter().any(|m| m.contains(expected)), "{w:?}");
            assert!(
                w.iter().any(|m| m.contains("require_durable = true")),
                "{w:?}"
            );
        }
    }

    #[test]
    fn no_synchronous_standby_is_a_warning_even_when_durability_is_required() {
        let mut alone = durable();
        alone.synchronous_standby_names = Setting::new("", "default");
        alone.synchronous_standbys = 0;
        for require_durable in [true, false] {
            let w = warnings(judge(&alone, require_durable));
            assert_eq!(w.len(), 1, "{w:?}");
            assert!(w[0].contains("no synchronous standby"), "{w:?}");
        }
    }

    #[test]
    fn a_named_standby_that_commits_do_not_wait_for_is_a_warning() {
        let mut local = durable();
        local.synchronous_commit = Setting::new("local", "database");
        let w = warnings(judge(&local, true));
        assert!(
            w.iter()
                .any(|m| m.contains("synchronous_commit is local (set for this database")),
            "{w:?}"
        );
        let mut missing = durable();
        missing.synchronous_standbys = 0;
        let w = warnings(judge(&missing, true));
        assert!(w.iter().any(|m| m.contains("none is connected")), "{w:?}");
    }

    #[test]
    fn full_page_writes_off_is_a_warning() {
        let mut torn = durable();
        torn.full_page_writes = Setting::new("off", "configuration file");
        let w = warnings(judge(&torn, true));
        assert!(
            w.iter().any(|m| m.contains("full_page_writes is off")),
            "{w:?}"
        );
    }
}
