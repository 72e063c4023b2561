//! Recency order of cached blocks: an intrusive doubly linked list over block indices.
//!
//! Every operation the pool needs (append on release, unlink on revival, pop the oldest
//! on eviction) is O(1), and the links live in two flat arrays sized once at startup,
//! so nothing allocates while serving.

use crate::hash::BlockId;

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Least recently used end: evicted first.
    head: u32,
    /// Most recently used end: where released blocks go.
    tail: u32,
    len: usize,
}

impl Lru {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { prev: vec![NIL; capacity], next: vec![NIL; capacity], head: NIL, tail: NIL, len: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Appends at the most recently used end. The caller guarantees `id` is not linked.
    pub(crate) fn push_back(&mut self, id: BlockId) {
        let i = id.index();
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        match self.tail {
            NIL => self.head = id.0,
            t => self.next[t as usize] = id.0,
        }
        self.tail = id.0;
        self.len += 1;
    }

    /// Unlinks `id`. The caller guarantees it is linked.
    pub(crate) fn remove(&mut self, id: BlockId) {
        let i = id.index();
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.len -= 1;
    }

    /// Unlinks and returns the least recently used block.
    pub(crate) fn pop_front(&mut self) -> Option<BlockId> {
        if self.head == NIL {
            return None;
        }
        let id = BlockId(self.head);
        self.remove(id);
        Some(id)
    }

    /// Blocks from least to most recently used.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            (cur != NIL).then(|| {
                let id = BlockId(cur);
                cur = self.next[cur as usize];
                id
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(lru: &Lru) -> Vec<u32> {
        lru.iter().map(|b| b.0).collect()
    }

    #[test]
    fn push_remove_pop_keep_order() {
        let mut lru = Lru::new(5);
        for i in [3, 0, 4, 1] {
            lru.push_back(BlockId(i));
        }
        assert_eq!(order(&lru), [3, 0, 4, 1]);
        lru.remove(BlockId(4));
        lru.remove(BlockId(3));
        assert_eq!(order(&lru), [0, 1]);
        lru.push_back(BlockId(3));
        assert_eq!(lru.pop_front(), Some(BlockId(0)));
        lru.remove(BlockId(3));
        assert_eq!(order(&lru), [1]);
        assert_eq!(lru.pop_front(), Some(BlockId(1)));
        assert_eq!(lru.pop_front(), None);
        assert_eq!(lru.len(), 0);
    }
}
