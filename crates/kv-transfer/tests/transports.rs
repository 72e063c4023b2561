//! Every transport against the same contract: frames arrive whole and in order per
//! handoff, handoffs sharing a link stay apart, an abort or a vanished receiver ends
//! the handoff on the other side, and nothing hangs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_kv_transfer::{
    measure, measure_copy, measure_copy_twice, measure_raw_shm, measure_raw_tcp, ClusterKey, Frame, HandoffId,
    HandoffToken, InProcess, Inboxes, KvAddr, KvTarget, KvTransport, Links, ShmConfig, ShmReceiver, ShmTransport,
    TcpReceiver, TcpTransport, Throughput, TransferError,
};
use pdserve_types::{KvDtype, KvFrame};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// One block of the default model: 3 KV heads × 16 slots × 64 dims.
const REAL: usize = 3 * 16 * 64;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    InProcess,
    Tcp,
    Shm,
}

const KINDS: [Kind; 3] = [Kind::InProcess, Kind::Tcp, Kind::Shm];

/// A transport and the inboxes it delivers into; the receiver lives as long as this.
struct Pair {
    inboxes: Inboxes,
    transport: Arc<dyn KvTransport>,
    _tcp: Option<TcpReceiver>,
    _shm: Option<ShmReceiver>,
}

fn socket_path() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("pdkv-test-{}-{n}.sock", std::process::id()))
}

/// The cluster secret of the tests' receivers.
fn key() -> ClusterKey {
    static KEY: std::sync::OnceLock<ClusterKey> = std::sync::OnceLock::new();
    KEY.get_or_init(ClusterKey::random).clone()
}

async fn pair(kind: Kind, cfg: ShmConfig) -> Pair {
    let inboxes = Inboxes::guarded(256, key(), 64 << 20);
    let mut p =
        Pair { inboxes: inboxes.clone(), transport: Arc::new(InProcess::new(inboxes.clone())), _tcp: None, _shm: None };
    match kind {
        Kind::InProcess => {}
        Kind::Tcp => {
            let rx = TcpReceiver::bind("127.0.0.1:0", inboxes).await.unwrap();
            let addr = rx.local_addr();
            p.transport = Arc::new(
                tokio::task::spawn_blocking(move || TcpTransport::connect(addr, &key())).await.unwrap().unwrap(),
            );
            p._tcp = Some(rx);
        }
        Kind::Shm => {
            let rx = ShmReceiver::bind(socket_path(), inboxes).await.unwrap();
            let path = rx.path().to_path_buf();
            let t =
                tokio::task::spawn_blocking(move || ShmTransport::connect(path, cfg, &key())).await.unwrap().unwrap();
            p.transport = Arc::new(t);
            p._shm = Some(rx);
        }
    }
    p
}

fn frame(id: HandoffId, layer: u32, index: u32, elems: usize) -> Frame {
    let seed = (id.0 as u16).wrapping_mul(7919) ^ (layer as u16) << 8 ^ index as u16;
    Frame {
        handoff: id,
        layer,
        index,
        // Every stored form crosses every transport.
        dtype: KvDtype::ALL[layer as usize % 3],
        k: (0..elems).map(|i| seed.wrapping_add(i as u16)).collect(),
        v: (0..elems).map(|i| seed ^ (i as u16).rotate_left(3)).collect(),
    }
}

/// The frames of a prompt of `blocks` blocks on a model of `layers` layers, layer-major.
fn prompt(id: HandoffId, layers: u32, blocks: u32, elems: usize) -> Vec<Frame> {
    (0..layers).flat_map(|l| (0..blocks).map(move |b| frame(id, l, b, elems))).collect()
}

