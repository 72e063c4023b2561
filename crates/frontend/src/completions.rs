//! `POST /v1/completions`: text or token-id prompts in (one, or a batch), `n`
//! `text_completion` choices each out, optionally echoing the prompt and scoring it.

use crate::extract::ApiJson;
use crate::generation::{Output, TokenInfo};
use crate::openai::{Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, TopLogprobs, Usage};
use crate::request_id::Tagged;
use crate::sse::{data, finish_reason, to_json, Format};
use crate::validate::ValidRequest;
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use pdserve_protocol::{TokenOut, Usage as TokenUsage};
use pdserve_text::tokenizer::Tokenizer;
use std::collections::HashSet;
use std::sync::Arc;

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<CompletionRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let valid = crate::validate_blocking(&app, body, |v, req| v.completion(req)).await;
    crate::run(app, tagged, tracker, valid, move |id, v| {
        CompletionFormat::new(format!("cmpl-{id}"), v, v.tokenizer.clone())
    })
    .await
}

/// What echoing needs of one prompt.
struct Echo {
    text: String,
    ids: Vec<u32>,
}

/// Writes `text_completion` objects.
pub struct CompletionFormat {
    id: String,
    created: u64,
    model: String,
    tokenizer: Arc<Tokenizer>,
    /// Choices per prompt: choice `i` answers prompt `i / n`.
    n: usize,
    /// Set when the request echoes its prompts.
    echo: Option<Vec<Echo>>,
    /// vLLM's `prompt_logprobs` field was asked for.
    prompt_field: bool,
    /// vLLM's `return_token_ids` was asked for: each prompt's ids and the output's.
    token_ids: bool,
    /// Each prompt's ids (empty unless `token_ids`).
    prompt_ids: Vec<Vec<u32>>,
    /// Choices whose prompt was already echoed (streaming).
    echoed: HashSet<u32>,
}

impl CompletionFormat {
    fn new(id: String, v: &ValidRequest, tokenizer: Arc<Tokenizer>) -> Self {
        let echo = v.echo.then(|| {
            v.prompts
                .iter()
                .map(|p| Echo { text: p.text.clone().unwrap_or_else(|| tokenizer.decode(&p.ids)), ids: p.ids.clone() })
                .collect()
        });
        CompletionFormat {
            id,
            created: crate::unix_now(),
            model: v.model.clone(),
            tokenizer,
            n: v.n.max(1),
            echo,
            prompt_field: v.prompt_logprobs,
            token_ids: v.token_ids,
            prompt_ids: v.prompts.iter().filter(|_| v.token_ids).map(|p| p.ids.clone()).collect(),
            echoed: HashSet::new(),
        }
    }

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

    /// One choice's part: `first` when it is the first the client sees of this choice
    /// (the echoed prompt goes there).
    fn choice(&self, index: u32, out: &Output, first: bool, logprobs: bool) -> CompletionChoice {
        let echo = self.echo.as_ref().filter(|_| first).map(|e| &e[index as usize / self.n]);
        let mut text = echo.map(|e| e.text.clone()).unwrap_or_default();
        let shift = text.chars().count();
        text.push_str(&out.text);
        let logprobs = logprobs.then(|| {
            let mut lp = CompletionLogprobs::default();
            if let Some(e) = echo {
                self.prompt_entries(e, out.prompt.as_deref().unwrap_or_default(), &mut lp);
            }
            self.token_entries(&out.tokens, shift, &mut lp);
            lp
        });
        CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: finish_reason(out.finish),
            prompt_logprobs: self.prompt_field.then(|| out.prompt.as_deref().map(|s| self.vllm_scores(s))).flatten(),
            prompt_token_ids: self.prompt_ids.get(index as usize / self.n).filter(|_| first).cloned(),
            token_ids: self.token_ids.then(|| out.ids.clone()),
        }
    }

    fn text_of(&self, id: u32) -> String {
        self.tokenizer.token_text(id).unwrap_or_default()
    }

    /// The echoed prompt's tokens: the first has no logprob (nothing precedes it).
    fn prompt_entries(&self, e: &Echo, scores: &[TokenOut], lp: &mut CompletionLogprobs) {
        let mut offset = 0;
        for (i, &id) in e.ids.iter().enumerate() {
            let text = self.text_of(id);
            lp.tokens.push(text.clone());
            lp.text_offset.push(offset);
            offset += text.chars().count();
            let score = i.checked_sub(1).and_then(|j| scores.get(j));
            lp.token_logprobs.push(score.map(|s| s.logprob));
            lp.top_logprobs.push(score.map(|s| self.top(&s.top)));
        }
    }

    fn token_entries(&self, tokens: &[TokenInfo], shift: usize, lp: &mut CompletionLogprobs) {
        for t in tokens {
            lp.tokens.push(self.text_of(t.token));
            lp.token_logprobs.push(Some(t.logprob));
            lp.top_logprobs.push(Some(self.top(&t.top)));
            lp.text_offset.push(shift + t.text_offset);
        }
    }

    fn top(&self, top: &[(u32, f32)]) -> TopLogprobs {
        TopLogprobs(top.iter().map(|&(id, p)| (self.text_of(id), p)).collect())
    }

    fn vllm_scores(&self, scores: &[TokenOut]) -> Vec<Option<serde_json::Value>> {
        vllm_prompt_logprobs(&self.tokenizer, scores)
    }
}

/// vLLM's `prompt_logprobs` form: `[null, {id: {logprob, rank, decoded_token}}, ...]`,
/// each prompt token with its alternatives. Ranks are exact among the alternatives
/// returned; a token outside them ranks right after those more likely than it.
pub(crate) fn vllm_prompt_logprobs(tok: &Tokenizer, scores: &[TokenOut]) -> Vec<Option<serde_json::Value>> {
    let mut out = vec![None];
    for s in scores {
        let mut entry = serde_json::Map::new();
        let rank = 1 + s.top.iter().filter(|(id, p)| *id != s.token && *p > s.logprob).count();
        let mut put = |id: u32, logprob: f32, rank: usize| {
            let text = tok.token_text(id).unwrap_or_default();
            let v = serde_json::json!({"logprob": logprob, "rank": rank, "decoded_token": text});
            entry.entry(id.to_string()).or_insert(v);
        };
        put(s.token, s.logprob, rank);
        for (r, &(id, p)) in s.top.iter().enumerate() {
            put(id, p, r + 1);
        }
        out.push(Some(serde_json::Value::Object(entry)));
    }
    out
}

impl Format for CompletionFormat {
    fn chunk(&mut self, index: u32, step: &Output) -> Vec<String> {
        let first = self.echoed.insert(index);
        let logprobs = !step.tokens.is_empty() || (self.echo.is_some() && first && step.prompt.is_some());
        let choice = self.choice(index, step, first, logprobs);
        vec![data(&to_json(&self.completion(vec![choice], None)))]
    }

    fn usage_chunk(&self, usage: TokenUsage) -> String {
        to_json(&self.completion(Vec::new(), Some(usage.into())))
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: TokenUsage) -> String {
        let list = choices
            .iter()
            .map(|(index, out)| {
                let logprobs = !out.tokens.is_empty() || (self.echo.is_some() && out.prompt.is_some());
                let mut choice = self.choice(*index, out, true, logprobs);
                choice.finish_reason = choice.finish_reason.or(Some("stop"));
                choice
            })
            .collect();
        to_json(&self.completion(list, Some(usage.into())))
    }
}
