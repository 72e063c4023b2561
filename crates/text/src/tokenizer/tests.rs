//! Unit tests on tiny handmade vocabularies; the real model is checked against
//! llama.cpp in `crates/engine/tests/tokenizer_golden.rs`.

use super::bytemap::{byte_to_char, char_to_byte, map};
use super::pretokenize::PreTokenizer;
use super::*;
use crate::meta::MetaValue;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// Ids of single bytes in the tiny vocabularies: after the three specials.
const BYTE0: u32 = 3;

/// A vocabulary of three specials, all 256 bytes, then each merge's result.
struct Tiny<'a> {
    pre: &'a str,
    merges: &'a [(&'a str, &'a str)],
    /// Merge results that are *not* tokens (to exercise the byte fallback).
    not_tokens: &'a [&'a str],
}

impl Tiny<'_> {
    fn tokens(&self) -> Vec<String> {
        let mut t: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        t.extend((0..=255u8).map(|b| byte_to_char(b).to_string()));
        for (a, b) in self.merges {
            let joined = format!("{a}{b}");
            if !self.not_tokens.contains(&joined.as_str()) {
                t.push(map(joined.as_bytes()));
            }
        }
        t
    }

    fn header(&self) -> Header {
        let tokens = self.tokens();
        let types = (0..tokens.len()).map(|i| MetaValue::I32(if i < 3 { 3 } else { 1 }));
        let merges = self.merges.iter().map(|(a, b)| format!("{} {}", map(a.as_bytes()), map(b.as_bytes())));
        header([
            ("tokenizer.ggml.model", MetaValue::Str("gpt2".into())),
            ("tokenizer.ggml.pre", MetaValue::Str(self.pre.into())),
            ("tokenizer.ggml.tokens", strs(tokens)),
            ("tokenizer.ggml.token_type", MetaValue::Array(types.collect())),
            ("tokenizer.ggml.merges", strs(merges.collect())),
            ("tokenizer.ggml.bos_token_id", MetaValue::U32(1)),
            ("tokenizer.ggml.eos_token_id", MetaValue::U32(2)),
            ("tokenizer.chat_template", MetaValue::Str("{{ messages }}".into())),
        ])
    }

    fn build(&self) -> Tokenizer {
        Tokenizer::from_gguf(&self.header()).unwrap()
    }
}

/// A model file's metadata, as the GGUF reader hands it over.
pub(super) type Header = BTreeMap<String, MetaValue>;

