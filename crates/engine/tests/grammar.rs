//! Constrained decoding on the real model: JSON Schema and regex outputs match their
//! grammar; a constrained request samples the same tokens alone, batched, chunked,
//! preempted and prefilled on another engine; a request replayed with its tokens so far (a moved
//! request) continues the grammar; bad grammars and `logit_bias`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::batch::{Engine, EngineConfig, EngineError, SpecConfig, StepOutput};
use pdserve_engine::grammar::Grammars;
use pdserve_engine::loader::{self, LoadedModel};
use pdserve_types::{Grammar, GrammarSpec, RequestId, SamplingParams};
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| loader::load(&pdserve_engine::models::require_default_model()).unwrap())
}

fn grammars() -> Arc<Grammars> {
    static G: OnceLock<Arc<Grammars>> = OnceLock::new();
    G.get_or_init(|| Arc::new(Grammars::new(model().tokenizer.clone()).unwrap())).clone()
}

fn engine(max_batch_tokens: usize) -> Engine {
    engine_with(256, max_batch_tokens)
}

fn engine_with(num_blocks: usize, max_batch_tokens: usize) -> Engine {
    let m = model();
    let cfg = EngineConfig {
        threads: 1,
        num_blocks,
        max_batch_tokens,
        max_seqs: 16,
        cache_salt: 0,
        objectives: None,
        ..Default::default()
    };
    Engine::new(m.model.clone(), cfg, m.tokenizer.eog_ids().to_vec()).with_grammars(grammars())
}

fn chat(text: &str) -> Vec<u32> {
    let t = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
    model().tokenizer.encode(&t, true)
}

const PERSON: &str = r##"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer"},
    "role": {"$ref": "#/$defs/role"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}
  },
  "required": ["name", "age", "role", "tags"],
  "additionalProperties": false,
  "$defs": {"role": {"enum": ["admin", "user", "guest"]}}
}"##;

fn constrained(spec: GrammarSpec, max_tokens: u32, seed: Option<u64>) -> SamplingParams {
    SamplingParams {
        max_tokens,
        temperature: if seed.is_some() { 0.9 } else { 0.0 },
        seed,
        grammar: Some(Grammar::new(spec)),
        ..Default::default()
    }
    .validate()
    .unwrap()
}

/// Runs every request to the end on `e`; tokens by request.
fn run(e: &mut Engine, reqs: &[(u64, Vec<u32>, SamplingParams)]) -> BTreeMap<u64, Vec<u32>> {
    for (id, p, params) in reqs {
        e.add(RequestId(*id), p.clone(), params.clone()).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o.sampled.token);
        }
        steps += 1;
        assert!(steps < 5000, "no progress");
    }
    assert_eq!(e.stats().blocks.used, 0);
    out
}

fn text(tokens: &[u32]) -> String {
    let eog = model().tokenizer.eog_ids();
    let body: Vec<u32> = tokens.iter().copied().filter(|t| !eog.contains(t)).collect();
    model().tokenizer.decode(&body)
}

