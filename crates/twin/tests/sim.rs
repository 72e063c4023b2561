//! The simulator on a profile whose costs are known exactly: on a virtual clock a
//! lone request's times are the profile's sums to the timer's millisecond, the same run
//! gives the same records, every topology (sixteen workers under the planner too)
//! finishes every request, and no KV block stays used.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_bench::lengths::LengthSpec;
use pdserve_bench::load::{plans, PointResult, Sweep};
use pdserve_bench::metrics::Slo;
use pdserve_bench::prompt::TokenRange;
use pdserve_bench::workload::{PrefixOrder, Replies, Workload, WorkloadFlags};
use pdserve_engine::batch::Objectives;
use pdserve_engine::timed::{StepCost, StepShape};
use pdserve_kv_transfer::TransportKind;
use pdserve_router::{Admission, Mode, PolicyKind};
use pdserve_twin::group::GroupShape;
use pdserve_twin::profile::{Link, ModelShape, Profile, Provenance, Shape, SpecProfile, SCHEMA};
use pdserve_twin::sim::{simulate, SimServer, SimSpec, Topology};
use pdserve_types::Role;
use std::time::Duration;

const STEP: StepCost = StepCost { fixed_s: 0.004, token_s: 0.0005, pair_s: 1e-7, decode_pair_s: 4e-7, logits_s: 0.001 };
const ADMISSION: f64 = 0.0005;
const NO_ADMISSION: Admission = Admission { max_queue: None, ttft: None, tpot: None };
const LINK: Link = Link { transport: String::new(), latency_s: 0.0002, bytes_per_s: 1e9 };

fn profile() -> Profile {
    Profile {
        schema: SCHEMA,
        provenance: Provenance::Derived { sources: vec!["a test".into()], assumptions: vec![] },
        model: ModelShape {
            name: "test".into(),
            vocab_size: 49152,
            context_length: 8192,
            n_layers: 30,
            kv_bytes_per_token: 23040.0,
            kv_dtype: pdserve_types::KvDtype::F16,
            kv_blocks: 1024,
            hidden: 576,
            weight_bytes: 100_000_000,
            max_batch_tokens: None,
            max_seqs: None,
            speculation: None,
        },
        shapes: vec![Shape { threads: 1, step: STEP, points: vec![], layers_fixed_s: None }],
        links: vec![Link { transport: "inproc".into(), ..LINK }],
        switch_s: 0.0,
        admission_s: ADMISSION,
        token_overhead_s: 0.0,
        host_token_s: 0.0,
        co_run_slowdown: 1.0,
        cores: None,
        co_run: None,
        tiers: None,
    }
}

fn topology(mode: Mode, roles: Vec<Role>) -> Topology {
    Topology {
        mode,
        roles,
        policy: PolicyKind::LeastLoaded,
        threads: 1,
        kv_blocks: None,
        via: TransportKind::Inproc,
        planner: None,
        objectives: None,
        shared_machine: true,
        prefix_fetch: true,
        group: None,
        tiers: Default::default(),
        admission: Admission::default(),
    }
}

fn workload(input: u32, output: u32) -> Workload {
    flags(input, output).build().unwrap()
}

fn flags(input: u32, output: u32) -> WorkloadFlags {
    WorkloadFlags {
        input: LengthSpec::Fixed(input),
        output: LengthSpec::Fixed(output),
        shared_prefixes: 0,
        prefix_order: Default::default(),
        prefix_share: 1.0,
        prefix_len: 0,
        conversations: 0,
        turns: LengthSpec::Fixed(1),
        replies: Default::default(),
        trace: None,
        trace_block_size: 512,
        phases: Vec::new(),
        range: TokenRange { lo: 1000, hi: 40000 },
        seed: 7,
    }
}

fn run(p: &Profile, t: Topology, w: &Workload, sweep: Sweep, requests: usize) -> Vec<PointResult> {
    let plans = plans(&sweep, requests, 3600.0, w.trace_len()).unwrap();
    let spec = SimSpec { profile: p, topology: t, workload: w, plans: &plans, slo: Slo::default(), warmup: 0 };
    simulate(&spec).unwrap()
}

/// Within tokio's timer resolution: an event fires on the next whole millisecond
/// (the admission's and the last step's roundings may add up), and back-to-back steps
/// do not accumulate the rounding.
fn close(got: f64, want: f64) {
    assert!((got - want).abs() <= 2.001e-3, "{got} vs {want}");
}

