//! Deadlines on grammar steps, for the work llguidance's own budgets do not bound.
//!
//! llguidance bounds most of a step with fuel and item limits, but not the bytes it
//! forces (those every continuation shares): a rule that can only recurse behind a
//! long lexeme (`r: /x{1000}/ r`, or a JSON schema whose required property holds the
//! schema itself under a long name) forced bytes for seconds per step, growing with
//! the lexeme, up to minutes within the source bounds, and did so on an engine
//! thread. So each step is armed here with a deadline, and a thread of its own
//! cancels (llguidance's cancellation, checked as it forces each byte) any step that
//! runs past it, checking [`TICK`] apart.

use llguidance::CancellationHandle;
use std::sync::{Mutex, Once, PoisonError};
use std::time::{Duration, Instant};

/// How often overdue steps are looked for: a deadline is kept within this.
const TICK: Duration = Duration::from_millis(20);

/// The steps running now.
static RUNNING: Mutex<Running> = Mutex::new(Running { last: 0, steps: Vec::new() });
static WATCH: Once = Once::new();

struct Running {
    /// The id given last.
    last: u64,
    steps: Vec<Step>,
}

/// A step: its id, when it must end, and how to stop it.
struct Step {
    id: u64,
    deadline: Instant,
    handle: CancellationHandle,
}

/// A step under a deadline; dropping it disarms the deadline.
pub(super) struct Armed(u64);

/// Cancels `handle`'s work once `budget` has passed, unless the returned guard is
/// dropped first.
pub(super) fn arm(handle: CancellationHandle, budget: Duration) -> Armed {
    WATCH.call_once(|| {
        let spawned = std::thread::Builder::new().name("pdserve-grammar-deadline".into()).spawn(watch);
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the grammar deadline thread; grammar steps run unbounded");
        }
    });
    let mut running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
    running.last += 1;
    let id = running.last;
    running.steps.push(Step { id, deadline: Instant::now() + budget, handle });
    Armed(id)
}

impl Drop for Armed {
    fn drop(&mut self) {
        RUNNING.lock().unwrap_or_else(PoisonError::into_inner).steps.retain(|s| s.id != self.0);
    }
}

fn watch() {
    loop {
        std::thread::sleep(TICK);
        let now = Instant::now();
        let running = RUNNING.lock().unwrap_or_else(PoisonError::into_inner);
        for step in running.steps.iter().filter(|s| s.deadline <= now) {
            step.handle.cancel();
        }
    }
}
