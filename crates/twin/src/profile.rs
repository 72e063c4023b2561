//! A profile: what one worker shape costs on one machine, as `pdserve profile`
//! measured it (or as derived from published figures, and then marked so).
//!
//! A step's time is fitted as linear in its shape (see
//! [`pdserve_engine::timed::StepCost`]): a fixed part, per token computed, per
//! attention pair, per logits row. The measured points stay in the file beside their
//! fitted values, so anyone can see how well the line fits. The timed decode steps'
//! departures from the line are then added back, interpolated over batch and context
//! ([`pdserve_engine::timed::DecodeTable`]): a request's TPOT is made of those steps.

use crate::TwinError;
use pdserve_engine::batch::{EngineConfig, SpecConfig};
use pdserve_engine::timed::{
    Clock, DecodeTable, RestoreCost, StepCost, StepShape, StepTime, TimedLookup, TimedModel, TimedSpeculation,
};
use pdserve_kv_transfer::TransportKind;
use pdserve_types::KvDtype;
use pdserve_worker::{CoRun, LinkModel};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const SCHEMA: u32 = 1;
/// Coefficients of a step cost.
const TERMS: usize = 5;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub schema: u32,
    /// Where the figures come from.
    pub provenance: Provenance,
    pub model: ModelShape,
    /// One entry per worker shape (compute threads) measured.
    pub shapes: Vec<Shape>,
    /// KV links by transport.
    pub links: Vec<Link>,
    /// Seconds a worker takes to change role in place.
    pub switch_s: f64,
    /// Seconds a request spends getting into a worker's engine beyond its compute
    /// (queues and hops between the router and the engine).
    pub admission_s: f64,
    /// Seconds each token a serving worker streams adds to its step beyond the bare
    /// engine's (its loop, routing the token to its stream, waking the threads that
    /// carry it).
    #[serde(default)]
    pub token_overhead_s: f64,
    /// CPU seconds serving spends per streamed token outside the engine (the frontend,
    /// the router, the client), which come out of the workers' time once their threads
    /// fill every core.
    #[serde(default)]
    pub host_token_s: f64,
    /// A decode step's time while a second one-thread worker decodes on the same
    /// machine, over its time alone.
    #[serde(default = "one")]
    pub co_run_slowdown: f64,
    /// That factor for each pair of step kinds (decode or prompt chunk, beside
    /// either); absent in a profile timed before they were, which then applies
    /// `co_run_slowdown` to every pair.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub co_run: Option<CoRun>,
    /// Seconds to copy one block back into the pool from the host tier and from the
    /// disk tier; absent in a profile timed before tiers were (the simulator then
    /// refuses tier flags).
    #[serde(default)]
    pub tiers: Option<RestoreCost>,
    /// The cores of the machine it was timed on (absent in a profile timed before
    /// they were stated, and in a derived one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cores: Option<usize>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Provenance {
    /// Timed on a machine by `pdserve profile`.
    Measured { machine: String, date: String, command: String },
    /// Computed from published figures; not measured.
    Derived { sources: Vec<String>, assumptions: Vec<String> },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub name: String,
    pub vocab_size: usize,
    pub context_length: usize,
    pub n_layers: usize,
    /// Bytes of K and V per token, all layers (what a handoff moves), in `kv_dtype`.
    pub kv_bytes_per_token: f64,
    /// How the profiled cache stored K and V.
    #[serde(default)]
    pub kv_dtype: KvDtype,
    /// KV blocks of 16 tokens a worker holds.
    pub kv_blocks: usize,
    /// The residual stream's width and the weights' bytes: what a stage group of the
    /// model sends per token and splits (0 in a profile timed before groups were).
    #[serde(default)]
    pub hidden: usize,
    #[serde(default)]
    pub weight_bytes: u64,
    /// Tokens per step and sequences at once, where the hardware wants other values
    /// than pdserve's defaults (512 and 64), as a GPU server's larger batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seqs: Option<usize>,
    /// Speculative decoding as measured on a server: drafts of so many tokens, and
    /// the share of drafted tokens accepted ([`Profile::with_speculation`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speculation: Option<SpecProfile>,
}

