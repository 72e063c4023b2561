//! pdserve's frontend: the first hop of the request path.
//!
//! ```text
//! client ─HTTP─► frontend ─GenerateRequest─► router/worker (dyn Generate)
//! client ◄─SSE── frontend ◄──── TokenStream (tokens, then Done | Failed)
//! ```
//!
//! OpenAI-compatible HTTP in (`/v1/completions`, `/v1/chat/completions`,
//! `/v1/embeddings`, `/v1/models`, `/health`, `/metrics`), and Anthropic's `/v1/messages` and OpenAI's
//! `/v1/responses` over the chat path; validation into a [`ValidRequest`] (chat template, tokenization, sampling
//! ranges); a token stream back, detokenized, cut at stop strings and sent as JSON or
//! server-sent events. Every failure is one [`ApiError`], mapped once to a status, and
//! to each API's error body by its format. Dropping a
//! response (client gone) drops its token stream, which cancels the request on every
//! hop behind this one.

mod anthropic;
mod auth;
mod chat_completions;
mod completions;
mod cors;
mod embeddings;
mod errors;
mod extract;
mod generation;
mod lifecycle;
mod listen;
pub use pdserve_telemetry::metrics;
pub mod observe;
mod openai;
mod request_id;
mod response_store;
mod responses;
mod sse;
mod stop;
mod structured;
mod tokenize;
mod tools;
mod validate;

pub use cors::Origins;
pub use errors::ApiError;
pub use extract::BODY_LIMIT;
pub use lifecycle::Lifecycle;
pub use listen::HttpLimits;
pub use metrics::Metrics;
pub use validate::{
    GenerationDefaults, ValidRequest, Validator, DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS,
};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use extract::ApiJson;
use generation::{Generation, Tracker};
use metrics::Outcome;
use observe::{Observer, RequestRecord};
use pdserve_protocol::{Generate, GenerateRequest, ServeError};
use pdserve_text::chat::ChatTemplate;
use pdserve_text::grammar::Grammars;
use pdserve_text::tokenizer::Tokenizer;
use request_id::Tagged;
use sse::Choice;
use sse::Format;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// The HTTP frontend over the served models.
pub struct Frontend {
    state: AppState,
    /// The served models, the first the one a request naming none gets.
    models: Vec<Model>,
}

/// One model behind the port: what validation needs of it, and where its requests go.
pub(crate) struct Model {
    generate: Arc<dyn Generate>,
    validator: Validator,
}

/// Another model behind the same port (`serve --model A --model B`).
pub struct ModelSpec {
    pub generate: Arc<dyn Generate>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Arc<ChatTemplate>,
    /// The names it answers to, the first listed first.
    pub names: Vec<String>,
    pub context_length: usize,
    pub grammars: Option<Arc<Grammars>>,
}