#[test]
fn a_lone_request_takes_the_profiles_time() {
    let p = profile();
    let w = workload(256, 8);
    let out = run(&p, topology(Mode::Aggregated, vec![Role::Mixed]), &w, Sweep::Concurrency(vec![1]), 2);
    let r = &out[0].records[0];
    assert!(r.ok, "{:?}", r.error);
    assert_eq!(r.output_tokens, 8);
    // One chunk of 256 tokens, sampled at its end.
    let prefill = STEP.seconds(&StepShape::prefill(0, 256));
    close(r.ttft_s.unwrap(), ADMISSION + prefill);
    // Decode steps at 256, 257, … computed positions.
    let decodes: f64 = (0..7).map(|k| STEP.seconds(&StepShape::decode(1, 256 + k))).sum();
    close(r.e2e_s, ADMISSION + prefill + decodes);
    close(r.tpot_s.unwrap(), decodes / 7.0);
}

#[test]
fn admission_sheds_what_would_wait_too_long_as_serve_does() {
    let p = profile();
    let w = workload(1024, 32);
    let with = |max_queue| Topology {
        admission: Admission { max_queue, ..Admission::default() },
        ..topology(Mode::Aggregated, vec![Role::Mixed])
    };
    // Sixteen 1024-token prompts queued on one worker wait seconds for a prefill.
    let out = run(&p, with(Some(Duration::from_secs(1))), &w, Sweep::Concurrency(vec![16]), 48);
    let refused: Vec<_> = out[0].records.iter().filter(|r| !r.ok).collect();
    assert!(!refused.is_empty(), "nothing was shed");
    for r in &refused {
        assert!(r.shed.is_some_and(|s| s >= 1.0), "refused without a Retry-After: {r:?}");
        assert!(r.error.as_deref().is_some_and(|e| e.contains("over the limit of 1 s")), "{:?}", r.error);
    }
    assert_eq!(out[0].summary.shed, refused.len());
    assert!(out[0].records.iter().any(|r| r.ok), "admission refused everything");
    let open = run(&p, with(None), &w, Sweep::Concurrency(vec![16]), 48);
    assert!(open[0].records.iter().all(|r| r.ok), "shed with admission off");
}

/// `serve` asks its workers for their blocks before the first request and every
/// second after; so does the simulator, and a burst at start-up that the pool cannot
/// hold is shed at once, as `serve` sheds it, instead of queued on no figures at all.
#[test]
fn a_burst_the_pool_cannot_hold_is_shed_at_start_as_serve_sheds_it() {
    let p = profile();
    // 64 blocks hold one 512/128 request (40 blocks), not two.
    let t = Topology { kv_blocks: Some(64), ..topology(Mode::Aggregated, vec![Role::Mixed]) };
    let out = run(&p, t, &workload(512, 128), Sweep::Concurrency(vec![4]), 8);
    let first: Vec<_> = out[0].records.iter().filter(|r| r.start_s == 0.0).collect();
    assert!(first.iter().any(|r| r.ok), "the first fits");
    let shed: Vec<_> = first.iter().filter(|r| r.shed.is_some()).collect();
    assert!(!shed.is_empty(), "a burst four times the pool was all admitted");
    assert!(shed.iter().all(|r| r.error.as_deref().is_some_and(|e| e.contains("would wait"))), "{shed:?}");
}

