//! Least loaded: the worker with the fewest requests in flight; ties go to the first.

use crate::node::Node;

pub fn least_loaded<'a>(workers: &[&'a Node]) -> Option<&'a Node> {
    workers.iter().copied().min_by_key(|w| w.load())
}
