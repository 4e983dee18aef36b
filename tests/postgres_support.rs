//! The private PostgreSQL servers of `support/postgres.rs` do what the PostgreSQL tests rely
//! on: they start with the durable settings on their own port, keep a committed write across
//! a SIGKILL of the postmaster and across `pg_ctl stop -m immediate`, and a promoted
//! synchronous standby holds every row its primary acknowledged. The shared server of a test
//! binary hands each test a database of its own.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;

use postgres_support::PostgresServer;

#[test]
fn a_server_starts_durable_on_its_own_loopback_port() {
    let server = PostgresServer::start();
    assert_ne!(server.port, 5432, "never the machine's shared server");
    for (setting, expected) in [
        ("fsync", "on"),
        ("synchronous_commit", "on"),
        ("full_page_writes", "on"),
        ("listen_addresses", "127.0.0.1"),
    ] {
        assert_eq!(
            server.psql(&format!("SHOW {setting}")),
            expected,
            "{setting}"
        );
    }
    assert_eq!(server.psql("SHOW port"), server.port.to_string());
    assert!(server.url().contains(&format!("127.0.0.1:{}", server.port)));
}

#[test]
fn extra_settings_win_and_last_across_a_restart() {
    let mut server = PostgresServer::start_with(&[("synchronous_commit", "off")]);
    assert_eq!(server.psql("SHOW synchronous_commit"), "off");
    server.stop_immediate();
    server.start_again();
    assert_eq!(server.psql("SHOW synchronous_commit"), "off");
}

#[test]
fn a_committed_write_survives_kill_9_and_an_immediate_stop() {
    let mut server = PostgresServer::start();
    let port = server.port;
    server.create_database("cb");
    server.psql_db("cb", "CREATE TABLE t (n int); INSERT INTO t VALUES (1)");

    let postmaster = server.pid();
    server.kill9();
    assert!(!server.is_running());
    assert!(
        server.try_psql("SELECT 1").is_err(),
        "nothing answers once the postmaster is killed"
    );
    server.start_again();
    assert_eq!(server.port, port, "the same port after a restart");
    assert_ne!(server.pid(), postmaster, "a new postmaster");
    assert_eq!(server.psql_db("cb", "SELECT n FROM t"), "1");

    server.psql_db("cb", "INSERT INTO t VALUES (2)");
    server.stop_immediate();
    server.start_again();
    assert_eq!(
        server.psql_db("cb", "SELECT string_agg(n::text, ',' ORDER BY n) FROM t"),
        "1,2"
    );
}

#[test]
fn a_promoted_synchronous_standby_has_every_acknowledged_row() {
    let mut primary = PostgresServer::start();
    primary.psql("CREATE TABLE t (n int)");
    let standby = PostgresServer::standby_of(&primary);
    assert_eq!(standby.psql("SELECT pg_is_in_recovery()"), "t");
    assert_eq!(
        primary.psql("SELECT sync_state FROM pg_stat_replication"),
        "sync"
    );

    // Acknowledged only once the standby flushed it: the commit is on both disks.
    primary.psql("INSERT INTO t VALUES (42)");
    primary.kill9();
    standby.promote();

    assert_eq!(standby.psql("SELECT pg_is_in_recovery()"), "f");
    assert_eq!(standby.psql("SELECT n FROM t"), "42");
    standby.psql("INSERT INTO t VALUES (43)");
    assert_eq!(standby.psql("SELECT count(*) FROM t"), "2");
}

#[test]
fn the_shared_server_gives_each_test_a_database_of_its_own() {
    let shared = PostgresServer::shared();
    assert!(
        std::ptr::eq(shared, PostgresServer::shared()),
        "one per binary"
    );
    let (a, b) = (shared.fresh_database(), shared.fresh_database());
    assert_ne!(a, b);
    let db = |url: &str| url.rsplit('/').next().unwrap().to_string();
    shared.psql_db(&db(&a), "CREATE TABLE t (n int)");
    assert_eq!(
        shared.psql_db(
            &db(&b),
            "SELECT count(*) FROM pg_tables WHERE tablename = 't'"
        ),
        "0"
    );
}
