//! `pdserve fleet`: the nodes registered in the NATS fleet and the links they
//! measured, as tables or JSON; and the NATS flags `worker`, `frontend` and `fleet`
//! share.

use pdserve_fleet::{Bus, NatsConfig, NodeRecord, Plan};
use pdserve_kv_transfer::ClusterKey;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach the fleet's NATS.
#[derive(clap::Args, Clone)]
pub struct NatsArgs {
    /// NATS server URL (several, comma separated, for a cluster). Credentials: see
    /// --nats-creds, or PDSERVE_NATS_USER + PDSERVE_NATS_PASSWORD, or PDSERVE_NATS_TOKEN;
    /// PDSERVE_NATS_INBOX_PREFIX replaces `_INBOX` for replies (per-user permissions:
    /// deploy/nats/permissions.conf).
    #[arg(long)]
    pub nats: Option<String>,
    /// NATS credentials file (`.creds`, JWT + NKey).
    #[arg(long, requires = "nats")]
    nats_creds: Option<PathBuf>,
    /// Copies of the fleet bucket, when this process creates it in a JetStream cluster.
    #[arg(long, default_value_t = 1, requires = "nats")]
    nats_replicas: usize,
    /// With --river: the subjects (by prefix, comma separated) a request's `reply_to`
    /// may name. The frontend publishes results there with its own NATS rights.
    #[arg(long, value_delimiter = ',', default_value = pdserve_fleet::forest::DEFAULT_REPLY_PREFIX)]
    pub river_reply_prefix: Vec<String>,
}

impl NatsArgs {
    /// The NATS settings, when `--nats` was given.
    /// With `key`, what this process writes to the fleet bucket is sealed and what
    /// it reads there must verify; without, records and the plan are read unchecked
    /// (for a tool that only shows them).
    pub fn config(&self, client_name: &str, key: Option<&ClusterKey>) -> Option<NatsConfig> {
        Some(NatsConfig {
            url: self.nats.clone()?,
            creds: self.nats_creds.clone(),
            replicas: self.nats_replicas,
            client_name: client_name.to_string(),
            key: key.cloned(),
        })
    }
}

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    /// Print the records as JSON (one array) instead of a table.
    #[arg(long)]
    json: bool,
    /// Print the fleet planner's plan instead (JSON: its holder and the role it wants
    /// of each node; `null` when no planner holds the lease).
    #[arg(long)]
    plan: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let Some(cfg) = a.nats.config("pdserve-fleet", None) else {
        anyhow::bail!("give --nats URL: the fleet's NATS server")
    };
    let (nodes, plan) =
        read(&cfg, |bus| async move { anyhow::Ok((bus.nodes().await?, pdserve_fleet::read_plan(&bus).await?)) })?;
    let now = pdserve_fleet::now_unix_ms();
    match (a.plan, a.json) {
        (true, _) => println!("{}", serde_json::to_string_pretty(&plan)?),
        (false, true) => println!("{}", serde_json::to_string_pretty(&nodes)?),
        (false, false) => {
            print!("{}", table(&nodes, plan.as_ref(), now));
            print!("{}", link_matrix(&nodes));
        }
    }
    Ok(())
}

/// The nodes registered in the fleet at `cfg`, their records read unchecked.
pub fn records(cfg: &NatsConfig) -> anyhow::Result<Vec<NodeRecord>> {
    read(cfg, |bus| async move { anyhow::Ok(bus.nodes().await?) })
}

/// What `f` reads from the fleet at `cfg`, on a runtime of its own.
fn read<T, F>(cfg: &NatsConfig, f: impl FnOnce(Bus) -> F) -> anyhow::Result<T>
where
    F: std::future::Future<Output = anyhow::Result<T>>,
{
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let bus = tokio::time::timeout(Duration::from_secs(10), Bus::connect(cfg))
            .await
            .map_err(|_| anyhow::anyhow!("NATS at {} did not answer within 10 s", cfg.url))??;
        f(bus).await
    })
}

/// The nodes as an aligned text table, with the role a fleet planner wants of each;
/// `now_ms` dates the heartbeats.
fn table(nodes: &[NodeRecord], plan: Option<&Plan>, now_ms: u64) -> String {
    let mut rows = vec![vec![
        "NODE",
        "ROLE/EPOCH",
        "PLANNED",
        "MODEL",
        "CONTROL",
        "KV",
        "LOAD",
        "QUEUED TOK",
        "BLOCKS FREE/USED/CACHED",
        "KV DTYPE",
        "MEM AVAIL",
        "HEARTBEAT",
    ]
    .into_iter()
    .map(String::from)
    .collect()];
    for n in nodes {
        let k = &n.kv_cache;
        rows.push(vec![
            n.node_id.to_string(),
            format!("{}/{}", n.role, n.epoch.0),
            plan.and_then(|p| p.roles.get(&n.node_id)).map_or("-".into(), |a| format!("{}/{}", a.role, a.epoch.0)),
            n.model.clone(),
            n.endpoints.control.to_string(),
            n.endpoints.kv.to_string(),
            format!("{} run, {} wait", n.load.running, n.load.waiting + n.load.importing),
            n.load.queued_prompt_tokens.to_string(),
            format!("{}/{}/{}", k.blocks_free, k.blocks_used, k.blocks_cached),
            k.dtype.to_string(),
            match n.memory_available {
                0 => "-".into(),
                b => format!("{:.1} GB", b as f64 / 1e9),
            },
            format!("{:.1} s ago", now_ms.saturating_sub(n.updated_unix_ms) as f64 / 1000.0),
        ]);
    }
    let mut out = aligned(&rows);
    if nodes.is_empty() {
        out.push_str("(no node is registered)\n");
    }
    match plan {
        Some(p) => out.push_str(&format!(
            "planner: {} (plan written {:.1} s ago)\n",
            p.holder,
            now_ms.saturating_sub(p.updated_unix_ms) as f64 / 1000.0
        )),
        None => out.push_str("planner: none holds the lease\n"),
    }
    out
}

