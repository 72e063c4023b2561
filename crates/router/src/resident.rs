//! Models loaded when asked for: with `serve --models-max N`, at most N models have
//! workers in memory. A request for a model that is not loaded waits while it loads;
//! when N are loaded, the one asked for least recently is unloaded first, once the
//! requests in flight on it have finished. Which ones go is [`to_unload`], a pure
//! function; [`Residency`] carries it out, one load at a time.

use crate::relay::relay;
use pdserve_protocol::{Event, EventSender, Generate, GenerateRequest, ServeError, TokenStream};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// A model's workers being started: what then serves it, or why nothing can.
pub type Loading = Pin<Box<dyn Future<Output = Result<Arc<dyn Generate>, String>> + Send>>;

/// Starts one model's workers. Dropping what it gave unloads the model.
pub trait Load: Send + Sync + 'static {
    fn load(&self) -> Loading;
}

/// How often an unload looks whether the requests in flight on its model finished.
const DRAIN_POLL: Duration = Duration::from_millis(20);

/// The models of one server and which of them are loaded.
pub struct Residency {
    max: usize,
    slots: Mutex<Vec<Slot>>,
    /// One load (with the unloads that make room for it) at a time.
    turn: tokio::sync::Mutex<()>,
    /// Orders the asks, for least recently used.
    clock: AtomicU64,
    /// The client stall of the relays (see [`crate::Deadlines`]).
    stall: Duration,
    rt: tokio::runtime::Handle,
}

struct Slot {
    name: String,
    load: Arc<dyn Load>,
    loaded: Option<Arc<dyn Generate>>,
    /// Requests in flight on it.
    open: Arc<AtomicUsize>,
    /// When it was last asked for, on the clock.
    used: u64,
}

/// Which loaded models to unload so that `want` fits with at most `max` loaded: none
/// when `want` is loaded, else the least recently used first. `loaded` holds each
/// loaded model's slot and when it was last asked for.
pub fn to_unload(loaded: &[(usize, u64)], want: usize, max: usize) -> Vec<usize> {
    if loaded.iter().any(|&(s, _)| s == want) {
        return Vec::new();
    }
    let excess = (loaded.len() + 1).saturating_sub(max.max(1));
    let mut by_age = loaded.to_vec();
    by_age.sort_by_key(|&(slot, used)| (used, slot));
    by_age.into_iter().take(excess).map(|(slot, _)| slot).collect()
}

impl Residency {
    /// Room for `max` loaded models (at least one); `stall` as the router's.
    pub fn new(max: usize, stall: Duration, rt: tokio::runtime::Handle) -> Arc<Residency> {
        Arc::new(Residency {
            max: max.max(1),
            slots: Mutex::default(),
            turn: tokio::sync::Mutex::new(()),
            clock: AtomicU64::new(0),
            stall,
            rt,
        })
    }

    /// A model `load` starts, not loaded yet: its requests go to the handle.
    pub fn add(self: &Arc<Self>, name: &str, load: Arc<dyn Load>) -> Resident {
        let mut slots = self.lock();
        let slot = Slot { name: name.to_string(), load, loaded: None, open: Arc::default(), used: 0 };
        slots.push(slot);
        Resident { pool: self.clone(), slot: slots.len() - 1 }
    }

