//! `pdserve worker --group NAME --layers A..B`: one stage of a model split by layers
//! across processes. The stage holding layer 0 is the group's head: a worker as any
//! other to routers, given the later stages' addresses (`--stage`) or finding them in
//! the fleet (`--nats`, where each later stage announces itself). A later stage
//! serves only the head's calls, on `--listen`.

use super::http::{self, Stopped};
use anyhow::Context;
use pdserve_engine::batch::StageRunner;
use pdserve_engine::loader::LoadedModel;
use pdserve_engine::model::stage::{head_cost, heads_by_links, StageBytes};
use pdserve_engine::model::LayerRange;
use pdserve_kv_transfer::{ClusterKey, Links, StageServer, TcpReceiver};
use pdserve_worker::stages::{stage_inboxes, RemoteStages, StageHello, StageService};
use std::net::SocketAddr;

/// Rows a later stage takes in one step: past any head's batch budget.
const STAGE_MAX_ROWS: usize = 4096;

#[derive(clap::Args, Clone)]
pub struct GroupArgs {
    /// The stage group this worker is a stage of: the model split by layers across
    /// processes (see --layers).
    #[arg(long, requires = "layers")]
    group: Option<String>,
    /// The layers this stage holds, A..B (from 0, both included). The stage with
    /// layer 0 heads the group and takes requests; a later one serves the head.
    #[arg(long, requires = "group")]
    layers: Option<LayerRange>,
    /// A later stage of the group (its --listen address), for the head; repeat for
    /// each. The head serves once the stages' layers and its own cover the model.
    /// With --nats and no --stage, the head takes the stages of its group and model
    /// that announce themselves in the fleet.
    #[arg(long = "stage", requires = "group")]
    stages: Vec<SocketAddr>,
    /// For the head: send every step through the stages whole. By default the head
    /// cuts a step into micro-batches that follow one another through the stages,
    /// and runs its decodes in two lanes pipelined across steps, where the stages'
    /// measured costs predict it ends sooner.
    #[arg(long, requires = "group")]
    no_micro_batches: bool,
}

/// Where a stage meets the fleet: its NATS settings, the address others reach it at
/// (`--advertise`) and its node id.
pub struct InFleet {
    pub cfg: pdserve_fleet::NatsConfig,
    pub advertise: Option<std::net::IpAddr>,
    pub node_id: Option<pdserve_fleet::NodeId>,
}

/// What a worker process is in a stage group.
pub enum Part {
    /// Not in one: it holds the whole model.
    Whole,
    /// The head, with its later stages.
    Head(Box<RemoteStages>),
    /// A later stage, served until it was stopped.
    Later(Stopped),
}

/// The blocks, threads and K/V dtype a stage's pool and runner take.
type Shape = (usize, usize, pdserve_types::KvDtype);

impl GroupArgs {
    /// What this worker is (`m`: its model, `None` for a simulated engine); a later
    /// stage is served here, on `listen`, until it stops.
    pub fn part(
        &self,
        m: Option<&LoadedModel>,
        listen: (SocketAddr, Option<SocketAddr>),
        how: Shape,
        key: &ClusterKey,
        fleet: Option<InFleet>,
    ) -> anyhow::Result<Part> {
        Ok(match (m, self.layers) {
            (_, None) => Part::Whole,
            (None, Some(_)) => anyhow::bail!("a stage group runs the real engine"),
            (Some(m), Some(l)) if l.embeds() => Part::Head(Box::new(self.head_stages(m, how.0, key))),
            (Some(m), Some(_)) => Part::Later(serve(self, m, (listen, fleet), how, key.clone())?),
        })
    }

    /// The head's stages found in the fleet from now on, where it was given none
    /// (on the current runtime).
    pub fn find(&self, stages: RemoteStages, fleet: Option<&InFleet>, model: &str) -> RemoteStages {
        let (Some(f), true) = (fleet, self.stages.is_empty()) else { return stages };
        let found = pdserve_fleet::find_stages(f.cfg.clone(), self.name(), model);
        stages.with_finder(Box::new(move || found.lock().map(|a| a.clone()).unwrap_or_default()))
    }

    /// The layers to load (all when not a stage).
    pub fn layers(&self) -> Option<LayerRange> {
        self.layers
    }

