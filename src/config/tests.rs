//! The loader and the validation, through `Config::from_toml_str`.

use std::path::Path;

use super::*;

fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    Config::from_toml_str(
        text,
        Path::new("test.toml"),
        env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
    )
}

#[test]
fn defaults_match_the_design() {
    let c = load("", &[]).unwrap();
    assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.server.max_body_bytes, 1_048_576);
    assert_eq!(c.server.max_streams_per_connection, 32);
    assert_eq!(c.server.max_buffered_bytes, 64 * 1_048_576);
    assert_eq!(c.store.dedupe_ttl_secs, 2_592_000);
    assert_eq!(c.store.payment_retention_secs, 400 * 86_400);
    assert_eq!(c.store.sweep_interval_secs, 30);
    assert_eq!(c.dispatch.max_age_secs, 604_800);
    assert_eq!(c.dispatch.initial_backoff_ms, 1000);
    assert_eq!(c.dispatch.max_backoff_secs, 3600);
    assert_eq!(c.dispatch.request_timeout_ms, 10_000);
    assert_eq!(c.dispatch.concurrency, 64);
    assert!(!c.dispatch.allow_private_networks);
    assert_eq!(c.store.min_replicas_acked, 0);
    assert!(matches!(
        c.store_location().unwrap(),
        StoreLocation::Sqlite(_)
    ));
}

#[test]
fn env_overrides_win_and_parse_types() {
    let c = load(
        "[server]\nlisten = \"127.0.0.1:1\"\n",
        &[
            ("CALLBACKD__SERVER__LISTEN", "127.0.0.1:9000"),
            ("CALLBACKD__STORE__URL", "redis://127.0.0.1:6379/0"),
            ("CALLBACKD__DISPATCH__CONCURRENCY", "8"),
            ("CALLBACKD__SOURCES__P__SIGNATURE", "none"),
            ("OTHER", "x"),
        ],
    )
    .unwrap();
    assert_eq!(c.server.listen.port(), 9000);
    assert_eq!(
        c.store_location().unwrap(),
        StoreLocation::Redis("redis://127.0.0.1:6379/0".into())
    );
    assert_eq!(c.dispatch.concurrency, 8);
    assert_eq!(c.sources["p"].signature, SignatureScheme::None);
}

#[test]
fn errors_name_the_key() {
    let cases = [
        ("[server]\nlisten = \"nope\"\n", "server.listen"),
        ("[store]\nurl = \"mysql://x\"\n", "store.url"),
        ("[dispatch]\nconcurency = 3\n", "dispatch"),
        ("[dispatch]\nconcurrency = 0\n", "dispatch.concurrency"),
        (
            "[store]\ndedupe_ttl_secs = 100\npayment_retention_secs = 99\n",
            "store.payment_retention_secs",
        ),
        (
            "[store]\nsweep_interval_secs = 61\n",
            "store.sweep_interval_secs",
        ),
        (
            "[store]\nsweep_interval_secs = 0\n",
            "store.sweep_interval_secs",
        ),
        (
            "[server]\nmax_streams_per_connection = 0\n",
            "server.max_streams_per_connection",
        ),
        (
            "[server]\nmax_buffered_bytes = 1000\n",
            "server.max_buffered_bytes",
        ),
        ("[dispatch]\nlease_secs = 10\n", "dispatch.lease_secs"),
        (
            "[store]\nurl = \"redis://127.0.0.1:6379/0\"\nmin_replicas_acked = 17\n",
            "store.min_replicas_acked",
        ),
        (
            "[store]\nmin_replicas_acked = 1\n",
            "store.min_replicas_acked",
        ),
        ("[store]\npartitions = 0\n", "store.partitions"),
        ("[store]\npartitions = 257\n", "store.partitions"),
        ("[store]\npartitions = -1\n", "store.partitions"),
        ("[sources.p]\nsignature = \"payzu\"\n", "sources.p.secrets"),
        (
            "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"whsec_!!\"]\n",
            "sources.p.secrets[0]",
        ),
        (
            "[sources.p]\nsignature = \"hmac-sha256\"\nsecrets = [\"s\"]\n",
            "sources.p.signature_header",
        ),
        (
            "[sources.p]\nsignature = \"none\"\ndedupe_fields = [\"status\"]\n",
            "sources.p.dedupe_fields[0]",
        ),
        (
            "[sources.p]\nsignature = \"rot13\"\n",
            "sources.p.signature",
        ),
        (
            "[sources.p]\nsignature = \"none\"\nforward_url = \"http://10.1.2.3/hook\"\n",
            "sources.p.allow_private_forward_url",
        ),
        (
            "[sources.p]\nsignature = \"none\"\nforward_url = \"http://[::1]:9/hook\"\n",
            "sources.p.forward_url",
        ),
    ];
    for (text, key) in cases {
        let err = load(text, &[]).unwrap_err().to_string();
        assert!(err.contains(key), "{text:?}: `{err}` does not name {key}");
    }
}

