//! The wire format of one KV frame: one block of one layer of one handoff.
//!
//! ```text
//! offset  size       field
//!      0     4       magic "PDKV"
//!      4     2       version (1)
//!      6     1       flags (0, or LOCAL: no checksum, shared memory only)
//!      7     1       dtype of K and V: 0 f16, 1 q8_0, 2 q4_0
//!      8     8       handoff id
//!     16     4       layer
//!     20     4       block index within the sequence
//!     24     4       n: 16-bit words in K, and in V
//!     28    2n       K as stored (f16 bits, or GGUF blocks), little-endian words
//!  28+2n    2n       V, likewise
//!  28+4n     4       CRC-32C of every byte before it (0 when LOCAL)
//! ```
//!
//! An f16 frame is byte for byte what the format was before it carried a dtype (the
//! flags were a little-endian u16 of at most 1), so the version stayed 1; a peer
//! that predates quantized caches refuses a quantized frame by its flags.
//!
//! Frames that cross a network carry the checksum. Frames written into a shared
//! memory segment on the same host may leave it out ([`FLAG_LOCAL`]): no wire stands
//! between sender and receiver, and the checksum would cost more than the copy.
//! [`decode`] accepts only checksummed frames, [`decode_reusing`] both when told the
//! frame came from shared memory.
//!
//! All integers are little-endian. [`decode`] checks everything before it allocates,
//! so no input, however corrupt, makes it panic or allocate more than
//! [`MAX_FRAME_BYTES`].

use crate::crc32c::crc32c;
use crate::HandoffId;
use pdserve_types::{KvDtype, KvFrame};

pub const MAGIC: [u8; 4] = *b"PDKV";
pub const VERSION: u16 = 1;
/// The frame was written into shared memory and carries no checksum.
pub const FLAG_LOCAL: u8 = 1;
pub const HEADER_BYTES: usize = 28;
pub const CHECKSUM_BYTES: usize = 4;
/// The largest encoded frame accepted (64 MiB); a block of a real model is far smaller.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// The most values K (and V) may hold.
pub const MAX_ELEMS: usize = (MAX_FRAME_BYTES - HEADER_BYTES - CHECKSUM_BYTES) / 4;

/// Bytes of an encoded frame whose K and V hold `elems` values each.
pub fn encoded_len_for(elems: usize) -> usize {
    HEADER_BYTES + 4 * elems + CHECKSUM_BYTES
}

/// One block of one layer: `n_kv_heads × block_size × head_dim` values each of K
/// and V in `dtype`'s stored form, as 16-bit words (see [`KvFrame`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub handoff: HandoffId,
    pub layer: u32,
    /// The block's index within the sequence (position / block size).
    pub index: u32,
    pub dtype: KvDtype,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unsupported frame version {0}")]
    Version(u16),
    #[error("unsupported frame flags {0:#x}")]
    Flags(u8),
    #[error("unknown KV dtype code {0}")]
    Dtype(u8),
    #[error("frame of {elems} values per K/V exceeds the limit of {MAX_ELEMS}")]
    TooLarge { elems: usize },
    #[error("K has {k} values but V has {v}")]
    Mismatched { k: usize, v: usize },
    #[error("frame is {actual} bytes, expected {expected}")]
    Length { expected: usize, actual: usize },
    #[error("checksum {actual:#010x} does not match {expected:#010x}")]
    Checksum { expected: u32, actual: u32 },
}

impl Frame {
    /// Wraps an engine frame for handoff `handoff`; the payloads move, not copy.
    pub fn from_kv(handoff: HandoffId, f: KvFrame) -> Frame {
        Frame { handoff, layer: f.layer, index: f.index, dtype: f.dtype, k: f.k, v: f.v }
    }

    /// The engine's frame, payloads moved.
    pub fn into_kv(self) -> KvFrame {
        KvFrame { layer: self.layer, index: self.index, dtype: self.dtype, k: self.k, v: self.v }
    }

    /// Bytes of K and V together.
    pub fn payload_bytes(&self) -> usize {
        2 * (self.k.len() + self.v.len())
    }

