//! Building a tokenizer from Hugging Face `tokenizer.json` (BPE model with ByteLevel
//! pre-tokenization) and `tokenizer_config.json`.
//!
//! Only the parts that decide token ids are read. A `normalizer` (Qwen 2 has NFC) is
//! ignored, as llama.cpp ignores it after conversion; pre-tokenizers other than Split,
//! Digits and ByteLevel are refused rather than guessed.

use super::bytemap::unmap;
use super::pretokenize::{PreTokenizer, DIGITS, GPT2};
use super::vocab::TokenEntry;
use super::{MergeRule, Parts, TokenKind, Tokenizer, TokenizerError};
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

#[derive(Deserialize)]
struct TokenizerJson {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    #[serde(default)]
    pre_tokenizer: Value,
    #[serde(default)]
    post_processor: Value,
    #[serde(default)]
    decoder: Value,
    model: ModelJson,
}

#[derive(Deserialize)]
struct ModelJson {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    vocab: HashMap<String, u32>,
    #[serde(default)]
    merges: Vec<MergeJson>,
    #[serde(default)]
    ignore_merges: bool,
}

/// Merges are `"a b"` in older files and `["a", "b"]` in newer ones.
#[derive(Deserialize)]
#[serde(untagged)]
enum MergeJson {
    Text(String),
    Pair([String; 2]),
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
    #[serde(default)]
    special: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
}

#[derive(Deserialize)]
struct ConfigJson {
    add_bos_token: Option<bool>,
    bos_token: Option<TokenRef>,
    eos_token: Option<TokenRef>,
    chat_template: Option<TemplateRef>,
}

/// A token named by its text or as an AddedToken object.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenRef {
    Text(String),
    Added { content: String },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateRef {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. BOS, EOS and the chat template live in
    /// `tokenizer_config.json`: add them with [`with_config_file`](Self::with_config_file).
    pub fn from_json_file(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let file: TokenizerJson = read_json(path)?;
        Tokenizer::from_json(file)
    }

    /// Applies `tokenizer_config.json`: BOS and EOS tokens, `add_bos_token` and the
    /// chat template (or a `chat_template.jinja` beside it, as newer repos ship).
    pub fn with_config_file(mut self, path: &Path) -> Result<Tokenizer, TokenizerError> {
        let cfg: ConfigJson = read_json(path)?;
        if let Some(id) = cfg.bos_token.and_then(|t| self.token_id(t.text())) {
            self.bos = Some(id);
        }
        if let Some(id) = cfg.eos_token.and_then(|t| self.token_id(t.text())) {
            self.eos = Some(id);
            self.eog.push(id);
            self.eog.sort_unstable();
            self.eog.dedup();
        }
        self.add_bos = cfg.add_bos_token.unwrap_or(self.add_bos);
        self.chat_template = match cfg.chat_template {
            Some(t) => t.pick(),
            None => read_sibling_template(path)?.or(self.chat_template),
        };
        Ok(self)
    }

    fn from_json(file: TokenizerJson) -> Result<Tokenizer, TokenizerError> {
        let kind = file.model.kind.as_deref().unwrap_or("BPE");
        if kind != "BPE" || !mentions_byte_level(&[&file.pre_tokenizer, &file.decoder]) {
            return Err(TokenizerError::Unsupported(format!("tokenizer.json model `{kind}` without ByteLevel")));
        }
        let tokens = json_tokens(&file.model.vocab, &file.added_tokens)?;
        let bos = leading_special(&file.post_processor)
            .and_then(|t| tokens.iter().position(|e| e.bytes == t.as_bytes()))
            .map(|i| i as u64);
        Tokenizer::build(Parts {
            merges: file.model.merges.iter().map(MergeJson::parse).collect::<Result<_, _>>()?,
            tokens,
            pre: Some(pre_tokenizer(&file.pre_tokenizer)?),
            ignore_merges: file.model.ignore_merges,
            add_bos: bos.is_some(),
            bos,
            ..Parts::default()
        })
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, TokenizerError> {
    let p = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: p(), source })?;
    serde_json::from_str(&text).map_err(|source| TokenizerError::Json { path: p(), source })
}

fn read_sibling_template(config: &Path) -> Result<Option<String>, TokenizerError> {
    let path = config.with_file_name("chat_template.jinja");
    if !path.is_file() {
        return Ok(None);
    }
    std::fs::read_to_string(&path)
        .map(Some)
        .map_err(|source| TokenizerError::Io { path: path.display().to_string(), source })
}

impl TokenRef {
    fn text(&self) -> &str {
        match self {
            TokenRef::Text(t) | TokenRef::Added { content: t } => t,
        }
    }
}

impl TemplateRef {
    /// The single template, or the one named `default` (else the first) of a list.
    fn pick(self) -> Option<String> {
        match self {
            TemplateRef::One(t) => Some(t),
            TemplateRef::Named(list) => {
                let default = list.iter().position(|t| t.name == "default").unwrap_or(0);
                list.into_iter().nth(default).map(|t| t.template)
            }
        }
    }
}

