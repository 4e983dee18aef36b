//! The resend walkers: message by message, each resend its own store call, so a failure
//! part-way leaves the list of what was done. A message already resent under the same
//! `requestId` is not resent again.

use super::MAX_RESEND;
use crate::app::App;
use crate::metrics as m;
use crate::store::{
    HistoryEntry, ListFilter, MessageId, ResendEffect, ResendMark, StoreError, matches_filter,
};

/// Resends one message; whether it was resent (or had been, under `request_id`).
async fn resend_one(
    app: &App,
    id: &MessageId,
    request_id: Option<&str>,
) -> Result<bool, StoreError> {
    if let Some(request_id) = request_id {
        // A walk of this requestId whose answer was never recorded (its process died, or the
        // store stayed down past the reservation) may have resent this one already.
        let already = app.store.get(id).await?.is_some_and(|record| {
            record
                .history
                .iter()
                .any(|row| matches!(row, HistoryEntry::Resend(mark) if mark.request_id.as_deref() == Some(request_id)))
        });
        if already {
            return Ok(true);
        }
    }
    let now = app.clock.now_ms();
    let mark = ResendMark {
        at: now,
        request_id: request_id.map(str::to_string),
    };
    let fresh_deadline = app.settings.dispatch.deadline(now);
    let effect = app.store.resend(id, mark, fresh_deadline, now).await?;
    metrics::counter!(m::RESENDS, "effect" => m::resend_effect(effect)).increment(1);
    Ok(effect != ResendEffect::Skipped)
}

/// Resends `ids` in order, each only if it meets `filter`, pushing each one resent onto
/// `resent` as it goes.
pub(super) async fn ids(
    app: &App,
    ids: &[MessageId],
    filter: &ListFilter,
    request_id: Option<&str>,
    resent: &mut Vec<String>,
) -> Result<(), StoreError> {
    let narrowed = filter.state.is_some()
        || filter.source.is_some()
        || filter.ordering_keys.is_some()
        || filter.created_from.is_some()
        || filter.created_to.is_some();
    for id in ids {
        if narrowed {
            let record = app.store.get(id).await?;
            if !record.is_some_and(|r| matches_filter(&r, filter)) {
                continue;
            }
        }
        if resend_one(app, id, request_id).await? {
            resent.push(id.to_string());
        }
    }
    Ok(())
}

/// Like [`ids`] over what `filter` lists, page by page; returns whether it stopped at
/// [`MAX_RESEND`].
pub(super) async fn selection(
    app: &App,
    mut filter: ListFilter,
    request_id: Option<&str>,
    resent: &mut Vec<String>,
) -> Result<bool, StoreError> {
    loop {
        let page = app.store.list(&filter).await?;
        for record in page.messages {
            if resent.len() >= MAX_RESEND {
                return Ok(true);
            }
            if resend_one(app, &record.message.id, request_id).await? {
                resent.push(record.message.id.to_string());
            }
        }
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => return Ok(false),
        }
    }
}
