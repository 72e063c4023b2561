use super::*;
use pdserve_types::rng::Rng;

/// The project's seeded generator, drawing what these tests need.
pub(crate) struct Lcg(Rng);
impl Lcg {
    pub fn new(seed: u64) -> Lcg {
        Lcg(Rng::new(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0.next_u64() >> 33
    }
    pub fn f32(&mut self) -> f32 {
        (self.0.next_f64() * 2.0 - 1.0) as f32
    }
}

pub(crate) fn random_gguf(dtype: DType, rows: usize, cols: usize, rng: &mut Lcg) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rows * cols / QBLOCK {
        let d = f16::from_f32(0.01 + 0.02 * rng.f32().abs());
        out.extend_from_slice(&d.to_le_bytes());
        match dtype {
            DType::Q4_1 => {
                out.extend_from_slice(&f16::from_f32(-0.1 * rng.f32().abs()).to_le_bytes());
                (0..16).for_each(|_| out.push(rng.next() as u8));
            }
            DType::Q4_0 => (0..16).for_each(|_| out.push(rng.next() as u8)),
            _ => (0..32).for_each(|_| out.push(rng.next() as u8)),
        }
    }
    out
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
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let (rows, cols, t) = (37, 96, 3);
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
            // 8-bit activations: error well under 1% of Σ|w·x|.
            assert!((g - w).abs() < 0.01 * s, "{dtype:?}: {g} vs {w} (scale {s})");
        }
    }
}

#[test]
fn simd_is_bit_identical_to_scalar() {
    let mut rng = Lcg::new(11);
    for isa in Isa::available() {
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for (rows, cols, t) in [(16, 32, 1), (45, 160, 5), (64, 576, 9)] {
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
}
