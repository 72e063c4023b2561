//! What the router's integration tests share: the real model, workers on it, the
//! prompts, and reading a stream to its end.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::EngineConfig;
use pdserve_engine::loader::{load, LoadedModel};
use pdserve_kv_transfer::{ListenAt, TransportKind};
use pdserve_protocol::{Event, GenerateRequest, TokenStream, Worker};
use pdserve_remote::{RemoteWorker, WorkerServer};
use pdserve_types::{RequestId, Role, SamplingParams};
use pdserve_worker::{LocalWorker, WorkerOptions};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "Once upon a time, there was a little girl who lived in a village near the forest. Every morning she",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];

pub fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| load(&pdserve_engine::models::require_default_model()).unwrap())
}

/// A one-thread worker with 256 blocks on the default model.
pub fn worker(name: &str, role: Role) -> Arc<dyn Worker> {
    Arc::new(local(name, role, 256))
}

/// A one-thread worker with `blocks` blocks on the default model, on the current runtime.
pub fn local(name: &str, role: Role, blocks: usize) -> LocalWorker {
    local_with(name, role, EngineConfig { threads: 1, num_blocks: blocks, ..Default::default() })
}

/// A worker on the default model with this engine, on the current runtime.
pub fn local_with(name: &str, role: Role, engine: EngineConfig) -> LocalWorker {
    LocalWorker::spawn(options(name, role, engine), model().model.clone(), tokio::runtime::Handle::current()).unwrap()
}

/// A worker's options on the default model with this engine.
fn options(name: &str, role: Role, engine: EngineConfig) -> WorkerOptions {
    let m = model();
    WorkerOptions {
        name: name.into(),
        role,
        model_name: m.name.clone(),
        engine,
        eog: m.tokenizer.eog_ids().to_vec(),
        key: key(),
        grammars: Some(grammars()),
        tiers: Default::default(),
    }
}

/// The head of a stage group on the default model (layers 0..14, the rest in a
/// later stage in this process): one thread each, 256 blocks each.
pub fn group_head(name: &str, role: Role) -> LocalWorker {
    use pdserve_engine::batch::{LocalStages, StageRunner};
    use pdserve_engine::config::ModelConfig;
    use pdserve_engine::format::gguf::GgufFile;
    use pdserve_engine::model::{LayerRange, Model};
    let file = GgufFile::open(&pdserve_engine::models::require_default_model()).unwrap();
    let cfg = ModelConfig::from_gguf(&file.header).unwrap();
    let stage = |first, last| Arc::new(Model::load_stage(&file, cfg.clone(), LayerRange { first, last }).unwrap());
    let engine = EngineConfig { threads: 1, num_blocks: 256, ..Default::default() };
    let later = StageRunner::new(stage(15, 29), 256, engine.kv_dtype, 1, engine.max_batch_tokens);
    let stages = Box::new(LocalStages::new(vec![later]));
    let opts = options(name, role, engine);
    LocalWorker::spawn_head(opts, stage(0, 14), stages, tokio::runtime::Handle::current()).unwrap()
}

/// The grammar compiler of the default model, built once.
pub fn grammars() -> Arc<pdserve_engine::grammar::Grammars> {
    static G: OnceLock<Arc<pdserve_engine::grammar::Grammars>> = OnceLock::new();
    G.get_or_init(|| Arc::new(pdserve_engine::grammar::Grammars::new(model().tokenizer.clone()).unwrap())).clone()
}

/// The cluster secret every test worker and router shares.
pub fn key() -> pdserve_kv_transfer::ClusterKey {
    static KEY: OnceLock<pdserve_kv_transfer::ClusterKey> = OnceLock::new();
    KEY.get_or_init(pdserve_kv_transfer::ClusterKey::random).clone()
}

pub fn request(id: u64, text: &str, max_tokens: u32) -> GenerateRequest {
    let prompt = model().tokenizer.encode(text, false);
    GenerateRequest {
        fence: None,
        id: RequestId(id),
        tag: format!("test-{id}").as_str().into(),
        prompt,
        params: SamplingParams { max_tokens, ..Default::default() }.validate().unwrap(),
        trace: Default::default(),
    }
}

/// The stream's tokens and its final event.
pub async fn collect(mut s: TokenStream) -> (Vec<u32>, Event) {
    let mut toks = Vec::new();
    loop {
        match s.next().await.expect("stream ended without a final event") {
            Event::Token(t) => toks.push(t.token),
            last => return (toks, last),
        }
    }
}

/// Reads every stream at once, as concurrent clients would: reading them one after
/// another leaves the later ones unread past the router's client-stall deadline while
/// an earlier one is long.
pub async fn collect_all(streams: Vec<TokenStream>) -> Vec<(Vec<u32>, Event)> {
    let tasks: Vec<_> = streams.into_iter().map(|s| tokio::spawn(collect(s))).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("a stream reader panicked"));
    }
    out
}

/// A worker served over loopback, as `pdserve worker` does, and its local handle.
pub struct Served {
    pub local: LocalWorker,
    pub remote: RemoteWorker,
}

pub async fn serve(name: &str, role: Role) -> Served {
    let local = local(name, role, 256);
    let sock = std::env::temp_dir().join(format!("pdserve-remote-test-{}-{name}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let at = ListenAt { net: "127.0.0.1:0".parse().unwrap(), socket: sock };
    for via in [TransportKind::Tcp, TransportKind::Shm] {
        local.listen(via, &at).await.unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served: Arc<dyn Worker> = Arc::new(local.clone());
    tokio::spawn(WorkerServer::new(served, key()).serve(listener, std::future::pending()));
    let remote = RemoteWorker::connect(addr, &key()).await.unwrap();
    Served { local, remote }
}

pub fn remotes(p: &Served, d: &Served) -> [Arc<dyn Worker>; 2] {
    [Arc::new(p.remote.clone()), Arc::new(d.remote.clone())]
}

/// Used blocks on the workers themselves, once cancellations have settled.
pub async fn settle(workers: &[&LocalWorker]) -> usize {
    let mut used = 0;
    for _ in 0..300 {
        used = 0;
        for w in workers {
            used += w.stats().await.unwrap().blocks.used;
        }
        if used == 0 {
            return 0;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for w in workers {
        eprintln!("{}: {:?}", w.name(), w.stats().await);
    }
    used
}

pub fn rt() -> tokio::runtime::Handle {
    tokio::runtime::Handle::current()
}