pub(super) fn header<const N: usize>(entries: [(&str, MetaValue); N]) -> Header {
    entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn strs(v: Vec<String>) -> MetaValue {
    MetaValue::Array(v.into_iter().map(MetaValue::Str).collect())
}

const HELLO: &[(&str, &str)] = &[
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    (" ", "w"),
    ("o", "r"),
    (" w", "or"),
    (" wor", "ld"),
    ("l", "d"),
];

fn hello() -> Tokenizer {
    Tiny { pre: "gpt2", merges: HELLO, not_tokens: &[] }.build()
}

fn id(tok: &Tokenizer, text: &str) -> u32 {
    tok.token_id(text).unwrap_or_else(|| panic!("no token {text:?}"))
}

fn byte(b: u8) -> u32 {
    BYTE0 + u32::from(b)
}

#[test]
fn byte_map_is_a_bijection() {
    for b in 0..=255u8 {
        assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
    }
    assert_eq!(byte_to_char(b' '), 'Ġ');
    assert_eq!(byte_to_char(b'\n'), 'Ċ');
    assert_eq!(char_to_byte('\u{0144}'), None);
}

#[test]
fn merges_apply_by_rank() {
    let tok = hello();
    assert_eq!(tok.encode("hello world", false), vec![id(&tok, "hello"), id(&tok, " world")]);
    // ` wor`+`ld` outranks `l`+`d`, yet `ld` has to form first: a pair is queued
    // when it comes into being, not only at the start.
    assert_eq!(tok.encode("hellx", false), vec![id(&tok, "hell"), byte(b'x')]);
    assert_eq!(tok.decode(&tok.encode("hello world", false)), "hello world");
}

#[test]
fn lower_rank_wins_and_ties_go_left() {
    let ab_first = Tiny { pre: "gpt2", merges: &[("a", "b"), ("b", "c")], not_tokens: &[] }.build();
    assert_eq!(ab_first.encode("abc", false), vec![id(&ab_first, "ab"), byte(b'c')]);
    let bc_first = Tiny { pre: "gpt2", merges: &[("b", "c"), ("a", "b")], not_tokens: &[] }.build();
    assert_eq!(bc_first.encode("abc", false), vec![byte(b'a'), id(&bc_first, "bc")]);
    let aa = Tiny { pre: "gpt2", merges: &[("a", "a")], not_tokens: &[] }.build();
    assert_eq!(aa.encode("aaa", false), vec![id(&aa, "aa"), byte(b'a')]);
}

#[test]
fn merges_through_strings_that_are_not_tokens() {
    let merges = &[("x", "y"), ("xy", "z")];
    let tok = Tiny { pre: "gpt2", merges, not_tokens: &["xy"] }.build();
    assert_eq!(tok.token_id("xy"), None);
    assert_eq!(tok.encode("xyz", false), vec![id(&tok, "xyz")]);
    assert_eq!(tok.encode("xy", false), vec![byte(b'x'), byte(b'y')]);
}

#[test]
fn special_tokens_are_cut_out_only_when_asked() {
    let tok = hello();
    let text = "<|im_start|>hello<|im_end|>\n";
    let ids = tok.encode(text, true);
    assert_eq!(ids, vec![1, id(&tok, "hello"), 2, byte(b'\n')]);
    let plain = tok.encode(text, false);
    assert!(!plain.contains(&1) && !plain.contains(&2));
    assert_eq!(tok.decode(&plain), text);
    assert_eq!(tok.decode(&ids), text);
    assert!(tok.is_special(1) && !tok.is_special(byte(b'a')));
    assert_eq!(tok.eog_ids(), &[0, 2]);
    assert!(tok.is_eog(0) && !tok.is_eog(1));
    assert_eq!(tok.chat_template(), Some("{{ messages }}"));
}

#[test]
fn longer_special_tokens_win() {
    let tok = hello();
    // `<|endoftext|>` contains no shorter special, but adjacent ones must all be cut.
    let ids = tok.encode("<|im_end|><|endoftext|><|im_start|>", true);
    assert_eq!(ids, vec![2, 0, 1]);
}

#[test]
fn pre_tokenizers_split_like_llama_cpp() {
    let pieces = |pre: &str, text: &str| {
        let p = PreTokenizer::for_gguf(pre).unwrap();
        let mut out = Vec::new();
        p.split(text, &mut |w| out.push(w.to_string()));
        out
    };
    assert_eq!(pieces("gpt2", "Hi  there's 42\n\n x"), ["Hi", " ", " there", "'s", " 42", "\n\n", " x"]);
    assert_eq!(pieces("smollm", "ab 123 c"), ["ab", " ", "1", "2", "3", " c"]);
    assert_eq!(pieces("llama-bpe", "It'S 12345!\n\n  ok"), ["It", "'S", " ", "123", "45", "!\n\n", " ", " ok"]);
    assert_eq!(pieces("qwen2", "x 12"), ["x", " ", "1", "2"]);
    assert_eq!(pieces("trailing", "a  "), ["a", "  "]);
    assert!(PreTokenizer::for_gguf("no-such-pre").unwrap().name().contains("fallback"));
}

#[test]
fn decode_never_panics_on_bad_ids() {
    let tok = hello();
    assert_eq!(tok.decode(&[byte(b'a'), 999_999, u32::MAX]), "a\u{FFFD}\u{FFFD}");
    assert_eq!(tok.token_bytes(999_999), None);
    // A lone continuation byte decodes lossily, not as a panic.
    assert_eq!(tok.decode(&[byte(0x80)]), "\u{FFFD}");
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let tok = hello();
    let mut s = tok.stream_decoder();
    let e_acute = "é".as_bytes();
    assert_eq!(s.push(byte(b'a')), "a");
    assert_eq!(s.push(byte(e_acute[0])), "");
    assert!(!s.is_clean());
    assert_eq!(s.push(byte(e_acute[1])), "é");
    // 0xFF can never start a character: replaced at once.
    assert_eq!(s.push(byte(0xFF)), "\u{FFFD}");
    assert_eq!(s.push(byte(0xE3)), "");
    assert_eq!(s.push(byte(b'x')), "\u{FFFD}x");
    assert_eq!(s.push(byte(0xF0)), "");
    assert_eq!(s.finish(), "\u{FFFD}");
    assert_eq!(s.push(1), "<|im_start|>");
    assert_eq!(s.push(u32::MAX), "\u{FFFD}");
}

#[test]
fn stream_decoder_works_over_an_arc() {
    let tok = std::sync::Arc::new(hello());
    let mut s = StreamDecoder::new(tok.clone());
    let ids = tok.encode("hello wörld", false);
    let text: String = ids.iter().map(|&i| s.push(i)).collect::<String>() + &s.finish();
    assert_eq!(text, "hello wörld");
}

#[test]
fn huge_inputs_stay_fast_and_exact() {
    let tok = hello();
    for text in ["a".repeat(200_000), " ".repeat(200_000), "\u{1F680}".repeat(50_000)] {
        let start = std::time::Instant::now();
        let ids = tok.encode(&text, true);
        assert_eq!(tok.decode(&ids), text);
        assert!(start.elapsed().as_secs() < 5, "{} bytes took {:?}", text.len(), start.elapsed());
    }
}

#[test]
fn ignore_merges_takes_whole_words_for_llama3() {
    // `abc` is a token but the merges only build `ab`.
    let mut t = Tiny { pre: "llama-bpe", merges: &[("a", "b")], not_tokens: &[] };
    let mut h = t.header();
    if let Some(MetaValue::Array(tokens)) = h.get_mut("tokenizer.ggml.tokens") {
        tokens.push(MetaValue::Str("abc".into()));
        if let Some(MetaValue::Array(types)) = h.get_mut("tokenizer.ggml.token_type") {
            types.push(MetaValue::I32(1));
        }
    }
    let llama = Tokenizer::from_gguf(&h).unwrap();
    assert_eq!(llama.encode("abc", false), vec![llama.token_id("abc").unwrap()]);
    assert!(llama.add_bos(), "Llama 3 adds BOS by default");
    assert_eq!(llama.encode_with_bos("abc", false)[0], 1);
    t.pre = "gpt2";
    let gpt2 = t.build();
    assert_eq!(gpt2.encode("abc", false), vec![gpt2.token_id("ab").unwrap(), byte(b'c')]);
    assert!(!gpt2.add_bos());
}

#[test]
fn gguf_errors_are_reported() {
    let with = |edit: &dyn Fn(&mut Header)| {
        let mut h = Tiny { pre: "gpt2", merges: HELLO, not_tokens: &[] }.header();
        edit(&mut h);
        Tokenizer::from_gguf(&h)
    };
    let set = |k: &'static str, v: MetaValue| {
        move |h: &mut Header| {
            h.insert(k.into(), v.clone());
        }
    };
    let r = with(&set("tokenizer.ggml.model", MetaValue::Str("bert".into())));
    assert!(matches!(r, Err(TokenizerError::Unsupported(_))));
    let message = r.unwrap_err().to_string();
    assert!(message.contains("`bert`") && message.contains("gpt2") && message.contains("llama"), "{message}");
    let r = with(&|h: &mut Header| {
        h.remove("tokenizer.ggml.merges");
    });
    assert!(matches!(r, Err(TokenizerError::MissingKey(_))));
    let r = with(&set("tokenizer.ggml.bos_token_id", MetaValue::U32(1_000_000)));
    assert!(matches!(r, Err(TokenizerError::IdOutOfRange { .. })));
    let r = with(&set("tokenizer.ggml.merges", strs(vec!["nospace".into()])));
    assert!(matches!(r, Err(TokenizerError::Invalid(_))));
    let r = with(&set("tokenizer.ggml.tokens", MetaValue::Array(vec![MetaValue::U8(1)])));
    assert!(matches!(r, Err(TokenizerError::Invalid(_))));
}

