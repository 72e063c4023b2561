//! The operations that only ask the worker something and wait for one answer: each
//! is a variant of [`Ask`], the line that serves it, and the client's method that
//! sends it, all here. A new one of these touches this file, the protocol trait that
//! names it and the worker that implements it. (Calls that stream tokens, hold a
//! reservation or move KV keep their own handling in `server.rs` and `client.rs`.)

use crate::client::RemoteWorker;
use pdserve_kv_transfer::HandoffToken;
use pdserve_protocol::{
    Capabilities, KvCursor, KvEventLog, KvEvents, LinkProbe, Reply, RoleSwitch, ServeError, Worker,
};
use pdserve_types::{Assignment, RequestId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Serialize, Deserialize)]
pub enum Ask {
    /// Switch role if the epoch is newer; answers the assignment held after.
    SetRole { to: Assignment },
    /// Hand back the decodes a worker that left decode still runs; answers how many.
    MoveDecodes,
    /// The worker's prefix-cache events after a cursor.
    KvEvents { after: KvCursor },
    /// Open an inbox that throws its frames away, for a peer's link probe; answers
    /// its token.
    ProbeInbox { id: RequestId },
}

impl Ask {
    /// The worker's answer (server side).
    pub(crate) async fn answer(self, w: &dyn Worker) -> Result<Value, ServeError> {
        match self {
            Ask::SetRole { to } => json(w.roles()?.set_role(to).await?),
            Ask::MoveDecodes => json(w.roles()?.move_decodes().await?),
            Ask::KvEvents { after } => json(w.event_log()?.kv_events(after).await?),
            Ask::ProbeInbox { id } => json(w.probes()?.probe_inbox(id).await?),
        }
    }

    /// Sends this to `w` and reads its answer as a `T` (client side).
    fn send<T: serde::de::DeserializeOwned + Send + 'static>(self, w: &RemoteWorker) -> Reply<'static, T> {
        match json(self) {
            Ok(ask) => w.ask_value(ask),
            Err(e) => Box::pin(std::future::ready(Err(e))),
        }
    }
}

fn json(v: impl Serialize) -> Result<Value, ServeError> {
    serde_json::to_value(v).map_err(|e| ServeError::Internal(format!("cannot encode an answer: {e}")))
}

impl RoleSwitch for RemoteWorker {
    fn set_role(&self, to: Assignment) -> Reply<'_, Assignment> {
        Ask::SetRole { to }.send(self)
    }

    fn move_decodes(&self) -> Reply<'_, usize> {
        Ask::MoveDecodes.send(self)
    }
}

impl KvEventLog for RemoteWorker {
    fn kv_events(&self, after: KvCursor) -> Reply<'_, KvEvents> {
        Ask::KvEvents { after }.send(self)
    }
}

impl LinkProbe for RemoteWorker {
    fn probe_inbox(&self, id: RequestId) -> Reply<'_, HandoffToken> {
        Ask::ProbeInbox { id }.send(self)
    }
}
