//! The resend use case (like PayZu's `POST /user/callbacks/resend`): deliver messages once
//! more (a finished one gets a fresh window; a pending one keeps its schedule), each resend
//! recorded in the message's history.
//!
//! A resend is idempotent with a `requestId`: its first use reserves it under the request's
//! fingerprint, the walk's answer is recorded under it, and a repeat gets that answer and
//! resends nothing. The walk runs detached from the request, so a client that hangs up does
//! not leave it half-done, and its answer (final, or partial after a store error) is recorded
//! on every path. `walk.rs` resends message by message; `dry_run.rs` counts instead.

pub mod dry_run;
mod walk;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::oneshot;
use utoipa::ToSchema;

use super::messages::{MessageQuery, configured_sources};
use crate::app::App;
use crate::digest::short_hash;
use crate::store::{ListFilter, MessageId, OperationReservation, StoreError};

/// Messages one resend request may touch; a larger selection answers `more: true` and the
/// operator narrows the window. Keeps memory and the answer bounded.
const MAX_RESEND: usize = 10_000;
/// Most `messageIds` one request may name.
pub const MAX_IDS: usize = 1000;
/// Page size used to walk a resend selection.
const BATCH: usize = 500;
/// How long a resend `requestId` is held while its resend runs: a walk of at most
/// [`MAX_RESEND`] messages takes seconds.
const RESERVATION_SECS: u64 = 300;
/// Longest pause between attempts to record a resend's answer while the store refuses it.
const RECORD_RETRY_MAX: Duration = Duration::from_secs(5);

/// What a resend request asks, every field parsed.
#[derive(Debug, Clone, Default)]
pub struct Resend {
    /// These messages (at most [`MAX_IDS`]), each only if it meets every filter of `query`.
    pub ids: Option<Vec<MessageId>>,
    /// Without `ids`, the messages it selects.
    pub query: MessageQuery,
    /// Makes the resend idempotent.
    pub request_id: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ResendError {
    #[error(
        "give `messageIds`, `paymentId`, `transactionId` or a `createdAtFrom`/`createdAtTo` window"
    )]
    NoSelector,
    #[error("a resend with this requestId is still running")]
    InProgress,
    #[error("this requestId was used with a different selection")]
    RequestIdReused,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The answer could not be written as JSON (its shape cannot fail to).
    #[error(transparent)]
    Answer(serde_json::Error),
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResendAnswer {
    pub resent: usize,
    pub message_ids: Vec<String>,
    /// True when the selection had more than one request may resend: narrow it and repeat.
    pub more: bool,
    /// True when the resend stopped part-way on a store error (the request itself got a 503):
    /// the messages listed were resent, the rest of the selection was not. This is the answer
    /// its `requestId` keeps; resend the rest with a new `requestId`.
    pub incomplete: bool,
}

/// A resend's answer: the JSON of its [`ResendAnswer`], as recorded for its `requestId`, and
/// whether it is the answer recorded by an earlier request with the same `requestId`.
#[derive(Debug)]
pub struct ResendReply {
    pub body: String,
    pub replayed: bool,
}

impl Resend {
    /// Whether it names what to resend: ids, a payment, a transaction or a time window.
    fn has_selector(&self) -> bool {
        let q = &self.query;
        self.ids.is_some()
            || q.payment_id.is_some()
            || q.transaction_id.is_some()
            || q.created_from.is_some()
            || q.created_to.is_some()
    }

    /// Hash of the request as it selects: ids as a set, times as instants, `requestId` left
    /// out, so the same selection written differently is the same request. Recorded with
    /// the `requestId`, so it must not change between releases.
    fn fingerprint(&self) -> String {
        let ids = self
            .ids
            .as_ref()
            .map(|ids| ids.iter().map(MessageId::as_str).collect::<BTreeSet<_>>());
        let q = &self.query;
        let normalised = serde_json::json!({
            "messageIds": ids,
            "paymentId": q.payment_id,
            "transactionId": q.transaction_id,
            "source": q.source,
            "state": q.state.map(|s| s.as_str()),
            "createdFrom": q.created_from,
            "createdTo": q.created_to,
        });
        short_hash(normalised.to_string().as_bytes())
    }

