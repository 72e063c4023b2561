//! Pre-tokenization: splitting text into the words BPE merges within.
//!
//! A pre-tokenizer is a list of regex stages. Each stage splits every piece from the
//! stage before into its matches and the gaps between them (both kept), which is how
//! llama.cpp and Hugging Face `Split(behavior = Isolated)` apply a regex. A piece's
//! end is the end of the text for lookaheads, so `\s+(?!\S)` cannot see past it.

use super::TokenizerError;
use fancy_regex::Regex;

/// GPT-2's word split. llama.cpp's copy drops the final `|\s+` but keeps unmatched gaps
/// as pieces, which splits the same way.
pub(crate) const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Every digit on its own (SmolLM / StarCoder run this before [`GPT2`]).
pub(crate) const DIGITS: &str = r"\p{N}";

/// Llama 3. The contractions are spelled case by case as llama.cpp does: `(?i:'s)`
/// would also match `'ſ` under Unicode case folding.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2: Llama 3's split with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

#[derive(Debug)]
pub(crate) struct PreTokenizer {
    name: String,
    stages: Vec<Regex>,
}

impl PreTokenizer {
    /// The pre-tokenizer for a GGUF `tokenizer.ggml.pre` name.
    pub fn for_gguf(pre: &str) -> Result<Self, TokenizerError> {
        match pre {
            "smollm" | "starcoder" | "refact" => Self::new(pre, &[DIGITS, GPT2]),
            "llama-bpe" | "llama3" | "llama-v3" => Self::new(pre, &[LLAMA3]),
            "qwen2" => Self::new(pre, &[QWEN2]),
            "gpt2" | "gpt-2" => Self::new(pre, &[GPT2]),
            // An unlisted name still gets a working split; words may break differently
            // from llama.cpp for it, which costs quality, not correctness.
            other => Self::new(&format!("gpt2 (fallback for `{other}`)"), &[GPT2]),
        }
    }

    pub fn new(name: &str, patterns: &[&str]) -> Result<Self, TokenizerError> {
        let stages = patterns.iter().map(|p| compile(p)).collect::<Result<_, _>>()?;
        Ok(PreTokenizer { name: name.to_string(), stages })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Calls `word` for each piece of `text`, in order.
    pub fn split<'t>(&self, text: &'t str, word: &mut dyn FnMut(&'t str)) {
        self.split_stage(0, text, word);
    }

    fn split_stage<'t>(&self, stage: usize, text: &'t str, word: &mut dyn FnMut(&'t str)) {
        let Some(re) = self.stages.get(stage) else {
            if !text.is_empty() {
                word(text);
            }
            return;
        };
        let mut last = 0;
        for m in re.find_iter(text) {
            // A regex that gives up (backtrack limit) leaves the rest as one piece:
            // BPE still encodes it, only less compactly.
            let Ok(m) = m else { break };
            self.split_stage(stage + 1, &text[last..m.start()], word);
            self.split_stage(stage + 1, m.as_str(), word);
            last = m.end();
        }
        self.split_stage(stage + 1, &text[last..], word);
    }
}

fn compile(pattern: &str) -> Result<Regex, TokenizerError> {
    Regex::new(pattern).map_err(|e| TokenizerError::Regex { pattern: pattern.to_string(), message: e.to_string() })
}
