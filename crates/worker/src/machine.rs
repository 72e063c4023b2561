//! The machine simulated workers share, as the profile measured it: its KV links,
//! how steps slow each other down, and the host work serving takes per token.

use crate::lock;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex};

/// A KV link as the profile measured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Seconds before the first byte lands (connection, first frame's round trip).
    pub latency_s: f64,
    pub bytes_per_s: f64,
}

impl LinkModel {
    /// Seconds from a prefill's end until the receiver holds all `bytes`, when each of
    /// `layers` layers' share was sent as soon as it was computed during `prefill_s`.
    pub fn tail(&self, bytes: f64, layers: usize, prefill_s: f64) -> f64 {
        let layers = layers.max(1) as f64;
        let send = bytes / self.bytes_per_s.max(1.0);
        // The last layer is sent after the compute; earlier layers overlap it unless
        // the link is slower than the compute.
        let behind = send - prefill_s * (layers - 1.0) / layers;
        self.latency_s + (send / layers).max(behind)
    }
}

/// How much longer a one-thread step takes while another worker of the same machine
/// computes, by what each is doing: a decode step streams the weights from memory,
/// a prompt chunk is bound by arithmetic, and the two contend for different parts of
/// a machine (its memory bandwidth, or the cores a hypervisor shares). Each factor is
/// a step's time beside the other over its time alone.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CoRun {
    pub decode_beside_decode: f64,
    pub decode_beside_prefill: f64,
    pub prefill_beside_decode: f64,
    pub prefill_beside_prefill: f64,
}

impl CoRun {
    /// The same factor whatever the steps are.
    pub fn uniform(factor: f64) -> CoRun {
        CoRun {
            decode_beside_decode: factor,
            decode_beside_prefill: factor,
            prefill_beside_decode: factor,
            prefill_beside_prefill: factor,
        }
    }

    /// The factor for a step whose time is a `own` share prompt chunks, beside
    /// neighbours whose steps are a `others` share prompt chunks on average: the
    /// four measured pairs, weighted by those shares.
    pub fn factor(&self, own: f64, others: f64) -> f64 {
        let (p, q) = (own.clamp(0.0, 1.0), others.clamp(0.0, 1.0));
        let decode = (1.0 - q) * self.decode_beside_decode + q * self.decode_beside_prefill;
        let prefill = (1.0 - q) * self.prefill_beside_decode + q * self.prefill_beside_prefill;
        ((1.0 - p) * decode + p * prefill).max(1.0)
    }
}

/// The machine simulated workers share. A step that runs while another worker of the
/// machine computes takes longer, by the [`CoRun`] factor the profile measured for
/// the two steps' kinds; and once the workers' busy threads fill every core, the
/// host work serving does per streamed token (the frontend, the router, the client)
/// comes out of the step's time, less what the step's own threads leave idle.
#[derive(Debug)]
pub struct Machine {
    load: Mutex<Load>,
    cores: usize,
    co_run: CoRun,
    /// Host CPU seconds per streamed token.
    host_token_s: f64,
}

/// What the machine's workers compute now.
#[derive(Debug, Default)]
struct Load {
    /// Compute threads busy, over all the machine's workers.
    threads: usize,
    /// Those threads weighted by the share of their step that is prompt chunks.
    prefill_threads: f64,
}

impl Machine {
    pub fn new(cores: usize, co_run: CoRun, host_token_s: f64) -> Arc<Machine> {
        Arc::new(Machine {
            load: Mutex::new(Load::default()),
            cores: cores.max(1),
            co_run,
            host_token_s: host_token_s.max(0.0),
        })
    }

    /// Marks `threads` computing a step whose time is a `prefill_share` share prompt
    /// chunks, until the guard drops.
    pub(crate) fn busy(&self, threads: usize, prefill_share: f64) -> Busy<'_> {
        let share = prefill_share.clamp(0.0, 1.0);
        let mut load = lock(&self.load);
        let (others, others_prefill) = (load.threads, load.prefill_threads);
        load.threads += threads;
        load.prefill_threads += share * threads as f64;
        let slowdown = match others {
            0 => 1.0,
            n => self.co_run.factor(share, others_prefill / n as f64),
        };
        Busy { machine: self, threads, share, slowdown, saturated: others + threads >= self.cores }
    }
}

pub(crate) struct Busy<'a> {
    machine: &'a Machine,
    threads: usize,
    share: f64,
    slowdown: f64,
    saturated: bool,
}

impl Busy<'_> {
    /// How long a step of `compute` modelled seconds that streams `tokens` takes,
    /// its threads idle for `idle` core-seconds of it.
    pub(crate) fn seconds(&self, compute: f64, idle: f64, tokens: usize) -> f64 {
        let m = self.machine;
        // Host work first takes the cores the step leaves idle.
        let host = if self.saturated { (tokens as f64 * m.host_token_s - idle).max(0.0) } else { 0.0 };
        compute * self.slowdown + host
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut load = lock(&self.machine.load);
        load.threads -= self.threads;
        load.prefill_threads = (load.prefill_threads - self.share * self.threads as f64).max(0.0);
    }
}