    /// What it selects, checked before anything is reserved or resent.
    fn target(self, app: &App) -> Result<Target, ResendError> {
        if !self.has_selector() {
            return Err(ResendError::NoSelector);
        }
        Ok(
            match (self.ids, self.query.filter(configured_sources(app), BATCH)) {
                (_, None) => Target::Nothing,
                (Some(ids), Some(filter)) => Target::Ids(ids, filter),
                (None, Some(filter)) => Target::Selection(filter),
            },
        )
    }
}

/// What a resend selects.
enum Target {
    /// These ids, each resent only if it meets every other filter given.
    Ids(Vec<MessageId>, ListFilter),
    /// Every message the filter lists.
    Selection(ListFilter),
    /// Filters that contradict each other: nothing.
    Nothing,
}

/// A resend `requestId`, with the fingerprint of the request that uses it.
struct Operation {
    key: String,
    request_id: String,
    fingerprint: String,
}

/// Resends what `resend` selects and answers with what was resent. The walk runs detached:
/// the answer comes once the first attempt to record it is made, and the walk runs to the
/// end whether or not anyone still waits for it.
pub async fn run(app: Arc<App>, resend: Resend) -> Result<ResendReply, ResendError> {
    let operation = resend.request_id.clone().map(|request_id| Operation {
        key: format!("resend\n{request_id}"),
        fingerprint: resend.fingerprint(),
        request_id,
    });
    let target = resend.target(&app)?;
    let (answer, walked) = oneshot::channel();
    tokio::spawn(run_detached(app, target, operation, answer));
    walked.await.map_err(|_| {
        ResendError::Store(StoreError::Unavailable(
            "the resend ended without an answer".into(),
        ))
    })?
}

/// Reserves the `requestId`, walks the targets and records the answer, sending `answer` once
/// the first attempt to record it is made.
async fn run_detached(
    app: Arc<App>,
    target: Target,
    operation: Option<Operation>,
    answer: oneshot::Sender<Result<ResendReply, ResendError>>,
) {
    if let Some(op) = &operation {
        let reserved = app
            .store
            .reserve_operation(&op.key, &op.fingerprint, RESERVATION_SECS)
            .await;
        let early = match reserved {
            Ok(OperationReservation::Fresh) => None,
            Ok(OperationReservation::Done(body)) => Some(Ok(ResendReply {
                body,
                replayed: true,
            })),
            Ok(OperationReservation::InProgress) => Some(Err(ResendError::InProgress)),
            Ok(OperationReservation::Mismatch) => Some(Err(ResendError::RequestIdReused)),
            Err(e) => Some(Err(ResendError::Store(e))),
        };
        if let Some(early) = early {
            let _ = answer.send(early);
            return;
        }
    }

    let request_id = operation.as_ref().map(|op| op.request_id.as_str());
    let mut resent = Vec::new();
    let walked = match target {
        Target::Ids(ids, filter) => walk::ids(&app, &ids, &filter, request_id, &mut resent)
            .await
            .map(|()| false),
        Target::Selection(filter) => walk::selection(&app, filter, request_id, &mut resent).await,
        Target::Nothing => Ok(false),
    };
    if !resent.is_empty() {
        app.wake.notify_one();
    }
    let result = ResendAnswer {
        resent: resent.len(),
        message_ids: resent,
        more: walked.as_ref().is_ok_and(|more| *more),
        incomplete: walked.is_err(),
    };
    let body = match serde_json::to_string(&result) {
        Ok(body) => body,
        Err(e) => {
            let _ = answer.send(Err(ResendError::Answer(e)));
            return;
        }
    };
    let reply = |walked: Result<bool, StoreError>, body: String| {
        walked
            .map(|_| ResendReply {
                body,
                replayed: false,
            })
            .map_err(ResendError::Store)
    };
    let Some(op) = operation else {
        let _ = answer.send(reply(walked, body));
        return;
    };
    // The store counts retention in whole seconds.
    let ttl = app.settings.store.dedupe_ttl.as_secs();
    match app
        .store
        .finish_operation(&op.key, &op.fingerprint, &body, ttl)
        .await
    {
        Ok(()) => {
            let _ = answer.send(reply(walked, body));
        }
        Err(e) => {
            // The client is told to retry now; its retry gets 409 until the answer is in.
            let _ = answer.send(Err(ResendError::Store(e)));
            keep_recording(&app, &op, &body, ttl).await;
        }
    }
}

