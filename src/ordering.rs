//! Ordering keys: the queue a message waits in (only its head is due, so messages of one key
//! are delivered in order) and, hashed, the partition it lives in. Every form is rendered here
//! and nowhere else, so the code that files a message and the code that finds it (a listing by
//! payment or transaction, the alert check) cannot disagree.

use std::fmt;

/// What a message is ordered by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderingKey<'a> {
    /// A connector's notifications of one payment: `pay/<payment id>`.
    Payment(&'a str),
    /// A provider's callbacks of one transaction: `src/<source>/<transaction id>`.
    Transaction { source: &'a str, id: &'a str },
    /// A dead-letter alert about one subject (a message id, or a digest's): `alert/<subject>`.
    Alert(&'a str),
}

const ALERT_PREFIX: &str = "alert/";

impl fmt::Display for OrderingKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OrderingKey::Payment(id) => write!(f, "pay/{id}"),
            OrderingKey::Transaction { source, id } => write!(f, "src/{source}/{id}"),
            OrderingKey::Alert(subject) => write!(f, "{ALERT_PREFIX}{subject}"),
        }
    }
}

/// Whether a rendered ordering key is an alert's.
pub fn is_alert(ordering_key: &str) -> bool {
    ordering_key.starts_with(ALERT_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_renders_once_and_alerts_are_told_apart() {
        assert_eq!(OrderingKey::Payment("p1").to_string(), "pay/p1");
        let tx = OrderingKey::Transaction {
            source: "payzu",
            id: "tx1",
        };
        assert_eq!(tx.to_string(), "src/payzu/tx1");
        let alert = OrderingKey::Alert("msg_1").to_string();
        assert_eq!(alert, "alert/msg_1");
        assert!(is_alert(&alert));
        assert!(!is_alert("pay/alert/x"));
    }
}
