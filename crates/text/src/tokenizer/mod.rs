//! Tokenizers built from GGUF metadata or a Hugging Face `tokenizer.json`, matching
//! llama.cpp token for token: byte-level BPE (the GPT-2 family: SmolLM, Llama 3, Qwen 2)
//! and SentencePiece (GGUF `llama`: Gemma, Llama 2, Mistral).
//!
//! Encoding starts by cutting special tokens out of the text (`special.rs`). For BPE,
//! each remaining fragment is split into words by the model's pre-tokenizer regexes
//! (`pretokenize.rs`), and each word's bytes are merged by BPE rank (`bpe.rs`). For
//! SentencePiece, each fragment's characters are joined by piece score (`spm.rs`).
//! Token strings in model files use GPT-2's byte-to-unicode mapping (BPE) or `▁` for a
//! space and `<0xNN>` for a byte (SentencePiece); [`Vocab`] holds them decoded, so
//! decoding and streaming work on raw bytes for both.

mod bpe;
mod bytemap;
mod gguf;
mod json;
mod pretokenize;
mod special;
mod spm;
#[cfg(test)]
mod spm_tests;
mod stream;
#[cfg(test)]
mod tests;
mod vocab;

pub use stream::StreamDecoder;

use bpe::Bpe;
use pretokenize::PreTokenizer;
use special::{Fragment, Specials};
use spm::{Spm, SpmParts};
use vocab::{TokenEntry, Vocab};

/// Why a tokenizer could not be built. Messages name the file's problem.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata `{0}` is missing or has the wrong type")]
    MissingKey(String),
    #[error(
        "unsupported tokenizer `{0}`: pdserve supports byte-level BPE (GGUF `gpt2`, tokenizer.json BPE with ByteLevel) and SentencePiece (GGUF `llama`)"
    )]
    Unsupported(String),
    #[error("{what} id {id} is outside the vocabulary of {size} tokens")]
    IdOutOfRange { what: &'static str, id: u64, size: usize },
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not valid tokenizer JSON: {source}")]
    Json { path: String, source: serde_json::Error },
    #[error("pre-tokenizer regex `{pattern}` does not compile: {message}")]
    Regex { pattern: String, message: String },
    #[error("invalid tokenizer: {0}")]
    Invalid(String),
}

/// What a token is, following GGUF's `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Normal,
    Unknown,
    /// Special tokens such as `<|im_start|>`: matched in text only when parsing specials.
    Control,
    /// Added tokens that are always matched in text as a whole.
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    pub fn from_gguf(t: i64) -> TokenKind {
        match t {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => TokenKind::Normal,
        }
    }

    /// Stored and matched as literal text rather than through BPE.
    fn is_literal(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown)
    }
}

/// Token texts that end a turn in common chat formats, as llama.cpp lists them.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// One merge rule: the raw bytes of its left and right parts.
type MergeRule = (Vec<u8>, Vec<u8>);

/// Everything a file format provides, gathered before building.
#[derive(Debug, Default)]
struct Parts {
    tokens: Vec<TokenEntry>,
    merges: Vec<MergeRule>,
    pre: Option<PreTokenizer>,
    ignore_merges: bool,
    bos: Option<u64>,
    eos: Option<u64>,
    /// Further end-of-generation ids the format names (GGUF eot / eom).
    eog: Vec<u64>,
    add_bos: bool,
    chat_template: Option<String>,
    /// A SentencePiece vocabulary: `merges`, `pre` and `ignore_merges` are unused.
    spm: Option<SpmParts>,
}

/// How plain text becomes tokens.
#[derive(Debug)]
enum Model {
    Bpe { bpe: Box<Bpe>, pre: PreTokenizer },
    Spm(Box<Spm>),
}

