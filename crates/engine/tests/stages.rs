//! A model cut into pipeline stages computes what the whole model does, bit for bit:
//! each stage loads only its layers (the first the embeddings, the last the head), the
//! residual stream goes from one stage's pass to the next one's, and each stage keeps
//! the K/V of its own layers. Checked on the real default model (SmolLM2, 30 layers) and
//! Gemma 3 270M (18 layers, a global layer every sixth, so a cut can fall either side of
//! one), prefilled in chunks and then decoded greedily.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::config::ModelConfig;
use pdserve_engine::format::gguf::GgufFile;
use pdserve_engine::kernels::Isa;
use pdserve_engine::kvcache::KvStorage;
use pdserve_types::KvDtype;
use pdserve_engine::model::{ForwardScratch, LayerRange, Model, SeqBatch, StageOut};
use pdserve_engine::threadpool::ThreadPool;

const DECODE: usize = 8;

struct Stage {
    model: Model,
    kv: KvStorage,
    scratch: ForwardScratch,
}

fn stages(name: &str, cuts: &[(usize, usize)], n_blocks: usize) -> Vec<Stage> {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model(name)).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    cuts.iter()
        .map(|&(first, last)| {
            let model = Model::load_stage(&file, cfg.clone(), LayerRange { first, last }).unwrap();
            let kv = KvStorage::for_model(&model, n_blocks, 16, KvDtype::F16);
            Stage { model, kv, scratch: ForwardScratch::default() }
        })
        .collect()
}

/// Every logits row of a chunked prefill and a greedy decode, through `stages` in turn.
fn run(stages: &mut [Stage], prompt: &[u32], chunk: usize, blocks: &[u32]) -> Vec<Vec<f32>> {
    let pool = ThreadPool::new(1);
    let isa = Isa::detect();
    let (mut tokens, mut pos, mut out) = (prompt.to_vec(), 0, Vec::new());
    while out.len() < DECODE + prompt.len().div_ceil(chunk) {
        let n = if pos < prompt.len() { chunk.min(prompt.len() - pos) } else { 1 };
        let batch = [SeqBatch::plain(&tokens[pos..pos + n], pos, blocks, 1)];
        let (mut x, mut next) = (Vec::new(), None);
        for st in stages.iter_mut() {
            match st.model.forward_stage(isa, &pool, &batch, &x, &mut st.kv, &mut st.scratch, &mut |_, _| true) {
                Some(StageOut::Hidden(h)) => x = h.to_vec(),
                Some(StageOut::Logits(l)) => {
                    next = Some(argmax(l));
                    out.push(l.to_vec());
                }
                None => panic!("a stage stopped"),
            }
        }
        if pos + n >= prompt.len() {
            tokens.push(next.expect("the last stage yields logits"));
        }
        pos += n;
    }
    out
}

fn check(name: &str, total: usize, splits: &[&[(usize, usize)]], prompt: &[u32]) {
    let n_blocks = (prompt.len() + DECODE).div_ceil(16);
    let blocks: Vec<u32> = (0..n_blocks as u32).rev().collect();
    let mut whole = stages(name, &[(0, total - 1)], n_blocks);
    let expected = run(&mut whole, prompt, 7, &blocks);
    let whole_bytes = whole[0].model.weight_bytes();
    for split in splits {
        let mut parts = stages(name, split, n_blocks);
        let got = run(&mut parts, prompt, 7, &blocks);
        assert_eq!(got.len(), expected.len());
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(g == e, "{name} {split:?}: logits row {i} differs");
        }
        let held: usize = parts.iter().map(|p| p.model.weight_bytes()).sum();
        assert_eq!(held, whole_bytes, "{name} {split:?}: the stages together hold more than the model");
        assert!(parts.iter().all(|p| p.model.weight_bytes() < whole_bytes));
    }
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + (i * 7919) % 4000).collect()
}

#[test]
fn smollm2_in_two_and_three_stages_computes_the_whole_models_logits() {
    check("smollm2-135m", 30, &[&[(0, 14), (15, 29)], &[(0, 0), (1, 20), (21, 29)]], &prompt(40));
}

#[test]
fn gemma3_stages_cut_either_side_of_a_global_layer() {
    check("gemma3-270m", 18, &[&[(0, 5), (6, 17)], &[(0, 4), (5, 11), (12, 17)]], &prompt(33));
}

#[test]
fn a_stage_past_the_models_last_layer_is_refused() {
    let file = GgufFile::open(&pdserve_engine::models::require_known_model("smollm2-135m")).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let err = Model::load_stage(&file, cfg, LayerRange { first: 20, last: 30 }).err().unwrap();
    assert!(err.to_string().contains("past the model's last layer, 29"), "{err}");
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap() as u32
}
