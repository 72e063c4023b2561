//! Seeded random input to everything that reads what the fleet puts on NATS: plans,
//! node records, KV-event batches and traffic batches as their readers open them
//! (`seal::open_as`, the one path the bucket's followers and the core-NATS
//! subscribers take), and River and Wind messages as the ingress parses them.
//!
//! Random bytes, random JSON, and JSON shaped like each value with fields dropped,
//! retyped or pushed to their edges never panic; nothing unsealed, sealed under
//! another key or for another kind of value opens; every valid value sealed under
//! the key opens to itself, and no truncation or bit flip of it opens at all. The
//! draws are seeded, so a failure names its input and recurs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_fleet::forest::{self, Leaf};
use pdserve_fleet::{seal, Endpoints, KvBatch, KvCache, LinkRecord, Load, NodeId, NodeRecord, Plan, TrafficBatch};
use pdserve_kv_transfer::ClusterKey;
use pdserve_types::rng::Rng;
use pdserve_types::{Assignment, Epoch, RequestSample, Role};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Debug;

/// Valid values drawn per kind, each sealed and then tampered with.
const VALID: usize = 200;
/// Random inputs drawn per kind.
const RANDOM: usize = 600;

struct Draws(Rng);

impl Draws {
    fn below(&mut self, n: usize) -> usize {
        self.0.range(0, n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }

    fn u64(&mut self) -> u64 {
        match self.below(4) {
            0 => self.pick(&[0, 1, u64::MAX, u64::MAX - 1, 1 << 53, u32::MAX as u64]),
            1 => self.0.next_u64(),
            _ => self.below(100_000) as u64,
        }
    }

    fn usize(&mut self) -> usize {
        self.u64() as usize
    }

    /// A value JSON carries exactly (serde_json parses a short decimal exactly; NaN and
    /// the infinities are not JSON at all), so a valid value round-trips bit for bit.
    fn f64(&mut self) -> f64 {
        match self.below(4) {
            0 => self.pick(&[0.0, 0.5, 1e-3, 1e20, 123_456.75]),
            _ => self.below(1 << 20) as f64 / 1024.0,
        }
    }

    fn text(&mut self) -> String {
        match self.below(6) {
            0 => String::new(),
            1 => self.pick(&["é𝄞\u{202e}", "\u{0}", "\"\\", "nodes.>", "$KV.INFER_LOAD.planner", "\n"]).to_string(),
            2 => "x".repeat(self.below(5000)),
            _ => (0..self.below(20)).map(|_| char::from(b' ' + self.below(95) as u8)).collect(),
        }
    }

    fn node_id(&mut self) -> NodeId {
        const OK: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_";
        let n = 1 + self.below(64);
        let id: String = (0..n).map(|_| char::from(OK[self.below(OK.len())])).collect();
        id.parse().unwrap()
    }

    fn role(&mut self) -> Role {
        self.pick(&[Role::Prefill, Role::Decode, Role::Mixed])
    }

    fn addr(&mut self) -> std::net::SocketAddr {
        let port = self.below(65_536) as u16;
        match self.chance(50) {
            true => (std::net::Ipv4Addr::from(self.0.next_u64() as u32), port).into(),
            false => {
                (std::net::Ipv6Addr::from(((self.0.next_u64() as u128) << 64) | self.0.next_u64() as u128), port).into()
            }
        }
    }

    fn record(&mut self) -> NodeRecord {
        NodeRecord {
            node_id: self.node_id(),
            name: self.text(),
            model: self.text(),
            role: self.role(),
            epoch: Epoch(self.u64()),
            protocol: self.u64() as u32,
            endpoints: Endpoints { control: self.addr(), kv: self.addr() },
            threads: self.usize(),
            kv_cache: KvCache {
                block_size: self.usize(),
                blocks_total: self.usize(),
                blocks_free: self.usize(),
                blocks_used: self.usize(),
                blocks_cached: self.usize(),
                dtype: pdserve_types::KvDtype::ALL[self.usize() % 3],
                bytes_per_token: self.u64(),
            },
            load: Load {
                queued_prompt_tokens: self.usize(),
                waiting: self.usize(),
                running: self.usize(),
                importing: self.usize(),
            },
            links: (0..self.below(4))
                .map(|_| LinkRecord {
                    to: self.node_id(),
                    transport: self.text(),
                    gb_per_s: self.f64(),
                    latency_ms: self.f64(),
                    measured_unix_ms: self.u64(),
                })
                .collect(),
            memory_available: self.u64(),
            updated_unix_ms: self.u64(),
        }
    }

    fn plan(&mut self) -> Plan {
        let n = self.below(8);
        let roles = (0..n).map(|_| (self.node_id(), Assignment::new(self.role(), Epoch(self.u64())))).collect();
        Plan { holder: self.text(), roles, updated_unix_ms: self.u64() }
    }

    fn kv_batch(&mut self) -> KvBatch {
        let tier = |d: &mut Draws| d.pick(&["device", "host", "disk"]);
        let snapshot = match self.chance(30) {
            true => json!((0..self.below(6)).map(|_| json!([self.u64(), tier(self)])).collect::<Vec<_>>()),
            false => Value::Null,
        };
        let events: Vec<Value> = (0..self.below(8))
            .map(|_| {
                let event = match self.chance(50) {
                    true => {
                        let parent = if self.chance(30) { Value::Null } else { json!(self.u64()) };
                        json!({"Stored": {"hash": self.u64(), "parent": parent, "tier": tier(self)}})
                    }
                    false => json!({"Removed": {"hash": self.u64(), "tier": tier(self)}}),
                };
                json!([event, self.below(1 << 14) as f32 / 1024.0])
            })
            .collect();
        let cursor = |d: &mut Draws| json!({"instance": d.u64(), "seq": d.u64()});
        let v = json!({"worker": self.text(), "from": cursor(self),
                       "events": {"snapshot": snapshot, "events": events, "cursor": cursor(self)}});
        serde_json::from_value(v).unwrap()
    }

    fn traffic(&mut self) -> TrafficBatch {
        let samples = (0..self.below(10))
            .map(|_| match self.chance(50) {
                true => RequestSample::Arrived { prompt: self.usize(), max_tokens: self.usize() },
                false => RequestSample::Ended {
                    out: self.usize(),
                    max_tokens: self.usize(),
                    ttft: self.chance(70).then(|| self.f64()),
                    tpot: self.chance(50).then(|| self.f64()),
                    failed: self.chance(10),
                },
            })
            .collect();
        let prefill_pace: BTreeMap<String, f64> = (0..self.below(4)).map(|_| (self.text(), self.f64())).collect();
        TrafficBatch { frontend: self.text(), model: self.text(), samples, prefill_pace }
    }

    /// Any JSON value, nested at most `depth` more levels.
    fn any(&mut self, depth: usize) -> Value {
        match self.below(if depth == 0 { 7 } else { 10 }) {
            0 => Value::Null,
            1 => json!(self.chance(50)),
            2 => json!(self.u64()),
            3 => json!(self.pick(&[-1i64, i64::MIN, -0])),
            4 => json!(self.pick(&[1e300, -1e300, f64::MAX, 1e-300, 0.1, -0.0, 2.5])),
            5 => json!(self.text()),
            6 => json!(self.pick(&["prefill", "decode", "mixed", "device", "Stored", "Removed", "arrived", "ended"])),
            7 | 8 => Value::Array((0..self.below(5)).map(|_| self.any(depth - 1)).collect()),
            _ => {
                let keys = ["node_id", "role", "epoch", "roles", "holder", "events", "samples", "kind", "hash", "a"];
                let m: Map<String, Value> =
                    (0..self.below(5)).map(|_| (self.pick(&keys).to_string(), self.any(depth - 1))).collect();
                Value::Object(m)
            }
        }
    }

    /// `v` with a few changes somewhere inside: a field dropped, retyped, added.
    fn mutate(&mut self, mut v: Value) -> Value {
        for _ in 0..1 + self.below(3) {
            let replacement = self.any(2);
            let target = self.walk(&mut v);
            match target {
                Value::Object(o) if !o.is_empty() && self.chance(30) => {
                    let k = o.keys().nth(self.below(o.len())).unwrap().clone();
                    o.remove(&k);
                }
                Value::Object(o) if self.chance(20) => {
                    o.insert(self.text(), replacement);
                }
                Value::Array(a) if !a.is_empty() && self.chance(30) => {
                    let i = self.below(a.len());
                    a.remove(i);
                }
                other => *other = replacement,
            }
        }
        v
    }

    /// A random place inside `v`.
    fn walk<'a>(&mut self, v: &'a mut Value) -> &'a mut Value {
        let mut path = Vec::new();
        let mut at: &Value = v;
        loop {
            let len = match at {
                Value::Object(o) => o.len(),
                Value::Array(a) => a.len(),
                _ => 0,
            };
            if len == 0 || self.chance(30) {
                break;
            }
            let i = self.below(len);
            path.push(i);
            at = match at {
                Value::Object(o) => o.values().nth(i).unwrap(),
                Value::Array(a) => &a[i],
                _ => unreachable!("a value with children"),
            };
        }
        let mut at = v;
        for i in path {
            at = match at {
                Value::Object(o) => o.values_mut().nth(i).unwrap(),
                Value::Array(a) => &mut a[i],
                _ => unreachable!("the path was drawn from this value"),
            };
        }
        at
    }

    /// Bytes that may or may not be JSON.
    fn bytes(&mut self, shaped: &[u8]) -> Vec<u8> {
        match self.below(5) {
            0 => (0..self.below(300)).map(|_| self.0.next_u64() as u8).collect(),
            1 => {
                let depth = 100 + self.below(300);
                format!("{}{}", "[".repeat(depth), "]".repeat(depth)).into_bytes()
            }
            2 => serde_json::to_vec(&self.any(4)).unwrap(),
            _ => {
                let mut b = shaped.to_vec();
                for _ in 0..1 + self.below(4) {
                    if b.is_empty() {
                        break;
                    }
                    let i = self.below(b.len());
                    match self.below(3) {
                        0 => b[i] ^= 1 << self.below(8),
                        1 => b.truncate(i),
                        _ => b[i] = self.0.next_u64() as u8,
                    }
                }
                b
            }
        }
    }

    // ---- River messages and Wind Leaves ----

    /// A `nimsforest` extension object: each field now and then, some in the form the
    /// ingress reads (reply subjects allowed and reserved), the others any value.
    fn nimsforest(&mut self, case: usize) -> Map<String, Value> {
        let mut ext = Map::new();
        for k in ["request_id", "reply_to", "priority", "deadline_ms", "context"] {
            if self.chance(50) {
                let v = match (k, self.below(3)) {
                    ("request_id", 0) => json!(format!("r-{case}")),
                    ("reply_to", 0) => json!(self.pick(&[
                        "infer.result.x",
                        "forest.replies.y",
                        "$KV.INFER_LOAD.planner",
                        "pdserve.traffic",
                        "elsewhere",
                        ""
                    ])),
                    _ => self.any(2),
                };
                ext.insert(k.to_string(), v);
            }
        }
        ext
    }

    /// A completion or chat request body (or any value), most carrying `ext`, some
    /// mutated.
    fn request_body(&mut self, ext: &Map<String, Value>) -> Value {
        let mut body = match self.below(3) {
            0 => json!({"prompt": self.any(1)}),
            1 => json!({"messages": [{"role": "user", "content": self.any(1)}]}),
            _ => self.any(3),
        };
        if let (Some(o), true) = (body.as_object_mut(), self.chance(70)) {
            o.insert("nimsforest".into(), Value::Object(ext.clone()));
        }
        if self.chance(20) {
            self.mutate(body)
        } else {
            body
        }
    }

    /// The River message's bytes: `body` bare, with headers, or base64 in an envelope;
    /// now and then broken.
    fn river_input(&mut self, ext: &Map<String, Value>, body: &Value) -> Vec<u8> {
        use base64::Engine as _;
        let payload = match self.below(3) {
            0 => body.clone(),
            1 => json!({"headers": {"X-Request-Id": ext.get("request_id").cloned().unwrap_or(Value::Null)},
                        "body": body.clone()}),
            _ => json!({"subject": "river.infer.requests", "ts": "2026-01-15T12:00:00Z",
                        "data": base64::engine::general_purpose::STANDARD.encode(body.to_string())}),
        };
        let bytes = serde_json::to_vec(&payload).unwrap();
        if self.chance(70) {
            bytes
        } else {
            self.bytes(&bytes)
        }
    }
}

