//! Prompts of your own (`bench load --prompts FILE`): one JSON string per line, each
//! a whole prompt sent as text (the user message of a chat request, the `prompt` of a
//! completion), as vLLM's custom datasets are.
//!
//! Request `i` of sweep point `p` takes prompt `p × R + i` (modulo the file's length),
//! `R` being the requests a point sends at most, and the warm-up requests take the
//! file's last prompts: a file of at least `points × R + warm-up` prompts gives every
//! request its own, so no point finds an earlier one's prompt in the prefix cache.

use crate::error::BenchError;
use std::path::Path;
use std::sync::Arc;

/// Reads a prompts file.
pub fn load(path: &Path) -> Result<Vec<Arc<str>>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    parse(&text, &path.display().to_string())
}

/// Parses prompts text (`name` is used in errors); blank lines are skipped.
pub fn parse(text: &str, name: &str) -> Result<Vec<Arc<str>>, BenchError> {
    crate::jsonl::parse(text, name, "the file has no prompts", |line| {
        let prompt: String = serde_json::from_str(line).map_err(|e| format!("not a JSON string: {e}"))?;
        match prompt.is_empty() {
            true => Err("an empty prompt".into()),
            false => Ok(Arc::from(prompt)),
        }
    })
}

/// Which prompt request `index` of `point` takes (`u64::MAX` is the warm-up).
pub fn pick(n: usize, per_point: usize, point: u64, index: usize) -> usize {
    let n = n.max(1);
    match point {
        u64::MAX => n - 1 - index % n,
        p => (p as usize).wrapping_mul(per_point).wrapping_add(index) % n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_one_json_string_a_line() {
        let p = parse("\"one\"\n\n\"two\\nlines\"\n", "f").unwrap();
        assert_eq!(p.iter().map(|s| &**s).collect::<Vec<_>>(), ["one", "two\nlines"]);
        for (bad, why) in [("one\n", "f:1: not a JSON string"), ("\"a\"\n{\"x\":1}\n", "f:2: not a JSON string")] {
            assert!(parse(bad, "f").unwrap_err().to_string().starts_with(why), "{bad:?}");
        }
        assert_eq!(parse("\"\"\n", "f").unwrap_err().to_string(), "f:1: an empty prompt");
        assert_eq!(parse("\n", "f").unwrap_err().to_string(), "f:0: the file has no prompts");
    }

    #[test]
    fn points_and_the_warm_up_take_prompts_of_their_own() {
        // 3 points of 4 requests and 2 warm-ups over 14 prompts: all distinct.
        let mut seen: Vec<usize> = (0..3).flat_map(|p| (0..4).map(move |i| pick(14, 4, p, i))).collect();
        seen.extend((0..2).map(|i| pick(14, 4, u64::MAX, i)));
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 14);
        // A short file wraps round.
        assert_eq!((pick(3, 4, 1, 0), pick(3, 4, u64::MAX, 4)), (1, 1));
    }
}
