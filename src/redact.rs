//! What an operator may see of a delivery target. A gateway signs its `callbackUrl` with a
//! query parameter (`?X-VTEX-signature=…`), and other receivers put tokens there too, so every
//! view of a URL (the API's `targetUrl`, hence the console, and the `message.dead` alert, often
//! posted to a third-party chat) shows the query's names and never its values. Deliveries use
//! the stored URL, byte for byte; this is only ever a copy for display.

/// What replaces each query value.
pub const REDACTED: &str = "[redacted]";

/// `url` with every query value replaced by [`REDACTED`]; the scheme, host, path, the query's
/// names and the fragment stay as written. Pure text work, so nothing is normalised on the way.
pub fn display_url(url: &str) -> String {
    let (before_fragment, fragment) = match url.split_once('#') {
        Some((head, fragment)) => (head, Some(fragment)),
        None => (url, None),
    };
    let Some((base, query)) = before_fragment.split_once('?') else {
        return url.to_string();
    };
    let query = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) => format!("{name}={REDACTED}"),
            None => pair.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&");
    match fragment {
        Some(fragment) => format!("{base}?{query}#{fragment}"),
        None => format!("{base}?{query}"),
    }
}

/// `url` with its user and password replaced, for messages and logs: a password in
/// `store.url` must never reach either.
pub fn url_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "<unparsable URL>".to_string();
    };
    match rest.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}"),
        None => url.to_string(),
    }
}

/// A secret read from the config (a provider's API token): its `Debug` is [`REDACTED`], so a
/// config or settings struct printed to a log never shows it, and [`Secret::expose`] is the
/// one place the value is read, where it is sent.
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value, for the header it is sent in and for the config's strength checks.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(REDACTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_shows_in_debug_output() {
        let secret = Secret::new("tok-123456789abcdef");
        assert_eq!(format!("{secret:?}"), REDACTED);
        assert_eq!(format!("{:?}", Some(&secret)), format!("Some({REDACTED})"));
        assert_eq!(secret.expose(), "tok-123456789abcdef");
    }

    #[test]
    fn every_query_value_is_hidden_and_the_rest_kept() {
        assert_eq!(
            display_url("https://gw.example/cb?X-VTEX-signature=a%2Fb&an=1&flag"),
            "https://gw.example/cb?X-VTEX-signature=[redacted]&an=[redacted]&flag"
        );
        assert_eq!(
            display_url("http://h/p?t=s3cret#part"),
            "http://h/p?t=[redacted]#part"
        );
        // Nothing to hide: the URL as written, not as a parser would normalise it.
        for plain in [
            "https://gw.example/cb",
            "HTTP://H:80/a/../b#x=1",
            "http://h/?",
        ] {
            assert_eq!(display_url(plain), plain);
        }
    }
}
