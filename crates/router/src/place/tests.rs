//! Placement on plain records: each rule of the module, one table row or test, no
//! worker and no runtime.

use super::*;
use crate::cost::Queue;
use crate::index::CachedPrefix;
use crate::policies::KvAware;
use crate::snapshot::{BacklogView, KvView, PrefillView, QueueView, Restore};
use pdserve_types::StepFit;

fn view(name: &str, role: Role) -> View {
    View {
        name: name.into(),
        role,
        usable: true,
        alive: true,
        peers: false,
        receives: false,
        load: 0,
        routed: 0,
        free_slots: crate::workers::PREFILL_SLOTS,
        prefill: PrefillView::default(),
        backlog: BacklogView::default(),
        kv: KvView::default(),
        step: None,
        restore: Restore::default(),
        links: Default::default(),
        cached: CachedPrefix::default(),
        kv_bytes_per_token: None,
    }
}

fn loaded(v: View, load: usize) -> View {
    View { load, ..v }
}

fn cached(v: View, blocks: usize) -> View {
    View { cached: CachedPrefix { device: blocks, host: 0, disk: 0 }, ..v }
}

fn snap(views: Vec<View>) -> Snapshot {
    Snapshot { views, ..Snapshot::default() }
}

/// Places a request of `prompt_len` tokens, 16 output tokens, with the KV-aware
/// policy and `serve`'s default admission unless `admission` says otherwise.
fn placed(
    mode: Mode,
    s: &Snapshot,
    prompt_len: usize,
    admission: Admission,
    pin: Option<&str>,
) -> Result<Plan, Refusal> {
    let ask = Ask { prompt_len, block_hashes: &[] };
    place(mode, &admission, s, &ask, &KvAware, pin, prompt_len + 16)
}

fn local(decode: usize, cached: usize) -> Plan {
    Plan { decode, prefill: Prefill::Local { fetch: None }, cached, predicted: 0.0 }
}

fn remote(decode: usize, on: usize, spare: Option<usize>) -> Plan {
    Plan { decode, prefill: Prefill::Remote { on, fetch: None, spare }, cached: 0, predicted: 0.0 }
}

