//! How long what a store keeps outlives its use, where the config says nothing. A leaf, so the
//! config's defaults and the engines read one number.

/// How long a payment's status outlives its last transition when the config says nothing:
/// 400 days, past any refund or chargeback window, so a refund on day 31 still finds the
/// payment `settled` after its dedupe claims are long gone.
pub const DEFAULT_PAYMENT_RETENTION_SECS: u64 = 400 * 86_400;
