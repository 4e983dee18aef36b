//! `/openapi.json`: generated from the handlers' annotations, then completed with what the
//! annotations cannot say (see [`complete`]), so that the document and the server agree on
//! every request a client may send: schemathesis checks that in CI (`.ci/schemathesis.sh`).

use axum::Json;
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{admin, callbacks, health, notifications, recoveries};
use crate::http::error::ErrorCode;
use crate::inbound::dedupe::{MAX_ID_LEN, MAX_SAFE_ID};
use crate::store::ids::PATTERN as MESSAGE_ID;

#[derive(OpenApi)]
#[openapi(
    info(title = "callbackd", description = "Makes payment callbacks safe to retry."),
    paths(
        callbacks::receive,
        notifications::hand_off,
        admin::get_message,
        admin::list_messages,
        admin::resend,
        admin::held_hosts,
        recoveries::start,
        recoveries::list,
        recoveries::get,
        health::healthz,
        health::readyz,
        health::metrics,
        health::index,
        spec,
    ),
    components(schemas(
        crate::http::error::ErrorBody,
        crate::http::error::ErrorCode,
        super::views::AttemptView,
        super::views::AnswerView,
        crate::store::MessageState,
        crate::store::MessageKind,
        crate::store::ResendEffect,
        crate::payment::PaymentStatus,
        crate::operations::resend::dry_run::DryRunAnswer,
        crate::operations::recover::RecoveryWindowView,
        crate::store::WindowState,
    )),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = openapi.components.as_mut() {
            for (name, role) in [
                ("admin", "auth.admin_tokens"),
                ("connector", "auth.connector_tokens"),
            ] {
                components.add_security_scheme(
                    name,
                    SecurityScheme::Http(
                        HttpBuilder::new()
                            .scheme(HttpAuthScheme::Bearer)
                            .description(Some(format!("A token from `{role}`")))
                            .build(),
                    ),
                );
            }
        }
    }
}

/// Visible ASCII, no space at either end: what the server accepts in `Idempotency-Key`
/// (after trimming, which HTTP does anyway).
pub const HEADER_TEXT: &str = "^[!-~]([ -~]*[!-~])?$";

/// An HTTP token: what a header name may be made of.
const HEADER_NAME: &str = "^[!#$%&'*+.^_`|~0-9A-Za-z-]+$";
/// What a header value may hold: anything but control characters (a tab is allowed).
const HEADER_VALUE: &str = "^[^\\u0000-\\u0008\\u000a-\\u001f\\u007f]*$";
/// The `callbackUrl`s the document promises to take: http(s), a host name or IPv4 address,
/// an optional port, path and query. The server also takes some the pattern leaves out
/// (IPv6 literals, for one); it refuses any URL it cannot parse or that has no host.
const CALLBACK_URL: &str = concat!(
    "^https?://(",
    "([A-Za-z0-9]+(-[A-Za-z0-9]+)*\\.)*[A-Za-z][A-Za-z0-9]*(-[A-Za-z0-9]+)*",
    "|(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(\\.(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}",
    ")(:[0-9]{1,4})?([/?#][!-~]*)?$"
);

/// The reserved header names, matched case-insensitively (JSON Schema patterns have no flag
/// for that, so each letter is a class).
fn reserved_headers() -> String {
    let names: Vec<String> = crate::handoff::RESERVED_HEADERS
        .iter()
        .map(|name| {
            name.chars()
                .map(|c| match c {
                    c if c.is_ascii_alphabetic() => {
                        format!("[{}{}]", c.to_ascii_lowercase(), c.to_ascii_uppercase())
                    }
                    '-' => "-".to_string(),
                    c => c.to_string(),
                })
                .collect()
        })
        .collect();
    format!("^({})$", names.join("|"))
}

/// The complete document.
pub fn document() -> Value {
    // Serialising utoipa's plain data structures cannot fail.
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or(Value::Null);
    complete(&mut doc);
    doc
}

fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    })
}

