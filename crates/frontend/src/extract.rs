//! The JSON body extractor: like axum's `Json`, but every rejection is an
//! [`ApiError`] (so clients get an OpenAI error body, not axum's plain text), and the
//! body must be valid UTF-8.
//!
//! A missing `Content-Type` is accepted as JSON (as FastAPI-based servers do); an
//! explicit non-JSON type is a 415.

use crate::errors::ApiError;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

/// Largest request body accepted (413 above it).
pub const BODY_LIMIT: usize = 4 << 20;

/// A request body parsed as `T`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        check_content_type(&req)?;
        check_length(&req)?;
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge { limit: BODY_LIMIT },
            _ => ApiError::malformed(format!("could not read the request body: {rejection}")),
        })?;
        parse(&bytes).map(ApiJson)
    }
}

fn check_content_type(req: &Request) -> Result<(), ApiError> {
    let Some(value) = req.headers().get(CONTENT_TYPE) else { return Ok(()) };
    let text = value.to_str().unwrap_or_default();
    let mime = text.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    if mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json")) {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType(text.to_string()))
    }
}

/// Refuses an announced body over the limit before reading any of it.
fn check_length(req: &Request) -> Result<(), ApiError> {
    let announced = req.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    match announced {
        Some(n) if n > BODY_LIMIT as u64 => Err(ApiError::TooLarge { limit: BODY_LIMIT }),
        _ => Ok(()),
    }
}

/// UTF-8 first, then JSON, each with its own message.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text =
        std::str::from_utf8(bytes).map_err(|e| ApiError::malformed(format!("request body is not valid UTF-8: {e}")))?;
    serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ApiError::malformed(format!("invalid request: {e}")),
        _ => ApiError::malformed(format!("malformed JSON: {e}")),
    })
}
