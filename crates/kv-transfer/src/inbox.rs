//! The receiving side: a decode worker's registry of handoffs it expects, fed by any
//! number of transports at once.

use crate::frame::MAX_FRAME_BYTES;
use crate::{ClusterKey, Frame, HandoffId, HandoffToken, Share, TransferError};
use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use tokio::sync::{mpsc, Semaphore};

/// How a handoff ended, set once by a feed before the feed drops its channel.
type End = Arc<Ending>;

#[derive(Default)]
struct Ending {
    result: OnceLock<Result<(), TransferError>>,
    /// The inbox waiting for frames: a failure wakes it even while a part still
    /// holds the channel open.
    waiting: Mutex<Option<Waker>>,
}

impl Ending {
    fn get(&self) -> Option<&Result<(), TransferError>> {
        self.result.get()
    }

    fn set(&self, result: Result<(), TransferError>) {
        let failed = result.is_err();
        if self.result.set(result).is_ok() && failed {
            if let Some(w) = self.waiting.lock().unwrap_or_else(PoisonError::into_inner).take() {
                w.wake();
            }
        }
    }

    fn failed(&self) -> bool {
        matches!(self.get(), Some(Err(_)))
    }
}

/// The handoffs a decode worker expects. Cheap to clone; every transport's receiver
/// delivers into the same one.
#[derive(Clone)]
pub struct Inboxes {
    shared: Arc<Shared>,
}

/// Frames move into an inbox in batches of at most this many: a link that read
/// several frames of one handoff in one go hands them over with one send and one
/// wake-up of the consumer, not one each.
pub(crate) const MAX_BATCH: usize = 64;

/// Payload buffers kept for reuse, at most this many and this many bytes: a steady
/// transfer then decodes into memory that is already mapped and warm.
const POOL_BUFFERS: usize = 4 * MAX_BATCH;
const POOL_BYTES: usize = 32 << 20;

struct Shared {
    /// Frames an inbox holds at most.
    capacity: usize,
    /// What a peer must prove before its frames are read.
    key: ClusterKey,
    /// The largest record a receiver reads: a frame of the served model's size.
    record_limit: usize,
    /// Payload buffers handed back by consumers.
    pool: Mutex<Pool>,
    expected: Mutex<HashMap<HandoffId, Expected>>,
}

/// A handoff expected: the feed its sinks claim copies of, and whether its main
/// sink has claimed one (parts may claim theirs until the main sink's feed is gone).
struct Expected {
    feed: Feed,
    main_claimed: bool,
}

impl Inboxes {
    /// Each handoff buffers up to `capacity` frames before its sender waits.
    /// Inboxes that accept any peer and any frame size up to the format's limit; see
    /// [`Inboxes::guarded`].
    pub fn new(capacity: usize) -> Inboxes {
        Inboxes::guarded(capacity, ClusterKey::insecure(), MAX_FRAME_BYTES)
    }

    /// Inboxes whose receivers let in only peers that prove `key`, and read no frame
    /// larger than `max_frame_bytes` (a block of the served model).
    pub fn guarded(capacity: usize, key: ClusterKey, max_frame_bytes: usize) -> Inboxes {
        let shared = Shared {
            capacity: capacity.max(1),
            key,
            record_limit: crate::records::record_limit(max_frame_bytes.min(MAX_FRAME_BYTES)),
            pool: Mutex::default(),
            expected: Mutex::new(HashMap::new()),
        };
        Inboxes { shared: Arc::new(shared) }
    }

    pub(crate) fn key(&self) -> &ClusterKey {
        &self.shared.key
    }

    /// The largest record this receiver reads.
    pub(crate) fn record_limit(&self) -> usize {
        self.shared.record_limit
    }

