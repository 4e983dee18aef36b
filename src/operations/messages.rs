//! Which messages a listing or a resend selects: its filters, parsed ([`MessageQuery`]), and
//! the store filter they become. A transaction id names the provider's event stream in one
//! source or in each configured one; a payment id names its notifications.

use crate::app::App;
use crate::clock::Millis;
use crate::inbound;
use crate::payment;
use crate::store::{ListFilter, MessageId, MessageState, Page, StoreError};

/// The filters of a listing or a resend, each parsed. Filters always combine; none is
/// ignored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MessageQuery {
    pub state: Option<MessageState>,
    pub source: Option<String>,
    /// The payment's notifications.
    pub payment_id: Option<String>,
    /// A provider's transaction: its events in `source`, or in every configured source. Not
    /// empty.
    pub transaction_id: Option<String>,
    /// Inclusive.
    pub created_from: Option<Millis>,
    /// Inclusive.
    pub created_to: Option<Millis>,
}

impl MessageQuery {
    /// The store filter listing `limit` messages at a time, or `None` when the filters
    /// contradict each other: a payment id and a transaction id together select nothing (a
    /// message has one or the other), like any other filters that no message meets.
    pub fn filter<'a>(
        &self,
        configured_sources: impl IntoIterator<Item = &'a str>,
        limit: usize,
    ) -> Option<ListFilter> {
        // A transaction id is a provider's, so it names one event stream per source: the
        // given source's, else every configured source's.
        let transaction_keys = self.transaction_id.as_ref().map(|transaction| {
            let sources: Vec<&str> = match &self.source {
                Some(source) => vec![source.as_str()],
                None => configured_sources.into_iter().collect(),
            };
            sources
                .into_iter()
                .map(|source| inbound::accept::ordering_key(source, transaction))
                .collect::<Vec<_>>()
        });
        let ordering_keys = match (&self.payment_id, transaction_keys) {
            (Some(_), Some(_)) => return None,
            (Some(p), None) => Some(vec![payment::ordering_key(p)]),
            (None, keys) => keys,
        };
        Some(ListFilter {
            state: self.state,
            source: self.source.clone(),
            ordering_keys,
            created_from: self.created_from,
            created_to: self.created_to,
            after: None,
            limit,
        })
    }
}

/// The names of the configured sources, which a transaction id without a source spans.
pub fn configured_sources(app: &App) -> impl Iterator<Item = &str> {
    app.settings.sources.keys().map(String::as_str)
}

/// A page of at most `limit` messages `query` selects, oldest first, after the cursor
/// `after`; filters that contradict each other give an empty page.
pub async fn list(
    app: &App,
    query: &MessageQuery,
    limit: usize,
    after: Option<MessageId>,
) -> Result<Page, StoreError> {
    let Some(filter) = query.filter(configured_sources(app), limit) else {
        return Ok(Page {
            messages: Vec::new(),
            next_after: None,
        });
    };
    app.store.list(&ListFilter { after, ..filter }).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transaction_spans_the_given_source_or_every_configured_one() {
        let query = MessageQuery {
            transaction_id: Some("tx-1".into()),
            ..MessageQuery::default()
        };
        let keys = |query: &MessageQuery| {
            let mut keys = query
                .filter(["payzu", "other"], 10)
                .and_then(|f| f.ordering_keys)
                .unwrap();
            keys.sort();
            keys
        };
        assert_eq!(
            keys(&query),
            vec![
                inbound::accept::ordering_key("other", "tx-1"),
                inbound::accept::ordering_key("payzu", "tx-1"),
            ]
        );
        let in_one = MessageQuery {
            source: Some("payzu".into()),
            ..query.clone()
        };
        assert_eq!(
            keys(&in_one),
            vec![inbound::accept::ordering_key("payzu", "tx-1")]
        );
    }

    #[test]
    fn a_payment_and_a_transaction_together_select_nothing() {
        let payment = MessageQuery {
            payment_id: Some("p-1".into()),
            state: Some(MessageState::Dead),
            created_from: Some(5),
            ..MessageQuery::default()
        };
        let filter = payment.filter([], 7).unwrap();
        assert_eq!(
            filter.ordering_keys,
            Some(vec![payment::ordering_key("p-1")])
        );
        assert_eq!(
            (filter.state, filter.created_from, filter.limit),
            (Some(MessageState::Dead), Some(5), 7)
        );
        let both = MessageQuery {
            transaction_id: Some("tx-1".into()),
            ..payment
        };
        assert_eq!(both.filter(["payzu"], 7), None);
    }
}
