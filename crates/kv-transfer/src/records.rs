//! The records a link carries around frames, on a TCP connection or the control
//! socket of a shared-memory link:
//!
//! ```text
//! len u32 | tag u8 | handoff u64 | body (len - 9 bytes)      all little-endian
//! ```
//!
//! Frames carry their own checksum; a record that cannot be parsed means the stream
//! lost its framing, and the connection is closed.
//!
//! On a TCP connection whose handshake set up a session (any key but the insecure
//! one), each record after the handshake ends with a MAC, counted in `len`:
//!
//! ```text
//! len u32 | tag u8 | handoff u64 | body | mac (32 bytes)
//!                              mac = HMAC-SHA256(session key of the direction,
//!                                                seq u64 | len | tag | handoff | body)
//! ```
//!
//! `seq` counts the direction's records from 0 and is never sent. A record whose MAC
//! fails closes the connection ([`crate::auth::forged`]). Records on the Unix socket of
//! a shared-memory link carry none: both ends are on one host, nothing lies between.

use crate::auth::{self, SessionMac, MAC_BYTES};
use crate::frame::MAX_FRAME_BYTES;
use crate::HandoffId;
use std::io::{self, Read};
use tokio::io::{AsyncRead, AsyncReadExt};

pub const PREFIX_BYTES: usize = 13;
/// The largest record: a frame of the largest size.
const MAX_RECORD: usize = 9 + MAX_FRAME_BYTES;

/// Sender → receiver.
pub mod to_receiver {
    /// body: one encoded frame.
    pub const FRAME: u8 = 1;
    /// body: slot u32, length u32; the frame lies in that shared-memory slot.
    pub const SLOT: u8 = 2;
    /// body: frames sent u32. The receiver answers with `DONE`.
    pub const END: u8 = 3;
    /// body: empty.
    pub const ABORT: u8 = 4;
    /// body: slots u32, slot bytes u64, segment path. Answered with `WELCOME`.
    pub const HELLO: u8 = 5;
    /// body: the handoff's token (16 bytes). Comes before the handoff's frames; a
    /// token that does not match the receiver's fails the handoff.
    pub const OPEN: u8 = 6;
    /// body: the answer to `CHALLENGE` (32 bytes).
    pub const PROOF: u8 = 7;
    /// body: the sender's nonce (16 bytes), the connection's first record.
    pub const KNOCK: u8 = 8;
}

/// Receiver → sender.
pub mod to_sender {
    /// body: status u8. The handoff failed before its end; stop sending.
    pub const NOTICE: u8 = 16;
    /// body: status u8, frames received u32. The answer to `END`.
    pub const DONE: u8 = 17;
    /// body: slot u32. The receiver has copied the slot out; it may be reused.
    pub const FREE: u8 = 18;
    /// body: status u8 (`DELIVERED` when the segment is mapped).
    pub const WELCOME: u8 = 19;
    /// body: the receiver's nonce (16 bytes) and its answer to `KNOCK` (32 bytes).
    pub const CHALLENGE: u8 = 20;
}

/// How a handoff ended, as the receiver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Delivered = 0,
    /// Nobody expects the handoff, or its inbox was dropped.
    Gone = 1,
    /// A frame failed its checksum or checks.
    Rejected = 2,
    /// `END` counted more frames than arrived.
    Incomplete = 3,
    /// The shared-memory segment could not be used.
    Refused = 4,
}

impl Status {
    pub fn from_u8(b: u8) -> Option<Status> {
        [Status::Delivered, Status::Gone, Status::Rejected, Status::Incomplete, Status::Refused]
            .into_iter()
            .find(|s| *s as u8 == b)
    }
}

/// The fixed part of a record; its body is in the caller's buffer.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub tag: u8,
    pub handoff: HandoffId,
    pub len: usize,
}

/// Appends one record.
pub fn put(out: &mut Vec<u8>, tag: u8, handoff: HandoffId, body: &[u8]) {
    put_with_room(out, tag, handoff, body, 0);
}

