//! The worker's two ends of a KV handoff: the sink its engine thread writes a
//! prefill's frames into, and the task that feeds a transfer's arriving frames into
//! the engine's reserved blocks.

use crate::{Command, FrameSink, Inner};
use pdserve_kv_transfer::{Frame, HandoffId, Inbox, KvSink};
use pdserve_types::RequestId;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::task::JoinHandle;

/// A transfer whose frames never all arrive is given up after this long; the
/// router's own deadline normally releases it much sooner.
const IMPORT_TTL: Duration = Duration::from_secs(120);

/// A transfer into this worker.
pub(crate) enum Import {
    /// Blocks asked for; the router may still release them before they are granted.
    Reserving,
    /// A task feeding the transfer's frames into the reservation; it ends `true`
    /// once every frame arrived.
    Receiving(JoinHandle<bool>),
}

/// The sending half of one transfer, shared by the frame sink (which sends on the
/// engine's thread) and the prefill's task, which finishes it once the prefill is
/// done.
pub(crate) struct SharedSink(Arc<Mutex<Option<Box<dyn KvSink>>>>);

impl SharedSink {
    pub fn new(sink: Box<dyn KvSink>) -> SharedSink {
        SharedSink(Arc::new(Mutex::new(Some(sink))))
    }

    /// A frame sink for the engine: sends each frame (counting its payload into
    /// `bytes`) until `stop` is raised; a failed send marks `broken` and stops the
    /// prefill.
    pub fn frame_sink(
        &self,
        hid: HandoffId,
        stop: Arc<AtomicBool>,
        broken: Arc<AtomicBool>,
        bytes: Arc<AtomicU64>,
    ) -> FrameSink {
        let shared = self.0.clone();
        Box::new(move |frame| {
            if broken.load(Ordering::SeqCst) || stop.load(Ordering::SeqCst) {
                return false;
            }
            let frame = Frame::from_kv(hid, frame);
            bytes.fetch_add(frame.payload_bytes() as u64, Ordering::Relaxed);
            let mut guard = shared.lock().unwrap_or_else(PoisonError::into_inner);
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
        let taken = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(sink) = taken else { return false };
        tokio::task::spawn_blocking(move || sink.finish().is_ok()).await.unwrap_or(false)
    }
}

/// Feeds the frames arriving in `inbox` into the reservation of `id`: `true` once
/// every frame arrived, `false` if the transfer broke or outlived [`IMPORT_TTL`]
/// (then the reservation is released).
pub(crate) async fn forward(mut inbox: Inbox, worker: Arc<Inner>, id: RequestId) -> bool {
    let recycle = inbox.pool();
    let feed = async {
        loop {
            match inbox.recv().await {
                Ok(Some(f)) => {
                    let frame = Command::Frame { id, frame: f.into_kv(), recycle: recycle.clone() };
                    if worker.send_waiting(frame).await.is_err() {
                        return false;
                    }
                }
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    };
    match tokio::time::timeout(IMPORT_TTL, feed).await {
        Ok(done) => done,
        Err(_) => {
            tracing::warn!(worker = %worker.info.name, %id, "a KV transfer outlived its time limit; released");
            worker.release(id);
            false
        }
    }
}
