//! Bearer-token roles: connector tokens may hand off notifications, admin tokens may inspect
//! and resend. A route takes its role as an extractor ([`Admin`], [`Connector`]), so a
//! handler runs only for a token of that role. A valid token of the other role gets 403 (it
//! is known, just not allowed here); anything else 401. Tokens are compared in constant time.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use subtle::ConstantTimeEq;

use crate::app::App;
use crate::http::error::ApiError;

/// A request made with an admin token.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

/// A request made with a connector token.
#[derive(Debug, Clone, Copy)]
pub struct Connector;

impl FromRequestParts<Arc<App>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Admin, ApiError> {
        let auth = &app.settings.auth;
        require(&parts.headers, &auth.admin_tokens, &auth.connector_tokens).map(|()| Admin)
    }
}

impl FromRequestParts<Arc<App>> for Connector {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Connector, ApiError> {
        let auth = &app.settings.auth;
        require(&parts.headers, &auth.connector_tokens, &auth.admin_tokens).map(|()| Connector)
    }
}

fn any_equal(tokens: &[String], presented: &[u8]) -> bool {
    // Every token is compared (no early exit), so timing does not reveal which one matched.
    tokens.iter().fold(0u8, |hit, t| {
        hit | t.as_bytes().ct_eq(presented).unwrap_u8()
    }) == 1
}

/// Passes a bearer token among `mine`; one among `theirs` (the other role's) is forbidden.
fn require(headers: &HeaderMap, mine: &[String], theirs: &[String]) -> Result<(), ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized(
            "missing `Authorization: Bearer <token>` header",
        ))?
        .trim()
        .as_bytes();
    if any_equal(mine, presented) {
        Ok(())
    } else if any_equal(theirs, presented) {
        Err(ApiError::Forbidden)
    } else {
        Err(ApiError::Unauthorized("unknown token"))
    }
}
