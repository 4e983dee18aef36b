//! Inbound callbacks: signature verification and dedupe key derivation, both pure so they are
//! tested exhaustively without a server.

pub mod dedupe;
pub mod signature;
