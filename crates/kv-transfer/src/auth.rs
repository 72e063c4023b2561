//! Who may talk to a worker's ports: every connection starts with a challenge. The
//! side that accepted sends a random nonce; the side that connected answers with
//! HMAC-SHA256 of the nonce under the cluster's shared secret; a wrong answer closes
//! the connection. The secret itself never crosses the wire.
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

/// What the two ends prove they know, on KV links.
const KV_LABEL: &[u8] = b"pdserve-kv";
/// How long either end waits for the other's part of the exchange.
const EXCHANGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The accepting side: challenges the peer; `Ok` once it answered right.
pub(crate) async fn challenge<R, W>(r: &mut R, w: &mut W, key: &ClusterKey) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use crate::records::{self, to_receiver, to_sender};
    use tokio::io::AsyncWriteExt;
    let n = nonce();
    let mut out = Vec::new();
    records::put(&mut out, to_sender::CHALLENGE, crate::HandoffId(0), &n);
    w.write_all(&out).await?;
    let mut body = Vec::new();
    let rec = tokio::time::timeout(EXCHANGE_TIMEOUT, records::read_async(r, &mut body, records::REPLY_LIMIT))
        .await
        .map_err(|_| records::invalid("no answer to the challenge".into()))??;
    match rec {
        Some(rec) if rec.tag == to_receiver::PROOF && key.verify(KV_LABEL, &n, &body[..rec.len]) => Ok(()),
        _ => Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "wrong cluster token")),
    }
}

/// The connecting side: answers the challenge on a fresh (blocking) connection.
pub(crate) fn answer<S: std::io::Read + std::io::Write>(
    s: &mut S,
    key: &ClusterKey,
) -> Result<(), crate::TransferError> {
    use crate::records::{self, to_receiver, to_sender};
    let mut body = Vec::new();
    let n = match records::read_sync(s, &mut body, records::REPLY_LIMIT)? {
        Some(rec) if rec.tag == to_sender::CHALLENGE && rec.len == NONCE_BYTES => body[..rec.len].to_vec(),
        _ => return Err(crate::TransferError::Disconnected("the receiver sent no challenge".into())),
    };
    let mut out = Vec::new();
    records::put(&mut out, to_receiver::PROOF, crate::HandoffId(0), &key.prove(KV_LABEL, &n));
    s.write_all(&out)?;
    Ok(())
}

/// How long a connecting side waits for the challenge.
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
