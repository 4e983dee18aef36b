//! What both accept routes (`callbacks`, `notifications`) do once they hold an accept
//! request: one `Store::accept` call, the dispatcher's wake-up, the route's metrics and the
//! answer.

use std::time::Instant;

use axum::http::StatusCode;
use axum::response::Response;

use super::raw_json;
use crate::app::App;
use crate::clock::Millis;
use crate::http::error::{ApiError, ErrorCode};
use crate::metrics as m;
use crate::store::{AcceptOutcome, AcceptRequest, StoreError};

/// The answer the store holds for a request: this one's, or a replay of the first.
#[derive(Debug)]
pub struct Recorded {
    pub body: String,
    pub replayed: bool,
}

/// Claims and records `request` in one atomic step (§1.2) and rings the dispatcher when
/// something new was recorded. A refusal is mapped from what the request carries: a conflict
/// needs a fingerprint, an invalid transition needs a transition; the store answering either
/// for a request without one is a fault of the store.
pub async fn record(app: &App, request: AcceptRequest, now: Millis) -> Result<Recorded, ApiError> {
    let answer = request.dedupe.response.clone();
    let fingerprinted = request.dedupe.fingerprint.is_some();
    let to = request.payment.as_ref().map(|p| p.to.to_string());
    match (app.store.accept(request, now).await?, to) {
        (AcceptOutcome::Accepted, _) => {
            app.wake.notify_one();
            Ok(Recorded {
                body: answer,
                replayed: false,
            })
        }
        (AcceptOutcome::Replayed { response }, _) => Ok(Recorded {
            body: response,
            replayed: true,
        }),
        (AcceptOutcome::Conflict, _) if fingerprinted => Err(ApiError::IdempotencyMismatch),
        (AcceptOutcome::SignatureReused, _) => Err(ApiError::SignatureReused),
        (AcceptOutcome::InvalidTransition { from }, Some(to)) => {
            Err(ApiError::InvalidTransition { from, to })
        }
        (AcceptOutcome::Conflict | AcceptOutcome::InvalidTransition { .. }, _) => {
            Err(ApiError::Unavailable(StoreError::Corrupt(
                "a refusal for a fingerprint or a transition the request does not carry".into(),
            )))
        }
    }
}

/// The accept route a request came in by, with what its metrics are labelled with.
pub enum Route {
    /// `source` is the configured source, or `unknown`.
    Callbacks {
        source: String,
    },
    Notifications,
}

/// Counts and times a request of an accept route, then answers it: the recorded answer, with
/// `Idempotent-Replayed: true` on a replay.
pub fn answer(
    route: Route,
    started: Instant,
    result: Result<Recorded, ApiError>,
) -> Result<Response, ApiError> {
    let outcome = result.as_ref().map(|r| r.replayed).map_err(ApiError::code);
    let (name, status) = match route {
        Route::Callbacks { source } => {
            let outcome = callback_outcome(outcome);
            metrics::counter!(m::CALLBACKS, "source" => source, "outcome" => outcome).increment(1);
            ("callbacks", StatusCode::OK)
        }
        Route::Notifications => {
            let outcome = notification_outcome(outcome);
            metrics::counter!(m::NOTIFICATIONS, "outcome" => outcome).increment(1);
            ("notifications", StatusCode::ACCEPTED)
        }
    };
    metrics::histogram!(m::ACCEPT_SECONDS, "route" => name).record(started.elapsed().as_secs_f64());
    let recorded = result?;
    Ok(raw_json(status, recorded.body, recorded.replayed))
}

/// The `outcome` of a provider callback: `Ok(replayed)` or the error's code.
fn callback_outcome(result: Result<bool, ErrorCode>) -> &'static str {
    match result {
        Ok(true) => "replayed",
        Ok(false) => "accepted",
        Err(ErrorCode::InvalidSignature) => "bad_signature",
        Err(ErrorCode::PayloadTooLarge) => "too_large",
        Err(ErrorCode::RequestTimeout) => "timeout",
        Err(ErrorCode::StoreUnavailable | ErrorCode::StoreFull) => "unavailable",
        Err(ErrorCode::ServerBusy) => "busy",
        Err(ErrorCode::UnknownSource) => "unknown_source",
        Err(ErrorCode::SignatureReused) => "signature_reused",
        Err(_) => "bad_request",
    }
}

/// The `outcome` of a connector hand-off: `Ok(replayed)` or the error's code.
fn notification_outcome(result: Result<bool, ErrorCode>) -> &'static str {
    match result {
        Ok(true) => "replayed",
        Ok(false) => "accepted",
        Err(ErrorCode::InvalidTransition) => "invalid_transition",
        Err(ErrorCode::IdempotencyKeyReused) => "key_conflict",
        Err(ErrorCode::PayloadTooLarge) => "too_large",
        Err(ErrorCode::RequestTimeout) => "timeout",
        Err(ErrorCode::StoreUnavailable | ErrorCode::StoreFull) => "unavailable",
        Err(ErrorCode::ServerBusy) => "busy",
        Err(ErrorCode::Unauthorized | ErrorCode::Forbidden) => "unauthorized",
        Err(_) => "bad_request",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn documented(name: &str) -> &'static [&'static str] {
        m::CATALOGUE
            .iter()
            .find(|doc| doc.name == name)
            .and_then(|doc| doc.values_of("outcome"))
            .unwrap_or_else(|| panic!("{name} has no outcome values"))
    }

    /// Whatever an error's code, the outcome label it gets is documented, and a full store
    /// counts as unavailable, not as a bad request.
    #[test]
    fn every_outcome_a_route_can_emit_is_in_the_catalogue() {
        let results = [Ok(true), Ok(false)]
            .into_iter()
            .chain(ErrorCode::ALL.iter().map(|c| Err(*c)));
        for result in results {
            let label = callback_outcome(result);
            assert!(documented(m::CALLBACKS).contains(&label), "{label}");
            let label = notification_outcome(result);
            assert!(documented(m::NOTIFICATIONS).contains(&label), "{label}");
        }
        assert_eq!(callback_outcome(Err(ErrorCode::StoreFull)), "unavailable");
        assert_eq!(
            notification_outcome(Err(ErrorCode::StoreFull)),
            "unavailable"
        );
    }
}
