//! The tokenizers of the supported architectures against the test vocabularies
//! llama.cpp keeps with its sources (`models/ggml-vocab-*.gguf`, with texts in `.inp`
//! and the ids Hugging Face's tokenizers give them in `.out`): Llama 3's byte-level
//! BPE, Qwen 2 and 3's (their own pre-tokenizer), Phi-3's and Llama 2's SentencePiece.
//! `scripts/make_oracle.sh` copies them to target/oracle/vocab. Every text must give
//! exactly the listed ids.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::format::gguf::GgufHeader;
use pdserve_engine::tokenizer::Tokenizer;
use std::path::PathBuf;

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn vocab_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/oracle/vocab"))
}

/// `(text, ids)` pairs of one vocabulary's test file.
fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}; run scripts/make_oracle.sh", path.display()))
    };
    let inputs = read("inp");
    let texts: Vec<&str> = inputs.split(SEPARATOR).collect();
    let outputs = read("out");
    let ids: Vec<Vec<u32>> =
        outputs.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    // The input file ends with a separator, so its last piece is empty.
    assert_eq!(texts.len(), ids.len() + 1, "{name}: inputs and outputs do not pair up");
    texts.into_iter().zip(ids).map(|(t, i)| (t.to_string(), i)).collect()
}

fn tokenizer(name: &str) -> Tokenizer {
    let bytes = std::fs::read(vocab_dir().join(format!("ggml-vocab-{name}.gguf"))).unwrap();
    let header = GgufHeader::parse(&bytes).unwrap();
    Tokenizer::from_gguf(&header).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every text tokenizes as listed, special tokens not parsed and no BOS added (the
/// files' convention); the failures are listed together.
fn check(name: &str) {
    let tok = tokenizer(name);
    let cases = cases(name);
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(text, want)| {
            let got = tok.encode(text, false);
            (&got != want).then(|| format!("{text:?}\n  want {want:?}\n  got  {got:?}"))
        })
        .collect();
    eprintln!("{name}: {} of {} texts match", cases.len() - failures.len(), cases.len());
    assert!(failures.is_empty(), "{name}: {} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

#[test]
fn llama3_bpe_matches_llama_cpp() {
    check("llama-bpe");
}

#[test]
fn qwen2_and_qwen3_bpe_matches_llama_cpp() {
    check("qwen2");
}

#[test]
fn phi3_sentencepiece_matches_llama_cpp() {
    check("phi-3");
}

#[test]
fn llama2_sentencepiece_matches_llama_cpp() {
    check("llama-spm");
}
