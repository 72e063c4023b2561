//! The one error type of the HTTP API and its one mapping to a status and an
//! OpenAI-style body: `{"error": {"message", "type", "param", "code"}}`.
//!
//! | error | status | type | code |
//! |---|---|---|---|
//! | malformed JSON, wrong types, out-of-range values, context too long | 400 | `invalid_request_error` | null, or `context_length_exceeded` |
//! | API key missing or wrong (with `WWW-Authenticate: Bearer`) | 401 | `authentication_error` | `invalid_api_key` |
//! | unknown model / unknown route or stored response | 404 | `invalid_request_error` | `model_not_found` / `not_found` |
//! | wrong method | 405 | `invalid_request_error` | `method_not_allowed` |
//! | body not all sent within the deadline (the connection then closes) | 408 | `invalid_request_error` | `request_timeout` |
//! | body over the limit | 413 | `invalid_request_error` | `request_too_large` |
//! | content type not JSON | 415 | `invalid_request_error` | `unsupported_media_type` |
//! | admission refused ([`ServeError::Overloaded`], [`ServeError::QueueFull`], [`ServeError::SloInfeasible`], [`ServeError::TpotInfeasible`]; with `Retry-After`) | 429 | `rate_limit_error` | `rate_limit_exceeded` |
//! | no worker, shutting down | 503 | `server_error` | `service_unavailable` |
//! | a phase timed out | 504 | `server_error` | `timeout` |
//! | anything else | 500 | `server_error` | null |

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use pdserve_protocol::ServeError;
use pdserve_types::SamplingError;
use serde::Serialize;

/// Everything that can go wrong answering an HTTP request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a value is out of range.
    #[error("{message}")]
    Invalid { message: String, param: Option<&'static str> },
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("no stored response with id `{0}`")]
    ResponseNotFound(String),
    #[error("no route for {0}")]
    RouteNotFound(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")]
    MissingApiKey,
    #[error("invalid API key")]
    InvalidApiKey,
    #[error("the request body did not arrive within {} s", .0.as_secs_f64())]
    BodyTimeout(std::time::Duration),
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    #[error("unsupported content type `{0}`: send application/json")]
    UnsupportedMediaType(String),
    /// From the hop behind the frontend (or the frontend's own context check).
    #[error(transparent)]
    Serve(#[from] ServeError),
}

impl ApiError {
    /// A 400 about one request field.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        ApiError::Invalid { message: message.into(), param: Some(param) }
    }

    /// A 400 not tied to one field (malformed JSON, bad UTF-8).
    pub fn malformed(message: impl Into<String>) -> Self {
        ApiError::Invalid { message: message.into(), param: None }
    }

    /// Status, OpenAI error type, param and code.
    fn parts(&self) -> (StatusCode, &'static str, Option<&'static str>, Option<&'static str>) {
        const BAD: &str = "invalid_request_error";
        const SERVER: &str = "server_error";
        match self {
            ApiError::Invalid { param, .. } => (StatusCode::BAD_REQUEST, BAD, *param, None),
            ApiError::ModelNotFound(_) => (StatusCode::NOT_FOUND, BAD, Some("model"), Some("model_not_found")),
            ApiError::RouteNotFound(_) | ApiError::ResponseNotFound(_) => {
                (StatusCode::NOT_FOUND, BAD, None, Some("not_found"))
            }
            ApiError::MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, BAD, None, Some("method_not_allowed")),
            ApiError::MissingApiKey | ApiError::InvalidApiKey => {
                (StatusCode::UNAUTHORIZED, "authentication_error", None, Some("invalid_api_key"))
            }
            ApiError::BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, BAD, None, Some("request_timeout")),
            ApiError::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, BAD, None, Some("request_too_large")),
            ApiError::UnsupportedMediaType(_) => {
                (StatusCode::UNSUPPORTED_MEDIA_TYPE, BAD, None, Some("unsupported_media_type"))
            }
            ApiError::Serve(e) => match e {
                ServeError::Invalid(_) => (StatusCode::BAD_REQUEST, BAD, None, None),
                ServeError::ContextLength { .. } => {
                    (StatusCode::BAD_REQUEST, BAD, Some("max_tokens"), Some("context_length_exceeded"))
                }
                ServeError::Overloaded(_)
                | ServeError::QueueFull { .. }
                | ServeError::SloInfeasible { .. }
                | ServeError::TpotInfeasible { .. } => {
                    (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", None, Some("rate_limit_exceeded"))
                }
                ServeError::NoWorker(_)
                | ServeError::WorkerLost(_)
                | ServeError::KvLost(_)
                | ServeError::ShuttingDown
                | ServeError::StaleEpoch { .. }
                | ServeError::Moved { .. } => {
                    (StatusCode::SERVICE_UNAVAILABLE, SERVER, None, Some("service_unavailable"))
                }
                ServeError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, SERVER, None, Some("timeout")),
                ServeError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, SERVER, None, None),
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    /// A stable, machine-readable name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Serve(e) => e.kind(),
            ApiError::Invalid { .. } => "invalid_request",
            other => other.parts().3.unwrap_or("invalid_request"),
        }
    }

    /// The OpenAI error body, also sent as an SSE event when a stream fails midway.
    pub fn body(&self) -> ErrorBody {
        let (_, kind, param, code) = self.parts();
        ErrorBody { error: ErrorDetail { message: self.to_string(), kind, param, code } }
    }
}

impl From<SamplingError> for ApiError {
    fn from(e: SamplingError) -> Self {
        ApiError::Invalid { message: e.to_string(), param: Some(e.param) }
    }
}

impl ApiError {
    /// Seconds a client should wait before trying again, for `Retry-After`.
    pub fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::Serve(e) => e.retry_after_s(),
            _ => None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        use axum::http::header::{HeaderValue, CONNECTION, RETRY_AFTER, WWW_AUTHENTICATE};
        let mut resp = (self.status(), Json(self.body())).into_response();
        let h = resp.headers_mut();
        if let Some(s) = self.retry_after() {
            h.insert(RETRY_AFTER, s.into());
        }
        match self {
            ApiError::MissingApiKey | ApiError::InvalidApiKey => {
                h.insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            // The rest of a late body may still be on its way: not worth reading.
            ApiError::BodyTimeout(_) => {
                h.insert(CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        resp
    }
}

/// `{"error": {...}}`.
#[derive(Debug, Serialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_errors_map_to_their_status() {
        let cases = [
            (ServeError::Overloaded("queue full".into()), 429),
            (ServeError::NoWorker("none".into()), 503),
            (ServeError::WorkerLost("gone".into()), 503),
            (ServeError::KvLost("a bad frame".into()), 503),
            (ServeError::ShuttingDown, 503),
            (ServeError::Timeout("prefill".into()), 504),
            (ServeError::Internal("bug".into()), 500),
            (ServeError::ContextLength { context: 8, prompt: 6, needed: 10 }, 400),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(e).status().as_u16(), status);
        }
    }

    #[test]
    fn body_is_openai_shaped() {
        let v = serde_json::to_value(ApiError::invalid("n", "only n = 1 is supported").body()).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "n");
        assert!(v["error"]["code"].is_null());
    }
}