/// What utoipa's annotations cannot express:
/// - every operation that reads a body documents the answers of reading it (400
///   `unreadable_body`, 408 `request_timeout`, 413 `payload_too_large`);
/// - message ids and cursors have the pattern the server parses;
/// - a resend needs a selector (`anyOf`), and answers either what it resent or, as a dry
///   run, its count (`oneOf`); a callback needs an `id` and a `status`;
/// - links from the answers that carry message ids to the operations that take them, so a
///   client (and the fuzzer) can follow a real id.
fn complete(doc: &mut Value) {
    if let Some(paths) = doc["paths"].as_object_mut() {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for op in item.values_mut() {
                if op.get("requestBody").is_none() {
                    continue;
                }
                let Some(responses) = op["responses"].as_object_mut() else {
                    continue;
                };
                for code in [
                    ErrorCode::UnreadableBody,
                    ErrorCode::RequestTimeout,
                    ErrorCode::PayloadTooLarge,
                ] {
                    responses
                        .entry(code.status().as_str())
                        .or_insert_with(|| error_response(code.meaning()));
                }
            }
        }
    }

    let paths = &mut doc["paths"];
    set_param(
        &mut paths["/v1/messages/{id}"]["get"],
        "id",
        json!({"type": "string", "pattern": MESSAGE_ID}),
    );
    set_param(
        &mut paths["/v1/messages"]["get"],
        "cursor",
        json!({"type": ["string", "null"], "pattern": MESSAGE_ID}),
    );
    set_param(
        &mut paths["/v1/notifications"]["post"],
        "Idempotency-Key",
        key_text(),
    );
    paths["/v1/callbacks/{source}"]["post"]["requestBody"]["content"]["application/json"]["schema"] = json!({
        "type": "object",
        "description": "The provider's callback. Other fields are kept and forwarded as they are.",
        "required": ["id", "status"],
        "properties": {
            "id": {
                "description": "Transaction id",
                "oneOf": [
                    {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN},
                    {"type": "integer", "minimum": -MAX_SAFE_ID, "maximum": MAX_SAFE_ID}
                ]
            },
            "status": {
                "description": "Transaction status; `X-Callback-Event`, when sent, takes its place in the dedupe key",
                "type": ["string", "number"]
            }
        }
    });

    let message_id_link =
        |expression: &str| json!({"operationId": "get_message", "parameters": {"id": expression}});
    let resend_link = |expression: &str| json!({"operationId": "resend", "requestBody": {"messageIds": [expression]}});
    paths["/v1/notifications"]["post"]["responses"]["202"]["links"] = json!({
        "GetNotification": message_id_link("$response.body#/notificationId"),
        "ResendNotification": resend_link("$response.body#/notificationId"),
    });
    paths["/v1/callbacks/{source}"]["post"]["responses"]["200"]["links"] = json!({
        "GetEvent": message_id_link("$response.body#/messageId"),
        "ResendEvent": resend_link("$response.body#/messageId"),
    });

    let hand_off = &mut doc["components"]["schemas"]["NotificationRequest"]["properties"];
    hand_off["callbackUrl"]["pattern"] = json!(CALLBACK_URL);
    hand_off["headers"] = json!({
        "type": ["object", "null"],
        "description": "Static headers for every attempt (e.g. `X-VTEX-API-AppKey`, `X-VTEX-API-AppToken`); not the ones that belong to HTTP or to callbackd",
        "maxProperties": crate::handoff::MAX_HEADERS,
        "propertyNames": {"pattern": HEADER_NAME, "not": {"pattern": reserved_headers()}},
        "additionalProperties": {"type": "string", "pattern": HEADER_VALUE},
    });

    // A dry run (`"dryRun": true`) answers its count instead of what was resent.
    doc["paths"]["/v1/admin/resend"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] = json!({
        "oneOf": [
            {"$ref": "#/components/schemas/ResendAnswer"},
            {"$ref": "#/components/schemas/DryRunAnswer"}
        ]
    });

    let resend = &mut doc["components"]["schemas"]["ResendRequest"];
    let request_id = &mut resend["properties"]["requestId"];
    let description = request_id["description"].take();
    *request_id = key_text();
    request_id["description"] = description;
    resend["properties"]["messageIds"]["items"] = json!({"type": "string", "pattern": MESSAGE_ID});
    resend["properties"]["messageIds"]["maxItems"] = json!(crate::operations::resend::MAX_IDS);
    resend["anyOf"] = Value::Array(
        [
            ("messageIds", json!({"type": "array"})),
            ("paymentId", json!({"type": "string"})),
            ("transactionId", json!({"type": "string"})),
            ("createdAtFrom", json!({"type": "string"})),
            ("createdAtTo", json!({"type": "string"})),
        ]
        .into_iter()
        .map(|(field, schema)| json!({"required": [field], "properties": {field: schema}}))
        .collect(),
    );
}

/// A key the client chooses (`Idempotency-Key`, a resend's `requestId`), when given: the
/// one rule the server checks both with ([`super::is_visible_text`]).
fn key_text() -> Value {
    json!({"type": ["string", "null"], "pattern": HEADER_TEXT, "minLength": 1, "maxLength": super::MAX_KEY_LEN})
}

/// Replaces the schema of the parameter `name` of an operation.
fn set_param(op: &mut Value, name: &str, schema: Value) {
    if let Some(params) = op["parameters"].as_array_mut() {
        for p in params.iter_mut().filter(|p| p["name"] == name) {
            p["schema"] = schema.clone();
        }
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "OpenAPI 3 document", body = Object)), tag = "ops")]
pub async fn spec() -> Json<Value> {
    Json(document())
}
