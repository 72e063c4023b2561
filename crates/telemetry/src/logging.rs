//! Structured logs: `tracing` events to stderr, as text or one JSON object per line,
//! filtered by `RUST_LOG` (default `info`, the NATS client's own lines off); spans optionally exported over OTLP.

use crate::otlp::{Endpoint, OtlpLayer};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber: logs in `format`, and spans to `otlp` (an
/// `http://` collector endpoint) when given, reported as `service`. A bad `RUST_LOG`
/// is reported and ignored; a bad endpoint is an error.
pub fn init(format: LogFormat, otlp: Option<&str>, service: &str) -> Result<(), String> {
    let filter = match EnvFilter::try_from_default_env() {
        Ok(f) => f,
        Err(e) => {
            if std::env::var_os("RUST_LOG").is_some() {
                eprintln!("warning: ignoring RUST_LOG: {e}");
            }
            // The NATS client's own lines repeat what the fleet code reports once.
            EnvFilter::new("info,async_nats=off")
        }
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false);
    let fmt = match format {
        LogFormat::Text => fmt.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).with_current_span(true).with_span_list(false).boxed(),
    };
    let otlp = match otlp {
        Some(url) => {
            let endpoint = Endpoint::parse(url)?;
            Some(OtlpLayer::new(endpoint, service).map_err(|e| format!("starting the OTLP exporter: {e}"))?)
        }
        None => None,
    };
    if let Err(e) = tracing_subscriber::registry().with(filter).with(fmt).with(otlp).try_init() {
        eprintln!("warning: logging not set up: {e}");
    }
    Ok(())
}
