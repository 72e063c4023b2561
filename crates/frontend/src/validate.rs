//! OpenAI requests → [`ValidRequest`]: the model checked, the prompt rendered and
//! tokenized, every sampling value range-checked. Code past this point trusts it.
//!
//! Defaults follow OpenAI and vLLM:
//! - `temperature` 1, `top_p` 1, no top-k, min-p or penalties; the server's
//!   [`GenerationDefaults`] (`--override-generation-config`, as vLLM's) replace these
//!   for fields a request leaves out.
//! - `max_tokens` 16 for completions. For chat, the rest of the context
//!   (`context_length − prompt`), capped at [`DEFAULT_CHAT_MAX_TOKENS`] so a forgotten
//!   limit cannot hold a worker for minutes. Defaults shrink to fit the context; an
//!   explicit `max_tokens` that does not fit is a 400.
//! - Text prompts are tokenized without parsing special tokens (`<|im_end|>` in user
//!   text stays text); rendered chat prompts parse them. BOS is added only when the
//!   tokenizer asks for it, and never twice.
//! - Token-id prompts are used as given.
//! - `n` choices per prompt and several prompts per completion request, at most
//!   [`MAX_CHOICES`] choices in all.
//! - `echo` (completions) returns the prompt before the completion; with `logprobs`,
//!   the prompt's tokens are scored too (first token: null), as OpenAI's legacy API
//!   does, and `max_tokens: 0` then means the prompt alone. vLLM's `prompt_logprobs`
//!   asks for the scores in its own field.

use crate::errors::ApiError;
use crate::openai::{ChatRequest, CommonParams, CompletionRequest, Content, Message, Prompt, Stop};
use crate::tools::{self, Tools};
use pdserve_protocol::ServeError;
use pdserve_text::chat::{ChatMessage, ChatTemplate};
use pdserve_text::grammar::{GrammarError, Grammars};
use pdserve_text::tokenizer::Tokenizer;
use pdserve_types::{Grammar, SamplingParams, StopCondition, TokenId, MAX_STOP_TOKEN_IDS};
use std::ops::Range;
use std::sync::Arc;

/// `max_tokens` of completions when the request names none.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;
/// Upper bound of the chat default (`context_length − prompt`).
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 4096;
/// Most alternatives per token (OpenAI allows 20).
const MAX_TOP_LOGPROBS: i64 = 20;
/// Most choices one request may ask for: prompts × `n`.
pub const MAX_CHOICES: usize = 128;

/// A request that passed every check, ready for [`pdserve_protocol::Generate`].
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// The name the request used for the model (one of the served names).
    pub model: String,
    /// That model's tokenizer, to read the output with.
    pub tokenizer: Arc<Tokenizer>,
    /// One per prompt; completions may send several.
    pub prompts: Vec<ValidPrompt>,
    /// Choices per prompt.
    pub n: usize,
    pub params: SamplingParams,
    pub stream: bool,
    /// Streamed responses end with a usage chunk.
    pub include_usage: bool,
    /// Completions: each choice's text starts with its prompt (and its logprobs with
    /// the prompt's scores).
    pub echo: bool,
    /// `max_tokens: 0` with `echo`: the prompt alone; the token generated is dropped.
    pub prompt_only: bool,
    /// vLLM's `prompt_logprobs`: the prompt's scores in a field of their own.
    pub prompt_logprobs: bool,
    /// vLLM's `return_token_ids`: the prompt's and the output's ids in the response.
    pub token_ids: bool,
    /// Chat: the tools offered, whose calls the reply is read for.
    pub tools: Option<Arc<Tools>>,
    /// The request field whose grammar constrains the output, if any.
    pub constrained_by: Option<&'static str>,
}

/// One prompt: its tokens, and its text when it came as text.
#[derive(Debug, Clone)]
pub struct ValidPrompt {
    pub ids: Vec<TokenId>,
    pub text: Option<String>,
}

