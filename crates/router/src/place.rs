//! Placement: where a request decodes, where it prefills, what it fetches first and
//! whether it is admitted, decided once from a [`Snapshot`]. A pure function over
//! plain records, so every rule below has a table test without workers or a
//! runtime; the router then runs the [`Plan`] ([`crate::execute`]).
//!
//! The rules, in the order they apply:
//! - **Decode worker**: the policy's choice among usable decode and mixed workers.
//!   One that will not prefill the request (any decoder in disaggregated mode, one
//!   the planner made a decoder in auto) is offered as a prefill elsewhere would
//!   serve it: nothing cached, nothing queued, the fastest pace among them; the
//!   whole prompt's KV reaches it from a prefill worker, so a prefix it holds would
//!   save nothing. With the choice, the fetch of a peer's cached prefix where that
//!   is predicted sooner than recomputing.
//! - **Prefill worker**: none in aggregated mode; the policy's choice among prefill
//!   workers in disaggregated mode; in auto, a remote prefill only where it is
//!   predicted clearly sooner than prefilling on the decode worker (its decodes'
//!   delay counted, see [`crate::cost`]).
//! - **Admission**: refused at once (429 with `Retry-After`) when the wait before
//!   its prefill starts, its first token, or its decode worker's step would be
//!   predicted past the limits of [`Admission`].

use crate::cost;
use crate::policies::{kv_aware, Ask, Candidate, Policy};
use crate::snapshot::{Snapshot, View};
use crate::{Mode, BLOCK_SIZE};
use pdserve_types::Role;
use std::time::Duration;

/// The longest prompt (tokens to compute) a worker with the decode role prefills
/// itself in `auto`, when the prefill workers are backed up: the engine's default
/// step budget, so its sequences wait out one step.
pub const DECODER_PREFILL_TOKENS: usize = 512;

/// What a router refuses at the door (429 with `Retry-After`) rather than queue.
/// The default is `pdserve serve`'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Admission {
    /// The longest predicted wait before a request's prefill starts.
    pub max_queue: Option<Duration>,
    /// The time-to-first-token objective.
    pub ttft: Option<Duration>,
    /// The time-per-output-token objective.
    pub tpot: Option<Duration>,
}

impl Admission {
    /// `serve`'s `--max-queue-seconds` unless given.
    pub const DEFAULT_MAX_QUEUE_S: f64 = 30.0;
}

impl Default for Admission {
    fn default() -> Self {
        Admission { max_queue: Some(Duration::from_secs_f64(Self::DEFAULT_MAX_QUEUE_S)), ttft: None, tpot: None }
    }
}

/// A prefix fetch: `tokens` prompt tokens (whole blocks) from worker `from` (an
/// index into the snapshot), of which the receiver caches the first `keep` itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FetchPlan {
    pub from: usize,
    pub tokens: usize,
    pub keep: usize,
    /// Predicted seconds it takes.
    pub seconds: f64,
}

/// Where a request runs; workers are indices into the snapshot it was made from.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub decode: usize,
    pub prefill: Prefill,
    /// Prompt tokens predicted cached (or fetched) where it prefills.
    pub cached: usize,
    /// Admission's raw prediction of its wait before its first token's prefill.
    pub predicted: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prefill {
    /// On the decode worker, after the planned fetch if any.
    Local { fetch: Option<FetchPlan> },
    /// On worker `on`, its KV handed off to the decode worker; `spare` stands by
    /// should `on` fail before its first token.
    Remote { on: usize, fetch: Option<FetchPlan>, spare: Option<usize> },
}

/// Why a request is not placed. All but [`Refusal::NoWorker`] name the decode
/// worker it was judged for.
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    NoWorker,
    /// Its wait before its prefill starts, corrected, is over the limit.
    Queue {
        decode: usize,
        wait_s: f64,
        limit: Duration,
    },
    /// Its first token is predicted later than the objective.
    Ttft {
        decode: usize,
        first_s: f64,
        slo: Duration,
    },
    /// Its decode worker's step would be longer than the objective.
    Tpot {
        decode: usize,
        step_s: f64,
        slo: Duration,
    },
}

