//! Link throughput, for the benchmarks: each transport against the bare transport
//! moving the same bytes in the same pieces (docs/benchmarks.md).

use crate::frame::MAX_ELEMS;
use crate::{Frame, HandoffId, HandoffToken, Inboxes, KvSink, KvTarget, KvTransport, Links, TransferError};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

/// Payload bytes moved in a time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    pub bytes: u64,
    pub elapsed: Duration,
}

impl Throughput {
    /// Decimal gigabytes per second.
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

impl fmt::Display for Throughput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mb = self.bytes as f64 / 1e6;
        write!(f, "{mb:.1} MB in {:.2} ms: {:.2} GB/s", self.elapsed.as_secs_f64() * 1e3, self.gb_per_s())
    }
}

/// Sends at least `bytes` of K/V payload as one handoff through `transport`, in frames
/// of `frame_elems` values per K and per V (3072 for a block of the default model),
/// into `inboxes`, which must be where `transport` delivers. Times from opening the
/// sink until a consumer thread has taken every frame out of the inbox. Blocks; run it
/// on a plain thread.
pub fn measure(
    transport: &dyn KvTransport,
    inboxes: &Inboxes,
    bytes: usize,
    frame_elems: usize,
) -> Result<Throughput, TransferError> {
    static PROBES: AtomicU64 = AtomicU64::new(1 << 63);
    let id = HandoffId(PROBES.fetch_add(1, Ordering::Relaxed));
    // Built up front so that only the transfer is timed.
    let frames = probe_frames(id, bytes, frame_elems);
    let mut inbox = inboxes.expect(id)?;
    let token = inbox.token();
    thread::scope(|s| {
        let consumer = s.spawn(move || {
            let mut got = 0u64;
            while let Some(f) = inbox.blocking_recv()? {
                got += f.payload_bytes() as u64;
                // As a decode worker does once the frame is in its cache.
                inboxes.recycle(f.k, f.v);
            }
            Ok::<u64, TransferError>(got)
        });
        let start = Instant::now();
        let sent = transport.open(id, token).and_then(|sink| send_all(sink, frames));
        if sent.is_err() {
            // The sink may never have reached the inbox: end it so the consumer stops.
            if let Some(feed) = inboxes.claim(id, token, crate::Share::Main) {
                feed.end(Err(TransferError::Aborted));
            }
        }
        let got = consumer.join().unwrap_or(Err(TransferError::Aborted));
        let elapsed = start.elapsed();
        drop(sent?);
        Ok(Throughput { bytes: got?, elapsed })
    })
}

/// Times one handoff of at least `bytes` of payload (frames of `frame_elems` values
/// per K and per V) through `links` to a receiver elsewhere, which holds a
/// reservation for `id` under `token` that throws the frames away: from opening the
/// sink until the receiver has acknowledged the last frame. A small handoff times
/// the link's round trip, a large one its rate. Blocks; run it off the async workers.
pub fn probe(
    links: &Links,
    to: &KvTarget,
    id: HandoffId,
    token: HandoffToken,
    bytes: usize,
    frame_elems: usize,
) -> Result<Throughput, TransferError> {
    let frames = probe_frames(id, bytes, frame_elems);
    let bytes = frames.iter().map(|f| f.payload_bytes() as u64).sum();
    let start = Instant::now();
    let sent = links.open(to, id, token).and_then(|sink| send_all(sink, frames));
    let elapsed = start.elapsed();
    drop(sent?);
    Ok(Throughput { bytes, elapsed })
}

/// The frames of a probe of `bytes`, each filled so a checksum over it is not trivial.
fn probe_frames(id: HandoffId, bytes: usize, frame_elems: usize) -> Vec<Frame> {
    let elems = frame_elems.clamp(1, MAX_ELEMS);
    let n = bytes.div_ceil(4 * elems).max(1);
    (0..n)
        .map(|i| {
            let fill = (i as u16) | 1;
            Frame {
                handoff: id,
                layer: 0,
                index: i as u32,
                dtype: pdserve_types::KvDtype::F16,
                k: vec![fill; elems],
                v: vec![!fill; elems],
            }
        })
        .collect()
}

/// Sends every frame; the frames a link hands back are kept, not freed, until the
/// clock has stopped (they are the source, like the raw baselines' source buffer).
fn send_all(mut sink: Box<dyn KvSink>, frames: Vec<Frame>) -> Result<Vec<Frame>, TransferError> {
    let mut sent = Vec::with_capacity(frames.len());
    for f in frames {
        sent.extend(sink.send_returning(f)?);
    }
    sink.finish().map(|()| sent)
}

/// A plain `copy_from_slice` of `bytes` between two pre-faulted buffers: the ceiling
/// a transport's figure compares against.
pub fn measure_copy(bytes: usize) -> Throughput {
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0xa5u8; bytes];
    let start = Instant::now();
    dst.copy_from_slice(&src);
    let elapsed = start.elapsed();
    std::hint::black_box(&dst);
    Throughput { bytes: bytes as u64, elapsed }
}

