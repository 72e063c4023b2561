//! Token id ↔ bytes, with each token's kind.

use super::{TokenKind, TokenizerError};
use std::collections::HashMap;

/// One vocabulary entry as a file format provides it, GPT-2 mapping already undone.
#[derive(Debug, Clone)]
pub(crate) struct TokenEntry {
    pub bytes: Vec<u8>,
    pub kind: TokenKind,
    /// Whitespace on this side of the token is swallowed when the token is cut out of
    /// text (tokenizer.json `lstrip` / `rstrip`).
    pub lstrip: bool,
    pub rstrip: bool,
}

impl TokenEntry {
    pub fn new(bytes: Vec<u8>, kind: TokenKind) -> Self {
        TokenEntry { bytes, kind, lstrip: false, rstrip: false }
    }
}

#[derive(Debug)]
pub(crate) struct Vocab {
    /// All token bytes back to back; token `i` is `data[starts[i]..starts[i + 1]]`.
    data: Vec<u8>,
    starts: Vec<usize>,
    kinds: Vec<TokenKind>,
    by_bytes: HashMap<Box<[u8]>, u32>,
}

impl Vocab {
    pub fn new(entries: &[TokenEntry]) -> Result<Self, TokenizerError> {
        if u32::try_from(entries.len()).map_or(true, |n| n == u32::MAX) {
            return Err(TokenizerError::Invalid(format!("{} tokens is too many", entries.len())));
        }
        let mut data = Vec::with_capacity(entries.iter().map(|e| e.bytes.len()).sum());
        let mut starts = Vec::with_capacity(entries.len() + 1);
        for e in entries {
            starts.push(data.len());
            data.extend_from_slice(&e.bytes);
        }
        starts.push(data.len());
        let kinds = entries.iter().map(|e| e.kind).collect();
        Ok(Vocab { data, starts, kinds, by_bytes: index_by_bytes(entries) })
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn bytes(&self, id: u32) -> Option<&[u8]> {
        let i = usize::try_from(id).ok()?;
        let (start, end) = (*self.starts.get(i)?, *self.starts.get(i + 1)?);
        self.data.get(start..end)
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(usize::try_from(id).ok()?).copied()
    }

    pub fn id_of(&self, bytes: &[u8]) -> Option<u32> {
        self.by_bytes.get(bytes).copied()
    }

    /// `(id, bytes, kind)` for every token.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &[u8], TokenKind)> + '_ {
        (0..self.len()).filter_map(move |i| {
            let id = u32::try_from(i).ok()?;
            Some((id, self.bytes(id)?, self.kinds[i]))
        })
    }
}

/// Text → id. When two tokens have the same bytes (a special token spelled like a normal
/// one), the special one wins: asking for `<|im_end|>` by name means the special token.
/// Next come normal tokens, so `A` means the piece `A` rather than the byte token
/// `<0x41>` that decodes to the same byte.
fn index_by_bytes(entries: &[TokenEntry]) -> HashMap<Box<[u8]>, u32> {
    let mut map = HashMap::with_capacity(entries.len());
    let rank = |k: TokenKind| match k {
        k if k.is_literal() => 0,
        TokenKind::Normal => 1,
        _ => 2,
    };
    let by = |r| entries.iter().zip(0u32..).filter(move |(e, _)| rank(e.kind) == r);
    for (e, id) in by(0).chain(by(1)).chain(by(2)) {
        if !e.bytes.is_empty() {
            map.entry(e.bytes.clone().into_boxed_slice()).or_insert(id);
        }
    }
    map
}