/// Appends one record with `room` bytes after its body for its MAC (0 or
/// [`MAC_BYTES`]), filled in by [`seal`] as the record goes out.
pub fn put_with_room(out: &mut Vec<u8>, tag: u8, handoff: HandoffId, body: &[u8], room: usize) {
    out.extend_from_slice(&prefix(tag, handoff, body.len() + room));
    out.extend_from_slice(body);
    out.resize(out.len() + room, 0);
}

/// Fills in the MACs of the whole records in `bytes`, in order, each put with room for
/// one: call it once per record, just before the bytes are written, under whatever
/// orders the writes (the sequence numbers follow the order on the wire).
pub fn seal(bytes: &mut [u8], mac: &mut SessionMac) {
    let mut at = 0;
    while let Some(len) = bytes.get(at..at + 4) {
        let end = at + 4 + u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
        debug_assert!(end <= bytes.len() && end >= at + PREFIX_BYTES + MAC_BYTES, "a record without room for a MAC");
        let Some(record) = bytes.get_mut(at..end) else { return };
        let (covered, tag) = record.split_at_mut(record.len().saturating_sub(MAC_BYTES));
        tag.copy_from_slice(&mac.seal(&[covered]));
        at = end;
    }
}

/// Checks the MAC at the end of a record read under a session; the body's length
/// without it.
fn open(p: &[u8; PREFIX_BYTES], body: &[u8], mac: &mut SessionMac) -> io::Result<usize> {
    let n = body.len().checked_sub(MAC_BYTES).ok_or_else(auth::forged)?;
    match mac.open(&[p, &body[..n]], &body[n..]) {
        true => Ok(n),
        false => Err(auth::forged()),
    }
}

/// The first [`PREFIX_BYTES`] of a record whose body is `body_len` bytes.
pub fn prefix(tag: u8, handoff: HandoffId, body_len: usize) -> [u8; PREFIX_BYTES] {
    let mut p = [0u8; PREFIX_BYTES];
    p[0..4].copy_from_slice(&((9 + body_len) as u32).to_le_bytes());
    p[4] = tag;
    p[5..13].copy_from_slice(&handoff.0.to_le_bytes());
    p
}

/// `extra`: bytes a record may have past `limit` (its MAC), and must have at least.
fn parse_prefix(p: &[u8; PREFIX_BYTES], limit: usize, extra: usize) -> io::Result<Record> {
    let len = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
    if !(9 + extra..=limit.min(MAX_RECORD) + extra).contains(&len) {
        return Err(invalid(format!("record of {len} bytes")));
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&p[5..13]);
    Ok(Record { tag: p[4], handoff: HandoffId(u64::from_le_bytes(id)), len: len - 9 })
}

/// Body bytes read (and buffer grown) at a time: a length prefix alone never
/// allocates more than this.
const GROW: usize = 64 << 10;

/// Reads one record, its body into `body[..record.len]` (grown as the bytes arrive,
/// never shrunk, so it is zeroed only once). A record over `limit` bytes is an error.
/// `None` at a clean end of stream. Under a session (`mac`), the record must end with
/// the MAC of the direction's next record, else the error is [`auth::forged`]'s; its
/// `len` then leaves the MAC out.
pub async fn read_async<R: AsyncRead + Unpin>(
    r: &mut R,
    body: &mut Vec<u8>,
    limit: usize,
    mac: Option<&mut SessionMac>,
) -> io::Result<Option<Record>> {
    let mut p = [0u8; PREFIX_BYTES];
    match r.read_exact(&mut p[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut p[1..]).await?;
    let mut rec = parse_prefix(&p, limit, if mac.is_some() { MAC_BYTES } else { 0 })?;
    let mut filled = 0;
    while filled < rec.len {
        let end = (filled + GROW).min(rec.len);
        if body.len() < end {
            body.resize(end, 0);
        }
        r.read_exact(&mut body[filled..end]).await?;
        filled = end;
    }
    if let Some(mac) = mac {
        rec.len = open(&p, &body[..rec.len], mac)?;
    }
    Ok(Some(rec))
}

/// [`read_async`] for a blocking stream.
pub fn read_sync<R: Read>(
    r: &mut R,
    body: &mut Vec<u8>,
    limit: usize,
    mac: Option<&mut SessionMac>,
) -> io::Result<Option<Record>> {
    let mut p = [0u8; PREFIX_BYTES];
    match r.read_exact(&mut p[..1]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut p[1..])?;
    let mut rec = parse_prefix(&p, limit, if mac.is_some() { MAC_BYTES } else { 0 })?;
    let mut filled = 0;
    while filled < rec.len {
        let end = (filled + GROW).min(rec.len);
        if body.len() < end {
            body.resize(end, 0);
        }
        r.read_exact(&mut body[filled..end])?;
        filled = end;
    }
    if let Some(mac) = mac {
        rec.len = open(&p, &body[..rec.len], mac)?;
    }
    Ok(Some(rec))
}

/// The largest record that carries a frame of `frame_bytes`.
pub const fn record_limit(frame_bytes: usize) -> usize {
    9 + frame_bytes
}

/// Records the sender side reads: answers, challenges, a few bytes each.
pub const REPLY_LIMIT: usize = 4096;

pub fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// A little-endian reader over a record body that fails instead of panicking.
pub struct Body<'a>(pub &'a [u8]);