/// One kind of sealed value: its label and how to draw a valid one.
struct Kind<T> {
    name: &'static str,
    label: &'static [u8],
    draw: fn(&mut Draws) -> T,
}

const LABELS: [&[u8]; 4] = [seal::PLAN, seal::NODE, seal::KV_EVENTS, seal::TRAFFIC];

fn sealed_values_open_only_whole_and_under_their_key<T>(kind: Kind<T>, seed: u64)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let mut d = Draws(Rng::new(seed));
    let (key, other) = (ClusterKey::random(), ClusterKey::random());
    let open = |k: &ClusterKey, label: &[u8], b: &[u8]| seal::open_as::<T>(Some(k), label, b);
    for case in 0..VALID {
        let value = (kind.draw)(&mut d);
        let body = serde_json::to_vec(&value).unwrap();
        let sealed = seal::seal(&key, kind.label, &body);
        let ctx = || format!("{} case {case}: {}", kind.name, String::from_utf8_lossy(&sealed));
        assert_eq!(open(&key, kind.label, &sealed).unwrap_or_else(|e| panic!("{e}: {}", ctx())), value);
        assert_eq!(seal::open_as::<T>(None, kind.label, &sealed).unwrap(), value, "{}", ctx());
        assert!(open(&other, kind.label, &sealed).is_err(), "another key opened {}", ctx());
        assert!(open(&ClusterKey::insecure(), kind.label, &sealed).is_err(), "the insecure key opened {}", ctx());
        for label in LABELS.iter().filter(|l| **l != kind.label) {
            assert!(open(&key, label, &sealed).is_err(), "another label opened {}", ctx());
        }
        assert!(open(&key, kind.label, &body).is_err(), "the bare body opened: {}", ctx());
        for _ in 0..8 {
            let cut = d.below(sealed.len());
            assert!(open(&key, kind.label, &sealed[..cut]).is_err(), "cut at {cut}: {}", ctx());
            let mut flipped = sealed.clone();
            let (i, bit) = (d.below(sealed.len()), d.below(8));
            flipped[i] ^= 1 << bit;
            assert!(open(&key, kind.label, &flipped).is_err(), "bit {bit} of byte {i} flipped: {}", ctx());
        }
    }
}