    /// Starts expecting handoff `id`; its frames arrive on the returned inbox, from
    /// the one sink that presents the inbox's [`token`](Inbox::token). Dropping the
    /// inbox tells the sender the receiver is gone.
    pub fn expect(&self, id: HandoffId) -> Result<Inbox, TransferError> {
        let mut expected = self.shared.expected.lock().unwrap_or_else(PoisonError::into_inner);
        // One whose main sink claimed it is under way: a retried handoff replaces it
        // here, and the old one's sink keeps its own feed until it ends.
        if expected.get(&id).is_some_and(|e| !e.main_claimed && !e.feed.tx.is_closed()) {
            return Err(TransferError::Duplicate(id));
        }
        // The channel is unbounded; `room` bounds it, in frames.
        let (tx, rx) = mpsc::unbounded_channel();
        let room = Arc::new(Semaphore::new(self.shared.capacity));
        let end = End::default();
        let max_batch = self.shared.capacity.min(MAX_BATCH);
        let token = HandoffToken::random();
        let feed = Feed {
            id,
            tx,
            room: room.clone(),
            max_batch,
            end: end.clone(),
            token,
            share: None,
            parts_open: Arc::default(),
            home: Arc::downgrade(&self.shared),
        };
        expected.insert(id, Expected { feed, main_claimed: false });
        Ok(Inbox { id, token, rx, room, ready: Vec::new().into_iter(), end, shared: self.shared.clone() })
    }

    /// Stops expecting handoff `id` now, even while its inbox is still being dropped
    /// elsewhere, so that the same id can be expected again at once (a retried
    /// handoff). A sink that claimed it already keeps it until it ends.
    pub fn forget(&self, id: HandoffId) {
        self.shared.expected.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    }

    /// Gives a frame's payload buffers back for later frames to be decoded into.
    pub fn recycle(&self, k: Vec<u16>, v: Vec<u16>) {
        let mut pool = self.shared.pool.lock().unwrap_or_else(PoisonError::into_inner);
        pool.put(k);
        pool.put(v);
    }

    /// Buffers to decode a K and a V payload into: recycled ones if there are any.
    pub(crate) fn buffers(&self) -> (Vec<u16>, Vec<u16>) {
        let mut pool = self.shared.pool.lock().unwrap_or_else(PoisonError::into_inner);
        (pool.take(), pool.take())
    }

    /// A feed of an expected handoff for a sink that presents its token: the main
    /// sink's once (the first link to claim it owns it), a part's any number of times
    /// while the main sink has not ended. A wrong token claims nothing and leaves the
    /// handoff to its real senders.
    pub(crate) fn claim(&self, id: HandoffId, token: HandoffToken, share: Share) -> Option<Feed> {
        let mut expected = self.shared.expected.lock().unwrap_or_else(PoisonError::into_inner);
        let e = expected.get_mut(&id).filter(|e| e.feed.token == token && !e.feed.tx.is_closed())?;
        match share {
            Share::Main if e.main_claimed => return None,
            Share::Main => e.main_claimed = true,
            Share::Part => {
                e.feed.parts_open.fetch_add(1, Ordering::AcqRel);
            }
        }
        Some(e.feed.copy(share))
    }
}

#[derive(Default)]
struct Pool {
    buffers: Vec<Vec<u16>>,
    bytes: usize,
}

impl Pool {
    fn put(&mut self, buf: Vec<u16>) {
        let bytes = 2 * buf.capacity();
        if buf.capacity() > 0 && self.buffers.len() < POOL_BUFFERS && self.bytes + bytes <= POOL_BYTES {
            self.bytes += bytes;
            self.buffers.push(buf);
        }
    }

    fn take(&mut self) -> Vec<u16> {
        let buf = self.buffers.pop().unwrap_or_default();
        self.bytes -= 2 * buf.capacity();
        buf
    }
}

/// The frames of one handoff, in the order they were sent.
pub struct Inbox {
    id: HandoffId,
    token: HandoffToken,
    rx: mpsc::UnboundedReceiver<Vec<Frame>>,
    /// Free places for frames; a batch's places come back when it is taken out.
    room: Arc<Semaphore>,
    /// The rest of the batch last taken out.
    ready: std::vec::IntoIter<Frame>,
    end: End,
    shared: Arc<Shared>,
}

impl Inbox {
    pub fn id(&self) -> HandoffId {
        self.id
    }