impl Refusal {
    pub fn decode(&self) -> Option<usize> {
        match *self {
            Refusal::NoWorker => None,
            Refusal::Queue { decode, .. } | Refusal::Ttft { decode, .. } | Refusal::Tpot { decode, .. } => Some(decode),
        }
    }
}

/// Places `ask` on `snap`'s workers. `pin`: the worker a moved request prefills on
/// wherever it can (its KV is cached there); a moved request is never refused.
/// `life`: the tokens it holds at its longest, prompt and output.
pub fn place(
    mode: Mode,
    admission: &Admission,
    snap: &Snapshot,
    ask: &Ask<'_>,
    policy: &dyn Policy,
    pin: Option<&str>,
    life: usize,
) -> Result<Plan, Refusal> {
    let p = Placer { mode, admission, snap, ask, policy };
    let (d, fetch) = p.decoder().ok_or(Refusal::NoWorker)?;
    let pinned = pin.and_then(|name| p.pinned(d, name)).map(|on| (on, None));
    let moved = pin.is_some();
    match pinned.or_else(|| p.remote_prefill(d, fetch.as_ref())) {
        None => {
            let cached = fetch.map_or_else(|| p.cached_on(d), |f| f.tokens);
            let predicted = p.admit(d, d, cached, life, moved)?;
            Ok(Plan { decode: d, prefill: Prefill::Local { fetch }, cached, predicted })
        }
        Some((on, fetch)) => {
            let cached = fetch.map_or_else(|| p.cached_on(on), |f| f.tokens);
            let predicted = p.admit(d, on, cached, life, moved)?;
            // In disaggregated mode a second prefill worker stands by; in auto the
            // decode worker itself is the fallback.
            let spare = match mode {
                Mode::Disaggregated => p.pick(&p.with_role(&[Role::Prefill], Some(on))),
                _ => None,
            };
            Ok(Plan { decode: d, prefill: Prefill::Remote { on, fetch, spare }, cached, predicted })
        }
    }
}

struct Placer<'a> {
    mode: Mode,
    admission: &'a Admission,
    snap: &'a Snapshot,
    ask: &'a Ask<'a>,
    policy: &'a dyn Policy,
}

