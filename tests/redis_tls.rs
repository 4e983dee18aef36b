//! Redis over TLS (`rediss://` with `store.tls_*`) and with an ACL user and password in
//! `store.url`, against private redis-servers and a private Redis Cluster. Certificates are made by the `openssl` CLI in a
//! temp dir for each test; the password never reaches callbackd's output.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use callbackd::clock::Millis;
use callbackd::store::Partitions;
use callbackd::store::ids::partition_of;
use callbackd::store::redis::{ClientIdentity, RedisOptions, RedisStore, RedisTls};
use callbackd::store::{AcceptOutcome, AcceptRequest, Store, StoreError};
use support::process::Process;
use support::redis::cluster::{RedisCluster, cluster_port};
use support::redis::{AclUser, RedisServer, free_port};

const NOW: Millis = 1_700_000_000_000;

/// A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        let pki = Pki {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        pki.ca("ca");
        pki.leaf(
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        );
        pki.leaf("client", "extendedKeyUsage=clientAuth\n");
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
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

    /// A self-signed CA: `<name>.crt`, `<name>.key`.
    fn ca(&self, name: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN=callbackd test {name}"),
        ]);
    }

    /// A certificate signed by `ca` with the given v3 extensions: `<name>.crt`, `<name>.key`.
    fn leaf(&self, name: &str, extensions: &str) {
        std::fs::write(self.path(&format!("{name}.ext")), extensions).expect("writes");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
            "-subj",
            &format!("/CN={name}"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
        ]);
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("reads PEM")
    }

    /// TLS options trusting this CA, with the client certificate when `client`.
    fn options(&self, client: bool) -> RedisOptions {
        RedisOptions {
            tls: Some(RedisTls {
                ca_pem: self.read("ca.crt"),
                client: client.then(|| ClientIdentity {
                    cert_pem: self.read("client.crt"),
                    key_pem: self.read("client.key"),
                }),
            }),
            ..RedisOptions::default()
        }
    }
}

/// A redis-server also listening with TLS on the returned port (the plain port stays for
/// redis-cli and the readiness check).
fn tls_server(pki: &Pki, auth_clients: bool) -> (RedisServer, u16) {
    let tls_port = free_port().to_string();
    let server = RedisServer::start_with_args(
        "always",
        &[
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            pki.path("server.crt").to_str().expect("utf-8 path"),
            "--tls-key-file",
            pki.path("server.key").to_str().expect("utf-8 path"),
            "--tls-ca-cert-file",
            pki.path("ca.crt").to_str().expect("utf-8 path"),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ],
    );
    (server, tls_port.parse().expect("a port"))
}

fn rediss(port: u16) -> String {
    format!("rediss://127.0.0.1:{port}/0")
}

async fn connect(url: &str, options: &RedisOptions) -> Result<RedisStore, StoreError> {
    RedisStore::connect_with(url, Duration::from_secs(3), 3600, options).await
}

fn request(dedupe_key: &str) -> AcceptRequest {
    support::notification_request(dedupe_key, "order-1", NOW)
}

/// The store accepts a callback once and replays it after.
async fn accepts_and_replays(store: &RedisStore) {
    assert_eq!(
        store
            .accept(request("claim/1"), NOW)
            .await
            .expect("accepts"),
        AcceptOutcome::Accepted
    );
    assert!(matches!(
        store
            .accept(request("claim/1"), NOW)
            .await
            .expect("replays"),
        AcceptOutcome::Replayed { .. }
    ));
}

