//! pdserve's frontend: the first hop of the request path.
//!
//! ```text
//! client ─HTTP─► frontend ─GenerateRequest─► router/worker (dyn Generate)
//! client ◄─SSE── frontend ◄──── TokenStream (tokens, then Done | Failed)
//! ```
//!
//! OpenAI-compatible HTTP in (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, `/health`, `/metrics`); validation into a [`ValidRequest`] (chat
//! template, tokenization, sampling ranges); a token stream back, detokenized, cut at
//! stop strings and sent as JSON or server-sent events. Every failure is one
//! [`ApiError`], mapped once to a status and an OpenAI error body. Dropping a
//! response (client gone) drops its token stream, which cancels the request on every
//! hop behind this one.

mod chat_completions;
mod completions;
mod errors;
mod extract;
mod generation;
pub mod metrics;
mod openai;
mod request_id;
mod sse;
mod stop;
mod validate;

pub use errors::ApiError;
pub use extract::BODY_LIMIT;
pub use metrics::Metrics;
pub use validate::{ValidRequest, Validator, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use extract::ApiJson;
use generation::{Generation, Tracker};
use metrics::Outcome;
use pdserve_engine::chat::ChatTemplate;
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_protocol::{Generate, GenerateRequest, ServeError};
use request_id::Tagged;
use sse::Format;
use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The HTTP frontend over one served model.
pub struct Frontend {
    state: AppState,
}

/// What every handler shares.
pub(crate) struct AppState {
    generate: Arc<dyn Generate>,
    validator: Validator,
    metrics: Metrics,
    /// The `mode` label of the latency histograms.
    mode: Arc<str>,
    created: u64,
}

impl Frontend {
    /// A frontend that sends validated requests to `generate` (the router, or one
    /// worker) and records into `metrics` (share the handle with the router and
    /// workers so `/metrics` shows theirs too).
    pub fn new(
        generate: Arc<dyn Generate>,
        tokenizer: Arc<Tokenizer>,
        chat: Arc<ChatTemplate>,
        model_id: impl Into<String>,
        context_length: usize,
        metrics: Metrics,
    ) -> Frontend {
        let created = unix_now();
        let validator = Validator { tokenizer, chat, model_id: model_id.into(), context_length };
        let state = AppState { generate, validator, metrics, mode: "auto".into(), created };
        Frontend { state }
    }

    /// Sets the `mode` label of the request latency histograms (default `auto`): the
    /// serving mode, so runs of different modes can be told apart.
    pub fn with_mode(mut self, mode: &str) -> Frontend {
        self.state.mode = mode.into();
        self
    }

    /// The axum router with every route, the body limit and JSON fallbacks.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions::handler))
            .route("/v1/chat/completions", post(chat_completions::handler))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
            .fallback(|uri: Uri| async move { ApiError::RouteNotFound(uri.path().to_string()) })
            .layer(DefaultBodyLimit::max(BODY_LIMIT))
            .layer(axum::middleware::from_fn(request_id::middleware))
            .with_state(Arc::new(self.state))
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then finishes the requests in
/// flight (streams included) and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

impl AppState {
    fn tracker(&self, tagged: &Tagged) -> Tracker {
        Tracker::new(self.metrics.clone(), self.mode.clone(), tagged.span.clone())
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Validates on the blocking pool: templates and tokenization are CPU work that must
/// not stall the async workers.
pub(crate) async fn validate_blocking<R: Send + 'static>(
    app: &Arc<AppState>,
    body: Result<ApiJson<R>, ApiError>,
    check: fn(&Validator, R) -> Result<ValidRequest, ApiError>,
) -> Result<ValidRequest, ApiError> {
    let ApiJson(req) = body?;
    let app = app.clone();
    tokio::task::spawn_blocking(move || check(&app.validator, req))
        .await
        .map_err(|e| ApiError::Serve(ServeError::Internal(format!("validation failed: {e}"))))?
}

/// Sends a validated request downstream and answers with JSON or SSE. `format`
/// gets the request's public id.
pub(crate) async fn run<F: Format>(
    app: Arc<AppState>,
    tagged: Tagged,
    tracker: Tracker,
    valid: Result<ValidRequest, ApiError>,
    format: impl FnOnce(&str) -> F,
) -> Response {
    let ValidRequest { prompt, params, stream, include_usage } = match valid {
        Ok(v) => v,
        Err(e) => return reject(tracker, e),
    };
    let prompt_tokens = prompt.len();
    let req =
        GenerateRequest { id: request_id::internal_id(), tag: tagged.tag.clone(), prompt, params: params.clone() };
    let tokens = match tagged.span.in_scope(|| app.generate.generate(req)) {
        Ok(t) => t,
        Err(e) => return reject(tracker, e.into()),
    };
    let generation = Generation::new(tokens, app.validator.tokenizer.clone(), &params, prompt_tokens, tracker);
    let format = format(tagged.tag.as_str());
    let answer = match stream {
        true => sse::streamed(generation, format, include_usage).await,
        false => sse::whole(generation, format).await,
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

/// Refused before generation started: counted as `rejected`.
fn reject(mut tracker: Tracker, e: ApiError) -> Response {
    tracker.error(e.kind());
    tracker.finish(Outcome::Rejected);
    e.into_response()
}

async fn models(State(app): State<Arc<AppState>>) -> Json<openai::ModelList> {
    let v = &app.validator;
    let card = openai::ModelCard {
        id: v.model_id.clone(),
        object: "model",
        created: app.created,
        owned_by: "pdserve",
        max_model_len: v.context_length,
    };
    Json(openai::ModelList { object: "list", data: vec![card] })
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    match app.generate.ready() {
        true => Json(serde_json::json!({"status": "ok"})).into_response(),
        false => ApiError::Serve(ServeError::NoWorker("no worker is ready".into())).into_response(),
    }
}

async fn metrics_text(State(app): State<Arc<AppState>>) -> Response {
    ([(CONTENT_TYPE, metrics::CONTENT_TYPE)], app.metrics.render()).into_response()
}
