//! The `pdserve` binary: argument parsing and wiring, nothing else. Each subcommand
//! lives in `cmd/`; the work happens in the library crates.

mod cmd;
mod hub;

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
    /// Fetch a model into the cache: the default (SmolLM2-135M-Instruct Q4_1) unless
    /// named, another known one (--list shows them), or hf:ORG/REPO[:QUANT] from the
    /// Hugging Face Hub.
    Pull(cmd::pull::Args),
    /// The models in the cache, with their sizes: the names --model takes.
    Models,
    /// Generate text from a prompt and stream it to stdout.
    Generate(cmd::generate::Args),
    /// Serve the OpenAI-compatible API: frontend, router and workers in one process.
    Serve(cmd::serve::Args),
    /// Run one worker in this process, for a `pdserve frontend` elsewhere.
    Worker(cmd::worker::Args),
    /// Serve the OpenAI-compatible API in front of `pdserve worker` processes.
    Frontend(cmd::frontend::Args),
    /// The nodes of a NATS fleet: roles, addresses, load, KV blocks, heartbeats.
    Fleet(cmd::fleet::Args),
    /// Plan a NATS fleet's roles from its traffic (one active planner per fleet).
    Planner(cmd::planner::Args),
    /// Time this machine's worker shapes into a profile for the twin (`sim`, `plan`).
    Profile(cmd::twin::ProfileArgs),
    /// Simulate a topology under a workload on a virtual clock, from a profile; prints
    /// and writes what `bench load` would measure.
    Sim(cmd::twin::SimArgs),
    /// Rank every topology of N nodes by simulated goodput and say when to disaggregate.
    Plan(cmd::twin::PlanArgs),
    /// Each node's layers for a stage group of nodes of the given memory (`worker
    /// --layers`), from the model file.
    Split(cmd::stage::SplitArgs),
    /// A model's perplexity on a text file, as llama.cpp's perplexity tool measures it.
    Perplexity(cmd::perplexity::Args),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: cmd::bench::What,
    },
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Pull(_) => "pull",
            Command::Models => "models",
            Command::Generate(_) => "generate",
            Command::Serve(_) => "serve",
            Command::Worker(_) => "worker",
            Command::Frontend(_) => "frontend",
            Command::Fleet(_) => "fleet",
            Command::Planner(_) => "planner",
            Command::Profile(_) => "profile",
            Command::Sim(_) => "sim",
            Command::Plan(_) => "plan",
            Command::Split(_) => "split",
            Command::Perplexity(_) => "perplexity",
            Command::Bench { .. } => "bench",
        }
    }
}

/// What a supervisor learns from a server's exit: 0 when every request in flight at
/// the signal finished, [`CUT`] when the grace period (or a second signal) cut some.
fn exit_code(stopped: cmd::Stopped) -> ExitCode {
    match stopped {
        cmd::Stopped::Drained => ExitCode::SUCCESS,
        cmd::Stopped::Cut(_) => ExitCode::from(CUT),
    }
}

/// Exit code of a server that had to cut requests short.
const CUT: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let service = format!("pdserve-{}", cli.command.name());
    if let Err(e) = pdserve_telemetry::init(cli.log_format, cli.otlp_endpoint.as_deref(), &service) {
        eprintln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Pull(a) => cmd::pull::run(&a).map(|()| ExitCode::SUCCESS),
        Command::Models => cmd::pull::list_cached().map(|()| ExitCode::SUCCESS),
        Command::Generate(args) => cmd::generate::run(args).map(|()| ExitCode::SUCCESS),
        Command::Serve(args) => cmd::serve::run(args).map(exit_code),
        Command::Worker(args) => cmd::worker::run(args).map(exit_code),
        Command::Frontend(args) => cmd::frontend::run(args).map(exit_code),
        Command::Fleet(args) => cmd::fleet::run(args).map(|()| ExitCode::SUCCESS),
        Command::Planner(args) => cmd::planner::run(args).map(|()| ExitCode::SUCCESS),
        Command::Profile(args) => cmd::twin::profile(args).map(|()| ExitCode::SUCCESS),
        Command::Sim(args) => cmd::twin::sim(args).map(|()| ExitCode::SUCCESS),
        Command::Plan(args) => cmd::twin::plan(args).map(|()| ExitCode::SUCCESS),
        Command::Split(args) => cmd::stage::split(&args).map(|()| ExitCode::SUCCESS),
        Command::Perplexity(args) => cmd::perplexity::run(args).map(|()| ExitCode::SUCCESS),
        Command::Bench { what } => cmd::bench::run(what).map(|()| ExitCode::SUCCESS),
    };
    cmd::runtime_dir::remove();
    match result {
        Ok(code) => code,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every subcommand and every flag says what it is for in `--help`.
    #[test]
    fn every_help_entry_has_a_description() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if id != "help" && id != "version" && arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} --{}", arg.get_long().unwrap_or(id)));
                }
            }
            for sub in cmd.get_subcommands() {
                let name = format!("{path} {}", sub.get_name());
                if sub.get_about().is_none() && sub.get_name() != "help" {
                    missing.push(name.clone());
                }
                walk(sub, &name, missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "pdserve", &mut missing);
        assert!(missing.is_empty(), "no description: {missing:#?}");
    }
}
