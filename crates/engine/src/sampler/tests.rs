//! Behaviour of the sampler as a whole: choices, determinism, distributions, and
//! robustness to whatever the model emits.

use super::*;
use proptest::prelude::*;
// proptest's prelude exports a trait of the same name.
use super::Rng;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
    f(&mut p);
    p.validate().unwrap()
}

fn random_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_f64() * 10.0 - 5.0) as f32).collect()
}

fn run(p: &SamplingParams, logits: &[f32], steps: usize) -> Vec<u32> {
    let mut s = Sampler::new(p, 0);
    let h = TokenHistory::new(&[]);
    (0..steps).map(|_| s.sample(&mut logits.to_vec(), &h).token).collect()
}

fn softmax(xs: &[f32]) -> Vec<f64> {
    let m = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = xs.iter().map(|&x| f64::from(x - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

#[test]
fn greedy_picks_argmax_with_ties_to_lowest_id() {
    let p = SamplingParams::greedy(4);
    assert_eq!(run(&p, &[0.1, 2.0, -1.0, 2.0], 3), [1, 1, 1]);
    let p = params(|p| p.temperature = 1e-7);
    assert_eq!(run(&p, &[0.1, 2.0, -1.0, 2.5], 1), [3]);
}

#[test]
fn same_seed_same_tokens_and_different_seeds_differ() {
    let logits = random_logits(1000, 1);
    let a = params(|p| p.seed = Some(42));
    let b = params(|p| p.seed = Some(43));
    assert_eq!(run(&a, &logits, 64), run(&a, &logits, 64));
    assert_ne!(run(&a, &logits, 64), run(&b, &logits, 64));
    // Without a request seed the fallback seed decides.
    let none = params(|p| p.seed = None);
    let mut s1 = Sampler::new(&none, 42);
    let h = TokenHistory::new(&[]);
    let via_fallback: Vec<u32> = (0..64).map(|_| s1.sample(&mut logits.clone(), &h).token).collect();
    assert_eq!(via_fallback, run(&a, &logits, 64));
}

#[test]
fn top_k_one_and_tiny_top_p_equal_greedy() {
    for seed in 0..20 {
        let logits = random_logits(500, seed);
        let greedy = run(&SamplingParams::greedy(1), &logits, 1);
        assert_eq!(run(&params(|p| p.top_k = 1), &logits, 5), vec![greedy[0]; 5]);
        assert_eq!(run(&params(|p| p.top_p = 1e-6), &logits, 5), vec![greedy[0]; 5]);
    }
}

#[test]
fn top_k_never_leaves_the_k_best() {
    let logits = random_logits(300, 3);
    let mut order: Vec<u32> = (0..300).collect();
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    let best: Vec<u32> = order[..5].to_vec();
    let got = run(&params(|p| p.top_k = 5), &logits, 2000);
    assert!(got.iter().all(|t| best.contains(t)));
    assert_eq!(best.iter().filter(|t| got.contains(t)).count(), 5);
}

#[test]
fn top_p_keeps_the_nucleus() {
    // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 needs the first two.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
    let got = run(&params(|p| p.top_p = 0.7), &logits, 2000);
    assert!(got.iter().all(|&t| t < 2));
    assert!(got.contains(&0) && got.contains(&1));
}

#[test]
fn min_p_drops_unlikely_tokens() {
    // min_p 0.5 keeps tokens with p >= 0.25: only the first two.
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
    let got = run(&params(|p| p.min_p = 0.5), &logits, 2000);
    assert!(got.iter().all(|&t| t < 2));
    assert!(got.contains(&0) && got.contains(&1));
    // Combined with a big top_k the same holds.
    let got = run(&params(|p| (p.min_p, p.top_k) = (0.5, 3)), &logits, 500);
    assert!(got.iter().all(|&t| t < 2));
}

fn greedy_after(p: &SamplingParams, logits: &[f32], prompt: &[u32], out: &[u32]) -> u32 {
    let mut h = TokenHistory::new(prompt);
    out.iter().for_each(|&t| h.push(t));
    Sampler::new(p, 0).sample(&mut logits.to_vec(), &h).token
}

#[test]
fn penalties_change_the_choice() {
    let greedy = |f: fn(&mut SamplingParams)| {
        let mut p = SamplingParams::greedy(8);
        f(&mut p);
        p.validate().unwrap()
    };
    let rep = greedy(|p| p.repetition_penalty = 1.2);
    assert_eq!(greedy_after(&rep, &[2.0, 1.9], &[0], &[]), 1, "positive logit divided");
    assert_eq!(greedy_after(&rep, &[-1.0, -1.1], &[0], &[]), 1, "negative logit multiplied");
    assert_eq!(greedy_after(&rep, &[2.0, 1.9], &[], &[]), 0, "unseen tokens untouched");
    let freq = greedy(|p| p.frequency_penalty = 0.3);
    assert_eq!(greedy_after(&freq, &[1.0, 0.5], &[], &[0]), 0, "0.7 still wins");
    assert_eq!(greedy_after(&freq, &[1.0, 0.5], &[], &[0, 0]), 1, "0.4 loses");
    assert_eq!(greedy_after(&freq, &[1.0, 0.5], &[0, 0, 0], &[]), 0, "prompt not counted");
    let pres = greedy(|p| p.presence_penalty = 0.6);
    assert_eq!(greedy_after(&pres, &[1.0, 0.5], &[], &[0]), 1);
    let negative = greedy(|p| p.presence_penalty = -1.0);
    assert_eq!(greedy_after(&negative, &[0.5, 1.0], &[], &[0]), 0);
    // Out-of-vocabulary history entries are ignored, not a panic.
    assert_eq!(greedy_after(&rep, &[2.0, 1.9], &[7, 0], &[99]), 1);
}

#[test]
fn bans_mask_until_cleared() {
    let p = SamplingParams { top_logprobs: 1, ..SamplingParams::greedy(8) };
    let mut s = Sampler::new(&p, 0);
    let h = TokenHistory::new(&[]);
    let logits = [0.0, 3.0, 1.0];
    s.ban(&[1, 1, 1000]);
    let banned = s.sample(&mut logits.to_vec(), &h);
    assert_eq!(banned.token, 2);
    // The top list still reports the raw distribution, banned token included.
    assert_eq!(banned.top[0].0, 1);
    s.clear_bans();
    assert_eq!(s.sample(&mut logits.to_vec(), &h).token, 1);
}

#[test]
fn logprobs_are_raw_normalized_and_sorted() {
    let raw = random_logits(500, 9);
    let p = params(|p| (p.top_logprobs, p.repetition_penalty) = (20, 1.5));
    let mut s = Sampler::new(&p, 0);
    let mut h = TokenHistory::new(&[3, 4, 5]);
    let lsm = LogSoftmax::of(&raw);
    let total: f64 = raw.iter().map(|&x| f64::from(lsm.logprob(x)).exp()).sum();
    assert!((total - 1.0).abs() < 1e-4, "{total}");
    for _ in 0..20 {
        let mut logits = raw.clone();
        let out = s.sample(&mut logits, &h);
        assert_eq!(logits, raw, "logits end raw");
        h.push(out.token);
        let expect = lsm.logprob(raw[out.token as usize]);
        assert!((out.logprob - expect).abs() < 1e-6);
        assert_eq!(out.top.len(), 20);
        assert!(out.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let best = raw.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(raw[out.top[0].0 as usize], best);
        let reference = -raw.iter().map(|&x| f64::from(x - best).exp()).sum::<f64>().ln();
        assert!((f64::from(out.top[0].1) - reference).abs() < 1e-4);
    }
    assert!(Sampler::new(&params(|_| ()), 0).sample(&mut raw.clone(), &h).top.is_empty());
}

#[test]
fn nan_and_infinite_logits_do_not_panic() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let cases: [&[f32]; 6] = [
        &[nan, 1.0, nan, 0.5],
        &[nan, nan, nan],
        &[f32::NEG_INFINITY; 4],
        &[1.0, inf, 2.0, inf],
        &[f32::MAX, -f32::MAX, 0.0],
        &[],
    ];
    let all = [
        SamplingParams { top_logprobs: 3, ..SamplingParams::greedy(1) },
        params(|p| p.top_logprobs = 3),
        params(|p| (p.top_k, p.top_p, p.min_p) = (2, 0.5, 0.1)),
        params(|p| (p.repetition_penalty, p.frequency_penalty) = (1.3, 2.0)),
    ];
    for p in &all {
        for logits in cases {
            let mut h = TokenHistory::new(&[0, 1]);
            h.push(1);
            let out = Sampler::new(p, 0).sample(&mut logits.to_vec(), &h);
            assert!(logits.is_empty() || (out.token as usize) < logits.len());
            assert!(!out.logprob.is_nan(), "{logits:?} {p:?}");
            assert!(out.top.iter().all(|t| !t.1.is_nan()));
        }
    }
    // NaN is never chosen when anything else is available, and +inf always is.
    assert_eq!(run(&params(|_| ()), &[nan, 1.0, nan], 50), vec![1; 50]);
    let got = run(&params(|_| ()), &[1.0, inf, 2.0, inf], 200);
    assert!(got.iter().all(|&t| t == 1 || t == 3) && got.contains(&1) && got.contains(&3));
}

/// Pearson's statistic of `draws` samples under `p` against `expect` (probabilities by
/// token id; zero entries must never be drawn).
fn chi_square(p: &SamplingParams, logits: &[f32], expect: &[f64], draws: usize) -> f64 {
    let mut counts = vec![0usize; logits.len()];
    for t in run(p, logits, draws) {
        counts[t as usize] += 1;
    }
    let mut chi = 0.0;
    for (&c, &e) in counts.iter().zip(expect) {
        if e == 0.0 {
            assert_eq!(c, 0, "a token with probability 0 was drawn");
            continue;
        }
        let e = e * draws as f64;
        chi += (c as f64 - e).powi(2) / e;
    }
    chi
}

/// 0.1% critical values of chi-square by degrees of freedom (1 to 3). The seeds are
/// fixed, so these tests are deterministic; they catch a biased draw, a wrong
/// temperature, or a filter that renormalizes wrongly.
const CHI_CRITICAL: [f64; 4] = [0.0, 10.83, 13.82, 16.27];

#[test]
fn sampling_frequencies_follow_softmax() {
    let logits = [0.0, 1.0, 2.0, 0.5];
    for t in [1.0, 0.5, 2.0] {
        let p = params(|p| (p.temperature, p.seed) = (t, Some(2024)));
        let scaled: Vec<f32> = logits.iter().map(|x| x / t).collect();
        let chi = chi_square(&p, &logits, &softmax(&scaled), 20_000);
        assert!(chi < CHI_CRITICAL[3], "temperature {t}: chi-square {chi}");
    }
}

#[test]
fn filters_renormalize_what_they_keep() {
    let logits = [0.0f32, 1.0, 2.0, 0.5];
    let sm = softmax(&logits);
    // top_k = 3 drops token 0; the rest keep their relative odds.
    let keep3: f64 = sm[1..].iter().sum();
    let expect = [0.0, sm[1] / keep3, sm[2] / keep3, sm[3] / keep3];
    let chi = chi_square(&params(|p| p.top_k = 3), &logits, &expect, 20_000);
    assert!(chi < CHI_CRITICAL[2], "top_k: {chi}");
    // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 and min_p 0.5 both keep two.
    let probs = [0.5f32, 0.3, 0.15, 0.05];
    let logits: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
    let expect = [0.625, 0.375, 0.0, 0.0];
    for p in [params(|p| p.top_p = 0.7), params(|p| p.min_p = 0.5)] {
        let chi = chi_square(&p, &logits, &expect, 20_000);
        assert!(chi < CHI_CRITICAL[1], "{p:?}: {chi}");
    }
    // top_p over a top_k set renormalizes over that set: with top_k 3 the masses are
    // 0.5/0.95, 0.3/0.95, ..., so top_p 0.8 needs the first two.
    let p = params(|p| (p.top_k, p.top_p) = (3, 0.8));
    assert!(chi_square(&p, &logits, &expect, 20_000) < CHI_CRITICAL[1]);
}

#[test]
fn nucleus_of_a_flat_distribution_is_its_lowest_ids() {
    // Equal logits: the nucleus of mass 0.5 is the first half by id (ties go to lower
    // ids), which takes the nucleus search through several rounds.
    let logits = vec![0.25f32; 4096];
    let got = run(&params(|p| p.top_p = 0.5), &logits, 4000);
    assert!(got.iter().all(|&t| t < 2048));
    assert!(got.iter().any(|&t| t > 1900) && got.iter().any(|&t| t < 100));
}

#[test]
fn large_vocabularies_draw_in_range_on_every_path() {
    let logits = random_logits(49_152, 5);
    for p in [
        params(|_| ()),
        params(|p| p.top_k = 40),
        params(|p| p.top_k = 40_000),
        params(|p| p.top_p = 0.9),
        params(|p| (p.temperature, p.min_p) = (0.7, 0.05)),
    ] {
        let got = run(&p, &logits, 50);
        assert!(got.iter().all(|&t| (t as usize) < logits.len()), "{p:?}");
        let distinct: std::collections::HashSet<_> = got.iter().collect();
        assert!(distinct.len() > 10, "{p:?} drew only {distinct:?}");
    }
}

#[test]
fn history_counts_incrementally() {
    let mut h = TokenHistory::new(&[5, 5, 6]);
    assert!(h.contains(5) && h.contains(6) && !h.contains(7));
    assert!(h.in_prompt(5) && !h.in_prompt(7));
    assert_eq!(h.output_count(5), 0);
    h.push(5);
    h.push(7);
    h.push(7);
    assert_eq!((h.output_count(5), h.output_count(7), h.output_len()), (1, 2, 3));
    assert!(h.in_prompt(5) && !h.in_prompt(7));
    assert_eq!(h.seen.len(), 3);
}

proptest! {
    #[test]
    fn never_panics_and_stays_in_range(
        logits in prop::collection::vec(prop_oneof![
            any::<f32>(), Just(f32::NAN), Just(f32::INFINITY), -10.0f32..10.0
        ], 1..64),
        temperature in prop_oneof![Just(0.0f32), 0.0f32..5.0],
        top_k in 0u32..8,
        top_p in 0.01f32..=1.0,
        min_p in 0.0f32..=1.0,
        rep in 0.5f32..2.0,
        history in prop::collection::vec(0u32..80, 0..20),
        seed in any::<u64>(),
    ) {
        let p = SamplingParams {
            temperature, top_k, top_p, min_p, repetition_penalty: rep,
            frequency_penalty: 0.5, top_logprobs: 5, seed: Some(seed), ..Default::default()
        }.validate().unwrap();
        let mut s = Sampler::new(&p, 0);
        s.ban(&[0]);
        let h = TokenHistory::new(&history);
        let mut work = logits.clone();
        let out = s.sample(&mut work, &h);
        prop_assert!((out.token as usize) < logits.len());
        prop_assert!(!out.logprob.is_nan());
        prop_assert!(out.top.len() == logits.len().min(5));
        prop_assert!(work.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn replay_draw_catches_up_with_a_sampler_that_sampled_one_more_step() {
    let logits = random_logits(300, 4);
    let h = TokenHistory::new(&[]);
    for p in [params(|_| ()), params(|p| p.top_k = 20), SamplingParams::greedy(4)] {
        let mut local = Sampler::new(&p, 9);
        let mut remote = Sampler::new(&p, 9);
        local.sample(&mut logits.clone(), &h);
        remote.replay_draw();
        let a: Vec<u32> = (0..20).map(|_| local.sample(&mut logits.clone(), &h).token).collect();
        let b: Vec<u32> = (0..20).map(|_| remote.sample(&mut logits.clone(), &h).token).collect();
        assert_eq!(a, b, "{p:?}");
    }
}
