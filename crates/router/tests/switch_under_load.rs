//! Roles switched back and forth on the real model while greedy requests run: every
//! request ends whole, with the tokens of an uninterrupted single-worker run, none
//! fails because of a switch, and no KV block is left used.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{collect, request, worker, PROMPTS};
use pdserve_protocol::{Event, Generate};
use pdserve_router::{Deadlines, Migrating, Mode, Router};
use pdserve_types::Role;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switching_roles_under_load_loses_and_changes_nothing() {
    let reference = Router::new([worker("ref", Role::Mixed)], Mode::Aggregated, Deadlines::default(), common::rt());
    let mut want = Vec::new();
    for (i, p) in PROMPTS.iter().enumerate() {
        want.push(collect(reference.generate(request(i as u64, p, 32)).unwrap()).await.0);
    }
    let workers = [worker("w0", Role::Mixed), worker("w1", Role::Mixed)];
    let router = Arc::new(Router::new(workers, Mode::Auto, Deadlines::default(), common::rt()));
    let front = Arc::new(Migrating::new(router.clone(), 1));
    // Flip between two mixed workers and a prefill/decode split every 40 ms, while
    // 24 requests (8 of each prompt, 4 at a time) run.
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let (router, stop) = (router.clone(), stop.clone());
        tokio::spawn(async move {
            let mut switches = 0;
            let plans = [[Role::Prefill, Role::Decode], [Role::Mixed, Role::Mixed], [Role::Decode, Role::Prefill]];
            for plan in plans.iter().cycle() {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                for (e, role) in router.workers().snapshot().iter().zip(plan) {
                    if e.role() != *role {
                        router.switch_role(e, *role).await.unwrap();
                        switches += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            switches
        })
    };
    for round in 0..6u64 {
        let runs: Vec<_> = (0..4u64)
            .map(|k| {
                let i = ((round * 4 + k) % PROMPTS.len() as u64) as usize;
                let front = front.clone();
                tokio::spawn(async move {
                    let s = front.generate(request(1000 + round * 4 + k, PROMPTS[i], 32)).unwrap();
                    (i, collect(s).await)
                })
            })
            .collect();
        for r in runs {
            let (i, (tokens, end)) = r.await.unwrap();
            assert!(matches!(end, Event::Done { .. }), "prompt {i} ended with {end:?}");
            assert_eq!(tokens, want[i], "prompt {i}: the uninterrupted greedy tokens");
        }
    }
    stop.store(true, Ordering::SeqCst);
    let switches = flipper.await.unwrap();
    assert!(switches >= 6, "the roles changed under the load ({switches} switches)");
    for e in router.workers().snapshot() {
        let mut used = usize::MAX;
        for _ in 0..200 {
            used = e.worker.stats().await.unwrap().blocks.used;
            if used == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(used, 0, "{} keeps no block", e.name());
    }
}
