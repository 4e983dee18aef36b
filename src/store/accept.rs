//! What an accept carries to the store and what it answers: the dedupe claim, the payment
//! transition, the signature seal and the message, claimed and recorded in one step.

use super::{NewMessage, PaymentId};
use crate::clock::Millis;
use crate::payment::PaymentStatus;

/// A dedupe claim: the key is already hashed and scoped, and the response is what every
/// replay of this key gets back, byte for byte.
#[derive(Debug, Clone, PartialEq)]
pub struct DedupeClaim {
    /// Lives in the partition of the message's ordering key (on Redis, its hash slot), so a
    /// key must always come with the same ordering key: true for callbacks (the id is in
    /// both) and for notifications (keys are scoped to the payment).
    pub key: String,
    pub ttl_secs: u64,
    /// Hash of the request; a replay with a different one is a conflict (422). `None` for
    /// inbound callbacks, whose key is derived from the body itself.
    pub fingerprint: Option<String>,
    pub response: String,
}

/// How every engine stores "no fingerprint": as the empty string, in every layout so far, so
/// claims written by earlier releases read back the same. Only the storage format knows it.
const NO_FINGERPRINT: &str = "";

impl DedupeClaim {
    /// The fingerprint in the engines' storage format.
    pub fn stored_fingerprint(&self) -> &str {
        self.fingerprint.as_deref().unwrap_or(NO_FINGERPRINT)
    }
}

/// A fingerprint read back from storage: the stored form of "none" is none.
pub fn fingerprint_from_stored(stored: String) -> Option<String> {
    (stored != NO_FINGERPRINT).then_some(stored)
}

/// The payment status compare-and-set that goes with a notification.
#[derive(Debug, Clone, PartialEq)]
pub struct PaymentTransition {
    pub payment_id: PaymentId,
    pub to: PaymentStatus,
    /// Statuses the payment may be in for the transition to apply; a payment never seen is
    /// [`PaymentStatus::Undefined`].
    pub allowed_from: Vec<PaymentStatus>,
}

/// A verified provider signature, single-use while its timestamp is inside the tolerance
/// window. The seal keeps the answer of the claim the signature was accepted under: the same
/// signature with the same dedupe key is a replay of it; with another dedupe key (the same
/// signed bytes under another unsigned `X-Callback-Event`) it is
/// [`AcceptOutcome::SignatureReused`], so a captured request is not a new event, while a
/// provider's real second event, signed again, gets through.
#[derive(Debug, Clone, PartialEq)]
pub struct SignatureSeal {
    /// Hash of the source and the signature bytes; in the partition of the message.
    pub key: String,
    /// Until when the signature could still be accepted, so until when it is remembered (at
    /// most as long as the claim it is sealed to).
    pub expires_at: Millis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AcceptRequest {
    pub dedupe: DedupeClaim,
    pub message: NewMessage,
    pub payment: Option<PaymentTransition>,
    /// Inbound callbacks of a signed source; `None` for notifications and unsigned sources.
    pub seal: Option<SignatureSeal>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum AcceptOutcome {
    /// Lease and recorded now.
    Accepted,
    /// The key was claimed before: the stored response, unchanged.
    Replayed { response: String },
    /// The key was claimed before by a request with another fingerprint.
    Conflict,
    /// The payment is in `from`, which does not allow the transition. Nothing was recorded.
    InvalidTransition { from: String },
    /// The request's signature is sealed to another dedupe key's answer. Nothing was
    /// recorded and no key claimed.
    SignatureReused,
}