/// Sends `frames` as handoff `id` on a plain thread; returns what `finish` said.
fn send(
    t: &Arc<dyn KvTransport>,
    id: HandoffId,
    token: HandoffToken,
    frames: Vec<Frame>,
) -> tokio::task::JoinHandle<Result<(), TransferError>> {
    let t = t.clone();
    tokio::task::spawn_blocking(move || {
        let mut sink = t.open(id, token)?;
        for f in frames {
            sink.send(f)?;
        }
        sink.finish()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_frames_round_trip_through_every_transport() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig { slots: 8, slot_bytes: 16 << 10 }).await;
        for (n, elems) in [(1u64, REAL), (2, 1), (3, 0), (4, 999)] {
            let id = HandoffId(n);
            let mut inbox = p.inboxes.expect(id).unwrap();
            let frames = prompt(id, 30, 8, elems);
            let sender = send(&p.transport, id, inbox.token(), frames.clone());
            for want in &frames {
                assert_eq!(inbox.recv().await.unwrap().as_ref(), Some(want), "{kind:?}");
            }
            assert_eq!(inbox.recv().await.unwrap(), None, "{kind:?}");
            sender.await.unwrap().unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_frames_survive_the_trip() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig::default()).await;
        let id = HandoffId(77);
        let mut inbox = p.inboxes.expect(id).unwrap();
        let kv = KvFrame { layer: 29, index: 31, dtype: KvDtype::F16, k: vec![0x3c00; REAL], v: vec![0xbc00; REAL] };
        send(&p.transport, id, inbox.token(), vec![Frame::from_kv(id, kv.clone())]).await.unwrap().unwrap();
        assert_eq!(inbox.recv().await.unwrap().map(Frame::into_kv), Some(kv), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_handoffs_on_one_link_stay_apart() {
    for kind in KINDS {
        // Fewer slots than frames in flight: senders also contend for slots.
        let p = pair(kind, ShmConfig { slots: 3, slot_bytes: 16 << 10 }).await;
        let ids: Vec<HandoffId> = (10..16).map(HandoffId).collect();
        let mut inboxes: Vec<_> = ids.iter().map(|&id| p.inboxes.expect(id).unwrap()).collect();
        let senders: Vec<_> =
            inboxes.iter().map(|i| send(&p.transport, i.id(), i.token(), prompt(i.id(), 6, 10, REAL))).collect();
        let receivers: Vec<_> = inboxes
            .drain(..)
            .map(|mut inbox| {
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    while let Some(f) = inbox.recv().await.unwrap() {
                        got.push(f);
                    }
                    (inbox.id(), got)
                })
            })
            .collect();
        for s in senders {
            s.await.unwrap().unwrap();
        }
        for r in receivers {
            let (id, got) = r.await.unwrap();
            assert!(got == prompt(id, 6, 10, REAL), "{kind:?}: {id} got {} frames, mixed or out of order", got.len());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_reaches_the_receiver() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig::default()).await;
        // After some frames, explicitly.
        let id = HandoffId(20);
        let mut inbox = p.inboxes.expect(id).unwrap();
        let (t, token) = (p.transport.clone(), inbox.token());
        tokio::task::spawn_blocking(move || {
            let mut sink = t.open(id, token).unwrap();
            sink.send(frame(id, 0, 0, REAL)).unwrap();
            sink.flush().unwrap();
            sink.abort();
        })
        .await
        .unwrap();
        assert_eq!(inbox.recv().await.unwrap(), Some(frame(id, 0, 0, REAL)), "{kind:?}");
        assert!(matches!(inbox.recv().await, Err(TransferError::Aborted)), "{kind:?}");
        // Before any frame, by dropping the sink.
        let id = HandoffId(21);
        let mut inbox = p.inboxes.expect(id).unwrap();
        let (t, token) = (p.transport.clone(), inbox.token());
        tokio::task::spawn_blocking(move || drop(t.open(id, token).unwrap())).await.unwrap();
        assert!(matches!(inbox.recv().await, Err(TransferError::Aborted)), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_without_the_token_delivers_nothing() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig::default()).await;
        let id = HandoffId(60);
        let mut inbox = p.inboxes.expect(id).unwrap();
        // A stranger guessing the id: refused, at open or at the latest at finish.
        let forged = HandoffToken([0x42; 16]);
        let r = send(&p.transport, id, forged, vec![frame(id, 9, 9, REAL)]).await.unwrap();
        assert!(matches!(r, Err(TransferError::ReceiverGone(_))), "{kind:?}: {r:?}");
        // The real sender still owns the handoff, and only its frame arrives.
        send(&p.transport, id, inbox.token(), vec![frame(id, 1, 1, REAL)]).await.unwrap().unwrap();
        assert_eq!(inbox.recv().await.unwrap(), Some(frame(id, 1, 1, REAL)), "{kind:?}");
        assert_eq!(inbox.recv().await.unwrap(), None, "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn senders_and_receivers_without_the_same_cluster_key_never_meet() {
    let inboxes = Inboxes::guarded(16, key(), 64 << 20);
    let tcp = TcpReceiver::bind("127.0.0.1:0", inboxes.clone()).await.unwrap();
    let addr = tcp.local_addr();
    let stranger = ClusterKey::random();
    let other = stranger.clone();
    let r = tokio::task::spawn_blocking(move || TcpTransport::connect(addr, &other)).await.unwrap();
    assert!(r.is_err(), "a sender without the key connected over TCP");
    let shm = ShmReceiver::bind(socket_path(), inboxes.clone()).await.unwrap();
    let (path, other) = (shm.path().to_path_buf(), stranger.clone());
    let r =
        tokio::task::spawn_blocking(move || ShmTransport::connect(path, ShmConfig::default(), &other)).await.unwrap();
    assert!(r.is_err(), "a sender without the key connected over shared memory");
    // A receiver without the key: the sender refuses to send it anything.
    let theirs = Inboxes::guarded(16, stranger, 64 << 20);
    let fake = TcpReceiver::bind("127.0.0.1:0", theirs).await.unwrap();
    let fake_addr = fake.local_addr();
    let r = tokio::task::spawn_blocking(move || TcpTransport::connect(fake_addr, &key())).await.unwrap();
    assert!(r.is_err(), "a sender trusted a receiver without the key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_never_answers_fails_fast_and_then_at_once() {
    // A listener that accepts and then says nothing.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let held: Vec<_> = listener.incoming().take(2).collect();
        std::thread::sleep(std::time::Duration::from_secs(30));
        drop(held);
    });
    let links = Arc::new(Links::new(key()));
    let target = KvTarget::Remote(KvAddr::Tcp(addr));
    let (l, t) = (links.clone(), target.clone());
    let started = std::time::Instant::now();
    let first =
        tokio::task::spawn_blocking(move || l.open(&t, HandoffId(1), HandoffToken([0; 16])).map(drop)).await.unwrap();
    assert!(first.is_err());
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "took {:?}", started.elapsed());
    let again = std::time::Instant::now();
    assert!(links.open(&target, HandoffId(2), HandoffToken([0; 16])).is_err());
    assert!(again.elapsed() < std::time::Duration::from_millis(100), "no cool-down: {:?}", again.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiver_fails_the_sender() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig { slots: 2, slot_bytes: 16 << 10 }).await;
        // The inbox goes away mid-transfer: sending more than the inbox and link buffer
        // would block forever if the sender were not told.
        let id = HandoffId(30);
        let inbox = p.inboxes.expect(id).unwrap();
        let (t, token) = (p.transport.clone(), inbox.token());
        let sender = tokio::task::spawn_blocking(move || {
            let mut sink = t.open(id, token)?;
            for f in prompt(id, 100, 100, REAL) {
                sink.send(f)?;
            }
            sink.finish()
        });
        drop(inbox);
        let r = sender.await.unwrap();
        assert!(matches!(r, Err(TransferError::ReceiverGone(x)) if x == id), "{kind:?}: {r:?}");
        // Never expected at all: the error comes at open or at the latest at finish.
        let r = send(&p.transport, HandoffId(31), HandoffToken([0; 16]), vec![frame(HandoffId(31), 0, 0, REAL)])
            .await
            .unwrap();
        assert!(matches!(r, Err(TransferError::ReceiverGone(_))), "{kind:?}: {r:?}");
        // The link still works for the next handoff.
        let id = HandoffId(32);
        let mut inbox = p.inboxes.expect(id).unwrap();
        send(&p.transport, id, inbox.token(), vec![frame(id, 1, 1, REAL)]).await.unwrap().unwrap();
        assert_eq!(inbox.recv().await.unwrap(), Some(frame(id, 1, 1, REAL)), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_listener_fails_both_sides() {
    for kind in [Kind::Tcp, Kind::Shm] {
        let mut p = pair(kind, ShmConfig::default()).await;
        let id = HandoffId(40);
        let mut inbox = p.inboxes.expect(id).unwrap();
        let (t, token) = (p.transport.clone(), inbox.token());
        let (sent_one, proceed) = std::sync::mpsc::channel::<()>();
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let sender = tokio::task::spawn_blocking(move || {
            let mut sink = t.open(id, token)?;
            sink.send(frame(id, 0, 0, REAL))?;
            // TCP sinks batch frames; this one must be on its way now.
            sink.flush()?;
            sent_one.send(()).unwrap();
            wait.recv().unwrap();
            for f in prompt(id, 100, 100, REAL) {
                sink.send(f)?;
            }
            sink.finish()
        });
        proceed.recv().unwrap();
        assert!(inbox.recv().await.unwrap().is_some());
        p._tcp = None;
        p._shm = None;
        go.send(()).unwrap();
        let r = sender.await.unwrap();
        assert!(matches!(r, Err(TransferError::Disconnected(_))), "{kind:?}: {r:?}");
        assert!(matches!(inbox.recv().await, Err(TransferError::Disconnected(_))), "{kind:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_is_an_error_not_a_panic() {
    for kind in KINDS {
        let p = pair(kind, ShmConfig { slots: 2, slot_bytes: 4096 }).await;
        let id = HandoffId(50);
        let inbox = p.inboxes.expect(id).unwrap();
        assert!(matches!(p.inboxes.expect(id), Err(TransferError::Duplicate(_))));
        let (t, token) = (p.transport.clone(), inbox.token());
        let (wrong, mismatched, big) = tokio::task::spawn_blocking(move || {
            let mut sink = t.open(id, token).unwrap();
            assert!(t.open(id, token).is_err(), "a handoff has one sink");
            let wrong = sink.send(frame(HandoffId(51), 0, 0, 4));
            let mismatched = sink.send(Frame { v: vec![1], ..frame(id, 0, 0, 4) });
            let big = sink.send(frame(id, 0, 0, REAL));
            (wrong, mismatched, big)
        })
        .await
        .unwrap();
        assert!(matches!(wrong, Err(TransferError::WrongHandoff { .. })), "{kind:?}");
        assert!(matches!(mismatched, Err(TransferError::Frame(_))), "{kind:?}: {mismatched:?}");
        if matches!(kind, Kind::Shm) {
            assert!(matches!(big, Err(TransferError::SlotTooSmall { .. })), "{big:?}");
        }
    }
}

/// Prints each transport's throughput next to the bare transport moving the same
/// bytes in the same pieces, as medians of seven alternating runs (this machine's
/// memory and loopback figures drift by tens of percent from run to run); run with
/// `-- --nocapture` to see it, and `KV_BENCH_ONLY="shm 12 KiB frames"` to run one
/// line. Timings are printed, never asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_is_measurable() {
    const BYTES: usize = 128 << 20;
    const ROUNDS: usize = 7;
    let copy = tokio::task::spawn_blocking(|| measure_copy(BYTES)).await.unwrap();
    println!("copy_from_slice            {copy}");
    let only = std::env::var("KV_BENCH_ONLY").ok();
    for kind in KINDS {
        for (label, elems) in [("12 KiB frames", REAL), ("1 MiB frames", 1 << 18)] {
            if only.as_deref().is_some_and(|o| o != format!("{} {label}", t_name(kind))) {
                continue;
            }
            // The real frames go through the segment every worker uses; 1 MiB frames
            // need larger slots.
            let cfg = match elems {
                REAL => ShmConfig::default(),
                _ => ShmConfig { slots: 16, slot_bytes: (4 << 20) + 64 },
            };
            let p = pair(kind, cfg).await;
            let (mut ours, mut raw, mut twice) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..ROUNDS {
                let (t, inboxes) = (p.transport.clone(), p.inboxes.clone());
                let tp = tokio::task::spawn_blocking(move || {
                    if round == 0 {
                        measure(t.as_ref(), &inboxes, 16 << 20, elems)?; // warm-up
                    }
                    measure(t.as_ref(), &inboxes, BYTES, elems)
                })
                .await
                .unwrap()
                .unwrap();
                assert_eq!(tp.bytes as usize, BYTES.div_ceil(4 * elems) * 4 * elems);
                ours.push(tp);
                let piece = 4 * elems;
                match kind {
                    Kind::InProcess => {}
                    Kind::Tcp => raw.push(blocking(move || measure_raw_tcp(BYTES, piece)).await),
                    Kind::Shm => {
                        raw.push(blocking(move || measure_raw_shm(BYTES, piece)).await);
                        twice.push(blocking(move || measure_copy_twice(BYTES, piece)).await);
                    }
                }
            }
            let tp = median(ours);
            let name = t_name(kind);
            if raw.is_empty() {
                println!("{name:<10} {label:<15} {tp}");
                continue;
            }
            let raw = median(raw);
            println!("{name:<10} {label:<15} {tp}; raw {raw}; {:.0} % of raw", 100.0 * tp.gb_per_s() / raw.gb_per_s());
            if !twice.is_empty() {
                let twice = median(twice);
                let pct = 100.0 * tp.gb_per_s() / twice.gb_per_s();
                println!("{:<26} both copies on one thread {twice}; {pct:.0} % of it", "");
            }
        }
    }
}

/// Prints how long each transport takes to move the K/V of a 2,048-token prompt of
/// the default model (30 layers, 3 KV heads of 64) in each cache dtype, as medians of
/// seven runs (docs/benchmarks.md); asserts only the bytes moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompts_handoff_per_dtype_is_measurable() {
    const TOKENS: usize = 2048;
    const FRAMES: usize = 30 * TOKENS / 16;
    // Fewer rounds where the link is slow (scripts/bench-kv-cache.sh's throttled run).
    let rounds = std::env::var("PDSERVE_HANDOFF_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(7);
    for kind in [Kind::Tcp, Kind::Shm] {
        let p = pair(kind, ShmConfig::default()).await;
        for dtype in KvDtype::ALL {
            // Words of one block of one layer: 16 tokens of 3 heads.
            let elems = 3 * 16 * dtype.row_bytes(64).unwrap() / 2;
            let bytes = FRAMES * 4 * elems;
            let mut runs = Vec::new();
            for round in 0..rounds {
                let (t, inboxes) = (p.transport.clone(), p.inboxes.clone());
                let tp = tokio::task::spawn_blocking(move || {
                    if round == 0 {
                        measure(t.as_ref(), &inboxes, bytes, elems)?; // warm-up
                    }
                    measure(t.as_ref(), &inboxes, bytes, elems)
                })
                .await
                .unwrap()
                .unwrap();
                assert_eq!(tp.bytes as usize, bytes);
                runs.push(tp);
            }
            let tp = median(runs);
            println!("{:<5} {dtype:<5} {TOKENS} tokens: {tp}", t_name(kind));
        }
    }
}

async fn blocking(f: impl FnOnce() -> std::io::Result<Throughput> + Send + 'static) -> Throughput {
    tokio::task::spawn_blocking(f).await.unwrap().unwrap()
}

/// The run of median throughput.
fn median(mut runs: Vec<Throughput>) -> Throughput {
    runs.sort_by(|a, b| a.gb_per_s().total_cmp(&b.gb_per_s()));
    runs[runs.len() / 2]
}

fn t_name(kind: Kind) -> &'static str {
    match kind {
        Kind::InProcess => "in-process",
        Kind::Tcp => "tcp",
        Kind::Shm => "shm",
    }
}
