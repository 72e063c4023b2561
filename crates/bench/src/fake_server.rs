//! An OpenAI-style server that answers instantly: each request gets `max_tokens`
//! one-token chunks, a usage chunk and `[DONE]`, with no delay at all. Loading it
//! measures the client itself (see `calibrate`).

use crate::error::BenchError;
use axum::body::{Body, Bytes};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::net::SocketAddr;

/// A running instant server on its own thread; stops when dropped.
pub struct FakeServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeServer {
    /// Starts on a free loopback port, on a thread and runtime of its own.
    pub fn start() -> Result<Self, BenchError> {
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| BenchError::Runtime(e.to_string()))?;
        std_listener.set_nonblocking(true).map_err(|e| BenchError::Runtime(e.to_string()))?;
        let addr = std_listener.local_addr().map_err(|e| BenchError::Runtime(e.to_string()))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("fake-server".into())
            .spawn(move || serve(std_listener, stopped))
            .map_err(|e| BenchError::Runtime(e.to_string()))?;
        Ok(Self { addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: std::net::TcpListener, stopped: tokio::sync::oneshot::Receiver<()>) {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
    rt.block_on(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else { return };
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(completions))
            .route("/v1/models", get(|| async { Json(json!({"object": "list", "data": [{"id": "fake"}]})) }))
            .route("/health", get(|| async { Json(json!({"status": "ok"})) }));
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
    });
}

async fn completions(Json(req): Json<Value>) -> Response {
    let n = req["max_tokens"].as_u64().unwrap_or(16);
    let chat = req.get("messages").is_some();
    let frames = (0..n).map(move |i| {
        let finish = if i + 1 == n { json!("length") } else { Value::Null };
        let choice = if chat {
            json!({"index": 0, "delta": {"content": "x"}, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": "x", "finish_reason": finish})
        };
        Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {}\n\n", json!({"choices": [choice]}))))
    });
    let prompt_tokens = req["prompt"].as_array().map_or(0, Vec::len);
    let usage = json!({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}});
    let tail = [format!("data: {usage}\n\n"), "data: [DONE]\n\n".to_string()].map(|s| Ok(Bytes::from(s)));
    let body = Body::from_stream(futures_util::stream::iter(frames.chain(tail)));
    ([(CONTENT_TYPE, "text/event-stream")], body).into_response()
}
