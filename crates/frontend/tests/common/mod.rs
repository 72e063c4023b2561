//! Test support: the real tokenizer and chat template of the default model, a fake
//! `Generate` backend with scripted behaviour, a server on 127.0.0.1:0 and a raw
//! HTTP/1.1 client over tokio's TcpStream.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use pdserve_engine::chat::ChatTemplate;
use pdserve_engine::tokenizer::Tokenizer;
use pdserve_frontend::{Frontend, Metrics};
use pdserve_protocol::{
    Event, EventSender, FinishReason, Generate, GenerateRequest, ServeError, TokenOut, TokenStream, Usage,
};
use pdserve_testkit::http;
pub use pdserve_testkit::http::Reply;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;

/// A small context so tests can overflow it cheaply.
pub const CONTEXT: usize = 512;
/// `cached_tokens` the fake reports in its usage.
pub const CACHED: usize = 3;

pub struct Model {
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Arc<ChatTemplate>,
    pub name: String,
}

/// The default model's tokenizer and template, loaded once per test binary.
pub fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = pdserve_engine::models::require_default_model();
        let loaded = pdserve_engine::loader::load(&path).expect("load the default model");
        Model { tokenizer: loaded.tokenizer, chat: loaded.chat, name: loaded.name }
    })
}

/// What the fake backend does with each request.
#[derive(Clone)]
pub enum Script {
    /// Streams the tokens of this text, then EOS (or stops at max_tokens).
    Reply(String),
    /// `generate` itself fails.
    Refuse(ServeError),
    /// Streams this many tokens of "hello", then fails.
    FailAfter(usize, ServeError),
    /// A token every 5 ms until the client is gone.
    Endless,
}

pub struct Fake {
    script: Script,
    tokenizer: Arc<Tokenizer>,
    pub ready: AtomicBool,
    pub last: Mutex<Option<GenerateRequest>>,
    pub all: Mutex<Vec<GenerateRequest>>,
    /// Set once an endless stream saw its consumer go away.
    pub cancelled: Arc<AtomicBool>,
}

impl Fake {
    pub fn new(script: Script) -> Fake {
        Fake {
            script,
            tokenizer: model().tokenizer.clone(),
            ready: AtomicBool::new(true),
            last: Mutex::new(None),
            all: Mutex::default(),
            cancelled: Arc::new(AtomicBool::new(false)),
        }
    }

    fn token(id: u32, n_top: u32) -> Event {
        let top = (0..n_top).map(|i| (id + i, -0.25 - i as f32)).collect();
        Event::Token(TokenOut { token: id, logprob: -0.25, top })
    }

    fn reply(&self, req: &GenerateRequest, text: &str, tx: &EventSender) {
        let mut ids = self.tokenizer.encode(text, false);
        ids.extend(self.tokenizer.eos_id());
        if req.params.prompt_logprobs.is_some() {
            let scores = req.prompt.iter().skip(1).map(|&t| TokenOut { token: t, logprob: -1.5, top: vec![(t, -1.5)] });
            tx.send(Event::Prompt(scores.collect())).unwrap();
        }
        let max = req.params.max_tokens as usize;
        let n = ids.len().min(max);
        for &id in &ids[..n] {
            tx.send(Fake::token(id, req.params.top_logprobs)).unwrap();
        }
        let reason = if n == ids.len() { FinishReason::Stop } else { FinishReason::Length };
        let usage = Usage { prompt_tokens: req.prompt.len(), completion_tokens: n, cached_tokens: CACHED };
        tx.send(Event::Done { reason, usage }).unwrap();
    }

    fn endless(&self, tx: EventSender) {
        let id = self.tokenizer.encode(" hi", false)[0];
        let cancelled = self.cancelled.clone();
        tokio::spawn(async move {
            loop {
                if tx.is_closed() {
                    cancelled.store(true, Ordering::SeqCst);
                    return;
                }
                let _ = tx.send(Fake::token(id, 0));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
    }
}

impl Generate for Fake {
    fn generate(&self, req: GenerateRequest) -> Result<TokenStream, ServeError> {
        *self.last.lock().unwrap() = Some(req.clone());
        self.all.lock().unwrap().push(req.clone());
        let (tx, stream) = TokenStream::channel(1024);
        match &self.script {
            Script::Reply(text) => self.reply(&req, text, &tx),
            Script::Refuse(e) => return Err(e.clone()),
            Script::FailAfter(n, e) => {
                let id = self.tokenizer.encode("hello", false)[0];
                for _ in 0..*n {
                    tx.send(Fake::token(id, 0)).unwrap();
                }
                tx.send(Event::Failed(e.clone())).unwrap();
            }
            Script::Endless => self.endless(tx),
        }
        Ok(stream)
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

pub struct Server {
    pub addr: SocketAddr,
    pub fake: Arc<Fake>,
    pub metrics: Metrics,
}

impl Server {
    pub async fn start(script: Script) -> Server {
        Server::start_named(script, Vec::new()).await
    }

    /// A server answering to `names` (`--served-model-name`).
    pub async fn start_named(script: Script, names: Vec<String>) -> Server {
        Server::start_with(script, names, &[]).await
    }

    /// A server answering to `names`, with CORS for `origins`.
    pub async fn start_with(script: Script, names: Vec<String>, origins: &[String]) -> Server {
        Server::serve(script, model().chat.clone(), names, origins).await
    }

    /// A server rendering chats with `chat` instead of the model's own template.
    #[allow(dead_code)]
    pub async fn start_with_template(script: Script, chat: Arc<ChatTemplate>) -> Server {
        Server::serve(script, chat, Vec::new(), &[]).await
    }

    async fn serve(script: Script, chat: Arc<ChatTemplate>, names: Vec<String>, origins: &[String]) -> Server {
        let m = model();
        let fake = Arc::new(Fake::new(script));
        let metrics = Metrics::new();
        let frontend = Frontend::new(fake.clone(), m.tokenizer.clone(), chat, m.name.clone(), CONTEXT, metrics.clone())
            .with_served_names(names)
            .with_cors(pdserve_frontend::Origins::parse(origins));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(pdserve_frontend::serve(listener, frontend.router()));
        Server { addr, fake, metrics }
    }

    pub fn last_request(&self) -> GenerateRequest {
        self.fake.last.lock().unwrap().clone().expect("a request reached the backend")
    }

    /// Every request that reached the backend, oldest first.
    pub fn requests(&self) -> Vec<GenerateRequest> {
        self.fake.all.lock().unwrap().clone()
    }

    pub async fn post(&self, path: &str, body: &str) -> Reply {
        http::send(self.addr, &http::post_request(path, body, &[])).await
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.post(path, &body.to_string()).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        http::send(self.addr, &http::get_request(path)).await
    }

    /// Sends raw bytes and reads the whole response (the server closes after it).
    pub async fn raw(&self, request: &[u8]) -> Reply {
        http::send(self.addr, request).await
    }

    /// Writes `request` while reading the answer, for servers that answer before
    /// reading the whole body (and may reset the connection once they have).
    pub async fn raw_eager(&self, request: Vec<u8>) -> Reply {
        http::send_eager(self.addr, request).await
    }
}
