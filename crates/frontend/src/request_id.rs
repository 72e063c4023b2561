//! Request ids, and the span that follows each request.
//!
//! A client may name its request with `X-Request-Id` (as with vLLM and most API
//! gateways); otherwise the frontend makes one. The id comes back on every response,
//! is the suffix of the OpenAI response id (`chatcmpl-<id>`), travels with the
//! request to every worker, and is the `request_id` field of every log line about
//! the request, in every process. The engine's own request id is separate and random,
//! so nothing a client sees lets it name another client's work.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use pdserve_protocol::RequestTag;
use pdserve_types::RequestId;
use tracing::Instrument;

pub const HEADER: &str = "x-request-id";
/// Longest client id kept; a longer or non-printable one is replaced.
const MAX_LEN: usize = 128;

/// What the middleware hands each handler.
#[derive(Clone)]
pub struct Tagged {
    pub tag: RequestTag,
    pub span: tracing::Span,
    pub path: String,
    /// `x-pdserve-ingress` (how a gateway in this process got the request), else `http`.
    pub ingress: String,
    /// `x-pdserve-context`: the caller's JSON, echoed on the request's lifecycle record.
    pub context: serde_json::Value,
}

/// The client's id if it is usable, else a fresh one.
fn tag_of(header: Option<&HeaderValue>) -> RequestTag {
    let given = header.and_then(|v| v.to_str().ok()).map(str::trim);
    match given {
        Some(s) if !s.is_empty() && s.len() <= MAX_LEN && s.bytes().all(|b| b.is_ascii_graphic()) => s.into(),
        _ => RequestTag(format!("{:016x}{:016x}", random_u64(), random_u64()).into()),
    }
}

/// A fresh engine-side id, unrelated to anything public.
pub fn internal_id() -> RequestId {
    RequestId(random_u64())
}

fn random_u64() -> u64 {
    // The OS generator does not fail on supported platforms; were it to, the clock
    // keeps ids unique, if not secret.
    getrandom::u64().unwrap_or_else(|_| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    })
}

/// Tags the request, runs it inside its span, and answers with its id.
pub async fn middleware(mut req: Request, next: Next) -> Response {
    let tag = tag_of(req.headers().get(HEADER));
    let span = tracing::info_span!(
        "request",
        request_id = %tag,
        path = %req.uri().path(),
        route = tracing::field::Empty,
        prefill = tracing::field::Empty,
        decode = tracing::field::Empty,
        constrained_by = tracing::field::Empty,
    );
    let (ingress, context) = {
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(String::from);
        let ingress = header("x-pdserve-ingress").filter(|s| s.len() <= 32).unwrap_or_else(|| "http".into());
        let context = header("x-pdserve-context").and_then(|c| serde_json::from_str(&c).ok()).unwrap_or_default();
        (ingress, context)
    };
    let path = req.uri().path().to_string();
    req.extensions_mut().insert(Tagged { tag: tag.clone(), span: span.clone(), path, ingress, context });
    let mut resp = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(tag.as_str()) {
        resp.headers_mut().insert(HEADER, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_client_id_is_kept_and_others_replaced() {
        assert_eq!(tag_of(Some(&HeaderValue::from_static("abc-123"))).as_str(), "abc-123");
        for bad in ["", "has space", &"x".repeat(200)] {
            let made = tag_of(Some(&HeaderValue::from_str(bad).unwrap_or(HeaderValue::from_static("x y"))));
            assert_eq!(made.as_str().len(), 32, "{bad:?}");
        }
        assert_ne!(tag_of(None), tag_of(None));
    }
}
