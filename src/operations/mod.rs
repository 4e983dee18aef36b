//! The admin API's use cases, below `http`: what listing and resending messages do once the
//! request is parsed. Handlers parse and check the request's fields (`http::query`), call one
//! function here, and map its outcome to an answer; these know nothing of HTTP, and their
//! errors are mapped to statuses in `http/error.rs`.
//!
//! - `messages.rs`: a listing's filters (`MessageQuery`) and the store filter they become;
//! - `resend/`: the resend use case: its `requestId` (fingerprint, reservation, the recorded
//!   answer), the walk detached from the request, the batch walkers with each message's
//!   idempotency, and the dry run's count;
//! - `recover/`: the provider-side recovery: its checks and windows, the requests to the
//!   provider's resend API, and its report of new and replayed callbacks.

pub mod messages;
pub mod recover;
pub mod resend;
