//! The HTTP side shared by `serve` and `frontend`: the OpenAI API in front of a
//! router, block-count reporting, and the graceful shutdown.

use anyhow::Context;
use pdserve_frontend::{Frontend, HttpLimits, Lifecycle, Metrics, ModelSpec};
use pdserve_protocol::Generate;
use pdserve_router::{Admission, Deadlines, Migrating, Mode, Router};
use std::sync::Arc;
use std::time::Duration;

/// What one API port serves.
pub struct Serving {
    /// The first is the one a request naming no model gets.
    pub models: Vec<ModelSpec>,
    /// Refuse new requests at shutdown (a model loaded on demand drains with the
    /// frontend).
    pub routers: Vec<Arc<Router>>,
    pub mode: Mode,
    /// Hears of every request (the forest's lifecycle Leaves), when set.
    pub observer: Option<Arc<dyn pdserve_frontend::observe::Observer>>,
}

/// Admission control's flags, shared by `serve`, `frontend` and `sim`.
#[derive(clap::Args)]
pub struct AdmissionArgs {
    /// Refuse (429 with Retry-After) a request predicted to wait longer than this
    /// before its prefill starts; 0 turns admission control off.
    #[arg(long, default_value_t = Admission::DEFAULT_MAX_QUEUE_S)]
    max_queue_seconds: f64,
    /// SLO admission: refuse (429 with Retry-After) a request whose first token is
    /// predicted later than this many milliseconds (its wait plus its own prefill),
    /// before any of it is computed. Off by default.
    #[arg(long, value_parser = positive_ms)]
    admit_ttft_ms: Option<f64>,
    /// TPOT admission: refuse (429 with Retry-After) a request with which its decode
    /// worker's step (every sequence's time per output token there) is predicted
    /// longer than this many milliseconds, from the worker's own fit of its decode
    /// steps. Off by default.
    #[arg(long, value_parser = positive_ms)]
    admit_tpot_ms: Option<f64>,
}

impl AdmissionArgs {
    /// The limits the router enforces: `--max-queue-seconds 0` turns that one off.
    pub fn limits(&self) -> Admission {
        let ms = |ms: Option<f64>| ms.map(|ms| Duration::from_secs_f64(ms / 1e3));
        Admission {
            max_queue: Duration::try_from_secs_f64(self.max_queue_seconds).ok().filter(|d| !d.is_zero()),
            ttft: ms(self.admit_ttft_ms),
            tpot: ms(self.admit_tpot_ms),
        }
    }
}

/// The API's flags, the same for `serve` and `frontend`.
#[derive(clap::Args)]
pub struct ApiArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    grace_seconds: u64,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    /// A streaming client that reads nothing for this many seconds gets an error and
    /// its request is cancelled (its sequence is paused while it lags).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    client_stall_seconds: u64,
    /// A name the model answers to in the API (repeat for aliases; the first is listed
    /// first). Default: the model file's name.
    #[arg(long = "served-model-name")]
    served_model_names: Vec<String>,
    /// Browser origins allowed to call the API (CORS), comma separated, or `*`. Off by
    /// default.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// How many times a request whose worker is lost mid-stream may move to another
    /// worker (its prompt plus the tokens already sent are replayed there); 0: never.
    #[arg(long, default_value_t = 1)]
    max_migrations: u32,
    /// Require this key of clients (`Authorization: Bearer KEY` or `x-api-key: KEY`)
    /// on every route but /health and /metrics. Default: $PDSERVE_API_KEY, which keeps
    /// the key out of the process list.
    #[arg(long, value_parser = non_empty)]
    api_key: Option<String>,
    /// The longest sequence (prompt plus output tokens) a request may have, below the
    /// model's context (as vLLM's flag): bounds what one request can cost. Default:
    /// the model's context.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_model_len: Option<u64>,
    /// Sampling defaults for fields a request leaves out, as vLLM's JSON: keys
    /// temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty,
    /// presence_penalty. E.g. '{"temperature": 0}' for agents that send none.
    #[arg(long, value_parser = generation_config)]
    override_generation_config: Option<pdserve_frontend::GenerationDefaults>,
}

fn generation_config(json: &str) -> Result<pdserve_frontend::GenerationDefaults, String> {
    pdserve_frontend::GenerationDefaults::parse(json)
}

impl ApiArgs {
    /// The router's deadlines, with the client stall from the flags.
    pub fn deadlines(&self) -> Deadlines {
        Deadlines { client_stall: Duration::from_secs(self.client_stall_seconds), ..Deadlines::default() }
    }

