//! Who may talk to a worker's ports: every connection starts with a mutual challenge.
//! Each side sends a random nonce and answers the other's with HMAC-SHA256 of it under
//! the cluster's shared secret; a wrong answer closes the connection. So a receiver
//! takes frames only from a sender that holds the secret, and a sender sends frames
//! only to a receiver that holds it (not to whatever address it was told). The secret
//! itself never crosses the wire.
//!
//! A process started with `--insecure` uses the empty key: the exchange still runs,
//! and any peer can answer it.

use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// Bytes of a challenge nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of an answer (an HMAC-SHA256).
pub const PROOF_BYTES: usize = 32;

/// The cluster's shared secret. Cheap to clone; never printed.
#[derive(Clone, Default)]
pub struct ClusterKey(Arc<[u8]>);

impl ClusterKey {
    /// The key that everyone has: for `--insecure` runs.
    pub fn insecure() -> ClusterKey {
        ClusterKey::default()
    }

    /// A fresh random key, for processes whose two ends are both here (`serve`).
    pub fn random() -> ClusterKey {
        let mut k = [0u8; 32];
        let _ = getrandom::fill(&mut k);
        ClusterKey(Arc::from(&k[..]))
    }

    /// The token in `path` (surrounding whitespace ignored; at least 16 bytes).
    pub fn from_file(path: &Path) -> Result<ClusterKey, String> {
        let text = std::fs::read(path).map_err(|e| format!("cannot read the cluster token {}: {e}", path.display()))?;
        let token = text.trim_ascii();
        if token.len() < 16 {
            return Err(format!("the cluster token in {} is shorter than 16 bytes", path.display()));
        }
        Ok(ClusterKey(Arc::from(token)))
    }

    pub fn is_insecure(&self) -> bool {
        self.0.is_empty()
    }

    /// The answer to `nonce` for the purpose `label` (so an answer for one port or
    /// direction is worthless on another).
    pub fn prove(&self, label: &[u8], nonce: &[u8]) -> [u8; PROOF_BYTES] {
        hmac_sha256(&self.0, &[label, nonce])
    }

    /// Whether `proof` answers `nonce` for `label`, compared in constant time.
    pub fn verify(&self, label: &[u8], nonce: &[u8], proof: &[u8]) -> bool {
        let want = self.prove(label, nonce);
        proof.len() == want.len() && want.iter().zip(proof).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_insecure() { "ClusterKey(insecure)" } else { "ClusterKey(..)" })
    }
}

/// A fresh challenge.
pub fn nonce() -> [u8; NONCE_BYTES] {
    let mut n = [0u8; NONCE_BYTES];
    let _ = getrandom::fill(&mut n);
    n
}

/// HMAC-SHA256 (RFC 2104) of the concatenated `parts`.
fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// What a KV sender proves it knows.
const SENDER_LABEL: &[u8] = b"pdserve-kv-sender";
/// What a KV receiver proves it knows.
const RECEIVER_LABEL: &[u8] = b"pdserve-kv-receiver";
/// How long either end waits for the other's part of the exchange.
const EXCHANGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(3);

fn denied(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, why.to_string())
}

/// The accepting side (a receiver): `Ok` once the sender proved the key.
///
/// ```text
/// sender ── KNOCK{nonce_s} ──────────────────────► receiver
///        ◄── CHALLENGE{nonce_r, proof of nonce_s} ─
///        ── PROOF{proof of nonce_r} ─────────────►
/// ```
pub(crate) async fn challenge<R, W>(r: &mut R, w: &mut W, key: &ClusterKey) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use crate::records::{self, to_receiver, to_sender};
    use tokio::io::AsyncWriteExt;
    let mut body = Vec::new();
    let next = async |r: &mut R, body: &mut Vec<u8>| {
        tokio::time::timeout(EXCHANGE_TIMEOUT, records::read_async(r, body, records::REPLY_LIMIT))
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
        Some(rec) if rec.tag == to_receiver::PROOF && key.verify(SENDER_LABEL, &ours, &body[..rec.len]) => Ok(()),
        _ => Err(denied("wrong cluster token")),
    }
}

/// The connecting side (a sender), on a fresh blocking connection whose read timeout
/// bounds each wait: `Ok` once both sides proved the key.
pub(crate) fn answer<S: std::io::Read + std::io::Write>(
    s: &mut S,
    key: &ClusterKey,
) -> Result<(), crate::TransferError> {
    use crate::records::{self, to_receiver, to_sender};
    let ours = nonce();
    let mut out = Vec::new();
    records::put(&mut out, to_receiver::KNOCK, crate::HandoffId(0), &ours);
    s.write_all(&out)?;
    let mut body = Vec::new();
    let rec = match records::read_sync(s, &mut body, records::REPLY_LIMIT) {
        Ok(Some(rec)) => rec,
        _ => return Err(crate::TransferError::Disconnected("the receiver did not answer the knock".into())),
    };
    let got = &body[..rec.len];
    if rec.tag != to_sender::CHALLENGE || got.len() != NONCE_BYTES + PROOF_BYTES {
        return Err(crate::TransferError::Disconnected("the receiver sent no challenge".into()));
    }
    let (theirs, proof) = got.split_at(NONCE_BYTES);
    if !key.verify(RECEIVER_LABEL, &ours, proof) {
        return Err(crate::TransferError::Disconnected("the receiver does not hold the cluster token".into()));
    }
    out.clear();
    records::put(&mut out, to_receiver::PROOF, crate::HandoffId(0), &key.prove(SENDER_LABEL, theirs));
    s.write_all(&out)?;
    Ok(())
}

/// How long a connecting side waits for each step of the exchange.
pub(crate) fn exchange_timeout() -> std::time::Duration {
    EXCHANGE_TIMEOUT
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2.
        let mac = hmac_sha256(b"Jefe", &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 6: a key longer than the block.
        let mac = hmac_sha256(&[0xaa; 131], &[b"Test Using Larger Than Block-Size Key - Hash Key First"]);
        assert_eq!(hex(&mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn a_proof_holds_only_for_its_key_label_and_nonce() {
        let k = ClusterKey(Arc::from(&b"0123456789abcdef"[..]));
        let n = nonce();
        let p = k.prove(b"kv", &n);
        assert!(k.verify(b"kv", &n, &p));
        assert!(!k.verify(b"control", &n, &p));
        assert!(!k.verify(b"kv", &nonce(), &p));
        assert!(!ClusterKey::random().verify(b"kv", &n, &p));
        assert!(!k.verify(b"kv", &n, &p[..31]));
    }
}