#[test]
fn empty_secrets_are_refused_for_every_scheme() {
    let cases = [
        (
            "[sources.p]\nsignature = \"payzu\"\nsecrets = [\"\"]\n",
            "sources.p.secrets[0]",
        ),
        (
            "[sources.p]\nsignature = \"hmac-sha256\"\nsignature_header = \"x-sig\"\n\
             secrets = [\"long-enough-secret\", \"\"]\n",
            "sources.p.secrets[1]",
        ),
        (
            "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"whsec_\"]\n",
            "sources.p.secrets[0]",
        ),
        (
            "[sources.p]\nsignature = \"standard-webhooks\"\nsecrets = [\"\"]\n",
            "sources.p.secrets[0]",
        ),
        (
            "[sources.p]\nsignature = \"none\"\nforward_secret = \"whsec_\"\n",
            "sources.p.forward_secret",
        ),
        (
            "[sources.p]\nsignature = \"none\"\nforward_secret = \"\"\n",
            "sources.p.forward_secret",
        ),
    ];
    for (text, key) in cases {
        // Refused on loopback too: an empty key lets anyone sign, wherever it listens.
        let err = load(text, &[]).unwrap_err().to_string();
        assert!(err.contains(key), "{text:?}: `{err}` does not name {key}");
        assert!(err.contains("empty"), "{text:?}: `{err}` does not say why");
    }
}

/// Every token and secret key, each given a strong value except `weak_key`, which gets
/// `weak`.
fn config_with(weak_key: &str, weak: &str) -> String {
    let strong = "0123456789abcdef0123456789abcdef";
    // 32 random-looking bytes, base64.
    let strong_whsec = "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    let pick = |key: &str, default: &str| {
        if key == weak_key {
            weak.to_string()
        } else {
            default.to_string()
        }
    };
    format!(
        "[auth]\nconnector_tokens = [\"{}\"]\nadmin_tokens = [\"{}\"]\n\
         [sources.p]\nsignature = \"payzu\"\nsecrets = [\"{}\"]\n\
         [sources.w]\nsignature = \"standard-webhooks\"\nsecrets = [\"{}\"]\n\
         forward_secret = \"{}\"\n",
        pick("auth.connector_tokens[0]", strong),
        pick("auth.admin_tokens[0]", strong),
        pick("sources.p.secrets[0]", strong),
        pick("sources.w.secrets[0]", strong_whsec),
        pick("sources.w.forward_secret", strong_whsec),
    )
}

#[test]
fn placeholders_and_short_secrets_are_refused_off_loopback() {
    let public = [("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")];
    assert!(
        load(&config_with("", ""), &public).is_ok(),
        "strong values pass"
    );
    // 8 bytes, base64: long enough as text, too short as a key.
    let short_whsec = "whsec_MDEyMzQ1Njc=";
    let cases = [
        (
            "auth.connector_tokens[0]",
            "change-me-connector-token",
            "placeholder",
        ),
        (
            "auth.admin_tokens[0]",
            "change-me-admin-token",
            "placeholder",
        ),
        (
            "auth.admin_tokens[0]",
            "Change-Me-Please-0123456789",
            "placeholder",
        ),
        ("auth.admin_tokens[0]", "fifteen-bytes!!", "15 bytes"),
        (
            "sources.p.secrets[0]",
            "change-me-payzu-secret",
            "placeholder",
        ),
        ("sources.p.secrets[0]", "short-secret", "12 bytes"),
        ("sources.w.secrets[0]", short_whsec, "8 bytes"),
        ("sources.w.forward_secret", short_whsec, "8 bytes"),
    ];
    for (key, weak, why) in cases {
        let text = config_with(key, weak);
        for listen in ["0.0.0.0:8080", "192.0.2.10:8080", "[::]:8080"] {
            let err = load(&text, &[("CALLBACKD__SERVER__LISTEN", listen)])
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{key} on {listen}: `{err}`");
            assert!(
                err.contains(why),
                "{key} on {listen}: `{err}` lacks `{why}`"
            );
            assert!(!err.contains(weak), "the value is never echoed: `{err}`");
        }
        for listen in ["127.0.0.1:8080", "[::1]:8080"] {
            assert!(
                load(&text, &[("CALLBACKD__SERVER__LISTEN", listen)]).is_ok(),
                "{key} = {weak:?} is fine on loopback {listen}"
            );
        }
    }
}

