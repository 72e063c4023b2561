//! Round robin: each request to the next worker in turn, whatever their load.

use crate::node::Node;
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn round_robin<'a>(workers: &[&'a Node], turn: &AtomicUsize) -> Option<&'a Node> {
    if workers.is_empty() {
        return None;
    }
    Some(workers[turn.fetch_add(1, Ordering::Relaxed) % workers.len()])
}
