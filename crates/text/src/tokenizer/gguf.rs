//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`).

use super::bytemap::unmap;
use super::pretokenize::PreTokenizer;
use super::spm::{self, SpmParts};
use super::vocab::TokenEntry;
use super::{check_id, MergeRule, Parts, TokenKind, Tokenizer, TokenizerError};
use crate::meta::{MetaValue, Metadata};

const EOG_KEYS: [&str; 2] = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"];

impl Tokenizer {
    /// The tokenizer stored in a GGUF file's metadata: `tokenizer.ggml.model = gpt2`
    /// (byte-level BPE) or `llama` (SentencePiece).
    pub fn from_gguf(h: &dyn Metadata) -> Result<Tokenizer, TokenizerError> {
        match string(h, "tokenizer.ggml.model")? {
            "gpt2" => from_gguf_bpe(h),
            "llama" => from_gguf_spm(h),
            model => Err(TokenizerError::Unsupported(format!("GGUF tokenizer model `{model}`"))),
        }
    }
}

fn from_gguf_bpe(h: &dyn Metadata) -> Result<Tokenizer, TokenizerError> {
    // llama.cpp treats a missing `pre` as its default; GPT-2's split is ours.
    let pre_name = h.get("tokenizer.ggml.pre").and_then(MetaValue::as_str).unwrap_or("gpt2");
    let is_llama3 = matches!(pre_name, "llama-bpe" | "llama3" | "llama-v3");
    let id = |key: &str| h.get(key).and_then(MetaValue::as_u64);
    Tokenizer::build(Parts {
        tokens: tokens(h)?,
        merges: merges(h)?,
        pre: Some(PreTokenizer::for_gguf(pre_name)?),
        // Llama 3 vocabularies contain words the merges cannot build; llama.cpp
        // takes a word that is a token as is for them.
        ignore_merges: is_llama3,
        bos: id("tokenizer.ggml.bos_token_id"),
        eos: id("tokenizer.ggml.eos_token_id"),
        eog: EOG_KEYS.iter().filter_map(|k| id(k)).collect(),
        add_bos: h.get("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(is_llama3),
        chat_template: chat_template(h),
        spm: None,
    })
}

/// A SentencePiece vocabulary. Where a key is missing, llama.cpp's defaults for this
/// model type apply: BOS 1, EOS 2, BOS added, a space put in front of the text.
fn from_gguf_spm(h: &dyn Metadata) -> Result<Tokenizer, TokenizerError> {
    let texts = array(h, "tokenizer.ggml.tokens")?;
    let types = h.get("tokenizer.ggml.token_type").and_then(MetaValue::as_array).unwrap_or(&[]);
    let scores = h.get("tokenizer.ggml.scores").and_then(MetaValue::as_array).unwrap_or(&[]);
    let mut tokens = Vec::with_capacity(texts.len());
    let mut pieces = Vec::with_capacity(texts.len());
    for (i, t) in texts.iter().enumerate() {
        let text =
            t.as_str().ok_or_else(|| TokenizerError::Invalid(format!("tokenizer.ggml.tokens[{i}] is not a string")))?;
        let kind = types.get(i).and_then(MetaValue::as_i64).map_or(TokenKind::Normal, TokenKind::from_gguf);
        let bytes = match kind {
            k if k.is_literal() => text.as_bytes().to_vec(),
            TokenKind::Byte => spm::byte_of(text).map_or_else(|| spm::unescape(text), |b| vec![b]),
            _ => spm::unescape(text),
        };
        tokens.push(TokenEntry::new(bytes, kind));
        pieces.push(text.to_string());
    }
    let scores = scores.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect();
    let n = tokens.len();
    let id = |key: &str| h.get(key).and_then(MetaValue::as_u64);
    let flag = |key: &str, default: bool| h.get(key).and_then(MetaValue::as_bool).unwrap_or(default);
    // A default that the vocabulary is too small for is dropped rather than an error.
    let or_default = |v: Option<u64>, d: u64| v.or((d < n as u64).then_some(d));
    let unk = id("tokenizer.ggml.unknown_token_id")
        .or_else(|| tokens.iter().position(|t| t.kind == TokenKind::Unknown).map(|i| i as u64));
    Tokenizer::build(Parts {
        bos: or_default(id("tokenizer.ggml.bos_token_id"), 1),
        eos: or_default(id("tokenizer.ggml.eos_token_id"), 2),
        eog: EOG_KEYS.iter().filter_map(|k| id(k)).collect(),
        add_bos: flag("tokenizer.ggml.add_bos_token", true),
        chat_template: chat_template(h),
        spm: Some(SpmParts {
            pieces,
            scores,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true),
            unk: check_id("unknown", unk, n)?,
        }),
        tokens,
        ..Parts::default()
    })
}

fn chat_template(h: &dyn Metadata) -> Option<String> {
    h.get("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_string)
}

fn string<'h>(h: &'h dyn Metadata, key: &str) -> Result<&'h str, TokenizerError> {
    h.get(key).and_then(MetaValue::as_str).ok_or_else(|| TokenizerError::MissingKey(key.into()))
}

fn array<'h>(h: &'h dyn Metadata, key: &str) -> Result<&'h [MetaValue], TokenizerError> {
    h.get(key).and_then(MetaValue::as_array).ok_or_else(|| TokenizerError::MissingKey(key.into()))
}

/// Special tokens keep their text; normal ones are stored in the GPT-2 mapping.
fn tokens(h: &dyn Metadata) -> Result<Vec<TokenEntry>, TokenizerError> {
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

fn merges(h: &dyn Metadata) -> Result<Vec<MergeRule>, TokenizerError> {
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
