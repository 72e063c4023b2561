//! Disaggregation at the engine level, on the real model: a prefill engine exports a
//! prompt's K/V as frames, a decode engine imports them and continues. The tokens (and
//! their logprobs) must equal one engine doing both, for greedy and for seeded sampling;
//! frames arrive layer by layer; bad frames are refused without touching the cache; and
//! every block comes back on both sides.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, EngineError, FinishReason, KvFrame, StepOutput};
use pdserve_engine::kvcache::convert_block;
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_types::{KvDtype, TokenOut};
use pdserve_types::{RequestId, SamplingParams, StopCondition};
use std::sync::OnceLock;

const BLOCK: usize = 16;

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

const TEXT: &str = "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great lens until it gleamed, and wound the clockwork that turned the light. Ships passing in the night never saw him, but they trusted the steady beam that swept across the dark water, warning them away from the rocks below the cliff. One winter night, a storm rolled in from the north, and the waves rose higher than anyone in the village could remember. The keeper watched the sea from the gallery, wrapped in his heavy coat, as the wind howled around the tower and";

/// The first `n` tokens of a fixed text (BOS included).
fn prompt(n: usize) -> Vec<u32> {
    let ids = model().tokenizer.encode_with_bos(TEXT, false);
    assert!(ids.len() >= n, "the text has only {} tokens", ids.len());
    ids[..n].to_vec()
}

/// `n` tokens that share no block with [`prompt`]'s: a request beside an export
/// whose cache hits would otherwise tell nothing apart.
fn unrelated(n: usize) -> Vec<u32> {
    prompt(n).into_iter().rev().collect()
}

fn engine(num_blocks: usize, max_batch_tokens: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads: 1,
        num_blocks,
        max_batch_tokens,
        max_seqs: 16,
        cache_salt: 7,
        objectives: None,
        ..Default::default()
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, logprobs: true, top_logprobs: 3, ..Default::default() }
        .validate()
        .unwrap()
}

fn seeded(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(42),
        ignore_eos: true,
        logprobs: true,
        ..Default::default()
    }
    .validate()
    .unwrap()
}

/// Steps `e` until idle; the outputs of request `id`, checking the finish flags.
fn drain(e: &mut Engine, id: RequestId) -> Vec<StepOutput> {
    let mut out = Vec::new();
    let mut steps = 0;
    while e.has_work() {
        out.extend(e.step().into_iter().filter(|o| o.id == id));
        steps += 1;
        assert!(steps < 10_000, "the engine does not make progress");
    }
    out
}

/// One engine doing everything.
fn aggregated(prompt: &[u32], params: &SamplingParams) -> Vec<TokenOut> {
    let mut e = engine(64, 512);
    e.add(RequestId(1), prompt.to_vec(), params.clone()).unwrap();
    let out = drain(&mut e, RequestId(1));
    assert!(out.last().unwrap().finish.is_some());
    out.into_iter().map(|o| o.sampled).collect()
}

