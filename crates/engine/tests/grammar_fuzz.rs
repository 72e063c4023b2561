//! Seeded random grammars against the real model's vocabulary, through what a
//! request's grammar goes through: [`Grammars::prepare`] (the source bounds, then the
//! compile thread) and, for what compiles, a constraint's first masks and tokens.
//!
//! JSON schemas (nested objects and arrays, `$ref`s, `anyOf`/`oneOf`/`allOf`,
//! enums, patterns, formats), regular expressions, Lark grammars and
//! `guided_choice` lists are drawn at random depths and sizes, some past the bounds
//! (`$ref` and rule chains past 128 links, sources past 64 KiB, nesting thousands
//! deep) and some not grammars at all. Each one compiles or is refused with a
//! message; nothing panics, on any thread, or aborts the process; a token the mask
//! allows is taken. The draws are seeded, so a failure names its grammar and recurs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use pdserve_engine::grammar::{Constraint, GrammarError, Grammars, MaskClock};
use pdserve_engine::loader;
use pdserve_types::rng::Rng;
use pdserve_types::{Grammar, GrammarSpec};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Grammars drawn per kind.
const CASES: usize = 150;
/// Steps taken through each grammar that compiles.
const STEPS: usize = 4;
/// A case still running after this is a hang: the watchdog names it and fails the test.
const HANG: Duration = Duration::from_secs(120);

struct Draws(Rng);

