//! SentencePiece unit tests on tiny handmade vocabularies; Gemma 3 is checked against
//! llama.cpp in `crates/engine/tests/tokenizer_golden.rs`.

use super::tests::{header, Header};
use super::*;
use crate::meta::MetaValue;

/// `<unk>`, `<s>`, `</s>`, then (with `bytes`) `<0x00>`..`<0xFF>`, then the pieces, then
/// the user-defined token `xy`.
struct TinySpm<'a> {
    pieces: &'a [(&'a str, f32)],
    /// `tokenizer.ggml.add_space_prefix`; `None` leaves the key out.
    prefix: Option<bool>,
    bytes: bool,
}

const UNK: u32 = 0;
const BOS: u32 = 1;
const BYTE0: u32 = 3;

impl TinySpm<'_> {
    fn header(&self) -> Header {
        let mut tokens: Vec<(String, f32, i32)> =
            vec![("<unk>".into(), 0.0, 2), ("<s>".into(), 0.0, 3), ("</s>".into(), 0.0, 3)];
        if self.bytes {
            tokens.extend((0..=255u8).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
        }
        tokens.extend(self.pieces.iter().map(|&(p, score)| (p.to_string(), score, 1)));
        tokens.push(("xy".into(), 0.0, 4));
        let mut h = header([
            ("tokenizer.ggml.model", MetaValue::Str("llama".into())),
            ("tokenizer.ggml.tokens", MetaValue::Array(tokens.iter().map(|t| MetaValue::Str(t.0.clone())).collect())),
            ("tokenizer.ggml.scores", MetaValue::Array(tokens.iter().map(|t| MetaValue::F32(t.1)).collect())),
            ("tokenizer.ggml.token_type", MetaValue::Array(tokens.iter().map(|t| MetaValue::I32(t.2)).collect())),
        ]);
        if let Some(p) = self.prefix {
            h.insert("tokenizer.ggml.add_space_prefix".into(), MetaValue::Bool(p));
        }
        h
    }

    fn build(&self) -> Tokenizer {
        Tokenizer::from_gguf(&self.header()).unwrap()
    }
}

fn tiny(pieces: &[(&str, f32)], prefix: bool) -> Tokenizer {
    TinySpm { pieces, prefix: Some(prefix), bytes: true }.build()
}

/// The id of a piece, written with `▁` as in the file.
fn pid(tok: &Tokenizer, piece: &str) -> u32 {
    tok.token_id(&piece.replace('▁', " ")).unwrap_or_else(|| panic!("no piece {piece:?}"))
}

fn byte(b: u8) -> u32 {
    BYTE0 + u32::from(b)
}

#[test]
fn the_highest_score_joins_first() {
    let pieces = |ab, bc| [("a", 0.0), ("b", 0.0), ("c", 0.0), ("ab", ab), ("bc", bc)];
    let bc_wins = tiny(&pieces(-2.0, -1.0), false);
    assert_eq!(bc_wins.encode("abc", false), vec![pid(&bc_wins, "a"), pid(&bc_wins, "bc")]);
    let ab_wins = tiny(&pieces(-1.0, -2.0), false);
    assert_eq!(ab_wins.encode("abc", false), vec![pid(&ab_wins, "ab"), pid(&ab_wins, "c")]);
    // Equal scores: the leftmost pair.
    let tie = tiny(&pieces(-1.0, -1.0), false);
    assert_eq!(tie.encode("abc", false), vec![pid(&tie, "ab"), pid(&tie, "c")]);
    let aa = tiny(&[("a", 0.0), ("aa", -1.0)], false);
    assert_eq!(aa.encode("aaa", false), vec![pid(&aa, "aa"), pid(&aa, "a")]);
}

#[test]
fn pairs_formed_by_a_join_are_queued() {
    let pieces = [
        ("▁", -9.0),
        ("h", 0.0),
        ("e", 0.0),
        ("l", 0.0),
        ("o", 0.0),
        ("he", -3.0),
        ("ll", -1.0),
        ("hell", -2.0),
        ("hello", -0.5),
        ("▁hello", -0.1),
    ];
    let tok = tiny(&pieces, true);
    // ll, then he, then hell, hello and ▁hello as each pair comes into being.
    assert_eq!(tok.encode("hello", false), vec![pid(&tok, "▁hello")]);
    assert_eq!(tok.encode("hellohe", false), vec![pid(&tok, "▁hello"), pid(&tok, "he")]);
    assert_eq!(tok.decode(&tok.encode("hello", false)), "hello");
}

