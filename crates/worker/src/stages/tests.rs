use super::*;

fn parts() -> Vec<StagePart> {
    vec![
        StagePart { rows: 3, start_pos: 0, logits: 1, blocks: vec![7] },
        StagePart { rows: 1, start_pos: 40, logits: 1, blocks: vec![2, 9, 4] },
    ]
}

#[test]
fn a_step_call_decodes_to_what_was_encoded() {
    let x: Vec<f32> = (0..4 * 5).map(|i| i as f32 * 0.5 - 3.0).collect();
    let mut call = Vec::new();
    encode_step(&parts(), &x, &mut call);
    assert_eq!(call[0], STEP);
    let mut got = Vec::new();
    assert_eq!(decode_step(&call[1..], &mut got).unwrap(), parts());
    assert_eq!(got, x);
}

#[test]
fn a_cut_or_lying_call_is_refused_without_a_panic() {
    let mut call = Vec::new();
    encode_step(&parts(), &[1.0; 8], &mut call);
    let mut x = Vec::new();
    // No cut decodes to the whole step: it is refused, or it has fewer values than
    // its rows need (which the runner refuses by count).
    for end in 1..call.len() {
        if let Ok(p) = decode_step(&call[1..end], &mut x) {
            assert!(p != parts() || x.len() < 8, "cut at {end}");
        }
    }
    // A count of parts or blocks past what the bytes could hold.
    let mut lie = vec![];
    put_u32(&mut lie, 1 << 30);
    assert!(decode_step(&lie, &mut x).is_err());
    let mut lie = vec![];
    for v in [1, 1, 0, 1, 1 << 30] {
        put_u32(&mut lie, v);
    }
    assert!(decode_step(&lie, &mut x).is_err());
}

fn hello(layers: LayerRange, blocks: usize) -> StageHello {
    StageHello { layers, total_layers: 30, hidden: 576, vocab: 49152, blocks, model: "m.gguf".into() }
}

#[test]
fn a_stage_of_another_model_or_a_smaller_pool_does_not_join() {
    let head = hello(LayerRange { first: 0, last: 14 }, 100);
    let ok = hello(LayerRange { first: 15, last: 29 }, 100);
    assert_eq!(StageHello::decode(&ok.encode()).unwrap(), ok);
    assert_eq!(ok.mismatch(&head), None);
    let other = StageHello { model: "n.gguf".into(), ..ok.clone() };
    assert!(other.mismatch(&head).unwrap().contains("n.gguf"));
    let wider = StageHello { hidden: 1024, ..ok.clone() };
    assert!(wider.mismatch(&head).is_some());
    let small = hello(LayerRange { first: 15, last: 29 }, 99);
    assert!(small.mismatch(&head).unwrap().contains("fewer than the head's 100"));
}

fn frames() -> Vec<(u32, KvFrame)> {
    let f = |layer, block, dtype| {
        let k: Vec<u16> = (0..6).map(|i| (i * 1000 + layer) as u16).collect();
        let v = k.iter().map(|x| x ^ 0x8000).collect();
        (block, KvFrame { layer: layer as u32, index: block, dtype, k, v })
    };
    vec![f(12, 40, KvDtype::F16), f(13, 3, KvDtype::Q8_0)]
}

#[test]
fn frames_decode_to_what_was_encoded_and_a_cut_or_lie_is_refused() {
    let mut call = Vec::new();
    put_u32(&mut call, 2);
    frames().iter().for_each(|(b, f)| put_frame(&mut call, *b, f));
    assert_eq!(Reader(&call).frames().unwrap(), frames());
    for end in 0..call.len() {
        assert!(Reader(&call[..end]).frames().is_err(), "cut at {end}");
    }
    // More frames, or more words, than the bytes could hold.
    let mut lie = call.clone();
    lie[..4].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(Reader(&lie).frames().is_err());
    let mut lie = call.clone();
    lie[13..17].copy_from_slice(&(1u32 << 30).to_le_bytes());
    assert!(Reader(&lie).frames().is_err());
    // A K/V type nobody has.
    let mut lie = call;
    lie[12] = 200;
    assert!(Reader(&lie).frames().is_err());
}
