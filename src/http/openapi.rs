//! `/openapi.json`, generated from the handlers' annotations.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{admin, callbacks, health, notifications};

#[derive(OpenApi)]
#[openapi(
    info(title = "callbackd", description = "Makes payment callbacks safe to retry."),
    paths(
        callbacks::receive,
        notifications::hand_off,
        admin::get_message,
        admin::list_messages,
        admin::resend,
        health::healthz,
        health::readyz,
        health::metrics,
        health::index,
        spec,
    ),
    components(schemas(
        crate::error::ErrorBody,
        crate::store::Attempt,
        crate::store::ReceiverAnswer,
        crate::store::MessageState,
        crate::store::MessageKind,
        crate::store::ResendEffect,
        crate::payment::PaymentStatus,
    )),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            components.add_security_scheme(
                "bearer",
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "OpenAPI 3 document", body = Object)), tag = "ops")]
pub async fn spec() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
