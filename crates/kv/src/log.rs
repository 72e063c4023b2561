//! The pool's events, numbered and kept in a bounded ring so that any number of
//! readers (one router per frontend) follow them at their own pace, each with its
//! own cursor. A reader that falls further behind than the ring reaches, or that
//! finds another log instance (the worker restarted), rebuilds from a snapshot of
//! the registry taken at a known sequence number.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::time::Instant;

use crate::event::KvEvent;

/// One event with its number in the log and the time it happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedEvent {
    /// 1 for the first event of a log instance, then consecutive.
    pub seq: u64,
    pub at: Instant,
    pub event: KvEvent,
}

/// The reader's cursor is older than the oldest kept event, or belongs to another
/// instance: it must resync from a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the KV event log no longer holds events after {after} (oldest kept: {oldest})")]
pub struct EventGap {
    pub after: u64,
    pub oldest: u64,
}

#[derive(Debug)]
pub(crate) struct EventLog {
    /// Differs between pools, so a reader notices a restarted worker.
    instance: u64,
    /// Number of the last event appended (0: none yet).
    last: u64,
    kept: VecDeque<LoggedEvent>,
    cap: usize,
}

impl EventLog {
    pub(crate) fn new(cap: usize) -> Self {
        let instance = std::collections::hash_map::RandomState::new().build_hasher().finish();
        Self { instance, last: 0, kept: VecDeque::with_capacity(cap.min(4096)), cap: cap.max(1) }
    }

    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    pub(crate) fn last(&self) -> u64 {
        self.last
    }

    pub(crate) fn push(&mut self, event: KvEvent) {
        if self.kept.len() == self.cap {
            self.kept.pop_front();
        }
        self.last += 1;
        self.kept.push_back(LoggedEvent { seq: self.last, at: Instant::now(), event });
    }

    /// The events numbered after `after` of instance `instance`, oldest first.
    pub(crate) fn since(&self, instance: u64, after: u64) -> Result<Vec<LoggedEvent>, EventGap> {
        let oldest = self.kept.front().map_or(self.last + 1, |e| e.seq);
        if instance != self.instance || after > self.last || after + 1 < oldest {
            return Err(EventGap { after, oldest });
        }
        let skip = (after + 1 - oldest) as usize;
        Ok(self.kept.iter().skip(skip).copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::BlockHash;
    use crate::tier::Tier;

    fn stored(h: u64) -> KvEvent {
        KvEvent::Stored { hash: BlockHash(h), parent: None, tier: Tier::Device }
    }

    #[test]
    fn readers_follow_by_cursor_until_the_ring_passes_them() {
        let mut log = EventLog::new(3);
        let me = log.instance();
        assert_eq!(log.since(me, 0).unwrap(), []);
        for h in 1..=3 {
            log.push(stored(h));
        }
        let all = log.since(me, 0).unwrap();
        assert_eq!(all.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(log.since(me, 2).unwrap()[0].event, stored(3));
        log.push(stored(4));
        // Event 1 is gone: a reader at 0 must resync, one at 1 need not.
        assert_eq!(log.since(me, 0), Err(EventGap { after: 0, oldest: 2 }));
        assert_eq!(log.since(me, 1).unwrap().len(), 3);
        assert_eq!(log.since(me, 4).unwrap(), []);
        assert!(log.since(me, 5).is_err(), "a cursor from the future is another life");
    }

    #[test]
    fn another_instance_is_a_gap() {
        let (a, b) = (EventLog::new(8), EventLog::new(8));
        assert_ne!(a.instance(), b.instance());
        assert!(a.since(b.instance(), 0).is_err());
    }
}