#[test]
fn a_stage_group_pipelines_its_prompt_adds_hops_to_each_decode_and_holds_more_blocks() {
    let mut p = profile();
    p.links.push(Link { transport: "tcp".into(), ..LINK });
    let link = p.links().into_iter().find(|(k, _)| *k == TransportKind::Tcp).unwrap().1;
    let w = workload(256, 8);
    // (stages, the fixed part of a pass through every layer alone, where timed)
    for (stages, layers_fixed) in [(2, None), (3, None), (2, Some(0.002)), (3, Some(0.0))] {
        p.shapes[0].layers_fixed_s = layers_fixed;
        let group = GroupShape { stages, link, cores: None };
        let t = Topology { group: Some(group), ..topology(Mode::Aggregated, vec![Role::Mixed]) };
        let out = run(&p, t, &w, Sweep::Concurrency(vec![1]), 2);
        let r = &out[0].records[0];
        assert!(r.ok, "{:?}", r.error);
        // A decode step goes to every later stage and back: 2 hops each, every row on
        // each hop but the last one back, which carries the logits row alone.
        let hops = 2.0 * (stages - 1) as f64;
        let row = 576.0 * 4.0 / LINK.bytes_per_s;
        // The prompt's one step costs mostly per row: the head cuts it into one
        // micro-batch per stage (even rows), each stage a share of the step's layers,
        // a round trip before each later stage. Of the step's fixed part, the stages
        // share the layers' `shared` (all of it where the profile did not time it),
        // and the head pays the rest (the output head, the step around the layers).
        let whole = STEP.seconds(&StepShape::prefill(0, 256));
        let n = stages as f64;
        let span = |shared: f64| {
            let fixed = |i: usize| shared / n + if i == 0 { STEP.fixed_s - shared } else { 0.0 };
            let pass = |i: usize, r: usize| fixed(i) + (whole - STEP.fixed_s) / 256.0 / n * r as f64;
            let hop = |r: usize| 2.0 * (LINK.latency_s + r as f64 * row);
            let sizes: Vec<usize> = (0..stages).map(|j| (j + 1) * 256 / stages - j * 256 / stages).collect();
            let mut done = vec![0.0f64; stages];
            for i in 0..stages {
                let mut free = 0.0f64;
                for (j, &r) in sizes.iter().enumerate() {
                    free = free.max(if i == 0 { 0.0 } else { done[j] + hop(r) }) + pass(i, r);
                    done[j] = free;
                }
            }
            done[stages - 1]
        };
        let even = span(STEP.fixed_s);
        let got = span(layers_fixed.unwrap_or(STEP.fixed_s));
        // With none of it the layers', three stages' prompt time tells the head's
        // fixed part from an even share by more than the timer's rounding (two
        // stages' differ by 2 ms: the head's two extra fixed parts less the later
        // stage's last one).
        assert!(layers_fixed != Some(0.0) || got - even > 4.1e-3, "{stages}: {got} against {even}");
        let unpipelined = whole + hops * LINK.latency_s + (hops - 1.0) * 256.0 * row + row;
        assert!(got < unpipelined * 0.8, "{stages}: {got} against {unpipelined}");
        close(r.ttft_s.unwrap(), ADMISSION + got);
        let decode = |k: usize| STEP.seconds(&StepShape::decode(1, 256 + k)) + hops * (LINK.latency_s + row);
        close(r.tpot_s.unwrap(), (0..7).map(decode).sum::<f64>() / 7.0);
    }
    // The nodes' weights a split frees are cache: 1024 blocks beside 100 MB of weights
    // on one node, 2048 and the 50 MB the second node does not hold on two.
    let block = p.block_bytes() as f64;
    let memory = 100e6 + 1024.0 * block;
    let blocks = GroupShape { stages: 2, link, cores: None }.kv_blocks(memory, 100e6, block).unwrap();
    assert_eq!(blocks, (2.0 * (memory - 50e6) / block) as usize);
    assert!(blocks > 2048, "{blocks}");
}

#[test]
fn a_handoff_adds_the_links_tail() {
    let p = profile();
    let w = workload(320, 4);
    let t = topology(Mode::Disaggregated, vec![Role::Prefill, Role::Decode]);
    let out = run(&p, t, &w, Sweep::Concurrency(vec![1]), 2);
    let r = &out[0].records[0];
    assert!(r.ok, "{:?}", r.error);
    let prefill = STEP.seconds(&StepShape::prefill(0, 320));
    let bytes = 320.0 * p.model.kv_bytes_per_token;
    // 30 layers: the last layer's share goes after the compute (the link is fast).
    let tail = LINK.latency_s + bytes / LINK.bytes_per_s / 30.0;
    close(r.ttft_s.unwrap(), ADMISSION + prefill + tail);
    assert_eq!(r.output_tokens, 4);
}

#[test]
fn the_same_run_gives_the_same_records() {
    let p = profile();
    let w = workload(300, 40);
    let sweep = Sweep::Rates { rates: vec![3.0], kind: pdserve_bench::arrivals::ArrivalKind::Poisson, burstiness: 1.0 };
    let t = || topology(Mode::Auto, vec![Role::Prefill, Role::Decode]);
    let a = run(&p, t(), &w, sweep.clone(), 40);
    let b = run(&p, t(), &w, sweep, 40);
    assert_eq!(a[0].records, b[0].records);
    assert!(a[0].records.iter().all(|r| r.ok));
}

#[test]
fn a_decode_is_slowed_by_the_prefills_beside_it_as_the_profile_timed() {
    use pdserve_worker::CoRun;
    // Two clients of long prompts on one prefill and one decode worker sharing a
    // machine: the decode worker's steps run while the other worker prefills.
    let w = workload(2000, 40);
    let t = || topology(Mode::Disaggregated, vec![Role::Prefill, Role::Decode]);
    let with = |co: CoRun| run(&Profile { co_run: Some(co), ..profile() }, t(), &w, Sweep::Concurrency(vec![2]), 8);
    let tpot = |out: &[PointResult]| out[0].summary.tpot_ms.p50.unwrap();
    let alone = with(CoRun::uniform(1.0));
    assert!(alone[0].records.iter().all(|r| r.ok));
    // Decodes slowed only beside decodes: no pair of this topology is that one.
    let by_decodes = with(CoRun { decode_beside_decode: 2.0, ..CoRun::uniform(1.0) });
    assert_eq!(by_decodes[0].records, alone[0].records);
    // Slowed beside prefills: the decodes' steps take longer, the prompts' do not.
    let by_prefills = with(CoRun { decode_beside_prefill: 2.0, ..CoRun::uniform(1.0) });
    assert!(tpot(&by_prefills) > 1.3 * tpot(&alone), "{} vs {}", tpot(&by_prefills), tpot(&alone));
    let first = |out: &[PointResult]| out[0].records[0].ttft_s.unwrap();
    close(first(&by_prefills), first(&alone));
}