/// Retries recording a resend's answer while its reservation lasts. If the store stays down
/// longer, the reservation lapses and a repeat walks again, but every message this walk
/// resent carries its `requestId` mark, and the walk does not resend those twice.
async fn keep_recording(app: &App, op: &Operation, body: &str, ttl: u64) {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(RESERVATION_SECS);
    let mut delay = Duration::from_millis(100);
    while tokio::time::Instant::now() < give_up {
        tokio::time::sleep(delay).await;
        match app
            .store
            .finish_operation(&op.key, &op.fingerprint, body, ttl)
            .await
        {
            Ok(()) => return,
            Err(e) => tracing::warn!(error = %e, "cannot record the resend's answer yet"),
        }
        delay = (delay * 2).min(RECORD_RETRY_MAX);
    }
    tracing::error!(
        request_id = %op.request_id,
        "gave up recording the resend's answer; a repeat of this requestId walks again but \
         skips the messages it already resent"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MessageState;

    const ID_A: &str = "msg_0190000000000100000000000001";
    const ID_B: &str = "msg_0190000000000100000000000002";

    fn ids(ids: &[&str]) -> Option<Vec<MessageId>> {
        Some(ids.iter().map(|id| MessageId::parse(id).unwrap()).collect())
    }

    const FINGERPRINT_BY_IDS: &str = "ZCYNVgIZCVCR9RZ1SozjKg";
    const FINGERPRINT_BY_WINDOW: &str = "ppgAi6j6YjRhwSKeH9929A";

    /// Fingerprints are recorded with their `requestId`: a release that computed them
    /// otherwise would answer a client's retry across an upgrade with a 422. These are the
    /// values the request's JSON fields gave when the fingerprint was taken from them.
    #[test]
    fn fingerprints_stay_what_they_were() {
        let by_ids = Resend {
            ids: ids(&[ID_B, ID_A, ID_B]),
            query: MessageQuery {
                state: Some(MessageState::Dead),
                source: Some("payzu".into()),
                ..MessageQuery::default()
            },
            request_id: Some("r-1".into()),
        };
        let by_window = Resend {
            query: MessageQuery {
                payment_id: Some("p-1".into()),
                transaction_id: Some("tx-1".into()),
                created_from: Some(1_764_460_800_000),
                created_to: Some(1_764_460_900_250),
                ..MessageQuery::default()
            },
            ..Resend::default()
        };
        assert_eq!(by_ids.fingerprint(), FINGERPRINT_BY_IDS);
        assert_eq!(by_window.fingerprint(), FINGERPRINT_BY_WINDOW);
        let reordered = Resend {
            ids: ids(&[ID_A, ID_B]),
            request_id: Some("r-2".into()),
            ..by_ids.clone()
        };
        assert_eq!(reordered.fingerprint(), by_ids.fingerprint());
    }

    #[test]
    fn a_resend_needs_a_selector() {
        let state_only = Resend {
            query: MessageQuery {
                state: Some(MessageState::Dead),
                source: Some("payzu".into()),
                ..MessageQuery::default()
            },
            ..Resend::default()
        };
        assert!(!state_only.has_selector());
        assert!(
            Resend {
                ids: Some(Vec::new()),
                ..Resend::default()
            }
            .has_selector()
        );
        for query in [
            MessageQuery {
                payment_id: Some("p".into()),
                ..MessageQuery::default()
            },
            MessageQuery {
                transaction_id: Some("t".into()),
                ..MessageQuery::default()
            },
            MessageQuery {
                created_to: Some(0),
                ..MessageQuery::default()
            },
        ] {
            let resend = Resend {
                query,
                ..Resend::default()
            };
            assert!(resend.has_selector(), "{resend:?}");
        }
    }
}
