//! The receiving end of one connection (TCP, or a shared-memory control socket):
//! reads records, decodes frames, and routes each to its handoff's inbox.
//!
//! A frame that fails its checks fails only its own handoff (the inbox yields
//! [`TransferError::Corrupt`], the sender is told to stop); the connection goes on. A
//! record that cannot be parsed ends the connection, and every handoff still open on
//! it ends with [`TransferError::Disconnected`]. So does a record that fails the
//! session's MAC (TCP): nothing it carried is delivered.

use crate::auth::{Session, SessionMac, MAC_BYTES};
use crate::frame::{self, Frame};
use crate::inbox::Feed;
use crate::records::{self, to_receiver, to_sender, Body, Record, Status};
use crate::segment::Mapping;
use crate::{HandoffId, HandoffToken, Inboxes, Share, TransferError};
use std::collections::HashMap;
use std::io;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};

/// The byte after an `OPEN`'s token that makes the sink a [part](Share::Part).
pub(crate) const PART: u8 = 1;

/// Answers are flushed at this size at the latest.
const FLUSH_BYTES: usize = 4 << 10;

enum Route {
    Open { feed: Feed, received: u32 },
    Failed(Status),
}

struct Conn<'a> {
    inboxes: &'a Inboxes,
    routes: HashMap<HandoffId, Route>,
    /// Answers not yet written.
    out: Vec<u8>,
    /// `out` holds an answer: it goes out once nothing more is buffered to read.
    urgent: bool,
    /// `out` holds a `FREE` for a sender that sleeps: it goes out at once.
    wake: bool,
    /// Bytes after each answer for its MAC (the connection's session has one).
    room: usize,
    /// Frames of one handoff decoded but not yet in its inbox: they go in together
    /// when the connection has nothing more buffered, when a record of another
    /// handoff comes, or when the inbox's batch is full.
    batch: Option<(HandoffId, Vec<Frame>)>,
}

/// Serves one connection until it ends. `slots` is the shared-memory segment the
/// sender writes frames into; without it, frames arrive inline. With a `session`
/// (`(send, receive)`), every record read must pass its MAC and every answer carries
/// one.
pub async fn serve<R, W>(
    r: &mut BufReader<R>,
    w: &mut W,
    inboxes: &Inboxes,
    slots: Option<&Mapping>,
    session: Session,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (mut sealing, mut opening) = session.unzip();
    let room = if sealing.is_some() { MAC_BYTES } else { 0 };
    let mut conn =
        Conn { inboxes, routes: HashMap::new(), out: Vec::new(), urgent: false, wake: false, room, batch: None };
    let mut body = Vec::new();
    let result = loop {
        let rec = match records::read_async(r, &mut body, inboxes.record_limit(), opening.as_mut()).await {
            Ok(Some(rec)) => rec,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
        };
        if let Err(e) = conn.record(&rec, &body[..rec.len], slots).await {
            break Err(e);
        }
        let idle = r.buffer().is_empty();
        if idle {
            conn.deliver().await;
        }
        if let Err(e) = conn.write_due(w, idle, sealing.as_mut()).await {
            break Err(e);
        }
    };
    let _ = w.flush().await;
    conn.disconnect(&result);
    result
}

