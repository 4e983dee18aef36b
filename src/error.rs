//! Every HTTP error of the API, mapped to a status and a JSON body in one place:
//! `{"error": "<code>", "message": "<human text>"}`.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("unknown source `{0}`")]
    UnknownSource(String),
    #[error("{0}")]
    BadSignature(String),
    #[error("{0}")]
    Unauthorized(&'static str),
    #[error("this token may not use this route")]
    Forbidden,
    #[error("{message}")]
    BadRequest { code: &'static str, message: String },
    #[error("body exceeds {0} bytes")]
    TooLarge(usize),
    #[error("the request body did not arrive within {0} s")]
    RequestTimeout(u64),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    NotFound(String),
    #[error("payment cannot move from `{from}` to `{to}`")]
    InvalidTransition { from: String, to: String },
    #[error("this idempotency key was used with a different request body")]
    IdempotencyMismatch,
    #[error("{0}")]
    Conflict(String),
    #[error("the store cannot record this durably right now; retry")]
    Unavailable(#[source] StoreError),
    #[error("shutting down: send requests to another instance")]
    ShuttingDown,
    #[error("too many request bodies are being received at once; retry")]
    Busy,
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }

    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::UnknownSource(_) => (StatusCode::NOT_FOUND, "unknown_source"),
            ApiError::BadSignature(_) => (StatusCode::UNAUTHORIZED, "invalid_signature"),
            ApiError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "unauthorized"),
            ApiError::Forbidden => (StatusCode::FORBIDDEN, "forbidden"),
            ApiError::BadRequest { code, .. } => (StatusCode::BAD_REQUEST, code),
            ApiError::TooLarge(_) => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            ApiError::RequestTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            ApiError::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            ApiError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ApiError::InvalidTransition { .. } => (StatusCode::CONFLICT, "invalid_transition"),
            ApiError::IdempotencyMismatch => {
                (StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused")
            }
            ApiError::Conflict(_) => (StatusCode::CONFLICT, "in_progress"),
            ApiError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "store_unavailable"),
            ApiError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
            ApiError::Busy => (StatusCode::SERVICE_UNAVAILABLE, "server_busy"),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ApiError::Unavailable(e)
    }
}

/// The JSON shape of every error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// Stable machine-readable code, e.g. `invalid_signature`.
    pub error: String,
    pub message: String,
    /// Current payment status (`invalid_transition` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Requested payment status (`invalid_transition` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if let ApiError::Unavailable(e) = &self {
            tracing::warn!(error = %e, "store unavailable, answering 503");
        }
        let (from, to) = match &self {
            ApiError::InvalidTransition { from, to } => (Some(from.clone()), Some(to.clone())),
            _ => (None, None),
        };
        let body = ErrorBody {
            error: code.to_string(),
            message: self.to_string(),
            from,
            to,
        };
        let mut response = (status, Json(body)).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
