//! The payment state machine (ARCHITECTURE.md §1.3), pure.
//!
//! `undefined → approved → settled → refunded`, `undefined → denied`, `undefined → cancelled`
//! (an async payment that expires unpaid), `approved → cancelled`. `denied`, `cancelled` and
//! `refunded` are terminal. A payment the store has never seen is `undefined`: async methods
//! (Pix, Boleto) are never approved synchronously, so every payment starts there.

use std::fmt;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum PaymentStatus {
    Undefined,
    Approved,
    Denied,
    Settled,
    Cancelled,
    Refunded,
}

impl PaymentStatus {
    pub const ALL: [PaymentStatus; 6] = [
        PaymentStatus::Undefined,
        PaymentStatus::Approved,
        PaymentStatus::Denied,
        PaymentStatus::Settled,
        PaymentStatus::Cancelled,
        PaymentStatus::Refunded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PaymentStatus::Undefined => "undefined",
            PaymentStatus::Approved => "approved",
            PaymentStatus::Denied => "denied",
            PaymentStatus::Settled => "settled",
            PaymentStatus::Cancelled => "cancelled",
            PaymentStatus::Refunded => "refunded",
        }
    }

    pub fn parse(s: &str) -> Option<PaymentStatus> {
        PaymentStatus::ALL.into_iter().find(|p| p.as_str() == s)
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            PaymentStatus::Denied | PaymentStatus::Cancelled | PaymentStatus::Refunded
        )
    }
}

impl fmt::Display for PaymentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a payment in `from` may move to `to`.
pub fn can_transition(from: PaymentStatus, to: PaymentStatus) -> bool {
    use PaymentStatus::*;
    matches!(
        (from, to),
        (Undefined, Approved)
            | (Undefined, Denied)
            | (Undefined, Cancelled)
            | (Approved, Settled)
            | (Approved, Cancelled)
            | (Settled, Refunded)
    )
}

/// The statuses from which `to` is reachable in one step: what the store's compare-and-set
/// accepts as the current status.
pub fn allowed_from(to: PaymentStatus) -> Vec<PaymentStatus> {
    PaymentStatus::ALL
        .into_iter()
        .filter(|from| can_transition(*from, to))
        .collect()
}

/// Ordering key of a payment's notifications: they are delivered in acceptance order.
pub fn ordering_key(payment_id: &str) -> String {
    crate::ordering::OrderingKey::Payment(payment_id).to_string()
}

#[cfg(test)]
mod tests {
    use super::PaymentStatus::*;
    use super::*;

    #[test]
    fn every_pair_follows_the_table() {
        let allowed = [
            (Undefined, Approved),
            (Undefined, Denied),
            (Undefined, Cancelled),
            (Approved, Settled),
            (Approved, Cancelled),
            (Settled, Refunded),
        ];
        for from in PaymentStatus::ALL {
            for to in PaymentStatus::ALL {
                assert_eq!(
                    can_transition(from, to),
                    allowed.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn terminal_states_have_no_way_out() {
        for from in PaymentStatus::ALL.into_iter().filter(|s| s.is_terminal()) {
            assert!(
                PaymentStatus::ALL
                    .into_iter()
                    .all(|to| !can_transition(from, to))
            );
        }
    }

    #[test]
    fn allowed_from_inverts_the_table() {
        assert_eq!(allowed_from(Approved), vec![Undefined]);
        assert_eq!(allowed_from(Cancelled), vec![Undefined, Approved]);
        assert_eq!(allowed_from(Refunded), vec![Settled]);
        assert!(allowed_from(Undefined).is_empty());
    }

    #[test]
    fn parse_round_trips_and_rejects_case_variants() {
        for s in PaymentStatus::ALL {
            assert_eq!(PaymentStatus::parse(s.as_str()), Some(s));
        }
        assert_eq!(PaymentStatus::parse("APPROVED"), None);
        assert_eq!(PaymentStatus::parse("paid"), None);
    }
}