/// What every handler shares.
pub(crate) struct AppState {
    /// The served models, the first the one a request naming none gets.
    models: Vec<Arc<Model>>,
    /// Sampling values for fields a request leaves out, for every model.
    defaults: GenerationDefaults,
    metrics: Metrics,
    /// The `mode` label of the latency histograms.
    mode: Arc<str>,
    created: u64,
    life: Lifecycle,
    /// Browser origins allowed to call the API (CORS); none by default.
    origins: Option<Origins>,
    /// Hears of every request (lifecycle events), if set.
    observer: Option<Arc<dyn Observer>>,
    /// The key clients must present, if any.
    api_key: Option<auth::ApiKey>,
    /// Responses kept for `previous_response_id`.
    responses: Arc<response_store::ResponseStore>,
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
        let spec =
            ModelSpec { generate, tokenizer, chat, names: vec![model_id.into()], context_length, grammars: None };
        Frontend::serving(spec, metrics)
    }

    /// A frontend over `first` (the model a request naming none gets); more with
    /// [`Frontend::with_model`].
    pub fn serving(first: ModelSpec, metrics: Metrics) -> Frontend {
        let life = Lifecycle::default();
        let state = AppState {
            models: Vec::new(),
            defaults: GenerationDefaults::default(),
            metrics,
            mode: "auto".into(),
            created: unix_now(),
            life,
            origins: None,
            observer: None,
            api_key: None,
            responses: Arc::default(),
        };
        Frontend { state, models: vec![Model::new(first)] }
    }

    /// Serves another model behind the same port: requests naming one of `spec`'s
    /// names go to it.
    pub fn with_model(mut self, spec: ModelSpec) -> Frontend {
        self.models.push(Model::new(spec));
        self
    }

    /// Serves constrained outputs (`response_format`, tools that must be called, ...)
    /// of the first model with `grammars`, built from its tokenizer.
    pub fn with_grammars(mut self, grammars: Option<Arc<Grammars>>) -> Frontend {
        self.models[0].validator.grammars = grammars;
        self
    }

    /// Tells `observer` of every request: accepted, then finished with its route,
    /// workers and phase timings.
    pub fn with_observer(mut self, observer: Option<Arc<dyn Observer>>) -> Frontend {
        self.state.observer = observer;
        self
    }

    /// Sets the `mode` label of the request latency histograms (default `auto`): the
    /// serving mode, so runs of different modes can be told apart.
    pub fn with_mode(mut self, mode: &str) -> Frontend {
        self.state.mode = mode.into();
        self
    }

    /// The names the first model answers to (`--served-model-name`, as vLLM's); the
    /// first is the one listed first. None given: the model's own name.
    pub fn with_served_names(mut self, names: Vec<String>) -> Frontend {
        if !names.is_empty() {
            self.models[0].validator.model_ids = names;
        }
        self
    }

    /// Samples every model with `defaults` where a request leaves a field out.
    pub fn with_generation_defaults(mut self, defaults: GenerationDefaults) -> Frontend {
        self.state.defaults = defaults;
        self
    }

    /// Lets browsers on `origins` call the API (CORS).
    pub fn with_cors(mut self, origins: Option<Origins>) -> Frontend {
        self.state.origins = origins;
        self
    }

    /// Requires `key` on every route but `/health` and `/metrics` (see `auth.rs`).
    pub fn with_api_key(mut self, key: Option<&str>) -> Frontend {
        self.state.api_key = key.map(auth::ApiKey::new);
        self
    }

    /// Drains and cuts this frontend's requests at shutdown.
    pub fn lifecycle(&self) -> Lifecycle {
        self.state.life.clone()
    }

    /// The axum router with every route, the body limit and JSON fallbacks.
    pub fn router(self) -> Router {
        let Frontend { mut state, models: served } = self;
        state.models = served
            .into_iter()
            .map(|mut m| {
                m.validator.defaults = state.defaults.clone();
                Arc::new(m)
            })
            .collect();
        let origins = state.origins.clone();
        let mut app = Router::new()
            .route("/v1/completions", post(completions::handler))
            .route("/v1/chat/completions", post(chat_completions::handler))
            .route("/v1/messages", post(anthropic::handler))
            .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
            .route("/v1/embeddings", post(embeddings::handler))
            .route("/v1/responses", post(responses::create))
            .route("/v1/responses/{id}", get(responses::get).delete(responses::delete))
            .route("/v1/responses/{id}/input_items", get(responses::input_items))
            .route("/v1/models", get(models))
            .route("/v1/models/{*id}", get(model_card))
            .route("/tokenize", post(tokenize::tokenize))
            .route("/detokenize", post(tokenize::detokenize))
            .route("/tokenizer_info", get(tokenize::info))
            .route("/health", get(health))
            .route("/metrics", get(metrics_text))
            .method_not_allowed_fallback(|| async { ApiError::MethodNotAllowed })
            .fallback(|uri: Uri| async move { ApiError::RouteNotFound(uri.path().to_string()) });
        // Inside the request id (a 401 carries one) and CORS (a preflight has no key).
        if let Some(key) = state.api_key.clone() {
            let metrics = state.metrics.clone();
            app = app.layer(axum::middleware::from_fn(move |req, next| {
                auth::middleware(key.clone(), metrics.clone(), req, next)
            }));
        }
        let app = app
            .layer(DefaultBodyLimit::max(BODY_LIMIT))
            .layer(axum::middleware::from_fn(request_id::middleware))
            .with_state(Arc::new(state));
        match origins {
            Some(o) => app.layer(axum::middleware::from_fn(move |req, next| cors::middleware(o.clone(), req, next))),
            None => app,
        }
    }
}

/// Serves `app` on `listener` with the default [`HttpLimits`] until the process ends.
/// Shutting down is the caller's [`Lifecycle`]: it drains (new requests get 503,
/// connections are still accepted), waits, then cuts what is left.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    listen::serve(listener, app, HttpLimits::default()).await
}