impl MergeJson {
    fn parse(&self) -> Result<MergeRule, TokenizerError> {
        match self {
            MergeJson::Pair([a, b]) => Ok((unmap(a), unmap(b))),
            MergeJson::Text(m) => super::gguf::parse_merge(m)
                .ok_or_else(|| TokenizerError::Invalid(format!("merge `{m}` is not `left right`"))),
        }
    }
}

/// Vocabulary entries by id. Added tokens override the vocabulary's entry for their
/// id and keep their text as is; ids nobody names become unused placeholders.
fn json_tokens(vocab: &HashMap<String, u32>, added: &[AddedToken]) -> Result<Vec<TokenEntry>, TokenizerError> {
    let max_id = vocab.values().chain(added.iter().map(|a| &a.id)).copied().max();
    let size = max_id.map_or(0, |m| m as usize + 1);
    // Refuse ids so sparse that the table would be mostly holes (a corrupt file).
    if size > 2 * (vocab.len() + added.len()) + 1024 {
        return Err(TokenizerError::Invalid(format!("token id {} is far beyond the vocabulary", size - 1)));
    }
    let mut tokens = vec![TokenEntry::new(Vec::new(), TokenKind::Unused); size];
    for (text, &id) in vocab {
        tokens[id as usize] = TokenEntry::new(unmap(text), TokenKind::Normal);
    }
    for a in added {
        let kind = if a.special { TokenKind::Control } else { TokenKind::UserDefined };
        let mut entry = TokenEntry::new(a.content.as_bytes().to_vec(), kind);
        (entry.lstrip, entry.rstrip) = (a.lstrip, a.rstrip);
        tokens[a.id as usize] = entry;
    }
    Ok(tokens)
}

/// Pre-tokenizer components in order, with `Sequence`s flattened.
fn components(v: &Value) -> Vec<&Value> {
    let nested = ["pretokenizers", "decoders", "processors"];
    match nested.iter().find_map(|k| v.get(k).and_then(Value::as_array)) {
        Some(list) => list.iter().flat_map(components).collect(),
        None if v.is_null() => Vec::new(),
        None => vec![v],
    }
}

fn type_of(v: &Value) -> &str {
    v.get("type").and_then(Value::as_str).unwrap_or("")
}

fn mentions_byte_level(parts: &[&Value]) -> bool {
    parts.iter().flat_map(|v| components(v)).any(|c| type_of(c) == "ByteLevel")
}

/// One regex stage per Split / Digits / ByteLevel component; GPT-2's split when none.
fn pre_tokenizer(v: &Value) -> Result<PreTokenizer, TokenizerError> {
    let mut patterns = Vec::new();
    for c in components(v) {
        if let Some(p) = stage_pattern(c)? {
            patterns.push(p);
        }
    }
    if patterns.is_empty() {
        return PreTokenizer::new("gpt2", &[GPT2]);
    }
    let refs: Vec<&str> = patterns.iter().map(String::as_str).collect();
    PreTokenizer::new("tokenizer.json", &refs)
}

fn stage_pattern(c: &Value) -> Result<Option<String>, TokenizerError> {
    let unsupported = |what: &str| Err(TokenizerError::Unsupported(format!("pre-tokenizer {what}")));
    match type_of(c) {
        "ByteLevel" if c.get("add_prefix_space").and_then(Value::as_bool) == Some(true) => {
            unsupported("ByteLevel with add_prefix_space")
        }
        "ByteLevel" => {
            let use_regex = c.get("use_regex").and_then(Value::as_bool).unwrap_or(true);
            Ok(use_regex.then(|| GPT2.to_string()))
        }
        "Digits" => {
            let single = c.get("individual_digits").and_then(Value::as_bool).unwrap_or(false);
            Ok(Some(if single { DIGITS.to_string() } else { r"\p{N}+".to_string() }))
        }
        "Split" => split_pattern(c).map(Some),
        other => unsupported(&format!("`{other}`")),
    }
}

/// A Split's pattern. Only the `Isolated` behaviour (matches and gaps both kept) is
/// what our stages do.
fn split_pattern(c: &Value) -> Result<String, TokenizerError> {
    let behavior = c.get("behavior").and_then(Value::as_str).unwrap_or("Isolated");
    let invert = c.get("invert").and_then(Value::as_bool).unwrap_or(false);
    if behavior != "Isolated" || invert {
        return Err(TokenizerError::Unsupported(format!("Split with behavior {behavior}, invert {invert}")));
    }
    let pattern = c.get("pattern");
    if let Some(re) = pattern.and_then(|p| p.get("Regex")).and_then(Value::as_str) {
        return Ok(re.to_string());
    }
    match pattern.and_then(|p| p.get("String")).and_then(Value::as_str) {
        Some(s) => Ok(fancy_regex::escape(s).into_owned()),
        None => Err(TokenizerError::Invalid("Split pre-tokenizer without a pattern".into())),
    }
}

/// The special token a TemplateProcessing post-processor puts before every sequence
/// (Llama 3's `<|begin_of_text|>`): that is how tokenizer.json says "add BOS".
fn leading_special(v: &Value) -> Option<String> {
    let template = components(v).into_iter().find(|c| type_of(c) == "TemplateProcessing")?;
    let first = template.get("single")?.as_array()?.first()?;
    first.get("SpecialToken")?.get("id")?.as_str().map(str::to_string)
}
