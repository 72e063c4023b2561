//! Worker selection policies, one per file.

mod least_loaded;

pub use least_loaded::least_loaded;