impl<'a> Body<'a> {
    fn take<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let Some((head, rest)) = self.0.split_first_chunk::<N>() else {
            return Err(invalid(format!("record body too short for {N} more bytes")));
        };
        self.0 = rest;
        Ok(*head)
    }

    pub fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take::<1>()?[0])
    }

    pub fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    pub fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    pub fn status(&mut self) -> io::Result<Status> {
        let b = self.u8()?;
        Status::from_u8(b).ok_or_else(|| invalid(format!("unknown status {b}")))
    }

    pub fn rest(self) -> &'a [u8] {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_prefix_alone_allocates_nothing_and_limits_hold() {
        // Announces 60 MiB, sends 3 bytes: an error, and the buffer never grew past a
        // first step.
        let mut bytes = prefix(to_receiver::FRAME, HandoffId(1), 60 << 20).to_vec();
        bytes.extend_from_slice(b"abc");
        let mut body = Vec::new();
        assert!(read_sync(&mut &bytes[..], &mut body, usize::MAX, None).is_err());
        assert!(body.capacity() <= GROW, "{} bytes allocated", body.capacity());
        // Over the receiver's limit: refused before reading the body.
        let mut ok = Vec::new();
        put(&mut ok, to_receiver::FRAME, HandoffId(1), &[0u8; 100]);
        assert!(read_sync(&mut &ok[..], &mut Vec::new(), record_limit(50), None).is_err());
        assert!(read_sync(&mut &ok[..], &mut Vec::new(), record_limit(100), None).is_ok());
    }

    #[test]
    fn records_round_trip_and_bad_lengths_fail() {
        let mut out = Vec::new();
        put(&mut out, to_receiver::END, HandoffId(7), &5u32.to_le_bytes());
        put(&mut out, to_receiver::ABORT, HandoffId(8), &[]);
        let mut r = &out[..];
        let mut body = Vec::new();
        let a = read_sync(&mut r, &mut body, usize::MAX, None).unwrap().unwrap();
        assert_eq!((a.tag, a.handoff, a.len), (to_receiver::END, HandoffId(7), 4));
        assert_eq!(Body(&body[..a.len]).u32().unwrap(), 5);
        let b = read_sync(&mut r, &mut body, usize::MAX, None).unwrap().unwrap();
        assert_eq!((b.tag, b.handoff, b.len), (to_receiver::ABORT, HandoffId(8), 0));
        assert!(read_sync(&mut r, &mut body, usize::MAX, None).unwrap().is_none());
        let huge = prefix(to_receiver::FRAME, HandoffId(1), MAX_RECORD);
        assert!(read_sync(&mut &huge[..], &mut body, usize::MAX, None).is_err());
        assert!(read_sync(&mut &out[..5], &mut body, usize::MAX, None).is_err(), "a record cut short is an error");
        assert!(Body(&[1, 2]).u32().is_err());
        assert!(Body(&[9]).status().is_err());
    }
}
