//! The bytes of the prefix cache's lower tiers: a host-RAM store (tier 2) and a
//! file on local disk (tier 3), each a fixed number of block-sized slots. The pool
//! (`pdserve-kv`) decides which hash lives in which slot and hands the engine the
//! copies to make ([`Move`]); this module makes them.
//!
//! A slot holds one block of every layer: per layer, the block's K then its V, as
//! the f16 bits [`KvStorage`] keeps. Disk writes go to a writer thread through a
//! bounded channel, so the engine's step never waits for the disk unless the disk
//! falls a whole channel behind; a slot being written is read from its pending
//! buffer.

use crate::kvcache::KvStorage;
use pdserve_kv::{Move, Place, Tier, TierCounters};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// Sizes of the lower tiers, in blocks (0: no such tier).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierConfig {
    pub host_blocks: usize,
    pub disk_blocks: usize,
    /// Where the disk tier's file goes; required when `disk_blocks > 0`.
    pub disk_dir: Option<PathBuf>,
}

impl TierConfig {
    /// How many blocks of `block_bytes` fit in `gb` gigabytes (10^9 bytes).
    pub fn blocks_in(gb: f64, block_bytes: usize) -> usize {
        if gb.is_nan() || gb <= 0.0 || block_bytes == 0 {
            return 0;
        }
        (gb * 1e9 / block_bytes as f64) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.host_blocks == 0 && self.disk_blocks == 0
    }
}

/// The disk tier could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("KV disk tier in {dir}: {source}")]
pub struct TierError {
    dir: String,
    source: std::io::Error,
}

/// The host and disk stores of one engine.
pub(crate) struct TierBytes {
    /// f16 values per slot (every layer, K and V).
    slot_values: usize,
    host: Vec<u16>,
    disk: Option<DiskStore>,
    pub(crate) counters: TierCounters,
}

impl TierBytes {
    pub(crate) fn new(kv: &KvStorage, cfg: &TierConfig) -> Result<TierBytes, TierError> {
        let slot_values = kv.n_layers * 2 * kv.block_elems();
        let disk = match (cfg.disk_blocks, &cfg.disk_dir) {
            (0, _) | (_, None) => None,
            (n, Some(dir)) => Some(DiskStore::open(dir, n, slot_values * 2)?),
        };
        // Zeroed, so untouched slots cost no resident memory.
        let host = vec![0u16; cfg.host_blocks * slot_values];
        Ok(TierBytes { slot_values, host, disk, counters: TierCounters::default() })
    }

    /// Makes one of the pool's copies.
    pub(crate) fn apply(&mut self, m: Move, kv: &KvStorage) {
        match (m.from, m.to) {
            (Place::Device(b), Place::Host(s)) => {
                let at = s as usize * self.slot_values;
                gather(kv, b.0, &mut self.host[at..at + self.slot_values]);
                self.counters.stored_host += 1;
            }
            (Place::Device(b), Place::Disk(s)) => {
                let mut buf = vec![0u16; self.slot_values];
                gather(kv, b.0, &mut buf);
                write_disk(self.disk.as_ref(), &mut self.counters, s, &buf);
            }
            (Place::Host(h), Place::Disk(s)) => {
                let at = h as usize * self.slot_values;
                write_disk(self.disk.as_ref(), &mut self.counters, s, &self.host[at..at + self.slot_values]);
            }
            // The pool only moves blocks down; a copy up is a restore.
            _ => debug_assert!(false, "unexpected move {m:?}"),
        }
    }