    /// Refuses what a stage group cannot be (`tiers`: whether K/V tiers are asked
    /// for; `nats`: whether the fleet is). The head's role is the group's (a later
    /// stage serves its head's steps whatever its own `--role` says), and so are its
    /// tiers (a later stage keeps as many slots as its head, of its own layers).
    pub fn check(&self, tiers: bool, nats: bool) -> anyhow::Result<()> {
        let Some(layers) = self.layers else { return Ok(()) };
        if tiers && !layers.embeds() {
            anyhow::bail!(
                "a later stage keeps the K/V tiers its head has (layers {layers}): give --kv-host-gb and --kv-disk-gb to the head"
            );
        }
        if layers.embeds() && self.stages.is_empty() && !nats {
            anyhow::bail!(
                "the head of stage group {} (layers {layers}) needs --stage ADDR for each later stage, or --nats to find them",
                self.name()
            );
        }
        if !layers.embeds() && !self.stages.is_empty() {
            anyhow::bail!("--stage is for the group's head (the stage with layer 0); layers {layers} serve a head");
        }
        Ok(())
    }

    fn name(&self) -> &str {
        self.group.as_deref().unwrap_or("?")
    }

    /// The head's view of its later stages, tried once now (they may start later).
    fn head_stages(&self, m: &LoadedModel, blocks: usize, key: &ClusterKey) -> RemoteStages {
        let hello = hello_of(m, blocks);
        let mut stages = RemoteStages::new(hello, &self.stages, key.clone());
        if self.no_micro_batches {
            stages = stages.whole_steps();
        }
        match stages.connect(true) {
            None => tracing::info!(group = self.name(), "stage group whole"),
            Some(why) => tracing::warn!(group = self.name(), "stage group not whole yet: {why}"),
        }
        stages
    }
}

fn hello_of(m: &LoadedModel, blocks: usize) -> StageHello {
    let c = &m.model.cfg;
    StageHello {
        layers: m.model.layers(),
        total_layers: c.n_layers,
        hidden: c.hidden,
        vocab: c.vocab_size,
        blocks,
        kv_port: 0,
        model: m.name.clone(),
    }
}

/// Serves a later stage on `listen` (its K/V receiver on the second address,
/// by default a free port of the same host) until SIGINT/SIGTERM, announced in the
/// fleet when it is in one.
fn serve(
    g: &GroupArgs,
    m: &LoadedModel,
    ((listen, kv_listen), fleet): ((SocketAddr, Option<SocketAddr>), Option<InFleet>),
    how: Shape,
    key: ClusterKey,
) -> anyhow::Result<Stopped> {
    let (blocks, threads, dtype) = how;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Before the announcement, so a signal right after it is handled.
    let signal = {
        let _in = rt.enter();
        http::signal()
    };
    let listener = std::net::TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    let kv_at = kv_listen.unwrap_or(SocketAddr::new(listen.ip(), 0));
    let inboxes = stage_inboxes(&m.model, key.clone());
    let kv = rt
        .block_on(TcpReceiver::bind(kv_at, inboxes.clone()))
        .with_context(|| format!("cannot listen for K/V on {kv_at}"))?;
    let runner = StageRunner::new(m.model.clone(), blocks, dtype, threads, STAGE_MAX_ROWS);
    let service = StageService::new(runner, blocks, m.name.clone()).sending_parts(Links::new(key.clone())).receiving(
        inboxes,
        kv.local_addr().port(),
        rt.handle().clone(),
    );
    let server = StageServer::start(listener, key, service)?;
    tracing::info!(
        "pdserve worker: stage {} of group {} ({} thread(s), {blocks} KV blocks of {dtype}, {:.0} MiB of weights) listening on {}, K/V on {}",
        m.model.layers(),
        g.name(),
        threads,
        m.model.weight_bytes() as f64 / (1 << 20) as f64,
        server.local_addr(),
        kv.local_addr()
    );
    let announced = match fleet {
        Some(f) => Some(announce(g, m, &f, server.local_addr(), &rt)?),
        None => None,
    };
    rt.block_on(async move {
        signal.await;
        if let Some(reg) = announced {
            reg.deregister().await;
        }
    });
    drop(server);
    drop(kv);
    tracing::info!("pdserve worker: stage stopped");
    Ok(Stopped::Drained)
}

