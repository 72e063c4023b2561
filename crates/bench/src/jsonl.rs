//! Files of one JSON record a line (traces, prompts): blank lines skipped, a bad line
//! named by its file and number.

use crate::error::BenchError;

/// Each non-blank line of `text` through `one`; `name` is the file in errors, `empty`
/// the error where no line holds a record.
pub fn parse<T>(
    text: &str,
    name: &str,
    empty: &str,
    one: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, BenchError> {
    let bad = |line: usize, reason: String| BenchError::BadLine { path: name.to_string(), line, reason };
    let mut records = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        records.push(one(line).map_err(|reason| bad(i + 1, reason))?);
    }
    if records.is_empty() {
        return Err(bad(0, empty.to_string()));
    }
    Ok(records)
}
