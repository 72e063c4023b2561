//! What a worker tells routers about its prefix cache: the pool's numbered events
//! after a reader's cursor, or a snapshot to start over from.

use pdserve_kv::BlockPool;
use pdserve_protocol::{KvCursor, KvEvents};

/// Events sent in one answer at most; a reader further behind asks again.
const MAX_EVENTS: usize = 8192;

/// The events of `pool` after `after`, starting with a snapshot when the cursor
/// cannot be followed.
pub(crate) fn since(pool: &BlockPool, after: KvCursor) -> KvEvents {
    let (snapshot, from) = match pool.events_since(after.instance, after.seq) {
        Ok(events) => (None, (after, events)),
        Err(_) => {
            let snap = pool.snapshot();
            let at = KvCursor { instance: snap.instance, seq: snap.seq };
            // Events after the snapshot are still in the log: it was just taken.
            let events = pool.events_since(at.instance, at.seq).unwrap_or_default();
            (Some(snap.hashes), (at, events))
        }
    };
    let (mut cursor, events) = from;
    let events: Vec<_> = events
        .into_iter()
        .take(MAX_EVENTS)
        .inspect(|e| cursor.seq = e.seq)
        .map(|e| (e.event, e.at.elapsed().as_secs_f32()))
        .collect();
    KvEvents { snapshot, events, cursor }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_kv::{BlockTable, KvEvent};

    #[test]
    fn a_new_reader_gets_a_snapshot_then_follows_the_events() {
        let pool = BlockPool::new(8, 2);
        let mut table = BlockTable::new(&pool, 0);
        table.ensure_capacity(4).unwrap();
        table.commit(&[1, 2, 3, 4]);
        let first = since(&pool, KvCursor::default());
        assert_eq!(first.snapshot.as_ref().map(Vec::len), Some(2));
        assert!(first.events.is_empty(), "the snapshot already holds them");
        table.ensure_capacity(6).unwrap();
        table.commit(&[1, 2, 3, 4, 5, 6]);
        let next = since(&pool, first.cursor);
        assert_eq!(next.snapshot, None);
        assert!(matches!(next.events[..], [(KvEvent::Stored { .. }, _)]));
        assert_eq!(next.cursor.seq, first.cursor.seq + 1);
    }
}
