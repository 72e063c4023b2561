//! Least loaded: the worker with the fewest requests in flight; ties go to the first.

use pdserve_worker::Worker;

pub fn least_loaded<'a>(workers: &[&'a Worker]) -> Option<&'a Worker> {
    workers.iter().copied().min_by_key(|w| w.load())
}
