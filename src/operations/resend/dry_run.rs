//! The resend dry run (`"dryRun": true`): how many messages a resend would deliver again,
//! counted without changing anything, so an operator (or the console) can confirm a bulk
//! resend by its size first. It does not use the `requestId`.

use serde::Serialize;
use utoipa::ToSchema;

use super::{MAX_RESEND, Resend, ResendError, Target};
use crate::app::App;
use crate::clock::Millis;
use crate::store::{ListFilter, MessageId, MessageRecord, StoreError, lifecycle, matches_filter};

/// Shaped like a resend's answer (nothing resent, no ids) plus the count, so a client that
/// reads every resend answer the same way still reads this one right.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DryRunAnswer {
    /// Always 0: a dry run resends nothing.
    pub resent: usize,
    /// Always empty.
    pub message_ids: Vec<String>,
    /// Always true.
    pub dry_run: bool,
    /// Messages the same request without `dryRun` would resend now.
    pub would_resend: usize,
    /// True when the selection holds more than one request may resend.
    pub more: bool,
}

/// Counts what [`super::run`] would resend now, with the same checks.
pub async fn count(app: &App, resend: Resend) -> Result<DryRunAnswer, ResendError> {
    let now = app.clock.now_ms();
    let (would_resend, more) = match resend.target(app)? {
        Target::Ids(ids, filter) => (count_ids(app, &ids, &filter, now).await?, false),
        Target::Selection(filter) => count_selection(app, filter, now).await?,
        Target::Nothing => (0, false),
    };
    Ok(DryRunAnswer {
        resent: 0,
        message_ids: Vec::new(),
        dry_run: true,
        would_resend,
        more,
    })
}

/// Unknown ids are not counted, nor what a resend skips (`lifecycle::resend_skips`).
fn resendable(record: &MessageRecord, now: Millis) -> bool {
    !lifecycle::resend_skips(record.state, record.ends_at, now)
}

async fn count_ids(
    app: &App,
    ids: &[MessageId],
    filter: &ListFilter,
    now: Millis,
) -> Result<usize, StoreError> {
    let mut would_resend = 0;
    for id in ids {
        if let Some(record) = app.store.get(id).await?
            && resendable(&record, now)
            // Ids are narrowed by the other filters, as in the resend itself.
            && matches_filter(&record, filter)
        {
            would_resend += 1;
        }
    }
    Ok(would_resend)
}

/// The count, and whether the selection holds more than [`MAX_RESEND`].
async fn count_selection(
    app: &App,
    mut filter: ListFilter,
    now: Millis,
) -> Result<(usize, bool), StoreError> {
    let mut would_resend = 0;
    loop {
        let page = app.store.list(&filter).await?;
        for record in page.messages {
            if !resendable(&record, now) {
                continue;
            }
            if would_resend >= MAX_RESEND {
                return Ok((would_resend, true));
            }
            would_resend += 1;
        }
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => return Ok((would_resend, false)),
        }
    }
}