    /// What the sender must present to deliver into this inbox.
    pub fn token(&self) -> HandoffToken {
        self.token
    }

    /// The registry this inbox belongs to, whose pool takes back frame buffers.
    pub fn pool(&self) -> Inboxes {
        Inboxes { shared: self.shared.clone() }
    }

    /// The next frame; `Ok(None)` once the sender finished and every frame arrived.
    /// An error ends the handoff: the sender aborted, a frame was corrupt or missing,
    /// or the link went down.
    pub async fn recv(&mut self) -> Result<Option<Frame>, TransferError> {
        loop {
            if let Some(f) = self.ready.next() {
                return Ok(Some(f));
            }
            match self.next_batch().await {
                Some(batch) => {
                    self.room.add_permits(batch.len());
                    self.ready = batch.into_iter();
                }
                None => break,
            }
        }
        match self.end.get() {
            Some(Ok(())) => Ok(None),
            Some(Err(e)) => Err(e.clone()),
            None => Err(TransferError::Disconnected("the receiving link stopped".into())),
        }
    }

    /// The next batch of frames; `None` once the channel closed, or the handoff
    /// failed and nothing more is queued.
    async fn next_batch(&mut self) -> Option<Vec<Frame>> {
        std::future::poll_fn(|cx| {
            if let Poll::Ready(batch) = self.rx.poll_recv(cx) {
                return Poll::Ready(batch);
            }
            *self.end.waiting.lock().unwrap_or_else(PoisonError::into_inner) = Some(cx.waker().clone());
            // Looked at after the waker is in place: a failure set since wakes it.
            match self.end.failed() {
                true => Poll::Ready(None),
                false => Poll::Pending,
            }
        })
        .await
    }

    /// [`Inbox::recv`] for a plain thread.
    pub fn blocking_recv(&mut self) -> Result<Option<Frame>, TransferError> {
        // The rest of a batch needs no waker.
        match self.ready.next() {
            Some(f) => Ok(Some(f)),
            None => block_on(self.recv()),
        }
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        // A feed waiting for room learns the inbox is gone.
        self.room.close();
        forget_if_ours(&self.shared, self.id, &self.end);
    }
}

/// Stops expecting handoff `id` if the entry is still the one whose end is `end`
/// (not a retry's).
fn forget_if_ours(shared: &Shared, id: HandoffId, end: &End) {
    let mut expected = shared.expected.lock().unwrap_or_else(PoisonError::into_inner);
    if expected.get(&id).is_some_and(|e| Arc::ptr_eq(&e.feed.end, end)) {
        // The entry's own feed has no share: dropping it here takes no lock.
        expected.remove(&id);
    }
}

/// The producer half of one handoff's inbox, held by the link that claimed it (the
/// expected handoff's entry holds one with no share, to copy for its sinks).
pub(crate) struct Feed {
    id: HandoffId,
    tx: mpsc::UnboundedSender<Vec<Frame>>,
    room: Arc<Semaphore>,
    /// The most frames one `deliver` takes.
    max_batch: usize,
    end: End,
    token: HandoffToken,
    /// The sink's share of the handoff; `None` in the expected handoff's entry.
    share: Option<Share>,
    /// Parts that claimed a feed and have not ended.
    parts_open: Arc<AtomicU32>,
    /// The registry, so that the main sink's feed, dropped, lets no part in after it.
    home: Weak<Shared>,
}

/// The inbox was dropped.
#[derive(Debug)]
pub(crate) struct Gone;