impl Placer<'_> {
    fn view(&self, i: usize) -> &View {
        &self.snap.views[i]
    }

    /// Usable workers whose role is one of `roles`, except `not`.
    fn with_role(&self, roles: &[Role], not: Option<usize>) -> Vec<usize> {
        let usable = |i: &usize| self.view(*i).usable && roles.contains(&self.view(*i).role) && not != Some(*i);
        (0..self.snap.views.len()).filter(usable).collect()
    }

    /// The policy's choice among `among`.
    fn pick(&self, among: &[usize]) -> Option<usize> {
        self.pick_where(among, |_| true, None).map(|(i, _)| i)
    }

    /// The decode worker (see the module's rules), with the fetch that serves it
    /// sooner, if any.
    fn decoder(&self) -> Option<(usize, Option<FetchPlan>)> {
        let decoders = self.with_role(&[Role::Decode, Role::Mixed], None);
        let prefills_there = |v: &View| match self.mode {
            Mode::Aggregated => true,
            Mode::Disaggregated => false,
            Mode::Auto => v.role != Role::Decode,
        };
        self.pick_where(&decoders, prefills_there, Some(&[]))
    }

    /// The policy's choice among `among`, where only those `prefills_there` are
    /// offered with their cached prefix, or, `fetching` (from `among` or the others
    /// named), with the longer one they could fetch from a peer where that is
    /// predicted sooner (the fetch is returned with the choice).
    fn pick_where(
        &self,
        among: &[usize],
        prefills_there: impl Fn(&View) -> bool,
        fetching: Option<&[usize]>,
    ) -> Option<(usize, Option<FetchPlan>)> {
        let paces = Paces::of(among.iter().map(|&i| self.view(i)));
        let fastest = among.iter().map(|&i| paces.per_token(self.view(i))).fold(f64::INFINITY, f64::min);
        let source = fetching.and_then(|others| self.fetch_source(among.iter().chain(others)));
        let mut fetches: Vec<Option<FetchPlan>> = vec![None; among.len()];
        let candidates: Vec<Candidate<'_>> = among
            .iter()
            .zip(&mut fetches)
            .map(|(&i, fetch)| {
                let own = self.candidate(i, &paces);
                if !prefills_there(self.view(i)) {
                    return Candidate { cached_tokens: 0, restore_seconds: 0.0, ..Self::idle(own, fastest) };
                }
                let Some((f, c)) = self.fetched(i, &own, source) else { return own };
                *fetch = Some(f);
                c
            })
            .collect();
        let k = self.policy.pick(self.ask, &candidates)?;
        Some((*among.get(k)?, fetches.get_mut(k)?.take()))
    }

    /// Worker `i` as the policies see it.
    fn candidate(&self, i: usize, paces: &Paces) -> Candidate<'_> {
        let v = self.view(i);
        let at = (paces.fixed(v), paces.per_token(v));
        Candidate {
            name: &v.name,
            role: v.role,
            load: v.load + v.routed,
            queued_seconds: v.prefill.queue.seconds(at),
            cached_tokens: v.cached.blocks() * BLOCK_SIZE,
            restore_seconds: v.restore.seconds(&v.cached),
            seconds_per_token: at.1,
            fixed_seconds: at.0,
        }
    }

    /// A worker offered as a prefill elsewhere would serve it: nothing queued, the
    /// fastest pace.
    fn idle(c: Candidate<'_>, fastest: f64) -> Candidate<'_> {
        Candidate { queued_seconds: 0.0, seconds_per_token: fastest, fixed_seconds: 0.0, ..c }
    }

    /// The holder whose cache holds the longest prefix of the request, in blocks,
    /// among those that can export it: where a fetch would come from.
    fn fetch_source<'i>(&self, holders: impl Iterator<Item = &'i usize>) -> Option<usize> {
        self.snap.fetch_per_token?;
        let exports = |v: &View| v.cached.blocks() > 0 && v.alive && v.peers;
        holders.copied().filter(|&i| exports(self.view(i))).max_by_key(|&i| self.view(i).cached.blocks())
    }

    /// `own` (worker `i` as it is) with the source's longer prefix fetched instead,
    /// and the fetch, if that is predicted to give the first token sooner.
    fn fetched<'c>(&self, i: usize, own: &Candidate<'c>, source: Option<usize>) -> Option<(FetchPlan, Candidate<'c>)> {
        let (from, per_token) = (source?, self.snap.fetch_per_token?);
        let (holder, e) = (self.view(from), self.view(i));
        let tokens = holder.cached.blocks() * BLOCK_SIZE;
        if from == i || tokens <= own.cached_tokens || !(e.peers && e.receives) {
            return None;
        }
        // Only what `i` lacks moves: the prefix it caches stays.
        let keep = own.cached_tokens;
        let seconds = crate::fetch::seconds(per_token, holder.restore.seconds(&holder.cached), tokens - keep);
        let c = Candidate { cached_tokens: tokens, restore_seconds: own.restore_seconds + seconds, ..own.clone() };
        let sooner = kv_aware::predicted_ttft(self.ask, &c) < kv_aware::predicted_ttft(self.ask, own);
        sooner.then_some((FetchPlan { from, tokens, keep, seconds }, c))
    }

    /// Prompt tokens of the request cached on `i`, as indexed.
    fn cached_on(&self, i: usize) -> usize {
        self.view(i).cached.blocks() * BLOCK_SIZE
    }

    /// Worker `name`, where it can prefill for `d`: a usable prefill or mixed worker
    /// other than `d`.
    fn pinned(&self, d: usize, name: &str) -> Option<usize> {
        self.with_role(&[Role::Prefill, Role::Mixed], Some(d)).into_iter().find(|&i| self.view(i).name == name)
    }

    /// The prefill worker for a request decoding on `d`, or `None` to prefill there;
    /// with it, in disaggregated mode, the fetch of a prefix a peer (a decode
    /// worker holding an earlier turn's answer) caches, where that is sooner.
    fn remote_prefill(&self, d: usize, d_fetch: Option<&FetchPlan>) -> Option<(usize, Option<FetchPlan>)> {
        match self.mode {
            Mode::Aggregated => None,
            Mode::Disaggregated => {
                let others = self.with_role(&[Role::Decode, Role::Mixed], None);
                self.pick_where(&self.with_role(&[Role::Prefill], None), |_| true, Some(&others))
            }
            Mode::Auto => self.auto_prefill(d, d_fetch).map(|p| (p, None)),
        }
    }

    /// `auto`'s prefill worker for `d`, or `None` to prefill on `d`.
    fn auto_prefill(&self, d: usize, d_fetch: Option<&FetchPlan>) -> Option<usize> {
        let n = self.ask.prompt_len;
        let paces = Paces::of(self.with_role(&[Role::Prefill, Role::Mixed], None).iter().map(|&i| self.view(i)));
        // Only the part of the prompt a worker's cache lacks is computed there.
        let cost = |v: &View, cached: usize| {
            let todo = n - cached.min(n);
            paces.predict(v, todo) + interference(v, todo as f64 * paces.per_token(v))
        };
        // `d` computes what is left once it fetched the prefix it was picked with.
        let local = match d_fetch {
            Some(f) => f.seconds + cost(self.view(d), f.tokens),
            None => cost(self.view(d), self.cached_on(d)),
        };
        let remote = |i: usize| {
            let (v, to) = (self.view(i), &self.view(d).name);
            let compute = n as f64 * paces.per_token(v);
            cost(v, self.cached_on(i))
                + self.snap.transfer.predict(n, v.links.get(to).copied(), compute, v.kv_bytes_per_token)
        };
        let others = self.with_role(&[Role::Prefill, Role::Mixed], Some(d));
        if self.view(d).role == Role::Decode {
            return self.decoder_prefill(d, &others, local, remote);
        }
        // Only a worker that can start now: a prompt queued there would reach `d`
        // behind prompts that arrived after it (which went straight to `d`'s own
        // queue), and find `d`'s blocks taken. Each candidate is costed once.
        let (best_s, best) = others
            .into_iter()
            .filter(|&i| self.view(i).free_slots > 0)
            .map(|i| (remote(i), i))
            .min_by(|a, b| a.0.total_cmp(&b.0))?;
        let go = cost::prefer_remote(local, best_s);
        let (decode, peer) = (&self.view(d).name, &self.view(best).name);
        tracing::debug!(decode, local_s = local, remote_s = best_s, peer, remote = go, "prefill placed");
        go.then_some(best)
    }

    /// A worker given the decode role prefills only a short prompt (one step's
    /// worth: its sequences wait one step) while the prefill worker is backed up,
    /// and only where that is clearly sooner with the delay to its own decodes
    /// counted: a short prompt behind a long one, not the interference the split
    /// removes.
    fn decoder_prefill(&self, d: usize, others: &[usize], local: f64, remote: impl Fn(usize) -> f64) -> Option<usize> {
        let p = self.pick(others)?;
        let n = self.ask.prompt_len;
        let short = n - self.cached_on(d).min(n) <= DECODER_PREFILL_TOKENS;
        let backed_up = self.view(p).free_slots == 0 || self.view(p).prefill.queued() > 0;
        let stay = short && backed_up && cost::decoder_prefills(local, remote(p));
        let (decode, peer) = (&self.view(d).name, &self.view(p).name);
        tracing::debug!(decode, peer, local = stay, "decoder's prefill placed");
        (!stay).then_some(p)
    }

    /// Admission of a request decoding on `d` and prefilling on `on` with `cached`
    /// prompt tokens found there: refused when predicted to start later than the
    /// limit (behind the prompts queued on `on`, behind `d`'s backlog, or until `d`
    /// has freed the KV blocks its waiting requests and this one need, whichever is
    /// longest); under SLO admission, when its first token (its own prefill after
    /// that) is predicted past the objective; under TPOT admission, when `d`'s
    /// decode step would be. The prediction is scaled by how late first tokens came
    /// against it lately. Admitted, the raw prediction is returned; a request
    /// moving mid-stream (`moved`) was admitted when it came and is never refused.
    fn admit(&self, d: usize, on: usize, cached: usize, life: usize, moved: bool) -> Result<f64, Refusal> {
        let (v, queued_s, own_s) = (self.view(d), self.view(on).prefill.queued_seconds(), self.own_prefill(on, cached));
        let need = v.backlog.pending_blocks + cost::blocks_for(life);
        let raw = queued_s.max(v.backlog.wait_s).max(v.kv.wait_for(need));
        if moved {
            return Ok(raw);
        }
        let correction = v.backlog.correction;
        let (wait_s, first_s) = (raw * correction, (raw + own_s) * correction);
        if let Some(limit) = self.admission.max_queue.filter(|l| wait_s > l.as_secs_f64()) {
            let (backlog_s, blocks_s) = (v.backlog.wait_s, v.kv.wait_for(need));
            let worker = &v.name;
            tracing::debug!(
                worker,
                queued_s,
                backlog_s,
                blocks_s,
                need,
                correction,
                "refused: the wait is over the admission limit"
            );
            return Err(Refusal::Queue { decode: d, wait_s, limit });
        }
        if let Some(slo) = self.admission.ttft.filter(|s| first_s > s.as_secs_f64()) {
            return Err(Refusal::Ttft { decode: d, first_s, slo });
        }
        let tpot = self.admission.tpot.and_then(|s| Some((s, v.predict_step(life)?)));
        if let Some((slo, step_s)) = tpot.filter(|(s, t)| *t > s.as_secs_f64()) {
            return Err(Refusal::Tpot { decode: d, step_s, slo });
        }
        Ok(raw)
    }

    /// Predicted seconds of the request's own prefill on `i` with `cached` prompt
    /// tokens found there, which SLO admission adds to the wait; 0 without it.
    fn own_prefill(&self, i: usize, cached: usize) -> f64 {
        let n = self.ask.prompt_len;
        match self.admission.ttft {
            Some(_) => self.view(i).prefill.compute(n - cached.min(n)),
            None => 0.0,
        }
    }
}