/// What a row says, the mode, the workers, the prompt's length, and the plan.
type Row = (&'static str, Mode, Vec<View>, usize, Result<Plan, Refusal>);

#[test]
fn where_each_mode_places_a_request() {
    use Role::{Decode, Mixed, Prefill as P};
    let long = 2000;
    #[rustfmt::skip]
    let table: Vec<Row> = vec![
        ("aggregated: the least loaded worker",
            Mode::Aggregated, vec![loaded(view("a", Mixed), 3), view("b", Mixed)], 100, Ok(local(1, 0))),
        ("aggregated: the worker caching the prefix",
            Mode::Aggregated, vec![view("a", Mixed), cached(view("b", Mixed), 4)], 100, Ok(local(1, 64))),
        ("aggregated: an unusable worker is passed over",
            Mode::Aggregated, vec![View { usable: false, ..view("a", Mixed) }, loaded(view("b", Mixed), 5)], 100, Ok(local(1, 0))),
        ("no decode or mixed worker",
            Mode::Disaggregated, vec![view("p", P)], 100, Err(Refusal::NoWorker)),
        ("disaggregated: a prefill worker, the other one spare",
            Mode::Disaggregated, vec![view("p1", P), view("d", Decode), loaded(view("p2", P), 1)], 100, Ok(remote(1, 0, Some(2)))),
        ("disaggregated: no prefill worker, the decoder prefills",
            Mode::Disaggregated, vec![view("d", Decode)], 100, Ok(local(0, 0))),
        ("disaggregated: a decoder's cached prefix saves nothing, its load decides",
            Mode::Disaggregated, vec![view("p", P), loaded(cached(view("d1", Decode), 6), 2), view("d2", Decode)], 100,
            Ok(remote(2, 0, None))),
        ("auto: a short prompt stays on an idle mixed worker",
            Mode::Auto, vec![view("m", Mixed), view("p", P)], 10, Ok(local(0, 0))),
        ("auto: a prompt goes to the prefill worker when it spares the decodes",
            Mode::Auto, vec![loaded(view("m", Mixed), 4), view("p", P)], 10, Ok(remote(0, 1, None))),
        ("auto: a long prompt goes to the prefill worker",
            Mode::Auto, vec![loaded(view("m", Mixed), 4), view("p", P)], long, Ok(remote(0, 1, None))),
        ("auto: not to a prefill worker without a free slot",
            Mode::Auto, vec![loaded(view("m", Mixed), 4), View { free_slots: 0, ..view("p", P) }], long, Ok(local(0, 0))),
        ("auto: a decoder sends even a short prompt to an idle prefill worker",
            Mode::Auto, vec![view("d", Decode), view("p", P)], 100, Ok(remote(0, 1, None))),
        ("auto: a decoder prefills a short prompt itself while the prefill worker is backed up",
            Mode::Auto, vec![view("d", Decode), backed_up(view("p", P), 5000)], 100, Ok(local(0, 0))),
        ("auto: but never a long one",
            Mode::Auto, vec![view("d", Decode), backed_up(view("p", P), 5000)], 600, Ok(remote(0, 1, None))),
    ];
    for (what, mode, views, n, want) in table {
        let got = placed(mode, &snap(views), n, Admission::default(), None).map(|p| Plan { predicted: 0.0, ..p });
        assert_eq!(got, want, "{what}");
    }
}

fn backed_up(v: View, tokens: usize) -> View {
    let queue = QueueView { queue: Queue { tokens, prefills: 1 }, served_s: 0.0, reported: None };
    View { prefill: PrefillView { queue, ..v.prefill }, ..v }
}

#[test]
fn admission_refuses_what_it_predicts_too_late_and_never_a_moved_request() {
    let secs = Duration::from_secs_f64;
    let behind = |wait_s: f64, correction: f64| View {
        backlog: BacklogView { wait_s, pending_blocks: 0, correction },
        ..view("w", Role::Mixed)
    };
    let limit = Admission::default();
    let ok = |r: Result<Plan, Refusal>| r.map(|p| p.predicted);
    assert_eq!(ok(placed(Mode::Aggregated, &snap(vec![behind(20.0, 1.0)]), 100, limit, None)), Ok(20.0));
    assert_eq!(
        placed(Mode::Aggregated, &snap(vec![behind(40.0, 1.0)]), 100, limit, None),
        Err(Refusal::Queue { decode: 0, wait_s: 40.0, limit: secs(30.0) })
    );
    // Scaled by how late first tokens came; the raw figure is what an admitted
    // request carries.
    assert_eq!(
        placed(Mode::Aggregated, &snap(vec![behind(20.0, 2.0)]), 100, limit, None),
        Err(Refusal::Queue { decode: 0, wait_s: 40.0, limit: secs(30.0) })
    );
    // A moved request prefills where its KV is and is never refused.
    let s = snap(vec![view("p1", Role::Prefill), behind(40.0, 1.0), view("p2", Role::Prefill)]);
    let moved = placed(Mode::Disaggregated, &s, 100, limit, Some("p2")).unwrap();
    assert_eq!(moved.prefill, Prefill::Remote { on: 2, fetch: None, spare: Some(0) });
    assert_eq!(moved.predicted, 40.0);
}

#[test]
fn slo_admission_adds_the_requests_own_prefill() {
    let ttft = Admission { ttft: Some(Duration::from_secs(1)), ..Admission::default() };
    let s = snap(vec![view("w", Role::Mixed)]);
    assert!(placed(Mode::Aggregated, &s, 500, ttft, None).is_ok());
    let Err(Refusal::Ttft { decode: 0, first_s, .. }) = placed(Mode::Aggregated, &s, 2000, ttft, None) else {
        panic!("a 2,000-token prompt at the prior pace takes 2 s")
    };
    assert!((first_s - 2.0).abs() < 1e-9, "{first_s}");
}

#[test]
fn tpot_admission_judges_the_step_with_the_request_in_the_batch() {
    let tpot = Admission { tpot: Some(Duration::from_millis(100)), ..Admission::default() };
    let fit = StepFit { fixed: 0.05, per_row: 0.01, per_context: 0.0 };
    let with = |load| snap(vec![View { step: Some((fit, 0)), ..loaded(view("w", Role::Mixed), load) }]);
    assert!(placed(Mode::Aggregated, &with(3), 100, tpot, None).is_ok(), "0.05 + 4 × 0.01 s");
    let Err(Refusal::Tpot { step_s, .. }) = placed(Mode::Aggregated, &with(9), 100, tpot, None) else {
        panic!("0.05 + 10 × 0.01 s is over 0.1 s")
    };
    assert!((step_s - 0.15).abs() < 1e-9);
    // A worker whose steps were not fitted yet is not judged.
    assert!(placed(Mode::Aggregated, &snap(vec![loaded(view("w", Role::Mixed), 50)]), 100, tpot, None).is_ok());
}

#[test]
fn a_full_kv_pool_waits_at_the_pace_blocks_were_freed() {
    // No block free; 10 sequences gave back 30 blocks in the last 30 s: one a second.
    let kv = KvView { free: Some(0), freed_blocks: 30, ended: 10, counting_s: 100.0 };
    let s = snap(vec![View { kv, ..view("w", Role::Mixed) }]);
    // 100 prompt + 16 output tokens: 8 blocks, 8 s.
    assert_eq!(placed(Mode::Aggregated, &s, 100, Admission::default(), None).map(|p| p.predicted), Ok(8.0));
    let tight = Admission { max_queue: Some(Duration::from_secs(5)), ..Admission::default() };
    assert!(matches!(placed(Mode::Aggregated, &s, 100, tight, None), Err(Refusal::Queue { .. })));
}

#[test]
fn a_peer_cached_prefix_is_fetched_where_that_is_sooner_than_recomputing() {
    let peer = |v: View| View { peers: true, receives: true, ..v };
    // `a` caches 1,024 of the 1,100 tokens but is 100 s behind; `b` has nothing.
    let busy = backed_up(cached(peer(view("a", Role::Mixed)), 64), 100_000);
    let mut s = snap(vec![busy, peer(view("b", Role::Mixed))]);
    s.fetch_per_token = Some(50e-6);
    let plan = placed(Mode::Aggregated, &s, 1100, Admission::default(), None).unwrap();
    let Prefill::Local { fetch: Some(f) } = plan.prefill else { panic!("{plan:?}") };
    assert_eq!((plan.decode, plan.cached, f.from, f.tokens, f.keep), (1, 1024, 0, 1024, 0));
    assert!((f.seconds - (0.002 + 1024.0 * 50e-6)).abs() < 1e-9);
    // With fetching off, `b` recomputes; without an importer at `b`, too.
    s.fetch_per_token = None;
    assert_eq!(
        placed(Mode::Aggregated, &s, 1100, Admission::default(), None).map(|p| p.prefill),
        Ok(Prefill::Local { fetch: None })
    );
    s.fetch_per_token = Some(50e-6);
    s.views[1].receives = false;
    assert_eq!(
        placed(Mode::Aggregated, &s, 1100, Admission::default(), None).map(|p| p.prefill),
        Ok(Prefill::Local { fetch: None })
    );
}
