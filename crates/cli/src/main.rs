//! The `pdserve` binary: argument parsing and wiring, nothing else. Each subcommand
//! lives in `cmd/`; the work happens in the library crates.

mod cmd;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "pdserve", version, about = "Disaggregated LLM serving: prefill and decode on separate workers")]
struct Cli {
    /// Log lines as text or as one JSON object each (level and filters: RUST_LOG).
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: pdserve_telemetry::LogFormat,
    /// Also export spans to this OpenTelemetry collector (OTLP/HTTP, JSON), e.g.
    /// http://127.0.0.1:4318. Off by default.
    #[arg(long, global = true)]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Fetch the default model (SmolLM2-135M-Instruct Q4_1) into the cache.
    Pull,
    /// Generate text from a prompt and stream it to stdout.
    Generate(cmd::generate::Args),
    /// Serve the OpenAI-compatible API: frontend, router and workers in one process.
    Serve(cmd::serve::Args),
    /// Run one worker in this process, for a `pdserve frontend` elsewhere.
    Worker(cmd::worker::Args),
    /// Serve the OpenAI-compatible API in front of `pdserve worker` processes.
    Frontend(cmd::frontend::Args),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: cmd::bench::What,
    },
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Pull => "pull",
            Command::Generate(_) => "generate",
            Command::Serve(_) => "serve",
            Command::Worker(_) => "worker",
            Command::Frontend(_) => "frontend",
            Command::Bench { .. } => "bench",
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let service = format!("pdserve-{}", cli.command.name());
    if let Err(e) = pdserve_telemetry::init(cli.log_format, cli.otlp_endpoint.as_deref(), &service) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Pull => cmd::pull::run(),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Worker(args) => cmd::worker::run(args),
        Command::Frontend(args) => cmd::frontend::run(args),
        Command::Bench { what } => cmd::bench::run(what),
    };
    cmd::runtime_dir::remove();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line a user can act on; causes are appended unless already said.
            let mut msg = String::new();
            for cause in e.chain().map(|c| c.to_string()) {
                if !msg.contains(&cause) {
                    msg = if msg.is_empty() { cause } else { format!("{msg}: {cause}") };
                }
            }
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}