/// Draws one grammar of a kind.
type Draw = fn(&mut Draws) -> GrammarSpec;

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

    /// A count, now and then far past anything sensible.
    fn count(&mut self) -> u64 {
        match self.below(8) {
            0 => self.pick(&[0, 1_000, 100_000, u32::MAX as u64, u64::MAX]),
            _ => self.below(12) as u64,
        }
    }

    fn text(&mut self) -> String {
        match self.below(8) {
            0 => String::new(),
            1 => self.pick(&["\"", "\\", "é𝄞\u{202e}", "\u{0}", "\n", "a|b", "(", "/", "%json", "{\"a\":"]).to_string(),
            2 => "ab".repeat(self.below(200)),
            _ => (0..1 + self.below(12)).map(|_| char::from(b' ' + self.below(95) as u8)).collect(),
        }
    }

    fn scalar(&mut self) -> Value {
        match self.below(5) {
            0 => Value::Null,
            1 => json!(self.chance(50)),
            2 => json!(self.pick(&[0i64, -1, 7, i64::MAX, i64::MIN])),
            3 => json!(self.pick(&[0.5f64, -1e300, 1e-300])),
            _ => json!(self.text()),
        }
    }

    // ---- JSON schemas ----

    fn json_schema(&mut self) -> String {
        let root = match self.below(10) {
            0 => self.ref_chain(),
            1 => {
                // Nesting past serde's recursion limit, now and then.
                let mut s = json!({"type": "string"});
                for _ in 0..self.pick(&[10, 60, 100, 200]) {
                    s = json!({"type": "array", "items": s});
                }
                s
            }
            2 => {
                // Wide: past the size bound, now and then.
                let n = self.pick(&[10, 300, 3000]);
                let props: Map<String, Value> = (0..n).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
                json!({"type": "object", "properties": props, "required": ["p0"]})
            }
            3 => return self.text(), // not a schema at all
            _ => {
                let defs = self.below(6);
                let depth = 1 + self.below(6);
                let mut root = self.schema(depth, defs);
                if defs > 0 {
                    let d: Map<String, Value> = (0..defs).map(|i| (format!("d{i}"), self.schema(3, defs))).collect();
                    if let Value::Object(o) = &mut root {
                        o.insert("$defs".into(), Value::Object(d));
                    } else {
                        root = json!({"anyOf": [root], "$defs": d});
                    }
                }
                root
            }
        };
        root.to_string()
    }

    /// A chain of `$ref`s, at, under and past the bound; it may end in a schema, a
    /// missing definition, or loop back on itself.
    fn ref_chain(&mut self) -> Value {
        let n = self.pick(&[2, 50, 127, 128, 129, 300, 1000, 2000]);
        let mut defs: Map<String, Value> =
            (0..n).map(|i| (format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}))).collect();
        let end = match self.below(4) {
            0 => json!({"$ref": "#/$defs/d0"}),
            1 => json!({"type": "object", "properties": {"next": {"$ref": "#/$defs/d0"}}}),
            2 => json!({"$ref": "#/$defs/missing"}),
            _ => json!({"type": "string", "maxLength": 5}),
        };
        defs.insert(format!("d{n}"), end);
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    }

    fn schema(&mut self, depth: usize, defs: usize) -> Value {
        let choice = if depth == 0 { self.below(4) } else { self.below(13) };
        let mut s = match choice {
            0 => self.string_schema(),
            1 => self.number_schema(),
            2 => json!({"type": self.pick(&["boolean", "null", "nonsense"])}),
            3 => {
                let n = self.below(5);
                json!({"enum": (0..n).map(|_| self.scalar()).collect::<Vec<_>>()})
            }
            4 | 5 => self.object_schema(depth, defs),
            6 | 7 => self.array_schema(depth, defs),
            8 => {
                let k = self.pick(&["anyOf", "oneOf", "allOf"]);
                let n = self.below(4);
                json!({k: (0..n).map(|_| self.schema(depth - 1, defs)).collect::<Vec<_>>()})
            }
            9 => json!({"$ref": format!("#/$defs/d{}", self.below(defs + 2))}),
            10 => json!({"const": self.scalar()}),
            11 => json!({"type": ["string", "null"], "not": self.schema(depth - 1, defs)}),
            _ => self.pick(&[json!(true), json!(false), json!(42), json!("x"), json!([]), json!({"$ref": 5})]),
        };
        if self.chance(5) {
            if let Value::Object(o) = &mut s {
                o.insert(self.text(), self.scalar());
            }
        }
        s
    }

    /// A string schema, with length bounds, a pattern or a format now and then.
    fn string_schema(&mut self) -> Value {
        let mut s = json!({"type": "string"});
        if self.chance(30) {
            s["minLength"] = json!(self.count());
        }
        if self.chance(30) {
            s["maxLength"] = json!(self.count());
        }
        if self.chance(25) {
            s["pattern"] = json!(self.regex(3));
        }
        if self.chance(15) {
            s["format"] = json!(self.pick(&["date-time", "email", "uuid", "date", "ipv4", "no-such-format"]));
        }
        s
    }

    /// An integer or number schema, with bounds (some absurd) now and then.
    fn number_schema(&mut self) -> Value {
        let mut s = json!({"type": self.pick(&["integer", "number"])});
        for k in ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"] {
            if self.chance(20) {
                s[k] = self.pick(&[json!(0), json!(-5), json!(10), json!(0.5), json!(1e300), json!(-1)]);
            }
        }
        s
    }

    /// An object of drawn properties, some required (now and then one that is not a
    /// property), and any, no or drawn additional properties.
    fn object_schema(&mut self, depth: usize, defs: usize) -> Value {
        let n = self.below(5);
        let props: Map<String, Value> =
            (0..n).map(|i| (format!("{}{i}", self.text()), self.schema(depth - 1, defs))).collect();
        let mut required: Vec<Value> = props.keys().filter(|_| self.chance(50)).map(|k| json!(k)).collect();
        if self.chance(10) {
            required.push(json!("not-a-property"));
        }
        let extra = match self.below(3) {
            0 => json!(false),
            1 => json!(true),
            _ => self.schema(depth - 1, defs),
        };
        json!({"type": "object", "properties": props, "required": required, "additionalProperties": extra})
    }

    /// An array of drawn items, with item counts and prefix items now and then.
    fn array_schema(&mut self, depth: usize, defs: usize) -> Value {
        let mut s = json!({"type": "array", "items": self.schema(depth - 1, defs)});
        if self.chance(40) {
            s["minItems"] = json!(self.count());
        }
        if self.chance(40) {
            s["maxItems"] = json!(self.count());
        }
        if self.chance(10) {
            s["prefixItems"] = json!([self.schema(depth - 1, defs)]);
        }
        s
    }

    // ---- regular expressions ----

    fn regex(&mut self, depth: usize) -> String {
        if depth == 0 || self.chance(25) {
            return self.atom();
        }
        match self.below(9) {
            0 | 1 => (0..1 + self.below(4)).map(|_| self.regex(depth - 1)).collect(),
            2 => format!("{}|{}", self.regex(depth - 1), self.regex(depth - 1)),
            3 => format!("({})", self.regex(depth - 1)),
            4 => format!("(?:{})", self.regex(depth - 1)),
            5 => {
                let q = self.pick(&["*", "+", "?", "*?", "{3}", "{2,5}", "{0,}", "{1000}", "{0,100000}", "{5,2}"]);
                format!("({}){q}", self.regex(depth - 1))
            }
            6 => {
                let n = self.pick(&[20, 249, 250, 251, 1000, 10_000]);
                format!("{}{}{}", "(".repeat(n), self.atom(), ")".repeat(n))
            }
            7 => format!("({}{{100}}){{100}}", self.atom()),
            _ => self
                .pick(&["(a)\\1", "(?=a)a", "^a$", "\\bx", "(", ")", "[a-", "*a", "a{2,1}", "\\p{L}+", "\\"])
                .to_string(),
        }
    }

    fn atom(&mut self) -> String {
        match self.below(8) {
            0 => ".".into(),
            1 => self.pick(&["[a-z0-9]", "[^\"]", "[\\u0000-\\uffff]", "[é-𝄞]"]).into(),
            2 => self.pick(&["\\d", "\\w", "\\s", "\\.", "\\n", "\\u00e9"]).into(),
            3 => "é".into(),
            _ => {
                let c = char::from(b'a' + self.below(26) as u8);
                c.to_string()
            }
        }
    }

    // ---- Lark ----

    fn lark(&mut self) -> String {
        match self.below(10) {
            0 => {
                let n = self.pick(&[50, 127, 128, 129, 500, 2000]);
                let mut g: String = (0..n).map(|i| format!("r{i}: r{} \"x\"\n", i + 1)).collect();
                g.push_str(&format!("r{n}: \"end\"\nstart: r0\n"));
                g
            }
            1 => {
                let n = self.pick(&[100, 1000, 20_000]);
                format!("start: {}\"a\"{}\n", "(".repeat(n), ")".repeat(n))
            }
            2 => format!("start: %json {}\n", self.json_schema()),
            3 => self.text(),
            _ => {
                let rules = 1 + self.below(6);
                let mut g = String::new();
                for i in 0..rules {
                    let alts: Vec<String> = (0..1 + self.below(3)).map(|_| self.lark_seq(2, rules)).collect();
                    g.push_str(&format!("r{i}: {}\n", alts.join(" | ")));
                }
                g.push_str(&format!("TOKEN: /{}/\n", self.regex(2).replace('/', "\\/")));
                g.push_str("NUMBER: /[0-9]+/\n");
                let embedded = if self.chance(70) { self.schema(2, 0).to_string() } else { self.json_schema() };
                g.push_str(&format!("rj: %json {embedded}\n"));
                if self.chance(20) {
                    g.push_str("%ignore /[ \\t]+/\n");
                }
                let start = if self.chance(90) { "r0".to_string() } else { self.text() };
                g.push_str(&format!("start: {start}\n"));
                g
            }
        }
    }

    fn lark_seq(&mut self, depth: usize, rules: usize) -> String {
        let n = 1 + self.below(3);
        (0..n).map(|_| self.lark_item(depth, rules)).collect::<Vec<_>>().join(" ")
    }

    fn lark_item(&mut self, depth: usize, rules: usize) -> String {
        let item = match self.below(if depth == 0 { 5 } else { 8 }) {
            0 | 1 => format!("r{}", if self.chance(95) { self.below(rules) } else { rules }),
            2 => Value::from(self.text()).to_string(),
            3 => format!("/{}/", self.regex(2).replace('/', "\\/")),
            4 => self.pick(&["TOKEN", "\"\"", "NUMBER", "rj"]).to_string(),
            5 | 6 => format!("({})", self.lark_seq(depth - 1, rules)),
            // An alternation: its items carry their own quantifiers.
            _ => return format!("({} | {})", self.lark_item(depth - 1, rules), self.lark_item(depth - 1, rules)),
        };
        let q = self.pick(&["", "", "", "?", "*", "+", "{2,5}", "~3", "{0,1000}"]);
        format!("{item}{q}")
    }

    // ---- guided_choice ----

    /// A `guided_choice` list as the frontend makes it: a Lark alternation of the
    /// strings as JSON literals.
    fn choice(&mut self) -> String {
        let n = self.pick(&[1, 2, 5, 50, 1000, 1500]);
        let prefix = if self.chance(50) { self.text() } else { String::new() };
        let items: Vec<String> = (0..n)
            .map(|i| match self.below(5) {
                0 => self.text(),
                1 => format!("{prefix}{i}"),
                _ => format!("{prefix}{}", self.text()),
            })
            .collect();
        let alts: Vec<String> = items.iter().map(|s| Value::from(s.as_str()).to_string()).collect();
        format!("start: {}", alts.join(" | "))
    }
}

