//! Output formats: JSON (everything), Markdown (tables), SVG (plots).

pub mod compare_markdown;
pub mod json;
pub mod markdown;
pub mod plots;
pub mod svg;
