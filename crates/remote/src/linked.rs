//! The two ends of a KV transfer over a link, shared by the in-process router (which
//! owns both ends) and worker processes (each owning one).

use pdserve_engine::batch::KvFrame;
use pdserve_kv_transfer::{Frame, HandoffId, Inbox, KvSink};
use pdserve_types::RequestId;
use pdserve_worker::{FrameRecycler, FrameSink, Worker};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The sending half of one transfer, shared by the frame sink (which sends on the
/// prefill engine's thread) and whoever finishes it once prefill is done.
#[derive(Clone)]
pub struct SharedSink(Arc<Mutex<Option<Box<dyn KvSink>>>>);

impl SharedSink {
    pub fn new(sink: Box<dyn KvSink>) -> SharedSink {
        SharedSink(Arc::new(Mutex::new(Some(sink))))
    }

    fn take(&self) -> Option<Box<dyn KvSink>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// A frame sink for the prefill engine: sends each frame (counting its payload
    /// into `bytes`) until `stop` says the transfer is over; a failed send marks
    /// `broken` and stops the prefill.
    pub fn frame_sink(
        &self,
        hid: HandoffId,
        stop: impl Fn() -> bool + Send + 'static,
        broken: Arc<AtomicBool>,
        bytes: Arc<AtomicU64>,
    ) -> FrameSink {
        let shared = self.0.clone();
        Box::new(move |frame| {
            if broken.load(Ordering::SeqCst) || stop() {
                return false;
            }
            let frame = Frame::from_kv(hid, frame);
            bytes.fetch_add(frame.payload_bytes() as u64, Ordering::Relaxed);
            let mut guard = shared.lock().unwrap_or_else(|e| e.into_inner());
            let ok = guard.as_mut().is_some_and(|s| s.send(frame).is_ok());
            if !ok {
                broken.store(true, Ordering::SeqCst);
            }
            ok
        })
    }

    /// Ends the transfer: true once the receiver holds every frame. Blocks in a
    /// blocking-pool thread, not on the async workers.
    pub async fn finish(&self) -> bool {
        let Some(sink) = self.take() else { return false };
        tokio::task::spawn_blocking(move || sink.finish().is_ok()).await.unwrap_or(false)
    }
}

/// Feeds the frames arriving in `inbox` into `worker`'s reservation for `id`; the task
/// ends true once every frame arrived, false if the transfer broke.
pub fn forward(mut inbox: Inbox, worker: Worker, id: RequestId) -> tokio::task::JoinHandle<bool> {
    let pool = inbox.pool();
    let recycle: FrameRecycler = Arc::new(move |f: KvFrame| pool.recycle(f.k, f.v));
    tokio::spawn(async move {
        loop {
            match inbox.recv().await {
                Ok(Some(f)) => {
                    if worker.frame_recycled(id, f.into_kv(), recycle.clone()).is_err() {
                        return false;
                    }
                }
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    })
}