    /// `--api-key`, else a non-empty `$PDSERVE_API_KEY` (read by hand: clap here is
    /// built without its `env` feature).
    pub fn api_key(&self) -> Option<String> {
        self.api_key.clone().or_else(|| std::env::var("PDSERVE_API_KEY").ok().filter(|k| !k.is_empty()))
    }
}

/// An empty `--api-key` (an unset shell variable, most likely) would leave the API
/// open while looking closed: refused.
fn non_empty(s: &str) -> Result<String, String> {
    match s.is_empty() {
        true => Err("the API key is empty".into()),
        false => Ok(s.to_string()),
    }
}

fn positive_ms(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(ms) if ms > 0.0 && ms.is_finite() && ms < 1e9 => Ok(ms),
        _ => Err(format!("`{s}` is not a positive number of milliseconds")),
    }
}

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every request in flight at the signal finished.
    Drained,
    /// The grace period ended (or a second signal came) with this many requests
    /// still open; their streams were ended with an error event.
    Cut(usize),
}

/// The router with requests moved off workers lost under them, as the frontend calls it.
pub fn migrating(router: &Arc<Router>, api: &ApiArgs) -> Arc<dyn Generate> {
    Arc::new(Migrating::new(router.clone(), api.max_migrations))
}

/// Reports `router`'s workers into `metrics` now and every [`pdserve_router::STATS_EVERY`]
/// while the router lives. Admission knows every worker's blocks before the first
/// request: a burst at start-up must not all be admitted on no figures at all.
pub async fn watch_stats(router: &Arc<Router>, metrics: &Metrics) {
    publish(metrics, router.poll_stats().await);
    let metrics = metrics.clone();
    router.spawn_stats_poll(move |round| publish(&metrics, round));
}

/// The frontend over every model of `s`.
fn frontend(s: Serving, metrics: &Metrics, api: &ApiArgs) -> anyhow::Result<Frontend> {
    if s.models.len() > 1 && !api.served_model_names.is_empty() {
        anyhow::bail!("--served-model-name names one model; with several, each answers to its own name");
    }
    let fit = |mut m: ModelSpec| {
        m.context_length = api.max_model_len.map_or(m.context_length, |n| m.context_length.min(n as usize));
        m
    };
    let mut models = s.models.into_iter().map(fit);
    let mut f = Frontend::serving(models.next().context("no model to serve")?, metrics.clone());
    for m in models {
        f = f.with_model(m);
    }
    Ok(f.with_mode(&format!("{:?}", s.mode).to_lowercase())
        .with_observer(s.observer)
        .with_served_names(api.served_model_names.clone())
        .with_generation_defaults(api.override_generation_config.clone().unwrap_or_default())
        .with_cors(pdserve_frontend::Origins::parse(&api.allowed_origins))
        .with_api_key(api.api_key().as_deref()))
}

/// Serves the API until SIGINT/SIGTERM, then drains: requests in flight finish
/// within the grace period while new ones get 503; what is left then is cut. A second
/// signal cuts at once. `banner` describes the topology in the startup line.
pub async fn serve(
    s: Serving,
    metrics: Metrics,
    api: &ApiArgs,
    banner: &str,
    after_bind: impl FnOnce(std::net::SocketAddr),
) -> anyhow::Result<Stopped> {
    let mode = format!("{:?}", s.mode).to_lowercase();
    let names = s.models.iter().flat_map(|m| m.names.first().cloned()).collect::<Vec<_>>().join(", ");
    let routers = s.routers.clone();
    let frontend = frontend(s, &metrics, api)?;
    let listener = tokio::net::TcpListener::bind((api.host.as_str(), api.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", api.host, api.port))?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() && api.api_key().is_none() {
        tracing::warn!("pdserve: listening on {addr}, beyond this host, with no API key: anyone who reaches it can use it (set --api-key or PDSERVE_API_KEY)");
    }
    after_bind(addr);
    let first_signal = signal();
    tracing::info!(
        "pdserve: serving {names} ({mode} mode, {banner}) at http://{addr}/v1 — try: curl http://{addr}/v1/completions -H 'Content-Type: application/json' -d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'"
    );
    let life = frontend.lifecycle();
    let server = pdserve_frontend::serve_with(listener, frontend.router(), http_limits());
    let stopped = tokio::select! {
        r = server => {
            r.context("http server")?;
            Stopped::Drained
        }
        stopped = shut_down(routers, life, Duration::from_secs(api.grace_seconds), first_signal) => stopped,
    };
    tracing::info!("pdserve: stopped");
    Ok(stopped)
}

/// Waits for `first_signal`, drains, and cuts what the grace period (or a second
/// signal) leaves open.
async fn shut_down(
    routers: Vec<Arc<Router>>,
    life: Lifecycle,
    grace: Duration,
    first_signal: impl std::future::Future<Output = ()>,
) -> Stopped {
    first_signal.await;
    tracing::info!("pdserve: shutting down, finishing {} request(s) in flight (grace {grace:?})", life.open());
    routers.iter().for_each(|r| r.drain());
    life.drain();
    let why = tokio::select! {
        _ = life.drained() => return Stopped::Drained,
        _ = tokio::time::sleep(grace) => "grace period over",
        _ = signal() => "second signal",
    };
    let open = life.open();
    tracing::warn!("pdserve: {why}, cutting {open} request(s)");
    life.cut();
    // The cut streams send their last events; then the process exits.
    let _ = tokio::time::timeout(Duration::from_secs(2), life.drained()).await;
    Stopped::Cut(open)
}

/// Connections to accept at most: below the descriptor limit (raised to its hard
/// limit first), leaving room for worker, KV and file descriptors.
fn http_limits() -> HttpLimits {
    let soft = raise_fd_limit();
    let limits = HttpLimits::with_max_connections(soft.saturating_sub(256).clamp(16, 16_384));
    tracing::debug!(descriptors = soft, max_connections = limits.max_connections, "HTTP limits");
    limits
}

/// Raises the soft limit on open descriptors to the hard limit; the soft limit after.
fn raise_fd_limit() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    let want = libc::rlimit { rlim_cur: lim.rlim_max.min(1 << 20), rlim_max: lim.rlim_max };
    // SAFETY: `want` is a valid rlimit, its soft limit within the hard one.
    if want.rlim_cur > lim.rlim_cur && unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
        lim = want;
    }
    lim.rlim_cur as usize
}

