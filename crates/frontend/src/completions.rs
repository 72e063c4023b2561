//! `POST /v1/completions`: a text (or token-id) prompt in, a `text_completion` out.

use crate::extract::ApiJson;
use crate::generation::{Output, TokenInfo};
use crate::openai::{Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, TopLogprobs, Usage};
use crate::request_id::Tagged;
use crate::sse::{finish_reason, to_json, Format};
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_protocol::Usage as TokenUsage;
use std::sync::Arc;

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<CompletionRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let valid = crate::validate_blocking(&app, body, |v, req| v.completion(req)).await;
    let tokenizer = app.validator.tokenizer.clone();
    let model = app.validator.model_id.clone();
    crate::run(app, tagged, tracker, valid, move |id| CompletionFormat {
        id: format!("cmpl-{id}"),
        created: crate::unix_now(),
        model,
        tokenizer,
    })
    .await
}

/// Writes `text_completion` objects.
pub struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
}

impl CompletionFormat {
    fn completion(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    fn choice(&self, out: &Output, logprobs: bool) -> CompletionChoice {
        CompletionChoice {
            index: 0,
            text: out.text.clone(),
            logprobs: logprobs.then(|| self.logprobs(&out.tokens)),
            finish_reason: finish_reason(out.finish),
        }
    }

    fn logprobs(&self, tokens: &[TokenInfo]) -> CompletionLogprobs {
        let text = |id| self.tokenizer.token_text(id).unwrap_or_default();
        let mut lp = CompletionLogprobs::default();
        for t in tokens {
            lp.tokens.push(text(t.token));
            lp.token_logprobs.push(t.logprob);
            lp.top_logprobs.push(TopLogprobs(t.top.iter().map(|&(id, p)| (text(id), p)).collect()));
            lp.text_offset.push(t.text_offset);
        }
        lp
    }
}

impl Format for CompletionFormat {
    fn chunk(&self, step: &Output) -> String {
        let logprobs = !step.tokens.is_empty();
        to_json(&self.completion(vec![self.choice(step, logprobs)], None))
    }

    fn usage_chunk(&self, usage: TokenUsage) -> String {
        to_json(&self.completion(Vec::new(), Some(usage.into())))
    }

    fn response(&self, all: &Output, usage: TokenUsage) -> String {
        let logprobs = !all.tokens.is_empty();
        let mut choice = self.choice(all, logprobs);
        choice.finish_reason = choice.finish_reason.or(Some("stop"));
        to_json(&self.completion(vec![choice], Some(usage.into())))
    }
}