/// Prefill on a fresh `P` (with `p_batch` tokens per step), returning its first token
/// and the frames it streamed. Checks P holds no block afterwards.
fn export(id: RequestId, prompt: &[u32], params: &SamplingParams, p_batch: usize) -> (StepOutput, Vec<KvFrame>) {
    let mut p = engine(64, p_batch);
    let mut frames = Vec::new();
    let first = p
        .prefill_export(id, prompt.to_vec(), params.clone(), &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    assert_eq!(first.id, id);
    assert_eq!(first.prompt_tokens, prompt.len());
    let s = p.stats();
    assert!(!p.has_work());
    assert_eq!(s.blocks.used, 0, "P keeps blocks in use: {:?}", s.blocks);
    assert_eq!(s.blocks.free + s.blocks.cached, s.blocks.total);
    // The prompt's full blocks stay in P's prefix cache.
    assert_eq!(s.blocks.cached, prompt.len() / BLOCK);
    (first, frames)
}

/// Frames come layer by layer: all blocks of layer l, in order, before layer l + 1.
fn check_frame_order(frames: &[KvFrame], prompt_len: usize) {
    let cfg = &model().model.cfg;
    let n_blocks = prompt_len.div_ceil(BLOCK);
    let elems = cfg.n_kv_heads * BLOCK * cfg.head_dim;
    let order: Vec<(u32, u32)> = frames.iter().map(|f| (f.layer, f.index)).collect();
    let want: Vec<(u32, u32)> =
        (0..cfg.n_layers as u32).flat_map(|l| (0..n_blocks as u32).map(move |b| (l, b))).collect();
    assert_eq!(order, want);
    assert!(frames.iter().all(|f| f.k.len() == elems && f.v.len() == elems));
    // Real data: some non-zero K and V in every layer.
    for l in 0..cfg.n_layers as u32 {
        assert!(frames
            .iter()
            .filter(|f| f.layer == l)
            .any(|f| f.k.iter().any(|&x| x != 0) && f.v.iter().any(|&x| x != 0)));
    }
}

/// Imports `frames` into `d` and finishes the import; returns D's outputs for `id`.
fn import(
    d: &mut Engine,
    id: RequestId,
    prompt: &[u32],
    first: &StepOutput,
    frames: &[KvFrame],
    params: &SamplingParams,
) -> Vec<StepOutput> {
    d.reserve_import(id, prompt.len()).unwrap();
    for f in frames {
        d.import_frame(id, f).unwrap();
    }
    d.finish_import(id, prompt.to_vec(), first.sampled.token, params.clone()).unwrap();
    drain(d, id)
}

fn disaggregated(prompt: &[u32], params: &SamplingParams, p_batch: usize) -> Vec<TokenOut> {
    let id = RequestId(9);
    let (first, frames) = export(id, prompt, params, p_batch);
    check_frame_order(&frames, prompt.len());
    assert_eq!(first.finish, None);
    let mut d = engine(64, 512);
    let rest = import(&mut d, id, prompt, &first, &frames, params);
    assert_eq!(rest.last().unwrap().finish, Some(FinishReason::Length));
    assert!(rest[..rest.len() - 1].iter().all(|o| o.finish.is_none()));
    assert_eq!(d.stats().blocks.used, 0);
    std::iter::once(first.sampled).chain(rest.into_iter().map(|o| o.sampled)).collect()
}

fn tokens(s: &[TokenOut]) -> Vec<u32> {
    s.iter().map(|x| x.token).collect()
}

fn assert_same(what: &str, want: &[TokenOut], got: &[TokenOut]) {
    assert_eq!(tokens(want), tokens(got), "{what}: tokens");
    assert_eq!(want, got, "{what}: logprobs");
}

#[test]
fn greedy_tokens_match_one_engine() {
    // Lengths: not a block multiple, exactly two blocks, longer than P's step budget
    // (so P exports after several chunked steps).
    for (n, p_batch) in [(37, 512), (32, 512), (83, 32)] {
        let p = prompt(n);
        let want = aggregated(&p, &greedy(20));
        assert_eq!(want.len(), 20);
        assert_same(&format!("greedy, {n} tokens"), &want, &disaggregated(&p, &greedy(20), p_batch));
    }
}

#[test]
fn seeded_sampling_matches_one_engine() {
    let p = prompt(50);
    let want = aggregated(&p, &seeded(24));
    assert_eq!(want.len(), 24);
    // The sampling really is random: it leaves the greedy path.
    assert_ne!(tokens(&want), tokens(&aggregated(&p, &greedy(24))));
    assert_same("seeded", &want, &disaggregated(&p, &seeded(24), 512));
}

#[test]
fn import_joins_a_busy_decode_batch() {
    let p = prompt(45);
    let want = aggregated(&p, &greedy(16));
    let id = RequestId(5);
    let (first, frames) = export(id, &p, &greedy(16), 512);
    // D is already decoding another request when the import lands.
    let mut d = engine(64, 512);
    let local = prompt(21);
    let local_want = aggregated(&local, &greedy(30));
    d.add(RequestId(6), local.clone(), greedy(30)).unwrap();
    let mut local_out = Vec::new();
    for _ in 0..4 {
        local_out.extend(d.step().into_iter().map(|o| o.sampled));
    }
    d.reserve_import(id, p.len()).unwrap();
    for (i, f) in frames.iter().enumerate() {
        d.import_frame(id, f).unwrap();
        if i % 10 == 0 {
            // Decoding goes on while frames arrive.
            local_out.extend(d.step().into_iter().map(|o| o.sampled));
        }
    }
    d.finish_import(id, p.clone(), first.sampled.token, greedy(16)).unwrap();
    let mut mine = vec![first.sampled];
    while d.has_work() {
        for o in d.step() {
            if o.id == id {
                mine.push(o.sampled);
            } else {
                local_out.push(o.sampled);
            }
        }
    }
    assert_same("imported", &want, &mine);
    assert_same("local", &local_want, &local_out);
    assert_eq!(d.stats().blocks.used, 0);
}

#[test]
fn bad_frames_are_rejected_and_change_nothing() {
    let p = prompt(40);
    let params = greedy(12);
    let want = aggregated(&p, &params);
    let id = RequestId(3);
    let (first, frames) = export(id, &p, &params, 512);
    let mut d = engine(64, 512);
    d.reserve_import(id, p.len()).unwrap();
    let used = d.stats().blocks.used;
    assert_eq!(used, p.len().div_ceil(BLOCK));
    for f in &frames {
        d.import_frame(id, f).unwrap();
    }
    // Sent after the good frames: had any of them been written, the tokens would change.
    let garbage = |f: &KvFrame| KvFrame { k: vec![0x7bff; f.k.len()], v: vec![0x7bff; f.v.len()], ..f.clone() };
    let good = garbage(&frames[0]);
    let n_layers = model().model.cfg.n_layers as u32;
    let bad = [
        KvFrame { index: p.len().div_ceil(BLOCK) as u32, ..good.clone() },
        KvFrame { index: u32::MAX, ..good.clone() },
        KvFrame { layer: n_layers, ..good.clone() },
        KvFrame { k: good.k[1..].to_vec(), ..good.clone() },
        KvFrame { v: [good.v.clone(), vec![0]].concat(), ..good.clone() },
        KvFrame { k: Vec::new(), v: Vec::new(), ..good.clone() },
    ];
    for f in &bad {
        let err = d.import_frame(id, f).unwrap_err();
        assert!(
            matches!(err, EngineError::BadFrame(_)),
            "layer {} index {} len {}: {err:?}",
            f.layer,
            f.index,
            f.k.len()
        );
    }
    assert_eq!(d.import_frame(RequestId(4), &frames[0]), Err(EngineError::Unknown(RequestId(4))));
    // A finish that does not match the reservation is refused and keeps the import.
    let err = d.finish_import(id, p[..p.len() - 1].to_vec(), first.sampled.token, params.clone()).unwrap_err();
    assert!(matches!(err, EngineError::BadFrame(_)), "{err:?}");
    let err = d.finish_import(RequestId(4), p.clone(), first.sampled.token, params.clone()).unwrap_err();
    assert_eq!(err, EngineError::Unknown(RequestId(4)));
    assert_eq!(d.stats().blocks.used, used);
    assert!(!d.has_work());
    d.finish_import(id, p.clone(), first.sampled.token, params.clone()).unwrap();
    let got: Vec<TokenOut> =
        std::iter::once(first.sampled).chain(drain(&mut d, id).into_iter().map(|o| o.sampled)).collect();
    assert_same("after rejected frames", &want, &got);
}

#[test]
fn aborted_and_cancelled_imports_return_their_blocks() {
    let p = prompt(70);
    let id = RequestId(11);
    let (_, frames) = export(id, &p, &greedy(8), 512);
    let mut d = engine(16, 512);
    let total = d.stats().blocks.total;

    d.reserve_import(id, p.len()).unwrap();
    assert_eq!(d.stats().blocks.used, 5);
    assert_eq!(d.reserve_import(id, p.len()), Err(EngineError::Duplicate(id)));
    assert_eq!(d.add(id, p.clone(), greedy(8)), Err(EngineError::Duplicate(id)));
    for f in &frames[..frames.len() / 2] {
        d.import_frame(id, f).unwrap();
    }
    assert!(d.abort_import(id));
    assert_eq!(d.stats().blocks.used, 0);
    assert_eq!(d.stats().blocks.free, total);
    assert!(!d.abort_import(id));
    assert_eq!(d.import_frame(id, &frames[0]), Err(EngineError::Unknown(id)));

    // `cancel` also ends an import in flight.
    d.reserve_import(id, p.len()).unwrap();
    assert!(d.cancel(id));
    assert_eq!(d.stats().blocks.used, 0);

    // A reservation the pool cannot hold fails at once and takes nothing.
    d.reserve_import(RequestId(12), 200).unwrap();
    assert_eq!(d.stats().blocks.used, 13);
    assert_eq!(d.reserve_import(RequestId(13), 60), Err(EngineError::NoBlocks));
    assert_eq!(d.stats().blocks.used, 13);
    assert!(d.abort_import(RequestId(12)));
    assert_eq!(d.stats().blocks.used, 0);
    assert!(!d.has_work());
}

#[test]
fn first_token_that_ends_the_request_queues_nothing() {
    let p = prompt(30);
    // max_tokens 1: the prefill side's token is the whole answer.
    let (first, frames) = export(RequestId(1), &p, &greedy(1), 512);
    assert_eq!(first.finish, Some(FinishReason::Length));
    let mut d = engine(16, 512);
    let rest = import(&mut d, RequestId(1), &p, &first, &frames, &greedy(1));
    assert!(rest.is_empty());
    assert_eq!(d.stats().blocks.used, 0);

    // A stop token id as the first token.
    let stop = SamplingParams {
        stop: StopCondition { token_ids: vec![first.sampled.token], ..Default::default() },
        ..greedy(10)
    };
    let (first, frames) = export(RequestId(2), &p, &stop, 512);
    assert_eq!(first.finish, Some(FinishReason::Stop));
    let rest = import(&mut d, RequestId(2), &p, &first, &frames, &stop);
    assert!(rest.is_empty());
    assert!(!d.has_work());
    assert_eq!(d.stats().blocks.used, 0);
}

/// An export whose later chunks find no free block (a reservation holds them)
/// fails with `NoBlocks` and frees what it took, instead of stepping for ever: the
/// export runs alone on the engine thread, so nothing could free a block meanwhile.
#[test]
fn an_export_that_runs_out_of_blocks_fails_instead_of_spinning() {
    let mut p = engine(16, 32);
    p.reserve_import(RequestId(20), 200).unwrap();
    let held = p.stats().blocks.used;
    assert_eq!(held, 13);
    // 80 tokens need 5 blocks; 3 are free, enough for the first 32-token chunk only.
    let err = p.prefill_export(RequestId(21), prompt(80), greedy(4), &mut |_| true).unwrap_err();
    assert_eq!(err, EngineError::NoBlocks);
    assert_eq!(p.stats().blocks.used, held, "the export gave back what it took");
    assert!(!p.has_work());
    assert!(p.abort_import(RequestId(20)));
    assert_eq!(p.stats().blocks.used, 0);
}

/// A mixed worker exports a prefill while it decodes: the export's steps carry it
/// alone (every frame is its own, in order), the decode waits and then goes on with
/// the tokens it would have had anyway.
#[test]
fn prefill_export_on_a_busy_engine_runs_alone_and_the_others_wait_unchanged() {
    let mut p = engine(64, 512);
    let mut frames = Vec::new();
    assert_eq!(
        p.prefill_export(RequestId(1), Vec::new(), greedy(4), &mut |f| {
            frames.push(f);
            true
        })
        .unwrap_err(),
        EngineError::EmptyPrompt
    );
    assert!(frames.is_empty());
    let want = aggregated(&unrelated(20), &greedy(8));
    p.add(RequestId(2), unrelated(20), greedy(8)).unwrap();
    // Its prefill and two decode steps.
    let mut got: Vec<TokenOut> = (0..3).flat_map(|_| p.step()).map(|o| o.sampled).collect();
    let first_a = p
        .prefill_export(RequestId(4), prompt(48), greedy(4), &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    check_frame_order(&frames, 48);
    assert_eq!(first_a.sampled, aggregated(&prompt(48), &greedy(4))[0], "the export's first token");
    assert_eq!(p.stats().running, 1, "the decode is back in the batch");
    got.extend(drain(&mut p, RequestId(2)).into_iter().map(|o| o.sampled));
    assert_same("a decode that waited out an export", &want, &got);
    // A second export of the same prompt (now a prefix-cache hit) streams the same
    // frames (whole blocks: a partial one's unused rows are whatever the block held).
    let mut again = Vec::new();
    let first_b = p
        .prefill_export(RequestId(5), prompt(48), greedy(4), &mut |f| {
            again.push(f);
            true
        })
        .unwrap();
    assert_eq!(first_b.cached_tokens, 32);
    assert_eq!(first_a.sampled, first_b.sampled);
    assert!(frames == again, "frames differ on a prefix-cache hit");
    assert_eq!(p.stats().blocks.used, 0);
}

/// A receiver that goes away mid-transfer stops the prefill at the next layer
/// boundary: no more frames after the refusal, no first token, no blocks held.
#[test]
fn refused_frame_stops_prefill_at_layer_boundary() {
    let m = model();
    let mut p = Engine::new(
        m.model.clone(),
        EngineConfig { threads: 1, num_blocks: 64, ..Default::default() },
        m.tokenizer.eog_ids().to_vec(),
    );
    let prompt: Vec<u32> = m.tokenizer.encode("The capital of France is Paris, and the capital of Italy is", false);
    let mut layers_seen = Vec::new();
    let err = p
        .prefill_export(RequestId(7), prompt.clone(), SamplingParams::greedy(4), &mut |f| {
            layers_seen.push(f.layer);
            f.layer < 2
        })
        .unwrap_err();
    assert_eq!(err, EngineError::Cancelled);
    assert_eq!(*layers_seen.iter().max().unwrap(), 2, "frames kept coming after the refusal");
    assert!(!p.has_work());
    assert_eq!(p.stats().blocks.used, 0);
    // The engine is fine afterwards.
    let mut n = 0;
    p.prefill_export(RequestId(8), prompt, SamplingParams::greedy(4), &mut |_| {
        n += 1;
        true
    })
    .unwrap();
    assert!(n > 0);
}

/// An engine (`max_batch_tokens` a step) that computed `prompt` once: its pool caches
/// the whole blocks.
fn holding(prompt: &[u32], max_batch_tokens: usize) -> Engine {
    let mut h = engine(64, max_batch_tokens);
    h.add(RequestId(1), prompt.to_vec(), greedy(1)).unwrap();
    drain(&mut h, RequestId(1));
    h
}

/// What `h` exports of `tokens` between steps: the tokens sent and the frames.
fn exported(h: &mut Engine, tokens: &[u32]) -> (usize, Vec<KvFrame>) {
    let mut frames = Vec::new();
    let sent = h
        .export_cached(tokens, 0, &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    (sent, frames)
}

#[test]
fn a_cached_prefix_fetched_from_a_busy_peer_continues_with_the_same_tokens() {
    let (history, turn) = (prompt(83), prompt(110));
    let want = aggregated(&turn, &greedy(12));
    // The holder served the conversation so far, and is decoding another request.
    let mut h = holding(&history, 512);
    let other = prompt(21);
    h.add(RequestId(2), other.clone(), greedy(30)).unwrap();
    let mut other_out: Vec<TokenOut> = h.step().into_iter().map(|o| o.sampled).collect();
    // Between two of its steps it sends the blocks it caches: 5 whole blocks of 83.
    let (sent, frames) = exported(&mut h, &turn);
    assert_eq!(sent, 80);
    check_frame_order(&frames, sent);
    other_out.extend(drain(&mut h, RequestId(2)).into_iter().map(|o| o.sampled));
    assert_same("the holder's own request", &aggregated(&other, &greedy(30)), &other_out);
    assert_eq!(h.stats().blocks.used, 0);

    // The fetcher computes only the 30 tokens after the fetched prefix.
    let mut d = engine(64, 512);
    d.reserve_import(RequestId(9), sent).unwrap();
    for f in &frames {
        d.import_frame(RequestId(9), f).unwrap();
    }
    d.add_imported(RequestId(9), turn.clone(), greedy(12), sent).unwrap();
    let out = drain(&mut d, RequestId(9));
    assert_eq!(out[0].cached_tokens, 80);
    assert_same("fetched prefix", &want, &out.into_iter().map(|o| o.sampled).collect::<Vec<_>>());
    let s = d.stats();
    assert_eq!(s.blocks.used, 0, "the fetcher keeps blocks in use: {:?}", s.blocks);
    // The fetched blocks are the fetcher's own cache now: the next turn hits them.
    assert!(s.blocks.cached >= turn.len() / BLOCK, "{:?}", s.blocks);
    let mut nothing = Vec::new();
    assert_eq!(
        d.export_cached(&prompt(40)[..8], 0, &mut |f| {
            nothing.push(f);
            true
        })
        .unwrap(),
        0
    );
    assert!(nothing.is_empty());
}

/// A prefill running on a fetcher and a fetched prefix waiting behind it must not
/// wait on each other: the waiting sequence holds blocks the prefill's next chunk
/// needs, and is not admitted while that prefill is blocked. The prefill takes the
/// waiting sequence's table (its full blocks stay cached), and both end with the
/// tokens one engine gives.
#[test]
fn a_running_prefill_and_a_fetched_prefix_waiting_behind_it_do_not_deadlock() {
    let (history, turn, long) = (prompt(83), prompt(110), prompt(100));
    let (want_long, want_turn) = (aggregated(&long, &greedy(4)), aggregated(&turn, &greedy(4)));
    let mut h = holding(&history, 512);
    let (sent, frames) = exported(&mut h, &turn);
    assert_eq!(sent, 80);
    // 9 blocks, 32 tokens a step: the long prompt's first chunk takes 2 blocks, the
    // fetched prefix 5, the second chunk the last 2; the third finds none.
    let mut d = engine(9, 32);
    d.add(RequestId(1), long, greedy(4)).unwrap();
    let mut outs = d.step();
    d.reserve_import(RequestId(9), sent).unwrap();
    for f in &frames {
        d.import_frame(RequestId(9), f).unwrap();
    }
    d.add_imported(RequestId(9), turn, greedy(4), sent).unwrap();
    let mut steps = 0;
    while d.has_work() {
        outs.extend(d.step());
        steps += 1;
        assert!(steps < 1_000, "the engine does not make progress: {:?}", d.stats());
    }
    let of = |id| outs.iter().filter(|o| o.id == RequestId(id)).map(|o| o.sampled.clone()).collect::<Vec<_>>();
    assert_eq!(tokens(&of(1)), tokens(&want_long), "the running prefill");
    assert_eq!(tokens(&of(9)), tokens(&want_turn), "the fetched prefix");
    assert_eq!(d.stats().blocks.used, 0);
}

#[test]
fn a_fetcher_that_caches_the_start_of_a_prefix_keeps_its_blocks_and_receives_only_the_rest() {
    let (history, turn) = (prompt(83), prompt(110));
    let want = aggregated(&turn, &greedy(12));
    let mut h = holding(&history, 512);
    // The fetcher served the first 40 tokens: it caches 2 whole blocks of them.
    let mut d = holding(&prompt(40), 512);
    let keep = 2 * BLOCK;
    assert_eq!(
        d.reserve_import_after(RequestId(8), 80, &prompt(83)[BLOCK..3 * BLOCK]),
        Err(EngineError::NotCached),
        "blocks it does not cache from the start"
    );
    assert_eq!(d.reserve_import_after(RequestId(8), 80, &turn[..3 * BLOCK]), Err(EngineError::NotCached));
    assert_eq!(d.stats().blocks.used, 0, "a refused reservation holds nothing");
    d.reserve_import_after(RequestId(9), 80, &turn[..keep]).unwrap();
    let mut frames = Vec::new();
    let sent = h
        .export_cached(&turn, keep, &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    assert_eq!(sent, 80 - keep, "the holder sends the 3 blocks after the 2 kept");
    check_frame_order(&frames, sent);
    for f in &frames {
        d.import_frame(RequestId(9), f).unwrap();
    }
    d.add_imported(RequestId(9), turn.clone(), greedy(12), keep + sent).unwrap();
    let out = drain(&mut d, RequestId(9));
    assert_eq!(out[0].cached_tokens, 80);
    assert_same("kept and fetched prefix", &want, &out.into_iter().map(|o| o.sampled).collect::<Vec<_>>());
    assert_eq!(d.stats().blocks.used, 0);
    // Skipping past what the holder caches sends nothing.
    assert_eq!(h.export_cached(&turn, 96, &mut |_| true).unwrap(), 0);
}

#[test]
fn a_prefill_engine_that_fetched_a_prefix_computes_the_rest_and_sends_the_whole_prompt() {
    // Disaggregated: the prefill engine caches a conversation's first 2 blocks, a
    // peer (the decode engine of the last turn) its first 5; the next turn is
    // prefilled with the 3 blocks it lacks fetched, and decoded elsewhere.
    let (history, turn) = (prompt(83), prompt(110));
    let params = greedy(12);
    let want = aggregated(&turn, &params);
    let mut h = holding(&history, 512);
    let mut p = holding(&prompt(40), 512);
    let (id, keep) = (RequestId(5), 2 * BLOCK);
    p.reserve_import_after(id, 80, &turn[..keep]).unwrap();
    let mut fetched = Vec::new();
    let sent = h
        .export_cached(&turn, keep, &mut |f| {
            fetched.push(f);
            true
        })
        .unwrap();
    for f in &fetched {
        p.import_frame(id, f).unwrap();
    }
    let mut frames = Vec::new();
    let first = p
        .prefill_export_imported(id, turn.clone(), params.clone(), keep + sent, &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    assert_eq!(first.cached_tokens, 80, "kept and fetched, not computed");
    check_frame_order(&frames, turn.len());
    let s = p.stats();
    assert_eq!((s.blocks.used, s.blocks.cached), (0, turn.len() / BLOCK), "the whole prompt cached, none in use");
    let mut d = engine(64, 512);
    let rest = import(&mut d, id, &turn, &first, &frames, &params);
    let got: Vec<TokenOut> = std::iter::once(first.sampled).chain(rest.into_iter().map(|o| o.sampled)).collect();
    assert_same("prefilled with a fetched prefix", &want, &got);
    assert_eq!(d.stats().blocks.used, 0);

    // On a busy engine it runs alone too: the decode there goes on unchanged.
    let mut busy = engine(64, 512);
    busy.reserve_import(RequestId(6), 32).unwrap();
    busy.add(RequestId(7), unrelated(20), greedy(4)).unwrap();
    let first = busy.prefill_export_imported(RequestId(6), prompt(50), greedy(4), 32, &mut |_| true).unwrap();
    assert_eq!(first.id, RequestId(6));
    let rest: Vec<TokenOut> = drain(&mut busy, RequestId(7)).into_iter().map(|o| o.sampled).collect();
    assert_same("a decode beside an imported export", &aggregated(&unrelated(20), &greedy(4)), &rest);
    assert_eq!(busy.stats().blocks.used, 0);
}

#[test]
fn a_fetch_cut_short_or_not_fitting_holds_no_block() {
    let turn = prompt(70);
    let mut h = holding(&turn, 512);
    let mut n = 0;
    let cut = h.export_cached(&turn, 0, &mut |_| {
        n += 1;
        n < 3
    });
    assert_eq!(cut, Err(EngineError::Cancelled));
    let s = h.stats();
    assert_eq!((s.blocks.used, s.blocks.cached), (0, 4), "{:?}", s.blocks);

    // An import claimed for more tokens than the request may take from a cache (it
    // must compute at least one), or than were reserved, is refused and released.
    let mut d = engine(64, 512);
    d.reserve_import(RequestId(3), 64).unwrap();
    let err = d.add_imported(RequestId(3), prompt(64), greedy(4), 64).unwrap_err();
    assert!(matches!(err, EngineError::BadFrame(_)), "{err:?}");
    d.reserve_import(RequestId(4), 32).unwrap();
    assert!(d.add_imported(RequestId(4), prompt(64), greedy(4), 48).is_err());
    assert!(!d.has_work());
    assert_eq!(d.stats().blocks.used, 0);
}

#[test]
fn a_prefix_is_exported_between_two_layers_of_a_running_prefill() {
    let history = prompt(83);
    let mut h = holding(&history, 32);
    let (sent, between_steps) = exported(&mut h, &history);
    assert_eq!(sent, 80);
    // The holder prefills another prompt in 32-token steps; a fetch is served after
    // the first layer of one of them, and frames equal those sent between steps.
    let other = prompt(70);
    h.add(RequestId(2), other.clone(), greedy(6)).unwrap();
    let mut out: Vec<TokenOut> = Vec::new();
    let (mut mid_step, mut served) = (Vec::new(), 0);
    out.extend(h.step().into_iter().map(|o| o.sampled));
    out.extend(
        h.step_serving(&mut |pool| {
            if served == 0 {
                served = pool
                    .export(&history, 0, &mut |f| {
                        mid_step.push(f);
                        true
                    })
                    .unwrap();
            }
        })
        .into_iter()
        .map(|o| o.sampled),
    );
    assert_eq!(served, 80);
    assert_eq!(mid_step.len(), between_steps.len());
    assert!(mid_step
        .iter()
        .zip(&between_steps)
        .all(|(a, b)| (a.layer, a.index, &a.k, &a.v) == (b.layer, b.index, &b.k, &b.v)));
    out.extend(drain(&mut h, RequestId(2)).into_iter().map(|o| o.sampled));
    assert_same("the running prefill", &aggregated(&other, &greedy(6)), &out);
    assert_eq!(h.stats().blocks.used, 0);
}

fn engine_in(kv_dtype: KvDtype) -> Engine {
    let m = model();
    let cfg = EngineConfig { num_blocks: 64, max_seqs: 16, cache_salt: 7, kv_dtype, ..Default::default() };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec())
}

/// Exports `prompt` from a fresh engine whose cache is `dtype`: its first token and
/// frames.
fn export_in(dtype: KvDtype, id: RequestId, prompt: &[u32], params: &SamplingParams) -> (StepOutput, Vec<KvFrame>) {
    let mut frames = Vec::new();
    let first = engine_in(dtype)
        .prefill_export(id, prompt.to_vec(), params.clone(), &mut |f| {
            frames.push(f);
            true
        })
        .unwrap();
    (first, frames)
}

#[test]
fn every_cache_dtype_hands_off_and_a_receiver_of_another_converts() {
    let (p, params, id) = (prompt(37), greedy(12), RequestId(9));
    let shape = |e: &Engine| e.kv_shape();
    for from in KvDtype::ALL {
        let (first, frames) = export_in(from, id, &p, &params);
        assert!(frames.iter().all(|f| f.dtype == from), "frames carry the sender's form");
        for to in KvDtype::ALL {
            let mut d = engine_in(to);
            let rest = import(&mut d, id, &p, &first, &frames, &params);
            assert_eq!(rest.len(), 11, "{from} -> {to}");
            assert_eq!(d.stats().blocks.used, 0);
            // The receiver holds exactly what converting the frames gives; the same
            // dtype moves the stored bytes unchanged, so decoding matches one engine
            // whose cache is that dtype.
            let mut held = Vec::new();
            d.export_cached(&p, 0, &mut |f| {
                held.push(f);
                true
            })
            .unwrap();
            let whole: Vec<&KvFrame> = frames.iter().filter(|f| (f.index as usize + 1) * BLOCK <= p.len()).collect();
            assert_eq!(held.len(), whole.len());
            for (h, f) in held.iter().zip(whole) {
                let (k, v) = convert_block(shape(&d), from, to, &f.k, &f.v).unwrap();
                assert_eq!((h.dtype, &h.k, &h.v), (to, &k, &v), "{from} -> {to}: layer {} block {}", f.layer, f.index);
            }
            if from == to {
                let mut one = engine_in(to);
                one.add(RequestId(1), p.clone(), params.clone()).unwrap();
                let want: Vec<u32> = drain(&mut one, RequestId(1)).iter().map(|o| o.sampled.token).collect();
                let got: Vec<u32> =
                    std::iter::once(first.sampled.token).chain(rest.iter().map(|o| o.sampled.token)).collect();
                assert_eq!(got, want, "{to} handoff vs one {to} engine");
            }
        }
    }
}

#[test]
fn a_frame_that_fits_no_dtype_shape_is_refused() {
    let (p, params, id) = (prompt(20), greedy(2), RequestId(3));
    let (_, frames) = export_in(KvDtype::F16, id, &p, &params);
    let mut d = engine_in(KvDtype::Q8_0);
    d.reserve_import(id, p.len()).unwrap();
    // f16's words labelled q8_0: too many for a q8_0 block.
    let mislabelled = KvFrame { dtype: KvDtype::Q8_0, ..frames[0].clone() };
    assert!(matches!(d.import_frame(id, &mislabelled), Err(EngineError::BadFrame(_))));
    d.import_frame(id, &frames[0]).unwrap();
}
