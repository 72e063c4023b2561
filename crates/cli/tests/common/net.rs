//! Hosts for the multi-host tests: Linux network namespaces on one bridge, each with
//! its own address, its cable to unplug and its link to throttle. Needs root.

use super::{ip, system_tool};
use std::process::Command;

pub fn tc() -> &'static str {
    system_tool("tc")
}

/// Runs a command that must succeed.
pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Hosts on a bridge, removed when dropped (after the processes in them).
pub struct Net {
    pub tag: String,
    subnet: u8,
    bridge: String,
    hosts: Vec<String>,
}

impl Net {
    /// `hosts` hosts on a new bridge.
    pub fn new(hosts: usize) -> Net {
        assert_eq!(unsafe { libc::geteuid() }, 0, "the multi-host tests need root (network namespaces)");
        // Unique among this process's nets (tests run side by side) and, mostly,
        // among other test processes': interface names stay within 15 bytes.
        static NETS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let (pid, n) = (std::process::id(), NETS.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        let tag = format!("pd{}{}", pid % 10_000, n % 10);
        let subnet = ((pid + 41 * n) % 200 + 20) as u8;
        let bridge = format!("{tag}br");
        let _ = Command::new(ip()).args(["link", "del", &bridge]).output();
        sh(&[ip(), "link", "add", &bridge, "type", "bridge"]);
        sh(&[ip(), "addr", "add", &format!("10.231.{subnet}.254/24"), "dev", &bridge]);
        sh(&[ip(), "link", "set", &bridge, "up"]);
        let mut net = Net { tag, subnet, bridge, hosts: Vec::new() };
        for _ in 0..hosts {
            net.add_host();
        }
        net
    }

    /// A new host: a namespace with loopback and one veth into the bridge.
    pub fn add_host(&mut self) -> usize {
        let i = self.hosts.len();
        let ns = format!("{}h{i}", self.tag);
        let _ = Command::new(ip()).args(["netns", "del", &ns]).output();
        sh(&[ip(), "netns", "add", &ns]);
        let (inner, outer) = (format!("{}i{i}", self.tag), self.veth(i));
        sh(&[ip(), "link", "add", &inner, "type", "veth", "peer", "name", &outer]);
        sh(&[ip(), "link", "set", &inner, "netns", &ns]);
        sh(&[ip(), "link", "set", &outer, "master", &self.bridge, "up"]);
        sh(&[ip(), "netns", "exec", &ns, ip(), "addr", "add", &format!("{}/24", self.ip(i)), "dev", &inner]);
        sh(&[ip(), "netns", "exec", &ns, ip(), "link", "set", &inner, "up"]);
        sh(&[ip(), "netns", "exec", &ns, ip(), "link", "set", "lo", "up"]);
        self.hosts.push(ns);
        i
    }

    pub fn ip(&self, host: usize) -> String {
        format!("10.231.{}.{}", self.subnet, host + 1)
    }

    /// The bridge side of host `i`'s cable.
    pub fn veth(&self, host: usize) -> String {
        format!("{}o{host}", self.tag)
    }

    pub fn ns(&self, host: usize) -> &str {
        &self.hosts[host]
    }

    /// Unplugs (or plugs back) host `i`'s cable.
    pub fn cable(&self, host: usize, up: bool) {
        sh(&[ip(), "link", "set", &self.veth(host), if up { "up" } else { "down" }]);
    }

    /// Limits what reaches host `i` to 20 Mbit/s with up to 50 ms of queue, or lifts
    /// the limit.
    pub fn throttle(&self, host: usize, on: bool) {
        let dev = self.veth(host);
        match on {
            true => sh(&[
                tc(),
                "qdisc",
                "add",
                "dev",
                &dev,
                "root",
                "tbf",
                "rate",
                "20mbit",
                "burst",
                "32kb",
                "latency",
                "50ms",
            ]),
            false => sh(&[tc(), "qdisc", "del", "dev", &dev, "root"]),
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.hosts {
            let _ = Command::new(ip()).args(["netns", "del", ns]).output();
        }
        let _ = Command::new(ip()).args(["link", "del", &self.bridge]).output();
    }
}
