//! Locking that outlives a panic.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m` even if a thread panicked while holding it: every value kept behind
/// these mutexes is whole between statements (counters, maps, queues), so a panic
/// elsewhere must not take every later caller down with it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mutex_poisoned_by_a_panic_still_locks() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let held = m.clone();
        let _ = std::thread::spawn(move || {
            let _guard = held.lock().unwrap();
            panic!("poisoning on purpose");
        })
        .join();
        assert!(m.is_poisoned());
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