/// Announces the later stage serving at `at` in the fleet, on `rt`.
fn announce(
    g: &GroupArgs,
    m: &LoadedModel,
    f: &InFleet,
    at: SocketAddr,
    rt: &tokio::runtime::Runtime,
) -> anyhow::Result<pdserve_fleet::Registration> {
    if f.advertise.is_none() && at.ip().is_unspecified() {
        anyhow::bail!("a stage listening on {at} must say where its head reaches it: add --advertise IP");
    }
    let addr = f.advertise.map_or(at, |ip| SocketAddr::new(ip, at.port()));
    let l = m.model.layers();
    let id =
        f.node_id.clone().unwrap_or_else(|| pdserve_fleet::NodeId::sanitized(&format!("stage-{}-{addr}", g.name())));
    let rec = pdserve_fleet::StageRecord {
        group: g.name().to_string(),
        model: m.name.clone(),
        first: l.first,
        last: l.last,
        addr,
    };
    let _in = rt.enter();
    Ok(pdserve_fleet::announce_stage(f.cfg.clone(), id, rec))
}

#[derive(clap::Args)]
pub struct SplitArgs {
    /// The model to split (a path, a known name or hf:ORG/REPO[:QUANT]).
    #[arg(long, default_value = "default")]
    model: String,
    /// Each node's memory for the model and its K/V, in GB, the head's first:
    /// `--memory-gb 8,4,4`.
    #[arg(long, value_delimiter = ',', required_unless_present = "nats", conflicts_with = "nats")]
    memory_gb: Vec<f64>,
    /// KV blocks every stage keeps (as each stage's --kv-blocks).
    #[arg(long, default_value_t = 1024)]
    kv_blocks: usize,
    /// How the K/V is stored (as the workers' --kv-cache-dtype).
    #[arg(long, default_value = "f16")]
    kv_cache_dtype: pdserve_types::KvDtype,
    /// The links between the nodes (numbered as in --memory-gb, from 0), each
    /// `I-J=MS:GBPS`: round trip in ms and GB/s, the figures `pdserve fleet` shows
    /// for running nodes. With them the head is the node whose hops to the others
    /// cost least (that can hold the embeddings); without, the first.
    #[arg(long, value_delimiter = ',', conflicts_with = "nats")]
    link: Vec<String>,
    /// Instead of --memory-gb and --link: the fleet's nodes, each with the memory its
    /// host has available (as its record says) and the links it probed.
    #[command(flatten)]
    nats: super::fleet::NatsArgs,
    /// With --nats: the nodes to place the group on, by node id [default: every node
    /// registered].
    #[arg(long, value_delimiter = ',', requires = "nats")]
    nodes: Vec<String>,
}

/// The nodes a group is placed on: their names, memory (GB) and links.
struct Nodes {
    names: Vec<String>,
    memory_gb: Vec<f64>,
    links: Vec<NodeLink>,
}

impl SplitArgs {
    /// The nodes given by flags, numbered from 0, or read from the fleet.
    fn nodes(&self) -> anyhow::Result<Nodes> {
        let Some(cfg) = self.nats.config("pdserve-split", None) else {
            let links = node_links(&self.link, self.memory_gb.len()).map_err(anyhow::Error::msg)?;
            let names = (0..self.memory_gb.len()).map(|i| i.to_string()).collect();
            return Ok(Nodes { names, memory_gb: self.memory_gb.clone(), links });
        };
        let records = super::fleet::records(&cfg)?;
        fleet_nodes(&records, &self.nodes).map_err(anyhow::Error::msg)
    }
}

/// The fleet's `records` (those named in `wanted`, in its order; all where it is
/// empty) as nodes to place a group on: each one's available memory, and the links
/// it probed to the others (a probe's time as the round trip).
fn fleet_nodes(records: &[pdserve_fleet::NodeRecord], wanted: &[String]) -> Result<Nodes, String> {
    let chosen: Vec<&pdserve_fleet::NodeRecord> = match wanted.is_empty() {
        true => records.iter().collect(),
        false => wanted
            .iter()
            .map(|id| records.iter().find(|r| r.node_id.as_str() == id).ok_or(format!("no node {id} in the fleet")))
            .collect::<Result<_, _>>()?,
    };
    if chosen.is_empty() {
        return Err("no node is registered in the fleet".into());
    }
    if let Some(r) = chosen.iter().find(|r| r.memory_available == 0) {
        return Err(format!("node {} does not say what memory it has available", r.node_id));
    }
    let names: Vec<String> = chosen.iter().map(|r| r.node_id.to_string()).collect();
    // In GB to the hundredth, as a person would write them.
    let memory_gb = chosen.iter().map(|r| (r.memory_available as f64 / 1e7).floor() / 100.0).collect();
    let mut links = Vec::new();
    for (i, r) in chosen.iter().enumerate() {
        for l in &r.links {
            let Some(j) = names.iter().position(|n| n == l.to.as_str()).filter(|&j| j != i) else { continue };
            if l.gb_per_s > 0.0 && l.latency_ms >= 0.0 {
                links.push(NodeLink { i, j, round_trip_ms: l.latency_ms, gb_per_s: l.gb_per_s });
            }
        }
    }
    Ok(Nodes { names, memory_gb, links })
}