fn check_person(v: &Value) {
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(o.len(), 4, "{v}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 20), "{v}");
    assert!(o["age"].is_i64() || o["age"].is_u64(), "{v}");
    assert!(["admin", "user", "guest"].contains(&o["role"].as_str().unwrap()), "{v}");
    assert!(o["tags"].as_array().is_some_and(|a| a.len() <= 3 && a.iter().all(Value::is_string)), "{v}");
}

#[test]
fn json_schema_outputs_parse_and_match_greedy_and_sampled() {
    let prompt = chat("Describe a user of a web shop as JSON.");
    let spec = GrammarSpec::JsonSchema(PERSON.into());
    let reqs: Vec<_> = [None, Some(1), Some(2), Some(3)]
        .into_iter()
        .enumerate()
        .map(|(i, seed)| (i as u64, prompt.clone(), constrained(spec.clone(), 200, seed)))
        .collect();
    for (id, tokens) in run(&mut engine(512), &reqs) {
        let last = *tokens.last().unwrap();
        assert!(model().tokenizer.eog_ids().contains(&last), "request {id} did not finish its JSON: {}", text(&tokens));
        let v: Value = serde_json::from_str(&text(&tokens)).unwrap_or_else(|e| panic!("{e}: {}", text(&tokens)));
        check_person(&v);
    }
}

#[test]
fn speculation_drafts_what_the_grammar_forces_and_changes_no_token() {
    // The schema's keys and punctuation are forced: free drafts.
    let prompt = chat("Describe a user of a web shop as JSON.");
    let spec = GrammarSpec::JsonSchema(PERSON.into());
    let reqs: Vec<_> = [None, Some(1), Some(2)]
        .into_iter()
        .enumerate()
        .map(|(i, seed)| (i as u64, prompt.clone(), constrained(spec.clone(), 200, seed)))
        .collect();
    let want = run(&mut engine(512), &reqs);
    let mut e = engine(512);
    let cfg = EngineConfig {
        speculation: Some(SpecConfig { max_draft: 8, verify_all: true, draft: None }),
        ..e.config().clone()
    };
    e = Engine::new(model().model.clone(), cfg, model().tokenizer.eog_ids().to_vec()).with_grammars(grammars());
    assert_eq!(run(&mut e, &reqs), want);
    let spec = e.stats().spec;
    assert!(spec.accepted > 0, "{spec:?}");
}

#[test]
fn json_object_and_regex_outputs_match() {
    let reqs = vec![
        (
            1,
            chat("Give me a JSON object."),
            constrained(GrammarSpec::JsonSchema(r#"{"type":"object"}"#.into()), 120, None),
        ),
        (2, chat("Call me."), constrained(GrammarSpec::Regex(r"\(\d{3}\) \d{3}-\d{4}".into()), 40, None)),
        (3, chat("Pick one."), constrained(GrammarSpec::Lark(r#"start: "yes" | "no" | "maybe""#.into()), 10, Some(5))),
    ];
    let out = run(&mut engine(512), &reqs);
    let obj: Value = serde_json::from_str(&text(&out[&1])).unwrap_or_else(|e| panic!("{e}: {}", text(&out[&1])));
    assert!(obj.is_object());
    let phone = text(&out[&2]);
    let b = phone.as_bytes();
    assert_eq!(b.len(), 14, "{phone}");
    assert!(b[0] == b'(' && b[4] == b')' && b[5] == b' ' && b[9] == b'-', "{phone}");
    assert!(["yes", "no", "maybe"].contains(&text(&out[&3]).as_str()), "{}", text(&out[&3]));
}

#[test]
fn constrained_tokens_do_not_depend_on_batching_chunking_or_where_prefill_ran() {
    let prompt = chat("Describe a user of a web shop as JSON.");
    let spec = GrammarSpec::JsonSchema(PERSON.into());
    for seed in [None, Some(11)] {
        let params = constrained(spec.clone(), 80, seed);
        let alone = run(&mut engine(512), &[(1, prompt.clone(), params.clone())])[&1].clone();
        // Batched with others and chunked 16 tokens a step.
        let others: Vec<_> = (2..6)
            .map(|i| (i, chat(&format!("Say something about {i}.")), constrained(spec.clone(), 60, Some(i))))
            .collect();
        let mut reqs = vec![(1, prompt.clone(), params.clone())];
        reqs.extend(others);
        assert_eq!(run(&mut engine(16), &reqs)[&1], alone, "batched and chunked, seed {seed:?}");
        // Prefilled on P, decoded on D.
        let id = RequestId(9);
        let mut frames = Vec::new();
        let first = engine(512)
            .prefill_export(id, prompt.clone(), params.clone(), &mut |f| {
                frames.push(f);
                true
            })
            .unwrap();
        let mut d = engine(512);
        d.reserve_import(id, prompt.len()).unwrap();
        for f in &frames {
            d.import_frame(id, f).unwrap();
        }
        assert!(d.finish_import(id, prompt.clone(), first.sampled.token, params.clone()).unwrap());
        let mut tokens = vec![first.sampled.token];
        while d.has_work() {
            tokens.extend(d.step().iter().map(|o: &StepOutput| o.sampled.token));
        }
        assert_eq!(tokens, alone, "disaggregated, seed {seed:?}");
    }
}

#[test]
fn a_preempted_constrained_request_resumes_with_the_same_tokens() {
    // 12 blocks hold 192 tokens; two requests of about 30 + 100 tokens need 17.
    let long = r#"{"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}"#;
    let reqs: Vec<_> = ["List words.", "List more words."]
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut params = constrained(GrammarSpec::JsonSchema(long.into()), 100, Some(i as u64));
            params.ignore_eos = true;
            (i as u64 + 1, chat(p), params)
        })
        .collect();
    let mut e = engine_with(12, 256);
    for (id, p, params) in &reqs {
        e.add(RequestId(*id), p.clone(), params.clone()).unwrap();
    }
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut preempted = false;
    while e.has_work() {
        for o in e.step() {
            out.entry(o.id.0).or_default().push(o.sampled.token);
        }
        preempted |= out.len() == 2 && e.stats().waiting == 1;
    }
    assert!(preempted, "the small cache never preempted a sequence");
    for (id, p, params) in &reqs {
        let alone = run(&mut engine(512), &[(*id, p.clone(), params.clone())]);
        assert_eq!(out[id], alone[id], "request {id}");
        assert!(text(&out[id]).starts_with("[\""), "{}", text(&out[id]));
    }
}

#[test]
fn a_replayed_request_continues_its_grammar() {
    let prompt = chat("Describe a user of a web shop as JSON.");
    let params = constrained(GrammarSpec::JsonSchema(PERSON.into()), 120, None);
    let whole = run(&mut engine(512), &[(1, prompt.clone(), params.clone())])[&1].clone();
    // Moved after 10 tokens: the prompt carries them, the grammar replays them.
    let mut moved = params.clone();
    moved.max_tokens -= 10;
    moved.grammar.as_mut().unwrap().replayed = 10;
    let longer = [prompt.clone(), whole[..10].to_vec()].concat();
    let rest = run(&mut engine(512), &[(2, longer, moved)])[&2].clone();
    assert_eq!([&whole[..10], &rest[..]].concat(), whole);
}

#[test]
fn bad_grammars_are_refused_without_side_effects() {
    let mut e = engine(512);
    for spec in [
        GrammarSpec::JsonSchema("{not json".into()),
        GrammarSpec::JsonSchema(r#"{"type": "frobnicate"}"#.into()),
        GrammarSpec::Regex("(unclosed".into()),
        GrammarSpec::Lark("start: undefined_rule".into()),
    ] {
        let r = e.add(RequestId(1), chat("x"), constrained(spec.clone(), 10, None));
        assert!(matches!(r, Err(EngineError::Grammar(_))), "{spec:?}: {r:?}");
        assert!(!e.has_work());
    }
    // An engine without grammar support refuses constrained requests.
    let m = model();
    let mut plain = Engine::new(m.model.clone(), EngineConfig::default(), m.tokenizer.eog_ids().to_vec());
    let err = plain.add(RequestId(1), chat("x"), constrained(GrammarSpec::Regex("a".into()), 5, None)).unwrap_err();
    assert!(matches!(err, EngineError::Grammar(_)));
}

#[test]
fn logit_bias_moves_the_choice() {
    let prompt = chat("Hello!");
    let greedy = SamplingParams { max_tokens: 4, ..Default::default() }.validate().unwrap();
    let base = run(&mut engine(512), &[(1, prompt.clone(), greedy.clone())])[&1].clone();
    // -100 on the greedy first token: another one comes first.
    let banned = SamplingParams { logit_bias: vec![(base[0], -100.0)], ..greedy.clone() }.validate().unwrap();
    assert_ne!(run(&mut engine(512), &[(1, prompt.clone(), banned)])[&1][0], base[0]);
    // +100 on a token: it is chosen every step.
    let forced = model().tokenizer.encode(" banana", false)[0];
    let pushed = SamplingParams { logit_bias: vec![(forced, 100.0)], ..greedy }.validate().unwrap();
    assert_eq!(run(&mut engine(512), &[(1, prompt, pushed)])[&1], vec![forced; 4]);
}

/// Chains of `$ref`s and of rules long enough to overflow a thread's stack inside
/// the grammar compiler (a probe killed the server with 635) are refused by name,
/// from the validating thread and the compile thread alike, and the process lives.
#[test]
fn grammars_chained_too_deep_are_refused_without_overflowing() {
    let n = 1000;
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(format!("d{i}"), serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert(format!("d{n}"), serde_json::json!({"type": "string"}));
    let schema = serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string();
    let mut lark = String::from("start: r0\n");
    for i in 0..n {
        lark += &format!("r{i}: r{} | \"x\"\n", i + 1);
    }
    lark += &format!("r{n}: \"y\"\n");
    for spec in [GrammarSpec::JsonSchema(schema), GrammarSpec::Lark(lark)] {
        let e = grammars().check(&Grammar::new(spec.clone())).unwrap_err().to_string();
        assert!(e.contains("references deep"), "{e}");
        let mut eng = engine(64);
        let err = eng.add(RequestId(1), chat("Hi"), constrained(spec, 4, None)).unwrap_err();
        assert!(matches!(err, EngineError::Grammar(_)), "{err:?}");
    }
}

/// A grammar compiled once serves every later constraint: after `prepare` (the
/// compile thread), the engine only copies the start state.
#[test]
fn a_prepared_grammar_is_kept_for_the_engines() {
    let spec = GrammarSpec::Regex("(yes|no)-[0-9]{3}".into());
    assert!(!grammars().is_compiled(&spec));
    grammars().prepare(&spec).unwrap();
    assert!(grammars().is_compiled(&spec));
    let mut e = engine(64);
    let reqs: Vec<_> = (0..4).map(|i| (i, chat("Answer."), constrained(spec.clone(), 8, Some(i)))).collect();
    for toks in run(&mut e, &reqs).values() {
        let text = model().tokenizer.decode(toks);
        let text = text.trim_end_matches("<|im_end|>");
        let digits = text.strip_prefix("yes-").or(text.strip_prefix("no-")).unwrap_or_default();
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    }
}

/// A grammar whose mask fails mid-output (3,000 alternatives sharing a prefix: too
/// many items in a row after it) ends its request with an error, never with a
/// partial answer reported as a normal stop.
#[test]
fn an_output_that_breaks_its_grammar_ends_in_an_error() {
    let alts: Vec<String> = (0..3000).map(|i| format!("\"c{i}\"")).collect();
    let spec = GrammarSpec::Lark(format!("start: {}", alts.join(" | ")));
    let mut e = engine(64);
    e.add(RequestId(7), chat("Pick one."), constrained(spec, 8, None)).unwrap();
    let mut last: Option<StepOutput> = None;
    while e.has_work() {
        last = e.step().into_iter().last().or(last);
    }
    let last = last.expect("no token");
    assert!(last.finish.is_some());
    let why = last.broken.expect("the broken grammar was reported as a normal stop");
    assert!(!why.is_empty());
    assert_eq!(e.stats().blocks.used, 0);
}

/// Grammars whose bytes are forced without end (a rule that can only recurse behind
/// a long lexeme; a schema whose required property holds the schema itself under a
/// long name) took llguidance seconds to minutes a step, on the engine's thread. A
/// step is held to `STEP_BUDGET`: one whose first step runs past it is refused as it
/// compiles, and one that turns slow after its first token ends its output in an
/// error.
#[test]
fn a_grammar_step_past_its_budget_is_cancelled() {
    let key = "k".repeat(10_000);
    let schema = serde_json::json!({"type": "object", "properties": {key.clone(): {"$ref": "#"}},
                                    "required": [key], "additionalProperties": false});
    let slow_at_once =
        [GrammarSpec::Lark("start: r0\nr0: /r{10000}/ r0".into()), GrammarSpec::JsonSchema(schema.to_string())];
    for spec in slow_at_once {
        let e = grammars().check(&Grammar::new(spec)).unwrap_err().to_string();
        assert!(e.contains("too complex"), "{e}");
    }
    let spec = GrammarSpec::Lark("start: (\"a\" | \"b\") r0\nr0: /r{10000}/ r0".into());
    grammars().check(&Grammar::new(spec.clone())).unwrap();
    let mut e = engine(64);
    e.add(RequestId(9), chat("Go."), constrained(spec, 8, None)).unwrap();
    let mut last: Option<StepOutput> = None;
    while e.has_work() {
        last = e.step().into_iter().last().or(last);
    }
    let why = last.expect("no token").broken.expect("the slow grammar was reported as a normal stop");
    assert!(why.contains("too complex"), "{why}");
    assert_eq!(e.stats().blocks.used, 0);
}
