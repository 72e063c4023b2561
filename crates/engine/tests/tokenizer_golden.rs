//! The tokenizer and chat template against llama.cpp's answers on the default model
//! (`crates/engine/tests/golden/smollm2-135m-q4_1.json`): every entry must match exactly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::chat::{ChatMessage, ChatTemplate};
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::models::require_default_model;
use pdserve_engine::tokenizer::Tokenizer;
use serde::Deserialize;

const GOLDEN: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/smollm2-135m-q4_1.json"));

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
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| {
            let got = tok.encode(&c.text, true);
            (got != c.ids).then(|| format!("{:?}\n  want {:?}\n  got  {:?}", c.text, c.ids, got))
        })
        .collect();
    assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
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
