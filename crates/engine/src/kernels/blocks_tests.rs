use super::*;
use crate::testing::random_blocks;
use pdserve_types::rng::Rng;

fn quantized_types() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|t| t.is_quantized())
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// (type, raw block, gguf-py's values) from `tests/data/quant_golden.json`.
fn golden() -> Vec<(DType, Vec<u8>, Vec<f32>)> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/quant_golden.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut out = Vec::new();
    for t in json["types"].as_array().unwrap() {
        let name = t["type"].as_str().unwrap();
        let dtype = DType::ALL.into_iter().find(|d| d.name() == name).unwrap_or_else(|| panic!("unknown {name}"));
        assert_eq!(Some(dtype.ggml_id()), t["ggml_id"].as_u64().map(|v| v as u32), "{name}");
        assert_eq!(Some(dtype.block_bytes()), t["block_bytes"].as_u64().map(|v| v as usize), "{name}");
        for b in t["blocks"].as_array().unwrap() {
            let raw = hex(b["raw"].as_str().unwrap());
            let values = hex(b["values_f32le"].as_str().unwrap())
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            out.push((dtype, raw, values));
        }
    }
    out
}

fn reference(dtype: DType, blk: &[u8]) -> Vec<f32> {
    let mut out = vec![f32::NAN; dtype.block_elems()];
    dequantize_block(dtype, blk, &mut out);
    out
}

/// Blocks to check every type on: the golden ones plus random ones with varied scales.
fn sample_blocks() -> Vec<(DType, Vec<u8>)> {
    let mut rng = Rng::new(17);
    let mut out: Vec<_> = golden().into_iter().map(|(t, raw, _)| (t, raw)).collect();
    for dtype in quantized_types() {
        for scale in [1e-3, 0.05, 1.0, 30.0] {
            let bytes = random_blocks(dtype, 8, scale, &mut rng);
            out.extend(bytes.chunks_exact(dtype.block_bytes()).map(|b| (dtype, b.to_vec())));
        }
    }
    out
}

/// Bit-for-bit: both sides take the same f32 operations in the same order (llama.cpp's),
/// and Rust neither fuses nor reorders them, so any difference would be a layout bug.
#[test]
fn matches_gguf_py_golden_values() {
    let golden = golden();
    for dtype in quantized_types() {
        assert!(golden.iter().any(|(t, ..)| *t == dtype), "no golden blocks for {dtype:?}");
    }
    for (i, (dtype, raw, want)) in golden.iter().enumerate() {
        assert_eq!(want.len(), dtype.block_elems());
        let got = reference(*dtype, raw);
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{dtype:?} golden block {i} value {j}: {g} vs gguf-py {w}");
        }
    }
}

#[test]
fn exact_types_decompose_into_the_reference_values() {
    for (dtype, blk) in sample_blocks().into_iter().filter(|(t, _)| is_exact(*t)) {
        let want = reference(dtype, &blk);
        let mut subs = vec![Sub::ZERO; dtype.block_elems() / QBLOCK];
        super::subs(dtype, &blk, &mut subs);
        let nibble = codes_of(dtype) == Some(Codes::Nibble);
        for (k, sub) in subs.iter().enumerate() {
            assert!(!nibble || sub.codes.iter().all(|&c| c < 16), "{dtype:?}: nibble code out of range");
            let got = sub.values();
            for (j, (g, w)) in got.iter().zip(&want[k * QBLOCK..]).enumerate() {
                // `==`, not bits: Q4_0's (q-8)·d gives -0 for a negative d where d·q - 8d gives +0.
                assert!(g == w, "{dtype:?} piece {k} value {j}: {g} vs {w}");
            }
            // Stored as f16: exact where d and m are an f16 times a power of two, else
            // rounded to nearest (half an f16 ulp, 2^-11 relative; 2^-25 absolute below
            // the normal range).
            let (d16, m16) = (f16::from_f32(sub.d).to_f32(), f16::from_f32(sub.m).to_f32());
            if matches!(dtype, DType::Q4_K | DType::Q5_K | DType::IQ4_XS) {
                let tol = |x: f32| x.abs() * 2f32.powi(-11) + 2f32.powi(-25);
                assert!((d16 - sub.d).abs() <= tol(sub.d) && (m16 - sub.m).abs() <= tol(sub.m), "{dtype:?}");
            } else {
                assert_eq!((d16, m16), (sub.d, sub.m), "{dtype:?}: scale not exact in f16");
            }
        }
    }
}

#[test]
fn per_16_types_requantize_within_half_a_step() {
    let mut checked = 0;
    for (dtype, blk) in sample_blocks().into_iter().filter(|(t, _)| !is_exact(*t)) {
        let want = reference(dtype, &blk);
        let mut subs = vec![Sub::ZERO; dtype.block_elems() / QBLOCK];
        super::subs(dtype, &blk, &mut subs);
        for (k, sub) in subs.iter().enumerate() {
            // d and m go into the matrix unchanged: d is already an f16, m = -128 d.
            assert_eq!(f16::from_f32(sub.d).to_f32(), sub.d);
            assert_eq!(sub.m, -128.0 * sub.d);
            let amax = want[k * QBLOCK..(k + 1) * QBLOCK].iter().fold(0f32, |a, v| a.max(v.abs()));
            let step = amax / 127.0;
            // amax/127 rounded up to an f16: at most one f16 ulp more.
            assert!(sub.d >= step && sub.d <= step * (1.0 + 2f32.powi(-10)) + 2f32.powi(-24), "{dtype:?}: {}", sub.d);
            for (g, w) in sub.values().iter().zip(&want[k * QBLOCK..]) {
                // Half a step, plus the f32 rounding of d·code + m.
                assert!((g - w).abs() <= sub.d * 0.5 + amax * 1e-6, "{dtype:?}: {g} vs {w} (d {})", sub.d);
            }
            checked += 1;
        }
    }
    assert!(checked > 3 * 8 * 4 * 8, "{checked}");
}

#[test]
fn q3_k_scales_unpack_to_sixteen_six_bit_values() {
    // Low nibbles from bytes 0..8, high two bits from bytes 8..12, minus 32.
    let mut b = [0u8; 12];
    b[0] = 0x21; // scales 0 (low 1) and 8 (low 2)
    b[8] = 0b1110_0111; // high bits of scales 0 (3), 4 (1), 8 (2), 12 (3)
    let s = q3k_scales(&b);
    assert_eq!(s[0], (1 | 3 << 4) - 32);
    assert_eq!(s[8], (2 | 2 << 4) - 32);
    assert_eq!(s[4], (1 << 4) - 32);
    assert_eq!(s[12], (3 << 4) - 32);
    assert_eq!(s[1], -32);
}