/// A link of `--link`: nodes `I` and `J` joined with this round trip and bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
struct NodeLink {
    i: usize,
    j: usize,
    round_trip_ms: f64,
    gb_per_s: f64,
}

impl std::str::FromStr for NodeLink {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("--link {s:?}: want I-J=MS:GBPS, e.g. 0-1=0.1:1.17");
        let (pair, figures) = s.split_once('=').ok_or_else(bad)?;
        let (i, j) = pair.split_once('-').ok_or_else(bad)?;
        let (ms, gbps) = figures.split_once(':').ok_or_else(bad)?;
        let (i, j) = (i.trim().parse().map_err(|_| bad())?, j.trim().parse().map_err(|_| bad())?);
        let (round_trip_ms, gb_per_s): (f64, f64) =
            (ms.trim().parse().map_err(|_| bad())?, gbps.trim().parse().map_err(|_| bad())?);
        if i == j || !(round_trip_ms.is_finite() && round_trip_ms >= 0.0) || !(gb_per_s.is_finite() && gb_per_s > 0.0) {
            return Err(bad());
        }
        Ok(NodeLink { i, j, round_trip_ms, gb_per_s })
    }
}

/// The links of `--link` between `nodes` nodes, or why one is not.
fn node_links(given: &[String], nodes: usize) -> Result<Vec<NodeLink>, String> {
    let links = given.iter().map(|l| l.parse::<NodeLink>()).collect::<Result<Vec<_>, _>>()?;
    match links.iter().find(|l| l.i >= nodes || l.j >= nodes) {
        Some(l) => Err(format!("--link {}-{}: there are {nodes} nodes, numbered from 0", l.i, l.j)),
        None => Ok(links),
    }
}

/// What one decode row's hop costs between each pair of `nodes` (ms; `None` where no
/// link is given): half the round trip and a residual row of `hidden` f32 values over
/// the bandwidth, the same both ways.
fn hop_costs(links: &[NodeLink], nodes: usize, hidden: usize) -> Vec<Vec<Option<f64>>> {
    let mut hop = vec![vec![None; nodes]; nodes];
    for l in links {
        let ms = l.round_trip_ms / 2.0 + (hidden * 4) as f64 / (l.gb_per_s * 1e9) * 1e3;
        hop[l.i][l.j] = Some(ms);
        hop[l.j][l.i] = Some(ms);
    }
    hop
}

