//! The exchange every KV connection opens with (see `auth` for why): written in
//! `records`, proved with the cluster key. Its own module so that `auth` (keys and
//! MACs) and `records` (the framing, which carries the MACs) need not know each other.

use crate::auth::{nonce, ClusterKey, Session, NONCE_BYTES, PROOF_BYTES};
use crate::records::{self, to_receiver, to_sender};

/// What a KV sender proves it knows.
const SENDER_LABEL: &[u8] = b"pdserve-kv-sender";
/// What a KV receiver proves it knows.
const RECEIVER_LABEL: &[u8] = b"pdserve-kv-receiver";

/// What each side of a channel proves with: distinct per channel, so a proof (or a
/// session) of one is worthless on another.
#[derive(Clone, Copy)]
pub(crate) struct Labels {
    pub connecting: &'static [u8],
    pub accepting: &'static [u8],
}

/// The KV ports'.
pub(crate) const KV: Labels = Labels { connecting: SENDER_LABEL, accepting: RECEIVER_LABEL };
/// How long either end waits for the other's part of the exchange.
const EXCHANGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

fn denied(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, why.to_string())
}

/// The accepting side (a receiver): its session's MACs once the sender proved the key.
///
/// ```text
/// sender ── KNOCK{nonce_s} ──────────────────────► receiver
///        ◄── CHALLENGE{nonce_r, proof of nonce_s} ─
///        ── PROOF{proof of nonce_r} ─────────────►
///   session keys from (key, nonce_s, nonce_r), one per direction; from here on
///   (TCP) every record carries a MAC: see `records`
/// ```
pub(crate) async fn challenge<R, W>(r: &mut R, w: &mut W, key: &ClusterKey) -> std::io::Result<Session>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt;
    let mut body = Vec::new();
    let next = async |r: &mut R, body: &mut Vec<u8>| {
        tokio::time::timeout(EXCHANGE_TIMEOUT, records::read_async(r, body, records::REPLY_LIMIT, None))
            .await
            .map_err(|_| denied("no answer to the challenge"))?
    };
    let theirs = match next(r, &mut body).await? {
        Some(rec) if rec.tag == to_receiver::KNOCK && rec.len == NONCE_BYTES => body[..rec.len].to_vec(),
        _ => return Err(denied("the sender did not knock")),
    };
    let ours = nonce();
    let mut out = Vec::new();
    let mut challenge = ours.to_vec();
    challenge.extend_from_slice(&key.prove(RECEIVER_LABEL, &theirs));
    records::put(&mut out, to_sender::CHALLENGE, crate::HandoffId(0), &challenge);
    w.write_all(&out).await?;
    match next(r, &mut body).await? {
        Some(rec) if rec.tag == to_receiver::PROOF && key.verify(SENDER_LABEL, &ours, &body[..rec.len]) => {
            Ok(key.session(&theirs, &ours, RECEIVER_LABEL, SENDER_LABEL))
        }
        _ => Err(denied("wrong cluster token")),
    }
}

/// The connecting side (a sender), on a fresh blocking connection whose read timeout
/// bounds each wait: its session's MACs once both sides proved the key.
pub(crate) fn answer<S: std::io::Read + std::io::Write>(
    s: &mut S,
    key: &ClusterKey,
) -> Result<Session, crate::TransferError> {
    answer_as(s, key, KV)
}

/// [`answer`] on the channel whose labels are `l`.
pub(crate) fn answer_as<S: std::io::Read + std::io::Write>(
    s: &mut S,
    key: &ClusterKey,
    l: Labels,
) -> Result<Session, crate::TransferError> {
    let ours = nonce();
    let mut out = Vec::new();
    records::put(&mut out, to_receiver::KNOCK, crate::HandoffId(0), &ours);
    s.write_all(&out)?;
    let mut body = Vec::new();
    let rec = match records::read_sync(s, &mut body, records::REPLY_LIMIT, None) {
        Ok(Some(rec)) => rec,
        _ => return Err(crate::TransferError::Disconnected("the receiver did not answer the knock".into())),
    };
    let got = &body[..rec.len];
    if rec.tag != to_sender::CHALLENGE || got.len() != NONCE_BYTES + PROOF_BYTES {
        return Err(crate::TransferError::Disconnected("the receiver sent no challenge".into()));
    }
    let (theirs, proof) = got.split_at(NONCE_BYTES);
    if !key.verify(l.accepting, &ours, proof) {
        return Err(crate::TransferError::Disconnected("the receiver does not hold the cluster token".into()));
    }
    out.clear();
    records::put(&mut out, to_receiver::PROOF, crate::HandoffId(0), &key.prove(l.connecting, theirs));
    s.write_all(&out)?;
    Ok(key.session(&ours, theirs, l.connecting, l.accepting))
}

/// [`challenge`] on a blocking stream whose read timeout bounds each wait, on the
/// channel whose labels are `l`.
pub(crate) fn challenge_blocking<S: std::io::Read + std::io::Write>(
    s: &mut S,
    key: &ClusterKey,
    l: Labels,
) -> std::io::Result<Session> {
    let mut body = Vec::new();
    let theirs = match records::read_sync(s, &mut body, records::REPLY_LIMIT, None)? {
        Some(rec) if rec.tag == to_receiver::KNOCK && rec.len == NONCE_BYTES => body[..rec.len].to_vec(),
        _ => return Err(denied("the sender did not knock")),
    };
    let ours = nonce();
    let mut challenge = ours.to_vec();
    challenge.extend_from_slice(&key.prove(l.accepting, &theirs));
    let mut out = Vec::new();
    records::put(&mut out, to_sender::CHALLENGE, crate::HandoffId(0), &challenge);
    s.write_all(&out)?;
    match records::read_sync(s, &mut body, records::REPLY_LIMIT, None)? {
        Some(rec) if rec.tag == to_receiver::PROOF && key.verify(l.connecting, &ours, &body[..rec.len]) => {
            Ok(key.session(&theirs, &ours, l.accepting, l.connecting))
        }
        _ => Err(denied("wrong cluster token")),
    }
}

/// How long a connecting side waits for each step of the exchange.
pub(crate) fn exchange_timeout() -> std::time::Duration {
    EXCHANGE_TIMEOUT
}