fn random_input_never_opens_unsealed_nor_panics<T>(kind: Kind<T>, seed: u64)
where
    T: Serialize + DeserializeOwned,
{
    let mut d = Draws(Rng::new(seed));
    let (key, other) = (ClusterKey::random(), ClusterKey::random());
    let mut opened = 0;
    for case in 0..RANDOM {
        let shaped = serde_json::to_value((kind.draw)(&mut d)).unwrap();
        let shaped = serde_json::to_vec(&d.mutate(shaped)).unwrap();
        let input = if d.chance(50) { shaped } else { d.bytes(&shaped) };
        let ctx = || format!("{} case {case}: {}", kind.name, String::from_utf8_lossy(&input));
        // As it came: not sealed, so nothing opens it; a tool that only shows may read it.
        for label in LABELS {
            assert!(seal::open_as::<T>(Some(&key), label, &input).is_err(), "unsealed input opened: {}", ctx());
            let _ = seal::open_as::<T>(None, label, &input);
        }
        // Sealed: under the key it opens if it parses, under another it never does.
        let sealed = seal::seal(&key, kind.label, &input);
        opened += usize::from(seal::open_as::<T>(Some(&key), kind.label, &sealed).is_ok());
        assert!(seal::open_as::<T>(Some(&other), kind.label, &sealed).is_err(), "{}", ctx());
        let _ = NodeRecord::decode(&input);
        let _ = seal::peek(&input);
    }
    eprintln!("{}: {opened} of {RANDOM} sealed inputs parsed", kind.name);
    // The mutations keep some values valid, so both branches run.
    assert!(opened > 0 && opened < RANDOM, "{}: {opened} of {RANDOM} opened", kind.name);
}

