//! A fake PayZu API on 127.0.0.1 for recoveries: it answers `POST /v1/user/callbacks/resend`
//! as PayZu documents (`{"message", "total"}`), records every request (its `Authorization`
//! header and window), and then posts, signed as PayZu signs them, the callbacks of its
//! transactions created in that window to the callbackd processes it is pointed at (round
//! robin, so several processes share the work).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use callbackd::clock::parse_rfc3339;
use callbackd::webhook::{PAYZU_HEADER, sign_payzu};
use serde_json::{Value, json};

pub const API_TOKEN: &str = "payzu-api-token-0123456789";

/// One resend request as the fake received it.
#[derive(Debug, Clone)]
pub struct ResendCall {
    pub authorization: Option<String>,
    pub from: String,
    pub to: String,
}

/// A transaction of the provider: when it was created and the callback it sends.
#[derive(Debug, Clone)]
pub struct Transaction {
    pub created_at: i64,
    pub body: String,
}

impl Transaction {
    pub fn new(created_at: i64, id: &str, status: &str) -> Transaction {
        Transaction {
            created_at,
            body: json!({"id": id, "status": status, "type": "DEPOSIT", "method": "PIX",
                         "amount": 10.0})
            .to_string(),
        }
    }
}

#[derive(Default)]
struct Inner {
    calls: Vec<ResendCall>,
    /// Answers given instead of the normal one, one per request, in order.
    forced: VecDeque<(u16, String)>,
    transactions: Vec<Transaction>,
    targets: Vec<String>,
    next_target: usize,
    /// Callbacks posted, and what callbackd answered each (status, replayed).
    posted: Vec<(u16, bool)>,
}

#[derive(Clone)]
pub struct FakePayzu {
    pub url: String,
    secret: Arc<String>,
    inner: Arc<Mutex<Inner>>,
    client: reqwest::Client,
}

impl FakePayzu {
    /// Starts the fake; callbacks are signed with `secret` (the source's in callbackd).
    pub async fn start(secret: &str) -> FakePayzu {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let fake = FakePayzu {
            url,
            secret: Arc::new(secret.to_string()),
            inner: Arc::default(),
            client: reqwest::Client::builder().no_proxy().build().unwrap(),
        };
        let app = axum::Router::new()
            .route("/v1/user/callbacks/resend", axum::routing::post(resend))
            .with_state(fake.clone());
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        fake
    }

    pub fn add(&self, transactions: impl IntoIterator<Item = Transaction>) {
        self.inner.lock().unwrap().transactions.extend(transactions);
    }

    /// The callbackd base URLs callbacks are posted to, in turn.
    pub fn target(&self, urls: &[&str]) {
        self.inner.lock().unwrap().targets = urls.iter().map(|u| u.to_string()).collect();
    }

    /// The next requests are answered `status` with `body` (one per request, in order).
    pub fn fail_next(&self, answers: &[(u16, &str)]) {
        self.inner
            .lock()
            .unwrap()
            .forced
            .extend(answers.iter().map(|(s, b)| (*s, b.to_string())));
    }

    pub fn calls(&self) -> Vec<ResendCall> {
        self.inner.lock().unwrap().calls.clone()
    }

    /// Callbacks posted so far and callbackd's answers: (status, replayed).
    pub fn posted(&self) -> Vec<(u16, bool)> {
        self.inner.lock().unwrap().posted.clone()
    }

    /// Posts one transaction's callback, signed now, to the next target; callbackd's answer.
    pub async fn post(&self, tx: &Transaction) -> (u16, bool) {
        self.post_signed_ago(tx, 0).await
    }

    /// [`FakePayzu::post`], signed `secs` ago (within the source's tolerance): the first
    /// delivery of a callback, made earlier than its resend, whose signature differs.
    pub async fn post_signed_ago(&self, tx: &Transaction, secs: i64) -> (u16, bool) {
        let target = {
            let mut inner = self.inner.lock().unwrap();
            let n = inner.targets.len().max(1);
            let target = inner.targets.get(inner.next_target % n).cloned();
            inner.next_target += 1;
            target.expect("FakePayzu::target was called")
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
            - secs;
        let signature = sign_payzu(self.secret.as_bytes(), now, tx.body.as_bytes());
        let response = self
            .client
            .post(format!("{target}/v1/callbacks/payzu"))
            .header(PAYZU_HEADER, signature)
            .header("content-type", "application/json")
            .body(tx.body.clone())
            .send()
            .await
            .expect("callbackd answers the provider");
        let answer = (
            response.status().as_u16(),
            response.headers().contains_key("idempotent-replayed"),
        );
        self.inner.lock().unwrap().posted.push(answer);
        answer
    }
}

async fn resend(State(fake): State<FakePayzu>, headers: HeaderMap, body: Json<Value>) -> Response {
    let authorization = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (from, to) = (
        body["createdAtFrom"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        body["createdAtTo"].as_str().unwrap_or_default().to_string(),
    );
    let forced = {
        let mut inner = fake.inner.lock().unwrap();
        inner.calls.push(ResendCall {
            authorization: authorization.clone(),
            from: from.clone(),
            to: to.clone(),
        });
        inner.forced.pop_front()
    };
    if let Some((status, body)) = forced {
        return (StatusCode::from_u16(status).unwrap(), body).into_response();
    }
    if authorization.as_deref() != Some(&format!("Bearer {API_TOKEN}")) {
        return (
            StatusCode::UNAUTHORIZED,
            Json(json!({"message": "Unauthorized"})),
        )
            .into_response();
    }
    let (Some(from), Some(to)) = (parse_rfc3339(&from), parse_rfc3339(&to)) else {
        return (
            StatusCode::BAD_REQUEST,
            Json(json!({"message": "createdAtFrom and createdAtTo are required"})),
        )
            .into_response();
    };
    let due: Vec<Transaction> = fake
        .inner
        .lock()
        .unwrap()
        .transactions
        .iter()
        .filter(|t| (from..to).contains(&t.created_at))
        .cloned()
        .collect();
    let total = due.len();
    // Like the provider: the answer first, the callbacks after it, on their own.
    tokio::spawn(async move {
        for tx in &due {
            fake.post(tx).await;
        }
    });
    Json(json!({"message": "Callbacks resent", "total": total})).into_response()
}