/// What validation needs to know about the served model.
#[derive(Debug, Clone)]
pub struct Validator {
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Arc<ChatTemplate>,
    /// The names the model answers to (`--served-model-name`), the first one canonical.
    pub model_ids: Vec<String>,
    pub context_length: usize,
    /// Text longer than this cannot fit the context (every token covers at most the
    /// longest token's bytes): refused before any tokenization is spent on it.
    pub max_prompt_bytes: usize,
    /// Compiles output constraints, to refuse a bad one with a 400 before it is
    /// queued; `None` refuses every constrained request.
    pub grammars: Option<Arc<Grammars>>,
    /// Sampling values for fields a request leaves out.
    pub defaults: GenerationDefaults,
}

/// Sampling defaults of the server, in place of OpenAI's for fields a request does not
/// set: agents such as Codex send no `temperature`, and a small model sampled at 1
/// rambles. Given as vLLM's `--override-generation-config` JSON; unknown keys are an
/// error.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// Parses the JSON object, checking each value's range as a request's would be.
    pub fn parse(json: &str) -> Result<GenerationDefaults, String> {
        let d: GenerationDefaults = serde_json::from_str(json).map_err(|e| format!("generation config: {e}"))?;
        let c = CommonParams {
            temperature: d.temperature,
            top_p: d.top_p,
            top_k: d.top_k,
            min_p: d.min_p,
            repetition_penalty: d.repetition_penalty,
            frequency_penalty: d.frequency_penalty,
            presence_penalty: d.presence_penalty,
            ..Default::default()
        };
        sampling(&c, &GenerationDefaults::default()).map(|_| d).map_err(|e| format!("generation config: {e}"))
    }
}

/// The sampling values of `c`, each from `defaults` where `c` leaves it out, checked.
fn sampling(c: &CommonParams, defaults: &GenerationDefaults) -> Result<SamplingParams, ApiError> {
    let params = SamplingParams {
        temperature: c.temperature.or(defaults.temperature).unwrap_or(1.0),
        top_k: top_k(c.top_k.or(defaults.top_k))?,
        top_p: c.top_p.or(defaults.top_p).unwrap_or(1.0),
        min_p: c.min_p.or(defaults.min_p).unwrap_or(0.0),
        repetition_penalty: c.repetition_penalty.or(defaults.repetition_penalty).unwrap_or(1.0),
        frequency_penalty: c.frequency_penalty.or(defaults.frequency_penalty).unwrap_or(0.0),
        presence_penalty: c.presence_penalty.or(defaults.presence_penalty).unwrap_or(0.0),
        ..SamplingParams::default()
    };
    Ok(params.validate()?)
}

