//! Structured logs: `tracing` events to stderr, as text or one JSON object per line,
//! filtered by `RUST_LOG` (default `info`).

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. A bad `RUST_LOG` is reported and ignored.
pub fn init(format: LogFormat) {
    let filter = match EnvFilter::try_from_default_env() {
        Ok(f) => f,
        Err(e) => {
            if std::env::var_os("RUST_LOG").is_some() {
                eprintln!("warning: ignoring RUST_LOG: {e}");
            }
            EnvFilter::new("info")
        }
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false);
    let installed = match format {
        LogFormat::Text => builder.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).try_init(),
    };
    if let Err(e) = installed {
        eprintln!("warning: logging not set up: {e}");
    }
}
