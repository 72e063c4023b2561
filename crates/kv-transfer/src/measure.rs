//! Link throughput, for `pdserve probe` and the benchmarks: what the router's cost
//! model divides a transfer's bytes by.

use crate::frame::MAX_ELEMS;
use crate::{Frame, HandoffId, Inboxes, KvTransport, TransferError};
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
    let elems = frame_elems.clamp(1, MAX_ELEMS);
    let n = bytes.div_ceil(4 * elems).max(1);
    // Built up front so that only the transfer is timed.
    let frames: Vec<Frame> = (0..n)
        .map(|i| {
            let fill = (i as u16) | 1;
            Frame { handoff: id, layer: 0, index: i as u32, k: vec![fill; elems], v: vec![!fill; elems] }
        })
        .collect();
    let mut inbox = inboxes.expect(id)?;
    thread::scope(|s| {
        let consumer = s.spawn(move || {
            let mut got = 0u64;
            while let Some(f) = inbox.blocking_recv()? {
                got += f.payload_bytes() as u64;
            }
            Ok::<u64, TransferError>(got)
        });
        let start = Instant::now();
        let sent = send_all(transport, id, frames);
        if sent.is_err() {
            // The sink may never have reached the inbox: end it so the consumer stops.
            if let Some(feed) = inboxes.claim(id) {
                feed.end(Err(TransferError::Aborted));
            }
        }
        let got = consumer.join().unwrap_or(Err(TransferError::Aborted));
        let elapsed = start.elapsed();
        sent?;
        Ok(Throughput { bytes: got?, elapsed })
    })
}

fn send_all(transport: &dyn KvTransport, id: HandoffId, frames: Vec<Frame>) -> Result<(), TransferError> {
    let mut sink = transport.open(id)?;
    for f in frames {
        sink.send(f)?;
    }
    sink.finish()
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

/// The same bytes through a pre-faulted shared-memory ring in `chunk`-byte pieces:
/// each piece copied from a source as large as the transfer into a slot and out again
/// into a destination as large (one thread, no signalling): the two copies every
/// shared-memory transport makes, and nothing else.
pub fn measure_raw_shm(bytes: usize, chunk: usize) -> io::Result<Throughput> {
    const SLOTS: usize = 64;
    let chunk = chunk.max(1);
    let mut ring = memmap2::MmapMut::map_anon(SLOTS * chunk)?;
    ring.fill(0);
    // Both written before timing, so no page is faulted in while copying.
    let src = vec![0x5au8; bytes];
    let mut dst = vec![0xa5u8; bytes];
    let start = Instant::now();
    for (i, (from, to)) in src.chunks(chunk).zip(dst.chunks_mut(chunk)).enumerate() {
        let at = (i % SLOTS) * chunk;
        let slot = &mut ring[at..at + from.len()];
        slot.copy_from_slice(from);
        to.copy_from_slice(slot);
    }
    let elapsed = start.elapsed();
    std::hint::black_box(&dst);
    Ok(Throughput { bytes: bytes as u64, elapsed })
}
