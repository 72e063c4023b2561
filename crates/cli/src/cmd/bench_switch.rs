//! `pdserve bench switch`: how long a role switch through the fleet takes, from the
//! decision to the worker admitting work in its new role.
//!
//! It takes the planner lease itself (so no planner may run), switches one node back
//! and forth between two roles, and times each switch two ways: through the plan
//! alone (the worker follows the bucket and takes it; confirmed by polling its
//! stats over control), and as `pdserve planner` does it (the plan written, then the
//! role handed over control, whose answer confirms it).

use super::fleet::NatsArgs;
use pdserve_fleet::{Bus, Lease, NodeId};
use pdserve_protocol::{Capabilities, Worker};
use pdserve_remote::RemoteWorker;
use pdserve_types::{Assignment, Role};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct SwitchArgs {
    #[command(flatten)]
    nats: NatsArgs,
    /// The node to switch (an idle one: its role changes back and forth).
    #[arg(long)]
    node: NodeId,
    /// Switches per way.
    #[arg(long, default_value_t = 100)]
    count: usize,
    #[command(flatten)]
    security: super::Security,
}

/// How long one switch may take before the run fails.
const PATIENCE: Duration = Duration::from_secs(5);

pub fn run(a: SwitchArgs) -> anyhow::Result<()> {
    let key = a.security.key()?;
    let Some(cfg) = a.nats.config("pdserve-bench-switch", Some(&key)) else { anyhow::bail!("give --nats URL") };
    if a.count == 0 {
        anyhow::bail!("--count must be at least 1");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async move {
        let bus = Bus::connect(&cfg).await?;
        let Some(rec) = bus.nodes().await?.into_iter().find(|r| r.node_id == a.node) else {
            anyhow::bail!("node {} is not in the fleet bucket", a.node)
        };
        let Some(mut lease) = Lease::take(&bus, "bench-switch").await? else {
            anyhow::bail!("a planner holds the lease: stop it first (`pdserve fleet` names it)")
        };
        let worker = RemoteWorker::connect(rec.endpoints.control, &key).await?;
        let roles = worker.roles()?;
        let start = held(&worker).await?;
        let other = if start.role == Role::Mixed { Role::Decode } else { Role::Mixed };
        let mut next = start;
        let mut ways = [("plan only", Vec::new()), ("plan + control", Vec::new())];
        for i in 0..2 * a.count {
            let (name, times) = &mut ways[i % 2];
            next = next.switch(if next.role == start.role { other } else { start.role });
            let t0 = Instant::now();
            lease.write([(a.node.clone(), next)]).await?;
            if i % 2 == 0 {
                while held(&worker).await?.epoch < next.epoch {
                    anyhow::ensure!(t0.elapsed() < PATIENCE, "{name}: {} never took {next}", a.node);
                }
            } else {
                roles.set_role(next).await?;
            }
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            lease.renew().await?;
        }
        // Back to the role it had, at a newer epoch, and the lease given up.
        let back = next.switch(start.role);
        lease.write([(a.node.clone(), back)]).await?;
        roles.set_role(back).await?;
        lease.release().await;
        println!("role switches of {} ({} <-> {}), {} per way, ms:", a.node, start.role, other, a.count);
        println!("| way | p50 | p99 | max |\n|---|---|---|---|");
        for (name, mut t) in ways {
            t.sort_by(f64::total_cmp);
            let q = |p: f64| t[((t.len() - 1) as f64 * p).round() as usize];
            println!("| {name} | {:.2} | {:.2} | {:.2} |", q(0.5), q(0.99), q(1.0));
        }
        anyhow::Ok(())
    })
}

async fn held(w: &RemoteWorker) -> anyhow::Result<Assignment> {
    w.stats().await?.assignment.ok_or_else(|| anyhow::anyhow!("the worker does not report its role"))
}