impl Validator {
    pub fn completion(&self, req: CompletionRequest) -> Result<ValidRequest, ApiError> {
        let model = self.check_common(&req.common)?;
        let echo = req.echo == Some(true);
        let top = match req.logprobs {
            None => None,
            Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as u32),
            Some(_) => return Err(ApiError::invalid("logprobs", "logprobs must be between 0 and 20")),
        };
        let prompts = self.prompts(req.prompt)?;
        let explicit = count("max_tokens", req.common.max_tokens)?;
        let prompt_only = explicit == Some(0);
        if prompt_only && !echo {
            return Err(ApiError::invalid("max_tokens", "max_tokens must be at least 1 (0 only with echo)"));
        }
        // The one token a prompt-only request generates is dropped.
        let explicit = if prompt_only { Some(1) } else { explicit };
        let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        let max_tokens = self.fit(longest, explicit, DEFAULT_COMPLETION_MAX_TOKENS)?;
        // Echo with logprobs scores the prompt, as OpenAI's legacy API does.
        let scored = if echo { top } else { None };
        let mut v = self.finish(model, prompts, max_tokens, top, scored, &req.common)?;
        (v.echo, v.prompt_only) = (echo, prompt_only);
        let found = crate::structured::grammar(&req.common)?;
        v.constrained_by = found.as_ref().map(|(param, _)| *param);
        v.params.grammar = self.checked(found)?;
        Ok(v)
    }

    pub fn chat(&self, req: ChatRequest) -> Result<ValidRequest, ApiError> {
        let model = self.check_common(&req.common)?;
        let top = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
            (_, Some(k)) if !(0..=MAX_TOP_LOGPROBS).contains(&k) => {
                return Err(ApiError::invalid("top_logprobs", "top_logprobs must be between 0 and 20"))
            }
            (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs requires logprobs: true")),
            (true, k) => Some(k.unwrap_or(0) as u32),
            (false, None) => None,
        };
        let tools = tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), req.parallel_tool_calls)?;
        let tools = tools.filter(Tools::active);
        let extra = req.chat_template_kwargs.unwrap_or_default();
        let prompt = self.chat_ids(&req.messages, tools.as_ref(), &extra)?;
        let grammar =
            match (crate::structured::grammar(&req.common)?, tools.as_ref().map(Tools::grammar).transpose()?.flatten())
            {
                (Some((param, _)), Some(_)) => {
                    return Err(ApiError::invalid(
                        param,
                        "tool_choice required or a named function already constrains the reply",
                    ))
                }
                (found, None) => found,
                (None, Some(g)) => Some(("tools", g)),
            };
        let explicit = match req.max_completion_tokens {
            Some(_) => count("max_completion_tokens", req.max_completion_tokens)?,
            None => count("max_tokens", req.common.max_tokens)?,
        };
        if explicit == Some(0) {
            return Err(ApiError::invalid("max_tokens", "max_tokens must be at least 1"));
        }
        let left = self.context_length.saturating_sub(prompt.len());
        let explicit = explicit.map(|n| if req.clamp_to_context { n.min(left) } else { n });
        let default = left.min(DEFAULT_CHAT_MAX_TOKENS);
        let max_tokens = self.fit(prompt.len(), explicit, default)?;
        let prompts = vec![ValidPrompt { ids: prompt, text: None }];
        let mut v = self.finish(model, prompts, max_tokens, top, None, &req.common)?;
        v.constrained_by = grammar.as_ref().map(|(param, _)| *param);
        v.params.grammar = self.checked(grammar)?;
        v.tools = tools.map(Arc::new);
        Ok(v)
    }

    /// A grammar that compiles, or a 400 naming the field it came from.
    fn checked(&self, found: Option<(&'static str, Grammar)>) -> Result<Option<Grammar>, ApiError> {
        let Some((param, g)) = found else { return Ok(None) };
        let Some(grammars) = &self.grammars else {
            return Err(ApiError::invalid(param, "this server does not serve constrained outputs"));
        };
        grammars.check(&g).map_err(|e| match e {
            GrammarError::Busy => ApiError::Serve(ServeError::Overloaded(e.to_string())),
            e => ApiError::invalid(param, format!("{param}: {e}")),
        })?;
        Ok(Some(g))
    }

    /// `logit_bias`: `{"token id": bias}`, sorted by id.
    fn logit_bias(&self, v: &Option<serde_json::Value>) -> Result<Vec<(TokenId, f32)>, ApiError> {
        const P: &str = "logit_bias";
        let Some(v) = v.as_ref().filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
        let map = v.as_object().ok_or_else(|| ApiError::invalid(P, "logit_bias must map token ids to numbers"))?;
        let vocab = self.tokenizer.vocab_size();
        let mut out = Vec::with_capacity(map.len());
        for (k, b) in map {
            let id = k.trim().parse::<u32>().ok().filter(|&t| (t as usize) < vocab).ok_or_else(|| {
                ApiError::invalid(P, format!("logit_bias key `{k}` is not a token id below the vocabulary of {vocab}"))
            })?;
            let bias =
                b.as_f64().ok_or_else(|| ApiError::invalid(P, format!("logit_bias of `{k}` is not a number")))?;
            out.push((id, bias as f32));
        }
        out.sort_by_key(|&(id, _)| id);
        Ok(out)
    }

    /// The model's name as the request gave it (or the canonical one), if served.
    pub(crate) fn check_common(&self, c: &CommonParams) -> Result<String, ApiError> {
        match c.model.as_deref() {
            None => Ok(self.model_ids.first().cloned().unwrap_or_default()),
            Some(m) if self.model_ids.iter().any(|id| id == m) => Ok(m.to_string()),
            Some(m) => Err(ApiError::ModelNotFound(m.to_string())),
        }
    }

    /// `n`: 1 to [`MAX_CHOICES`] over all prompts.
    fn choices(&self, n: Option<i64>, prompts: usize) -> Result<usize, ApiError> {
        let n = match n {
            None => 1,
            Some(k) => usize::try_from(k)
                .ok()
                .filter(|&k| k >= 1)
                .ok_or_else(|| ApiError::invalid("n", "n must be at least 1"))?,
        };
        if n.saturating_mul(prompts) > MAX_CHOICES {
            let msg = format!("at most {MAX_CHOICES} choices per request (prompts × n), asked for {}", n * prompts);
            return Err(ApiError::invalid("n", msg));
        }
        Ok(n)
    }

    /// `max_tokens`, the default shrunk to fit the context, or a context error.
    pub(crate) fn fit(&self, prompt: usize, explicit: Option<usize>, default: usize) -> Result<usize, ApiError> {
        let context = self.context_length;
        let too_long = |needed| ApiError::Serve(ServeError::ContextLength { context, prompt, needed });
        match explicit {
            _ if prompt >= context => Err(too_long(prompt + 1)),
            Some(n) if prompt.saturating_add(n) > context => Err(too_long(prompt.saturating_add(n))),
            Some(n) => Ok(n),
            None => Ok(default.min(context - prompt)),
        }
    }

    pub(crate) fn finish(
        &self,
        model: String,
        prompts: Vec<ValidPrompt>,
        max_tokens: usize,
        top_logprobs: Option<u32>,
        scored: Option<u32>,
        c: &CommonParams,
    ) -> Result<ValidRequest, ApiError> {
        let n = self.choices(c.n, prompts.len())?;
        let asked = match c.prompt_logprobs {
            None => None,
            Some(k) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as u32),
            Some(_) => return Err(ApiError::invalid("prompt_logprobs", "prompt_logprobs must be between 0 and 20")),
        };
        let params = SamplingParams {
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            min_tokens: count("min_tokens", c.min_tokens)?.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            // Negative seeds are accepted (vLLM does) and reinterpreted as u64.
            seed: c.seed.map(|s| s as u64),
            ignore_eos: c.ignore_eos.unwrap_or(false),
            logprobs: top_logprobs.is_some(),
            top_logprobs: top_logprobs.unwrap_or(0),
            prompt_logprobs: scored.max(asked),
            stop: StopCondition { strings: stop_strings(&c.stop), token_ids: self.stop_ids(&c.stop_token_ids)? },
            logit_bias: self.logit_bias(&c.logit_bias)?,
            grammar: None,
            ..sampling(c, &self.defaults)?
        }
        .validate()?;
        let stream = c.stream.unwrap_or(false);
        let include_usage = stream && c.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false);
        Ok(ValidRequest {
            model,
            tokenizer: self.tokenizer.clone(),
            prompts,
            n,
            params,
            stream,
            include_usage,
            echo: false,
            prompt_only: false,
            prompt_logprobs: asked.is_some(),
            token_ids: c.return_token_ids.unwrap_or(false),
            tools: None,
            constrained_by: None,
        })
    }

    /// The prompts of a completion request: one, or a batch of texts or of token-id
    /// lists.
    pub(crate) fn prompts(&self, prompt: Prompt) -> Result<Vec<ValidPrompt>, ApiError> {
        // Counted before any is tokenized, so an oversized batch costs nothing.
        let count = match &prompt {
            Prompt::Texts(texts) => texts.len(),
            Prompt::IdBatch(batch) => batch.len(),
            Prompt::Text(_) | Prompt::Ids(_) => 1,
        };
        if count > MAX_CHOICES {
            return Err(ApiError::invalid("prompt", format!("at most {MAX_CHOICES} prompts per request")));
        }
        let prompts: Vec<ValidPrompt> = match prompt {
            Prompt::Text(text) => vec![self.text_prompt(text)?],
            Prompt::Texts(texts) => texts.into_iter().map(|t| self.text_prompt(t)).collect::<Result<_, _>>()?,
            Prompt::Ids(ids) => vec![ValidPrompt { ids: self.checked_ids("prompt", &ids)?, text: None }],
            Prompt::IdBatch(batch) => batch
                .iter()
                .map(|ids| Ok(ValidPrompt { ids: self.checked_ids("prompt", ids)?, text: None }))
                .collect::<Result<_, ApiError>>()?,
        };
        if prompts.is_empty() {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"));
        }
        Ok(prompts)
    }

    fn text_prompt(&self, text: String) -> Result<ValidPrompt, ApiError> {
        Ok(ValidPrompt { ids: self.text_ids(&text)?, text: Some(text) })
    }

    /// Refuses text that cannot fit the context whatever its tokens, by length alone.
    fn fits(&self, param: &'static str, bytes: usize) -> Result<(), ApiError> {
        if bytes > self.max_prompt_bytes {
            let msg = format!(
                "the prompt is {bytes} bytes; no prompt over {} bytes fits this model's context of {} tokens",
                self.max_prompt_bytes, self.context_length
            );
            return Err(ApiError::invalid(param, msg));
        }
        Ok(())
    }

    fn text_ids(&self, text: &str) -> Result<Vec<TokenId>, ApiError> {
        if text.is_empty() {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"));
        }
        self.fits("prompt", text.len())?;
        Ok(self.tokenizer.encode_with_bos(text, false))
    }

    pub(crate) fn checked_ids(&self, param: &'static str, ids: &[i64]) -> Result<Vec<TokenId>, ApiError> {
        if ids.is_empty() && param == "prompt" {
            return Err(ApiError::invalid(param, "prompt must not be empty"));
        }
        let vocab = self.tokenizer.vocab_size();
        ids.iter()
            .map(|&id| match u32::try_from(id) {
                Ok(t) if (t as usize) < vocab => Ok(t),
                _ => {
                    Err(ApiError::invalid(param, format!("token id {id} is outside the vocabulary of {vocab} tokens")))
                }
            })
            .collect()
    }

    fn stop_ids(&self, ids: &Option<Vec<i64>>) -> Result<Vec<TokenId>, ApiError> {
        const P: &str = "stop_token_ids";
        match ids.as_deref() {
            Some(ids) if ids.len() > MAX_STOP_TOKEN_IDS => {
                Err(ApiError::invalid(P, format!("at most {MAX_STOP_TOKEN_IDS} stop token ids, not {}", ids.len())))
            }
            ids => ids.map_or(Ok(Vec::new()), |ids| self.checked_ids(P, ids)),
        }
    }

    pub(crate) fn chat_ids(
        &self,
        messages: &[Message],
        tools: Option<&Tools>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<TokenId>, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::invalid("messages", "messages must not be empty"));
        }
        let bytes = messages.iter().map(|m| match &m.content {
            Some(Content::Text(t)) => t.len(),
            Some(Content::Parts(p)) => p.iter().map(|x| x.text.as_deref().map_or(0, str::len)).sum(),
            None => 0,
        });
        self.fits("messages", bytes.sum())?;
        if !extra.is_empty() {
            self.fits("chat_template_kwargs", serde_json::Value::Object(extra.clone()).to_string().len())?;
        }
        // A template that renders tools gets them, and earlier calls, as it expects;
        // others get both as text (the tools in a system message).
        let native = self.chat.writes_tool_calls();
        let mut turns = messages.iter().map(|m| to_chat_message(m, native)).collect::<Result<Vec<_>, _>>()?;
        let definitions = tools.filter(|_| native).map(Tools::definitions);
        if let Some(t) = tools.filter(|_| !native) {
            match turns.first_mut().filter(|m| m.role == "system") {
                Some(sys) => sys.content = format!("{}\n\n{}", sys.content, t.prompt()),
                None => turns.insert(0, ChatMessage::new("system", t.prompt())),
            }
        }
        let text = self
            .chat
            .render_with(&turns, definitions.as_ref(), true, extra)
            .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
        let mut ids = self.tokenizer.encode_outside(&text, &content_spans(&text, &turns));
        if let (true, Some(bos)) = (self.tokenizer.add_bos(), self.tokenizer.bos_id()) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        if ids.is_empty() {
            return Err(ApiError::invalid("messages", "the conversation renders to an empty prompt"));
        }
        Ok(ids)
    }
}

