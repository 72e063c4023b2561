//! Shutting down without losing track of anyone: the frontend counts the requests
//! it is answering, keeps accepting connections while it drains (new requests get
//! 503, as a load balancer expects, rather than a refused connection), and at the
//! grace deadline ends every stream still open with an error event and `[DONE]`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Shared by the handlers and whoever runs the server.
#[derive(Clone)]
pub struct Lifecycle {
    inner: Arc<Inner>,
}

struct Inner {
    draining: AtomicBool,
    /// Requests being answered (their responses not yet complete).
    open: AtomicUsize,
    /// Raised at the grace deadline: streams still open end now.
    cut: watch::Sender<bool>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        let inner =
            Inner { draining: AtomicBool::new(false), open: AtomicUsize::new(0), cut: watch::Sender::new(false) };
        Lifecycle { inner: Arc::new(inner) }
    }
}

impl Lifecycle {
    /// New requests are refused from now on (with 503).
    pub fn drain(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Requests being answered now.
    pub fn open(&self) -> usize {
        self.inner.open.load(Ordering::SeqCst)
    }

    /// Resolves once no request is being answered.
    pub async fn drained(&self) {
        while self.open() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Ends every open stream with an error event and `[DONE]`; whole responses
    /// still waiting answer 503.
    pub fn cut(&self) {
        self.inner.cut.send_replace(true);
    }

    /// Resolves once [`Lifecycle::cut`] was called.
    pub(crate) async fn cut_signal(&self) {
        let mut rx = self.inner.cut.subscribe();
        let _ = rx.wait_for(|cut| *cut).await;
    }

    /// Counts a request as open until the guard drops.
    pub(crate) fn enter(&self) -> Open {
        self.inner.open.fetch_add(1, Ordering::SeqCst);
        Open(self.inner.clone())
    }
}

/// One request being answered.
pub(crate) struct Open(Arc<Inner>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}
