//! The provider-side recovery (issue #27): ask a source's provider to resend its callbacks
//! of a time range (PayZu's `POST /v1/user/callbacks/resend`), record what it answered, and
//! report how many of the callbacks that then arrive were new events and how many replays.
//!
//! - [`plan`] (pure) checks the request against the provider's limits and splits the range
//!   into the windows it accepts; a refusal names the field and the limit and changes
//!   nothing.
//! - [`start`] records the recovery, sends the windows one after the other (`provider.rs`:
//!   timeout, retries with jittered backoff on 5xx and connection failures, a window that
//!   fails recorded with its error while the others are still sent), detached from the
//!   request so a client that hangs up does not leave it half-sent, and records each answer.
//! - [`report`] reads its figures: the store's inbound counts of the source
//!   (store/recoveries.rs) from the minute it started to the end of its counting window, less
//!   what that minute held when it started, the same in every process. Ordinary traffic of the source in that period is counted too.
//!   Once the window is over, the figures are written into the recovery (settled), so they
//!   outlive the counts.

mod provider;

use std::sync::Arc;

use serde::Serialize;
use utoipa::ToSchema;

use crate::app::App;
use crate::app::Sources;
use crate::clock::{Millis, format_iso};
use crate::store::counts::{MINUTE_MS, minute_of};
use crate::store::recoveries::{self, MAX_COUNT_MS, count_is_gone};
use crate::store::{InboundCount, Recovery, RecoveryWindow, StoreError, WindowState};

const DAY_MS: Millis = 86_400_000;
/// The widest window the provider takes in one request.
pub const MAX_WINDOW_MS: Millis = 7 * DAY_MS;
/// How far back `from` may be: the provider resends nothing older.
pub const MAX_LOOKBACK_MS: Millis = 30 * DAY_MS;
/// How far past `now` a `to` may be: clocks of the operator's machine and the server differ
/// a little; a `to` further ahead asks for callbacks that cannot exist yet.
pub const MAX_SKEW_MS: Millis = 60_000;
/// Counting window when the request gives none: time for a provider to work through its
/// resends.
pub const DEFAULT_COUNT_SECS: u64 = 3600;

