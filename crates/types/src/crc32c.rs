//! CRC-32C (Castagnoli), the checksum of every wire frame and of every block the
//! KV disk tier keeps.
//!
//! x86-64 computes it with the SSE4.2 `crc32` instruction, three independent streams
//! at a time (the instruction's latency is three times its throughput) joined by a
//! multiplication in GF(2); other hosts use a slice-by-8 table. Both give the same
//! value, which the tests check against the reference vector and each other.

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

/// `TABLES[k][b]`: the CRC register after byte `b` followed by `k` zero bytes.
static TABLES: [[u32; 256]; 8] = tables();

const fn tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut b = 0;
    while b < 256 {
        let mut c = b as u32;
        let mut i = 0;
        while i < 8 {
            c = if c & 1 == 1 { (c >> 1) ^ POLY } else { c >> 1 };
            i += 1;
        }
        t[0][b] = c;
        b += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut b = 0;
        while b < 256 {
            let prev = t[k - 1][b];
            t[k][b] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            b += 1;
        }
        k += 1;
    }
    t
}

/// The CRC-32C of `data`.
pub fn crc32c(data: &[u8]) -> u32 {
    !update(!0, data)
}

/// Advances the raw (not inverted) CRC register `crc` over `data`.
fn update(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("sse4.2") {
        // SAFETY: the CPU supports SSE4.2, checked just above.
        return unsafe { hw::update(crc, data) };
    }
    update_table(crc, data)
}

/// Slice-by-8: eight bytes per step through eight tables.
fn update_table(mut crc: u32, data: &[u8]) -> u32 {
    let (words, tail) = data.as_chunks::<8>();
    for w in words {
        let lo = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) ^ crc;
        let hi = u32::from_le_bytes([w[4], w[5], w[6], w[7]]);
        crc = TABLES[7][(lo & 0xff) as usize]
            ^ TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ TABLES[4][(lo >> 24) as usize]
            ^ TABLES[3][(hi & 0xff) as usize]
            ^ TABLES[2][((hi >> 8) & 0xff) as usize]
            ^ TABLES[1][((hi >> 16) & 0xff) as usize]
            ^ TABLES[0][(hi >> 24) as usize];
    }
    for &b in tail {
        crc = (crc >> 8) ^ TABLES[0][((crc ^ b as u32) & 0xff) as usize];
    }
    crc
}

/// `a · b mod P` over GF(2), both in the reflected bit order of the register.
fn gf_mul(a: u32, mut b: u32) -> u32 {
    let mut p = 0u32;
    let mut m = 1u32 << 31; // x^0 in reflected order
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        b = if b & 1 == 1 { (b >> 1) ^ POLY } else { b >> 1 };
        m >>= 1;
    }
    p
}

/// `x^(8·n) mod P`: multiplying a register by it shifts it over `n` zero bytes.
fn x_pow_bytes(n: usize) -> u32 {
    let mut result = 1u32 << 31; // 1
    let mut sq = 1u32 << 23; // x^8
    let mut n = n;
    while n > 0 {
        if n & 1 == 1 {
            result = gf_mul(result, sq);
        }
        sq = gf_mul(sq, sq);
        n >>= 1;
    }
    result
}

#[cfg(target_arch = "x86_64")]
mod hw {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    use std::sync::OnceLock;

    /// Bytes per stream in one three-stream block.
    const LANE: usize = 4096;

    fn lane_shift() -> u32 {
        static SHIFT: OnceLock<u32> = OnceLock::new();
        *SHIFT.get_or_init(|| super::x_pow_bytes(LANE))
    }

    /// # Safety
    /// The CPU must support SSE4.2.
    #[target_feature(enable = "sse4.2")]
    pub(super) unsafe fn update(mut crc: u32, data: &[u8]) -> u32 {
        let shift = lane_shift();
        let mut blocks = data.chunks_exact(3 * LANE);
        for block in &mut blocks {
            let (a, rest) = block.split_at(LANE);
            let (b, c) = rest.split_at(LANE);
            let (mut ca, mut cb, mut cc) = (crc as u64, 0u64, 0u64);
            let (a, b, c) = (a.as_chunks::<8>().0, b.as_chunks::<8>().0, c.as_chunks::<8>().0);
            for ((&wa, &wb), &wc) in a.iter().zip(b).zip(c) {
                ca = _mm_crc32_u64(ca, u64::from_le_bytes(wa));
                cb = _mm_crc32_u64(cb, u64::from_le_bytes(wb));
                cc = _mm_crc32_u64(cc, u64::from_le_bytes(wc));
            }
            // The register is linear: crc(x ‖ y) = crc(x) shifted over |y| ⊕ crc₀(y).
            let ab = super::gf_mul(ca as u32, shift) ^ cb as u32;
            crc = super::gf_mul(ab, shift) ^ cc as u32;
        }
        let (words, tail) = blocks.remainder().as_chunks::<8>();
        let mut c = crc as u64;
        for &w in words {
            c = _mm_crc32_u64(c, u64::from_le_bytes(w));
        }
        let mut crc = c as u32;
        for &b in tail {
            crc = _mm_crc32_u8(crc, b);
        }
        crc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_vectors() {
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    }

    #[test]
    fn every_path_agrees_with_the_table() {
        let data: Vec<u8> = (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [0, 1, 7, 8, 9, 4095, 12_288, 12_289, 12_300, 24_576 + 13, 40_000] {
            let d = &data[..len];
            assert_eq!(crc32c(d), !update_table(!0, d), "length {len}");
        }
    }

    #[test]
    fn shifting_by_zero_bytes_is_the_identity() {
        assert_eq!(x_pow_bytes(0), 1 << 31);
        assert_eq!(gf_mul(0x1234_5678, 1 << 31), 0x1234_5678);
    }
}
