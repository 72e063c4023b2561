//! The shared-memory segment one sender writes and one receiver reads: a control
//! area of atomic words (one per slot, and the sender's "waiting" word), then a ring of
//! equal slots. [`crate::shm`] runs the transport over it; the link hands its slots
//! out.

use crate::records::{self, Body};
use crate::{Frame, FrameError};
use memmap2::{Mmap, MmapMut, MmapOptions};
use std::fs::{self, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) const DIR: &str = "/dev/shm";
pub(crate) const PREFIX: &str = "pdserve-kv-";
pub(crate) const PAGE: usize = 4096;
/// The largest segment a receiver maps.
const MAX_SEGMENT_BYTES: u64 = 16 << 30;
/// The most slots a segment has (its control words then fill two pages).
pub const MAX_SLOTS: usize = 2000;
/// Where in the control area the sender's "waiting for a slot" word lies...
const WAITING_AT: usize = 0;
/// ...and where the slots' words start (a cache line further, apart from it).
const STATES_AT: usize = 64;
/// A slot's word: the sender may write the slot.
const SLOT_FREE: u32 = 0;
/// A slot's word: announced, the receiver has not finished reading it.
const SLOT_SENT: u32 = 1;

/// Bytes before the first slot: the control words, rounded up to whole pages so that
/// the slots can be mapped on their own.
fn control_bytes(slots: usize) -> usize {
    (STATES_AT + 4 * slots).next_multiple_of(PAGE)
}

/// The shape of a sender's segment.
#[derive(Debug, Clone, Copy)]
pub struct ShmConfig {
    /// Frames in flight at most.
    pub slots: usize,
    /// Bytes per slot, the largest encoded frame this link can carry (a real block
    /// of the default model encodes to 12 320 bytes).
    pub slot_bytes: usize,
}

impl Default for ShmConfig {
    /// 8 slots of 256 KiB: 21 frames of the default model per slot (one control record
    /// each), and a 2 MiB segment, small enough to stay in a core's L2 cache. With 64
    /// slots (16 MiB) a sender that runs ahead spreads the copies over memory outside
    /// it, and the link measured 65–92 % of the bare ring where 8 slots gave 85–102 %
    /// (docs/benchmarks.md).
    fn default() -> Self {
        ShmConfig { slots: 8, slot_bytes: 256 << 10 }
    }
}

/// The body of `HELLO`: the segment's shape and path, as [`Mapping::open`] reads it.
pub(crate) fn hello(slots: u32, slot_bytes: u64, path: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(12 + path.len());
    body.extend_from_slice(&slots.to_le_bytes());
    body.extend_from_slice(&slot_bytes.to_le_bytes());
    body.extend_from_slice(path);
    body
}

/// The words at the start of a segment that both sides write, atomically.
struct Control {
    base: NonNull<u8>,
    slots: usize,
}

impl Control {
    /// Set by a sender that found no free slot and sleeps until `FREE` wakes it.
    fn waiting(&self) -> &AtomicU32 {
        // SAFETY: the control area is mapped, shared and writable for as long as `self`
        // (owned by the mapping's holder) lives; the word is 4-aligned (page-aligned
        // base) and both processes only ever access it atomically.
        unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(WAITING_AT).cast()) }
    }

    /// `SLOT_FREE` or `SLOT_SENT`; out-of-range slots have no word.
    fn state(&self, slot: usize) -> Option<&AtomicU32> {
        // SAFETY: as for `waiting`; slot < slots keeps the word inside the area.
        (slot < self.slots).then(|| unsafe { AtomicU32::from_ptr(self.base.as_ptr().add(STATES_AT + 4 * slot).cast()) })
    }
}

/// A slot that one sink fills: the link hands each slot out to one holder at a time,
/// so the holder may write it without a lock.
#[derive(Debug)]
pub(crate) struct HeldSlot {
    pub index: u32,
    /// Bytes written so far.
    pub used: usize,
}

