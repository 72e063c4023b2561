//! Who may talk to a worker's ports: every connection starts with a mutual challenge.
//! Each side sends a random nonce and answers the other's with HMAC-SHA256 of it under
//! the cluster's shared secret; a wrong answer closes the connection. So a receiver
//! takes frames only from a sender that holds the secret, and a sender sends frames
//! only to a receiver that holds it (not to whatever address it was told). The secret
//! itself never crosses the wire.
//!
//! Passing the exchange is not enough to be trusted afterwards: a relay between two
//! honest ends could pass it through untouched and then read or inject messages. So
//! both ends derive a [`SessionMac`] per direction from the cluster key and BOTH
//! nonces, and every message after the exchange carries an HMAC-SHA256 under it over
//! an implicit sequence number (0, 1, 2, … per direction, never sent) and the
//! message's bytes. A message that fails it (forged, altered, replayed, reordered,
//! dropped before it, or reflected from the other direction) closes the connection.
//! Traffic is authenticated, not encrypted: prompts and KV are readable on the wire.
//!
//! A process started with `--insecure` uses the empty key: the exchange still runs,
//! any peer can answer it, and messages carry no MAC (as before sessions had one).

use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

/// Bytes of a challenge nonce.
pub const NONCE_BYTES: usize = 16;
/// Bytes of an answer (an HMAC-SHA256).
pub const PROOF_BYTES: usize = 32;
/// Bytes of a message's MAC (an HMAC-SHA256).
pub const MAC_BYTES: usize = 32;

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

    #[cfg(test)]
    pub(crate) fn of(token: &[u8]) -> ClusterKey {
        ClusterKey(Arc::from(token))
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
        same(&self.prove(label, nonce), proof)
    }

    /// The MACs of a session whose exchange passed, as `(send, receive)` for the end
    /// that sends under `send_label` and receives under `recv_label` (the labels its
    /// exchange proves with: distinct per channel and direction). `first` is the
    /// nonce of the side that spoke first, `second` the other's; both ends derive the
    /// same two keys, and no key repeats across sessions while either side's nonce is
    /// fresh. `None` for the insecure key: its messages carry no MAC.
    pub fn session(
        &self,
        first: &[u8],
        second: &[u8],
        send_label: &[u8],
        recv_label: &[u8],
    ) -> Option<(SessionMac, SessionMac)> {
        if self.is_insecure() {
            return None;
        }
        Some((self.session_mac(send_label, first, second), self.session_mac(recv_label, first, second)))
    }

    fn session_mac(&self, label: &[u8], first: &[u8], second: &[u8]) -> SessionMac {
        // Each variable-length part goes in with its length, so no two different
        // (label, nonce, nonce) triples hash the same bytes.
        let len = |b: &[u8]| (b.len() as u32).to_le_bytes();
        let key = hmac_sha256(&self.0, &[SESSION_LABEL, &len(label), label, &len(first), first, &len(second), second]);
        SessionMac::new(&key)
    }
}

/// What a session key is derived for (never the label of a proof).
const SESSION_LABEL: &[u8] = b"pdserve-session-v1";

/// The MACs of one direction of an authenticated session: the sender [`seal`]s each
/// message, the receiver [`open`]s each in the same order. The sequence number is
/// implicit (each side counts), so a message replayed, reordered or dropped before
/// another fails the receiver's check, as does one sealed for the other direction,
/// another session or another channel (their keys differ). Not encryption.
///
/// [`seal`]: SessionMac::seal
/// [`open`]: SessionMac::open
#[derive(Clone)]
pub struct SessionMac {
    /// SHA-256 already fed the key's inner and outer pads (HMAC's two prefixes).
    inner: Sha256,
    outer: Sha256,
    /// The sequence number of the next message.
    seq: u64,
}

impl SessionMac {
    fn new(key: &[u8; 32]) -> SessionMac {
        let mut k = [0u8; 64];
        k[..32].copy_from_slice(key);
        let mut inner = Sha256::new();
        inner.update(k.map(|b| b ^ 0x36));
        let mut outer = Sha256::new();
        outer.update(k.map(|b| b ^ 0x5c));
        SessionMac { inner, outer, seq: 0 }
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; MAC_BYTES] {
        let mut inner = self.inner.clone();
        inner.update(self.seq.to_le_bytes());
        for p in parts {
            inner.update(p);
        }
        let mut outer = self.outer.clone();
        outer.update(inner.finalize());
        outer.finalize().into()
    }

    /// The MAC of the next message sent, the concatenation of `parts`.
    pub fn seal(&mut self, parts: &[&[u8]]) -> [u8; MAC_BYTES] {
        let mac = self.mac(parts);
        self.seq += 1;
        mac
    }

    /// Whether `mac` is the MAC of the next message received (compared in constant
    /// time). The count moves on only if it is; a caller closes the connection if not.
    pub fn open(&mut self, parts: &[&[u8]], mac: &[u8]) -> bool {
        let ok = same(&self.mac(parts), mac);
        self.seq += u64::from(ok);
        ok
    }
}

impl fmt::Debug for SessionMac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionMac(seq {})", self.seq)
    }
}

/// Why a connection closed: a message failed its session's MAC.
#[derive(Debug)]
struct Forged;

