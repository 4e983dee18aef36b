//! The provider's side of a recovery: one window sent to PayZu's
//! `POST {provider_api_url}/v1/user/callbacks/resend` with the source's bearer token, JSON
//! `{"createdAtFrom", "createdAtTo"}`, answered `{"message", "total"}`.
//!
//! A request has a timeout. A connection failure, a timeout or a 5xx is retried a few times
//! with jittered exponential backoff (the provider asked to resend may be briefly down); any
//! other answer is final. What a window ends with is its `total`, or an error naming the
//! status and the start of the body: never the token, which only the header carries.

use std::time::Duration;

use serde::Deserialize;

use crate::app::ProviderApi;
use crate::clock::{Millis, format_iso};

/// Path of the resend endpoint below `provider_api_url`.
pub const RESEND_PATH: &str = "/v1/user/callbacks/resend";
/// Requests per window at most: the first and two retries.
pub const MAX_ATTEMPTS: u32 = 3;
/// Timeout of one request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Backoff before the first retry; doubled for each next one, jittered down by up to half.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// Characters of a refusal's body kept in the window's error.
const BODY_CHARS: usize = 200;
/// The largest answer read: `{"message", "total"}` is a few dozen bytes.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// The client recoveries use, built as the crate's other clients are: no proxy from the
/// environment (the token goes only where the config says), no redirects (a redirect would
/// carry the token elsewhere), a timeout.
pub fn client() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(REQUEST_TIMEOUT.min(Duration::from_secs(5)))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("callbackd/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// What sending one window came to.
pub struct Sent {
    /// The provider's `total`, or why the window failed.
    pub outcome: Result<u64, String>,
    pub attempts: u32,
}

#[derive(Deserialize)]
struct ResendAnswer {
    total: u64,
}

/// One try: `Ok(total)`, or the error and whether it is worth retrying.
async fn try_once(
    client: &reqwest::Client,
    api: &ProviderApi,
    from: Millis,
    to: Millis,
) -> Result<u64, (String, bool)> {
    let url = format!("{}{RESEND_PATH}", api.url);
    let body = serde_json::json!({
        "createdAtFrom": format_iso(from),
        "createdAtTo": format_iso(to),
    });
    let response = client
        .post(&url)
        .bearer_auth(api.token.expose())
        .json(&body)
        .send()
        .await
        .map_err(|e| (format!("cannot reach {url}: {e}"), true))?;
    let status = response.status();
    let text = capped_text(response)
        .await
        .map_err(|(e, retry)| (format!("HTTP {status}, {e}"), retry))?;
    if !status.is_success() {
        let short: String = text.chars().take(BODY_CHARS).collect();
        return Err((format!("HTTP {status}: {short}"), status.is_server_error()));
    }
    serde_json::from_str::<ResendAnswer>(&text)
        .map(|a| a.total)
        .map_err(|e| {
            let short: String = text.chars().take(BODY_CHARS).collect();
            (
                format!("HTTP {status} without a numeric `total` ({e}): {short}"),
                false,
            )
        })
}

/// The answer's body, refused past [`MAX_ANSWER_BYTES`]: a provider's answer is read into
/// memory, and one that does not end must not take the process's memory with it.
/// A body cut off is worth a retry; one too long would be as long again.
async fn capped_text(mut response: reqwest::Response) -> Result<String, (String, bool)> {
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| (format!("unreadable body: {e}"), true))?
    {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err((format!("a body over {MAX_ANSWER_BYTES} bytes"), false));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Sends the window `[from, to)`, retrying what may pass on a second try.
pub async fn resend(client: &reqwest::Client, api: &ProviderApi, from: Millis, to: Millis) -> Sent {
    let mut attempts = 0;
    loop {
        attempts += 1;
        match try_once(client, api, from, to).await {
            Ok(total) => {
                return Sent {
                    outcome: Ok(total),
                    attempts,
                };
            }
            Err((error, retry)) if !retry || attempts >= MAX_ATTEMPTS => {
                return Sent {
                    outcome: Err(error),
                    attempts,
                };
            }
            Err(_) => tokio::time::sleep(backoff(attempts, rand::random::<f64>())).await,
        }
    }
}

/// The pause after the `attempt`-th failed try: [`FIRST_BACKOFF`] doubled per try, less up
/// to half of it by `jitter` (in `[0, 1)`), so recoveries that failed together retry apart.
fn backoff(attempt: u32, jitter: f64) -> Duration {
    let full = FIRST_BACKOFF * 2u32.saturating_pow(attempt.saturating_sub(1));
    full.mul_f64(1.0 - jitter.clamp(0.0, 1.0) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_jittered_down_by_at_most_half() {
        assert_eq!(backoff(1, 0.0), Duration::from_millis(250));
        assert_eq!(backoff(2, 0.0), Duration::from_millis(500));
        assert_eq!(backoff(2, 0.999_999).as_millis(), 250);
    }
}
