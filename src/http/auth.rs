//! Bearer-token roles: connector tokens may hand off notifications, admin tokens may inspect
//! and resend. A valid token of the other role gets 403 (it is known, just not allowed here);
//! anything else 401. Tokens are compared in constant time.

use axum::http::{HeaderMap, header};
use subtle::ConstantTimeEq;

use crate::app::App;
use crate::http::error::ApiError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Connector,
    Admin,
}

fn any_equal(tokens: &[String], presented: &[u8]) -> bool {
    // Every token is compared (no early exit), so timing does not reveal which one matched.
    tokens.iter().fold(0u8, |hit, t| {
        hit | t.as_bytes().ct_eq(presented).unwrap_u8()
    }) == 1
}

pub fn require(app: &App, headers: &HeaderMap, role: Role) -> Result<(), ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized(
            "missing `Authorization: Bearer <token>` header",
        ))?
        .trim()
        .as_bytes();
    let auth = &app.settings.auth;
    let (mine, theirs) = match role {
        Role::Connector => (&auth.connector_tokens, &auth.admin_tokens),
        Role::Admin => (&auth.admin_tokens, &auth.connector_tokens),
    };
    if any_equal(mine, presented) {
        Ok(())
    } else if any_equal(theirs, presented) {
        Err(ApiError::Forbidden)
    } else {
        Err(ApiError::Unauthorized("unknown token"))
    }
}