/// Takes over SIGINT and SIGTERM now and resolves on the first that arrives. Called
/// before a process announces itself, so a signal sent right after the announcement
/// is handled rather than killing the process by default.
pub fn signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal as listen, SignalKind};
        let (int, term) = (listen(SignalKind::interrupt()).ok(), listen(SignalKind::terminate()).ok());
        async move {
            let wait = |s: Option<tokio::signal::unix::Signal>| async move {
                match s {
                    Some(mut s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! { _ = wait(int) => {}, _ = wait(term) => {} }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// One round of the workers' stats, into the metrics.
fn publish(metrics: &Metrics, round: Vec<(Arc<pdserve_router::Entry>, Option<pdserve_protocol::WorkerStats>)>) {
    for (e, stats) in round {
        match stats {
            Some(s) => {
                metrics.set_worker_stats(e.name(), &s);
                // A role another process switched (a fleet planner) shows here first;
                // the gauge follows what the entry holds, however it learned it (a
                // stale-epoch refusal may have taught it before this report).
                if s.assignment.is_some() {
                    metrics.set_role(e.name(), e.role());
                }
            }
            None => metrics.forget_stats(e.name()),
        }
        // A worker taken out of the set while this round ran was forgotten then, or
        // is being forgotten now. Set first, look second: in either order its last
        // figures do not outlive it.
        if e.is_draining() {
            metrics.forget_stats(e.name());
            metrics.forget_role(e.name());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_protocol::WorkerStats;
    use pdserve_router::WorkerSet;
    use pdserve_testkit::FakeWorker;
    use pdserve_types::PoolStats;
    use pdserve_types::Role;

    /// A round polls a worker, the worker dies and leaves the set (its series are
    /// dropped), then the round lands: its used blocks must not stand forever.
    #[test]
    fn a_round_that_lands_after_its_worker_left_leaves_no_figures() {
        let set = WorkerSet::default();
        let id = set.add(Arc::new(FakeWorker::new("d-1", Role::Decode, 64)));
        let polled = set.get(id).expect("just added");
        let metrics = Metrics::new();
        let stats = WorkerStats { blocks: PoolStats { used: 26, ..Default::default() }, ..Default::default() };
        publish(&metrics, vec![(polled.clone(), Some(stats.clone()))]);
        assert!(metrics.render().contains("worker=\"d-1\",state=\"used\",tier=\"device\"} 26"));
        set.remove(id);
        metrics.forget_worker("d-1");
        publish(&metrics, vec![(polled, Some(stats))]);
        let text = metrics.render();
        let gauges = ["pdserve_kv_blocks{", "pdserve_worker_requests{", "pdserve_worker_role{"];
        let stale: Vec<_> =
            text.lines().filter(|l| gauges.iter().any(|g| l.starts_with(g)) && l.contains("d-1")).collect();
        assert!(stale.is_empty(), "{stale:?}");
    }
}
