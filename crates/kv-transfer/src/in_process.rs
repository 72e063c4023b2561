//! Sender and receiver in one process: each frame moves, payload and all, through the
//! handoff's bounded channel. Nothing is encoded, copied or checksummed.

use crate::inbox::Feed;
use crate::{Frame, HandoffId, HandoffToken, Inboxes, KvSink, KvTransport, Share, TransferError, TransportKind};

/// Delivers straight into a decode worker's [`Inboxes`] in this process.
#[derive(Clone)]
pub struct InProcess {
    inboxes: Inboxes,
}

impl InProcess {
    pub fn new(inboxes: Inboxes) -> InProcess {
        InProcess { inboxes }
    }
}

impl KvTransport for InProcess {
    fn open(&self, id: HandoffId, token: HandoffToken) -> Result<Box<dyn KvSink>, TransferError> {
        let feed = self.inboxes.claim(id, token, Share::Main).ok_or(TransferError::ReceiverGone(id))?;
        Ok(Box::new(InProcessSink { id, feed: Some(feed) }))
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Inproc
    }
}

struct InProcessSink {
    id: HandoffId,
    /// `None` once the handoff ended.
    feed: Option<Feed>,
}

impl KvSink for InProcessSink {
    fn send(&mut self, frame: Frame) -> Result<(), TransferError> {
        if frame.handoff != self.id {
            return Err(TransferError::WrongHandoff { sink: self.id, frame: frame.handoff });
        }
        frame.check().map_err(TransferError::Frame)?;
        let feed = self.feed.as_ref().ok_or(TransferError::ReceiverGone(self.id))?;
        if feed.blocking_deliver(vec![frame]).is_err() {
            self.feed = None;
            return Err(TransferError::ReceiverGone(self.id));
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<(), TransferError> {
        let feed = self.feed.take().ok_or(TransferError::ReceiverGone(self.id))?;
        if feed.is_gone() {
            return Err(TransferError::ReceiverGone(self.id));
        }
        if let Some(e) = feed.parts_unfinished() {
            feed.end(Err(e.clone()));
            return Err(e);
        }
        feed.end(Ok(()));
        Ok(())
    }

    fn abort(self: Box<Self>) {}
}

impl Drop for InProcessSink {
    fn drop(&mut self) {
        if let Some(feed) = self.feed.take() {
            feed.end(Err(TransferError::Aborted));
        }
    }
}
