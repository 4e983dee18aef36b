//! Every HTTP error of the API, mapped to a status and a JSON body in one place:
//! `{"error": "<code>", "message": "<human text>"}`.
//!
//! [`ErrorCode`] is the one catalogue of codes: the error table of docs/api.md, the OpenAPI
//! `ErrorBody.error` enum and the metric outcomes are checked against it, and an error can
//! only be built from one of its codes.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use crate::handoff::HandOffError;
use crate::inbound::accept::CallbackError;
use crate::operations::recover::RecoverError;
use crate::operations::resend::ResendError;
use crate::store::StoreError;

/// Declares the codes once, with their status and meaning, so the list of all codes cannot
/// miss one.
macro_rules! error_catalogue {
    ($($variant:ident => $status:expr, $code:literal, $meaning:literal;)+) => {
        /// Stable machine-readable error code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
        #[serde(rename_all = "snake_case")]
        pub enum ErrorCode {
            $(#[doc = $meaning] $variant,)+
        }

        impl ErrorCode {
            /// Every code, in the order of docs/api.md's table.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $code,)+
                }
            }

            pub fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => $status,)+
                }
            }

            pub fn meaning(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $meaning,)+
                }
            }
        }
    };
}

error_catalogue! {
    InvalidJson => StatusCode::BAD_REQUEST, "invalid_json",
        "The body is not valid JSON.";
    InvalidCallback => StatusCode::BAD_REQUEST, "invalid_callback",
        "A callback body that is not a JSON object, or has no usable `id` or `status`.";
    InvalidEventHeader => StatusCode::BAD_REQUEST, "invalid_event_header",
        "`X-Callback-Event` is empty, longer than 128 characters or not visible ASCII.";
    InvalidRequest => StatusCode::BAD_REQUEST, "invalid_request",
        "A field of a hand-off or resend body, or the `Idempotency-Key` header, is missing or wrong; the message names it.";
    InvalidQuery => StatusCode::BAD_REQUEST, "invalid_query",
        "A list filter or resend selection is malformed (a bad time, state, id or limit); the message names it.";
    NoSelector => StatusCode::BAD_REQUEST, "no_selector",
        "A resend names no `messageIds`, `paymentId`, `transactionId` or time window.";
    UnreadableBody => StatusCode::BAD_REQUEST, "unreadable_body",
        "The body could not be read (a broken connection or chunked encoding).";
    InvalidSignature => StatusCode::UNAUTHORIZED, "invalid_signature",
        "A callback's signature is missing, wrong or outside the timestamp tolerance.";
    Unauthorized => StatusCode::UNAUTHORIZED, "unauthorized",
        "No `Authorization: Bearer` token, or an unknown one.";
    Forbidden => StatusCode::FORBIDDEN, "forbidden",
        "A known token of the other role (a connector token on an admin route, or the reverse).";
    NotFound => StatusCode::NOT_FOUND, "not_found",
        "No such message, or no such route.";
    UnknownSource => StatusCode::NOT_FOUND, "unknown_source",
        "No source of that name is configured.";
    MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed",
        "The route exists but does not take that method.";
    RequestTimeout => StatusCode::REQUEST_TIMEOUT, "request_timeout",
        "The body did not arrive within `server.request_timeout_secs`.";
    InProgress => StatusCode::CONFLICT, "in_progress",
        "A resend with the same `requestId` is still running.";
    InvalidTransition => StatusCode::CONFLICT, "invalid_transition",
        "The payment cannot move to that status from its current one (`from`, `to`).";
    SignatureReused => StatusCode::CONFLICT, "signature_reused",
        "A callback's signature was already accepted with another dedupe key (another `X-Callback-Event`); nothing was recorded; send the event signed again.";
    PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large",
        "The body is larger than `server.max_body_bytes`.";
    IdempotencyKeyReused => StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused",
        "The idempotency key was used before with a different body.";
    InvalidRecovery => StatusCode::UNPROCESSABLE_ENTITY, "invalid_recovery",
        "A recovery is refused: an unknown source or one without `provider_api_url`, a bad time, `from` not before `to`, `from` more than 30 days back, `to` in the future, or `countSecs` out of range; the message names the field and the limit, and nothing was sent or recorded.";
    StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE, "store_unavailable",
        "The store cannot record durably right now; nothing was recorded; retry after `Retry-After`.";
    StoreFull => StatusCode::SERVICE_UNAVAILABLE, "store_full",
        "The store is out of memory or disk and refuses writes; nothing was recorded; retry after `Retry-After`.";
    ServerBusy => StatusCode::SERVICE_UNAVAILABLE, "server_busy",
        "Request bodies already fill `server.max_buffered_bytes`; nothing was recorded; retry after `Retry-After`.";
    ShuttingDown => StatusCode::SERVICE_UNAVAILABLE, "shutting_down",
        "`/readyz` once shutdown has begun: send requests to another instance.";
}

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
    BadRequest { code: ErrorCode, message: String },
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
    #[error(
        "this signature was already accepted for another event of the transaction; sign this \
         event again"
    )]
    SignatureReused,
    #[error("the store cannot record this durably right now; retry")]
    Unavailable(#[source] StoreError),
    #[error("shutting down: send requests to another instance")]
    ShuttingDown,
    #[error("too many request bodies are being received at once; retry")]
    Busy,
}