/// Serves only `/metrics` (and `/health`) on `listener`, for a process with no API
/// of its own (the fleet planner).
pub async fn serve_metrics(listener: tokio::net::TcpListener, metrics: Metrics) -> std::io::Result<()> {
    let text = move || {
        let m = metrics.clone();
        async move { ([(CONTENT_TYPE, metrics::CONTENT_TYPE)], m.render()) }
    };
    let app = Router::new()
        .route("/metrics", get(text))
        .route("/health", get(|| async { Json(serde_json::json!({"status": "ok"})) }));
    serve(listener, app).await
}

/// [`serve`] under `limits`.
pub async fn serve_with(listener: tokio::net::TcpListener, app: Router, limits: HttpLimits) -> std::io::Result<()> {
    listen::serve(listener, app, limits).await
}

impl Model {
    fn new(spec: ModelSpec) -> Model {
        let ModelSpec { generate, tokenizer, chat, names, context_length, grammars } = spec;
        let longest =
            (0..tokenizer.vocab_size() as u32).filter_map(|t| tokenizer.token_bytes(t)).map(<[u8]>::len).max();
        let max_prompt_bytes = context_length.saturating_mul(longest.unwrap_or(1).max(1));
        let validator = Validator {
            tokenizer,
            chat,
            model_ids: names,
            context_length,
            max_prompt_bytes,
            grammars,
            defaults: GenerationDefaults::default(),
        };
        Model { generate, validator }
    }
}

/// A request body that names the model it is for.
pub(crate) trait ForModel {
    fn model(&self) -> Option<&str>;
}

/// A validated request and the model it goes to.
pub(crate) struct Checked {
    pub(crate) model: Arc<Model>,
    pub(crate) request: ValidRequest,
}

impl AppState {
    /// The model a request names (the first one where it names none), or 404.
    pub(crate) fn model(&self, name: Option<&str>) -> Result<&Arc<Model>, ApiError> {
        let Some(name) = name else { return self.models.first().ok_or(ApiError::ModelNotFound(String::new())) };
        let named = |m: &&Arc<Model>| m.validator.model_ids.iter().any(|id| id == name);
        self.models.iter().find(named).ok_or_else(|| ApiError::ModelNotFound(name.to_string()))
    }