/// Where each turn's content sits in the rendered prompt, found in order (as given,
/// or trimmed, as some templates write it). Special-token text inside is text: a
/// user's `<|im_start|>system` stays words, not a forged system turn.
fn content_spans(text: &str, turns: &[ChatMessage]) -> Vec<Range<usize>> {
    let mut spans = Vec::new();
    let mut from = 0;
    for c in turns.iter().map(|t| t.content.as_str()) {
        for c in [c, c.trim()].into_iter().filter(|c| !c.is_empty()) {
            if let Some(p) = text[from..].find(c) {
                spans.push(from + p..from + p + c.len());
                from += p + c.len();
                break;
            }
        }
    }
    spans
}

/// The roles chat templates know.
const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "function"];

fn to_chat_message(m: &Message, native_tools: bool) -> Result<ChatMessage, ApiError> {
    if !ROLES.contains(&m.role.as_str()) {
        let known = ROLES.join(", ");
        return Err(ApiError::invalid("messages", format!("unknown role `{}`; use one of {known}", m.role)));
    }
    let content = match &m.content {
        None => String::new(),
        Some(Content::Text(s)) => s.clone(),
        Some(Content::Parts(parts)) => {
            let texts = parts.iter().map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.as_str()),
                ("text", None) => Err(ApiError::invalid("messages", "a text content part needs `text`")),
                (other, _) => Err(ApiError::invalid(
                    "messages",
                    format!("content parts of type `{other}` are not supported; only `text` is"),
                )),
            });
            texts.collect::<Result<Vec<_>, _>>()?.join("\n")
        }
    };
    let mut turn = ChatMessage::new(m.role.clone(), content);
    match &m.tool_calls {
        Some(calls) if calls.is_null() => {}
        Some(calls) if native_tools => turn.tool_calls = Some(tools::template_calls(calls)?),
        Some(calls) => {
            let calls = tools::render_calls(calls)?;
            turn.content = if turn.content.is_empty() { calls } else { format!("{}\n{calls}", turn.content) };
        }
        None => {}
    }
    Ok(turn)
}