impl Conn<'_> {
    /// Acts on one record from the sender; an error ends the connection.
    async fn record(&mut self, rec: &Record, b: &[u8], slots: Option<&Mapping>) -> io::Result<()> {
        match (rec.tag, slots) {
            (to_receiver::FRAME, None) => {
                self.frame(rec.handoff, b, false).await;
                Ok(())
            }
            (to_receiver::SLOT, Some(map)) => self.slot(rec.handoff, Body(b), map).await,
            (to_receiver::END, _) => match Body(b).u32() {
                Ok(sent) => {
                    self.end(rec.handoff, sent).await;
                    Ok(())
                }
                Err(e) => Err(e),
            },
            (to_receiver::ABORT, _) => {
                self.abort(rec.handoff).await;
                Ok(())
            }
            (to_receiver::OPEN, _) => self.open(rec.handoff, b).await,
            (tag, _) => Err(records::invalid(format!("unexpected record {tag}"))),
        }
    }

    /// Writes the buffered answers (sealed, with a session) when they are due: an
    /// answer once nothing more is buffered to read (`idle`), a wake-up at once, and
    /// anything at [`FLUSH_BYTES`].
    async fn write_due<W>(&mut self, w: &mut W, idle: bool, sealing: Option<&mut SessionMac>) -> io::Result<()>
    where
        W: AsyncWrite + Unpin,
    {
        if (idle && self.urgent) || self.wake || self.out.len() >= FLUSH_BYTES {
            if let Some(mac) = sealing {
                records::seal(&mut self.out, mac);
            }
            w.write_all(&self.out).await?;
            self.out.clear();
            self.urgent = false;
            self.wake = false;
        }
        Ok(())
    }

    /// The connection ended (`result`): every handoff still open on it ends as
    /// disconnected.
    fn disconnect(&mut self, result: &io::Result<()>) {
        for (_, route) in self.routes.drain() {
            if let Route::Open { feed, .. } = route {
                let why = match result {
                    Ok(()) => "the sender closed the connection".to_string(),
                    Err(e) => format!("connection failed: {e}"),
                };
                feed.end(Err(TransferError::Disconnected(why)));
            }
        }
    }

    fn answer(&mut self, tag: u8, id: HandoffId, body: &[u8]) {
        records::put_with_room(&mut self.out, tag, id, body, self.room);
        self.urgent = true;
        self.wake |= tag == to_sender::FREE;
    }

    /// A sink opened handoff `id` presenting `token`: its frames go to the inbox that
    /// issued the token; with any other token (or none expected) the handoff fails.
    async fn open(&mut self, id: HandoffId, body: &[u8]) -> io::Result<()> {
        let (token, share) = match body.split_first_chunk::<16>() {
            Some((token, [])) => (token, Share::Main),
            Some((token, [PART])) => (token, Share::Part),
            _ => return Err(records::invalid("OPEN without a 16-byte token".into())),
        };
        self.deliver().await;
        let route = match self.inboxes.claim(id, HandoffToken(*token), share) {
            Some(feed) => Route::Open { feed, received: 0 },
            None => self.fail(id, None, Status::Gone, TransferError::ReceiverGone(id)),
        };
        self.routes.insert(id, route);
        Ok(())
    }

    fn route(&mut self, id: HandoffId) -> Option<Route> {
        self.routes.remove(&id)
    }

    async fn frame(&mut self, id: HandoffId, bytes: &[u8], local: bool) {
        if self.batch.as_ref().is_some_and(|(batched, _)| *batched != id) {
            self.deliver().await;
        }
        if !self.routes.contains_key(&id) {
            // Frames of a handoff this connection never opened go nowhere.
            let route = self.fail(id, None, Status::Gone, TransferError::ReceiverGone(id));
            self.routes.insert(id, route);
        }
        // Frames of a failed handoff are dropped.
        let Some(Route::Open { feed, received }) = self.routes.get_mut(&id) else { return };
        let why = match decode(self.inboxes, bytes, local) {
            Ok(f) if f.handoff == id => {
                *received += 1;
                let max = feed.max_batch();
                let (_, frames) = self.batch.get_or_insert_with(|| (id, Vec::with_capacity(max)));
                frames.push(f);
                if frames.len() >= max {
                    self.deliver().await;
                }
                return;
            }
            Ok(f) => TransferError::WrongHandoff { sink: id, frame: f.handoff },
            Err(e) => TransferError::Corrupt(e),
        };
        if let Some(Route::Open { feed, .. }) = self.routes.remove(&id) {
            self.deliver_before_failing(id, &feed).await;
            let failed = self.fail(id, Some(feed), Status::Rejected, why);
            self.routes.insert(id, failed);
        }
    }

    /// The good frames batched before a bad one still reach the inbox, ahead of the
    /// error (whose route is already out of the map, so `deliver` cannot do it).
    async fn deliver_before_failing(&mut self, id: HandoffId, feed: &Feed) {
        if let Some((_, frames)) = self.batch.take_if(|(batched, _)| *batched == id) {
            let _ = feed.deliver(frames).await;
        }
    }

    /// Hands the batched frames to their inbox.
    async fn deliver(&mut self) {
        let Some((id, frames)) = self.batch.take() else { return };
        // A handoff that failed since its frames were batched keeps its failure.
        let next = match self.routes.remove(&id) {
            Some(Route::Open { feed, received }) => match feed.deliver(frames).await {
                Ok(()) => Route::Open { feed, received },
                Err(_) => self.fail(id, None, Status::Gone, TransferError::ReceiverGone(id)),
            },
            Some(failed) => failed,
            None => return,
        };
        self.routes.insert(id, next);
    }

    async fn slot(&mut self, id: HandoffId, mut b: Body<'_>, map: &Mapping) -> io::Result<()> {
        let slot = b.u32()?;
        let len = b.u32()?;
        // A slot holds frames of one handoff back to back. Past a header that does not
        // parse, the rest goes in as one frame, fails, and fails the handoff.
        let mut bytes = map.slot(slot, len)?;
        while !bytes.is_empty() {
            let n = frame::encoded_len_at(bytes).unwrap_or(bytes.len()).min(bytes.len());
            let (one, rest) = bytes.split_at(n);
            self.frame(id, one, true).await;
            bytes = rest;
        }
        if map.free(slot) {
            self.answer(to_sender::FREE, HandoffId(0), &slot.to_le_bytes());
        }
        Ok(())
    }

    /// Fails handoff `id`: its inbox (if still there) learns why, its sender is told.
    fn fail(&mut self, id: HandoffId, feed: Option<Feed>, status: Status, why: TransferError) -> Route {
        if let Some(feed) = feed {
            feed.end(Err(why));
        }
        self.answer(to_sender::NOTICE, id, &[status as u8]);
        Route::Failed(status)
    }

    async fn end(&mut self, id: HandoffId, sent: u32) {
        self.deliver().await;
        let (status, received) = match self.route(id) {
            None => (Status::Gone, 0),
            Some(Route::Failed(s)) => (s, 0),
            Some(Route::Open { feed, received }) => {
                let unfinished = feed.parts_unfinished();
                if feed.is_gone() {
                    (Status::Gone, received)
                } else if received != sent {
                    feed.end(Err(TransferError::Incomplete { sent, received }));
                    (Status::Incomplete, received)
                } else if let Some(why) = unfinished {
                    feed.end(Err(why));
                    (Status::Incomplete, received)
                } else {
                    feed.end(Ok(()));
                    (Status::Delivered, received)
                }
            }
        };
        let mut body = [status as u8, 0, 0, 0, 0];
        body[1..].copy_from_slice(&received.to_le_bytes());
        self.answer(to_sender::DONE, id, &body);
    }

    async fn abort(&mut self, id: HandoffId) {
        self.deliver().await;
        if let Some(Route::Open { feed, .. }) = self.route(id) {
            feed.end(Err(TransferError::Aborted));
        }
    }
}