fn plans() -> Kind<Plan> {
    Kind { name: "plan", label: seal::PLAN, draw: Draws::plan }
}

fn records() -> Kind<NodeRecord> {
    Kind { name: "node record", label: seal::NODE, draw: Draws::record }
}

fn kv_batches() -> Kind<KvBatch> {
    Kind { name: "KV batch", label: seal::KV_EVENTS, draw: Draws::kv_batch }
}

fn traffic() -> Kind<TrafficBatch> {
    Kind { name: "traffic batch", label: seal::TRAFFIC, draw: Draws::traffic }
}

#[test]
fn sealed_plans_records_and_batches_open_only_whole_and_under_their_key() {
    sealed_values_open_only_whole_and_under_their_key(plans(), 0x9a1a_0001);
    sealed_values_open_only_whole_and_under_their_key(records(), 0x9a1a_0002);
    sealed_values_open_only_whole_and_under_their_key(kv_batches(), 0x9a1a_0003);
    sealed_values_open_only_whole_and_under_their_key(traffic(), 0x9a1a_0004);
}

#[test]
fn random_plans_records_and_batches_never_panic_and_never_open_unsealed() {
    random_input_never_opens_unsealed_nor_panics(plans(), 0x7a4d_0001);
    random_input_never_opens_unsealed_nor_panics(records(), 0x7a4d_0002);
    random_input_never_opens_unsealed_nor_panics(kv_batches(), 0x7a4d_0003);
    random_input_never_opens_unsealed_nor_panics(traffic(), 0x7a4d_0004);
}

