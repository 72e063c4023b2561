//! Output formats: JSON (everything), Markdown (tables), SVG (plots). The runs
//! (`load`, `compare`) render their own reports with these pieces.

pub mod json;
pub mod markdown;
pub mod svg;