/// Frames decode into recycled buffers; only those read from a shared-memory slot
/// may come without a checksum.
fn decode(inboxes: &Inboxes, bytes: &[u8], local: bool) -> Result<Frame, frame::FrameError> {
    let (k, v) = inboxes.buffers();
    frame::decode_reusing(bytes, local, k, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(index: u32) -> Frame {
        Frame {
            handoff: HandoffId(1),
            layer: 0,
            index,
            dtype: pdserve_types::KvDtype::F16,
            k: vec![index as u16; 64],
            v: vec![1; 64],
        }
    }

    /// Records read in one go are batched; a bad frame among them still comes after
    /// the good frames before it, not instead of them.
    #[tokio::test]
    async fn frames_before_a_corrupt_one_are_delivered_first() {
        let inboxes = Inboxes::new(64);
        let mut inbox = inboxes.expect(HandoffId(1)).unwrap();
        let mut input = Vec::new();
        records::put(&mut input, to_receiver::OPEN, HandoffId(1), &inbox.token().0);
        for (i, corrupt) in [(0, false), (1, false), (2, true)] {
            let mut bytes = Vec::new();
            frame(i).encode_into(&mut bytes).unwrap();
            if corrupt {
                bytes[40] ^= 1;
            }
            records::put(&mut input, to_receiver::FRAME, HandoffId(1), &bytes);
        }
        let mut r = BufReader::new(&input[..]);
        let mut answers = Vec::new();
        serve(&mut r, &mut answers, &inboxes, None, None).await.unwrap();
        assert_eq!(inbox.recv().await.unwrap(), Some(frame(0)));
        assert_eq!(inbox.recv().await.unwrap(), Some(frame(1)));
        assert!(matches!(inbox.recv().await, Err(TransferError::Corrupt(_))));
        assert!(!answers.is_empty(), "the sender is told");
    }
}