/// River messages and Wind Leaves, drawn around the forms the ingress reads: what
/// parses is a request whose id is a subject token and whose reply subject is one
/// this frontend answers on, never a reserved one.
#[test]
fn random_river_and_wind_messages_never_panic_and_reply_only_where_allowed() {
    let mut d = Draws(Rng::new(0x41_7e_a5));
    let replies = vec![forest::DEFAULT_REPLY_PREFIX.to_string(), "forest.replies.".to_string()];
    let mut parsed = 0;
    const CASES: usize = 2000;
    for case in 0..CASES {
        let ext = d.nimsforest(case);
        let body = d.request_body(&ext);
        let input = d.river_input(&ext, &body);
        let ctx = || format!("case {case}: {}", String::from_utf8_lossy(&input));
        let mut check = |r: Result<forest::ForestRequest, forest::Unusable>| match r {
            Ok(req) => {
                parsed += 1;
                assert!(forest::reply_allowed(&req.reply_to, &replies), "replies on {}: {}", req.reply_to, ctx());
                let id_ok = req.request_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                assert!(id_ok && !req.request_id.is_empty() && req.request_id.len() <= 128, "{}", ctx());
            }
            Err(u) => assert!(!u.reason.is_empty(), "{}", ctx()),
        };
        check(forest::parse_river(&input, &replies));
        let leaf = Leaf::new("infer.request.submit", "forest:test", body);
        if let Ok(leaf) = Leaf::parse(&leaf.to_bytes(), "infer.request.submit") {
            check(forest::parse_submit(&leaf, &replies));
        }
        let _ = Leaf::parse(&input, "infer.request.submit");
    }
    eprintln!("{parsed} requests parsed from {CASES} River messages and their Wind Leaves");
    assert!(parsed > CASES / 10 && parsed < 2 * CASES, "{parsed} parsed");
}
