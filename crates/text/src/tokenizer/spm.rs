//! SentencePiece-style encoding (GGUF `tokenizer.ggml.model = "llama"`: Gemma, Llama 2,
//! Mistral), reproducing llama.cpp's SPM tokenizer.
//!
//! A text fragment (what is left between special tokens) gets an optional leading space,
//! every space becomes U+2581 `▁`, and each character starts as one symbol. Then,
//! while some pair of neighbouring symbols spells a vocabulary piece, the pair whose
//! piece has the highest score is joined (equal scores: the leftmost pair). A heap holds
//! the candidate pairs; a pair that changed since it was queued is skipped when popped.
//! Finally each symbol is looked up; a symbol that is no piece (always a single
//! character, since only pieces are ever formed) is written as its UTF-8 bytes through
//! the `<0xNN>` byte tokens, or as the unknown token where the vocabulary has none.
//!
//! The lookup works on piece texts as the file spells them (with `▁`), so it lives
//! here rather than in [`Vocab`](super::vocab::Vocab), which holds decoded bytes.

use super::TokenizerError;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece's visible space.
pub(crate) const SPACE: char = '\u{2581}';

/// Marks a missing neighbour.
const NONE: u32 = u32::MAX;

/// What the GGUF file says about a SentencePiece vocabulary.
#[derive(Debug, Default)]
pub(crate) struct SpmParts {
    /// Every token's text as stored (`▁the`, `<0x0A>`, `<start_of_turn>`).
    pub pieces: Vec<String>,
    /// One score per token; a missing one counts as 0.
    pub scores: Vec<f32>,
    /// Put a space in front of text that starts the input or follows a special token.
    pub add_space_prefix: bool,
    /// For characters without byte tokens (vocabularies without byte fallback).
    pub unk: Option<u32>,
}

#[derive(Debug)]
pub(crate) struct Spm {
    /// Piece text → id. When two tokens share a text the later id wins, as in llama.cpp.
    ids: HashMap<Box<str>, u32>,
    scores: Box<[f32]>,
    /// The token written for each byte of a character that is no piece: `<0xNN>`, or
    /// else a piece that is that one byte.
    byte_token: [Option<u32>; 256],
    /// For a character whose bytes do not all have a token.
    unk: Option<u32>,
    add_space_prefix: bool,
}

/// Buffers reused across the fragments of one `encode` call.
#[derive(Default)]
pub(crate) struct Scratch {
    text: String,
    syms: Vec<Symbol>,
    heap: BinaryHeap<Pair>,
}

/// A run of `text[start..start + len]`; `len == 0` once joined into its left neighbour.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

/// A queued join of symbols `left` and `right`, valid while their lengths still add
/// up to `len` (any change to either one changes that sum or empties one of them).
#[derive(Debug, Clone, Copy)]
struct Pair {
    score: f32,
    left: u32,
    right: u32,
    len: u32,
}

impl Ord for Pair {
    /// The heap's maximum is the best pair: highest score, then leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}

impl Spm {
    pub fn new(parts: SpmParts) -> Result<Self, TokenizerError> {
        let n = u32::try_from(parts.pieces.len())
            .map_err(|_| TokenizerError::Invalid(format!("{} tokens is too many", parts.pieces.len())))?;
        let mut ids = HashMap::with_capacity(parts.pieces.len());
        for (id, piece) in (0..n).zip(parts.pieces) {
            if !piece.is_empty() {
                ids.insert(piece.into_boxed_str(), id);
            }
        }
        // `+ 0.0` turns -0.0 into 0.0, so the total order agrees with `<` on scores.
        let scores = (0..n as usize).map(|i| parts.scores.get(i).map_or(0.0, |&s| s + 0.0)).collect();
        let byte_token = std::array::from_fn(|b| {
            let hex = format!("<0x{b:02X}>");
            let b = b as u8;
            let raw = std::str::from_utf8(std::slice::from_ref(&b)).ok().and_then(|s| ids.get(s));
            ids.get(hex.as_str()).or(raw).copied()
        });
        Ok(Spm { ids, scores, byte_token, unk: parts.unk, add_space_prefix: parts.add_space_prefix })
    }

    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Appends the tokens of one fragment of plain text. `after_special`: the fragment
    /// starts the input or follows a special token (where the space prefix goes).
    pub fn encode(&self, fragment: &str, after_special: bool, s: &mut Scratch, out: &mut Vec<u32>) {
        s.text.clear();
        if self.add_space_prefix && after_special {
            s.text.push(SPACE);
        }
        for (i, part) in fragment.split(' ').enumerate() {
            if i > 0 {
                s.text.push(SPACE);
            }
            s.text.push_str(part);
        }
        self.load(s);
        while let Some(p) = s.heap.pop() {
            self.join(s, p);
        }
        self.emit(s, out);
    }

    /// One symbol per character, and every neighbouring pair that spells a piece queued.
    fn load(&self, s: &mut Scratch) {
        s.syms.clear();
        s.heap.clear();
        let count = s.text.chars().count();
        for (i, (start, c)) in (0u32..).zip(s.text.char_indices()) {
            let prev = if i == 0 { NONE } else { i - 1 };
            let next = if i as usize + 1 == count { NONE } else { i + 1 };
            s.syms.push(Symbol { start: start as u32, len: c.len_utf8() as u32, prev, next });
        }
        for i in 1..s.syms.len() as u32 {
            self.queue(s, i - 1, i);
        }
    }

    fn piece<'s>(text: &'s str, sym: &Symbol) -> &'s str {
        &text[sym.start as usize..(sym.start + sym.len) as usize]
    }

    fn queue(&self, s: &mut Scratch, left: u32, right: u32) {
        if left == NONE || right == NONE {
            return;
        }
        let (l, r) = (s.syms[left as usize], s.syms[right as usize]);
        let len = l.len + r.len;
        let joined = &s.text[l.start as usize..(l.start + len) as usize];
        if let Some(&id) = self.ids.get(joined) {
            s.heap.push(Pair { score: self.scores[id as usize], left, right, len });
        }
    }

    fn join(&self, s: &mut Scratch, p: Pair) {
        let (l, r) = (s.syms[p.left as usize], s.syms[p.right as usize]);
        if l.len == 0 || r.len == 0 || l.len + r.len != p.len {
            return;
        }
        s.syms[p.left as usize].len = p.len;
        s.syms[p.left as usize].next = r.next;
        s.syms[p.right as usize].len = 0;
        if r.next != NONE {
            s.syms[r.next as usize].prev = p.left;
        }
        self.queue(s, l.prev, p.left);
        self.queue(s, p.left, r.next);
    }

    fn emit(&self, s: &Scratch, out: &mut Vec<u32>) {
        let mut i = if s.syms.is_empty() { NONE } else { 0 };
        while i != NONE {
            let sym = &s.syms[i as usize];
            let piece = Self::piece(&s.text, sym);
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None if piece.bytes().all(|b| self.byte_token[usize::from(b)].is_some()) => {
                    out.extend(piece.bytes().filter_map(|b| self.byte_token[usize::from(b)]));
                }
                None => out.extend(self.unk),
            }
            i = sym.next;
        }
    }
}

/// The bytes a piece stands for when decoding: `▁` as a space.
pub(crate) fn unescape(piece: &str) -> Vec<u8> {
    piece.replace(SPACE, " ").into_bytes()
}

/// The byte of a byte token's text `<0xNN>`.
pub(crate) fn byte_of(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok()).flatten()
}
