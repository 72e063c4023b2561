//! Events for the router's prefix index.

pub use pdserve_types::KvEvent;
