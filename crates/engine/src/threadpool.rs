//! A small fork-join pool for the forward pass: the caller plus `n - 1` workers split a
//! range of tasks. Workers spin only briefly after a job and then sleep on a condvar, so
//! two engines sharing two cores slow down gracefully instead of collapsing (a spinning
//! pool holds a core that the other engine needs).
//!
//! Tasks are claimed with a compare-and-swap on one word holding the job's generation
//! and the next task index, and the caller waits only for tasks, never for workers: a
//! worker that is descheduled or asleep when a job starts simply claims nothing, and
//! the caller runs the tasks itself.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Spin iterations before a worker sleeps: long enough to catch the next layer's job
/// during a forward pass, short enough to give the core away between steps.
const SPIN_ITERS: u32 = 20_000;

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Generation in the high 32 bits, next unclaimed task in the low 32.
    state: AtomicU64,
    job: UnsafeCell<Option<Job>>,
    n_tasks: AtomicUsize,
    /// Tasks of the current generation that have finished.
    done: AtomicUsize,
    sleepers: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by `run` before it publishes a new generation, and a
// task of a generation can only be claimed (and the job read) while that generation's
// tasks are not all done, which `run` waits for before returning or writing again.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool using `threads` threads in total (the caller counts as one).
    pub fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .filter_map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("pdserve-compute-{i}")).spawn(move || worker(&s)).ok()
            })
            .collect();
        ThreadPool { shared, workers, run_lock: Mutex::new(()) }
    }

    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` for every `i < n_tasks`, spread over the pool; returns when all are
    /// done. Task order and placement are unspecified, so `f` must not depend on them.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || n_tasks <= 1 {
            (0..n_tasks).for_each(f);
            return;
        }
        assert!(n_tasks < u32::MAX as usize, "too many tasks");
        let _one_at_a_time = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // Close the previous generation first: a worker that read its state just before
        // may still try to claim with it, and must fail before we reuse `n_tasks`.
        let prev = s.state.load(Relaxed) >> 32;
        s.state.store((prev << 32) | 0xffff_ffff, SeqCst);
        // SAFETY: erasing the lifetime is sound because we return only after every task
        // is done, and no task can be claimed afterwards (all indices are taken).
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // SAFETY: the previous generation is complete, so nobody reads `job` now.
        unsafe { *s.job.get() = Some(job) };
        s.n_tasks.store(n_tasks, Relaxed);
        s.done.store(0, Relaxed);
        let gen = prev.wrapping_add(1) & 0xffff_ffff;
        s.state.store(gen << 32, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        work_on(s, gen);
        let mut spins = 0u32;
        while s.done.load(Acquire) < n_tasks {
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if s.panicked.swap(false, SeqCst) {
            panic!("a compute task panicked");
        }
    }

    /// Splits `0..len` into about `parts` contiguous ranges and runs `f` on each.
    pub fn for_ranges(&self, len: usize, parts: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        let parts = parts.clamp(1, len.max(1));
        self.run(parts, &|i| {
            let (a, b) = (i * len / parts, (i + 1) * len / parts);
            if a < b {
                f(a..b)
            }
        });
    }
}

/// Claims and runs tasks of generation `gen` until none are left.
fn work_on(s: &Shared, gen: u64) {
    loop {
        let st = s.state.load(Acquire);
        let i = (st & 0xffff_ffff) as usize;
        if st >> 32 != gen || i >= s.n_tasks.load(Acquire) {
            return;
        }
        if s.state.compare_exchange_weak(st, st + 1, AcqRel, Relaxed).is_err() {
            continue;
        }
        // SAFETY: we hold an unfinished task of `gen`, so `run` is still waiting and
        // the job it published for `gen` is alive.
        if let Some(job) = unsafe { *s.job.get() } {
            let f = unsafe { &*job };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
                s.panicked.store(true, SeqCst);
            }
        }
        s.done.fetch_add(1, Release);
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0u32;
        let gen = loop {
            if s.shutdown.load(Acquire) {
                return;
            }
            let g = s.state.load(Acquire) >> 32;
            if g != seen {
                break g;
            }
            spins += 1;
            if spins < SPIN_ITERS {
                std::hint::spin_loop();
            } else {
                sleep_until_changed(s, seen);
                spins = 0;
            }
        };
        seen = gen;
        work_on(s, gen);
    }
}

fn sleep_until_changed(s: &Shared, seen: u64) {
    let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
    s.sleepers.fetch_add(1, SeqCst);
    while s.state.load(SeqCst) >> 32 == seen && !s.shutdown.load(SeqCst) {
        guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    }
    s.sleepers.fetch_sub(1, SeqCst);
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _g = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A mutable slice that pool tasks write disjoint parts of.
pub struct DisjointMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through `part`, whose contract forbids overlapping ranges.
unsafe impl<T: Send> Send for DisjointMut<'_, T> {}
unsafe impl<T: Send> Sync for DisjointMut<'_, T> {}

impl<'a, T> DisjointMut<'a, T> {
    pub fn new(s: &'a mut [T]) -> Self {
        DisjointMut { ptr: s.as_mut_ptr(), len: s.len(), _life: std::marker::PhantomData }
    }

    /// The sub-slice `range`.
    ///
    /// # Safety
    /// Ranges used concurrently (by any task of the same job) must not overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn part(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "range outside the slice");
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_every_task_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 5, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, SeqCst);
                });
                assert!(hits.iter().all(|h| h.load(SeqCst) == 1));
            }
        }
    }

    #[test]
    fn survives_sleep_and_wake() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for round in 0..5 {
            if round % 2 == 1 {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            pool.for_ranges(1000, 7, &|r| {
                total.fetch_add(r.len(), SeqCst);
            });
        }
        assert_eq!(total.load(SeqCst), 5000);
    }
}

#[cfg(test)]
mod stress {
    use super::*;

    /// Back-to-back jobs of different sizes: a worker finishing job k must never claim
    /// a task of job k+1 with job k's bookkeeping, nor run past `run`'s return.
    #[test]
    fn consecutive_jobs_never_mix() {
        let pool = ThreadPool::new(2);
        for iter in 0..20_000usize {
            let n = 2 + iter % 7;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            let live = AtomicBool::new(true);
            pool.run(n, &|i| {
                assert!(i < n, "task {i} of a job with {n} tasks");
                assert!(live.load(SeqCst), "task ran after run returned");
                for _ in 0..(i * 37) % 500 {
                    std::hint::spin_loop();
                }
                hits[i].fetch_add(1, SeqCst);
            });
            live.store(false, SeqCst);
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "iteration {iter}");
        }
    }
}