/// What a recovery request asks, the times parsed.
#[derive(Debug, Clone)]
pub struct RecoverRequest {
    pub source: String,
    /// `[from, to)`.
    pub from: Millis,
    pub to: Millis,
    /// How long its arrivals are counted; [`DEFAULT_COUNT_SECS`] when `None`.
    pub count_secs: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    /// The request is refused before anything is sent or recorded; `field` is the request's
    /// name for what is wrong.
    #[error("`{field}` {why}")]
    Refused { field: &'static str, why: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn refused(field: &'static str, why: impl Into<String>) -> RecoverError {
    RecoverError::Refused {
        field,
        why: why.into(),
    }
}

/// Checks `asked` at `now` against what `sources` configure and the provider's limits, and
/// splits `[from, to)` into windows of at most [`MAX_WINDOW_MS`], oldest first.
pub fn plan(
    sources: &Sources,
    asked: &RecoverRequest,
    now: Millis,
) -> Result<Vec<(Millis, Millis)>, RecoverError> {
    let Some(source) = sources.get(&asked.source) else {
        let mut known: Vec<&str> = sources.keys().map(String::as_str).collect();
        known.sort_unstable();
        return Err(refused(
            "source",
            format!(
                "names no configured source: `{}` (sources: {})",
                asked.source,
                known.join(", ")
            ),
        ));
    };
    if source.provider_api.is_none() {
        return Err(refused(
            "source",
            format!(
                "`{0}` has no provider API: set sources.{0}.provider_api_url and \
                 sources.{0}.provider_api_token",
                asked.source
            ),
        ));
    }
    if let Some(secs) = asked.count_secs
        && !(1..=MAX_COUNT_MS as u64 / 1000).contains(&secs)
    {
        return Err(refused(
            "countSecs",
            format!("must be 1 to {} seconds", MAX_COUNT_MS / 1000),
        ));
    }
    if asked.from >= asked.to {
        return Err(refused(
            "from",
            format!(
                "({}) must be before `to` ({})",
                format_iso(asked.from),
                format_iso(asked.to)
            ),
        ));
    }
    if asked.from < now - MAX_LOOKBACK_MS {
        return Err(refused(
            "from",
            format!(
                "({}) is more than 30 days back: the provider resends callbacks of the last \
                 30 days only (from {} on)",
                format_iso(asked.from),
                format_iso(now - MAX_LOOKBACK_MS)
            ),
        ));
    }
    if asked.to > now + MAX_SKEW_MS {
        return Err(refused(
            "to",
            format!(
                "({}) is in the future: at most {} s past the server's time ({})",
                format_iso(asked.to),
                MAX_SKEW_MS / 1000,
                format_iso(now)
            ),
        ));
    }
    let mut windows = Vec::new();
    let mut at = asked.from;
    while at < asked.to {
        let end = (at + MAX_WINDOW_MS).min(asked.to);
        windows.push((at, end));
        at = end;
    }
    Ok(windows)
}

/// Starts a recovery: checks it ([`plan`]), records it, sends its windows and records each
/// answer, then reports it. The sending runs as a task of its own, so a client that hangs up
/// does not stop it half-way.
pub async fn start(app: Arc<App>, asked: RecoverRequest) -> Result<RecoveryReport, RecoverError> {
    let now = app.clock.now_ms();
    let windows = plan(&app.settings.sources, &asked, now)?;
    let api = app
        .settings
        .sources
        .get(&asked.source)
        .and_then(|s| s.provider_api.clone())
        .ok_or_else(|| refused("source", "has no provider API"))?;
    let count_ms = asked.count_secs.unwrap_or(DEFAULT_COUNT_SECS) as Millis * 1000;
    // What the start's minute already counted is not this recovery's.
    let baseline = app
        .store
        .inbound_counts(&asked.source, now, now, now)
        .await?;
    let recovery = Recovery {
        baseline,
        id: Recovery::new_id(now),
        source: asked.source,
        started_at: now,
        from: asked.from,
        to: asked.to,
        count_until: now + count_ms,
        windows: windows
            .into_iter()
            .map(|(from, to)| RecoveryWindow {
                from,
                to,
                state: WindowState::Pending,
                total: None,
                error: None,
                attempts: 0,
            })
            .collect(),
        settled: None,
    };
    // Recorded before anything is sent: a recovery the provider acted on is never missing
    // from the list.
    app.store.save_recovery(&recovery, now).await?;
    let sending = tokio::spawn({
        let app = Arc::clone(&app);
        async move { send_windows(&app, recovery, &api).await }
    });
    let recovery = sending
        .await
        .map_err(|e| StoreError::Unavailable(format!("the recovery's task failed: {e}")))??;
    Ok(report(&app, recovery).await?)
}

/// Sends each window, records its answer as it comes (so a reader sees the progress), and
/// returns the recovery as last recorded.
async fn send_windows(
    app: &App,
    mut recovery: Recovery,
    api: &crate::app::ProviderApi,
) -> Result<Recovery, StoreError> {
    let client = provider::client()
        .map_err(|e| StoreError::Unavailable(format!("cannot build the HTTP client: {e}")))?;
    for i in 0..recovery.windows.len() {
        let (from, to) = (recovery.windows[i].from, recovery.windows[i].to);
        let sent = provider::resend(&client, api, from, to).await;
        let window = &mut recovery.windows[i];
        window.attempts = sent.attempts;
        match sent.outcome {
            Ok(total) => {
                window.state = WindowState::Sent;
                window.total = Some(total);
            }
            Err(error) => {
                tracing::warn!(
                    recovery = %recovery.id, source = %recovery.source, window = i,
                    error = %error, "the provider refused a recovery window"
                );
                window.state = WindowState::Failed;
                window.error = Some(error);
            }
        }
        app.store
            .save_recovery(&recovery, app.clock.now_ms())
            .await?;
    }
    Ok(recovery)
}

/// A recovery and its figures so far.
#[derive(Debug)]
pub struct RecoveryReport {
    pub recovery: Recovery,
    /// `None` once the counts it would be read from are gone without having been settled.
    pub arrivals: Option<InboundCount>,
    /// True while its counting window is open: the figures may still grow.
    pub counting: bool,
}

/// The figures of `recovery` now: settled, or summed from the counts (and settled when its
/// counting window is over).
pub async fn report(app: &App, mut recovery: Recovery) -> Result<RecoveryReport, StoreError> {
    let now = app.clock.now_ms();
    if let Some(settled) = recovery.settled {
        return Ok(RecoveryReport {
            recovery,
            arrivals: Some(settled),
            counting: false,
        });
    }
    if count_is_gone(minute_of(recovery.started_at), now) {
        return Ok(RecoveryReport {
            recovery,
            arrivals: None,
            counting: false,
        });
    }
    let counts = app
        .store
        .inbound_counts(
            &recovery.source,
            recovery.started_at,
            recovery.count_until,
            now,
        )
        .await?
        .since(recovery.baseline);
    // The window's last minute is over: nothing more can be counted in it. Not while a
    // window is still being sent: the sender saves the recovery after each window, and a
    // settled copy written from an older read would undo its answers.
    let over = now >= minute_of(recovery.count_until) + MINUTE_MS;
    let sent = recovery
        .windows
        .iter()
        .all(|w| w.state != WindowState::Pending);
    if over && sent {
        recovery.settled = Some(counts);
        app.store.save_recovery(&recovery, now).await?;
    }
    Ok(RecoveryReport {
        counting: now < recovery.count_until,
        recovery,
        arrivals: Some(counts),
    })
}

/// The recoveries kept, newest first, each with its figures.
pub async fn list(app: &App) -> Result<Vec<RecoveryReport>, StoreError> {
    let now = app.clock.now_ms();
    let mut reports = Vec::new();
    for recovery in app.store.recoveries(now).await? {
        reports.push(report(app, recovery).await?);
    }
    Ok(reports)
}

/// One recovery, if kept.
pub async fn get(app: &App, id: &str) -> Result<Option<RecoveryReport>, StoreError> {
    if !recoveries::is_recovery_id(id) {
        return Ok(None);
    }
    match app.store.recovery(id, app.clock.now_ms()).await? {
        Some(recovery) => Ok(Some(report(app, recovery).await?)),
        None => Ok(None),
    }
}

/// A recovery as the API shows it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecoveryView {
    /// `rec_...`.
    pub id: String,
    pub source: String,
    /// When it was started (RFC 3339).
    pub started_at: String,
    /// The range asked for, `[from, to)` (RFC 3339).
    pub from: String,
    pub to: String,
    /// Arrivals of the source are counted from the minute of `startedAt` to this time.
    pub count_until: String,
    /// True while the counting window is open: `new` and `replays` may still grow.
    pub counting: bool,
    /// The windows sent to the provider, oldest first.
    pub windows: Vec<RecoveryWindowView>,
    /// Sum of the provider's `total` over the windows it accepted.
    pub requested: u64,
    /// Windows the provider refused or could not be reached for.
    pub failed_windows: usize,
    /// Callbacks of the source recorded as new events while counting (every process, the
    /// source's ordinary traffic included); null once the counts are gone unsettled.
    pub new: Option<u64>,
    /// Callbacks of the source the dedupe absorbed while counting (as `new`).
    pub replays: Option<u64>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RecoveryWindowView {
    /// `createdAtFrom` sent (RFC 3339).
    pub from: String,
    /// `createdAtTo` sent (RFC 3339).
    pub to: String,
    pub state: WindowState,
    /// The provider's `total`, when it accepted the window.
    pub total: Option<u64>,
    /// Why the window failed: the provider's status and the start of its answer, or the
    /// connection error.
    pub error: Option<String>,
    /// Requests sent for this window, retries included.
    pub attempts: u32,
}

/// The recoveries, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct RecoveryList {
    pub recoveries: Vec<RecoveryView>,
}

