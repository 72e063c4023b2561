//! The connection slots of a worker port.
//!
//! A connection that has not proved the cluster token yet holds a slot of a small
//! budget of its own, at most a few per source address, never one that peers who
//! proved it need: idle strangers used to take every slot of a port and lock routers
//! out until they left. Once its handshake passes, a connection trades that slot for
//! one of the port's authenticated slots.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Connections still proving the token, in all.
pub const MAX_PENDING: usize = 32;
/// Connections still proving the token, from one source address.
pub const MAX_PENDING_PER_SOURCE: usize = 8;

/// Why a connection got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its source already has [`MAX_PENDING_PER_SOURCE`] handshakes open.
    SourceBusy,
    /// [`MAX_PENDING`] handshakes are open.
    PendingFull,
    /// Every authenticated slot is taken.
    Full,
}

/// The counts a decision reads.
#[derive(Debug, Default)]
struct Counts {
    pending: usize,
    by_source: HashMap<IpAddr, usize>,
    authed: usize,
}

/// Whether a new connection from `from` may start its handshake.
fn may_knock(c: &Counts, from: IpAddr) -> Result<(), Refused> {
    if c.by_source.get(&from).copied().unwrap_or(0) >= MAX_PENDING_PER_SOURCE {
        return Err(Refused::SourceBusy);
    }
    if c.pending >= MAX_PENDING {
        return Err(Refused::PendingFull);
    }
    Ok(())
}

/// A port's slots: `authed` for connections that proved the token.
#[derive(Debug)]
pub struct PortSlots {
    authed: usize,
    counts: Mutex<Counts>,
    refusals: LogEvery,
}

impl PortSlots {
    pub fn new(authed: usize) -> Arc<PortSlots> {
        Arc::new(PortSlots { authed, counts: Mutex::default(), refusals: LogEvery::new() })
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A handshake slot for a new connection from `from`, held until it is dropped
    /// or admitted.
    pub fn knock(self: &Arc<Self>, from: IpAddr) -> Result<Pending, Refused> {
        let mut c = self.counts();
        may_knock(&c, from)?;
        c.pending += 1;
        *c.by_source.entry(from).or_default() += 1;
        Ok(Pending { slots: self.clone(), from })
    }

    /// Whether a refusal should be logged now, and how many went unlogged since the
    /// last one: a reconnect loop would otherwise write a line per attempt.
    pub fn log_refusal(&self) -> Option<u64> {
        self.refusals.due()
    }
}

/// At most one refusal line per this long per port.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);

/// A warning logged at most once per [`REFUSAL_LOG_EVERY`] (10 s): a peer that keeps
/// reconnecting (or a relay that keeps forging) must not fill the log.
#[derive(Debug)]
pub struct LogEvery(Mutex<(Option<Instant>, u64)>);

impl LogEvery {
    pub const fn new() -> LogEvery {
        LogEvery(Mutex::new((None, 0)))
    }

    /// Whether to log now, and how many went unlogged since the last line.
    pub fn due(&self) -> Option<u64> {
        let mut r = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if r.0.is_some_and(|t| t.elapsed() < REFUSAL_LOG_EVERY) {
            r.1 += 1;
            return None;
        }
        let quiet = std::mem::take(&mut r.1);
        r.0 = Some(Instant::now());
        Some(quiet)
    }
}

impl Default for LogEvery {
    fn default() -> Self {
        LogEvery::new()
    }
}

/// A connection proving the token.
#[derive(Debug)]
pub struct Pending {
    slots: Arc<PortSlots>,
    from: IpAddr,
}

impl Pending {
    /// Trades the handshake slot for an authenticated one, once the token is proved.
    pub fn admit(self) -> Result<Admitted, Refused> {
        let slots = self.slots.clone();
        let mut c = slots.counts();
        if c.authed >= slots.authed {
            return Err(Refused::Full);
        }
        c.authed += 1;
        drop(c);
        Ok(Admitted { slots })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut c = self.slots.counts();
        c.pending -= 1;
        if let Some(n) = c.by_source.get_mut(&self.from) {
            *n -= 1;
            if *n == 0 {
                c.by_source.remove(&self.from);
            }
        }
    }
}

/// A connection that proved the token; its slot frees when it is dropped.
#[derive(Debug)]
pub struct Admitted {
    slots: Arc<PortSlots>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.slots.counts().authed -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_knock_is_decided_by_its_source_and_the_pending_total() {
        let mut c = Counts::default();
        assert_eq!(may_knock(&c, ip(1)), Ok(()));
        c.by_source.insert(ip(1), MAX_PENDING_PER_SOURCE);
        c.pending = MAX_PENDING_PER_SOURCE;
        assert_eq!(may_knock(&c, ip(1)), Err(Refused::SourceBusy));
        assert_eq!(may_knock(&c, ip(2)), Ok(()));
        c.pending = MAX_PENDING;
        assert_eq!(may_knock(&c, ip(2)), Err(Refused::PendingFull));
    }

    #[test]
    fn strangers_holding_handshakes_never_take_an_authenticated_slot() {
        let slots = PortSlots::new(2);
        let idle: Vec<_> = (0..MAX_PENDING_PER_SOURCE).map(|_| slots.knock(ip(9)).unwrap()).collect();
        assert_eq!(slots.knock(ip(9)).unwrap_err(), Refused::SourceBusy);
        // A router from elsewhere still gets in, and its slot was never theirs.
        let a = slots.knock(ip(1)).unwrap().admit().unwrap();
        let b = slots.knock(ip(2)).unwrap().admit().unwrap();
        assert_eq!(slots.knock(ip(3)).unwrap().admit().unwrap_err(), Refused::Full);
        drop((a, idle));
        assert!(slots.knock(ip(9)).is_ok());
        let _c = slots.knock(ip(3)).unwrap().admit().unwrap();
        drop(b);
        let c = slots.counts();
        assert_eq!((c.pending, c.authed, c.by_source.len()), (0, 1, 0));
    }

    #[test]
    fn refusals_are_logged_at_most_once_a_while_with_the_count_between() {
        let slots = PortSlots::new(1);
        assert_eq!(slots.log_refusal(), Some(0));
        for _ in 0..1000 {
            assert_eq!(slots.log_refusal(), None);
        }
        slots.refusals.0.lock().unwrap().0 = Some(Instant::now() - REFUSAL_LOG_EVERY);
        assert_eq!(slots.log_refusal(), Some(1000));
    }
}