#[test]
fn characters_without_a_piece_fall_back_to_bytes() {
    let tok = tiny(&[("a", 0.0)], false);
    let ids = tok.encode("aéa", false);
    assert_eq!(ids, vec![pid(&tok, "a"), byte(0xC3), byte(0xA9), pid(&tok, "a")]);
    assert_eq!(tok.decode(&ids), "aéa");
    assert_eq!(tok.token_bytes(byte(0xC3)), Some(&[0xC3][..]));
    assert_eq!(tok.token_kind(byte(0xC3)), Some(TokenKind::Byte));
    // Without byte tokens, a character that is no piece becomes one unknown token.
    let no_bytes = TinySpm { pieces: &[("a", 0.0)], prefix: Some(false), bytes: false }.build();
    assert_eq!(no_bytes.encode("aé🚀", false), vec![pid(&no_bytes, "a"), UNK, UNK]);
}

#[test]
fn a_piece_wins_over_the_byte_token_of_the_same_byte() {
    let tok = tiny(&[("A", 0.0)], false);
    assert_eq!(tok.token_id("A"), Some(BYTE0 + 256));
    assert_eq!(tok.encode("A", false), vec![BYTE0 + 256]);
    assert_eq!(tok.decode(&[byte(b'A'), BYTE0 + 256]), "AA");
}

#[test]
fn the_space_prefix_goes_at_the_start_and_after_special_tokens() {
    let pieces = [("▁", -5.0), ("a", 0.0), ("b", 0.0), ("▁a", -1.0)];
    let tok = tiny(&pieces, true);
    let (sp, a, b, sp_a) = (pid(&tok, "▁"), pid(&tok, "a"), pid(&tok, "b"), pid(&tok, "▁a"));
    assert_eq!(tok.encode("a b", false), vec![sp_a, sp, b]);
    assert_eq!(tok.decode(&tok.encode("a b", false)), "a b", "decode drops the space the prefix added");
    assert_eq!(tok.encode("<s>a", true), vec![BOS, sp_a]);
    assert_eq!(tok.encode("b<s>a", true), vec![sp, b, BOS, sp_a]);
    // A user-defined token is always cut out, and counts as special for the prefix.
    let xy = pid(&tok, "xy");
    assert_eq!(tok.encode("axyb", false), vec![sp_a, xy, sp, b]);
    assert_eq!(tok.encode("", false), Vec::<u32>::new());
    // Streaming continues a prompt: it keeps the space.
    let mut s = tok.stream_decoder();
    assert_eq!(s.push(sp_a), " a");

    // Text that continues an answer (a grammar's forced bytes) gets no prefix, and
    // its special-looking text stays text.
    assert_eq!(tok.encode_continuation("a b"), vec![a, sp, b]);
    assert!(!tok.encode_continuation("<s>").contains(&BOS));

    let plain = tiny(&pieces, false);
    assert_eq!(plain.encode_continuation("a b"), plain.encode("a b", false));
    assert_eq!(plain.encode("a b", false), vec![a, sp, b]);
    assert_eq!(plain.encode(" a", false), vec![sp_a]);
    assert_eq!(plain.decode(&[sp_a]), " a");
    assert_eq!(plain.encode("axyb", false), vec![a, xy, b]);
}

#[test]
fn missing_keys_take_llama_cpp_defaults() {
    let tok = TinySpm { pieces: &[("▁", -1.0), ("a", 0.0)], prefix: None, bytes: true }.build();
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(2)));
    assert!(tok.add_bos());
    assert_eq!(tok.encode_with_bos("a", false), vec![BOS, pid(&tok, "▁"), pid(&tok, "a")]);
    assert_eq!(tok.pre_tokenizer(), "spm");
    assert!(tok.is_special(BOS) && !tok.is_special(pid(&tok, "a")));
    assert_eq!(tok.eog_ids(), &[2]);
}

#[test]
fn stream_decoder_joins_byte_tokens_into_characters() {
    let tok = tiny(&[("▁", -1.0), ("a", 0.0)], false);
    let ids = tok.encode("a 🚀 a", false);
    assert_eq!(ids.len(), 1 + 1 + 4 + 1 + 1);
    let mut s = tok.stream_decoder();
    let pieces: Vec<String> = ids.iter().map(|&id| s.push(id)).collect();
    assert_eq!(pieces, ["a", " ", "", "", "", "🚀", " ", "a"]);
    assert!(s.is_clean());
    assert_eq!(pieces.concat(), tok.decode(&ids));
}

#[test]
fn long_inputs_stay_fast_and_exact() {
    let tok = tiny(&[("▁", -1.0), ("a", 0.0), ("aa", -1.0), ("aaaa", -2.0), ("▁aaaa", -3.0)], true);
    for text in ["a".repeat(100_000), "aaaa ".repeat(20_000), "é".repeat(20_000), " ".repeat(50_000)] {
        let start = std::time::Instant::now();
        let ids = tok.encode(&text, false);
        assert_eq!(tok.decode(&ids), text);
        assert!(start.elapsed().as_secs() < 5, "{} bytes took {:?}", text.len(), start.elapsed());
    }
}
