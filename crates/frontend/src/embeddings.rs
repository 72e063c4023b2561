//! `POST /v1/embeddings`: a prompt's final hidden states pooled into one vector, for
//! any served model, as llama-server offers it.
//!
//! Each input is validated and tokenized as a completion prompt is, then sent
//! downstream as a request that asks for its embedding and one token, which is
//! dropped: the same path as every other request (admission, routing, the
//! disaggregated handoff, metrics, request ids). The worker pools the hidden states
//! after the output norm over the whole prompt (`mean`, the default) or takes the last
//! token's (`last`, as vLLM pools decoder models), and the vector is L2-normalised as
//! OpenAI's and llama-server's are. The pooling is named in the response.

use crate::extract::ApiJson;
use crate::generation::Output;
use crate::openai::{CommonParams, Prompt};
use crate::request_id::Tagged;
use crate::sse::{to_json, Format};
use crate::validate::{ValidRequest, Validator};
use crate::{errors::ApiError, AppState};
use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use pdserve_protocol::Usage;
use pdserve_types::Pooling;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// `POST /v1/embeddings` as the OpenAI SDK sends it.
#[derive(Debug, Deserialize)]
pub struct EmbeddingsRequest {
    pub model: Option<String>,
    pub input: Prompt,
    /// `float` (the default) or `base64` (little-endian f32s; the SDK asks for it).
    pub encoding_format: Option<String>,
    /// OpenAI's field: only the model's own width is served.
    pub dimensions: Option<i64>,
    /// `mean` (the default) or `last`.
    pub pooling: Option<Pooling>,
}

impl crate::ForModel for EmbeddingsRequest {
    fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl Validator {
    pub fn embeddings(&self, req: EmbeddingsRequest) -> Result<ValidRequest, ApiError> {
        if req.dimensions.is_some() {
            return Err(ApiError::invalid("dimensions", "dimensions is not supported: the model's width is served"));
        }
        if !matches!(req.encoding_format.as_deref(), None | Some("float" | "base64")) {
            return Err(ApiError::invalid("encoding_format", "encoding_format must be float or base64"));
        }
        let common =
            CommonParams { model: req.model, max_tokens: Some(1), temperature: Some(0.0), ..Default::default() };
        let model = self.check_common(&common)?;
        let prompts = self.prompts(req.input).map_err(as_input)?;
        let longest = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
        self.fit(longest, Some(1), 1)?;
        let mut v = self.finish(model, prompts, 1, None, None, &common)?;
        v.prompt_only = true;
        v.params.embed = Some(req.pooling.unwrap_or(Pooling::Mean));
        Ok(v)
    }
}

/// A prompt's error, named as the embeddings API names the field.
fn as_input(e: ApiError) -> ApiError {
    match e {
        ApiError::Invalid { message, param: Some("prompt") } => {
            ApiError::Invalid { message: message.replace("prompt", "input"), param: Some("input") }
        }
        other => other,
    }
}

pub async fn handler(
    State(app): State<Arc<AppState>>,
    Extension(tagged): Extension<Tagged>,
    body: Result<ApiJson<EmbeddingsRequest>, ApiError>,
) -> Response {
    let tracker = app.tracker(&tagged);
    let base64 = body.as_ref().ok().is_some_and(|ApiJson(r)| r.encoding_format.as_deref() == Some("base64"));
    let valid = crate::validate_blocking(&app, body, |v, req| v.embeddings(req)).await;
    crate::run(app, tagged, tracker, valid, move |_, v| EmbeddingsFormat {
        model: v.model.clone(),
        pooling: v.params.embed.unwrap_or(Pooling::Mean),
        base64,
    })
    .await
}

/// Writes the `list` of embeddings; never streamed.
pub struct EmbeddingsFormat {
    model: String,
    pooling: Pooling,
    base64: bool,
}

/// `v` scaled to unit length (left as it is when it is all zeros).
fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    let norm = v.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>().sqrt();
    if norm > 0.0 {
        v.iter_mut().for_each(|x| *x = (f64::from(*x) / norm) as f32);
    }
    v
}

/// Little-endian f32s in standard base64, as OpenAI's `encoding_format: "base64"`.
fn base64_f32(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            let pad = i > chunk.len();
            out.push(if pad { '=' } else { ABC[(n >> (18 - 6 * i)) as usize & 63] as char });
        }
    }
    out
}

impl Format for EmbeddingsFormat {
    fn chunk(&mut self, _index: u32, _step: &Output) -> Vec<String> {
        Vec::new()
    }

    fn usage_chunk(&self, _usage: Usage) -> String {
        String::new()
    }

    fn response(&mut self, choices: &[(u32, Output)], usage: Usage) -> String {
        let data: Vec<Value> = choices
            .iter()
            .map(|(index, out)| {
                let e = normalized(out.embedding.clone().unwrap_or_default());
                let embedding = if self.base64 { json!(base64_f32(&e)) } else { json!(e) };
                json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        to_json(&json!({
            "object": "list", "data": data, "model": self.model, "pooling": self.pooling.name(),
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_the_f32s_little_endian() {
        // 1.0 = 00 00 80 3f; 2.0 = 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn vectors_come_out_unit_length() {
        let v = normalized(vec![3.0, 4.0]);
        assert_eq!(v, [0.6, 0.8]);
        assert_eq!(normalized(vec![0.0, 0.0]), [0.0, 0.0]);
    }
}
