//! Models split by llama.cpp's `llama-gguf-split` (`NAME-00001-of-00003.gguf`, ...):
//! opening the first part opens them all, and the model is the unsplit file's; a later
//! part, a missing part or a part of another split is a one-line error. The parts are
//! made by `scripts/make_oracle.sh` from the default model (target/oracle/split).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::format::TensorSource;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_engine::model::{ForwardScratch, Model, SeqBatch};
use pdserve_engine::threadpool::ThreadPool;
use std::path::{Path, PathBuf};

fn split_dir() -> PathBuf {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/oracle/split"));
    assert!(dir.join("smollm2-3-00001-of-00003.gguf").exists(), "{}: run scripts/make_oracle.sh", dir.display());
    dir
}

fn error_of(path: &Path) -> String {
    match GgufFile::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e.to_string(),
    }
}

fn logits(file: &GgufFile) -> Vec<f32> {
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let model = Model::load(file, cfg.clone()).unwrap();
    let mut kv = KvStorage::new(&cfg, 1, 16);
    let tokens = [504u32, 3458, 282, 4649, 314];
    let b = SeqBatch { tokens: &tokens, start_pos: 0, blocks: &[0], logits: 1, score: None, pool: None };
    let pool = ThreadPool::new(1);
    model
        .forward(Isa::detect(), &pool, &[b], &mut kv, &mut ForwardScratch::default(), &mut |_, _| true)
        .unwrap()
        .to_vec()
}

#[test]
fn the_first_part_opens_the_whole_model() {
    let whole = GgufFile::open(&pdserve_engine::models::require_default_model()).unwrap();
    let split = GgufFile::open(&split_dir().join("smollm2-3-00001-of-00003.gguf")).unwrap();
    assert_eq!(split.header.tensors.len(), whole.header.tensors.len());
    for t in &whole.header.tensors {
        let (a, b) = (whole.tensor(&t.name).unwrap(), split.tensor(&t.name).unwrap());
        assert_eq!((a.dtype, a.shape, a.bytes), (b.dtype, b.shape, b.bytes), "{}", t.name);
    }
    assert_eq!(ModelConfig::from_gguf(&split.header).unwrap(), ModelConfig::from_gguf(&whole.header).unwrap());
    assert_eq!(logits(&split), logits(&whole));
}

#[test]
fn a_later_part_says_which_to_open() {
    let e = error_of(&split_dir().join("smollm2-3-00002-of-00003.gguf"));
    assert!(e.contains("not the first part") && e.contains("00001-of-00003"), "{e}");
}

/// A directory holding links named `names`, to `targets` in the split directory.
fn linked(dir_name: &str, links: &[(&str, &str)]) -> PathBuf {
    let dir = pdserve_engine::testing::scratch_dir(dir_name).unwrap();
    for (name, target) in links {
        std::os::unix::fs::symlink(split_dir().join(target), dir.join(name)).unwrap();
    }
    dir
}

#[test]
fn a_missing_part_is_named() {
    let first = "smollm2-3-00001-of-00003.gguf";
    let dir =
        linked("split-missing", &[(first, first), ("smollm2-3-00003-of-00003.gguf", "smollm2-3-00003-of-00003.gguf")]);
    let e = error_of(&dir.join(first));
    assert!(e.contains("part 2 of 3") && e.contains("missing") && e.contains("smollm2-3-00002-of-00003.gguf"), "{e}");
}

#[test]
fn a_part_of_another_split_is_refused() {
    let first = "smollm2-3-00001-of-00003.gguf";
    let dir = linked(
        "split-foreign",
        &[
            (first, first),
            ("smollm2-3-00002-of-00003.gguf", "smollm2-2-00002-of-00002.gguf"),
            ("smollm2-3-00003-of-00003.gguf", "smollm2-3-00003-of-00003.gguf"),
        ],
    );
    let e = error_of(&dir.join(first));
    assert!(e.contains("is not part 2 of 3"), "{e}");
}
