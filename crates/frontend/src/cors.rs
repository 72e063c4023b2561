//! CORS for browser clients, off unless origins are given (`--allowed-origins`).
//!
//! A request whose `Origin` is allowed gets `Access-Control-Allow-Origin` back (the
//! origin itself, or `*` when every origin is allowed); a preflight `OPTIONS` from an
//! allowed origin is answered 204 with the methods and headers the API takes. Other
//! origins get no CORS headers, so browsers refuse them; non-browser clients are not
//! affected either way.

use axum::extract::Request;
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ORIGIN, VARY,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// The origins browsers may call the API from.
#[derive(Debug, Clone)]
pub enum Origins {
    Any,
    List(Arc<[String]>),
}

impl Origins {
    /// From `--allowed-origins`: `*`, or origins like `https://app.example.com`.
    pub fn parse(list: &[String]) -> Option<Origins> {
        match list {
            [] => None,
            l if l.iter().any(|o| o == "*") => Some(Origins::Any),
            l => Some(Origins::List(l.iter().map(|o| o.trim_end_matches('/').to_string()).collect())),
        }
    }

    /// What `Access-Control-Allow-Origin` says to `origin`, if it is allowed.
    fn allow(&self, origin: &str) -> Option<HeaderValue> {
        match self {
            Origins::Any => Some(HeaderValue::from_static("*")),
            Origins::List(l) if l.iter().any(|o| o == origin) => HeaderValue::from_str(origin).ok(),
            Origins::List(_) => None,
        }
    }
}

pub async fn middleware(origins: Origins, req: Request, next: Next) -> Response {
    let origin = req.headers().get(ORIGIN).and_then(|v| v.to_str().ok()).map(str::to_string);
    let allowed = origin.as_deref().and_then(|o| origins.allow(o));
    let preflight = req.method() == Method::OPTIONS;
    let mut resp = match (&allowed, preflight) {
        (Some(_), true) => {
            let mut r = StatusCode::NO_CONTENT.into_response();
            let h = r.headers_mut();
            h.insert(ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static("GET, POST, OPTIONS"));
            h.insert(
                ACCESS_CONTROL_ALLOW_HEADERS,
                HeaderValue::from_static("authorization, content-type, x-api-key, x-request-id"),
            );
            h.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
            r
        }
        _ => next.run(req).await,
    };
    if let Some(v) = allowed {
        let h = resp.headers_mut();
        h.insert(ACCESS_CONTROL_ALLOW_ORIGIN, v);
        h.insert(ACCESS_CONTROL_EXPOSE_HEADERS, HeaderValue::from_static("x-request-id"));
        h.append(VARY, HeaderValue::from_static("origin"));
    }
    resp
}
