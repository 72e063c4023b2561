//! The crate's one error type. Every variant renders as one line a user can act on;
//! a misbehaving *server* never produces one of these (that is a failed request
//! record), only bad flags, bad files, an unreachable target or a broken child process.

use std::path::PathBuf;

/// Why a benchmark could not run (as opposed to a request that failed, which is data).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag or spec string that does not parse or makes no sense.
    #[error("{0}")]
    BadFlag(String),
    /// The target server cannot be reached at all.
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    /// A non-loopback URL without `--allow-remote`.
    #[error("{0} is not a loopback address; pass --allow-remote to load a remote server")]
    NotLoopback(String),
    /// A line of an input file (a trace, a prompts file) that does not parse.
    #[error("{path}:{line}: {reason}")]
    BadLine { path: String, line: usize, reason: String },
    /// Reading or writing a file.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A server started by `bench compare` that did not come up or go down properly.
    #[error("topology {topology}: {reason}")]
    Server { topology: String, reason: String },
    /// Anything else from the runtime (starting tokio, spawning, encoding JSON).
    #[error("{0}")]
    Runtime(String),
}

impl BenchError {
    /// An I/O error tagged with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}

/// The crate's result type.
pub type Result<T, E = BenchError> = std::result::Result<T, E>;