impl From<RecoveryReport> for RecoveryView {
    fn from(report: RecoveryReport) -> RecoveryView {
        let r = report.recovery;
        RecoveryView {
            requested: r.windows.iter().filter_map(|w| w.total).sum(),
            failed_windows: r
                .windows
                .iter()
                .filter(|w| w.state == WindowState::Failed)
                .count(),
            windows: r
                .windows
                .into_iter()
                .map(|w| RecoveryWindowView {
                    from: format_iso(w.from),
                    to: format_iso(w.to),
                    state: w.state,
                    total: w.total,
                    error: w.error,
                    attempts: w.attempts,
                })
                .collect(),
            id: r.id,
            source: r.source,
            started_at: format_iso(r.started_at),
            from: format_iso(r.from),
            to: format_iso(r.to),
            count_until: format_iso(r.count_until),
            counting: report.counting,
            new: report.arrivals.map(|a| a.new),
            replays: report.arrivals.map(|a| a.replays),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::app::{ForwardSettings, ProviderApi, SourceSettings};
    use crate::config::{SignatureScheme, SourceConfig};
    use crate::webhook::Verifier;

    const NOW: Millis = 1_764_460_800_000;

    fn sources() -> Sources {
        let config = SourceConfig {
            secrets: vec![],
            signature: SignatureScheme::None,
            signature_header: None,
            tolerance_secs: 300,
            forward_url: None,
            allow_private_forward_url: false,
            forward_headers: Default::default(),
            forward_secret: None,
            dedupe_fields: None,
            provider_api_url: None,
            provider_api_token: None,
        };
        let source = |name: &str, api: bool| SourceSettings {
            name: name.to_string(),
            verifier: Verifier::from_config(&config).unwrap(),
            dedupe_fields: vec![],
            forward_url: None,
            forward: ForwardSettings::default(),
            provider_api: api.then(|| ProviderApi {
                url: "http://127.0.0.1:1".into(),
                token: crate::redact::Secret::new("tok-0123456789"),
            }),
        };
        Arc::new(HashMap::from([
            ("payzu".to_string(), source("payzu", true)),
            ("plain".to_string(), source("plain", false)),
        ]))
    }

    fn asked(source: &str, from: Millis, to: Millis) -> RecoverRequest {
        RecoverRequest {
            source: source.into(),
            from,
            to,
            count_secs: None,
        }
    }

    fn refusal(r: Result<Vec<(Millis, Millis)>, RecoverError>) -> (&'static str, String) {
        match r {
            Err(RecoverError::Refused { field, why }) => (field, why),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn twenty_days_are_three_windows_of_at_most_seven() {
        let from = NOW - 20 * DAY_MS;
        let windows = plan(&sources(), &asked("payzu", from, NOW), NOW).unwrap();
        assert_eq!(
            windows,
            [
                (from, from + 7 * DAY_MS),
                (from + 7 * DAY_MS, from + 14 * DAY_MS),
                (from + 14 * DAY_MS, NOW)
            ]
        );
        let one = plan(&sources(), &asked("payzu", NOW - 1000, NOW), NOW).unwrap();
        assert_eq!(one, [(NOW - 1000, NOW)]);
    }

    #[test]
    fn each_refusal_names_its_field_and_limit() {
        let s = sources();
        let (field, why) = refusal(plan(&s, &asked("payzu", NOW - 31 * DAY_MS, NOW), NOW));
        assert_eq!(field, "from");
        assert!(why.contains("30 days"), "{why}");
        assert!(plan(&s, &asked("payzu", NOW - 30 * DAY_MS, NOW), NOW).is_ok());
        assert_eq!(refusal(plan(&s, &asked("payzu", NOW, NOW), NOW)).0, "from");
        let (field, why) = refusal(plan(&s, &asked("payzu", NOW - 1, NOW + 61_000), NOW));
        assert_eq!(field, "to");
        assert!(why.contains("60 s"), "{why}");
        assert!(plan(&s, &asked("payzu", NOW - 1, NOW + 60_000), NOW).is_ok());
        let (field, why) = refusal(plan(&s, &asked("nope", NOW - 1, NOW), NOW));
        assert_eq!(field, "source");
        assert!(why.contains("payzu, plain"), "{why}");
        let (field, why) = refusal(plan(&s, &asked("plain", NOW - 1, NOW), NOW));
        assert_eq!(field, "source");
        assert!(why.contains("sources.plain.provider_api_url"), "{why}");
        let mut long = asked("payzu", NOW - 1, NOW);
        long.count_secs = Some(86_401);
        assert_eq!(refusal(plan(&s, &long, NOW)).0, "countSecs");
    }
}
