//! The PostgreSQL engine over TLS (`sslmode`, `store.tls_ca_file`, client certificates) and
//! with a password in `store.url`, against private servers that refuse plain connections.
//! Certificates are made by the `openssl` CLI in a temp dir for each test; the password
//! never reaches an error.

#[path = "support/postgres.rs"]
#[allow(dead_code)]
mod postgres_support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use callbackd::store::postgres::{ClientCertificate, PostgresOptions, PostgresStore, PostgresTls};
use callbackd::store::{Store, StoreError};
use postgres_support::PostgresServer;

const RETENTION_SECS: u64 = 2_592_000;
const TIMEOUT: Duration = Duration::from_secs(3);

/// A CA, a server certificate for 127.0.0.1 and a client certificate for the role
/// `certified`, all signed by it.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        pki.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=callbackd test ca",
        ]);
        pki.leaf(
            "server",
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        // `cert` authentication maps the certificate's CN to the role.
        pki.leaf("client", "certified", "extendedKeyUsage=clientAuth\n");
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("reads PEM")
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .expect("openssl on PATH");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `<name>.crt` and `<name>.key` for `cn`, signed by the CA, with `extensions`.
    fn leaf(&self, name: &str, cn: &str, extensions: &str) {
        std::fs::write(self.path(&format!("{name}.ext")), extensions).expect("writes");
        let (key, csr, crt, ext) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }

    /// TLS options trusting this CA, with the client certificate when `client`.
    fn options(&self, client: bool) -> PostgresOptions {
        PostgresOptions {
            tls: PostgresTls {
                ca_pem: Some(self.read("ca.crt")),
                client: client.then(|| ClientCertificate {
                    cert_pem: self.read("client.crt"),
                    key_pem: self.read("client.key"),
                }),
            },
            ..PostgresOptions::default()
        }
    }
}

/// A server that takes TLS only: `certified` by its client certificate, `pw` by its
/// password, anyone else without one; a plain connection is rejected.
fn tls_server(pki: &Pki) -> PostgresServer {
    let server = PostgresServer::start();
    let cert = server.install_file("server.crt", &pki.read("server.crt"));
    let key = server.install_file("server.key", &pki.read("server.key"));
    let ca = server.install_file("ca.crt", &pki.read("ca.crt"));
    server.reload_with(&[
        ("ssl", "on"),
        ("ssl_cert_file", &cert.display().to_string()),
        ("ssl_key_file", &key.display().to_string()),
        ("ssl_ca_file", &ca.display().to_string()),
    ]);
    server.psql("CREATE ROLE certified LOGIN SUPERUSER");
    server.psql("CREATE ROLE pw LOGIN SUPERUSER PASSWORD 'pg-s3cret'");
    server.prepend_hba(
        "hostssl all certified 127.0.0.1/32 cert\n\
         hostssl all pw 127.0.0.1/32 scram-sha-256\n\
         hostssl all all 127.0.0.1/32 trust\n\
         hostnossl all all 127.0.0.1/32 reject",
    );
    server
}

fn url(server: &PostgresServer, user: &str, query: &str) -> String {
    format!(
        "postgres://{user}@127.0.0.1:{}/postgres?{query}",
        server.port
    )
}

#[tokio::test]
async fn tls_verified_by_the_configured_ca_connects_in_every_sslmode_that_uses_it() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    for sslmode in ["prefer", "require", "verify-ca", "verify-full"] {
        let store = PostgresStore::connect_with(
            &url(&server, "postgres", &format!("sslmode={sslmode}")),
            TIMEOUT,
            RETENTION_SECS,
            &pki.options(false),
        )
        .await
        .unwrap_or_else(|e| panic!("sslmode={sslmode}: {e}"));
        store.ping().await.unwrap();
    }
}

#[tokio::test]
async fn a_server_certificate_that_does_not_verify_is_refused_not_waited_for() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    // No CA file: the system's roots do not know the test CA.
    let refused = PostgresStore::connect(
        &url(&server, "postgres", "sslmode=require"),
        TIMEOUT,
        RETENTION_SECS,
    )
    .await
    .expect_err("an unknown CA");
    assert!(matches!(refused, StoreError::Unavailable(_)), "{refused:?}");
    // Without TLS the server's rules reject the connection: a refusal too.
    let plain = PostgresStore::connect(
        &url(&server, "postgres", "sslmode=disable"),
        TIMEOUT,
        RETENTION_SECS,
    )
    .await
    .expect_err("plain connections are rejected");
    assert!(matches!(plain, StoreError::Unavailable(_)), "{plain:?}");
}

#[tokio::test]
async fn a_client_certificate_logs_in_where_the_server_asks_for_one() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let url = url(&server, "certified", "sslmode=verify-full");
    let store = PostgresStore::connect_with(&url, TIMEOUT, RETENTION_SECS, &pki.options(true))
        .await
        .expect("the certificate is the login");
    store.ping().await.unwrap();
    let refused = PostgresStore::connect_with(&url, TIMEOUT, RETENTION_SECS, &pki.options(false))
        .await
        .expect_err("no certificate, no login");
    assert!(matches!(refused, StoreError::Unavailable(_)), "{refused:?}");
}

#[tokio::test]
async fn a_password_logs_in_and_a_wrong_one_is_refused_without_being_shown() {
    let pki = Pki::new();
    let server = tls_server(&pki);
    let with = |password: &str| {
        format!(
            "postgres://pw:{password}@127.0.0.1:{}/postgres?sslmode=verify-full",
            server.port
        )
    };
    let store = PostgresStore::connect_with(
        &with("pg-s3cret"),
        TIMEOUT,
        RETENTION_SECS,
        &pki.options(false),
    )
    .await
    .expect("the right password");
    store.ping().await.unwrap();
    assert!(!format!("{store:?}").contains("pg-s3cret"));
    assert!(
        !store.shown_url().contains("pg-s3cret"),
        "{}",
        store.shown_url()
    );

    let refused = PostgresStore::connect_with(
        &with("wrong-pw"),
        TIMEOUT,
        RETENTION_SECS,
        &pki.options(false),
    )
    .await
    .expect_err("a wrong password");
    let StoreError::Unavailable(why) = &refused else {
        panic!("a refusal, not something to wait for: {refused:?}");
    };
    assert!(why.contains("28P01") || why.contains("password"), "{why}");
    assert!(!why.contains("wrong-pw"), "{why}");
}