    /// Waits until every queued disk write is in the file and on the disk; with
    /// `uncache`, also asks the kernel to drop the file from its page cache, so the
    /// next reads come from the device (for measuring a cold disk tier).
    pub(crate) fn flush(&self, uncache: bool) -> std::io::Result<()> {
        let Some(d) = &self.disk else { return Ok(()) };
        while !lock(&d.pending).is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        d.file.sync_all()?;
        if uncache {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid open descriptor; the call only advises the kernel.
            let rc = unsafe { libc::posix_fadvise(d.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            if rc != 0 {
                return Err(std::io::Error::from_raw_os_error(rc));
            }
        }
        Ok(())
    }

    /// Layer `l`'s K and V of the block in host slot `slot`, each `n` values, read in
    /// place: for an export while a step runs, which must not take pool blocks to
    /// copy the block back.
    pub(crate) fn host_layer(&self, slot: u32, l: usize, n: usize) -> Option<(&[u16], &[u16])> {
        let at = slot as usize * self.slot_values + l * 2 * n;
        let layer = self.host.get(at..at + 2 * n)?;
        Some(layer.split_at(n))
    }

    /// Every layer of the block in disk slot `slot`, as the slot holds it (per
    /// layer, K then V); `None` when it cannot be read.
    pub(crate) fn disk_slot(&self, slot: u32) -> Option<Vec<u16>> {
        self.disk.as_ref()?.read(slot, self.slot_values)
    }

    /// Copies the block at `from` (a host or disk slot) into pool block `block`;
    /// false when its bytes cannot be read (a failed disk write or read).
    pub(crate) fn restore(&mut self, from: Place, kv: &mut KvStorage, block: u32) -> bool {
        let started = Instant::now();
        let tier = match from {
            Place::Host(s) => {
                let at = s as usize * self.slot_values;
                scatter(&self.host[at..at + self.slot_values], kv, block);
                Tier::Host
            }
            Place::Disk(s) => {
                let Some(values) = self.disk.as_ref().and_then(|d| d.read(s, self.slot_values)) else {
                    return false;
                };
                scatter(&values, kv, block);
                Tier::Disk
            }
            Place::Device(_) => return false,
        };
        self.counters.restored(tier, started.elapsed().as_secs_f64());
        true
    }
}

/// Queues `values` for disk slot `slot`, if there is a disk tier.
fn write_disk(disk: Option<&DiskStore>, counters: &mut TierCounters, slot: u32, values: &[u16]) {
    if let Some(d) = disk {
        d.write(slot, values);
        counters.stored_disk += 1;
    }
}

/// Copies pool block `block` of every layer into `out` (one slot).
fn gather(kv: &KvStorage, block: u32, out: &mut [u16]) {
    let n = kv.block_elems();
    for (l, layer) in out.chunks_exact_mut(2 * n).enumerate() {
        let (k, v) = kv.block(l, block);
        layer[..n].copy_from_slice(k);
        layer[n..].copy_from_slice(v);
    }
}

/// Copies one slot into pool block `block` of every layer.
fn scatter(slot: &[u16], kv: &mut KvStorage, block: u32) {
    let n = kv.block_elems();
    for (l, layer) in slot.chunks_exact(2 * n).enumerate() {
        kv.set_block(l, block, &layer[..n], &layer[n..]);
    }
}

/// Disk stores made by this process, to name their files apart.
static STORES: AtomicUsize = AtomicUsize::new(0);

/// A file of fixed-size slots and the thread that writes them.
struct DiskStore {
    file: Arc<File>,
    path: PathBuf,
    slot_bytes: usize,
    /// Slots whose newest bytes are still on their way to the file.
    pending: Arc<Mutex<HashMap<u32, Arc<Vec<u8>>>>>,
    /// Slots whose last write failed: their contents are unknown.
    failed: Arc<Mutex<HashSet<u32>>>,
    writes: Option<SyncSender<(u32, Arc<Vec<u8>>)>>,
    writer: Option<JoinHandle<()>>,
}

/// Writes queued before the engine waits for the disk (a few hundred MB at most).
const WRITE_QUEUE: usize = 256;

impl DiskStore {
    fn open(dir: &Path, slots: usize, slot_bytes: usize) -> Result<DiskStore, TierError> {
        let err = |source| TierError { dir: dir.display().to_string(), source };
        std::fs::create_dir_all(dir).map_err(err)?;
        sweep_dead(dir);
        let n = STORES.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("pdserve-kv-{}-{n}.bin", std::process::id()));
        let file = File::options().read(true).write(true).create(true).truncate(true).open(&path).map_err(err)?;
        // Sparse: the disk fills only as blocks arrive.
        file.set_len((slots * slot_bytes) as u64).map_err(err)?;
        let file = Arc::new(file);
        let pending: Arc<Mutex<HashMap<u32, Arc<Vec<u8>>>>> = Arc::default();
        let failed: Arc<Mutex<HashSet<u32>>> = Arc::default();
        let (tx, rx) = sync_channel::<(u32, Arc<Vec<u8>>)>(WRITE_QUEUE);
        let (f, p, bad) = (file.clone(), pending.clone(), failed.clone());
        let writer = std::thread::Builder::new()
            .name("pdserve-kv-disk".into())
            .spawn(move || {
                for (slot, bytes) in rx {
                    let ok = f.write_all_at(&bytes, slot as u64 * bytes.len() as u64).is_ok();
                    let mut pending = lock(&p);
                    // A newer write of the same slot may be queued behind this one.
                    if pending.get(&slot).is_some_and(|b| Arc::ptr_eq(b, &bytes)) {
                        pending.remove(&slot);
                    }
                    let mut bad = lock(&bad);
                    if ok {
                        bad.remove(&slot);
                    } else {
                        bad.insert(slot);
                    }
                }
            })
            .map_err(err)?;
        Ok(DiskStore { file, path, slot_bytes, pending, failed, writes: Some(tx), writer: Some(writer) })
    }

    fn write(&self, slot: u32, values: &[u16]) {
        let bytes: Arc<Vec<u8>> = Arc::new(values.iter().flat_map(|v| v.to_le_bytes()).collect());
        lock(&self.pending).insert(slot, bytes.clone());
        if let Some(tx) = &self.writes {
            if tx.send((slot, bytes)).is_err() {
                lock(&self.failed).insert(slot);
            }
        }
    }

    fn read(&self, slot: u32, values: usize) -> Option<Vec<u16>> {
        let queued = lock(&self.pending).get(&slot).cloned();
        let bytes = match queued {
            Some(b) => b.to_vec(),
            None => {
                if lock(&self.failed).contains(&slot) {
                    return None;
                }
                let mut buf = vec![0u8; self.slot_bytes];
                self.file.read_exact_at(&mut buf, slot as u64 * self.slot_bytes as u64).ok()?;
                buf
            }
        };
        (bytes.len() == values * 2).then(|| bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it wrote what is queued.
        self.writes.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes the tier files of processes that no longer run (killed ones cannot).
fn sweep_dead(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix("pdserve-kv-")).and_then(|r| r.split('-').next())
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
