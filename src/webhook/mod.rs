//! The webhook wire format, in one place: the names of the headers callbackd reads and
//! writes, and the signature schemes it verifies (a source's callbacks, in [`verify`]) and
//! signs with (deliveries, dead-letter alerts and `callbackd send-test`, in [`sign`]).
//!
//! Nothing here knows the config or the store: a scheme takes secrets, headers, a body and
//! `now`, so every scheme is tested against fixed vectors without a server.

pub mod sign;
pub mod verify;

use hmac::Hmac;
use sha2::Sha256;

pub use sign::{
    decode_whsec, sign_hmac_sha256, sign_payzu, sign_standard_webhook, standard_webhook_headers,
};
pub use verify::{
    PayzuHeader, SignatureError, Verified, Verifier, parse_payzu_header, parse_standard_signatures,
};

/// The event of a registered webhook (`X-Callback-Event`): read from a provider's callback
/// (it takes the place of `status` in the dedupe key, §1.1) and sent with every delivery.
pub const EVENT_HEADER: &str = "x-callback-event";
/// The message id on every delivery, so a receiver can dedupe by it.
pub const MESSAGE_ID_HEADER: &str = "x-callbackd-message-id";
/// The 1-based number of the delivery attempt.
pub const ATTEMPT_HEADER: &str = "x-callbackd-attempt";
/// PayZu's signature: `t=<unix>, v1=<hex>`.
pub const PAYZU_HEADER: &str = "x-callback-signature";
/// Standard Webhooks: the signed message id, timestamp and `v1,<base64>` signatures.
pub const WEBHOOK_ID: &str = "webhook-id";
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";

type HmacSha256 = Hmac<Sha256>;