/// `pdserve split`: each node's `--layers` for a group of nodes of the memory given,
/// from the model file's tensor sizes, or one line on why they cannot hold it.
pub fn split(a: &SplitArgs) -> anyhow::Result<()> {
    use pdserve_engine::format::gguf::GgufFile;
    let Nodes { names, memory_gb, links } = a.nodes()?;
    let path = super::model_path(&a.model)?;
    let file = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let cfg = pdserve_engine::config::ModelConfig::from_gguf(&file.header)?;
    let bytes = |name: &str| file.header.tensor(name).map_or(0.0, |t| t.n_bytes as f64);
    let layers: Vec<f64> = (0..cfg.n_layers)
        .map(|i| {
            let prefix = format!("blk.{i}.");
            file.header.tensors.iter().filter(|t| t.name.starts_with(&prefix)).map(|t| t.n_bytes as f64).sum()
        })
        .collect();
    // A model with tied embeddings is held with its output head as a second copy.
    let head = match file.header.tensor("output.weight") {
        Some(t) => t.n_bytes as f64,
        None => bytes("token_embd.weight"),
    };
    // A step of the engine's most rows, and on the head a final row and its logits
    // for each sequence.
    let engine = pdserve_engine::batch::EngineConfig::default();
    let logits = (engine.max_seqs * (cfg.vocab_size + cfg.hidden) * 4) as f64;
    let first = bytes("token_embd.weight") + head + bytes("output_norm.weight") + logits;
    let kv_token = pdserve_engine::kvcache::bytes_per_token(&cfg, a.kv_cache_dtype) as f64 / cfg.n_layers as f64;
    let kv = kv_token * (a.kv_blocks * pdserve_engine::batch::BLOCK_SIZE) as f64;
    let step = pdserve_engine::model::step_bytes(&cfg, engine.max_batch_tokens) as f64;
    let need = StageBytes { layers: &layers, first, kv, step };
    let memory: Vec<f64> = memory_gb.iter().map(|g| g * 1e9).collect();
    let hop = hop_costs(&links, memory.len(), cfg.hidden);
    let heads = if links.is_empty() { vec![0] } else { heads_by_links(&hop) };
    let (order, ranges) = need.place(&memory, &heads).map_err(anyhow::Error::msg)?;
    let mib = |b: f64| b / (1 << 20) as f64;
    for (at, (&node, r)) in order.iter().zip(&ranges).enumerate() {
        let role = if at == 0 { "the head" } else { "a later stage" };
        println!(
            "node {} ({} GB, {role}): --layers {r}  ({:.0} MiB of weights and K/V as the file stores them, and a step's buffers)",
            names[node],
            memory_gb[node],
            mib(need.of(at, *r))
        );
    }
    if !links.is_empty() {
        match head_cost(&hop, order[0]) {
            ms if ms.is_finite() => {
                println!("links: {ms:.3} ms a decode step at batch 1 (each later stage's row out and back)")
            }
            _ => println!("links: not every link from the head was given; its hops are not priced"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fleet record of node `id`: `memory_available` bytes, and links (to, ms, GB/s).
    fn record(id: &str, memory_available: u64, links: &[(&str, f64, f64)]) -> pdserve_fleet::NodeRecord {
        let links: Vec<serde_json::Value> = links
            .iter()
            .map(|&(to, ms, gb)| {
                serde_json::json!({"to": to, "transport": "tcp", "gb_per_s": gb, "latency_ms": ms, "measured_unix_ms": 0})
            })
            .collect();
        let r = serde_json::json!({
            "node_id": id, "model": "m", "role": "mixed", "epoch": 0, "protocol": 1,
            "endpoints": {"control": "127.0.0.1:1", "kv": "127.0.0.1:2"}, "threads": 1,
            "kv_cache": {"block_size": 16, "blocks_total": 1, "blocks_free": 1, "blocks_used": 0, "blocks_cached": 0},
            "load": {"queued_prompt_tokens": 0, "waiting": 0, "running": 0, "importing": 0},
            "links": links, "memory_available": memory_available, "updated_unix_ms": 0,
        });
        serde_json::from_value(r).expect("a record")
    }

    #[test]
    fn fleet_nodes_bring_their_memory_and_the_links_among_them() {
        let records = [
            record("a", 8_000_000_000, &[("b", 0.2, 1.0), ("z", 0.1, 1.0), ("a", 0.1, 9.0)]),
            record("b", 4_009_999_999, &[("c", 0.3, 0.5)]),
            record("c", 2_500_000_000, &[("a", 0.4, 0.1), ("b", 0.3, 0.0)]),
        ];
        let all = fleet_nodes(&records, &[]).expect("every node");
        assert_eq!(all.names, ["a", "b", "c"]);
        assert_eq!(all.memory_gb, [8.0, 4.0, 2.5], "to the hundredth, down");
        // Links to a node not placed on, to itself, or of no bandwidth are left out.
        let want = [
            NodeLink { i: 0, j: 1, round_trip_ms: 0.2, gb_per_s: 1.0 },
            NodeLink { i: 1, j: 2, round_trip_ms: 0.3, gb_per_s: 0.5 },
            NodeLink { i: 2, j: 0, round_trip_ms: 0.4, gb_per_s: 0.1 },
        ];
        assert_eq!(all.links, want);
        let two = fleet_nodes(&records, &["c".into(), "a".into()]).expect("two nodes");
        assert_eq!((two.names, two.memory_gb), (vec!["c".to_string(), "a".into()], vec![2.5, 8.0]));
        assert_eq!(two.links, [NodeLink { i: 0, j: 1, round_trip_ms: 0.4, gb_per_s: 0.1 }]);
        // (records, wanted, what the one-line error names)
        let unknown = record("d", 0, &[]);
        let cases: &[(&[pdserve_fleet::NodeRecord], &[&str], &str)] = &[
            (&records, &["x"], "no node x"),
            (&[], &[], "no node is registered"),
            (std::slice::from_ref(&unknown), &[], "node d does not say"),
        ];
        for (recs, wanted, why) in cases {
            let wanted: Vec<String> = wanted.iter().map(|s| s.to_string()).collect();
            let err = fleet_nodes(recs, &wanted).err().expect("an error");
            assert!(err.contains(why), "{err}");
        }
    }
}
