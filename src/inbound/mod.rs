//! Inbound callbacks: the source's signature check, the dedupe key, and the accept request a
//! verified callback becomes, all pure so they are tested exhaustively without a server.

pub mod accept;
pub mod dedupe;
pub mod signature;