/// A scratch directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("pdserve-tok-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `hello` vocabulary as tokenizer.json, merges in both spellings, with the
/// Llama 3 style Split + ByteLevel pre-tokenizer and a BOS-adding post-processor.
fn hello_json() -> String {
    let tiny = Tiny { pre: "gpt2", merges: HELLO, not_tokens: &[] };
    let vocab: serde_json::Map<String, serde_json::Value> =
        tiny.tokens().into_iter().zip(0u32..).map(|(t, i)| (t, i.into())).collect();
    let merges: Vec<serde_json::Value> = HELLO
        .iter()
        .enumerate()
        .map(|(i, (a, b))| {
            let (a, b) = (map(a.as_bytes()), map(b.as_bytes()));
            if i % 2 == 0 {
                format!("{a} {b}").into()
            } else {
                serde_json::json!([a, b])
            }
        })
        .collect();
    let added: Vec<serde_json::Value> = SPECIALS
        .iter()
        .zip(0..)
        .map(|(s, i)| serde_json::json!({"id": i, "content": s, "special": true, "rstrip": i == 1}))
        .collect();
    serde_json::json!({
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": false}
    })
    .to_string()
}

#[test]
fn loads_tokenizer_json_like_gguf() {
    let dir = TempDir::new("json");
    let tok = Tokenizer::from_json_file(&dir.write("tokenizer.json", &hello_json())).unwrap();
    let gguf = hello();
    for text in ["hello world", "hello  world 1234", "<|im_start|>  hello<|im_end|>"] {
        let want = gguf.encode(&text.replace("<|im_start|>  ", "<|im_start|>"), true);
        assert_eq!(tok.encode(text, true), want, "{text:?} (rstrip eats the spaces)");
    }
    assert_eq!(tok.bos_id(), Some(1));
    assert!(tok.add_bos());
    assert_eq!(tok.eos_id(), None);
    let cfg = r#"{"add_bos_token": false, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#;
    let tok = tok.with_config_file(&dir.write("tokenizer_config.json", cfg)).unwrap();
    assert_eq!((tok.bos_id(), tok.eos_id(), tok.add_bos()), (Some(1), Some(2), false));
    assert_eq!(tok.chat_template(), Some("D"));
    assert_eq!(tok.eog_ids(), &[0, 2]);
}