/// A loaded tokenizer. Immutable and `Sync`: share one behind an `Arc`.
#[derive(Debug)]
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    specials: Specials,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl Tokenizer {
    fn build(p: Parts) -> Result<Tokenizer, TokenizerError> {
        let vocab = Vocab::new(&p.tokens)?;
        let check = |what, id: Option<u64>| check_id(what, id, vocab.len());
        let (bos, eos) = (check("bos", p.bos)?, check("eos", p.eos)?);
        let mut eog = Vec::new();
        for id in p.eog {
            eog.extend(check("end-of-generation", Some(id))?);
        }
        eog.extend(eos);
        eog.extend(EOG_TEXTS.iter().filter_map(|t| vocab.id_of(t.as_bytes())));
        eog.sort_unstable();
        eog.dedup();
        let model = match p.spm {
            Some(spm) => Model::Spm(Box::new(Spm::new(spm)?)),
            None => {
                let pre = match p.pre {
                    Some(pre) => pre,
                    None => PreTokenizer::for_gguf("gpt2")?,
                };
                Model::Bpe { bpe: Box::new(Bpe::new(&vocab, &p.merges, p.ignore_merges)?), pre }
            }
        };
        Ok(Tokenizer {
            model,
            specials: Specials::new(&p.tokens),
            vocab,
            bos,
            eos,
            eog,
            add_bos: p.add_bos,
            chat_template: p.chat_template,
        })
    }

    /// Token ids of `text`, without BOS. With `parse_special`, control tokens written
    /// in the text (`<|im_start|>`) become their ids; without it they are plain text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        self.encode_fragments(self.specials.split(text, parse_special), text.len())
    }

    /// Token ids of `text` as it continues text already written: special tokens are
    /// plain text, and a SentencePiece model puts no space in front of it (a grammar's
    /// forced bytes in the middle of an answer).
    pub fn encode_continuation(&self, text: &str) -> Vec<u32> {
        match &self.model {
            Model::Spm(spm) => {
                let mut out = Vec::with_capacity(text.len() / 4 + 1);
                spm.encode(text, false, &mut spm::Scratch::default(), &mut out);
                out
            }
            Model::Bpe { .. } => self.encode(text, false),
        }
    }

    /// `text` with special tokens parsed except where they start inside one of the
    /// byte ranges `plain`: a rendered chat whose messages' contents are text, so a
    /// user cannot forge the template's role markers.
    pub fn encode_outside(&self, text: &str, plain: &[std::ops::Range<usize>]) -> Vec<u32> {
        self.encode_fragments(self.specials.split_outside(text, true, plain), text.len())
    }

    fn encode_fragments(&self, frags: Vec<Fragment<'_>>, len: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(len / 4 + 1);
        match &self.model {
            Model::Bpe { bpe, pre } => {
                let mut scratch = bpe::Scratch::default();
                for frag in frags {
                    match frag {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(t) => pre.split(t, &mut |word| {
                            bpe.encode_word(word.as_bytes(), &self.vocab, &mut scratch, &mut out)
                        }),
                    }
                }
            }
            Model::Spm(spm) => {
                let mut scratch = spm::Scratch::default();
                // As in llama.cpp, the space prefix goes where the input starts and
                // after every token cut out of it.
                let mut after_special = true;
                for frag in frags {
                    match frag {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(t) => spm.encode(t, after_special, &mut scratch, &mut out),
                    }
                    after_special = matches!(frag, Fragment::Token(_));
                }
            }
        }
        out
    }

    /// [`encode`](Self::encode) with BOS in front when the model asks for it
    /// ([`add_bos`](Self::add_bos)).
    pub fn encode_with_bos(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut ids = self.encode(text, parse_special);
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.insert(0, bos);
        }
        ids
    }

    /// The text of `ids`. Special tokens give their text; ids outside the vocabulary
    /// give U+FFFD. Invalid UTF-8 is replaced only after all bytes are joined, so a
    /// character split across tokens decodes whole. A SentencePiece model that puts a
    /// space in front of the input loses one leading space of the first token here, as
    /// in llama.cpp's detokenizer (the [`StreamDecoder`], which continues a prompt,
    /// keeps it).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        if let Some((&first, rest)) = ids.split_first() {
            self.append_bytes(first, &mut bytes);
            if bytes.first() == Some(&b' ') && self.strips_leading_space() {
                bytes.remove(0);
            }
            for &id in rest {
                self.append_bytes(id, &mut bytes);
            }
        }
        match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    fn strips_leading_space(&self) -> bool {
        matches!(&self.model, Model::Spm(spm) if spm.add_space_prefix())
    }

    fn append_bytes(&self, id: u32, out: &mut Vec<u8>) {
        match self.vocab.bytes(id) {
            Some(b) => out.extend_from_slice(b),
            None => out.extend_from_slice("\u{FFFD}".as_bytes()),
        }
    }

    /// A decoder for streaming: see [`StreamDecoder`].
    pub fn stream_decoder(&self) -> StreamDecoder<&Tokenizer> {
        StreamDecoder::new(self)
    }

    /// The raw bytes of a token (for a normal token, possibly part of a character).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.vocab.bytes(id)
    }

    /// The id of the token whose text is exactly `text`; special tokens first.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id_of(text.as_bytes())
    }

    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.vocab.kind(id)
    }

    /// Control (and unknown) tokens: the ones `skip_special_tokens` would drop.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(self.vocab.kind(id), Some(TokenKind::Control | TokenKind::Unknown))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// How `other`'s vocabulary differs from this one, if it does: its size, its
    /// BOS and EOS, or the first token whose bytes differ. Two models whose
    /// vocabularies agree read each other's token ids (a draft model and its target).
    pub fn vocab_difference(&self, other: &Tokenizer) -> Option<String> {
        let (a, b) = (self.vocab_size(), other.vocab_size());
        if a != b {
            return Some(format!("{b} tokens against {a}"));
        }
        if (self.bos, self.eos) != (other.bos, other.eos) {
            return Some(format!("BOS/EOS {:?}/{:?} against {:?}/{:?}", other.bos, other.eos, self.bos, self.eos));
        }
        let differs = (0..a as u32).find(|&id| self.vocab.bytes(id) != other.vocab.bytes(id))?;
        let show = |t: &Tokenizer| t.token_text(differs).unwrap_or_default();
        Some(format!("token {differs} is {:?} against {:?}", show(other), show(self)))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether prompts should start with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Ids that end generation: EOS plus the model's end-of-turn tokens, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The model's own Jinja chat template, if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The pre-tokenizer in use, for logs (`smollm`, `llama-bpe`, ...); `spm` for
    /// SentencePiece, which has none.
    pub fn pre_tokenizer(&self) -> &str {
        match &self.model {
            Model::Bpe { pre, .. } => pre.name(),
            Model::Spm(_) => "spm",
        }
    }

    /// The text of token `id` for messages and templates (`<|im_end|>`), lossy.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.vocab.bytes(id).map(|b| String::from_utf8_lossy(b).into_owned())
    }
}

fn check_id(what: &'static str, id: Option<u64>, size: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(id) = id else { return Ok(None) };
    match u32::try_from(id) {
        Ok(v) if (v as usize) < size => Ok(Some(v)),
        _ => Err(TokenizerError::IdOutOfRange { what, id, size }),
    }
}
