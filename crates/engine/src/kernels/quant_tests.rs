use super::*;
use pdserve_types::rng::Rng;

/// The project's seeded generator, drawing what these tests need.
pub(crate) struct Lcg(Rng);
impl Lcg {
    pub fn new(seed: u64) -> Lcg {
        Lcg(Rng::new(seed))
    }
    pub fn f32(&mut self) -> f32 {
        (self.0.next_f64() * 2.0 - 1.0) as f32
    }
}

/// Random blocks of `dtype` for a `rows × cols` matrix: random codes, scales that keep
/// weights within about ±1.
pub(crate) fn random_gguf(dtype: DType, rows: usize, cols: usize, rng: &mut Lcg) -> Vec<u8> {
    crate::testing::random_blocks(dtype, rows * cols / dtype.block_elems(), 1.0, &mut rng.0)
}

/// Every quantized type pdserve loads.
fn quantized_types() -> impl Iterator<Item = DType> {
    DType::ALL.into_iter().filter(|t| t.is_quantized())
}

fn reference(dtype: DType, bytes: &[u8], rows: usize, cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    let mut w = vec![0f32; rows * cols];
    dequantize_row(dtype, bytes, &mut w);
    (0..t)
        .flat_map(|ti| {
            let xr = &x[ti * cols..(ti + 1) * cols];
            let w = &w;
            (0..rows).map(move |r| w[r * cols..(r + 1) * cols].iter().zip(xr).map(|(a, b)| a * b).sum())
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn run(isa: Isa, m: &QuantMatrix, acts: &QuantActs) -> Vec<f32> {
    let mut out = vec![0f32; acts.rows * m.rows];
    let view = OutRows::new(&mut out, acts.rows, m.rows);
    matmul(isa, m, acts, 0..m.groups(), &view);
    out
}

#[test]
fn scalar_matches_dequantized_reference() {
    let mut rng = Lcg::new(7);
    for dtype in quantized_types() {
        let (rows, cols, t) = (37, 512, 3);
        let bytes = random_gguf(dtype, rows, cols, &mut rng);
        let m = QuantMatrix::from_gguf(dtype, rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..t * cols).map(|_| rng.f32()).collect();
        let mut acts = QuantActs::default();
        acts.quantize(&x, t, cols);
        let got = run(Isa::Scalar, &m, &acts);
        let want = reference(dtype, &bytes, rows, cols, &x, t);
        let xabs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let mut wabs = vec![0f32; rows * cols];
        dequantize_row(dtype, &bytes, &mut wabs);
        wabs.iter_mut().for_each(|v| *v = v.abs());
        let scale = reference(DType::F32, &f32_bytes(&wabs), rows, cols, &xabs, t);
        for ((g, w), s) in got.iter().zip(&want).zip(&scale) {
            // 8-bit activations: error well under 1% of Σ|w·x|. Re-quantized weights
            // (Q2_K, Q3_K, Q6_K) add at most half a step of 1/127 of each 32-block's
            // largest weight, far less than that.
            assert!((g - w).abs() < 0.01 * s, "{dtype:?}: {g} vs {w} (scale {s})");
        }
    }
}

#[test]
fn simd_is_bit_identical_to_scalar() {
    let mut rng = Lcg::new(11);
    for isa in Isa::available() {
        for dtype in quantized_types() {
            for (rows, cols, t) in [(16, 256, 1), (45, 512, 5), (64, 768, 9)] {
                let bytes = random_gguf(dtype, rows, cols, &mut rng);
                let m = QuantMatrix::from_gguf(dtype, rows, cols, &bytes).unwrap();
                let x: Vec<f32> = (0..t * cols).map(|_| rng.f32() * 3.0).collect();
                let mut acts = QuantActs::default();
                acts.quantize(&x, t, cols);
                let want = run(Isa::Scalar, &m, &acts);
                assert_eq!(run(isa, &m, &acts), want, "{isa} {dtype:?} {rows}x{cols} t={t}");
            }
        }
    }
}

#[test]
fn rows_do_not_depend_on_batch() {
    let mut rng = Lcg::new(3);
    let (rows, cols) = (48, 256);
    let bytes = random_gguf(DType::Q4_1, rows, cols, &mut rng);
    let m = QuantMatrix::from_gguf(DType::Q4_1, rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..7 * cols).map(|_| rng.f32()).collect();
    let mut all = QuantActs::default();
    all.quantize(&x, 7, cols);
    let batched = run(Isa::detect(), &m, &all);
    for t in 0..7 {
        let mut one = QuantActs::default();
        one.quantize(&x[t * cols..(t + 1) * cols], 1, cols);
        assert_eq!(run(Isa::detect(), &m, &one), batched[t * rows..(t + 1) * rows]);
    }
}

#[test]
fn repack_rejects_bad_shapes() {
    assert!(QuantMatrix::from_gguf(DType::Q4_1, 2, 33, &[0; 40]).is_err());
    assert!(QuantMatrix::from_gguf(DType::Q4_1, 2, 32, &[0; 39]).is_err());
    assert!(QuantMatrix::from_gguf(DType::F32, 1, 32, &[0; 128]).is_err());
    assert!(QuantMatrix::from_gguf(DType::Q4_K, 1, 128, &[0; 72]).is_err(), "half a block");
    assert!(QuantMatrix::from_gguf(DType::Q6_K, 1, 256, &[0; 210]).is_ok());
}

/// The repacked matrix holds each piece's codes and f16 scales: reading them back gives
/// the reference weights, exactly for Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/IQ4_NL, within the f16
/// rounding of the folded scales for Q4_K/Q5_K/IQ4_XS, and within half a re-quantization
/// step for Q2_K/Q3_K/Q6_K.
#[test]
fn repacked_weights_read_back_as_the_reference() {
    let mut rng = Lcg::new(5);
    for dtype in quantized_types() {
        let (rows, cols) = (21, 512);
        let bytes = random_gguf(dtype, rows, cols, &mut rng);
        let m = QuantMatrix::from_gguf(dtype, rows, cols, &bytes).unwrap();
        let mut want = vec![0f32; rows * cols];
        dequantize_row(dtype, &bytes, &mut want);
        let stride = m.codes.block_stride();
        for r in 0..rows {
            for b in 0..m.blocks() {
                let blk = &m.group_data(r / GROUP)[b * stride..(b + 1) * stride];
                let lane = r % GROUP;
                let d = f16x16(&blk[m.codes.payload_bytes()..])[lane];
                let mo = f16x16(&blk[m.codes.payload_bytes() + 32..])[lane];
                let w = &want[r * cols + b * QBLOCK..][..QBLOCK];
                let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (i, &wi) in w.iter().enumerate() {
                    let code = match m.codes {
                        Codes::Nibble => (blk[(i % 16 / 4) * 64 + lane * 4 + i % 4] >> (4 * (i / 16))) & 15,
                        Codes::Byte => blk[(i / 4) * 64 + lane * 4 + i % 4],
                    };
                    let got = d * code as f32 + mo;
                    let tol = match dtype {
                        DType::Q2_K | DType::Q3_K | DType::Q6_K => d * 0.5 + amax * 1e-6,
                        DType::Q4_K | DType::Q5_K | DType::IQ4_XS => (amax + mo.abs()) * 2f32.powi(-10),
                        _ => 0.0,
                    };
                    assert!((got - wi).abs() <= tol, "{dtype:?} row {r} block {b} value {i}: {got} vs {wi}");
                }
            }
        }
    }
}