#[test]
fn sibling_chat_template_file_is_used() {
    let dir = TempDir::new("sibling");
    let tok = Tokenizer::from_json_file(&dir.write("tokenizer.json", &hello_json())).unwrap();
    dir.write("chat_template.jinja", "J");
    let tok = tok.with_config_file(&dir.write("tokenizer_config.json", "{}")).unwrap();
    assert_eq!(tok.chat_template(), Some("J"));
}

#[test]
fn bad_tokenizer_json_is_an_error() {
    let dir = TempDir::new("bad");
    let load = |text: &str| Tokenizer::from_json_file(&dir.write("t.json", text));
    assert!(matches!(load("{not json"), Err(TokenizerError::Json { .. })));
    assert!(matches!(load(r#"{"model": {}}"#), Err(TokenizerError::Json { .. })));
    let wordpiece = r#"{"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": {"type": "ByteLevel"}}"#;
    assert!(matches!(load(wordpiece), Err(TokenizerError::Unsupported(_))));
    let sparse = r#"{"model": {"type": "BPE", "vocab": {"a": 4000000000}}, "decoder": {"type": "ByteLevel"}}"#;
    assert!(matches!(load(sparse), Err(TokenizerError::Invalid(_))));
    let bad_re = r#"{"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "ByteLevel"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated"}}"#;
    assert!(matches!(load(bad_re), Err(TokenizerError::Regex { .. })));
    let missing = Tokenizer::from_json_file(&dir.0.join("absent.json"));
    assert!(matches!(missing, Err(TokenizerError::Io { .. })));
}

proptest! {
    #[test]
    fn any_text_round_trips(text in "\\PC{0,40}|[ \\n\\t<|>a-z0-9]{0,40}") {
        let tok = hello();
        prop_assert_eq!(tok.decode(&tok.encode(&text, true)), text.clone());
        prop_assert_eq!(tok.decode(&tok.encode(&text, false)), text);
    }

    #[test]
    fn streaming_equals_decode(ids in proptest::collection::vec(0u32..300, 0..40)) {
        let tok = hello();
        let mut s = tok.stream_decoder();
        let streamed: String = ids.iter().map(|&i| s.push(i)).collect::<String>() + &s.finish();
        prop_assert_eq!(streamed, tok.decode(&ids));
    }
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<crate::chat::ChatTemplate>();
}