#[test]
fn the_example_config_is_refused_off_loopback() {
    let example = include_str!("../../config.toml");
    assert!(
        load(example, &[]).is_ok(),
        "it serves on 127.0.0.1 as shipped"
    );
    let err = load(example, &[("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("auth.connector_tokens[0]"), "{err}");
}

#[test]
fn private_forward_urls_need_their_own_switch() {
    let internal = "[sources.p]\nsignature = \"none\"\nforward_url = \"http://10.1.2.3/hook\"\n";
    // The callbackUrl switch does not open forward_url.
    let with_dispatch_switch = format!("[dispatch]\nallow_private_networks = true\n{internal}");
    assert!(load(&with_dispatch_switch, &[]).is_err());
    let allowed = format!("{internal}allow_private_forward_url = true\n");
    let c = load(&allowed, &[]).unwrap();
    assert!(c.sources["p"].allow_private_forward_url);
    assert!(!c.dispatch.allow_private_networks);
    // A public address, or a name (checked at delivery, where DNS answers), is fine.
    for url in [
        "https://93.184.215.14/hook",
        "https://merchant.example.com/hook",
    ] {
        let text = format!("[sources.p]\nsignature = \"none\"\nforward_url = \"{url}\"\n");
        assert!(load(&text, &[]).is_ok(), "{url}");
    }
}

#[test]
fn env_values_take_the_type_of_their_key() {
    let c = load(
        "[sources.p]\nsignature = \"payzu\"\nsecrets = [\"file-secret-1\"]\n",
        &[
            // Digits, a boolean and a date are tokens, secrets and header values too.
            ("CALLBACKD__AUTH__CONNECTOR_TOKENS", "1234567890123456"),
            (
                "CALLBACKD__AUTH__ADMIN_TOKENS",
                "[\"12345678\", \"87654321\"]",
            ),
            ("CALLBACKD__SOURCES__P__SECRETS", "9876543210"),
            (
                "CALLBACKD__SOURCES__P__FORWARD_HEADERS__X_API_KEY",
                "123456",
            ),
            ("CALLBACKD__SOURCES__P__FORWARD_HEADERS__X_FLAG", "true"),
            (
                "CALLBACKD__SOURCES__P__FORWARD_HEADERS__X_DAY",
                "1979-05-27",
            ),
            ("CALLBACKD__LOG__LEVEL", "\"warn\""),
            // Numbers and booleans still are where the key wants one.
            ("CALLBACKD__DISPATCH__CONCURRENCY", "8"),
            ("CALLBACKD__DISPATCH__ALLOW_PRIVATE_NETWORKS", "true"),
        ],
    )
    .unwrap();
    assert_eq!(c.auth.connector_tokens, ["1234567890123456"]);
    assert_eq!(c.auth.admin_tokens, ["12345678", "87654321"]);
    let p = &c.sources["p"];
    assert_eq!(p.secrets, ["9876543210"]);
    assert_eq!(p.forward_headers["x_api_key"], "123456");
    assert_eq!(p.forward_headers["x_flag"], "true");
    assert_eq!(p.forward_headers["x_day"], "1979-05-27");
    assert_eq!(c.log.level, "warn");
    assert_eq!(c.dispatch.concurrency, 8);
    assert!(c.dispatch.allow_private_networks);
    // A digit token off loopback is judged by its length like any other.
    let public = [
        ("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080"),
        ("CALLBACKD__AUTH__ADMIN_TOKENS", "123456789012345"),
    ];
    let err = load("", &public).unwrap_err().to_string();
    assert!(
        err.contains("auth.admin_tokens[0]") && err.contains("15 bytes"),
        "{err}"
    );
}

#[test]
fn env_values_that_fit_no_reading_keep_their_first_error() {
    let cases = [
        (
            "CALLBACKD__DISPATCH__CONCURRENCY",
            "eight",
            "config key `dispatch.concurrency`: invalid type: string \"eight\", expected usize",
        ),
        (
            "CALLBACKD__SERVER__LISTEN",
            "8080",
            "config key `server.listen`: invalid type: integer `8080`",
        ),
        (
            "CALLBACKD__AUTH__ADMIN_TOKENS",
            "[\"12345678\", 9]",
            "config key `auth.admin_tokens[1]`: invalid type: integer `9`",
        ),
        (
            "CALLBACKD__AUTH__ADMIN_TOKENS",
            "[\"unclosed-list\"",
            "config key `auth.admin_tokens`: invalid type: string",
        ),
    ];
    for (var, value, message) in cases {
        let err = load("", &[(var, value)]).unwrap_err().to_string();
        assert!(err.starts_with(message), "{var}={value}: `{err}`");
    }
}

/// The invalid key and message of a config that must be refused.
fn refusal(text: &str) -> (String, String) {
    match load(text, &[]) {
        Err(ConfigError::Invalid { key, message }) => (key, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn key_prefix_defaults_to_the_layout_names_and_refuses_what_would_break_them() {
    let c = load("", &[]).unwrap();
    assert_eq!(c.store.key_prefix, "cb");
    for bad in ["", "a:b", "{p}", "a b", "cb*", &"x".repeat(65)] {
        let (key, message) = refusal(&format!("[store]\nkey_prefix = \"{bad}\"\n"));
        assert_eq!(key, "store.key_prefix", "{bad:?}: {message}");
    }
}

#[test]
fn tls_files_are_checked_by_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing-ca.pem");
    let (key, message) = refusal(&format!(
        "[store]\nurl = \"rediss://127.0.0.1:6380/0\"\ntls_ca_file = \"{}\"\n",
        missing.display()
    ));
    assert_eq!(key, "store.tls_ca_file");
    assert!(message.contains("missing-ca.pem"), "{message}");

    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let (key, message) = refusal(&format!(
        "[store]\nurl = \"rediss://127.0.0.1:6380/0\"\ntls_ca_file = \"{}\"\n",
        garbage.display()
    ));
    assert_eq!(key, "store.tls_ca_file");
    assert!(message.contains("garbage.pem"), "{message}");

    let (key, _) = refusal(&format!(
        "[store]\nurl = \"redis://127.0.0.1:6379/0\"\ntls_ca_file = \"{}\"\n",
        garbage.display()
    ));
    assert_eq!(key, "store.tls_ca_file", "TLS files need a rediss:// URL");

    let (key, _) = refusal(&format!(
        "[store]\nurl = \"rediss://127.0.0.1:6380/0\"\ntls_cert_file = \"{}\"\n",
        garbage.display()
    ));
    assert_eq!(key, "store.tls_key_file", "a certificate needs its key");
}

#[test]
fn key_prefix_and_tls_files_come_from_the_environment_too() {
    let c = load(
        "",
        &[
            ("CALLBACKD__STORE__URL", "rediss://127.0.0.1:6380/0"),
            ("CALLBACKD__STORE__KEY_PREFIX", "staging"),
            ("CALLBACKD__STORE__TLS_CA_FILE", "/nonexistent/ca.pem"),
        ],
    );
    match c {
        Err(ConfigError::Invalid { key, message }) => {
            assert_eq!(key, "store.tls_ca_file");
            assert!(message.contains("/nonexistent/ca.pem"), "{message}");
        }
        other => panic!("expected the CA file to be read, got {other:?}"),
    }
}

#[test]
fn a_refused_store_url_does_not_echo_its_password() {
    let (key, message) = refusal("[store]\nurl = \"redis:/user:hunter2-pw@127.0.0.1:6379\"\n");
    assert_eq!(key, "store.url");
    assert!(!message.contains("hunter2-pw"), "{message}");
}

#[test]
fn breaker_and_host_limits_are_checked_by_their_key() {
    let c = load("", &[]).unwrap();
    assert_eq!(c.dispatch.breaker, BreakerConfig::default());
    assert_eq!(c.dispatch.breaker.failures, 20);
    assert!(c.dispatch.hosts.is_empty());
    let c = load(
        "[dispatch.breaker]\nfailures = 5\nprobe_secs = 2\n\
         [dispatch.hosts.\"gw.example:8443\"]\nmax_per_second = 50\nconcurrency = 4\n\
         [dispatch.hosts.\"other.example\"]\nmax_per_second = 0.5\n",
        &[],
    )
    .unwrap();
    assert_eq!(c.dispatch.breaker.failures, 5);
    assert_eq!(
        c.dispatch.hosts["gw.example:8443"],
        HostConfig {
            max_per_second: Some(50.0),
            concurrency: Some(4)
        }
    );
    for (text, key, says) in [
        (
            "[dispatch.breaker]\nfailures = 0",
            "dispatch.breaker.failures",
            "must be ≥ 1",
        ),
        (
            "[dispatch.breaker]\nprobe_secs = 0",
            "dispatch.breaker.probe_secs",
            "must be ≥ 1",
        ),
        (
            "[dispatch.breaker]\nprobe_secs = 10\nmax_probe_secs = 5",
            "dispatch.breaker.max_probe_secs",
            "must be ≥ dispatch.breaker.probe_secs",
        ),
        (
            "[dispatch.hosts.\"gw.example/cb\"]\nconcurrency = 2",
            "dispatch.hosts.\"gw.example/cb\"",
            "is not host or host:port",
        ),
        (
            "[dispatch.hosts.\"gw.example:http\"]\nconcurrency = 2",
            "dispatch.hosts.\"gw.example:http\"",
            "is not host or host:port",
        ),
        (
            "[dispatch.hosts.\"GW.example\"]\nconcurrency = 2\n[dispatch.hosts.\"gw.example\"]\nconcurrency = 3",
            "dispatch.hosts.\"gw.example\"",
            "names the same host",
        ),
        (
            "[dispatch.hosts.\"gw.example\"]\nmax_per_second = 0",
            "dispatch.hosts.\"gw.example\".max_per_second",
            "must be > 0",
        ),
        (
            "[dispatch.hosts.\"gw.example\"]\nconcurrency = 0",
            "dispatch.hosts.\"gw.example\".concurrency",
            "must be ≥ 1",
        ),
    ] {
        let (refused, message) = refusal(text);
        assert_eq!(refused, key, "{text}");
        assert!(message.contains(says), "{text}: {message}");
    }
}

/// `provider_api_url` and `provider_api_token` (a recovery's provider API): both or neither,
/// the URL checked naming its key, the token as strong as the other secrets and never echoed.
#[test]
fn the_provider_api_is_both_or_neither_and_its_token_never_echoed() {
    let source = |extra: &str| {
        format!("[sources.p]\nsignature = \"payzu\"\nsecrets = [\"long-enough-secret\"]\n{extra}")
    };
    let token = "tok-0123456789abcdef0123456789";
    let url = "https://api.payzu.example";
    let ok = load(
        &source(&format!(
            "provider_api_url = \"{url}/\"\nprovider_api_token = \"{token}\"\n"
        )),
        &[],
    )
    .unwrap();
    let p = &ok.sources["p"];
    assert_eq!(p.provider_api_token.as_ref().unwrap().expose(), token);
    assert!(!format!("{ok:?}").contains(token), "Debug hides the token");
    assert!(
        load(&source(""), &[]).unwrap().sources["p"]
            .provider_api_url
            .is_none()
    );
    let cases = [
        (
            format!("provider_api_url = \"{url}\"\n"),
            "sources.p.provider_api_token",
            "is required with sources.p.provider_api_url",
        ),
        (
            format!("provider_api_token = \"{token}\"\n"),
            "sources.p.provider_api_url",
            "is required with sources.p.provider_api_token",
        ),
        (
            format!("provider_api_url = \"ftp://x\"\nprovider_api_token = \"{token}\"\n"),
            "sources.p.provider_api_url",
            "http:// or https://",
        ),
        (
            format!("provider_api_url = \"not a url\"\nprovider_api_token = \"{token}\"\n"),
            "sources.p.provider_api_url",
            "not a URL",
        ),
        (
            format!(
                "provider_api_url = \"https://u:hunter2@api.example\"\nprovider_api_token = \"{token}\"\n"
            ),
            "sources.p.provider_api_url",
            "must not hold credentials",
        ),
        (
            format!("provider_api_url = \"{url}\"\nprovider_api_token = \"\"\n"),
            "sources.p.provider_api_token",
            "is empty",
        ),
        (
            format!("provider_api_url = \"{url}\"\nprovider_api_token = \"short\"\n"),
            "sources.p.provider_api_token",
            "at least 8",
        ),
    ];
    for (extra, key, why) in cases {
        let err = load(&source(&extra), &[]).unwrap_err().to_string();
        assert!(
            err.contains(&format!("`{key}`")) && err.contains(why),
            "{extra}: {err}"
        );
        assert!(!err.contains(token) && !err.contains("hunter2"), "{err}");
    }
    // Off loopback, a placeholder or short token is refused as every secret is.
    let public = [("CALLBACKD__SERVER__LISTEN", "0.0.0.0:8080")];
    let strong = "[auth]\nadmin_tokens = [\"0123456789abcdef0123\"]\n\
                  connector_tokens = [\"abcdef0123456789abcd\"]\n";
    for weak in ["change-me-provider-token", "tok-1234567"] {
        let text = format!(
            "{strong}[sources.p]\nsignature = \"payzu\"\nsecrets = [\"0123456789abcdef0123456789\"]\n\
             provider_api_url = \"{url}\"\nprovider_api_token = \"{weak}\"\n"
        );
        let err = load(&text, &public).unwrap_err().to_string();
        assert!(err.contains("`sources.p.provider_api_token`"), "{err}");
        assert!(!err.contains(weak), "{err}");
    }
}
