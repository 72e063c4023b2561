//! The tokenizer and chat template against llama.cpp's answers: the default model's
//! byte-level BPE (`crates/engine/tests/golden/smollm2-135m-q4_1.json`) and Gemma 3's
//! SentencePiece vocabulary (`crates/engine/tests/golden/gemma3-270m-q4_k_m.json`, llama.cpp's
//! outputs via llama-cpp-python 0.3.36). Every entry must match exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::chat::{ChatMessage, ChatTemplate};
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::models::{self, require_default_model};
use pdserve_engine::tokenizer::Tokenizer;
use serde::Deserialize;

const GOLDEN: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/smollm2-135m-q4_1.json"));
const GEMMA_GOLDEN: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/gemma3-270m-q4_k_m.json"));

#[derive(Deserialize)]
struct Golden {
    tokenize: Vec<TokenizeCase>,
    chat: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct TokenizeCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    prompt: String,
    /// The file's prompts all end with the assistant header.
    #[serde(default = "yes")]
    add_generation_prompt: bool,
}

fn yes() -> bool {
    true
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn golden() -> Result<Golden> {
    Ok(serde_json::from_str(GOLDEN)?)
}

/// Every case tokenizes (special tokens parsed) to its golden ids; the failures are
/// listed together.
fn assert_tokenizes_as_golden(tok: &Tokenizer, cases: &[TokenizeCase]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let got = tok.encode(&c.text, true);
            (got != c.ids).then(|| format!("{:?}\n  want {:?}\n  got  {:?}", c.text, c.ids, got))
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

fn tokenizer() -> Result<Tokenizer> {
    let gguf = GgufFile::open(&require_default_model())?;
    Ok(Tokenizer::from_gguf(&gguf.header)?)
}

#[test]
fn metadata_matches_the_model_card() {
    let tok = tokenizer().unwrap();
    assert_eq!(tok.vocab_size(), 49_152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(!tok.add_bos());
    assert_eq!(tok.pre_tokenizer(), "smollm");
    assert_eq!(tok.eog_ids(), &[0, 2]);
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.is_special(1) && !tok.is_special(504));
    assert_eq!(tok.token_bytes(504), Some(&b"The"[..]));
    assert!(tok.chat_template().is_some_and(|t| t.contains("<|im_start|>")));
}

#[test]
fn every_golden_tokenization_matches() {
    let tok = tokenizer().unwrap();
    let cases = golden().unwrap().tokenize;
    assert_tokenizes_as_golden(&tok, &cases);
}

#[test]
fn golden_texts_round_trip() {
    let tok = tokenizer().unwrap();
    for c in golden().unwrap().tokenize {
        assert_eq!(tok.decode(&tok.encode(&c.text, true)), c.text);
        assert_eq!(tok.decode(&c.ids), c.text);
    }
}

#[test]
fn stream_decoder_reproduces_decode_one_id_at_a_time() {
    let tok = tokenizer().unwrap();
    let multibyte = golden().unwrap().tokenize.into_iter().filter(|c| !c.text.is_ascii());
    let mut seen = 0;
    for c in multibyte {
        let mut stream = tok.stream_decoder();
        let mut text = String::new();
        for &id in &c.ids {
            let piece = stream.push(id);
            assert!(!piece.contains('\u{FFFD}'), "{:?}: a character was split", c.text);
            text.push_str(&piece);
        }
        text.push_str(&stream.finish());
        assert_eq!(text, tok.decode(&c.ids));
        seen += 1;
    }
    assert!(seen >= 3, "expected the Japanese, emoji and accented cases");
}

#[test]
fn every_golden_chat_prompt_matches() {
    let tok = tokenizer().unwrap();
    let template = ChatTemplate::for_tokenizer(&tok).expect("model template compiles");
    for c in golden().unwrap().chat {
        let got = template.render(&c.messages, c.add_generation_prompt).expect("renders");
        assert_eq!(got, c.prompt);
    }
}

#[test]
fn chat_prompt_tokenizes_with_specials() {
    let tok = tokenizer().unwrap();
    let template = ChatTemplate::for_tokenizer(&tok).unwrap();
    let prompt = template.render(&[ChatMessage::new("user", "What is the capital of France?")], true).unwrap();
    let ids = tok.encode_with_bos(&prompt, true);
    // The model card's count for this prompt, starting <|im_start|> "system" "\n".
    assert_eq!(ids.len(), 37);
    assert_eq!(&ids[..3], &[1, 9690, 198]);
}

#[test]
fn encodes_a_long_prompt_quickly() {
    let tok = tokenizer().unwrap();
    let text = golden().unwrap().tokenize.iter().map(|c| c.text.as_str()).collect::<Vec<_>>().join(" ").repeat(10);
    let start = std::time::Instant::now();
    let ids = tok.encode(&text, true);
    let took = start.elapsed();
    eprintln!("encoded {} tokens in {took:?}", ids.len());
    assert!(ids.len() > 2000, "{} tokens", ids.len());
    // Generous for debug builds and a loaded machine; release runs are far below.
    assert!(took.as_millis() < 200, "{} tokens took {took:?}", ids.len());
}

/// The `tokenize` cases of the Gemma file (it has no chat template, so no `chat`).
#[derive(Deserialize)]
struct GemmaGolden {
    tokenize: Vec<TokenizeCase>,
}

fn gemma_cases() -> Vec<TokenizeCase> {
    serde_json::from_str::<GemmaGolden>(GEMMA_GOLDEN).unwrap().tokenize
}

/// Gemma 3's tokenizer, loaded once: 262,144 pieces. Panics (never skips) when the
/// model has not been pulled.
fn gemma() -> &'static Tokenizer {
    static TOKENIZER: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let path = models::cached(models::known("gemma3-270m").expect("gemma3-270m is a known model"));
        assert!(path.exists(), "Gemma 3 270M missing at {}: run `pdserve pull gemma3-270m` first", path.display());
        let gguf = GgufFile::open(&path).unwrap();
        Tokenizer::from_gguf(&gguf.header).unwrap()
    })
}