/// Speculation a profile's workers do, from a server's `/metrics`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecProfile {
    /// `--spec-tokens`.
    pub tokens: usize,
    /// `pdserve_spec_accepted_tokens_total / pdserve_spec_draft_tokens_total`.
    pub accepted_share: f64,
    /// `pdserve_spec_drafting_share`: the share of decode steps that had a draft.
    #[serde(default = "one")]
    pub drafting_share: f64,
    /// A draft model's step cost by threads (from its own profile); none: drafts
    /// are free, as an n-gram lookup nearly is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draft_steps: Vec<(usize, StepCost)>,
    /// The draft model's K/V bytes a prompt token (from its own profile): a handoff
    /// carries them after the target's where the draft model computed the prompt.
    #[serde(default)]
    pub draft_kv_bytes_per_token: f64,
    /// Beside a draft model, a lookup's drafts as a `--speculative ngram` server
    /// measured them on the same workload: (accepted share, drafting share). None: a
    /// request that drafts by lookup there drafts nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookup: Option<(f64, f64)>,
}

impl SpecProfile {
    /// The timed engine's speculation on `threads` threads.
    fn timed(&self, threads: usize) -> TimedSpeculation {
        let below = self.draft_steps.iter().filter(|(t, _)| *t <= threads).max_by_key(|(t, _)| *t);
        let step = below.or_else(|| self.draft_steps.iter().min_by_key(|(t, _)| *t)).map(|(_, s)| *s);
        let lookup = self.lookup.map(|(accepted, drafting)| TimedLookup {
            per_token: TimedSpeculation::from_share(accepted, self.tokens).per_token,
            drafting,
        });
        TimedSpeculation {
            drafting: self.drafting_share,
            draft_step: step,
            lookup,
            ..TimedSpeculation::from_share(self.accepted_share, self.tokens)
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    pub threads: usize,
    pub step: StepCost,
    /// What the fit was made from.
    pub points: Vec<Point>,
    /// The fixed part of a decode pass through every layer alone, without the output
    /// head or the step around it: what a stage group's stages share (absent in a
    /// profile timed before it was; a group's stages then share the step's whole
    /// fixed part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_fixed_s: Option<f64>,
}

/// One timed step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Point {
    #[serde(rename = "type")]
    pub kind: PointKind,
    /// Prompt tokens of the chunk, or sequences in the decode batch.
    pub size: usize,
    /// Positions already computed (each sequence's, for a decode).
    pub context: usize,
    pub seconds: f64,
    /// What the fitted step cost predicts.
    #[serde(default)]
    pub fitted: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PointKind {
    Prefill,
    Decode,
}

impl Point {
    pub fn shape(&self) -> StepShape {
        match self.kind {
            PointKind::Prefill => StepShape::prefill(self.context, self.size),
            PointKind::Decode => StepShape::decode(self.size, self.context),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// inproc | tcp | shm
    pub transport: String,
    pub latency_s: f64,
    pub bytes_per_s: f64,
}

impl Shape {
    /// Its timed decode steps' departures from the fitted line (none where they do
    /// not cover every batch at every context, as in a derived profile without points).
    pub fn decode_table(&self) -> DecodeTable {
        let residuals: Vec<(usize, usize, f64)> = self
            .points
            .iter()
            .filter(|p| p.kind == PointKind::Decode)
            .map(|p| (p.size, p.context, p.seconds - self.step.seconds(&p.shape())))
            .collect();
        DecodeTable::from_points(&residuals).unwrap_or_default()
    }
}

impl Profile {
    pub fn load(path: &Path) -> Result<Profile, TwinError> {
        let text = std::fs::read_to_string(path).map_err(|e| TwinError::io(path, e))?;
        let p: Profile = serde_json::from_str(&text)
            .map_err(|e| TwinError::Invalid(format!("{} is not a profile: {e}", path.display())))?;
        p.check().map_err(|e| TwinError::Invalid(format!("{}: {e}", path.display())))?;
        Ok(p)
    }

    pub fn save(&self, path: &Path) -> Result<(), TwinError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| TwinError::Invalid(e.to_string()))?;
        std::fs::write(path, text + "\n").map_err(|e| TwinError::io(path, e))
    }

    fn check(&self) -> Result<(), String> {
        if self.schema != SCHEMA {
            return Err(format!("profile schema {} (this build reads {SCHEMA})", self.schema));
        }
        if self.shapes.is_empty() {
            return Err("no worker shape".into());
        }
        let m = &self.model;
        if m.n_layers == 0 || m.vocab_size == 0 || m.context_length == 0 || m.kv_blocks == 0 {
            return Err("the model's sizes must be positive".into());
        }
        Ok(())
    }

    /// How a step slows beside another worker's on the same machine: the pairs the
    /// profile timed, or its one factor for every pair.
    pub fn co_run(&self) -> CoRun {
        self.co_run.unwrap_or(CoRun::uniform(self.co_run_slowdown))
    }

    /// Fits each shape's step cost again to the points it holds (a profile whose
    /// points were timed elsewhere, as a derived GPU profile's); the fit errors, by
    /// shape. A shape without points keeps its cost.
    pub fn refit(&mut self) -> Vec<(usize, f64)> {
        let with_points = self.shapes.iter_mut().filter(|s| !s.points.is_empty());
        with_points
            .map(|s| {
                s.step = fit(&mut s.points);
                (s.threads, fit_error(&s.points))
            })
            .collect()
    }

    /// The shape measured with `threads` compute threads, or the nearest below it
    /// (the smallest when none is below).
    pub fn shape(&self, threads: usize) -> &Shape {
        let below = self.shapes.iter().filter(|s| s.threads <= threads).max_by_key(|s| s.threads);
        below.or_else(|| self.shapes.iter().min_by_key(|s| s.threads)).unwrap_or(&self.shapes[0])
    }

    /// Bytes of one KV block of the real model (every layer's K and V): the unit the
    /// tiers' sizes count in, for a simulated worker as for a real one.
    pub fn block_bytes(&self) -> usize {
        (self.model.kv_bytes_per_token * pdserve_engine::batch::BLOCK_SIZE as f64) as usize
    }

    /// The profile with its cache stored as `dtype`: bytes per token scaled by the
    /// dtype's share of f16's, and as many more blocks as the same memory holds.
    /// Step times are kept: decode reads the cache's bytes, so a quantized cache's
    /// steps at long context are if anything shorter (measured in docs/benchmarks.md).
    pub fn with_kv_dtype(mut self, dtype: KvDtype) -> Profile {
        let m = &mut self.model;
        let ratio = dtype.share_of_f16() / m.kv_dtype.share_of_f16();
        m.kv_bytes_per_token *= ratio;
        m.kv_blocks = (m.kv_blocks as f64 / ratio) as usize;
        m.kv_dtype = dtype;
        self
    }

    /// The profile's workers speculate as `spec` says (as a server's `/metrics`
    /// measured it): a verified row costs what the profile's step cost says a row
    /// costs, a draft model's pass what its own profile says.
    pub fn with_speculation(mut self, spec: SpecProfile) -> Self {
        self.model.speculation = Some(spec);
        self
    }

    /// Each shape's step cost by threads: what a draft model of this profile costs
    /// a pass ([`SpecProfile::draft_steps`]).
    pub fn step_costs(&self) -> Vec<(usize, StepCost)> {
        self.shapes.iter().map(|s| (s.threads, s.step)).collect()
    }

    /// The timed stand-in of the model for a worker of `threads` threads.
    pub fn timed(&self, threads: usize, clock: Clock) -> TimedModel {
        // The step as timed on `threads`, and on one thread for the work it holds.
        let time = |s: &Shape| StepTime {
            cost: StepCost { logits_s: s.step.logits_s + self.token_overhead_s, ..s.step },
            decode_table: s.decode_table(),
        };
        let shape = self.shape(threads);
        let one = self.shapes.iter().find(|s| s.threads == 1).filter(|_| shape.threads > 1);
        TimedModel {
            vocab_size: self.model.vocab_size,
            context_length: self.model.context_length,
            n_layers: self.model.n_layers,
            kv_values: 1,
            step: time(shape),
            threads,
            work: one.map(time),
            restore: self.tiers.unwrap_or_default(),
            clock,
            speculation: self.model.speculation.as_ref().map(|s| s.timed(threads)),
            stages: None,
        }
    }

    /// A simulated worker's engine: `kv_blocks` or the profile's, its batch limits.
    pub fn engine_config(&self, threads: usize, kv_blocks: Option<usize>) -> EngineConfig {
        let d = EngineConfig::default();
        EngineConfig {
            threads,
            num_blocks: kv_blocks.unwrap_or(self.model.kv_blocks),
            kv_dtype: self.model.kv_dtype,
            max_batch_tokens: self.model.max_batch_tokens.unwrap_or(d.max_batch_tokens),
            max_seqs: self.model.max_seqs.unwrap_or(d.max_seqs),
            speculation: self.model.speculation.as_ref().map(|s| SpecConfig {
                max_draft: s.tokens,
                verify_all: false,
                draft: None,
            }),
            ..d
        }
    }

    /// The modelled links, by transport.
    pub fn links(&self) -> Vec<(TransportKind, LinkModel)> {
        self.links
            .iter()
            .filter_map(|l| {
                let kind = l.transport.parse::<TransportKind>().ok()?;
                Some((kind, LinkModel { latency_s: l.latency_s, bytes_per_s: l.bytes_per_s }))
            })
            .collect()
    }
}

/// Fits the step cost to `points` by least squares on relative error (short and
/// long steps count alike), with every coefficient kept non-negative; fills each
/// point's `fitted`.
pub fn fit(points: &mut [Point]) -> StepCost {
    let rows: Vec<([f64; TERMS], f64)> = points
        .iter()
        .map(|p| {
            let w = 1.0 / p.seconds.max(1e-9);
            (p.shape().terms().map(|t| t * w), 1.0)
        })
        .collect();
    let mut free = [true; TERMS];
    let mut x = [0.0; TERMS];
    // Active set: drop a coefficient that comes out negative and solve again.
    for _ in 0..TERMS {
        x = solve(&rows, &free);
        match (0..TERMS).find(|&i| free[i] && x[i] < 0.0) {
            Some(i) => free[i] = false,
            None => break,
        }
    }
    let cost = StepCost::from_coefficients(x.map(|c| c.max(0.0)));
    for p in points.iter_mut() {
        p.fitted = cost.seconds(&p.shape());
    }
    cost
}

/// Least squares over the free columns (normal equations; the fixed ones are 0).
fn solve(rows: &[([f64; TERMS], f64)], free: &[bool; TERMS]) -> [f64; TERMS] {
    let cols: Vec<usize> = (0..TERMS).filter(|&i| free[i]).collect();
    let n = cols.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (x, y) in rows {
        for (r, &i) in cols.iter().enumerate() {
            for (c, &j) in cols.iter().enumerate() {
                a[r][c] += x[i] * x[j];
            }
            a[r][n] += x[i] * y;
        }
    }
    let sol = gauss(a);
    let mut out = [0.0; TERMS];
    for (k, &i) in cols.iter().enumerate() {
        out[i] = sol[k];
    }
    out
}

/// Solves an augmented system by elimination with partial pivoting; a singular
/// column solves to 0.
fn gauss(mut a: Vec<Vec<f64>>) -> Vec<f64> {
    let n = a.len();
    for c in 0..n {
        let Some(p) = (c..n).max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs())) else { break };
        a.swap(c, p);
        let d = a[c][c];
        if d.abs() < 1e-300 {
            continue;
        }
        let pivot = a[c].clone();
        for (_, row) in a.iter_mut().enumerate().filter(|(r, _)| *r != c) {
            let f = row[c] / d;
            for (x, p) in row.iter_mut().zip(&pivot).skip(c) {
                *x -= f * p;
            }
        }
    }
    (0..n).map(|i| if a[i][i].abs() < 1e-300 { 0.0 } else { a[i][n] / a[i][i] }).collect()
}

