//! The server under load: a base URL, resolved once, loopback unless allowed.
//!
//! `--url` may be given with or without the `/v1` suffix
//! (`http://127.0.0.1:8000` and `http://127.0.0.1:8000/v1` mean the same). Plain HTTP
//! only: this is a benchmark for servers next to the client, not a TLS client.

use crate::error::BenchError;
use hyper::Uri;
use std::net::{SocketAddr, ToSocketAddrs};

/// A resolved server address and its API base path.
#[derive(Clone, Debug)]
pub struct Target {
    /// The URL as the user wrote it (for messages).
    pub url: String,
    /// `host:port`, for the `Host` header.
    pub authority: String,
    pub addr: SocketAddr,
    /// Path prefix of the API, e.g. `/v1`.
    pub api_base: String,
    /// Path prefix of the server (for `/health`).
    pub root: String,
}

impl Target {
    /// Parses and resolves `url`; refuses non-loopback hosts unless `allow_remote`.
    pub fn parse(url: &str, allow_remote: bool) -> Result<Self, BenchError> {
        let bad = |why: &str| BenchError::BadFlag(format!("bad URL {url:?}: {why}"));
        let uri: Uri = url.parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(s) => return Err(bad(&format!("scheme {s} is not supported (plain http only)"))),
            None => return Err(bad("expected http://HOST:PORT")),
        }
        let host = uri.host().ok_or_else(|| bad("no host"))?;
        let port = uri.port_u16().unwrap_or(80);
        let addrs: Vec<SocketAddr> = (host.trim_matches(['[', ']']), port)
            .to_socket_addrs()
            .map_err(|e| BenchError::Unreachable { url: url.into(), reason: e.to_string() })?
            .collect();
        let addr = *addrs.first().ok_or_else(|| bad("host resolves to no address"))?;
        if !allow_remote && !addrs.iter().all(|a| a.ip().is_loopback()) {
            return Err(BenchError::NotLoopback(url.into()));
        }
        let path = uri.path().trim_end_matches('/');
        let (root, api_base) = match path.strip_suffix("/v1") {
            Some(root) => (root.to_string(), path.to_string()),
            None => (path.to_string(), format!("{path}/v1")),
        };
        Ok(Self { url: url.into(), authority: format!("{host}:{port}"), addr, api_base, root })
    }

    /// The path of an API route, e.g. `/v1/completions`.
    pub fn api_path(&self, route: &str) -> String {
        format!("{}{route}", self.api_base)
    }

    /// The path of a server route outside the API, e.g. `/health`.
    pub fn root_path(&self, route: &str) -> String {
        format!("{}{route}", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_or_without_v1_the_paths_are_the_same() {
        for url in
            ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/"]
        {
            let t = Target::parse(url, false).unwrap();
            assert_eq!(t.api_path("/completions"), "/v1/completions");
            assert_eq!(t.root_path("/health"), "/health");
            assert_eq!(t.addr.port(), 8000);
            assert_eq!(t.authority, "127.0.0.1:8000");
        }
        let t = Target::parse("http://localhost:9/x/v1", false).unwrap();
        assert_eq!((t.api_path("/models"), t.root_path("/health")), ("/x/v1/models".into(), "/x/health".into()));
    }

    #[test]
    fn bad_urls_and_remote_hosts_are_refused_with_a_reason() {
        let e = Target::parse("https://127.0.0.1:1", false).unwrap_err().to_string();
        assert!(e.contains("plain http only"), "{e}");
        assert!(Target::parse("127.0.0.1:8000", false).is_err());
        let e = Target::parse("http://10.1.2.3:80", false).unwrap_err().to_string();
        assert!(e.contains("--allow-remote"), "{e}");
        assert!(Target::parse("http://10.1.2.3:80", true).is_ok());
        assert!(Target::parse("http://[::1]:80", false).is_ok());
    }
}
