//! Compute kernels: our own SIMD with run-time dispatch and a scalar reference for each.
//!
//! The quantized matmul is the hot path for every token. It always quantizes the
//! activations to 8 bits per 32-element block and computes integer dot products against
//! weights repacked 16 rows at a time ([`quant::QuantMatrix`]). Each output element is
//! produced by the same sequence of operations whatever the batch size, the tile or the
//! thread split, and the SIMD kernels perform exactly the scalar reference's operations
//! lane by lane, so results are bit-identical across batch shapes and ISAs. That is what
//! makes a sequence's tokens independent of what it is batched with.

pub mod attention;
mod attention_avx512;
pub mod blocks;
pub mod dense;
pub mod kv_quant;
pub mod ops;
pub mod quant;
mod quant_avx2;
mod quant_avx512;

use std::sync::OnceLock;

/// Resizes scratch `v` to `n` values, growing its allocation to exactly `n` where it
/// must grow (not the doubling `resize` does): a step's buffers then hold what its
/// largest step took, which `crate::model::step_bytes` counts for `pdserve split`.
pub fn fit<T: Clone + Default>(v: &mut Vec<T>, n: usize) {
    if n > v.capacity() {
        v.reserve_exact(n - v.len());
    }
    v.resize(n, T::default());
}

/// The instruction sets a kernel may be specialised for, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// No SIMD: the reference implementation, also the portable fallback.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL with VNNI.
    Avx512Vnni,
}

impl Isa {
    /// The best ISA this CPU supports. `PDSERVE_ISA=scalar|avx2|avx512` caps it, for
    /// testing the fallbacks on a machine that has more.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            let best = Self::hardware();
            match std::env::var("PDSERVE_ISA").as_deref() {
                Ok("scalar") => Isa::Scalar,
                Ok("avx2") => best.min(Isa::Avx2),
                _ => best,
            }
        })
    }

    #[cfg(target_arch = "x86_64")]
    fn hardware() -> Isa {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") && has!("f16c") && has!("fma")
        {
            Isa::Avx512Vnni
        } else if has!("avx2") && has!("fma") && has!("f16c") {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn hardware() -> Isa {
        Isa::Scalar
    }

    /// Every ISA this CPU can run, for tests that compare them.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni].into_iter().filter(|i| *i <= Self::hardware()).collect()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512Vnni => "avx512-vnni",
        })
    }
}
