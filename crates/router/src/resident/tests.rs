use super::*;
use pdserve_protocol::{FinishReason, Usage};
use pdserve_types::{RequestId, SamplingParams};

/// Loaded slots with when each was last asked for, the slot wanted, the most loaded
/// at once, and the slots unloaded.
type Case = (&'static [(usize, u64)], usize, usize, &'static [usize]);

#[test]
fn what_is_unloaded_to_make_room() {
    let cases: &[Case] = &[
        (&[], 0, 1, &[]),
        (&[(0, 5)], 0, 1, &[]),
        (&[(0, 5)], 1, 1, &[0]),
        (&[(0, 5)], 1, 2, &[]),
        (&[(0, 9), (1, 3)], 2, 2, &[1]),
        (&[(0, 3), (1, 9)], 2, 2, &[0]),
        // Already over (max lowered): as many go as make room, oldest first.
        (&[(0, 3), (1, 9), (2, 1)], 3, 1, &[2, 0, 1]),
        (&[(0, 3), (1, 9), (2, 1)], 3, 2, &[2, 0]),
        // The wanted model loaded: nothing goes, whatever the count.
        (&[(0, 3), (1, 9), (2, 1)], 1, 1, &[]),
        // A max of 0 means 1.
        (&[(0, 3)], 1, 0, &[0]),
    ];
    for (loaded, want, max, expect) in cases {
        assert_eq!(to_unload(loaded, *want, *max), *expect, "{loaded:?} want {want} max {max}");
    }
}

/// A model whose streams end when the test says so, counting its loads and drops.
struct Fake {
    name: &'static str,
    loads: Arc<AtomicUsize>,
    alive: Arc<AtomicUsize>,
    /// Streams it answered, held open until the test ends them.
    held: Arc<Mutex<Vec<pdserve_protocol::EventSender>>>,
}

struct Loaded(Arc<AtomicUsize>, Arc<Mutex<Vec<pdserve_protocol::EventSender>>>);

impl Generate for Loaded {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        let (tx, rx) = TokenStream::for_request(&req.params);
        self.1.lock().unwrap().push(tx);
        Ok(rx)
    }

    fn ready(&self) -> bool {
        true
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Load for Fake {
    fn load(&self) -> Loading {
        if self.name == "broken" {
            return Box::pin(async { Err("no such file".to_string()) });
        }
        self.loads.fetch_add(1, Ordering::SeqCst);
        self.alive.fetch_add(1, Ordering::SeqCst);
        let g: Arc<dyn Generate> = Arc::new(Loaded(self.alive.clone(), self.held.clone()));
        Box::pin(async move { Ok(g) })
    }
}

fn request() -> GenerateRequest {
    GenerateRequest {
        fence: None,
        id: RequestId(1),
        tag: "t".into(),
        prompt: vec![1, 2, 3],
        params: SamplingParams { max_tokens: 4, ..Default::default() },
        trace: Default::default(),
    }
}

fn finish(held: &Mutex<Vec<pdserve_protocol::EventSender>>) {
    for tx in held.lock().unwrap().drain(..) {
        let _ = tx.send(Event::Done { reason: FinishReason::Length, usage: Usage::default() });
    }
}

/// With room for one model, asking for the other unloads the first, but only once
/// its request in flight has finished; that request ends whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_is_unloaded_only_after_its_requests_in_flight_finish() {
    let pool = Residency::new(1, Duration::from_secs(30), tokio::runtime::Handle::current());
    let fakes: Vec<Fake> = ["a", "b"]
        .iter()
        .map(|&name| Fake { name, loads: Arc::default(), alive: Arc::default(), held: Arc::default() })
        .collect();
    let (a_alive, a_held) = (fakes[0].alive.clone(), fakes[0].held.clone());
    let (b_loads, b_held) = (fakes[1].loads.clone(), fakes[1].held.clone());
    let handles: Vec<Resident> = fakes.into_iter().map(|f| pool.add(f.name, Arc::new(f))).collect();
    handles[0].preload().await.unwrap();
    assert_eq!(pool.loaded(), ["a"]);

    let mut on_a = handles[0].generate(request()).unwrap();
    let mut on_b = handles[1].generate(request()).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(a_alive.load(Ordering::SeqCst), 1, "a stays while its request runs");
    assert_eq!(b_loads.load(Ordering::SeqCst), 0, "b waits for room");

    finish(&a_held);
    assert!(matches!(on_a.next().await, Some(Event::Done { .. })), "a's request ends whole");
    drop(on_a);
    tokio::time::timeout(Duration::from_secs(5), async {
        while b_held.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("b loads and takes its request");
    assert_eq!(a_alive.load(Ordering::SeqCst), 0, "a was dropped");
    assert_eq!(pool.loaded(), ["b"]);
    finish(&b_held);
    assert!(matches!(on_b.next().await, Some(Event::Done { .. })));
}

/// A model that cannot load fails its request with the reason, and is tried again on
/// the next one.
#[tokio::test]
async fn a_model_that_cannot_load_fails_its_request_with_the_reason() {
    let pool = Residency::new(1, Duration::from_secs(30), tokio::runtime::Handle::current());
    let f = Fake { name: "broken", loads: Arc::default(), alive: Arc::default(), held: Arc::default() };
    let h = pool.add("broken", Arc::new(f));
    let mut s = h.generate(request()).unwrap();
    match s.next().await {
        Some(Event::Failed(ServeError::Internal(why))) => assert!(why.contains("no such file"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(pool.loaded().is_empty());
    assert!(h.ready(), "a model not loaded is still offered");
}
