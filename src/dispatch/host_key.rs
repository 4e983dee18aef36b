//! How a target is named per host: `host:port`, lower-case, so two services on one machine are
//! two targets. Shared by the config's `dispatch.hosts` keys and the dispatcher's lookup, and
//! imports nothing of callbackd, so config (a leaf) may use it.

/// The `host:port` of a URL (the scheme's default port when none is written), or `None` when it
/// does not parse.
pub fn of_url(url: &str) -> Option<String> {
    let u = reqwest::Url::parse(url).ok()?;
    let port = u.port_or_known_default().unwrap_or(0);
    u.host_str()
        .map(|h| format!("{}:{port}", h.to_ascii_lowercase()))
}

/// A `dispatch.hosts` key (`host` or `host:port`) as a lookup key: `host:port`, or the bare
/// host, which applies to every port of it. `Err` says what is wrong.
pub fn parse(key: &str) -> Result<String, String> {
    let problem = || format!("`{key}` is not host or host:port");
    if key.is_empty() || key.contains(['/', '@', '?', '#', ' ']) {
        return Err(problem());
    }
    let url = reqwest::Url::parse(&format!("http://{key}/")).map_err(|_| problem())?;
    let host = url.host_str().ok_or_else(problem)?.to_ascii_lowercase();
    // The URL parser drops port 80 for http: read the written port back from the key.
    let written_port = key
        .rsplit_once(':')
        .filter(|(h, _)| !h.ends_with(':') && (!h.starts_with('[') || h.ends_with(']')))
        .map(|(_, p)| p.parse::<u16>().map_err(|_| problem()))
        .transpose()?;
    Ok(match written_port {
        Some(port) => format!("{host}:{port}"),
        None => host,
    })
}

/// The bare host of a `host:port` lookup key.
pub fn bare(key: &str) -> &str {
    key.rsplit_once(':').map_or(key, |(h, _)| h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_as_host_or_host_and_port() {
        assert_eq!(
            parse("Gateway.example:8443").as_deref(),
            Ok("gateway.example:8443")
        );
        assert_eq!(parse("gateway.example").as_deref(), Ok("gateway.example"));
        assert_eq!(parse("127.0.0.1:80").as_deref(), Ok("127.0.0.1:80"));
        assert_eq!(parse("[::1]:8080").as_deref(), Ok("[::1]:8080"));
        assert_eq!(parse("[::1]").as_deref(), Ok("[::1]"));
        for bad in [
            "",
            "a/b",
            "user@host",
            "host:port",
            "host:99999",
            "http://x",
            "a b",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert_eq!(
            of_url("https://Gateway.example/cb?x=1").as_deref(),
            Some("gateway.example:443")
        );
        assert_eq!(of_url("http://[::1]:9/cb").as_deref(), Some("[::1]:9"));
        assert_eq!(bare("gateway.example:443"), "gateway.example");
        assert_eq!(bare("[::1]:9"), "[::1]");
    }
}
