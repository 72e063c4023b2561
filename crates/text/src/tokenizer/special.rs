//! Cutting special tokens out of text before pre-tokenization.
//!
//! Like llama.cpp, tokens are searched longest first, each in the text that longer ones
//! left over, so `<|im_end|>` wins over a shorter token that is a prefix of it.
//! Control tokens are cut only when the caller parses specials; user-defined tokens
//! (non-special added tokens) are always cut, as Hugging Face does.
//!
//! Vocabularies can have thousands of such tokens (Gemma 3: 6,414), so one pass over the
//! text first finds which of them occur in it at all, through their first two bytes;
//! only those are searched for.

use super::vocab::TokenEntry;
use std::collections::HashMap;
use std::ops::Range;

#[derive(Debug)]
struct SpecialToken {
    id: u32,
    text: String,
    always: bool,
    lstrip: bool,
    rstrip: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

#[derive(Debug, Default)]
pub(crate) struct Specials {
    /// Longest text first; ties by id so the order does not depend on a sort's whims.
    tokens: Vec<SpecialToken>,
    /// Indices into `tokens` of the tokens that start with each pair of bytes.
    by_head: HashMap<[u8; 2], Vec<usize>>,
    /// Tokens of one byte, searched for in every text.
    short: Vec<usize>,
}

impl Specials {
    pub fn new(entries: &[TokenEntry]) -> Self {
        let mut tokens: Vec<SpecialToken> = (0u32..)
            .zip(entries)
            .filter(|(_, e)| e.kind.is_literal() && !e.bytes.is_empty())
            .filter_map(|(id, e)| {
                let text = String::from_utf8(e.bytes.clone()).ok()?;
                let always = e.kind == super::TokenKind::UserDefined;
                Some(SpecialToken { id, text, always, lstrip: e.lstrip, rstrip: e.rstrip })
            })
            .collect();
        tokens.sort_by(|a, b| b.text.len().cmp(&a.text.len()).then(a.id.cmp(&b.id)));
        let mut by_head: HashMap<[u8; 2], Vec<usize>> = HashMap::new();
        let mut short = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            match t.text.as_bytes() {
                [a, b, ..] => by_head.entry([*a, *b]).or_default().push(i),
                _ => short.push(i),
            }
        }
        Specials { tokens, by_head, short }
    }

    /// For each token, whether it occurs in `text` (where `wanted` says to look).
    fn occurring(&self, text: &str, wanted: impl Fn(&SpecialToken) -> bool) -> Vec<bool> {
        let mut found = vec![false; self.tokens.len()];
        if self.tokens.is_empty() {
            return found;
        }
        for &i in &self.short {
            found[i] = true;
        }
        let bytes = text.as_bytes();
        for (at, pair) in bytes.windows(2).enumerate() {
            let Some(bucket) = self.by_head.get(pair) else { continue };
            for &i in bucket {
                let tok = &self.tokens[i];
                if !found[i] && wanted(tok) && bytes[at..].starts_with(tok.text.as_bytes()) {
                    found[i] = true;
                }
            }
        }
        found
    }

    /// `text` as plain-text fragments and special tokens, in order. Empty text
    /// fragments are dropped.
    pub fn split<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        self.split_outside(text, parse_special, &[])
    }

    /// As [`Self::split`], but a special token's text that starts inside one of the
    /// byte ranges `plain` of `text` stays text (a chat message's content: only the
    /// template's own markers are special).
    pub fn split_outside<'t>(&self, text: &'t str, parse_special: bool, plain: &[Range<usize>]) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        let wanted = |t: &SpecialToken| parse_special || t.always;
        let occurring = self.occurring(text, wanted);
        for (tok, _) in self.tokens.iter().zip(occurring).filter(|(t, occurs)| *occurs && wanted(t)) {
            let found = frags.iter().any(|f| matches!(f, Fragment::Text(t) if t.contains(tok.text.as_str())));
            if found {
                let plain = if tok.always { &[][..] } else { plain };
                frags = cut(frags, tok, text, plain);
            }
        }
        frags.retain(|f| !matches!(f, Fragment::Text("")));
        frags
    }
}

/// Splits every text fragment at each occurrence of `tok` that does not start in
/// one of the ranges `plain` of `whole` (the text the fragments are slices of).
fn cut<'t>(frags: Vec<Fragment<'t>>, tok: &SpecialToken, whole: &str, plain: &[Range<usize>]) -> Vec<Fragment<'t>> {
    let mut out = Vec::with_capacity(frags.len() + 2);
    let offset = |s: &str| s.as_ptr() as usize - whole.as_ptr() as usize;
    for frag in frags {
        let Fragment::Text(mut rest) = frag else {
            out.push(frag);
            continue;
        };
        let mut from = 0;
        while let Some(found) = rest[from..].find(tok.text.as_str()) {
            let pos = from + found;
            if plain.iter().any(|r| r.contains(&(offset(rest) + pos))) {
                from = pos + tok.text.len();
                continue;
            }
            let (mut left, right) = (&rest[..pos], &rest[pos + tok.text.len()..]);
            if tok.lstrip {
                left = left.trim_end();
            }
            out.push(Fragment::Text(left));
            out.push(Fragment::Token(tok.id));
            rest = if tok.rstrip { right.trim_start() } else { right };
            from = 0;
        }
        out.push(Fragment::Text(rest));
    }
    out
}
