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
use pdserve_types::crc32c::crc32c;
use pdserve_types::lock;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
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
    counters: TierCounters,
}

impl TierBytes {
    pub(crate) fn new(kv: &KvStorage, cfg: &TierConfig) -> Result<TierBytes, TierError> {
        let slot_values = kv.n_layers * 2 * kv.block_words();
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
        while !lock(&d.slots).pending.is_empty() {
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

    /// What the tiers did, the disk writer's failures included.
    pub(crate) fn counters(&self) -> TierCounters {
        let Some(d) = &self.disk else { return self.counters };
        let s = lock(&d.slots);
        TierCounters { disk_write_failures: s.write_failures, disk_corrupt: s.corrupt, ..self.counters }
    }

    /// The disk slots whose blocks were lost (a failed write, a bad read) since the
    /// last call: the pool must forget them. Call right after making the pool's
    /// moves, so that every slot still holds the block its last write was for.
    pub(crate) fn take_lost(&self) -> Vec<u32> {
        self.disk.as_ref().map(|d| std::mem::take(&mut lock(&d.slots).lost)).unwrap_or_default()
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
    let n = kv.block_words();
    for (l, layer) in out.chunks_exact_mut(2 * n).enumerate() {
        let (k, v) = kv.block(l, block);
        layer[..n].copy_from_slice(k);
        layer[n..].copy_from_slice(v);
    }
}

/// Copies one slot into pool block `block` of every layer.
fn scatter(slot: &[u16], kv: &mut KvStorage, block: u32) {
    let n = kv.block_words();
    for (l, layer) in slot.chunks_exact(2 * n).enumerate() {
        kv.set_block(l, block, &layer[..n], &layer[n..]);
    }
}

/// A file of fixed-size slots and the thread that writes them.
///
/// The file is unlinked as soon as it is made: only our descriptor reaches it, and
/// the kernel frees its space when the process ends however it ends (the engine's
/// thread is not joined at exit, so a `Drop` would not run).
struct DiskStore {
    file: Arc<File>,
    slot_bytes: usize,
    slots: Arc<Mutex<Slots>>,
    writes: Option<SyncSender<(u32, Arc<Vec<u8>>)>>,
    writer: Option<JoinHandle<()>>,
}

/// What the engine and the writer thread know about the slots.
#[derive(Default)]
struct Slots {
    /// Slots whose newest bytes are still on their way to the file.
    pending: HashMap<u32, Arc<Vec<u8>>>,
    /// The CRC-32C of each slot's bytes in the file; `None`: nothing to read there
    /// (never written, or a write or read failed).
    crc: Vec<Option<u32>>,
    /// Slots whose block was lost since the engine last asked, so the pool can
    /// forget it ([`TierBytes::take_lost`]).
    lost: Vec<u32>,
    write_failures: u64,
    corrupt: u64,
}

/// Writes queued before the engine waits for the disk (a few hundred MB at most).
const WRITE_QUEUE: usize = 256;

impl DiskStore {
    fn open(dir: &Path, slots: usize, slot_bytes: usize) -> Result<DiskStore, TierError> {
        let err = |source| TierError { dir: dir.display().to_string(), source };
        private_dir(dir).map_err(err)?;
        sweep_dead(dir);
        let file = create_unlinked(dir).map_err(err)?;
        // Sparse: the disk fills only as blocks arrive.
        file.set_len((slots * slot_bytes) as u64).map_err(err)?;
        DiskStore::with_file(file, slots, slot_bytes).map_err(err)
    }

    fn with_file(file: File, slots: usize, slot_bytes: usize) -> std::io::Result<DiskStore> {
        let file = Arc::new(file);
        let state = Arc::new(Mutex::new(Slots { crc: vec![None; slots], ..Slots::default() }));
        let (tx, rx) = sync_channel::<(u32, Arc<Vec<u8>>)>(WRITE_QUEUE);
        let (f, s) = (file.clone(), state.clone());
        let writer =
            std::thread::Builder::new().name("pdserve-kv-disk".into()).spawn(move || write_queued(&f, &s, rx))?;
        Ok(DiskStore { file, slot_bytes, slots: state, writes: Some(tx), writer: Some(writer) })
    }

    fn write(&self, slot: u32, values: &[u16]) {
        let bytes: Arc<Vec<u8>> = Arc::new(values.iter().flat_map(|v| v.to_le_bytes()).collect());
        {
            let mut s = lock(&self.slots);
            s.pending.insert(slot, bytes.clone());
            // The pool put a new block in the slot: an older loss is not this one's.
            s.lost.retain(|&l| l != slot);
        }
        let sent = self.writes.as_ref().is_some_and(|tx| tx.send((slot, bytes)).is_ok());
        if !sent {
            let mut s = lock(&self.slots);
            s.pending.remove(&slot);
            s.write_failed(Some(slot), &std::io::Error::other("the disk writer stopped"));
        }
    }

    fn read(&self, slot: u32, values: usize) -> Option<Vec<u16>> {
        let (queued, crc) = {
            let s = lock(&self.slots);
            (s.pending.get(&slot).cloned(), s.crc.get(slot as usize).copied().flatten())
        };
        let bytes = match queued {
            Some(b) => b,
            None => Arc::new(self.read_file(slot, crc?)?),
        };
        (bytes.len() == values * 2).then(|| bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    }

    /// Slot `slot` from the file, if it reads back with checksum `crc`; otherwise the
    /// slot is lost.
    fn read_file(&self, slot: u32, crc: u32) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; self.slot_bytes];
        let why = match self.file.read_exact_at(&mut buf, slot as u64 * self.slot_bytes as u64) {
            Ok(()) if crc32c(&buf) == crc => return Some(buf),
            Ok(()) => "checksum mismatch".to_string(),
            Err(e) => e.to_string(),
        };
        let mut s = lock(&self.slots);
        s.corrupt += 1;
        s.lose(slot);
        if s.corrupt.is_power_of_two() {
            tracing::warn!(slot, corrupt = s.corrupt, "KV disk tier: a block read back bad ({why}); it is recomputed");
        }
        None
    }
}

impl Slots {
    fn lose(&mut self, slot: u32) {
        if let Some(c) = self.crc.get_mut(slot as usize) {
            *c = None;
        }
        self.lost.push(slot);
    }

    /// Counts a failed write; `lost`: the slot it leaves unreadable, if any.
    fn write_failed(&mut self, lost: Option<u32>, e: &std::io::Error) {
        self.write_failures += 1;
        if let Some(slot) = lost {
            self.lose(slot);
        }
        // Once, then ever more rarely: a full disk fails every write.
        if self.write_failures.is_power_of_two() {
            tracing::warn!(
                failures = self.write_failures,
                "KV disk tier: a block write failed ({e}); the block is dropped"
            );
        }
    }
}

/// The writer thread: writes each queued slot and records what came of it.
fn write_queued(file: &File, slots: &Mutex<Slots>, rx: Receiver<(u32, Arc<Vec<u8>>)>) {
    for (slot, bytes) in rx {
        let written = file.write_all_at(&bytes, slot as u64 * bytes.len() as u64);
        let crc = written.is_ok().then(|| crc32c(&bytes));
        let mut s = lock(slots);
        // A newer write of the same slot may be queued behind this one: it decides
        // what the slot holds.
        let newest = s.pending.get(&slot).is_some_and(|b| Arc::ptr_eq(b, &bytes));
        if newest {
            s.pending.remove(&slot);
        }
        match written {
            Ok(()) if newest => s.crc.get_mut(slot as usize).into_iter().for_each(|c| *c = crc),
            Ok(()) => {}
            Err(e) => s.write_failed(newest.then_some(slot), &e),
        }
    }
}

impl Drop for DiskStore {
    fn drop(&mut self) {
        // Closing the queue ends the writer once it wrote what is queued.
        self.writes.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Makes `dir` (0700) if it is missing, and refuses it unless only we can write it:
/// anyone else who could would be able to plant or swap names in it. A symlink is
/// refused too, so the directory checked is the one written.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: String| Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why));
    if meta.file_type().is_symlink() {
        return refuse("a symbolic link; give the directory it points to".into());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o022 != 0 {
        let (uid, mode) = (meta.uid(), meta.mode() & 0o7777);
        return refuse(format!("owned by uid {uid} with mode {mode:o}; give a directory only uid {me} can write"));
    }
    Ok(())
}

/// A new tier file in `dir` (checked by [`private_dir`]), already unlinked.
fn create_unlinked(dir: &Path) -> std::io::Result<File> {
    use std::hash::BuildHasher;
    // Random, so no one can guess the name; the pid lets `sweep_dead` find it.
    let nonce = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    let path = dir.join(format!("pdserve-kv-{}-{nonce:016x}.bin", std::process::id()));
    let file = create_private(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

/// Creates `path` for us alone (0600), failing if anything is there already, a
/// symlink included: O_EXCL never follows one, and O_NOFOLLOW says so twice.
fn create_private(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options().read(true).write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(path)
}

/// Removes the tier files of processes that no longer run: files are unlinked once
/// made, so only one caught in between (or an older pdserve's) is left.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fresh path under the temp directory (nothing there yet).
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pdserve-tiers-unit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Waits until the writer thread wrote every queued slot.
    fn written(d: &DiskStore) {
        let start = Instant::now();
        while !lock(&d.slots).pending.is_empty() {
            assert!(start.elapsed().as_secs() < 10, "the writer is stuck");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn counts(d: &DiskStore) -> (u64, u64) {
        let s = lock(&d.slots);
        (s.write_failures, s.corrupt)
    }

    const VALUES: [u16; 8] = [1, 2, 3, 4, 5, 6, 7, 8];

    #[test]
    fn a_symlink_planted_at_the_file_path_is_not_followed() {
        let dir = scratch("planted");
        private_dir(&dir).unwrap();
        let target = dir.join("precious");
        std::fs::write(&target, b"keep me").unwrap();
        let planted = dir.join("pdserve-kv-1-0.bin");
        std::os::unix::fs::symlink(&target, &planted).unwrap();
        assert!(create_private(&planted).is_err());
        assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_others_can_write_or_a_symlink_to_one_is_refused() {
        let dir = scratch("shared");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = DiskStore::open(&dir, 4, 16).err().unwrap().to_string();
        assert!(err.contains(&dir.display().to_string()) && err.contains("mode 777"), "{err}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = scratch("shared-link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let err = DiskStore::open(&link, 4, 16).err().unwrap().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        assert!(DiskStore::open(&dir, 4, 16).is_ok());
        std::fs::remove_file(&link).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_tier_file_is_private_and_never_left_in_the_directory() {
        let dir = scratch("private");
        let d = DiskStore::open(&dir.join("sub"), 4, 16).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&dir), mode(&dir.join("sub"))), (0o700, 0o700));
        assert_eq!(d.file.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        // Unlinked at once: nothing to leave behind, whatever ends the process.
        assert_eq!(std::fs::read_dir(dir.join("sub")).unwrap().count(), 0);
        d.write(1, &VALUES);
        written(&d);
        assert_eq!(d.read(1, 8).unwrap(), VALUES);
        drop(d);
        assert_eq!(std::fs::read_dir(dir.join("sub")).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_slot_corrupted_on_disk_is_lost_not_returned() {
        let dir = scratch("corrupt");
        let d = DiskStore::open(&dir, 4, 16).unwrap();
        d.write(2, &VALUES);
        written(&d);
        assert_eq!(d.read(2, 8).unwrap(), VALUES);
        d.file.write_all_at(&[0xff], 2 * 16 + 3).unwrap();
        assert_eq!(d.read(2, 8), None);
        assert_eq!(counts(&d), (0, 1));
        assert_eq!(lock(&d.slots).lost, [2]);
        // Known lost now: not read, nor counted, again.
        assert_eq!(d.read(2, 8), None);
        assert_eq!(counts(&d), (0, 1));
        // A new block in the slot reads back, and the old loss is moot.
        d.write(2, &VALUES);
        written(&d);
        assert_eq!(d.read(2, 8).unwrap(), VALUES);
        assert!(lock(&d.slots).lost.is_empty());
        drop(d);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_write_is_counted_and_its_slot_lost() {
        let dir = scratch("full");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ro");
        std::fs::write(&path, [0u8; 64]).unwrap();
        // Writes to a read-only descriptor fail, as they would on a full disk.
        let d = DiskStore::with_file(File::open(&path).unwrap(), 4, 16).unwrap();
        d.write(3, &VALUES);
        written(&d);
        assert_eq!(d.read(3, 8), None);
        assert_eq!(counts(&d), (1, 0));
        assert_eq!(std::mem::take(&mut lock(&d.slots).lost), [3]);
        drop(d);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