#[test]
fn gemma_metadata_matches_the_file() {
    let tok = gemma();
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)));
    assert!(tok.add_bos());
    assert_eq!(tok.pre_tokenizer(), "spm");
    assert_eq!(tok.eog_ids(), &[1, 106], "<eos> and <end_of_turn>");
    assert_eq!(tok.token_id("<start_of_turn>"), Some(105));
    assert!(tok.is_special(105) && !tok.is_special(818));
    // `▁capital` decodes with a space; `<0x00>` is one byte; `The` is a piece.
    assert_eq!(tok.token_bytes(5279), Some(&b" capital"[..]));
    assert_eq!(tok.token_bytes(238), Some(&[0u8][..]));
    assert_eq!(tok.token_id("The"), Some(818));
    assert_eq!(tok.token_text(106).as_deref(), Some("<end_of_turn>"));
    assert!(tok.chat_template().is_none());
}

#[test]
fn gemma_every_golden_tokenization_matches() {
    let tok = gemma();
    let cases = gemma_cases();
    assert_eq!(cases.len(), 27);
    assert_tokenizes_as_golden(tok, &cases);
    let bos = tok.encode_with_bos("The capital of France is", true);
    assert_eq!(bos, [2, 818, 5279, 529, 7001, 563]);
}

#[test]
fn gemma_golden_texts_round_trip() {
    let tok = gemma();
    for c in gemma_cases() {
        assert_eq!(tok.decode(&tok.encode(&c.text, true)), c.text);
        assert_eq!(tok.decode(&c.ids), c.text);
    }
}

#[test]
fn gemma_stream_decoder_reproduces_decode_one_id_at_a_time() {
    let tok = gemma();
    // The golden texts with non-ASCII or control characters, and characters Gemma has
    // no piece for, which go out as `<0xNN>` byte tokens.
    let mut texts: Vec<String> =
        gemma_cases().into_iter().map(|c| c.text).filter(|t| !t.is_ascii() || t.contains('\0')).collect();
    texts.push("runes ᚠ and 𓀀 hieroglyphs, 𝔘 fraktur".into());
    let mut byte_tokens = 0;
    for text in &texts {
        let ids = tok.encode(text, true);
        byte_tokens +=
            ids.iter().filter(|&&id| tok.token_kind(id) == Some(pdserve_engine::tokenizer::TokenKind::Byte)).count();
        let mut stream = tok.stream_decoder();
        let mut out = String::new();
        for &id in &ids {
            let piece = stream.push(id);
            assert!(!piece.contains('\u{FFFD}'), "{text:?}: a character was split");
            out.push_str(&piece);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, *text);
        assert_eq!(out, tok.decode(&ids));
    }
    assert!(texts.len() >= 6 && byte_tokens >= 12, "{} texts, {byte_tokens} byte tokens", texts.len());
}

#[test]
fn gemma_encodes_a_long_prompt_quickly() {
    let tok = gemma();
    let words = "The quick brown fox jumps over the lazy dog while naïve robots compute 3.14159 digits; ";
    let text = words.repeat(150);
    assert!(text.split_whitespace().count() >= 2000);
    let start = std::time::Instant::now();
    let ids = tok.encode(&text, true);
    let took = start.elapsed();
    eprintln!(
        "encoded {} words ({} bytes) into {} tokens in {took:?}",
        text.split_whitespace().count(),
        text.len(),
        ids.len()
    );
    assert_eq!(tok.decode(&ids), text);
    // Generous for a loaded machine; a quiet one takes a few milliseconds.
    assert!(took.as_millis() < 200, "{} tokens took {took:?}", ids.len());
}