/// Panics on any thread (the compile thread's too), counted and kept.
fn count_panics() -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let kept = seen.clone();
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(info.to_string());
        default(info);
    }));
    seen
}

/// Fails the test (the whole process) with the case's grammar when a case hangs.
fn watchdog(current: Arc<Mutex<(Instant, String)>>, done: Arc<AtomicUsize>) {
    std::thread::spawn(move || loop {
        std::thread::sleep(Duration::from_secs(1));
        if done.load(Ordering::Relaxed) == 1 {
            return;
        }
        let (since, case) = current.lock().unwrap().clone();
        if since.elapsed() > HANG {
            eprintln!("a grammar ran past {HANG:?}: {}", &case[..case.len().min(2000)]);
            std::process::exit(1);
        }
    });
}

/// What became of one drawn grammar: compiled (and a few allowed tokens taken),
/// refused by the bounds, or refused; anything else fails the test.
fn outcome(grammars: &Grammars, clock: &Arc<MaskClock>, d: &mut Draws, spec: &GrammarSpec, name: &str) -> &'static str {
    match grammars.prepare(spec) {
        Ok(()) => {
            let c = grammars
                .constraint(&Grammar::new(spec.clone()), &[], clock.clone())
                .unwrap_or_else(|e| panic!("compiled, yet no constraint ({e}): {name}"));
            take_allowed_tokens(c, d, name);
            "compiled"
        }
        Err(GrammarError::Invalid(why)) => {
            assert!(!why.trim().is_empty(), "refused without a reason: {name}");
            if why.contains("over the limit") {
                "refused by the bounds"
            } else {
                "refused"
            }
        }
        Err(e) => panic!("neither compiled nor refused as invalid ({e:?}): {name}"),
    }
}