impl ApiError {
    pub fn bad_request(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            code,
            message: message.into(),
        }
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::UnknownSource(_) => ErrorCode::UnknownSource,
            ApiError::BadSignature(_) => ErrorCode::InvalidSignature,
            ApiError::Unauthorized(_) => ErrorCode::Unauthorized,
            ApiError::Forbidden => ErrorCode::Forbidden,
            ApiError::BadRequest { code, .. } => *code,
            ApiError::TooLarge(_) => ErrorCode::PayloadTooLarge,
            ApiError::RequestTimeout(_) => ErrorCode::RequestTimeout,
            ApiError::MethodNotAllowed(_) => ErrorCode::MethodNotAllowed,
            ApiError::NotFound(_) => ErrorCode::NotFound,
            ApiError::InvalidTransition { .. } => ErrorCode::InvalidTransition,
            ApiError::IdempotencyMismatch => ErrorCode::IdempotencyKeyReused,
            ApiError::Conflict(_) => ErrorCode::InProgress,
            ApiError::SignatureReused => ErrorCode::SignatureReused,
            ApiError::Unavailable(StoreError::Full(_)) => ErrorCode::StoreFull,
            ApiError::Unavailable(_) => ErrorCode::StoreUnavailable,
            ApiError::ShuttingDown => ErrorCode::ShuttingDown,
            ApiError::Busy => ErrorCode::ServerBusy,
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        ApiError::Unavailable(e)
    }
}

impl From<CallbackError> for ApiError {
    fn from(e: CallbackError) -> Self {
        ApiError::bad_request(ErrorCode::InvalidCallback, e.to_string())
    }
}

impl From<HandOffError> for ApiError {
    fn from(e: HandOffError) -> Self {
        ApiError::bad_request(ErrorCode::InvalidRequest, e.to_string())
    }
}

impl From<ResendError> for ApiError {
    fn from(e: ResendError) -> Self {
        match e {
            ResendError::NoSelector => ApiError::bad_request(ErrorCode::NoSelector, e.to_string()),
            ResendError::InProgress => ApiError::Conflict(e.to_string()),
            ResendError::RequestIdReused => ApiError::IdempotencyMismatch,
            ResendError::Store(e) => ApiError::Unavailable(e),
            ResendError::Answer(e) => {
                ApiError::bad_request(ErrorCode::InvalidRequest, e.to_string())
            }
        }
    }
}

impl From<RecoverError> for ApiError {
    fn from(e: RecoverError) -> Self {
        match e {
            RecoverError::Refused { .. } => {
                ApiError::bad_request(ErrorCode::InvalidRecovery, e.to_string())
            }
            RecoverError::Store(e) => ApiError::Unavailable(e),
        }
    }
}

/// The JSON shape of every error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorCode,
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
        let code = self.code();
        let status = code.status();
        if let ApiError::Unavailable(e) = &self {
            tracing::warn!(error = %e, "store unavailable, answering 503");
        }
        let (from, to) = match &self {
            ApiError::InvalidTransition { from, to } => (Some(from.clone()), Some(to.clone())),
            _ => (None, None),
        };
        let body = ErrorBody {
            error: code,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_catalogue_names_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for code in ErrorCode::ALL {
            assert_eq!(
                serde_json::to_value(code).unwrap(),
                serde_json::Value::String(code.as_str().into())
            );
            assert!(seen.insert(code.as_str()), "{} twice", code.as_str());
            assert!(code.status().is_client_error() || code.status().is_server_error());
        }
    }
}
