//! `pdserve fleet`: the nodes registered in the NATS fleet, as a table or JSON; and
//! the NATS flags `worker`, `frontend` and `fleet` share.

use pdserve_fleet::{Bus, NatsConfig, NodeRecord};
use std::path::PathBuf;
use std::time::Duration;

/// How to reach the fleet's NATS.
#[derive(clap::Args, Clone)]
pub struct NatsArgs {
    /// NATS server URL (several, comma separated, for a cluster). Credentials: see
    /// --nats-creds, or PDSERVE_NATS_USER + PDSERVE_NATS_PASSWORD, or PDSERVE_NATS_TOKEN.
    #[arg(long)]
    pub nats: Option<String>,
    /// NATS credentials file (`.creds`, JWT + NKey).
    #[arg(long, requires = "nats")]
    nats_creds: Option<PathBuf>,
    /// Copies of the fleet bucket, when this process creates it in a JetStream cluster.
    #[arg(long, default_value_t = 1, requires = "nats")]
    nats_replicas: usize,
}

impl NatsArgs {
    /// The NATS settings, when `--nats` was given.
    pub fn config(&self, client_name: &str) -> Option<NatsConfig> {
        Some(NatsConfig {
            url: self.nats.clone()?,
            creds: self.nats_creds.clone(),
            replicas: self.nats_replicas,
            client_name: client_name.to_string(),
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
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let Some(cfg) = a.nats.config("pdserve-fleet") else { anyhow::bail!("give --nats URL: the fleet's NATS server") };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let nodes = rt.block_on(async {
        let bus = tokio::time::timeout(Duration::from_secs(10), Bus::connect(&cfg))
            .await
            .map_err(|_| anyhow::anyhow!("NATS at {} did not answer within 10 s", cfg.url))??;
        anyhow::Ok(bus.nodes().await?)
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&nodes)?);
    } else {
        print!("{}", table(&nodes, pdserve_fleet::now_unix_ms()));
    }
    Ok(())
}

/// The nodes as an aligned text table; `now_ms` dates the heartbeats.
fn table(nodes: &[NodeRecord], now_ms: u64) -> String {
    let mut rows = vec![[
        "NODE",
        "ROLE/EPOCH",
        "MODEL",
        "CONTROL",
        "KV",
        "LOAD",
        "QUEUED TOK",
        "BLOCKS FREE/USED/CACHED",
        "HEARTBEAT",
    ]
    .map(String::from)];
    for n in nodes {
        let k = &n.kv_cache;
        rows.push([
            n.node_id.to_string(),
            format!("{}/{}", n.role, n.epoch.0),
            n.model.clone(),
            n.endpoints.control.to_string(),
            n.endpoints.kv.to_string(),
            format!("{} run, {} wait", n.load.running, n.load.waiting + n.load.importing),
            n.load.queued_prompt_tokens.to_string(),
            format!("{}/{}/{}", k.blocks_free, k.blocks_used, k.blocks_cached),
            format!("{:.1} s ago", now_ms.saturating_sub(n.updated_unix_ms) as f64 / 1000.0),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for r in &rows {
        let cells: Vec<String> = r.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if nodes.is_empty() {
        out.push_str("(no node is registered)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdserve_fleet::{Endpoints, KvCache, Load};
    use pdserve_types::{Epoch, Role};

    #[test]
    fn the_table_lines_up_and_dates_heartbeats() {
        let n = NodeRecord {
            node_id: "gpu-1".parse().unwrap(),
            model: "SmolLM2".into(),
            role: Role::Decode,
            epoch: Epoch(3),
            protocol: 1,
            endpoints: Endpoints { control: ([10, 0, 0, 2], 7001).into(), kv: ([10, 0, 0, 2], 7101).into() },
            threads: 1,
            kv_cache: KvCache { block_size: 16, blocks_total: 10, blocks_free: 6, blocks_used: 4, blocks_cached: 2 },
            load: Load { queued_prompt_tokens: 300, waiting: 1, running: 2, importing: 1 },
            updated_unix_ms: 10_000,
        };
        let t = table(&[n], 10_400);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[1].starts_with("gpu-1 "), "{t}");
        for cell in ["decode/3", "10.0.0.2:7001", "2 run, 2 wait", "300", "6/4/2", "0.4 s ago"] {
            assert!(lines[1].contains(cell), "{cell} in {t}");
        }
        assert_eq!(lines[0].find("ROLE/EPOCH"), lines[1].find("decode/3"));
        assert!(table(&[], 0).contains("no node"));
    }
}