    /// Bytes of the encoded frame.
    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.payload_bytes() + CHECKSUM_BYTES
    }

    /// K and V agree in length and fit a frame.
    pub(crate) fn check(&self) -> Result<(), FrameError> {
        if self.k.len() != self.v.len() {
            return Err(FrameError::Mismatched { k: self.k.len(), v: self.v.len() });
        }
        if self.k.len() > MAX_ELEMS {
            return Err(FrameError::TooLarge { elems: self.k.len() });
        }
        Ok(())
    }

    /// Appends the encoded frame to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        self.check()?;
        let start = out.len();
        out.resize(start + self.encoded_len(), 0);
        self.write(&mut out[start..], true);
        Ok(())
    }

    /// Encodes the frame at the start of `out` and returns its length; `out` must
    /// hold [`Frame::encoded_len`] bytes.
    pub fn encode_to_slice(&self, out: &mut [u8]) -> Result<usize, FrameError> {
        self.encode_at(out, true)
    }

    /// [`Frame::encode_to_slice`] without the checksum, for a shared-memory slot.
    pub fn encode_local(&self, out: &mut [u8]) -> Result<usize, FrameError> {
        self.encode_at(out, false)
    }

    fn encode_at(&self, out: &mut [u8], checksum: bool) -> Result<usize, FrameError> {
        self.check()?;
        let len = self.encoded_len();
        let Some(out) = out.get_mut(..len) else {
            return Err(FrameError::Length { expected: len, actual: out.len() });
        };
        self.write(out, checksum);
        Ok(len)
    }

    /// Writes the frame into `out`, which is exactly `encoded_len` bytes.
    fn write(&self, out: &mut [u8], checksum: bool) {
        let n = self.k.len();
        let (header, rest) = out.split_at_mut(HEADER_BYTES);
        header[0..4].copy_from_slice(&MAGIC);
        header[4..6].copy_from_slice(&VERSION.to_le_bytes());
        let flags = if checksum { 0 } else { FLAG_LOCAL };
        header[6] = flags;
        header[7] = self.dtype.code();
        header[8..16].copy_from_slice(&self.handoff.0.to_le_bytes());
        header[16..20].copy_from_slice(&self.layer.to_le_bytes());
        header[20..24].copy_from_slice(&self.index.to_le_bytes());
        header[24..28].copy_from_slice(&(n as u32).to_le_bytes());
        let (k, rest) = rest.split_at_mut(2 * n);
        let (v, _) = rest.split_at_mut(2 * n);
        put_u16s(k, &self.k);
        put_u16s(v, &self.v);
        let body = out.len() - CHECKSUM_BYTES;
        let crc = if checksum { crc32c(&out[..body]) } else { 0 };
        out[body..].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Decodes one checksummed frame that fills `bytes` exactly.
pub fn decode(bytes: &[u8]) -> Result<Frame, FrameError> {
    let header = peek(bytes)?;
    if header.flags != 0 {
        return Err(FrameError::Flags(header.flags));
    }
    decode_into(bytes, header, Vec::new(), Vec::new())
}

/// Decodes one frame into `k` and `v` (buffers to reuse; their contents are
/// replaced). A [`FLAG_LOCAL`] frame, without checksum, is accepted only when
/// `local` says it was read from shared memory.
pub fn decode_reusing(bytes: &[u8], local: bool, k: Vec<u16>, v: Vec<u16>) -> Result<Frame, FrameError> {
    let header = peek(bytes)?;
    if header.flags != 0 && !local {
        return Err(FrameError::Flags(header.flags));
    }
    decode_into(bytes, header, k, v)
}

fn decode_into(bytes: &[u8], header: Header, mut k: Vec<u16>, mut v: Vec<u16>) -> Result<Frame, FrameError> {
    let n = header.elems;
    let expected = HEADER_BYTES + 4 * n + CHECKSUM_BYTES;
    if bytes.len() != expected {
        return Err(FrameError::Length { expected, actual: bytes.len() });
    }
    let (body, crc) = bytes.split_at(expected - CHECKSUM_BYTES);
    if header.flags & FLAG_LOCAL == 0 {
        let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        let actual = crc32c(body);
        if stored != actual {
            return Err(FrameError::Checksum { expected: stored, actual });
        }
    }
    let (k_bytes, v_bytes) = body[HEADER_BYTES..].split_at(2 * n);
    get_u16s(k_bytes, &mut k);
    get_u16s(v_bytes, &mut v);
    Ok(Frame { handoff: header.handoff, layer: header.layer, index: header.index, dtype: header.dtype, k, v })
}

/// The encoded length of the frame starting at `bytes`, read from its header.
pub(crate) fn encoded_len_at(bytes: &[u8]) -> Result<usize, FrameError> {
    Ok(HEADER_BYTES + 4 * peek(bytes)?.elems + CHECKSUM_BYTES)
}

/// The fixed header fields, checked for magic, version, flags and size but not yet
/// against the checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub handoff: HandoffId,
    pub layer: u32,
    pub index: u32,
    pub elems: usize,
    pub flags: u8,
    pub dtype: KvDtype,
}