/// The sender's segment: slots it writes frames into.
pub struct Segment {
    pub(crate) path: PathBuf,
    /// Keeps the mapping alive; written only through `control` and `slots_base`.
    _map: MmapMut,
    control: Control,
    slots_base: NonNull<u8>,
    slots: usize,
    slot_bytes: usize,
}

// SAFETY: the mapping's memory is shared on purpose: the control words are atomics and
// each slot is written by the one holder of its `HeldSlot` (see `Segment::write`).
unsafe impl Send for Segment {}
// SAFETY: as above.
unsafe impl Sync for Segment {}

impl Segment {
    pub(crate) fn create(cfg: ShmConfig) -> io::Result<Segment> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!("{DIR}/{PREFIX}{}-{seq}-{nanos:x}", std::process::id()));
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(&path)?;
        let control = control_bytes(cfg.slots);
        let bytes = control as u64 + cfg.slots as u64 * cfg.slot_bytes as u64;
        let mapped = file.set_len(bytes).and_then(|()| {
            // SAFETY: the file was just created by this process, with a unique name and
            // mode 0600; only the receiver it is handed to maps it besides us, and that
            // one writes only the control words. Its size is fixed from here on.
            unsafe { MmapOptions::new().populate().map_mut(&file) }
        });
        let mut map = match mapped {
            Ok(map) => map,
            Err(e) => {
                let _ = fs::remove_file(&path);
                return Err(e);
            }
        };
        // Fault every page in now, writable, so that no transfer does (zero: every
        // slot starts free).
        for page in map.chunks_mut(PAGE) {
            page[0] = 0;
        }
        let base = NonNull::new(map.as_mut_ptr()).ok_or_else(|| io::Error::other("null mapping"))?;
        // SAFETY: `control` bytes lie inside the mapping (it is `control` + slots long).
        let slots_base = unsafe { base.add(control) };
        Ok(Segment {
            path,
            _map: map,
            control: Control { base, slots: cfg.slots },
            slots_base,
            slots: cfg.slots,
            slot_bytes: cfg.slot_bytes,
        })
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Whether the receiver has finished reading `slot` (true for a slot never sent).
    pub(crate) fn is_free(&self, slot: usize) -> bool {
        self.control.state(slot).is_some_and(|w| w.load(Ordering::Acquire) == SLOT_FREE)
    }

    /// Marks `slot` as the receiver's, before its `SLOT` record goes out.
    pub(crate) fn mark_sent(&self, slot: &HeldSlot) {
        if let Some(w) = self.control.state(slot.index as usize) {
            w.store(SLOT_SENT, Ordering::Release);
        }
    }

    /// Says that a sender sleeps until a slot comes back; then the receiver wakes it.
    pub(crate) fn set_waiting(&self) {
        self.control.waiting().store(1, Ordering::SeqCst);
    }

    /// Encodes `frame` after the frames already in `slot`, without a checksum (the
    /// receiver reads the very memory written here), and returns its length.
    pub(crate) fn write(&self, slot: &mut HeldSlot, frame: &Frame) -> Result<usize, FrameError> {
        let used = slot.used;
        let n = frame.encode_local(&mut self.slot_mut(slot)[used..])?;
        slot.used += n;
        Ok(n)
    }

    /// The whole of a held slot.
    fn slot_mut<'a>(&'a self, slot: &'a mut HeldSlot) -> &'a mut [u8] {
        let index = (slot.index as usize).min(self.slots - 1);
        // SAFETY: the slot lies inside the mapping, and the `HeldSlot` (borrowed mutably
        // here, handed out once per slot by the link) is the one license to write it;
        // the receiver reads a slot only after it was announced, which ends the hold.
        unsafe {
            std::slice::from_raw_parts_mut(self.slots_base.as_ptr().add(index * self.slot_bytes), self.slot_bytes)
        }
    }

    #[cfg(test)]
    pub(crate) fn write_raw(&self, slot: &mut HeldSlot, bytes: &[u8]) {
        self.slot_mut(slot)[..bytes.len()].copy_from_slice(bytes);
        slot.used = bytes.len();
    }

    pub(crate) fn unlink(&self) {
        let _ = fs::remove_file(&self.path);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// The receiver's view of a sender's segment: the control words writable, the
/// slots read-only.
pub struct Mapping {
    /// Keeps the control area mapped for `control`.
    _control_map: MmapMut,
    control: Control,
    map: Mmap,
    slots: usize,
    slot_bytes: usize,
}

// SAFETY: `control` points into `_control_map`, owned alongside; its words are atomics.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the segment a `HELLO` names, after checking it is one of ours and has
    /// the announced size.
    pub(crate) fn open(hello: &[u8]) -> io::Result<Mapping> {
        let mut b = Body(hello);
        let slots = b.u32()? as usize;
        let slot_bytes = b.u64()?;
        let path = std::str::from_utf8(b.rest()).map_err(|_| records::invalid("segment path is not UTF-8".into()))?;
        let name = path.strip_prefix(DIR).and_then(|p| p.strip_prefix('/')).unwrap_or("");
        if !name.starts_with(PREFIX) || name.contains('/') {
            return Err(records::invalid(format!("{path:?} is not a pdserve segment")));
        }
        let slot_area = slots as u64 * slot_bytes;
        if slots == 0 || slots > MAX_SLOTS || slot_bytes > u64::from(u32::MAX) || slot_area > MAX_SEGMENT_BYTES {
            return Err(records::invalid(format!("{slots} slots of {slot_bytes} bytes")));
        }
        let control = control_bytes(slots);
        let bytes = control as u64 + slot_area;
        // A regular file, not a link to one elsewhere: lstat and the opened file agree.
        let named = fs::symlink_metadata(path)?;
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let meta = file.metadata()?;
        if !named.file_type().is_file() || (named.dev(), named.ino()) != (meta.dev(), meta.ino()) {
            return Err(records::invalid(format!("{path} is not a regular file")));
        }
        if meta.len() != bytes {
            return Err(records::invalid(format!("{path} is not {bytes} bytes")));
        }
        // SAFETY: the control area is shared with the sender, and both sides access its
        // words only atomically (`Control`); its size is fixed.
        let mut control_map = unsafe { MmapOptions::new().len(control).map_mut(&file)? };
        let base = NonNull::new(control_map.as_mut_ptr()).ok_or_else(|| io::Error::other("null mapping"))?;
        // SAFETY: the slots are shared with their sender, which never resizes the file
        // and writes a slot only while it holds it: before announcing it in a SLOT
        // record, and after this side frees it. This side reads a slot only in between.
        let map = unsafe { MmapOptions::new().offset(control as u64).len(slot_area as usize).populate().map(&file)? };
        let control = Control { base, slots };
        Ok(Mapping { _control_map: control_map, control, map, slots, slot_bytes: slot_bytes as usize })
    }

    /// The first `len` bytes of `slot`.
    pub fn slot(&self, slot: u32, len: u32) -> io::Result<&[u8]> {
        let (slot, len) = (slot as usize, len as usize);
        if slot >= self.slots || len > self.slot_bytes {
            return Err(records::invalid(format!("slot {slot} length {len} is outside the segment")));
        }
        let start = slot * self.slot_bytes;
        Ok(&self.map[start..start + len])
    }

    /// Hands `slot` back to the sender once its frames are copied out. True when the
    /// sender sleeps waiting for a slot and must be woken with `FREE`.
    pub fn free(&self, slot: u32) -> bool {
        let Some(word) = self.control.state(slot as usize) else { return false };
        word.store(SLOT_FREE, Ordering::SeqCst);
        // Pairs with the sender's `set_waiting` then re-check: either it sees this
        // slot free, or this sees it waiting.
        let waiting = self.control.waiting();
        waiting.load(Ordering::SeqCst) != 0 && waiting.swap(0, Ordering::SeqCst) != 0
    }
}