/// Median absolute relative error of the fitted points.
pub fn fit_error(points: &[Point]) -> f64 {
    let mut e: Vec<f64> = points.iter().map(|p| ((p.fitted - p.seconds) / p.seconds).abs()).collect();
    e.sort_by(f64::total_cmp);
    e.get(e.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(kind: PointKind, size: usize, context: usize, cost: &StepCost) -> Point {
        let mut p = Point { kind, size, context, seconds: 0.0, fitted: 0.0 };
        p.seconds = cost.seconds(&p.shape());
        p
    }

    #[test]
    fn fit_recovers_the_cost_it_was_made_from() {
        let truth = StepCost { fixed_s: 0.004, token_s: 0.0008, pair_s: 2e-8, decode_pair_s: 9e-8, logits_s: 0.003 };
        let mut pts = Vec::new();
        for (n, c) in [(16, 0), (128, 0), (512, 0), (512, 512), (512, 1536), (64, 2048)] {
            pts.push(point(PointKind::Prefill, n, c, &truth));
        }
        for (b, c) in [(1, 64), (4, 64), (16, 64), (1, 1024), (8, 1024), (32, 1024)] {
            pts.push(point(PointKind::Decode, b, c, &truth));
        }
        let got = fit(&mut pts);
        for (g, t) in got.coefficients().into_iter().zip(truth.coefficients()) {
            assert!((g - t).abs() <= 1e-6 * t.max(1e-9) + 1e-12, "{got:?} vs {truth:?}");
        }
        assert!(fit_error(&pts) < 1e-6);
    }

    #[test]
    fn a_timed_worker_takes_the_timed_decode_steps_not_the_line_through_them() {
        let line = StepCost { fixed_s: 0.002, token_s: 0.0008, decode_pair_s: 3e-6, ..StepCost::default() };
        // Decode time that rises steeply to 500 positions and slowly after, as a small
        // batch's does: no line meets all three.
        let bend = |c: usize| if c <= 500 { 4e-6 * c as f64 } else { 2e-3 + 1e-6 * (c - 500) as f64 };
        let mut points = Vec::new();
        for b in [1, 4] {
            for c in [50, 500, 1500] {
                let mut p = point(PointKind::Decode, b, c, &line);
                p.seconds += b as f64 * bend(c);
                points.push(p);
            }
        }
        let step = fit(&mut points);
        let shape = Shape { threads: 1, step, points: points.clone(), layers_fixed_s: None };
        let t = StepTime { cost: step, decode_table: shape.decode_table() };
        for p in &points {
            assert!((t.seconds(&p.shape()) - p.seconds).abs() < 1e-12, "{p:?}");
        }
        assert!(fit_error(&points) > 0.01, "the line alone misses them");
    }

    #[test]
    fn a_refit_replaces_each_shapes_cost_with_the_fit_of_its_points_and_keeps_one_without() {
        let truth = StepCost { fixed_s: 0.005, token_s: 3e-5, pair_s: 1e-9, decode_pair_s: 4e-8, logits_s: 3e-5 };
        let mut points = Vec::new();
        for (n, c) in [(128, 0), (2048, 0), (8192, 0), (2048, 8192)] {
            points.push(point(PointKind::Prefill, n, c, &truth));
        }
        for (b, c) in [(1, 512), (32, 512), (1, 8192), (32, 8192)] {
            points.push(point(PointKind::Decode, b, c, &truth));
        }
        let stated = StepCost { fixed_s: 1.0, ..StepCost::default() };
        let timed = Shape { threads: 1, step: stated, points, layers_fixed_s: None };
        let bare = Shape { threads: 2, step: stated, points: Vec::new(), layers_fixed_s: None };
        let model = ModelShape {
            name: "m".into(),
            vocab_size: 10,
            context_length: 100,
            n_layers: 1,
            kv_bytes_per_token: 1.0,
            kv_dtype: pdserve_types::KvDtype::F16,
            kv_blocks: 1,
            hidden: 0,
            weight_bytes: 0,
            max_batch_tokens: None,
            max_seqs: None,
            speculation: None,
        };
        let mut p = Profile {
            schema: SCHEMA,
            provenance: Provenance::Derived { sources: vec![], assumptions: vec![] },
            model,
            shapes: vec![timed, bare],
            links: vec![],
            switch_s: 0.0,
            admission_s: 0.0,
            token_overhead_s: 0.0,
            host_token_s: 0.0,
            co_run_slowdown: 1.0,
            cores: None,
            co_run: None,
            tiers: None,
        };
        let errors = p.refit();
        assert_eq!(errors.len(), 1);
        assert_eq!(errors[0].0, 1);
        assert!(errors[0].1 < 1e-6);
        let got = p.shapes[0].step.coefficients();
        for (g, t) in got.into_iter().zip(truth.coefficients()) {
            assert!((g - t).abs() <= 1e-6 * t, "{got:?}");
        }
        assert!(p.shapes[0].points.iter().all(|q| (q.fitted - q.seconds).abs() < 1e-9));
        assert_eq!(p.shapes[1].step, stated);
    }

    #[test]
    fn fit_keeps_coefficients_non_negative() {
        // Times that fall with size would need a negative slope.
        let mut pts: Vec<Point> = [(1, 0.010), (2, 0.009), (4, 0.008), (8, 0.0085)]
            .iter()
            .map(|&(b, s)| Point { kind: PointKind::Decode, size: b, context: 10, seconds: s, fitted: 0.0 })
            .collect();
        let c = fit(&mut pts);
        assert!(c.coefficients().iter().all(|&x| x >= 0.0), "{c:?}");
        assert!(fit_error(&pts) < 0.2);
    }
}

#[cfg(test)]
mod kv_dtype_tests {
    use super::*;

    #[test]
    fn a_quantized_cache_moves_fewer_bytes_and_holds_more_blocks_in_the_same_memory() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../profiles/h100-llama3.1-8b.json");
        let f16 = Profile::load(Path::new(path)).unwrap();
        let q8 = f16.clone().with_kv_dtype(KvDtype::Q8_0);
        let (b, n) = (f16.model.kv_bytes_per_token, f16.model.kv_blocks as f64);
        assert_eq!(q8.model.kv_bytes_per_token, b * 34.0 / 64.0);
        assert_eq!(q8.model.kv_blocks, (n * 64.0 / 34.0) as usize);
        assert_eq!(q8.engine_config(1, None).kv_dtype, KvDtype::Q8_0);
        // Back to f16 from q4_0: the figures it started from.
        let back = q8.with_kv_dtype(KvDtype::Q4_0).with_kv_dtype(KvDtype::F16);
        assert!((back.model.kv_bytes_per_token - b).abs() < 1e-6);
        assert!((back.model.kv_blocks as f64 - n).abs() <= 2.0);
    }
}