pub(crate) fn peek(bytes: &[u8]) -> Result<Header, FrameError> {
    let Some(h) = bytes.get(..HEADER_BYTES) else {
        return Err(FrameError::Length { expected: HEADER_BYTES + CHECKSUM_BYTES, actual: bytes.len() });
    };
    let u16_at = |i: usize| u16::from_le_bytes([h[i], h[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    if u16_at(4) != VERSION {
        return Err(FrameError::Version(u16_at(4)));
    }
    let flags = h[6];
    if flags & !FLAG_LOCAL != 0 {
        return Err(FrameError::Flags(flags));
    }
    let dtype = KvDtype::from_code(h[7]).ok_or(FrameError::Dtype(h[7]))?;
    let elems = u32_at(24) as usize;
    if elems > MAX_ELEMS {
        return Err(FrameError::TooLarge { elems });
    }
    let handoff = HandoffId(u64::from(u32_at(8)) | u64::from(u32_at(12)) << 32);
    Ok(Header { handoff, layer: u32_at(16), index: u32_at(20), elems, flags, dtype })
}

// On little-endian hosts the payload's memory is its wire format: one `memcpy` each
// way (the per-value loops below compile to narrower copies, ~1.5x slower).
#[cfg(target_endian = "little")]
fn put_u16s(dst: &mut [u8], src: &[u16]) {
    // SAFETY: `u16` has no padding and any alignment suits `u8`; the view covers exactly
    // the `2 * src.len()` initialised bytes of `src`.
    let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), 2 * src.len()) };
    dst.copy_from_slice(bytes);
}

#[cfg(target_endian = "little")]
fn get_u16s(src: &[u8], dst: &mut Vec<u16>) {
    let n = src.len() / 2;
    dst.clear();
    dst.reserve(n);
    // SAFETY: `dst` has room for `n` values, every byte of which is written here before
    // `set_len` exposes them, and any bit pattern is a valid `u16`.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), 2 * n);
        dst.set_len(n);
    }
}

#[cfg(target_endian = "big")]
fn put_u16s(dst: &mut [u8], src: &[u16]) {
    for (d, s) in dst.as_chunks_mut::<2>().0.iter_mut().zip(src) {
        *d = s.to_le_bytes();
    }
}