    fn tracker(&self, tagged: &Tagged) -> Tracker {
        let t = Tracker::new(self.metrics.clone(), self.mode.clone(), tagged.span.clone(), self.life.enter());
        let Some(observer) = &self.observer else { return t };
        let record = RequestRecord {
            request_id: tagged.tag.to_string(),
            api: tagged.path.clone(),
            ingress: tagged.ingress.clone(),
            context: tagged.context.clone(),
            ..Default::default()
        };
        t.observed(observer.clone(), record)
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Finds the model the request names and validates it for that model on the blocking
/// pool: templates and tokenization are CPU work that must not stall the async workers.
pub(crate) async fn validate_blocking<R: ForModel + Send + 'static>(
    app: &Arc<AppState>,
    body: Result<ApiJson<R>, ApiError>,
    check: fn(&Validator, R) -> Result<ValidRequest, ApiError>,
) -> Result<Checked, ApiError> {
    let ApiJson(req) = body?;
    let model = app.model(req.model())?.clone();
    let m = model.clone();
    let request = tokio::task::spawn_blocking(move || check(&m.validator, req))
        .await
        .map_err(|e| ApiError::Serve(ServeError::Internal(format!("validation failed: {e}"))))??;
    Ok(Checked { model, request })
}

/// Sends a validated request downstream and answers with JSON or SSE. `format`
/// gets the request's public id and the request.
pub(crate) async fn run<F: Format>(
    app: Arc<AppState>,
    tagged: Tagged,
    tracker: Tracker,
    valid: Result<Checked, ApiError>,
    format: impl FnOnce(&str, &ValidRequest) -> F,
) -> Response {
    let mut tracker = tracker;
    let (model, v) = match valid {
        Ok(_) if app.life.is_draining() => return reject::<F>(tracker, ApiError::Serve(ServeError::ShuttingDown)),
        Ok(c) => (c.model, c.request),
        Err(e) => return reject::<F>(tracker, e),
    };
    let served = model.validator.model_ids.first().unwrap_or(&v.model);
    tracker.accepted(&v.model, served, v.prompts.iter().map(|p| p.ids.len()).sum());
    if let Some(field) = v.constrained_by {
        app.metrics.constrained(field);
        tagged.span.record("constrained_by", field);
    }
    let format = format(tagged.tag.as_str(), &v);
    let choices = match dispatch(&model, &tagged, tracker, &v).await {
        Ok(c) => c,
        Err(e) => return F::error_response(e),
    };
    let answer = match v.stream {
        true => sse::streamed(choices, format, v.include_usage, app.life.clone()).await,
        false => sse::whole(choices, format, app.life.clone()).await,
    };
    answer.unwrap_or_else(F::error_response)
}

/// Starts every choice of a request: the first choice of each prompt at once, the
/// others once that first choice produced its first token, so its prompt is in a
/// prefix cache and they reuse its KV instead of computing it again. Choice `k` of a
/// seeded request uses seed + `k`, so the choices differ.
async fn dispatch(app: &Model, tagged: &Tagged, tracker: Tracker, v: &ValidRequest) -> Result<Vec<Choice>, ApiError> {
    let mut tracker = Some(tracker);
    let mut choices = Vec::with_capacity(v.prompts.len() * v.n);
    for p in 0..v.prompts.len() {
        match start(app, tagged, v, (p, 0), &mut tracker) {
            Ok(c) => choices.push(c),
            Err(e) => return Err(tracker.take().map_or(e.clone(), |t| reject_quietly(t, e))),
        }
    }
    if v.n > 1 {
        for c in &mut choices {
            c.generation.prime().await?;
        }
        for p in 0..v.prompts.len() {
            for k in 1..v.n {
                choices.push(start(app, tagged, v, (p, k), &mut None)?);
            }
        }
    }
    Ok(choices)
}

/// Sends choice `k` of prompt `p` downstream; it takes the tracker (if any) once it
/// is under way, and leaves it to count a refusal.
fn start(
    app: &Model,
    tagged: &Tagged,
    v: &ValidRequest,
    (p, k): (usize, usize),
    tracker: &mut Option<Tracker>,
) -> Result<Choice, ApiError> {
    let prompt = v.prompts[p].ids.clone();
    let prompt_tokens = prompt.len();
    let mut params = v.params.clone();
    params.seed = params.seed.map(|s| s.wrapping_add(k as u64));
    let trace = tracker.as_ref().map(Tracker::trace).unwrap_or_default();
    let req = GenerateRequest {
        fence: None,
        id: request_id::internal_id(),
        tag: tagged.tag.clone(),
        prompt,
        params: params.clone(),
        trace,
    };
    let tokens = tagged.span.in_scope(|| app.generate.generate(req))?;
    let mut generation =
        Generation::new(tokens, app.validator.tokenizer.clone(), &params, prompt_tokens, tracker.take());
    if v.prompt_only {
        generation = generation.silent();
    }
    if v.token_ids {
        generation = generation.with_ids();
    }
    Ok(Choice { index: (p * v.n + k) as u32, prompt: p, generation })
}

/// Counts a refusal and hands the error back.
fn reject_quietly(mut tracker: Tracker, e: ApiError) -> ApiError {
    tracker.error(e.kind());
    tracker.finish(Outcome::Rejected);
    e
}

/// Refused before generation started: counted as `rejected`, answered in `F`'s API's
/// shape.
fn reject<F: Format>(tracker: Tracker, e: ApiError) -> Response {
    F::error_response(reject_quietly(tracker, e))
}

impl AppState {
    fn card(&self, m: &Model, id: &str) -> openai::ModelCard {
        openai::ModelCard {
            id: id.to_string(),
            object: "model",
            created: self.created,
            owned_by: "pdserve",
            max_model_len: m.validator.context_length,
        }
    }
}

async fn models(State(app): State<Arc<AppState>>) -> Json<openai::ModelList> {
    let data = app.models.iter().flat_map(|m| m.validator.model_ids.iter().map(|id| app.card(m, id))).collect();
    Json(openai::ModelList { object: "list", data })
}

/// `GET /v1/models/{id}`: one served name's card, or 404.
async fn model_card(
    State(app): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<openai::ModelCard>, ApiError> {
    let m = app.model(Some(&id))?;
    Ok(Json(app.card(m, &id)))
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    if app.life.is_draining() {
        return ApiError::Serve(ServeError::ShuttingDown).into_response();
    }
    match app.models.iter().any(|m| m.generate.ready()) {
        true => Json(serde_json::json!({"status": "ok"})).into_response(),
        false => ApiError::Serve(ServeError::NoWorker("no worker is ready".into())).into_response(),
    }
}

async fn metrics_text(State(app): State<Arc<AppState>>) -> Response {
    ([(CONTENT_TYPE, metrics::CONTENT_TYPE)], app.metrics.render()).into_response()
}
