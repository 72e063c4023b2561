//! JSON output: the whole report, every request record included, compact (records
//! carry one timestamp per chunk, which would make pretty-printing huge).

use crate::error::BenchError;
use std::path::Path;

/// Writes `value` to `path`, creating parent directories.
pub fn write<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), BenchError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    }
    let text = serde_json::to_string(value).map_err(|e| BenchError::Runtime(format!("encoding JSON: {e}")))?;
    std::fs::write(path, text + "\n").map_err(|e| BenchError::io(path, e))
}