#[test]
fn a_small_cache_preempts_and_still_finishes_everything() {
    let p = profile();
    let w = workload(200, 300);
    // 40 blocks hold 640 tokens: eight requests of up to 500 cannot all run at once.
    // Admission off (`--max-queue-seconds 0`): it would refuse what the pool cannot hold.
    let t = Topology { kv_blocks: Some(40), admission: NO_ADMISSION, ..topology(Mode::Aggregated, vec![Role::Mixed]) };
    let out = run(&p, t, &w, Sweep::Concurrency(vec![8]), 16);
    assert_eq!(out[0].summary.ok, 16, "{:?}", out[0].summary.first_error);
    assert!(out[0].records.iter().all(|r| r.output_tokens == 300));
}

#[test]
fn phases_play_back_to_back_and_each_gets_its_own_summary() {
    let p = profile();
    let phase = |s: &str| s.parse::<pdserve_bench::phases::Phase>().unwrap();
    let flags = WorkloadFlags {
        phases: vec![phase("long:20:2:1000/8"), phase("short:20:2:50/64"), phase("sin:40:2:1000/8+50/64:sin=40")],
        ..flags(1, 1)
    };
    let w = flags.build().unwrap();
    let out = run(&p, topology(Mode::Aggregated, vec![Role::Mixed, Role::Mixed]), &w, Sweep::Phases, 1);
    let point = &out[0];
    assert_eq!(point.summary.requests, w.trace_len().unwrap(), "--requests does not cut a phased run");
    assert!(point.records.iter().all(|r| r.ok));
    let counts: Vec<usize> = point.phases.iter().map(|ph| ph.summary.requests).collect();
    assert_eq!(counts.iter().sum::<usize>(), point.summary.requests, "{counts:?}");
    assert!(counts.iter().all(|&n| n > 20), "{counts:?}");
    for r in &point.records {
        let at = r.scheduled_s.unwrap();
        let want_long = if at < 20.0 {
            Some(true)
        } else if at < 40.0 {
            Some(false)
        } else {
            None
        };
        if let Some(long) = want_long {
            assert_eq!(r.input_tokens == 1000, long, "request at {at} s");
            assert_eq!(r.output_tokens, if long { 8 } else { 64 });
        }
    }
}

#[test]
fn sixteen_workers_under_the_planner_finish_and_free_their_blocks() {
    let p = profile();
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
    rt.block_on(async {
        let slo = pdserve_planner::model::Slo { ttft_s: 2.0, tpot_s: 0.05 };
        let t = Topology { planner: Some(slo), ..topology(Mode::Auto, vec![Role::Mixed; 16]) };
        let server = SimServer::start(&p, &t).unwrap();
        let w = workload(1500, 16);
        let sweep =
            Sweep::Rates { rates: vec![20.0], kind: pdserve_bench::arrivals::ArrivalKind::Poisson, burstiness: 1.0 };
        let plans = plans(&sweep, 600, 3600.0, None).unwrap();
        let records = pdserve_bench::runner::run_point(&server, &w, &plans[0], None).await;
        assert_eq!(records.len(), 600);
        assert!(records.iter().all(|r| r.ok), "{:?}", records.iter().find(|r| !r.ok));
        // Let the planner look at the idle fleet, then check every worker's blocks.
        tokio::time::sleep(std::time::Duration::from_secs(30)).await;
        for e in server.router().workers().snapshot() {
            let s = e.worker.stats().await.unwrap();
            assert_eq!(s.blocks.used, 0, "{}", e.name());
            assert_eq!((s.running, s.waiting, s.importing), (0, 0, 0), "{}", e.name());
        }
    });
}

/// A shift the planner follows: one prefill worker is enough for a trickle of
/// prompts and far too few for the burst after it. The point notes each switch on
/// its own clock, in order, in the phase that called for it.
#[test]
fn the_planners_switches_are_noted_on_the_points_clock() {
    let p = profile();
    let phase = |s: &str| s.parse::<pdserve_bench::phases::Phase>().unwrap();
    let w = WorkloadFlags { phases: vec![phase("trickle:20:0.2:1500/8"), phase("burst:40:3:1500/8")], ..flags(1, 1) }
        .build()
        .unwrap();
    let slo = pdserve_planner::model::Slo { ttft_s: 5.0, tpot_s: 0.05 };
    let roles = vec![Role::Prefill, Role::Decode, Role::Decode, Role::Decode];
    let t = Topology { planner: Some(slo), admission: NO_ADMISSION, ..topology(Mode::Auto, roles) };
    let out = run(&p, t, &w, Sweep::Phases, 1);
    let switches = &out[0].switches;
    assert!(!switches.is_empty(), "no switch noted");
    assert_eq!(switches[0].from, "1P:3D", "{switches:?}");
    assert!((20.0..60.0).contains(&switches[0].at_s), "the first switch comes with the burst: {switches:?}");
    for pair in switches.windows(2) {
        assert!(pair[0].at_s <= pair[1].at_s, "{switches:?}");
        assert_eq!(pair[0].to, pair[1].from, "each switch starts where the last ended: {switches:?}");
    }
    assert!(switches.iter().all(|s| s.from != s.to && !s.reason.is_empty()), "{switches:?}");
}