impl Feed {
    /// Hands over up to [`Feed::max_batch`] frames in order, waiting while the
    /// inbox is full.
    pub async fn deliver(&self, frames: Vec<Frame>) -> Result<(), Gone> {
        let n = u32::try_from(frames.len()).map_err(|_| Gone)?;
        debug_assert!(frames.len() <= self.max_batch);
        self.room.acquire_many(n).await.map_err(|_| Gone)?.forget();
        self.tx.send(frames).map_err(|_| Gone)
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    pub fn blocking_deliver(&self, frames: Vec<Frame>) -> Result<(), Gone> {
        block_on(self.deliver(frames))
    }

    pub fn is_gone(&self) -> bool {
        self.tx.is_closed()
    }

    /// Ends the handoff: the inbox yields its remaining frames, then `result`. A
    /// part's failure fails the handoff too; its success is the main sink's to say.
    pub fn end(self, result: Result<(), TransferError>) {
        if result.is_err() || self.share != Some(Share::Part) {
            self.end.set(result);
        }
    }

    /// Why a sink whose own frames all arrived cannot end well: the handoff failed
    /// already (a part failed it), or, for the main sink, a part has not ended.
    pub fn parts_unfinished(&self) -> Option<TransferError> {
        if let Some(Err(e)) = self.end.get() {
            return Some(e.clone());
        }
        let open = self.parts_open.load(Ordering::Acquire);
        let main = self.share == Some(Share::Main);
        (main && open > 0).then(|| TransferError::Disconnected(format!("{open} part(s) of the handoff had not ended")))
    }

    fn copy(&self, share: Share) -> Feed {
        Feed {
            id: self.id,
            tx: self.tx.clone(),
            room: self.room.clone(),
            max_batch: self.max_batch,
            end: self.end.clone(),
            token: self.token,
            share: Some(share),
            parts_open: self.parts_open.clone(),
            home: self.home.clone(),
        }
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        match self.share {
            None => {}
            Some(Share::Part) => {
                self.parts_open.fetch_sub(1, Ordering::AcqRel);
            }
            Some(Share::Main) => {
                if let Some(shared) = self.home.upgrade() {
                    forget_if_ours(&shared, self.id, &self.end);
                }
            }
        }
    }
}

/// Runs a future to completion on this thread. Only for tokio's runtime-agnostic
/// channel operations, which is all the blocking halves need.
pub(crate) fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = pin!(fut);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: u64, index: u32) -> Frame {
        Frame { handoff: HandoffId(id), layer: 0, index, dtype: pdserve_types::KvDtype::F16, k: vec![1], v: vec![2] }
    }

    #[test]
    fn frames_then_the_end() {
        let inboxes = Inboxes::new(4);
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        assert!(matches!(inboxes.expect(HandoffId(1)), Err(TransferError::Duplicate(_))));
        assert!(
            inboxes.claim(HandoffId(1), HandoffToken([0; 16]), Share::Main).is_none(),
            "a wrong token claims nothing"
        );
        let feed = inboxes.claim(HandoffId(1), inbox.token(), Share::Main).unwrap();
        assert!(inboxes.claim(HandoffId(1), inbox.token(), Share::Main).is_none(), "a handoff is claimed once");
        feed.blocking_deliver(vec![frame(1, 0), frame(1, 1)]).unwrap();
        feed.end(Ok(()));
        assert_eq!(inbox.blocking_recv().unwrap(), Some(frame(1, 0)));
        assert_eq!(inbox.blocking_recv().unwrap(), Some(frame(1, 1)));
        assert_eq!(inbox.blocking_recv().unwrap(), None);
    }

    #[test]
    fn a_dropped_inbox_is_unclaimable_and_gone() {
        let inboxes = Inboxes::new(4);
        let dropped = inboxes.expect(HandoffId(2)).unwrap();
        let token = dropped.token();
        drop(dropped);
        assert!(inboxes.claim(HandoffId(2), token, Share::Main).is_none());
        let inbox = inboxes.expect(HandoffId(3)).unwrap();
        let feed = inboxes.claim(HandoffId(3), inbox.token(), Share::Main).unwrap();
        drop(inbox);
        assert!(feed.is_gone());
        assert!(feed.blocking_deliver(vec![frame(3, 0)]).is_err());
    }

    #[test]
    fn a_vanished_feed_reads_as_disconnected() {
        let inboxes = Inboxes::new(4);
        let mut inbox = inboxes.expect(HandoffId(4)).unwrap();
        drop(inboxes.claim(HandoffId(4), inbox.token(), Share::Main));
        assert!(matches!(inbox.blocking_recv(), Err(TransferError::Disconnected(_))));
    }
}