/// Takes up to [`STEPS`] tokens, each drawn from what the mask allows; the
/// constraint must accept every one.
fn take_allowed_tokens(mut c: Constraint, d: &mut Draws, name: &str) {
    for _ in 0..STEPS {
        let Some(mask) = c.allowed() else { break };
        let allowed: Vec<u32> =
            (0..mask.len() as u32 * 32).filter(|&t| mask[(t / 32) as usize] >> (t % 32) & 1 == 1).collect();
        assert!(!allowed.is_empty(), "an empty mask: {name}");
        let token = allowed[d.below(allowed.len())];
        assert_eq!(c.broken(token), None, "token {token} allowed but refused: {name}");
    }
}

#[test]
fn random_grammars_compile_or_are_refused_and_nothing_panics() {
    let panics = count_panics();
    let model = loader::load(&pdserve_engine::models::require_default_model()).unwrap();
    let grammars = Grammars::new(model.tokenizer.clone()).unwrap();
    let clock = Arc::new(MaskClock::default());
    let current = Arc::new(Mutex::new((Instant::now(), String::new())));
    let done = Arc::new(AtomicUsize::new(0));
    watchdog(current.clone(), done.clone());
    let mut d = Draws(Rng::new(0x6a4a_f022));
    let kinds: [(&str, Draw); 4] = [
        ("json_schema", |d| GrammarSpec::JsonSchema(d.json_schema())),
        ("regex", |d| GrammarSpec::Regex(d.regex(4))),
        ("lark", |d| GrammarSpec::Lark(d.lark())),
        ("choice", |d| GrammarSpec::Lark(d.choice())),
    ];
    let mut outcomes = BTreeMap::<(&str, &str), usize>::new();
    let mut slowest = (Duration::ZERO, String::new());
    for (kind, draw) in kinds {
        for case in 0..CASES {
            let spec = draw(&mut d);
            let name = format!("{kind} case {case}: {spec:?}");
            *current.lock().unwrap() = (Instant::now(), name.clone());
            let t0 = Instant::now();
            let outcome = outcome(&grammars, &clock, &mut d, &spec, &name);
            *outcomes.entry((kind, outcome)).or_default() += 1;
            if t0.elapsed() > slowest.0 {
                slowest = (t0.elapsed(), name[..name.len().min(300)].to_string());
            }
        }
    }
    done.store(1, Ordering::Relaxed);
    eprintln!("outcomes: {outcomes:?}");
    eprintln!("slowest: {:?} for {}", slowest.0, slowest.1);
    let panics = panics.lock().unwrap();
    assert!(panics.is_empty(), "{} panic(s), the first: {}", panics.len(), panics[0]);
    // The draws reach both sides of every kind, and past the bounds.
    for (kind, _) in kinds {
        assert!(outcomes.get(&(kind, "compiled")).is_some_and(|&n| n > 5), "{kind}: {outcomes:?}");
    }
    for kind in ["json_schema", "lark"] {
        assert!(outcomes.get(&(kind, "refused by the bounds")).is_some_and(|&n| n > 3), "{kind}: {outcomes:?}");
    }
    assert!(outcomes.get(&("regex", "refused")).is_some_and(|&n| n > 3), "{outcomes:?}");
}
