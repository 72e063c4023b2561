//! A hop the router puts between a worker's stream and the client's when it wants to
//! see the first event (to time it), without owning the rest.

use pdserve_protocol::{Event, EventSender, TokenStream};

/// Forwards `inner` to `client` on a task of `rt`, calling `on_first` with the first
/// event. A client that leaves drops `inner`, which cancels the request upstream.
pub fn relay(
    rt: &tokio::runtime::Handle,
    mut inner: TokenStream,
    client: EventSender,
    on_first: impl FnOnce(&Event) + Send + 'static,
) {
    rt.spawn(async move {
        let mut on_first = Some(on_first);
        loop {
            let ev = tokio::select! {
                ev = inner.next() => ev,
                _ = client.closed() => return,
            };
            let Some(ev) = ev else { return };
            if matches!(ev, Event::Token(_) | Event::Done { .. } | Event::Failed(_)) {
                if let Some(f) = on_first.take() {
                    f(&ev);
                }
            }
            let last = ev.is_last();
            if client.send(ev).is_err() || last {
                return;
            }
        }
    });
}