/// The probed links: one row per sending node, one column per receiving node, each
/// cell its rate and round trip; empty when no node has probed a link yet.
fn link_matrix(nodes: &[NodeRecord]) -> String {
    let mut to: Vec<&str> = nodes.iter().flat_map(|n| n.links.iter().map(|l| l.to.as_str())).collect();
    to.sort_unstable();
    to.dedup();
    if to.is_empty() {
        return String::new();
    }
    let mut rows = vec![std::iter::once("LINK FROM \\ TO").chain(to.iter().copied()).map(String::from).collect()];
    for n in nodes.iter().filter(|n| !n.links.is_empty()) {
        let cell = |peer: &str| match n.links.iter().find(|l| l.to.as_str() == peer) {
            Some(l) => format!("{:.2} GB/s {:.2} ms", l.gb_per_s, l.latency_ms),
            None => "-".into(),
        };
        rows.push(std::iter::once(n.node_id.to_string()).chain(to.iter().map(|p| cell(p))).collect());
    }
    format!("\n{}", aligned(&rows))
}

/// Rows of cells as left-aligned columns two spaces apart.
fn aligned(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows[0].len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in rows {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_fleet::{Endpoints, KvCache, LinkRecord, Load};
    use pdserve_types::{Epoch, Role};

    #[test]
    fn the_table_lines_up_and_dates_heartbeats() {
        let n = NodeRecord {
            node_id: "gpu-1".parse().unwrap(),
            name: "decode@10.0.0.2:7001".into(),
            model: "SmolLM2".into(),
            role: Role::Decode,
            epoch: Epoch(3),
            protocol: 1,
            endpoints: Endpoints { control: ([10, 0, 0, 2], 7001).into(), kv: ([10, 0, 0, 2], 7101).into() },
            threads: 1,
            kv_cache: KvCache {
                block_size: 16,
                blocks_total: 10,
                blocks_free: 6,
                blocks_used: 4,
                blocks_cached: 2,
                dtype: pdserve_types::KvDtype::Q8_0,
                bytes_per_token: 12_240,
            },
            load: Load { queued_prompt_tokens: 300, waiting: 1, running: 2, importing: 1 },
            links: vec![],
            memory_available: 7_960_000_000,
            updated_unix_ms: 10_000,
        };
        let plan = Plan {
            holder: "plan-a".into(),
            roles: [(n.node_id.clone(), pdserve_types::Assignment::new(Role::Prefill, Epoch(4)))].into(),
            updated_unix_ms: 9_000,
        };
        let t = table(std::slice::from_ref(&n), Some(&plan), 10_400);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].starts_with("gpu-1 "), "{t}");
        for cell in
            ["decode/3", "prefill/4", "10.0.0.2:7001", "2 run, 2 wait", "300", "6/4/2", "q8_0", "8.0 GB", "0.4 s ago"]
        {
            assert!(lines[1].contains(cell), "{cell} in {t}");
        }
        assert_eq!(lines[0].find("ROLE/EPOCH"), lines[1].find("decode/3"));
        assert_eq!(lines[0].find("PLANNED"), lines[1].find("prefill/4"));
        assert_eq!(lines[2], "planner: plan-a (plan written 1.4 s ago)");
        assert!(table(&[], None, 0).contains("no node"));
        assert!(table(std::slice::from_ref(&n), None, 0).contains(" - "), "no plan, no planned role");
        assert_eq!(link_matrix(&[n]), "");
    }

    #[test]
    fn the_link_matrix_has_a_row_per_sender_and_a_column_per_receiver() {
        let node = |id: &str, links: &[(&str, f64)]| NodeRecord {
            node_id: id.parse().unwrap(),
            name: id.into(),
            model: "m".into(),
            role: Role::Mixed,
            epoch: Epoch(0),
            protocol: 1,
            endpoints: Endpoints { control: ([10, 0, 0, 2], 7001).into(), kv: ([10, 0, 0, 2], 7101).into() },
            threads: 1,
            kv_cache: KvCache::default(),
            load: Load::default(),
            links: links
                .iter()
                .map(|&(to, gb)| LinkRecord {
                    to: to.parse().unwrap(),
                    transport: "tcp".into(),
                    gb_per_s: gb,
                    latency_ms: 0.25,
                    measured_unix_ms: 0,
                })
                .collect(),
            memory_available: 0,
            updated_unix_ms: 0,
        };
        let nodes = [node("a", &[("b", 1.5), ("c", 0.1)]), node("b", &[("a", 2.0)]), node("c", &[])];
        let m = link_matrix(&nodes);
        let lines: Vec<&str> = m.trim().lines().collect();
        assert_eq!(lines.len(), 3, "{m}");
        assert!(lines[0].starts_with("LINK FROM \\ TO") && lines[0].ends_with(" c"), "{m}");
        assert!(lines[1].starts_with("a ") && lines[1].contains("1.50 GB/s 0.25 ms"), "{m}");
        assert!(lines[1].contains("0.10 GB/s"), "{m}");
        assert!(lines[2].starts_with("b ") && lines[2].contains("2.00 GB/s"), "{m}");
        assert_eq!(lines[2].matches('-').count(), 2, "{m}");
    }
}
