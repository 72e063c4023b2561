//! Trace replay in the Mooncake format: one JSON object per line,
//! `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]}`.
//!
//! `hash_ids` (optional) name the prompt's blocks of `block_size` tokens (Mooncake
//! uses 512): a hash id always expands to the same tokens, so two rows that share
//! leading hash ids share that prefix, and a prefix cache sees what production saw.
//! The prompt is the blocks in order, cut to `input_length`; if the blocks are too
//! short, the rest is random tokens unique to the row.

use crate::error::BenchError;
use crate::prompt::{Prompt, TokenRange};
use crate::rng::{mix, Rng};
use std::path::Path;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct TraceRow {
    /// Arrival time in milliseconds (any origin; replay starts at the first row).
    pub timestamp: f64,
    pub input_length: u32,
    pub output_length: u32,
    #[serde(default)]
    pub hash_ids: Option<Vec<u64>>,
}

/// Reads a trace file.
pub fn load(path: &Path) -> Result<Vec<TraceRow>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    parse(&text, &path.display().to_string())
}

/// Parses trace text (`name` is used in errors). Rows are sorted by timestamp.
pub fn parse(text: &str, name: &str) -> Result<Vec<TraceRow>, BenchError> {
    let mut rows = crate::jsonl::parse(text, name, "the trace has no rows", |line| {
        let row: TraceRow = serde_json::from_str(line).map_err(|e| format!("not a trace row: {e}"))?;
        check(&row)?;
        Ok(row)
    })?;
    rows.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(rows)
}

fn check(row: &TraceRow) -> Result<(), String> {
    if !(row.timestamp.is_finite() && row.timestamp >= 0.0) {
        return Err(format!("timestamp {} is not a non-negative number of milliseconds", row.timestamp));
    }
    if row.input_length == 0 || row.output_length == 0 {
        return Err("input_length and output_length must be at least 1".into());
    }
    Ok(())
}

/// The fixed tokens of one hash block.
pub fn block_tokens(hash_id: u64, block_size: usize, range: TokenRange, seed: u64) -> Vec<u32> {
    range.random_ids(&mut Rng::new(mix(&[seed, 0xb10c, hash_id])), block_size)
}

impl TraceRow {
    /// The prompt of this row; `row_seed` fills what the hash blocks do not cover.
    pub fn prompt(&self, block_size: usize, range: TokenRange, seed: u64, row_seed: u64) -> Prompt {
        let want = self.input_length as usize;
        let mut ids = Vec::with_capacity(want);
        for &h in self.hash_ids.iter().flatten() {
            if ids.len() >= want {
                break;
            }
            ids.extend(block_tokens(h, block_size, range, seed));
        }
        ids.truncate(want);
        let rest = want - ids.len();
        ids.extend(range.random_ids(&mut Rng::new(row_seed), rest));
        Prompt { prefix: Vec::new(), body: ids }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [1, 2]}

{"timestamp": 50, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]}
{"timestamp": 20.5, "input_length": 30, "output_length": 5}
"#;

    #[test]
    fn good_trace_parses_sorted_with_optional_hash_ids() {
        let rows = parse(GOOD, "t.jsonl").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows.iter().map(|r| r.timestamp).collect::<Vec<_>>(), vec![0.0, 20.5, 50.0]);
        assert_eq!(rows[1].hash_ids, None);
        assert_eq!(rows[2].hash_ids, Some(vec![1, 3]));
    }

    #[test]
    fn bad_lines_name_the_file_and_line() {
        let cases = [
            ("{\"timestamp\": 0, \"input_length\": 5}\n", "t.jsonl:1: not a trace row"),
            ("\n{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 0}\n", "t.jsonl:2: input_length"),
            ("not json\n", "t.jsonl:1: not a trace row"),
            ("{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1}\n", "t.jsonl:1: timestamp -1"),
            ("\n\n", "the trace has no rows"),
        ];
        for (text, want) in cases {
            let e = parse(text, "t.jsonl").unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} does not contain {want:?}");
        }
    }

    #[test]
    fn equal_hash_ids_give_equal_prefixes() {
        let rows = parse(GOOD, "t").unwrap();
        let r = TokenRange::default();
        let (a, b) = (rows[0].prompt(512, r, 9, 100), rows[2].prompt(512, r, 9, 101));
        assert_eq!(a.len(), 700);
        assert_eq!(b.len(), 600);
        assert_eq!(a.body[..512], b.body[..512], "hash id 1 is shared");
        assert_ne!(a.body[512..600], b.body[512..600], "hash ids 2 and 3 differ");
        let c = rows[1].prompt(512, r, 9, 102);
        assert_eq!(c.len(), 30);
        assert_ne!(c.body[..], a.body[..30]);
    }

    #[test]
    fn blocks_are_deterministic_and_sized() {
        let r = TokenRange::default();
        assert_eq!(block_tokens(5, 16, r, 1), block_tokens(5, 16, r, 1));
        assert_ne!(block_tokens(5, 16, r, 1), block_tokens(6, 16, r, 1));
        assert_eq!(block_tokens(5, 16, r, 1).len(), 16);
    }
}