#[cfg(target_endian = "big")]
fn get_u16s(src: &[u8], dst: &mut Vec<u16>) {
    dst.clear();
    dst.extend(src.as_chunks::<2>().0.iter().map(|&c| u16::from_le_bytes(c)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(elems: usize, seed: u16) -> Frame {
        Frame {
            handoff: HandoffId(0x0123_4567_89ab_cdef),
            layer: 7,
            index: 42,
            dtype: KvDtype::F16,
            k: (0..elems).map(|i| (i as u16).wrapping_mul(31).wrapping_add(seed)).collect(),
            v: (0..elems).map(|i| (i as u16).wrapping_mul(17) ^ seed).collect(),
        }
    }

    fn encode(f: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        f.encode_into(&mut out).unwrap();
        out
    }

    #[test]
    fn round_trip_of_a_real_block() {
        let f = frame(3 * 16 * 64, 5);
        let bytes = encode(&f);
        assert_eq!(bytes.len(), f.encoded_len());
        assert_eq!(bytes.len(), 28 + 4 * 3072 + 4);
        assert_eq!(decode(&bytes).unwrap(), f);
        let mut slot = vec![0xaau8; bytes.len() + 100];
        assert_eq!(f.encode_to_slice(&mut slot).unwrap(), bytes.len());
        assert_eq!(&slot[..bytes.len()], &bytes[..]);
        assert_eq!(decode_reusing(&bytes, false, vec![7; 3], Vec::new()).unwrap(), f);
    }

    #[test]
    fn local_frames_skip_the_checksum_and_only_decode_locally() {
        let f = frame(3 * 16 * 64, 9);
        let mut slot = vec![0u8; f.encoded_len()];
        f.encode_local(&mut slot).unwrap();
        assert_eq!((slot[6], slot[7]), (FLAG_LOCAL, 0));
        assert_eq!(&slot[slot.len() - 4..], &[0; 4]);
        assert_eq!(decode(&slot), Err(FrameError::Flags(FLAG_LOCAL)));
        assert_eq!(decode_reusing(&slot, false, Vec::new(), Vec::new()), Err(FrameError::Flags(FLAG_LOCAL)));
        assert_eq!(decode_reusing(&slot, true, Vec::new(), vec![1; 10_000]).unwrap(), f);
        // The header is still checked.
        slot[0] = b'X';
        assert!(matches!(decode_reusing(&slot, true, Vec::new(), Vec::new()), Err(FrameError::BadMagic(_))));
    }

    #[test]
    fn layout_is_little_endian() {
        let f = Frame {
            handoff: HandoffId(0x0102),
            layer: 3,
            index: 4,
            dtype: KvDtype::F16,
            k: vec![0x1122],
            v: vec![0x3344],
        };
        let b = encode(&f);
        assert_eq!(&b[..4], b"PDKV");
        assert_eq!(&b[8..10], &[0x02, 0x01]);
        assert_eq!(&b[28..32], &[0x22, 0x11, 0x44, 0x33]);
        assert_eq!(u32::from_le_bytes([b[32], b[33], b[34], b[35]]), crc32c(&b[..32]));
        // The dtype is byte 7; f16's code 0 keeps the earlier encoding.
        assert_eq!(b[6..8], [0, 0]);
        let q = encode(&Frame { dtype: KvDtype::Q4_0, ..f });
        assert_eq!(q[6..8], [0, 2]);
        assert_eq!(decode(&q).unwrap().dtype, KvDtype::Q4_0);
    }

    #[test]
    fn rejections() {
        let f = frame(64, 1);
        let good = encode(&f);
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(decode(&b), Err(FrameError::BadMagic(_))));
        let mut b = good.clone();
        b[4] = 9;
        assert_eq!(decode(&b), Err(FrameError::Version(9)));
        assert!(matches!(decode(&good[..good.len() - 1]), Err(FrameError::Length { .. })));
        assert!(matches!(decode(&good[..10]), Err(FrameError::Length { .. })));
        let mut b = good.clone();
        b.push(0);
        assert!(matches!(decode(&b), Err(FrameError::Length { .. })));
        let mut b = good.clone();
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode(&b), Err(FrameError::TooLarge { .. })));
        let mut b = good.clone();
        b[7] = 3;
        assert_eq!(decode(&b), Err(FrameError::Dtype(3)));
        let mut b = good.clone();
        b[100] ^= 1;
        assert!(matches!(decode(&b), Err(FrameError::Checksum { .. })));
        let bad = Frame { v: vec![1], ..f };
        assert_eq!(bad.encode_into(&mut Vec::new()), Err(FrameError::Mismatched { k: 64, v: 1 }));
        assert!(matches!(frame(8, 0).encode_to_slice(&mut [0u8; 40]), Err(FrameError::Length { .. })));
    }

    #[test]
    fn engine_frames_convert_without_loss() {
        let kv = KvFrame { layer: 2, index: 9, dtype: KvDtype::Q8_0, k: vec![1, 2], v: vec![3, 4] };
        let f = Frame::from_kv(HandoffId(5), kv.clone());
        assert_eq!(f.payload_bytes(), 8);
        assert_eq!(f.into_kv(), kv);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn random_bytes_behind_a_valid_header_never_panic(
            tail in proptest::collection::vec(any::<u8>(), 0..256),
            elems in 0u32..80,
        ) {
            let mut bytes = encode(&frame(0, 0))[..HEADER_BYTES].to_vec();
            bytes[24..28].copy_from_slice(&elems.to_le_bytes());
            bytes.extend_from_slice(&tail);
            prop_assert!(decode(&bytes).is_err() || bytes.len() == HEADER_BYTES + 4 * elems as usize + 4);
        }

        #[test]
        fn single_byte_corruption_is_rejected(
            elems in 0usize..200,
            seed in any::<u16>(),
            at in any::<prop::sample::Index>(),
            flip in 1u8..=255,
        ) {
            let mut bytes = encode(&frame(elems, seed));
            let i = at.index(bytes.len());
            bytes[i] ^= flip;
            // CRC-32C catches every error burst up to 32 bits, so a changed byte never
            // decodes, not even to the original.
            prop_assert!(decode(&bytes).is_err());
        }

        #[test]
        fn round_trip(elems in 0usize..300, seed in any::<u16>(), layer in any::<u32>(), index in any::<u32>(), code in 0u8..3) {
            let f = Frame { layer, index, dtype: KvDtype::from_code(code).unwrap(), ..frame(elems, seed) };
            prop_assert_eq!(decode(&encode(&f)).unwrap(), f);
        }
    }
}
