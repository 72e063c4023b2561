//! A worker as the router sees it: in this process, or behind a control connection.
//! The router speaks to both the same way; only the KV path of a handoff differs
//! (see [`crate::handoff`]).

use pdserve_protocol::{EventSender, GenerateRequest, ServeError};
use pdserve_remote::RemoteWorker;
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{Worker, WorkerStats};
use tokio::sync::oneshot;

#[derive(Clone)]
pub enum Node {
    Local(Worker),
    Remote(RemoteWorker),
}

impl From<Worker> for Node {
    fn from(w: Worker) -> Node {
        Node::Local(w)
    }
}

impl From<RemoteWorker> for Node {
    fn from(w: RemoteWorker) -> Node {
        Node::Remote(w)
    }
}

impl Node {
    pub fn name(&self) -> &str {
        match self {
            Node::Local(w) => w.name(),
            Node::Remote(w) => w.name(),
        }
    }

    pub fn role(&self) -> Role {
        match self {
            Node::Local(w) => w.role(),
            Node::Remote(w) => w.role(),
        }
    }

    /// Requests in flight there.
    pub fn load(&self) -> usize {
        match self {
            Node::Local(w) => w.load(),
            Node::Remote(w) => w.load(),
        }
    }

    /// Whether the router may send it work (a lost remote worker may not).
    pub fn is_alive(&self) -> bool {
        match self {
            Node::Local(_) => true,
            Node::Remote(w) => w.is_alive(),
        }
    }

    pub fn generate_into(&self, req: GenerateRequest, events: EventSender) -> Result<(), ServeError> {
        match self {
            Node::Local(w) => w.generate_into(req, events),
            Node::Remote(w) => w.generate_into(req, events),
        }
    }

    pub fn reserve(
        &self,
        id: RequestId,
        prompt_len: usize,
    ) -> Result<oneshot::Receiver<Result<(), ServeError>>, ServeError> {
        match self {
            Node::Local(w) => w.reserve(id, prompt_len),
            Node::Remote(w) => w.reserve(id, prompt_len),
        }
    }

    pub fn finish_import(
        &self,
        id: RequestId,
        prompt: Vec<u32>,
        first: u32,
        params: SamplingParams,
        events: EventSender,
    ) -> Result<(), ServeError> {
        match self {
            Node::Local(w) => w.finish_import(id, prompt, first, params, events),
            Node::Remote(w) => w.finish_import(id, prompt, first, params, events),
        }
    }

    pub fn abort_import(&self, id: RequestId) {
        match self {
            Node::Local(w) => w.abort_import(id),
            Node::Remote(w) => w.abort_import(id),
        }
    }

    pub async fn stats(&self) -> Option<WorkerStats> {
        match self {
            Node::Local(w) => w.stats().await,
            Node::Remote(w) => w.stats().await,
        }
    }
}
