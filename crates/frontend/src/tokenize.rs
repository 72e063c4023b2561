//! `POST /tokenize` and `POST /detokenize`, as vLLM has them: the served model's
//! tokenizer and chat template, without generating anything.
//!
//! - `/tokenize` takes `{"prompt": "..."}` (BOS added as for a completion unless
//!   `add_special_tokens` is false) or `{"messages": [...]}` (rendered by the chat
//!   template, as for a chat completion), text too long to fit the context refused as
//!   for those (a 400, untokenized), and answers `{"count", "max_model_len",
//!   "tokens"}` (and `"token_strs"` when `return_token_strs` is true).
//! - `/detokenize` takes `{"tokens": [...]}` and answers `{"prompt": "..."}`.
//! - `GET /tokenizer_info` describes the tokenizer (special tokens, chat template,
//!   context), which lets clients such as lm-eval's remote tokenizer use ours.

use crate::errors::ApiError;
use crate::extract::ApiJson;
use crate::openai::Message;
use crate::validate::Validator;
use crate::AppState;
use axum::extract::State;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    add_special_tokens: Option<bool>,
    return_token_strs: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

pub async fn tokenize(
    State(app): State<Arc<AppState>>,
    body: Result<ApiJson<TokenizeRequest>, ApiError>,
) -> Result<Json<Value>, ApiError> {
    let ApiJson(req) = body?;
    let v = app.model(req.model.as_deref())?.validator.clone();
    if let Some(text) = &req.prompt {
        fits(&v, text)?;
    }
    let (tokenizer, context) = (v.tokenizer.clone(), v.context_length);
    let tokens = tokio::task::spawn_blocking(move || match (req.prompt, req.messages) {
        (Some(text), None) => Ok(match req.add_special_tokens.unwrap_or(true) {
            true => v.tokenizer.encode_with_bos(&text, false),
            false => v.tokenizer.encode(&text, false),
        }),
        (None, Some(messages)) => v.chat_ids(&messages, None, &serde_json::Map::new()),
        _ => Err(ApiError::malformed("send either `prompt` or `messages`")),
    })
    .await
    .map_err(|e| ApiError::malformed(format!("tokenization failed: {e}")))??;
    let mut out = json!({"count": tokens.len(), "max_model_len": context, "tokens": tokens});
    if req.return_token_strs == Some(true) {
        let strs: Vec<String> = tokens.iter().map(|&t| tokenizer.token_text(t).unwrap_or_default()).collect();
        out["token_strs"] = json!(strs);
    }
    Ok(Json(out))
}

/// Completions' bound on a prompt's bytes: text that cannot fit the context is not
/// worth tokenizing (nor answering with megabytes of tokens).
fn fits(v: &Validator, text: &str) -> Result<(), ApiError> {
    if text.len() <= v.max_prompt_bytes {
        return Ok(());
    }
    let (bytes, max, context) = (text.len(), v.max_prompt_bytes, v.context_length);
    let msg = format!(
        "the prompt is {bytes} bytes; no prompt over {max} bytes fits this model's context of {context} tokens"
    );
    Err(ApiError::invalid("prompt", msg))
}

pub async fn detokenize(
    State(app): State<Arc<AppState>>,
    body: Result<ApiJson<DetokenizeRequest>, ApiError>,
) -> Result<Json<Value>, ApiError> {
    let ApiJson(req) = body?;
    let v = &app.model(req.model.as_deref())?.validator;
    // No sequence of this model is longer than its context: a longer list is not
    // worth decoding on the request's thread.
    let context = v.context_length;
    if req.tokens.len() > context {
        let msg = format!("{} tokens; no sequence is longer than the context of {context}", req.tokens.len());
        return Err(ApiError::invalid("tokens", msg));
    }
    let ids = v.checked_ids("tokens", &req.tokens)?;
    Ok(Json(json!({"prompt": v.tokenizer.decode(&ids)})))
}

/// `GET /tokenizer_info`: the first model's tokenizer.
pub async fn info(State(app): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let v = &app.model(None)?.validator;
    let t = &v.tokenizer;
    let text = |id: Option<u32>| id.and_then(|i| t.token_text(i));
    Ok(Json(json!({
        "tokenizer_class": "pdserve-bpe",
        "bos_token": text(t.bos_id()),
        "eos_token": text(t.eos_id()),
        "pad_token": Value::Null,
        "add_bos_token": t.add_bos(),
        "chat_template": t.chat_template(),
        "model_max_length": v.context_length,
        "vocab_size": t.vocab_size(),
    })))
}