/// The same bytes over a bare loopback TCP connection, written `chunk` bytes at a time
/// and read on another thread into one reused buffer: no framing, no checksum, no
/// decoding — what the TCP transport is compared with.
pub fn measure_raw_tcp(bytes: usize, chunk: usize) -> io::Result<Throughput> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = thread::spawn(move || -> io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 256 << 10];
        let mut got = 0u64;
        loop {
            match s.read(&mut buf)? {
                0 => return Ok(got),
                n => got += n as u64,
            }
        }
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let data = vec![0x5au8; chunk.max(1)];
    let start = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(data.len());
        s.write_all(&data[..n])?;
        left -= n;
    }
    s.shutdown(Shutdown::Write)?;
    let got = reader.join().map_err(|_| io::Error::other("reader thread panicked"))??;
    Ok(Throughput { bytes: got, elapsed: start.elapsed() })
}

/// The same bytes through a pre-faulted shared-memory ring in `chunk`-byte pieces,
/// between two threads as between two processes: a writer copies each piece from a
/// source as large as the transfer into a free slot and publishes it, a reader copies
/// it out into a destination as large and frees the slot. The two copies every
/// shared-memory transport makes and the least signalling there is (two counters,
/// polled) — no framing, no checksum, no control socket: the bare transport the
/// shared-memory figure compares with.
pub fn measure_raw_shm(bytes: usize, chunk: usize) -> io::Result<Throughput> {
    let chunk = chunk.max(1);
    let (mut ring, src, mut dst) = prefaulted(bytes, chunk)?;
    let ring = Ring { base: ring.as_mut_ptr(), chunk, written: AtomicU64::new(0), read: AtomicU64::new(0) };
    let pieces = bytes.div_ceil(chunk) as u64;
    let start = Instant::now();
    thread::scope(|s| {
        s.spawn(|| {
            for (i, to) in dst.chunks_mut(chunk).enumerate() {
                let i = i as u64;
                wait_until(|| ring.written.load(Ordering::Acquire) > i);
                // SAFETY: slot `i % RING_SLOTS` holds piece `i` (published above) and the
                // writer leaves it alone until `read` passes `i`.
                to.copy_from_slice(unsafe { ring.slot(i, to.len()) });
                ring.read.store(i + 1, Ordering::Release);
            }
        });
        for (i, from) in src.chunks(chunk).enumerate() {
            let i = i as u64;
            wait_until(|| ring.read.load(Ordering::Acquire) + RING_SLOTS as u64 > i);
            // SAFETY: the reader is done with the slot's previous piece (`read` passed
            // it) and reads this one only after `written` says so.
            unsafe { ring.slot_mut(i, from.len()) }.copy_from_slice(from);
            ring.written.store(i + 1, Ordering::Release);
        }
    });
    let elapsed = start.elapsed();
    debug_assert_eq!(ring.read.load(Ordering::Relaxed), pieces);
    std::hint::black_box(&dst);
    Ok(Throughput { bytes: bytes as u64, elapsed })
}

/// The memory bound: each `chunk`-byte piece copied into a ring slot and out again on
/// one thread, with nothing between the copies.
pub fn measure_copy_twice(bytes: usize, chunk: usize) -> io::Result<Throughput> {
    let chunk = chunk.max(1);
    let (mut ring, src, mut dst) = prefaulted(bytes, chunk)?;
    let start = Instant::now();
    for (i, (from, to)) in src.chunks(chunk).zip(dst.chunks_mut(chunk)).enumerate() {
        let at = (i % RING_SLOTS) * chunk;
        let slot = &mut ring[at..at + from.len()];
        slot.copy_from_slice(from);
        to.copy_from_slice(slot);
    }
    let elapsed = start.elapsed();
    std::hint::black_box(&dst);
    Ok(Throughput { bytes: bytes as u64, elapsed })
}

/// Slots of the raw baselines' ring.
const RING_SLOTS: usize = 64;

/// The ring of `chunk`-byte slots, a source and a destination of `bytes`, all written
/// before timing so that no page is faulted in while copying.
fn prefaulted(bytes: usize, chunk: usize) -> io::Result<(memmap2::MmapMut, Vec<u8>, Vec<u8>)> {
    let mut ring = memmap2::MmapMut::map_anon(RING_SLOTS * chunk)?;
    ring.fill(0);
    Ok((ring, vec![0x5au8; bytes], vec![0xa5u8; bytes]))
}

/// A ring of [`RING_SLOTS`] slots shared by one writer and one reader thread.
struct Ring {
    base: *mut u8,
    chunk: usize,
    /// Pieces published by the writer.
    written: AtomicU64,
    /// Pieces the reader is done with.
    read: AtomicU64,
}

// SAFETY: the two threads touch a slot only in turn, ordered by the two counters.
unsafe impl Sync for Ring {}

impl Ring {
    /// # Safety
    /// The caller must be the only one touching piece `i`'s slot.
    unsafe fn slot(&self, i: u64, len: usize) -> &[u8] {
        // SAFETY: slot `i % RING_SLOTS` lies inside the mapping and the caller owns it.
        unsafe { std::slice::from_raw_parts(self.base.add((i % RING_SLOTS as u64) as usize * self.chunk), len) }
    }

    /// # Safety
    /// As for [`Ring::slot`].
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot_mut(&self, i: u64, len: usize) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(self.base.add((i % RING_SLOTS as u64) as usize * self.chunk), len) }
    }
}

/// Polls `ready`, yielding the core after a short spin (two threads, two cores).
fn wait_until(ready: impl Fn() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        if spins < 64 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            thread::yield_now();
        }
    }
}
