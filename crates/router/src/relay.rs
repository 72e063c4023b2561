//! A hop the router puts between a worker's stream and the client's when it wants to
//! see the first event (to time it), without owning the rest. It also paces the
//! worker to its client: see [`pdserve_protocol::pace`].

use pdserve_protocol::{pace, Event, EventSender, ServeError, TokenStream};
use std::time::Duration;

/// Forwards `inner` to `client` on a task of `rt`, calling `on_first` with the first
/// event and `on_end` once the stream is over, with the tokens forwarded and, if it
/// finished, the prompt tokens served from a prefix cache. `on_lost` runs before a
/// [`ServeError::WorkerLost`] is forwarded (so before the request is moved). A client that leaves drops
/// `inner`, which cancels the request upstream.
/// While `pace::WINDOW` events wait unread in `client`, nothing more is forwarded, so
/// they pile up in `inner` and the worker pauses the sequence; a client that reads
/// nothing for `stall` gets an error and the request is cancelled.
pub fn relay(
    rt: &tokio::runtime::Handle,
    mut inner: TokenStream,
    client: EventSender,
    stall: Duration,
    on_first: impl FnOnce(&Event) + Send + 'static,
    on_end: impl FnOnce(usize, Option<usize>) + Send + 'static,
    on_lost: impl FnOnce() + Send + 'static,
) {
    rt.spawn(async move {
        let (mut on_first, mut on_lost) = (Some(on_first), Some(on_lost));
        let (mut tokens, mut cached) = (0, None);
        loop {
            let ev = tokio::select! {
                ev = inner.next() => ev,
                _ = client.closed() => break,
            };
            let Some(ev) = ev else { break };
            if matches!(ev, Event::Token(_) | Event::Done { .. } | Event::Failed(_)) {
                if let Some(f) = on_first.take() {
                    f(&ev);
                }
            }
            tokens += usize::from(matches!(ev, Event::Token(_)));
            if let Event::Done { usage, .. } = &ev {
                cached = Some(usage.cached_tokens);
            }
            if matches!(ev, Event::Failed(ServeError::WorkerLost(_))) {
                if let Some(f) = on_lost.take() {
                    f();
                }
            }
            if !forward(&client, ev, stall).await {
                break;
            }
        }
        on_end(tokens, cached);
    });
}

/// Sends `ev` to `client` once fewer than `pace::WINDOW` events wait unread there.
/// False when the stream is over: `ev` was its last event, the client left, or it
/// read nothing for `stall` (then it gets an error instead).
pub(crate) async fn forward(client: &EventSender, ev: Event, stall: Duration) -> bool {
    if tokio::time::timeout(stall, client.room(pace::WINDOW)).await.is_err() {
        let e = ServeError::Timeout(format!("the client read nothing for {} s", stall.as_secs()));
        tracing::warn!(unread = client.unread(), "cancelled: the client stopped reading");
        // The channel holds max tokens + 4, so the error always fits.
        let _ = client.send(Event::Failed(e));
        return false;
    }
    let last = ev.is_last();
    client.send(ev).is_ok() && !last
}