    /// The names of the models loaded now.
    pub fn loaded(&self) -> Vec<String> {
        self.lock().iter().filter(|s| s.loaded.is_some()).map(|s| s.name.clone()).collect()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The model in `slot` if it is loaded, counted in flight until the guard drops.
    fn ready(&self, slot: usize) -> Option<(Arc<dyn Generate>, InFlight)> {
        let mut slots = self.lock();
        let s = &mut slots[slot];
        let generate = s.loaded.clone()?;
        s.used = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        s.open.fetch_add(1, Ordering::SeqCst);
        Some((generate, InFlight(s.open.clone())))
    }

    /// The model in `slot`, loaded first if it is not (after unloading what must go
    /// to make room).
    async fn acquire(&self, slot: usize) -> Result<(Arc<dyn Generate>, InFlight), ServeError> {
        loop {
            if let Some(ready) = self.ready(slot) {
                return Ok(ready);
            }
            let _turn = self.turn.lock().await;
            if self.lock()[slot].loaded.is_some() {
                continue;
            }
            for going in self.make_room(slot) {
                going.unload().await;
            }
            let (name, load) = {
                let slots = self.lock();
                (slots[slot].name.clone(), slots[slot].load.clone())
            };
            tracing::info!(model = %name, "loading the model");
            let loaded = load.load().await.map_err(|e| ServeError::Internal(format!("cannot load {name}: {e}")))?;
            tracing::info!(model = %name, "model loaded");
            self.lock()[slot].loaded = Some(loaded);
        }
    }

    /// Takes out of service the models [`to_unload`] names for `want`.
    fn make_room(&self, want: usize) -> Vec<Going> {
        let mut slots = self.lock();
        let loaded: Vec<(usize, u64)> =
            slots.iter().enumerate().filter(|(_, s)| s.loaded.is_some()).map(|(i, s)| (i, s.used)).collect();
        let mut going = Vec::new();
        for i in to_unload(&loaded, want, self.max) {
            let s = &mut slots[i];
            if let Some(generate) = s.loaded.take() {
                going.push(Going { name: s.name.clone(), generate, open: s.open.clone() });
            }
        }
        going
    }
}

/// A model taken out of service, unloaded once its requests in flight finish.
struct Going {
    name: String,
    generate: Arc<dyn Generate>,
    open: Arc<AtomicUsize>,
}

impl Going {
    async fn unload(self) {
        let open = self.open.load(Ordering::SeqCst);
        tracing::info!(model = %self.name, in_flight = open, "unloading the model once its requests finish");
        while self.open.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(DRAIN_POLL).await;
        }
        drop(self.generate);
        tracing::info!(model = %self.name, "model unloaded");
    }
}

/// A request in flight on a model: its model is not unloaded while this lives.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One model of a [`Residency`], loaded or not: what the frontend sends its requests to.
pub struct Resident {
    pool: Arc<Residency>,
    slot: usize,
}

impl Resident {
    /// Loads the model now (a server's first model, before it serves).
    pub async fn preload(&self) -> Result<(), ServeError> {
        self.pool.acquire(self.slot).await.map(drop)
    }

    /// Relays `inner` to `client`, the request counted in flight until it ends.
    fn hold(&self, inner: TokenStream, client: EventSender, open: InFlight) {
        relay(&self.pool.rt, inner, client, self.pool.stall, |_| {}, move |_, _| drop(open), || {});
    }
}

impl Generate for Resident {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        // Loaded: the model's own refusals (admission, ...) answer at once.
        let (client, stream) = TokenStream::for_request(&req.params);
        if let Some((generate, open)) = self.pool.ready(self.slot) {
            self.hold(generate.generate(req)?, client, open);
            return Ok(stream);
        }
        let me = Resident { pool: self.pool.clone(), slot: self.slot };
        self.pool.rt.spawn(async move {
            let started = match me.pool.acquire(me.slot).await {
                _ if client.is_closed() => return,
                Ok((generate, open)) => generate.generate(req).map(|s| (s, open)),
                Err(e) => Err(e),
            };
            match started {
                Ok((inner, open)) => me.hold(inner, client, open),
                Err(e) => drop(client.send(Event::Failed(e))),
            }
        });
        Ok(stream)
    }

    /// A model not loaded is loaded when asked for.
    fn ready(&self) -> bool {
        let slots = self.pool.lock();
        slots[self.slot].loaded.as_ref().is_none_or(|g| g.ready())
    }
}

#[cfg(test)]
mod tests;
