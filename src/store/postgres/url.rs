//! The operator's `store.url` for PostgreSQL, read without a connection: whether the driver
//! can read it, how it reaches the driver, and how messages show it. Nothing here imports the
//! rest of callbackd, so the config can check a URL at load without depending on the engine.

use std::str::FromStr;

use tokio_postgres::config::Config;

/// Query parameters whose values are secrets.
const SECRET_PARAMETERS: [&str; 2] = ["password", "sslpassword"];

/// `url` with its password hidden, for messages and logs: the user's password in the URL's
/// user info and any `password` parameter become `***`; the user, the hosts, the database and
/// the other parameters stay, so the message still says where it went.
pub fn redacted_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable URL>".to_string();
    };
    let (authority_and_path, query) = match rest.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (rest, None),
    };
    let authority_and_path = match authority_and_path.rsplit_once('@') {
        Some((user_info, hosts)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{hosts}"),
            None => format!("{user_info}@{hosts}"),
        },
        None => authority_and_path.to_string(),
    };
    match query {
        Some(query) => {
            let query = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if SECRET_PARAMETERS.contains(&name) => format!("{name}=***"),
                    _ => pair.to_string(),
                })
                .collect::<Vec<_>>()
                .join("&");
            format!("{scheme}://{authority_and_path}?{query}")
        }
        None => format!("{scheme}://{authority_and_path}"),
    }
}

/// The URL as the driver reads it: libpq's `sslmode=verify-ca` and `verify-full`, which the
/// driver does not know, become `require`, since every TLS connection is verified in full.
pub(super) fn driver_url(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let query = query
        .split('&')
        .map(|pair| {
            if ["sslmode=verify-ca", "sslmode=verify-full"].contains(&pair) {
                "sslmode=require"
            } else {
                pair
            }
        })
        .collect::<Vec<_>>()
        .join("&");
    format!("{base}?{query}")
}

/// Whether the driver can read `url`: checked when the config is loaded, so that a bad URL
/// stops the start naming `store.url`, and with the password hidden.
pub fn check_url(url: &str) -> Result<(), String> {
    Config::from_str(&driver_url(url))
        .map(|_| ())
        .map_err(|e| format!("`{}`: {e}", redacted_url(url)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_hidden_and_the_rest_kept() {
        assert_eq!(
            redacted_url("postgres://cb:s3cret@db.example:5432/callbackd?sslmode=require"),
            "postgres://cb:***@db.example:5432/callbackd?sslmode=require"
        );
        assert_eq!(
            redacted_url(
                "postgresql://cb:p%40ss@a:5432,b:5433/cb?target_session_attrs=read-write\
                 &password=again&sslpassword=key"
            ),
            "postgresql://cb:***@a:5432,b:5433/cb?target_session_attrs=read-write\
             &password=***&sslpassword=***"
        );
        // An `@` inside the password, unescaped: everything before the last one is hidden.
        assert_eq!(
            redacted_url("postgres://cb:a@b@host/db"),
            "postgres://cb:***@host/db"
        );
        for plain in [
            "postgres://host/db",
            "postgres://cb@host:5432/db?sslmode=disable",
        ] {
            assert_eq!(redacted_url(plain), plain);
        }
        assert_eq!(redacted_url("host=a password=x"), "<unparsable URL>");
    }

    #[test]
    fn libpq_verify_modes_reach_the_driver_as_require() {
        assert_eq!(
            driver_url("postgres://h/db?sslmode=verify-full&application_name=x"),
            "postgres://h/db?sslmode=require&application_name=x"
        );
        assert_eq!(
            driver_url("postgres://h/db?sslmode=verify-ca"),
            "postgres://h/db?sslmode=require"
        );
        assert_eq!(driver_url("postgres://h/db"), "postgres://h/db");
    }
}
