//! Where a handoff's frames go: the vocabulary lives in `pdserve_types`; an
//! in-process target wraps a worker's [`Inboxes`].

use crate::Inboxes;
pub use pdserve_types::{HandoffToken, InProcTarget, KvAddr, KvTarget, TransportKind};
use std::sync::Arc;

/// The target of `inboxes`, receivers in this process.
pub fn in_proc(inboxes: Inboxes) -> KvTarget {
    KvTarget::InProc(InProcTarget(Arc::new(inboxes)))
}

/// The inboxes an in-process target holds; `None` if another build made it.
pub fn inboxes_of(t: &InProcTarget) -> Option<&Inboxes> {
    t.0.downcast_ref::<Inboxes>()
}