/// What a prefill computing for `compute_s` on worker `v` costs the sequences
/// decoding there: each waits it out (chunked prefill shares their steps).
fn interference(v: &View, compute_s: f64) -> f64 {
    kv_aware::decode_delay(v.role, v.load, compute_s)
}

/// Prefill paces for comparing workers: a worker not timed yet is taken to be as
/// fast as its timed peers, since the fixed prior would make it look faster or
/// slower than it is (a slow machine's untimed worker looked idle and quick).
struct Paces {
    per_token: Option<f64>,
    fixed: Option<f64>,
}

impl Paces {
    fn of<'v>(views: impl Iterator<Item = &'v View> + Clone) -> Self {
        Paces {
            per_token: mean(views.clone().filter_map(|v| v.prefill.per_token)),
            fixed: mean(views.filter_map(|v| v.prefill.fixed)),
        }
    }

    fn per_token(&self, v: &View) -> f64 {
        v.prefill.per_token.or(self.per_token).unwrap_or_else(|| v.prefill.seconds_per_token())
    }

    fn fixed(&self, v: &View) -> f64 {
        v.prefill.fixed.or(self.fixed).unwrap_or(0.0)
    }

    /// Predicted seconds until a prompt computing `tokens` sent to `v` now has its
    /// first token.
    fn predict(&self, v: &View, tokens: usize) -> f64 {
        v.prefill.predict_at(tokens, (self.fixed(v), self.per_token(v)))
    }
}

/// The mean of `values`, if there are any.
fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
#[path = "place/tests.rs"]
mod tests;