impl fmt::Display for Forged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message failed its session MAC (forged, altered, replayed, reordered or out of its session)")
    }
}

impl std::error::Error for Forged {}

/// The error of a message that failed its session's MAC: the connection is closed.
pub fn forged() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, Forged)
}

/// Whether `e` is [`forged`]'s.
pub fn is_forged(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Forged>())
}

/// `a == b`, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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

/// The MACs of a KV connection, `(send, receive)` for the end that holds them; `None`
/// with the insecure key.
pub(crate) type Session = Option<(SessionMac, SessionMac)>;

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

    fn key() -> ClusterKey {
        ClusterKey(Arc::from(&b"0123456789abcdef"[..]))
    }

    /// Both ends of one session: (initiator's send, receive), (responder's send, receive).
    fn ends(k: &ClusterKey, a: &[u8], b: &[u8]) -> ((SessionMac, SessionMac), (SessionMac, SessionMac)) {
        let first = k.session(a, b, b"i", b"r").unwrap();
        let second = k.session(a, b, b"r", b"i").unwrap();
        (first, second)
    }

    #[test]
    fn a_session_passes_its_messages_in_order_both_ways() {
        let (a, b) = (nonce(), nonce());
        let ((mut i_send, mut i_recv), (mut r_send, mut r_recv)) = ends(&key(), &a, &b);
        for n in 0..5u8 {
            let m = i_send.seal(&[b"call ", &[n]]);
            // Split differently: the MAC is over the bytes, not how they are passed.
            assert!(r_recv.open(&[b"call", b" ", &[n]], &m), "message {n}");
            let m = r_send.seal(&[b"reply", &[n]]);
            assert!(i_recv.open(&[b"reply", &[n]], &m));
        }
        assert!(ClusterKey::insecure().session(&a, &b, b"i", b"r").is_none(), "no MACs without a key");
    }

    #[test]
    fn replayed_reordered_dropped_altered_and_reflected_messages_are_refused() {
        let (a, b) = (nonce(), nonce());
        let ((mut send, _), (_, recv)) = ends(&key(), &a, &b);
        let m0 = send.seal(&[b"zero"]);
        let m1 = send.seal(&[b"one"]);
        let m2 = send.seal(&[b"two"]);

        let mut r = recv.clone();
        assert!(r.open(&[b"zero"], &m0));
        assert!(!r.open(&[b"zero"], &m0), "replayed");
        assert!(r.open(&[b"one"], &m1), "a refused message does not move the count");

        let mut r = recv.clone();
        assert!(!r.open(&[b"one"], &m1), "reordered (one before zero)");
        assert!(!r.clone().open(&[b"two"], &m2), "dropped (zero and one never came)");
        assert!(!r.open(&[b"zerO"], &m0), "altered");
        assert!(!r.open(&[b"zero"], &m0[..31]), "cut short");
        assert!(r.open(&[b"zero"], &m0));

        // Reflected: what the initiator sent, played back to it as if from the responder.
        let ((mut i_send, mut i_recv), _) = ends(&key(), &a, &b);
        let m = i_send.seal(&[b"stats"]);
        assert!(!i_recv.open(&[b"stats"], &m), "wrong direction");
    }

    #[test]
    fn another_session_key_or_channel_does_not_open_a_message() {
        let (a, b) = (nonce(), nonce());
        let ((mut send, _), _) = ends(&key(), &a, &b);
        let m = send.seal(&[b"generate"]);
        // A session with a different nonce on either side: a recorded session replayed.
        assert!(!key().session(&a, &nonce(), b"r", b"i").unwrap().1.open(&[b"generate"], &m));
        assert!(!key().session(&nonce(), &b, b"r", b"i").unwrap().1.open(&[b"generate"], &m));
        // The nonces swapped: the other end's role.
        assert!(!key().session(&b, &a, b"r", b"i").unwrap().1.open(&[b"generate"], &m));
        // Another cluster key, another channel's labels.
        assert!(!ClusterKey::random().session(&a, &b, b"r", b"i").unwrap().1.open(&[b"generate"], &m));
        assert!(!key().session(&a, &b, b"x", b"j").unwrap().1.open(&[b"generate"], &m));
        // The same session does.
        assert!(key().session(&a, &b, b"r", b"i").unwrap().1.open(&[b"generate"], &m));
        assert!(
            is_forged(&forged())
                && !is_forged(&std::io::Error::new(std::io::ErrorKind::PermissionDenied, "wrong cluster token"))
        );
    }

    /// A record's MAC hashes its bytes once: the cost per MiB of KV, printed for the
    /// docs (`--nocapture`), and bounded loosely so a debug build passes too.
    #[test]
    fn a_mac_over_a_mib_is_cheap() {
        let (mut send, _) = key().session(&nonce(), &nonce(), b"i", b"r").unwrap();
        let mib = vec![7u8; 1 << 20];
        let _ = send.seal(&[&mib]);
        let rounds = 20;
        let t = std::time::Instant::now();
        for _ in 0..rounds {
            std::hint::black_box(send.seal(&[std::hint::black_box(&mib)]));
        }
        let per_mib = t.elapsed() / rounds;
        println!("HMAC-SHA256 of 1 MiB: {per_mib:?}");
        assert!(per_mib < std::time::Duration::from_millis(50), "{per_mib:?} per MiB");
    }
}
