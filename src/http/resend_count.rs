//! The resend dry run (`"dryRun": true`): how many messages a resend would deliver again,
//! counted without changing anything, so an operator (or the console) can confirm a bulk
//! resend by its size first.

use serde::Serialize;
use utoipa::ToSchema;

use crate::app::App;
use crate::clock::Millis;
use crate::http::error::ApiError;
use crate::store::{ListFilter, MessageId, MessageRecord, lifecycle};

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

/// Unknown ids are not counted, nor what a resend skips (`lifecycle::resend_skips`).
fn resendable(record: &MessageRecord, now: Millis) -> bool {
    !lifecycle::resend_skips(record.state, record.ends_at, now)
}

pub async fn count(
    app: &App,
    ids: Option<&[MessageId]>,
    mut filter: ListFilter,
    max: usize,
    batch: usize,
) -> Result<DryRunAnswer, ApiError> {
    let mut would_resend = 0;
    let now = app.clock.now_ms();
    if let Some(ids) = ids {
        for id in ids {
            if let Some(record) = app.store.get(id).await?
                && resendable(&record, now)
                // Ids are narrowed by the other filters, as in the resend itself.
                && crate::store::matches_filter(&record, &filter)
            {
                would_resend += 1;
            }
        }
        return Ok(DryRunAnswer {
            resent: 0,
            message_ids: Vec::new(),
            dry_run: true,
            would_resend,
            more: false,
        });
    }
    filter.limit = batch;
    loop {
        let page = app.store.list(&filter).await?;
        for record in page.messages {
            if !resendable(&record, now) {
                continue;
            }
            if would_resend >= max {
                return Ok(DryRunAnswer {
                    resent: 0,
                    message_ids: Vec::new(),
                    dry_run: true,
                    would_resend,
                    more: true,
                });
            }
            would_resend += 1;
        }
        match page.next_after {
            Some(after) => filter.after = Some(after),
            None => break,
        }
    }
    Ok(DryRunAnswer {
        resent: 0,
        message_ids: Vec::new(),
        dry_run: true,
        would_resend,
        more: false,
    })
}