/// Prompts sharing one of eight 512-token prefixes on a worker whose pool holds
/// fewer than two: with a host tier the prefixes come back at the profile's copy time
/// instead of being recomputed, and a profile without tier timings refuses tiers.
#[test]
fn a_host_tier_brings_evicted_prefixes_back_at_the_profiles_copy_time() {
    let w = WorkloadFlags { shared_prefixes: 8, prefix_len: 512, prefix_order: PrefixOrder::Cycle, ..flags(32, 4) }
        .build()
        .unwrap();
    let tiered = |host_blocks| Topology {
        kv_blocks: Some(48),
        admission: NO_ADMISSION,
        tiers: pdserve_engine::tiers::TierConfig { host_blocks, ..Default::default() },
        ..topology(Mode::Aggregated, vec![Role::Mixed])
    };
    let mut p = profile();
    assert!(SimServer::start(&p, &tiered(512)).is_err(), "tiers without the profile's timings");
    p.tiers = Some(pdserve_engine::timed::RestoreCost { host_block_s: 1e-4, disk_block_s: 1e-3 });
    let median_ttft = |host_blocks| {
        let out = run(&p, tiered(host_blocks), &w, Sweep::Concurrency(vec![1]), 40);
        let mut t: Vec<f64> = out[0].records.iter().map(|r| r.ttft_s.unwrap()).collect();
        assert!(out[0].records.iter().all(|r| r.ok));
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (pool_only, host) = (median_ttft(0), median_ttft(512));
    // Recomputing 544 tokens (in chunks of 512) against copying 32 blocks back and
    // computing the rest.
    let recompute = STEP.seconds(&StepShape::chunk(0, 512, false)) + STEP.seconds(&StepShape::prefill(512, 32));
    let restore = 32.0 * 1e-4 + STEP.seconds(&StepShape::prefill(512, 32));
    close(pool_only, ADMISSION + recompute);
    close(host, ADMISSION + restore);
}

#[test]
fn a_history_blind_policy_still_fetches_a_prefix_a_peer_caches_as_serve_does() {
    // Round-robin sends the second request to the worker without the prefix: the
    // sooner of the two first tokens is that one.
    let w = WorkloadFlags { shared_prefixes: 1, prefix_len: 512, ..flags(32, 16) }.build().unwrap();
    let ttft = |prefix_fetch| {
        let t = Topology {
            policy: PolicyKind::RoundRobin,
            prefix_fetch,
            ..topology(Mode::Aggregated, vec![Role::Mixed, Role::Mixed])
        };
        let out = run(&profile(), t, &w, Sweep::Concurrency(vec![1]), 2);
        assert!(out[0].records.iter().all(|r| r.ok));
        let hits = out[0].summary.prefix_hits.unwrap();
        // Reported as `bench load` reads them off `serve`: predicted, then realized.
        assert_eq!(hits.predicted, hits.realized);
        (out[0].records.iter().map(|r| r.ttft_s.unwrap()).fold(f64::INFINITY, f64::min), hits.realized)
    };
    let ((fetched, hit), (recomputed, missed)) = (ttft(true), ttft(false));
    // 512 tokens recomputed take 0.26 s; fetched over a 1 GB/s link, 12 ms.
    assert!(fetched < recomputed - 0.15, "fetched {fetched} s, recomputed {recomputed} s");
    assert_eq!((hit, missed), (512.0, 0.0));
}

#[test]
fn generated_replies_come_back_as_history_and_hit_the_cache() {
    let p = profile();
    let hits = |replies| {
        let flags = WorkloadFlags { conversations: 2, turns: LengthSpec::Fixed(3), replies, ..flags(40, 24) };
        let w = flags.build().unwrap();
        let out = run(&p, topology(Mode::Aggregated, vec![Role::Mixed]), &w, Sweep::Concurrency(vec![1]), 6);
        assert!(out[0].records.iter().all(|r| r.ok));
        (out[0].summary.replies, out[0].summary.prefix_hits.unwrap().realized)
    };
    let (none, random) = hits(Replies::Random);
    let (some, generated) = hits(Replies::Generated);
    // One client: every reply is in before its conversation's next turn is sent.
    // Turns 1 and 2 of two conversations carry 1 and 2 replies.
    assert_eq!(none, None);
    assert_eq!(some, Some(pdserve_bench::metrics::Replies { in_history: 6, generated: 6 }));
    // A reply the worker generated is in its cache; a random stand-in is not.
    assert!(generated > random, "{generated} vs {random} cached tokens");
}

/// `auto` over two mixed workers on prompts that share prefixes: a decoder picked
/// with a prefix to fetch from its peer is costed with that fetch. Costed as if it
/// recomputed the prefix, the prompt went to the peer to prefill instead, which
/// made the peer's decodes wait out a prefill and sent the whole prompt's KV over
/// the link. `auto` then serves exactly as the aggregated router does.
#[test]
fn auto_costs_its_decoder_with_the_prefix_it_fetches_and_serves_as_aggregated() {
    let w = WorkloadFlags { shared_prefixes: 8, prefix_len: 1024, ..flags(128, 32) }.build().unwrap();
    let served = |mode| {
        let t = Topology { policy: PolicyKind::KvAware, ..topology(mode, vec![Role::Mixed, Role::Mixed]) };
        let out = run(&profile(), t, &w, Sweep::Concurrency(vec![2]), 32);
        assert!(out[0].records.iter().all(|r| r.ok));
        let hits = out[0].summary.prefix_hits.unwrap();
        let times: Vec<(Option<f64>, f64)> = out[0].records.iter().map(|r| (r.ttft_s, r.e2e_s)).collect();
        (times, hits.fetched)
    };
    let (auto, aggregated) = (served(Mode::Auto), served(Mode::Aggregated));
    assert!(aggregated.1 > 0.0, "no prefix was fetched: the test shows nothing");
    assert_eq!(auto, aggregated);
}

/// `serve --protect-tpot` in the twin: one mixed worker with two requests in flight,
/// each 1,024-token prompt arriving while the other request decodes. Unheld, the
/// prompt's 0.57 s of chunks stall that answer (about 14 ms a token against 5.5 ms
/// alone); kept, every answer meets its 10 ms objective and every request finishes.
#[test]
fn protected_decodes_keep_their_tpot_objective_beside_long_prompts() {
    let p = profile();
    let w = workload(1024, 64);
    let objectives = Objectives { ttft_s: 30.0, tpot_s: 0.010 };
    let tpots = |objectives| {
        let t = Topology { objectives, ..topology(Mode::Aggregated, vec![Role::Mixed]) };
        let out = run(&p, t, &w, Sweep::Concurrency(vec![2]), 12);
        assert_eq!(out[0].records.len(), 12);
        assert!(out[0].records.iter().all(|r| r.ok && r.output_tokens == 64));
        out[0].records.iter().map(|r| r.tpot_s.unwrap()).collect::<Vec<_>>()
    };
    let unheld = tpots(None);
    assert!(unheld.iter().any(|&t| t > 0.012), "no answer was stalled: {unheld:?}");
    let kept = tpots(Some(objectives));
    assert!(kept.iter().all(|&t| t <= objectives.tpot_s), "{kept:?}");
}

/// Speculation as a server measured it: drafts mostly accepted make a decode step
/// yield several tokens for a row's cost each, so TPOT falls; drafts never accepted
/// are soon not verified at all (the measured rule), so TPOT stays within 3 %.
#[test]
fn measured_speculation_shortens_tpot_only_where_drafts_are_accepted() {
    let plain = lone_tpot(profile());
    let spec = |accepted_share| SpecProfile {
        tokens: 4,
        accepted_share,
        drafting_share: 1.0,
        draft_steps: vec![],
        draft_kv_bytes_per_token: 0.0,
        lookup: None,
    };
    let good = lone_tpot(profile().with_speculation(spec(0.8)));
    let bad = lone_tpot(profile().with_speculation(spec(0.0)));
    assert!(good < 0.7 * plain, "accepted drafts: {good:.2} ms against {plain:.2} ms");
    assert!(bad <= plain / 0.97, "rejected drafts: {bad:.2} ms against {plain:.2} ms");
}

/// Drafts that exist on a quarter of the steps gain less than drafts on every step,
/// and a draft model's passes are charged: one as dear as the target gains nothing.
#[test]
fn speculation_gains_less_where_drafts_are_rarer_or_dearer() {
    let spec = |drafting_share, draft_steps| SpecProfile {
        tokens: 4,
        accepted_share: 0.8,
        drafting_share,
        draft_steps,
        draft_kv_bytes_per_token: 0.0,
        lookup: None,
    };
    let plain = lone_tpot(profile());
    let always = lone_tpot(profile().with_speculation(spec(1.0, vec![])));
    let rare = lone_tpot(profile().with_speculation(spec(0.25, vec![])));
    let dear = lone_tpot(profile().with_speculation(spec(1.0, vec![(1, STEP)])));
    assert!(always < rare && rare < plain, "every step {always:.2}, a quarter {rare:.2}, none {plain:.2} ms");
    // Drafting costs more than it saves: the measured rule, which prices the draft
    // passes too, soon drafts nothing, so TPOT stays that of plain decoding.
    let dear_ok = (0.97 * plain..=plain / 0.97).contains(&dear);
    assert!(dear_ok, "a draft model as dear as the target: {dear:.2} against {plain:.2} ms");
}

/// A draft model computes each prompt it drafts for: the twin charges that to the
/// prompt's steps, and prices it per request as the engine does. Short prompts with
/// long answers repay it and pay it; once the costs are measured, a long prompt with
/// a short answer drafts by lookup (nothing, in a twin given no lookup figures) and is
/// spared it.
#[test]
fn a_draft_model_computes_the_prompts_whose_drafts_repay_it() {
    let spec = draft_spec(None);
    let ttfts = |p: Profile, input, output| {
        let t = topology(Mode::Aggregated, vec![Role::Mixed]);
        let out = run(&p, t, &workload(input, output), Sweep::Concurrency(vec![1]), 4);
        assert!(out[0].records.iter().all(|r| r.ok && r.output_tokens == u64::from(output)), "{:?}", out[0].records);
        out[0].records.iter().map(|r| r.ttft_s.unwrap()).collect::<Vec<f64>>()
    };
    let follow = |input| DRAFT.seconds(&StepShape::chunk(0, input, false));
    // 256 in, 64 out: every prompt is computed by both models.
    let (plain, drafting) = (ttfts(profile(), 256, 64), ttfts(profile().with_speculation(spec.clone()), 256, 64));
    for (p, d) in plain.iter().zip(&drafting) {
        close(*d, p + follow(256));
    }
    // 2048 in, 16 out: the first request drafts by model and measures the costs;
    // after it, drafts would save less than the prompt costs the draft model.
    let (plain, drafting) = (ttfts(profile(), 2048, 16), ttfts(profile().with_speculation(spec), 2048, 16));
    close(drafting[0], plain[0] + follow(2048));
    for (p, d) in plain.iter().zip(&drafting).skip(1) {
        close(*d, *p);
    }
}

/// Beside a draft model, a request that drafts by lookup drafts as the lookup's
/// measured figures say: the long prompts above, spared the draft model's prompt, gain
/// from their lookups' drafts where the twin has the lookup's figures, and decode as
/// plain ones where it has none; neither pays for the prompt.
#[test]
fn beside_a_draft_model_a_lookup_drafts_as_its_own_figures_say() {
    let runs = |p: Profile| {
        let t = topology(Mode::Aggregated, vec![Role::Mixed]);
        let out = run(&p, t, &workload(2048, 16), Sweep::Concurrency(vec![1]), 4);
        assert!(out[0].records.iter().all(|r| r.ok && r.output_tokens == 16), "{:?}", out[0].records);
        out[0].records.iter().map(|r| (r.ttft_s.unwrap(), r.tpot_s.unwrap())).collect::<Vec<(f64, f64)>>()
    };
    let plain = runs(profile());
    let nothing = runs(profile().with_speculation(draft_spec(None)));
    let lookup = runs(profile().with_speculation(draft_spec(Some((0.9, 1.0)))));
    // The first request drafts by model (nothing is measured yet); the rest by lookup.
    for ((p, n), l) in plain.iter().zip(&nothing).zip(&lookup).skip(1) {
        close(n.0, p.0);
        close(l.0, p.0);
        assert!((n.1 - p.1).abs() <= 0.01 * p.1, "no lookup figures: TPOT {} against {} s", n.1, p.1);
    }
    // The second learns what a lookup's drafts are worth (the worker has no record of
    // them yet); those after it verify them, and pay none of the draft model's passes:
    // they decode within 20 % of a worker's that drafts by lookup alone with the same
    // figures (its record of the drafts differs by the first request, drafted by
    // model here). Charged the passes, they took 1.3× as long.
    let alone =
        runs(profile().with_speculation(SpecProfile { draft_steps: vec![], accepted_share: 0.9, ..draft_spec(None) }));
    for ((p, l), a) in plain.iter().zip(&lookup).zip(&alone).skip(2) {
        assert!(l.1 < 0.8 * p.1, "a lookup's drafts: TPOT {:.2} ms against {:.2} ms", l.1 * 1e3, p.1 * 1e3);
        assert!(l.1 <= 1.2 * a.1, "beside a draft model: TPOT {:.2} ms, by lookup alone {:.2}", l.1 * 1e3, a.1 * 1e3);
    }
}

/// Across a handoff the prefill worker computes the draft model's prompt only where
/// the decode worker's reservation prices its K/V above that cost, and the decode
/// worker drafts by model exactly then: the same requests as above, on a prefill
/// worker and a decode worker.
#[test]
fn a_prefill_worker_computes_the_draft_prompts_the_decode_worker_prices_above_their_cost() {
    let spec = draft_spec(None);
    let runs = |p: Profile, input, output| {
        let t = topology(Mode::Disaggregated, vec![Role::Prefill, Role::Decode]);
        let out = run(&p, t, &workload(input, output), Sweep::Concurrency(vec![1]), 4);
        assert!(out[0].records.iter().all(|r| r.ok && r.output_tokens == u64::from(output)), "{:?}", out[0].records);
        let ttft = out[0].records.iter().map(|r| r.ttft_s.unwrap()).collect::<Vec<f64>>();
        (ttft, out[0].summary.tpot_ms.p50.unwrap())
    };
    let follow = |input| DRAFT.seconds(&StepShape::chunk(0, input, false));
    // 256 in, 64 out: every prompt's draft K/V is worth its compute, and drafts pay.
    let ((plain, plain_tpot), (drafting, drafting_tpot)) =
        (runs(profile(), 256, 64), runs(profile().with_speculation(spec.clone()), 256, 64));
    for (p, d) in plain.iter().zip(&drafting) {
        close(*d, p + follow(256));
    }
    assert!(drafting_tpot < plain_tpot * 0.8, "{drafting_tpot} ms against {plain_tpot} ms");
    // 2048 in, 16 out: the first prompt is computed while the decode worker has
    // measured nothing; after it, its reservations price the draft K/V below the
    // prompt's cost, neither worker pays it, and the decode worker drafts those
    // requests by lookup (nothing, in the twin): three of four decode as plain ones.
    let ((plain, plain_tpot), (drafting, drafting_tpot)) =
        (runs(profile(), 2048, 16), runs(profile().with_speculation(spec), 2048, 16));
    close(drafting[0], plain[0] + follow(2048));
    for (p, d) in plain.iter().zip(&drafting).skip(1) {
        close(*d, *p);
    }
    close(drafting_tpot / 1e3, plain_tpot / 1e3);
}

/// The draft model's K/V rides the handoff after the target's, where the prefill
/// worker computed it: the first token comes that many bytes' link time later, and
/// not at all later for the prompts whose draft K/V was not worth computing.
#[test]
fn a_handoff_carries_the_draft_models_kv_after_the_targets() {
    let ttfts = |draft_kv_bytes_per_token, input, output| {
        let spec = SpecProfile { draft_kv_bytes_per_token, ..draft_spec(None) };
        let t = topology(Mode::Disaggregated, vec![Role::Prefill, Role::Decode]);
        let out = run(&profile().with_speculation(spec), t, &workload(input, output), Sweep::Concurrency(vec![1]), 4);
        assert!(out[0].records.iter().all(|r| r.ok), "{:?}", out[0].records);
        out[0].records.iter().map(|r| r.ttft_s.unwrap()).collect::<Vec<f64>>()
    };
    let draft = 40_000.0;
    // 256 in, 64 out: every prompt's draft K/V goes.
    for (without, with) in ttfts(0.0, 256, 64).iter().zip(ttfts(draft, 256, 64)) {
        close(with, without + 256.0 * draft / LINK.bytes_per_s);
    }
    // 2048 in, 16 out: only the first (nothing is measured yet).
    let (without, with) = (ttfts(0.0, 2048, 16), ttfts(draft, 2048, 16));
    close(with[0], without[0] + 2048.0 * draft / LINK.bytes_per_s);
    for (w, d) in without.iter().zip(&with).skip(1) {
        close(*d, *w);
    }
}

/// A draft model's step cost, far below the test profile's.
const DRAFT: StepCost =
    StepCost { fixed_s: 0.0004, token_s: 0.00005, pair_s: 1e-8, decode_pair_s: 4e-8, logits_s: 0.0001 };

/// Drafts of 4 by [`DRAFT`], all accepted, beside a lookup's `lookup` figures.
fn draft_spec(lookup: Option<(f64, f64)>) -> SpecProfile {
    let draft_kv_bytes_per_token = 0.0;
    SpecProfile {
        tokens: 4,
        accepted_share: 1.0,
        drafting_share: 1.0,
        draft_steps: vec![(1, DRAFT)],
        draft_kv_bytes_per_token,
        lookup,
    }
}

/// TPOT p50 of four requests of 256 tokens in, 64 out, one at a time, on one mixed
/// worker of `p`; every one must finish whole.
fn lone_tpot(p: Profile) -> f64 {
    let out =
        run(&p, topology(Mode::Aggregated, vec![Role::Mixed]), &workload(256, 64), Sweep::Concurrency(vec![1]), 4);
    assert!(out[0].records.iter().all(|r| r.ok && r.output_tokens == 64), "{:?}", out[0].records);
    out[0].summary.tpot_ms.p50.unwrap()
}
