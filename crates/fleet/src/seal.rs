//! What the fleet writes to NATS carries a MAC under the cluster key.
//!
//! Anyone who can reach an unauthenticated NATS server can write the fleet bucket:
//! without this, a stranger could name every worker's role (the plan) or point the
//! fleet at a relay of its own (a node record). A sealed value is
//! `{"body": "<the value's JSON, as a string>", "mac": "<base64 HMAC-SHA256>"}`; the
//! MAC covers the exact bytes of the body and a label per kind of value, so a node
//! record cannot pass for a plan. Readers ignore what does not verify. The workers'
//! KV events and the frontends' traffic samples, on core NATS subjects, are sealed
//! the same way.

use base64::Engine as _;
use pdserve_kv_transfer::ClusterKey;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A plan (the planner's key).
pub const PLAN: &[u8] = b"pdserve-fleet-plan";
/// A node's record.
pub const NODE: &[u8] = b"pdserve-fleet-node";
/// A worker's batch of KV events (`pdserve.kv.<node>`): routers index what it says.
pub const KV_EVENTS: &[u8] = b"pdserve-fleet-kv-events";
/// A frontend's batch of traffic samples (`pdserve.traffic`): planners plan by it.
pub const TRAFFIC: &[u8] = b"pdserve-fleet-traffic";
/// A later stage's record (`stages.<group>.<node>`).
pub const STAGE: &[u8] = b"pdserve-fleet-stage";

#[derive(Serialize, Deserialize)]
struct Envelope {
    body: String,
    mac: String,
}

#[derive(Debug, PartialEq, thiserror::Error)]
pub enum SealError {
    #[error("not a sealed value (written without the cluster token?)")]
    Unsealed,
    #[error("its MAC does not verify under this cluster token")]
    Forged,
}

/// `body` (JSON) sealed under `key` for `label`.
pub fn seal(key: &ClusterKey, label: &[u8], body: &[u8]) -> Vec<u8> {
    let env = Envelope {
        body: String::from_utf8_lossy(body).into_owned(),
        mac: base64::engine::general_purpose::STANDARD.encode(key.prove(label, body)),
    };
    serde_json::to_vec(&env).unwrap_or_default()
}

/// The body of a value sealed under `key` for `label`.
pub fn open(key: &ClusterKey, label: &[u8], bytes: &[u8]) -> Result<Vec<u8>, SealError> {
    let env: Envelope = serde_json::from_slice(bytes).map_err(|_| SealError::Unsealed)?;
    let mac = base64::engine::general_purpose::STANDARD.decode(&env.mac).map_err(|_| SealError::Forged)?;
    match key.verify(label, env.body.as_bytes(), &mac) {
        true => Ok(env.body.into_bytes()),
        false => Err(SealError::Forged),
    }
}

/// The body without checking its MAC: for tools that only show the fleet.
pub fn peek(bytes: &[u8]) -> Result<Vec<u8>, SealError> {
    let env: Envelope = serde_json::from_slice(bytes).map_err(|_| SealError::Unsealed)?;
    Ok(env.body.into_bytes())
}

/// What every reader of the fleet makes of a value: the body sealed in `bytes` for
/// `label` under `key`, parsed as `T` (a plan, a node record, a batch of KV events or
/// of traffic). Without a key the body is read unchecked, for tools that only show.
pub fn open_as<T: DeserializeOwned>(key: Option<&ClusterKey>, label: &[u8], bytes: &[u8]) -> Result<T, String> {
    let body = match key {
        Some(k) => open(k, label, bytes),
        None => peek(bytes),
    };
    let body = body.map_err(|e| e.to_string())?;
    serde_json::from_slice(&body).map_err(|e| format!("does not parse: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_key_and_label_that_sealed_a_value_open_it() {
        let (key, other) = (ClusterKey::random(), ClusterKey::random());
        let sealed = seal(&key, PLAN, br#"{"holder":"p"}"#);
        assert_eq!(open(&key, PLAN, &sealed).unwrap(), br#"{"holder":"p"}"#);
        assert_eq!(open(&other, PLAN, &sealed), Err(SealError::Forged));
        assert_eq!(open(&key, NODE, &sealed), Err(SealError::Forged));
        assert_eq!(open(&key, PLAN, br#"{"holder":"rogue"}"#), Err(SealError::Unsealed));
        let tampered = String::from_utf8(sealed).unwrap().replace("\\\"p\\\"", "\\\"q\\\"");
        assert_eq!(open(&key, PLAN, tampered.as_bytes()), Err(SealError::Forged));
        assert_eq!(peek(tampered.as_bytes()).unwrap(), br#"{"holder":"q"}"#);
    }
}
