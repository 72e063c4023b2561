use super::gguf::{GgufHeader, MetaValue};
use super::gguf_write::GgufWriter;
use super::{DType, FormatError};
use proptest::prelude::*;

fn sample_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("llama".into()))
        .meta("llama.block_count", MetaValue::U32(2))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(vec![MetaValue::Str("a".into()), MetaValue::Str("b".into())]))
        .f32_tensor("x", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
        .tensor("q", DType::Q8_0, &[1, 32], vec![7u8; 34]);
    w.to_bytes()
}

#[test]
fn round_trips_metadata_and_tensors() {
    let bytes = sample_file();
    let h = GgufHeader::parse(&bytes).unwrap();
    assert_eq!(h.version, 3);
    assert_eq!(h.get("llama.block_count").and_then(MetaValue::as_u64), Some(2));
    let x = h.tensor("x").unwrap();
    assert_eq!(x.shape, vec![2, 3]);
    assert_eq!(x.dtype, DType::F32);
    assert_eq!(&bytes[x.offset..x.offset + 4], &1.0f32.to_le_bytes());
    let q = h.tensor("q").unwrap();
    assert_eq!(q.n_bytes, 34);
    assert_eq!(q.offset % 32, 0);
}

#[test]
fn rejects_bad_magic_and_truncation() {
    let mut bytes = sample_file();
    assert!(matches!(GgufHeader::parse(b"nope"), Err(FormatError::BadMagic)));
    let q_end = GgufHeader::parse(&bytes).unwrap().tensor("q").unwrap().offset + 34;
    for cut in [3, 10, 30, 100, q_end - 1] {
        assert!(GgufHeader::parse(&bytes[..cut]).is_err(), "cut at {cut}");
    }
    bytes[4] = 9;
    assert!(matches!(GgufHeader::parse(&bytes), Err(FormatError::UnsupportedVersion(9))));
}

#[test]
fn rejects_unsupported_tensor_type() {
    let mut w = GgufWriter::new();
    w.tensor("k", DType::F32, &[4], vec![0; 16]);
    let mut bytes = w.to_bytes();
    // The type id sits right after the name, n_dims and one dim.
    let pos = 24 + 8 + 1 + 4 + 8;
    bytes[pos..pos + 4].copy_from_slice(&16u32.to_le_bytes()); // IQ2_XXS
    let err = GgufHeader::parse(&bytes).unwrap_err();
    assert!(err.to_string().contains("ggml type 16"), "{err}");
    assert!(err.to_string().contains("Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"), "{err}");
}

#[test]
fn dtype_ids_and_sizes() {
    for t in DType::ALL {
        assert_eq!(DType::from_ggml(t.ggml_id()), Some(t));
    }
    for id in [4, 5, 9, 15, 16, 21, 22, 24, 29, 31, 39] {
        assert_eq!(DType::from_ggml(id), None, "{id}");
    }
    assert_eq!(DType::Q4_K.storage_bytes(&[3, 512]), Some(3 * 2 * 144));
    assert_eq!(DType::Q6_K.storage_bytes(&[4, 128]), None, "half a block");
    assert_eq!(DType::IQ4_NL.storage_bytes(&[64]), Some(2 * 18));
}

#[test]
fn reads_256_value_blocks() {
    let mut w = GgufWriter::new();
    w.tensor("k", DType::Q5_K, &[2, 512], vec![1u8; 4 * 176]).tensor("x", DType::Q3_K, &[256], vec![2u8; 110]);
    let bytes = w.to_bytes();
    let h = GgufHeader::parse(&bytes).unwrap();
    let k = h.tensor("k").unwrap();
    assert_eq!((k.dtype, k.n_bytes), (DType::Q5_K, 4 * 176));
    let x = h.tensor("x").unwrap();
    assert_eq!(x.n_bytes, 110);
    assert!(GgufHeader::parse(&bytes[..x.offset + 109]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn never_panics_on_mutated_headers(flips in prop::collection::vec((0usize..400, any::<u8>()), 1..8)) {
        let mut bytes = sample_file();
        for (pos, val) in flips {
            let n = bytes.len();
            bytes[pos % n] = val;
        }
        let _ = GgufHeader::parse(&bytes);
    }

    #[test]
    fn never_panics_on_random_bytes(mut bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        if bytes.len() >= 8 {
            bytes[..4].copy_from_slice(b"GGUF");
            bytes[4..8].copy_from_slice(&3u32.to_le_bytes());
        }
        let _ = GgufHeader::parse(&bytes);
    }
}