fn message(result: Result<RedisStore, StoreError>) -> String {
    match result {
        Ok(_) => panic!("connected where it must not"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn a_tls_redis_accepts_and_replays_trusting_the_configured_ca() {
    let pki = Pki::new();
    let (_server, port) = tls_server(&pki, false);
    let store = connect(&rediss(port), &pki.options(false))
        .await
        .expect("connects over TLS");
    store.upgrade(NOW).await.expect("stamps the layout");
    accepts_and_replays(&store).await;
}

#[tokio::test]
async fn client_certificates_are_presented_when_the_server_asks() {
    let pki = Pki::new();
    let (_server, port) = tls_server(&pki, true);
    let store = connect(&rediss(port), &pki.options(true))
        .await
        .expect("connects with a client certificate");
    accepts_and_replays(&store).await;

    let refused = message(connect(&rediss(port), &pki.options(false)).await);
    assert!(
        refused.contains("CertificateRequired"),
        "the error says the server wants a client certificate: {refused}"
    );
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let pki = Pki::new();
    let other = Pki::new();
    let (_server, port) = tls_server(&pki, false);
    let refused = message(connect(&rediss(port), &other.options(false)).await);
    assert!(
        refused.contains("invalid peer certificate"),
        "the error says the server's certificate is the problem: {refused}"
    );
}

/// An ACL user with its own password, allowed everything callbackd needs.
fn acl_server(user: &str, password: &str) -> RedisServer {
    let server = RedisServer::start();
    let reply = server.cli(&[
        "ACL",
        "SETUSER",
        user,
        "on",
        &format!(">{password}"),
        "~*",
        "&*",
        "+@all",
    ]);
    assert_eq!(reply, "OK");
    server
}

#[tokio::test]
async fn an_acl_user_and_password_in_the_url_work_and_a_wrong_one_is_not_echoed() {
    let password = "pw-Secret-4711";
    let server = acl_server("callbackd", password);
    let url = format!("redis://callbackd:{password}@127.0.0.1:{}/0", server.port);
    let store = connect(&url, &RedisOptions::default())
        .await
        .expect("connects as the ACL user");
    accepts_and_replays(&store).await;

    let wrong = "pw-Wrong-0815";
    let url = format!("redis://callbackd:{wrong}@127.0.0.1:{}/0", server.port);
    let refused = message(connect(&url, &RedisOptions::default()).await);
    assert!(refused.contains("AuthenticationFailed"), "{refused}");
    assert!(!refused.contains(wrong), "{refused}");
}

/// On a cluster the URL names one node; the certificates and the ACL user's password must
/// reach every node the cluster client finds from it, over TLS all the way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_with_an_acl_user_is_reached_on_every_node() {
    let pki = Pki::new();
    // The nodes present it to each other on the cluster bus and for replication too.
    pki.leaf(
        "node",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n",
    );
    let password = "pw-Secret-4711";
    let user = AclUser {
        name: "callbackd".into(),
        password: password.into(),
    };
    let pem = |name: &str| pki.path(name).to_str().expect("utf-8 path").to_string();
    let cluster = RedisCluster::start_as(&user, || {
        [
            "--tls-port".to_string(),
            cluster_port().to_string(),
            "--tls-cluster".into(),
            "yes".into(),
            "--tls-replication".into(),
            "yes".into(),
            "--tls-cert-file".into(),
            pem("node.crt"),
            "--tls-key-file".into(),
            pem("node.key"),
            "--tls-ca-cert-file".into(),
            pem("ca.crt"),
            "--tls-auth-clients".into(),
            "no".into(),
        ]
        .to_vec()
    });
    // Every node refuses a client that does not log in, so the password must reach each one
    // the cluster client finds, not only the node the URL names.
    for node in cluster.nodes() {
        let anonymous = Command::new("redis-cli")
            .args(["-e", "-p", &node.port.to_string(), "PING"])
            .output()
            .expect("redis-cli on PATH");
        assert!(
            !anonymous.status.success(),
            "node {} answers without a password",
            node.port
        );
    }
    let tls_port = cluster.nodes()[0].cli(&["CONFIG", "GET", "tls-port"]);
    let tls_port = tls_port.lines().last().expect("CONFIG GET tls-port").trim();
    let url = format!("rediss://callbackd:{password}@127.0.0.1:{tls_port}/0");
    let store = connect(&url, &pki.options(false))
        .await
        .expect("connects to the cluster over TLS as the ACL user");
    store.upgrade(NOW).await.expect("stamps the layout");
    let mut partitions = BTreeMap::new();
    for i in 0..10_000 {
        let key = format!("order-{i}");
        partitions
            .entry(partition_of(&key, Partitions::DEFAULT))
            .or_insert(key);
    }
    for key in partitions.values() {
        let request = support::notification_request(&format!("claim/{key}"), key, NOW);
        let outcome = store.accept(request, NOW).await.expect("accepts");
        assert_eq!(outcome, AcceptOutcome::Accepted, "{key}");
    }
    let depth = store.depth().await.expect("counts on every master");
    assert_eq!(depth.pending, partitions.len() as u64);

    let wrong = format!("rediss://callbackd:pw-Wrong-0815@127.0.0.1:{tls_port}/0");
    let refused = message(connect(&wrong, &pki.options(false)).await);
    assert!(refused.contains("AuthenticationFailed"), "{refused}");
    assert!(!refused.contains("pw-Wrong-0815"), "{refused}");
}

fn config_file(dir: &Path, store_url: &str) -> PathBuf {
    let path = dir.join("callbackd.toml");
    std::fs::write(
        &path,
        format!(
            "[store]\nurl = \"{store_url}\"\n[auth]\nconnector_tokens = [\"{}\"]\n\
             admin_tokens = [\"{}\"]\n",
            support::CONNECTOR_TOKEN,
            support::ADMIN_TOKEN
        ),
    )
    .expect("writes the config");
    path
}

#[test]
fn the_password_in_store_url_is_never_printed_or_logged() {
    let password = "pw-Secret-4711";
    let server = acl_server("callbackd", password);
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("redis://callbackd:{password}@127.0.0.1:{}/0", server.port);
    let config = config_file(dir.path(), &url);

    let checked = Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args(["check-config", "--config", config.to_str().expect("utf-8")])
        .env_remove("CALLBACKD_CONFIG")
        .output()
        .expect("runs check-config");
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    assert!(checked.status.success(), "{out}");
    assert!(out.contains(&format!("127.0.0.1:{}", server.port)), "{out}");
    assert!(
        !out.contains(password),
        "check-config printed the password: {out}"
    );

    // A serving process at the most verbose level, and one refused for a wrong password.
    let log = dir.path().join("serve.log");
    let port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_callbackd"));
    cmd.args(["serve", "--config", config.to_str().expect("utf-8")])
        .env_remove("CALLBACKD_CONFIG")
        .env("CALLBACKD__SERVER__LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "trace")
        .stdout(std::fs::File::create(&log).expect("log file"))
        .stderr(std::fs::File::create(dir.path().join("serve.err")).expect("log file"));
    let mut serving = Process::spawn(cmd, port, Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("callbackd did not start: {e}"));
    serving.stop(Duration::from_secs(10));

    let wrong = "pw-Wrong-0815";
    let wrong_url = format!("redis://callbackd:{wrong}@127.0.0.1:{}/0", server.port);
    let refused = Command::new(env!("CARGO_BIN_EXE_callbackd"))
        .args([
            "serve",
            "--config",
            config_file(dir.path(), &wrong_url).to_str().expect("utf-8"),
        ])
        .env_remove("CALLBACKD_CONFIG")
        .env(
            "CALLBACKD__SERVER__LISTEN",
            format!("127.0.0.1:{}", free_port()),
        )
        .env("RUST_LOG", "trace")
        .output()
        .expect("runs serve");
    assert!(!refused.status.success(), "started with a wrong password");
    let logged = format!(
        "{}{}{}{}",
        std::fs::read_to_string(&log).expect("reads the log"),
        std::fs::read_to_string(dir.path().join("serve.err")).expect("reads the log"),
        String::from_utf8_lossy(&refused.stdout),
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(!logged.is_empty(), "nothing was logged to check");
    assert!(
        !logged.contains(password),
        "the password was logged: {logged}"
    );
    assert!(!logged.contains(wrong), "the password was logged: {logged}");
}

/// What `callbackd serve` waits for, a server that is not there yet, is `Unreachable`; what
/// ends it at once, a refusal that waiting would not change (a TLS error, a wrong password),
/// is not. (TLS to a port that speaks plain Redis gets no answer at all, like a silent server:
/// that one is waited for, each attempt logged.)
#[tokio::test]
async fn only_a_server_that_is_not_there_is_unreachable() {
    let nobody = format!("redis://127.0.0.1:{}/0", free_port());
    let result = connect(&nobody, &RedisOptions::default()).await;
    assert!(
        matches!(result, Err(StoreError::Unreachable(_))),
        "nothing listens: {:?}",
        result.err()
    );

    let pki = Pki::new();
    let (_server, port) = tls_server(&pki, true);
    let acl = acl_server("callbackd", "pw-Right-1");
    let refusals = [
        (
            "no client certificate",
            connect(&rediss(port), &pki.options(false)).await,
        ),
        (
            "a server certificate of another CA",
            connect(&rediss(port), &Pki::new().options(false)).await,
        ),
        (
            "a wrong password",
            connect(
                &format!("redis://callbackd:pw-Wrong-2@127.0.0.1:{}/0", acl.port),
                &RedisOptions::default(),
            )
            .await,
        ),
    ];
    for (what, result) in refusals {
        match result {
            Err(StoreError::Unreachable(why)) => {
                panic!("{what} is taken for a server not up yet: {why}")
            }
            Err(_) => {}
            Ok(_) => panic!("connected with {what}"),
        }
    }
}
