//! Incremental detokenization for streamed responses.
//!
//! A byte-level token can end in the middle of a UTF-8 character (emoji and CJK often
//! span two tokens), so bytes that may still become a character are held back until
//! the next token decides. SentencePiece byte tokens (`<0xE2>`) are single bytes and
//! are held back the same way. The text given out, concatenated, equals
//! [`Tokenizer::decode`] of the same ids, except that `decode` drops the leading space
//! a SentencePiece model with a space prefix put in front of the input; a stream
//! continues a prompt, so it keeps that space.

use super::Tokenizer;
use std::ops::Deref;

/// Turns a stream of token ids into text pieces that never split a character.
///
/// Holds a `&Tokenizer` (from [`Tokenizer::stream_decoder`]) or any owner such as an
/// `Arc<Tokenizer>`.
#[derive(Debug)]
pub struct StreamDecoder<T: Deref<Target = Tokenizer>> {
    tokenizer: T,
    /// Bytes not yet given out: at most an incomplete character.
    pending: Vec<u8>,
}

impl<T: Deref<Target = Tokenizer>> StreamDecoder<T> {
    pub fn new(tokenizer: T) -> Self {
        StreamDecoder { tokenizer, pending: Vec::new() }
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let mut out = String::new();
        self.push_into(id, &mut out);
        out
    }

    /// Like [`push`](Self::push), appending to `out` so a caller can reuse one buffer.
    pub fn push_into(&mut self, id: u32, out: &mut String) {
        if self.pending.is_empty() {
            // The common case: a token that is whole characters by itself.
            if let Some(s) = self.tokenizer.token_bytes(id).and_then(|b| std::str::from_utf8(b).ok()) {
                out.push_str(s);
                return;
            }
        }
        self.tokenizer.append_bytes(id, &mut self.pending);
        drain_complete(&mut self.pending, out);
    }

    /// Gives out whatever is held back; an unfinished character becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// True when no bytes are held back.
    pub fn is_clean(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Moves every complete character from `pending` to `out`. A sequence that can no
/// longer become valid turns into one U+FFFD (as `String::from_utf8_lossy` does); an
/// incomplete one at the end stays.
fn drain_complete(pending: &mut Vec<u8>, out: &mut String) {
    let mut start = 0;
    while let Some(rest) = pending.get(start..).filter(|r| !r.is_empty()) {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        start += valid + bad;
                    }
                    None => {
                        start += valid;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
}