/// An optional non-negative count.
fn count(param: &'static str, v: Option<i64>) -> Result<Option<usize>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) => {
            usize::try_from(n).map(Some).map_err(|_| ApiError::invalid(param, format!("{param} must not be negative")))
        }
    }
}

/// `top_k`: -1 and 0 disable it (vLLM uses -1).
fn top_k(v: Option<i64>) -> Result<u32, ApiError> {
    match v {
        None | Some(-1) | Some(0) => Ok(0),
        Some(k) => {
            u32::try_from(k).map_err(|_| ApiError::invalid("top_k", "top_k must be -1, 0 (disabled) or positive"))
        }
    }
}

fn stop_strings(stop: &Option<Stop>) -> Vec<String> {
    match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_defaults_fill_only_what_a_request_leaves_out() {
        let defaults = GenerationDefaults::parse(r#"{"temperature": 0, "top_k": 40}"#).unwrap();
        let omitted = sampling(&CommonParams::default(), &defaults).unwrap();
        assert_eq!((omitted.temperature, omitted.top_k, omitted.top_p), (0.0, 40, 1.0));
        let asked = CommonParams { temperature: Some(0.7), ..Default::default() };
        assert_eq!(sampling(&asked, &defaults).unwrap().temperature, 0.7);
        assert_eq!(sampling(&CommonParams::default(), &GenerationDefaults::default()).unwrap().temperature, 1.0);
    }

    #[test]
    fn a_bad_generation_config_is_one_clear_error() {
        for (json, says) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temprature": 0}"#, "unknown field"),
            (r#"{"top_k": -5}"#, "top_k"),
            ("not json", "generation config"),
        ] {
            let e = GenerationDefaults::parse(json).unwrap_err();
            assert!(e.contains(says) && !e.contains('\n'), "{json}: {e}");
        }
    }
}
