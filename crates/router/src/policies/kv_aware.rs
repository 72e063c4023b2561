//! KV-aware: the worker where the request is predicted to get its first token
//! soonest, in seconds: the prefills queued there plus the part of this prompt its
//! prefix cache does not hold, at the worker's measured prefill pace (a fixed cost
//! per prefill and a cost per computed token), plus the
//! copy back of what it holds in host RAM or on disk, plus, where
//! sequences decode, the delay they suffer: each of them waits out that compute
//! (chunked prefill shares their steps), so a worker with many in flight costs as
//! many times the compute. No overlap weight: a cached block is worth exactly the
//! prefill it saves, to the request and to those it would delay. A hot prefix
//! therefore stays on its worker only until that worker's queue and decodes cost
//! more than recomputing the prefix elsewhere, and then spreads. Ties (nothing
//! cached, nothing queued) go to the fewest requests in flight.

use super::{Ask, Candidate, Policy};
use pdserve_types::Role;

pub struct KvAware;

/// Predicted seconds to first token of `ask` on `c`, plus the delay its prefill
/// adds to the sequences decoding there.
pub fn predicted_ttft(ask: &Ask<'_>, c: &Candidate<'_>) -> f64 {
    let tokens = ask.prompt_len.saturating_sub(c.cached_tokens) as f64 * c.seconds_per_token;
    c.queued_seconds + c.fixed_seconds + tokens + c.restore_seconds + decode_delay(c.role, c.load, tokens)
}

/// What `compute` seconds of prefill on a worker of `role` with `in_flight`
/// requests costs the sequences decoding there: each waits it out. A prefill
/// worker decodes nothing.
pub fn decode_delay(role: Role, in_flight: usize, compute: f64) -> f64 {
    match role {
        Role::Prefill => 0.0,
        _ => in_flight as f64 * compute,
    }
}

impl Policy for KvAware {
    fn name(&self) -> &'static str {
        "kv-aware"
    }

    fn pick(&self, ask: &Ask<'_>, candidates: &[Candidate<'_>]) -> Option<usize> {
        (0..candidates.len()).min_by(|&a, &b| {
            let (ca, cb) = (&candidates[a], &candidates[b]);
            predicted_ttft(ask, ca).total_cmp(&predicted_ttft(ask, cb)).then(ca.load.cmp(&cb.load))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::{ask, cand};

    fn cached(name: &'static str, load: usize, cached_tokens: usize) -> Candidate<'static> {
        Candidate { cached_tokens, ..cand(name, load) }
    }

    #[test]
    fn the_worker_holding_the_prefix_wins_until_its_queue_costs_more() {
        let p = KvAware;
        let ask = Ask { prompt_len: 1000, ..ask() };
        // 900 cached tokens on `b` save 0.9 s at 1 ms a token.
        assert_eq!(p.pick(&ask, &[cached("a", 1, 0), cached("b", 1, 900)]), Some(1));
        // 2000 prompt tokens queued on `b` cost more than recomputing on `a`.
        let busy = Candidate { queued_seconds: 2.0, ..cached("b", 1, 900) };
        assert_eq!(p.pick(&ask, &[cached("a", 1, 0), busy]), Some(0));
    }

    #[test]
    fn a_prefix_on_disk_is_worth_what_its_copy_back_saves() {
        let p = KvAware;
        let ask = Ask { prompt_len: 1000, ..ask() };
        // 900 tokens on `b`'s disk cost 0.2 s to read back, against 0.9 s to compute.
        let on_disk = Candidate { restore_seconds: 0.2, ..cached("b", 1, 900) };
        assert_eq!(p.pick(&ask, &[cached("a", 1, 0), on_disk]), Some(1));
        // A slow disk (2 s) loses to computing everything on an idle `a`.
        let slow = Candidate { restore_seconds: 2.0, ..cached("b", 1, 900) };
        assert_eq!(p.pick(&ask, &[cached("a", 1, 0), slow]), Some(0));
    }

    #[test]
    fn a_prefill_costs_every_sequence_decoding_there_and_spreads_decodes() {
        let p = KvAware;
        // A pace a hair faster does not outweigh more sequences to delay.
        let quick_but_busy = Candidate { seconds_per_token: 0.99e-3, ..cand("a", 30) };
        assert_eq!(p.pick(&ask(), &[quick_but_busy, cand("b", 5)]), Some(1));
        // 900 cached tokens still win over 10 more sequences to delay: 100 tokens
        // delay 12 of them (1.3 s), 1000 would delay 2 (3 s).
        let holder = Candidate { cached_tokens: 900, ..cand("a", 12) };
        let big = Ask { prompt_len: 1000, ..ask() };
        assert_eq!(p.pick(&big, &[holder.clone(), cand("b", 2)]), Some(0));
        // ...but not over 30 more: 100 tokens delaying 32 sequences cost 3.3 s.
        let crowded = Candidate { load: 32, ..holder };
        assert_eq!(p.pick(&big, &[crowded, cand("b", 2)]), Some(1));
        // A prefill worker decodes nothing: its load is its queue, counted already.
        assert_eq!(decode_delay(Role::Prefill, 9, 1.0), 0.0);
        assert_eq!(decode_delay(Role::Mixed, 9, 1.0), 9.0);
    }

    #[test]
    fn without_a_cache_it_is_least_loaded_and_spares_decoding_workers() {
        let p = KvAware;
        assert_eq!(p.pick(&ask(), &[cand("a", 3), cand("b", 1), cand("c", 2)]), Some(1));
        assert_eq!(p.pick(&ask(), &[cand("a", 2), cand("b", 0)]), Some(1), "b has no decodes to delay");
        assert_eq!(p.pick(&ask(), &[]), None);
    }
}
