//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`).

use super::bytemap::unmap;
use super::pretokenize::PreTokenizer;
use super::vocab::TokenEntry;
use super::{MergeRule, Parts, TokenKind, Tokenizer, TokenizerError};
use crate::format::gguf::{GgufHeader, MetaValue};

impl Tokenizer {
    /// The tokenizer stored in a GGUF file's metadata. Only `tokenizer.ggml.model =
    /// gpt2` (byte-level BPE) is supported.
    pub fn from_gguf(h: &GgufHeader) -> Result<Tokenizer, TokenizerError> {
        let model = string(h, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported(format!("GGUF tokenizer model `{model}`")));
        }
        // llama.cpp treats a missing `pre` as its default; GPT-2's split is ours.
        let pre_name = h.get("tokenizer.ggml.pre").and_then(MetaValue::as_str).unwrap_or("gpt2");
        let is_llama3 = matches!(pre_name, "llama-bpe" | "llama3" | "llama-v3");
        let id = |key: &str| h.get(key).and_then(MetaValue::as_u64);
        let eog = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"];
        Tokenizer::build(Parts {
            tokens: tokens(h)?,
            merges: merges(h)?,
            pre: Some(PreTokenizer::for_gguf(pre_name)?),
            // Llama 3 vocabularies contain words the merges cannot build; llama.cpp
            // takes a word that is a token as is for them.
            ignore_merges: is_llama3,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            eog: eog.iter().filter_map(|k| id(k)).collect(),
            add_bos: h.get("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(is_llama3),
            chat_template: h.get("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_string),
        })
    }
}

fn string<'h>(h: &'h GgufHeader, key: &str) -> Result<&'h str, TokenizerError> {
    h.get(key).and_then(MetaValue::as_str).ok_or_else(|| TokenizerError::MissingKey(key.into()))
}

fn array<'h>(h: &'h GgufHeader, key: &str) -> Result<&'h [MetaValue], TokenizerError> {
    h.get(key).and_then(MetaValue::as_array).ok_or_else(|| TokenizerError::MissingKey(key.into()))
}

/// Special tokens keep their text; normal ones are stored in the GPT-2 mapping.
fn tokens(h: &GgufHeader) -> Result<Vec<TokenEntry>, TokenizerError> {
    let texts = array(h, "tokenizer.ggml.tokens")?;
    let types = h.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array).unwrap_or(&[]);
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let text = t
                .as_str()
                .ok_or_else(|| TokenizerError::Invalid(format!("tokenizer.ggml.tokens[{i}] is not a string")))?;
            let kind = types.get(i).and_then(MetaValue::as_i64).map_or(TokenKind::Normal, TokenKind::from_gguf);
            let bytes = if kind.is_literal() { text.as_bytes().to_vec() } else { unmap(text) };
            Ok(TokenEntry::new(bytes, kind))
        })
        .collect()
}

fn merges(h: &GgufHeader) -> Result<Vec<MergeRule>, TokenizerError> {
    array(h, "tokenizer.ggml.merges")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.as_str()
                .and_then(parse_merge)
                .ok_or_else(|| TokenizerError::Invalid(format!("tokenizer.ggml.merges[{i}] is not `left right`")))
        })
        .collect()
}

/// `"Ġ t"` → the raw bytes of both sides. The separator is the first space after the
/// first character, so a left side that is itself a space still parses.
pub(super) fn parse_merge(m: &str) -> Option<MergeRule> {
    let first = m.chars().next()?.len_utf8();
    let sep = first + m.get(first..)?.find(' ')?;
    let (left, right) = (&m[..sep], &m[sep + 1..]);
    (!right.is_empty()).then(|| (unmap(left), unmap(right)))
}
