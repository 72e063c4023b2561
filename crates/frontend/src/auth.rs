//! The API key (`--api-key`, `PDSERVE_API_KEY`), as vLLM's and llama-server's: with
//! one set, every route needs `Authorization: Bearer <key>` (OpenAI clients) or
//! `x-api-key: <key>` (Anthropic clients), else a 401.
//!
//! Two routes stay open: `/health`, for load balancers and orchestrators' probes, and
//! `/metrics`, as vLLM leaves it, for scrapers. Neither holds any request's content
//! (only counts, timings and worker names); firewall the port if those matter.

use crate::errors::ApiError;
use crate::metrics::{Metrics, Outcome};
use axum::extract::Request;
use axum::http::header::AUTHORIZATION;
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Routes served without a key.
const OPEN: [&str; 2] = ["/health", "/metrics"];

/// The key every other route needs.
#[derive(Clone)]
pub struct ApiKey(Arc<[u8]>);

impl ApiKey {
    pub fn new(key: &str) -> ApiKey {
        ApiKey(key.as_bytes().into())
    }

    /// Whether `headers` present this key.
    fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let bearer = headers.get(AUTHORIZATION).map(|v| bearer_token(v.as_bytes()));
        let plain = headers.get("x-api-key").map(|v| v.as_bytes());
        if bearer.is_none() && plain.is_none() {
            return Err(ApiError::MissingApiKey);
        }
        // Both compared, so the time taken does not tell which header matched.
        let ok = [bearer.flatten(), plain].into_iter().flatten().fold(false, |ok, k| same(&self.0, k) | ok);
        if ok {
            Ok(())
        } else {
            Err(ApiError::InvalidApiKey)
        }
    }
}

/// The token of `Bearer <token>` (the scheme in any case), if that is the form.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| rest.trim_ascii())
}

/// Compares in a time that depends on the lengths alone, not on where the bytes
/// first differ, so the key cannot be guessed byte by byte from response times.
fn same(key: &[u8], given: &[u8]) -> bool {
    let mut diff = key.len() ^ given.len();
    for (i, k) in key.iter().enumerate() {
        diff |= usize::from(k ^ given.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

/// Serves `req` if it may pass; else a 401, counted as
/// `pdserve_requests_total{outcome="unauthorized"}` (a key being guessed shows there).
pub async fn middleware(key: ApiKey, metrics: Metrics, req: Request, next: Next) -> Response {
    if OPEN.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    match key.check(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            metrics.outcome(Outcome::Unauthorized);
            // Each API refuses in its own error shape.
            match req.uri().path().starts_with("/v1/messages") {
                true => crate::anthropic::error_response(e),
                false => e.into_response(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for &(k, v) in pairs {
            h.append(k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn either_header_with_the_key_passes_and_anything_else_is_refused() {
        let key = ApiKey::new("sk-secret");
        for good in [
            vec![("authorization", "Bearer sk-secret")],
            vec![("authorization", "bearer  sk-secret ")],
            vec![("x-api-key", "sk-secret")],
            vec![("authorization", "Bearer wrong"), ("x-api-key", "sk-secret")],
        ] {
            assert_eq!(key.check(&headers(&good)), Ok(()), "{good:?}");
        }
        assert_eq!(key.check(&headers(&[])), Err(ApiError::MissingApiKey));
        for bad in [
            vec![("authorization", "Bearer sk-secre")],
            vec![("authorization", "Bearer sk-secret2")],
            vec![("authorization", "Basic sk-secret")],
            vec![("authorization", "sk-secret")],
            vec![("x-api-key", "")],
        ] {
            assert_eq!(key.check(&headers(&bad)), Err(ApiError::InvalidApiKey), "{bad:?}");
        }
    }

    #[test]
    fn same_is_equality() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"ab") && !same(b"abc", b"abc\0") && !same(b"", b"x") && !same(b"abc", b"abd"));
    }
}
