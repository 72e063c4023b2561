//! Byte-pair merging of one pre-tokenized word.
//!
//! Merges are resolved to ids once at load time, so the inner loop looks up a pair of
//! `u32`s instead of concatenating strings. A merge whose parts or result are not
//! tokens themselves (possible in hand-edited vocabularies) still takes part: such
//! strings get "synthetic" ids past the vocabulary, and a synthetic id left at the end
//! falls back to its bytes' tokens, as llama.cpp does.

use super::vocab::Vocab;
use super::{MergeRule, TokenKind, TokenizerError};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Marks a symbol that was merged into its left neighbour.
const DEAD: u32 = u32::MAX;
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Merge {
    rank: u32,
    result: u32,
}

#[derive(Debug)]
pub(crate) struct Bpe {
    merges: HashMap<u64, Merge, BuildHasherDefault<PairHasher>>,
    /// Symbol id of each single byte (a token, or synthetic).
    byte_sym: [u32; 256],
    /// Token of each single byte, for the fallback.
    byte_token: [Option<u32>; 256],
    n_vocab: u32,
    /// Bytes of synthetic id `n_vocab + i`.
    synthetic: Vec<Box<[u8]>>,
    /// Emit a whole word that is itself a token without merging (Llama 3's `ignore_merges`).
    ignore_merges: bool,
}

/// Buffers reused across the words of one `encode` call.
#[derive(Default)]
pub(crate) struct Scratch {
    syms: Vec<Symbol>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
}

impl Bpe {
    pub fn new(vocab: &Vocab, merges: &[MergeRule], ignore_merges: bool) -> Result<Self, TokenizerError> {
        let mut interner = Interner::new(vocab)?;
        let byte_sym = std::array::from_fn(|b| interner.intern(&[b as u8]));
        let byte_token = std::array::from_fn(|b| vocab.id_of(&[b as u8]));
        let mut table = HashMap::with_capacity_and_hasher(merges.len(), Default::default());
        for (rank, (a, b)) in (0u32..).zip(merges) {
            let joined = [a.as_slice(), b.as_slice()].concat();
            let key = pair(interner.intern(a), interner.intern(b));
            let result = interner.intern(&joined);
            // A repeated merge keeps its first (best) rank.
            table.entry(key).or_insert(Merge { rank, result });
        }
        if interner.overflowed {
            return Err(TokenizerError::Invalid("too many distinct merge strings".into()));
        }
        let n_vocab = interner.n_vocab;
        Ok(Bpe { merges: table, byte_sym, byte_token, n_vocab, synthetic: interner.synthetic, ignore_merges })
    }

    /// Appends the tokens of `word` to `out`.
    pub fn encode_word(&self, word: &[u8], vocab: &Vocab, s: &mut Scratch, out: &mut Vec<u32>) {
        if self.ignore_merges {
            if let Some(id) = vocab.id_of(word) {
                out.push(id);
                return;
            }
        }
        self.load(word, s);
        while let Some(Reverse((rank, left))) = s.heap.pop() {
            self.apply(s, rank, left);
        }
        self.emit(s, out);
    }

    /// One symbol per byte, and every adjacent pair that has a merge on the heap.
    fn load(&self, word: &[u8], s: &mut Scratch) {
        s.syms.clear();
        s.heap.clear();
        let last = word.len().saturating_sub(1);
        for (i, &b) in (0u32..).zip(word) {
            let next = if i as usize == last { NONE } else { i + 1 };
            let prev = if i == 0 { NONE } else { i - 1 };
            s.syms.push(Symbol { id: self.byte_sym[usize::from(b)], prev, next });
        }
        for i in 0..s.syms.len().saturating_sub(1) {
            self.push_pair(s, i as u32);
        }
    }

    fn push_pair(&self, s: &mut Scratch, left: u32) {
        let Some(l) = s.syms.get(left as usize) else {
            return;
        };
        let Some(r) = s.syms.get(l.next as usize) else {
            return;
        };
        if let Some(m) = self.merges.get(&pair(l.id, r.id)) {
            s.heap.push(Reverse((m.rank, left)));
        }
    }

    /// Merges the pair starting at `left` if it is still the pair that was queued.
    /// Ranks are unique per pair, so an unchanged rank means an unchanged pair.
    fn apply(&self, s: &mut Scratch, rank: u32, left: u32) {
        let Some(&l) = s.syms.get(left as usize) else {
            return;
        };
        let Some(&r) = s.syms.get(l.next as usize) else {
            return;
        };
        if l.id == DEAD || r.id == DEAD {
            return;
        }
        let Some(m) = self.merges.get(&pair(l.id, r.id)).filter(|m| m.rank == rank) else {
            return;
        };
        s.syms[left as usize].id = m.result;
        s.syms[left as usize].next = r.next;
        s.syms[l.next as usize].id = DEAD;
        if let Some(after) = s.syms.get_mut(r.next as usize) {
            after.prev = left;
        }
        if l.prev != NONE {
            self.push_pair(s, l.prev);
        }
        self.push_pair(s, left);
    }

    fn emit(&self, s: &Scratch, out: &mut Vec<u32>) {
        let mut i = 0u32;
        while let Some(sym) = s.syms.get(i as usize) {
            if sym.id < self.n_vocab {
                out.push(sym.id);
            } else {
                self.emit_bytes(sym.id, out);
            }
            i = sym.next;
        }
    }

    /// A synthetic symbol: its bytes one by one, skipping bytes that have no token.
    fn emit_bytes(&self, id: u32, out: &mut Vec<u32>) {
        let bytes = self.synthetic.get((id - self.n_vocab) as usize).map_or(&[][..], |b| b);
        out.extend(bytes.iter().filter_map(|&b| self.byte_token[usize::from(b)]));
    }
}

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// Assigns ids to byte strings: a token's own id when the string is a token (normal
/// tokens first, like the BPE lookup in llama.cpp), otherwise a new synthetic id.
struct Interner {
    ids: HashMap<Vec<u8>, u32>,
    n_vocab: u32,
    synthetic: Vec<Box<[u8]>>,
    overflowed: bool,
}

impl Interner {
    fn new(vocab: &Vocab) -> Result<Self, TokenizerError> {
        let n_vocab = u32::try_from(vocab.len()).map_err(|_| TokenizerError::Invalid("vocabulary too large".into()))?;
        let mut ids = HashMap::with_capacity(vocab.len());
        let normal_first =
            vocab.iter().filter(|t| t.2 == TokenKind::Normal).chain(vocab.iter().filter(|t| t.2 != TokenKind::Normal));
        for (id, bytes, _) in normal_first {
            if !bytes.is_empty() {
                ids.entry(bytes.to_vec()).or_insert(id);
            }
        }
        Ok(Interner { ids, n_vocab, synthetic: Vec::new(), overflowed: false })
    }

    fn intern(&mut self, bytes: &[u8]) -> u32 {
        if let Some(&id) = self.ids.get(bytes) {
            return id;
        }
        let id =
            u32::try_from(self.synthetic.len()).ok().and_then(|n| self.n_vocab.checked_add(n)).filter(|&id| id < DEAD);
        let Some(id) = id else {
            self.overflowed = true;
            return DEAD;
        };
        self.synthetic.push(bytes.into());
        self.ids.insert(bytes.to_vec(), id);
        id
    }
}

/// A fast hasher for the `(left, right)` pair keys: a multiply-xorshift of one u64.
#[derive(Default)]
struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        let x = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = x ^ (x >> 29);
    }
}
