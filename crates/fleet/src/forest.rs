//! NimsForest's wire formats, as its Go runtime reads and writes them: the Leaf every
//! Wind message is, the RiverData envelope of the River, and the forms an inference
//! request arrives in. See `docs/nimsforest.md`.

use base64::Engine as _;
use pdserve_types::civil::civil_from_days;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// A Wind message: `subject` equal to the NATS subject it is published on, `data` any
/// JSON value, a non-empty `source`, `ts` RFC 3339 in UTC.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Leaf {
    pub subject: String,
    pub data: Value,
    pub source: String,
    pub ts: String,
}

impl Leaf {
    pub fn new(subject: impl Into<String>, source: impl Into<String>, data: Value) -> Leaf {
        Leaf { subject: subject.into(), data, source: source.into(), ts: rfc3339(SystemTime::now()) }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A Leaf received on `subject`, checked as NimsForest's `Leaf.Validate` checks it.
    pub fn parse(bytes: &[u8], subject: &str) -> Result<Leaf, String> {
        let leaf: Leaf = serde_json::from_slice(bytes).map_err(|e| format!("not a Leaf: {e}"))?;
        if leaf.subject != subject {
            return Err(format!("Leaf subject `{}` is not the NATS subject `{subject}`", leaf.subject));
        }
        if leaf.source.is_empty() || leaf.ts.is_empty() || leaf.ts.starts_with("0001-01-01") {
            return Err("a Leaf needs a source and a timestamp".into());
        }
        Ok(leaf)
    }
}

/// `t` as RFC 3339 UTC with nanoseconds (`2026-01-15T12:21:28.123456789Z`), as Go writes
/// `time.Time`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z", rem / 3600, rem % 3600 / 60, rem % 60, d.subsec_nanos())
}

/// Which OpenAI endpoint a request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    ChatCompletions,
    Completions,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// An inference request taken off the River or the Wind.
#[derive(Debug, Clone, PartialEq)]
pub struct ForestRequest {
    pub request_id: String,
    /// Where the result Leaf goes: the caller's `reply_to`, else
    /// `infer.result.<request_id>`.
    pub reply_to: String,
    pub priority: i64,
    /// The request is refused, not run, if it has not started this long after `sent`.
    pub deadline_ms: Option<u64>,
    /// When the producer sent it (the envelope's `ts`), if it said.
    pub sent: Option<String>,
    /// Opaque to pdserve, echoed on every Leaf about the request.
    pub context: Value,
    pub api: Api,
    /// The OpenAI request body, the `nimsforest` object taken out.
    pub body: Value,
}

/// A message that cannot become a request, with what is known of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Unusable {
    pub request_id: Option<String>,
    pub reason: String,
    pub context: Value,
}

/// Reads a River message: a RiverData envelope (`data` the base64 of the payload) or,
/// leniently, the payload itself; the payload an `http_webhook` Source's (`body` the
/// OpenAI request, `headers` copied from HTTP) or a bare OpenAI request with an
/// optional `nimsforest` object. A `reply_to` must start with one of `replies`: the
/// frontend publishes there with its own NATS rights, so a River client must not
/// choose any subject (the fleet's bucket, JetStream's API).
pub fn parse_river(bytes: &[u8], replies: &[String]) -> Result<ForestRequest, Unusable> {
    let unusable = |reason: String| Unusable { request_id: None, reason, context: Value::Null };
    let outer: Value = serde_json::from_slice(bytes).map_err(|e| unusable(format!("not JSON: {e}")))?;
    let (payload, sent) = match river_data(&outer) {
        Some((bytes, ts)) => {
            let v =
                serde_json::from_slice(&bytes).map_err(|e| unusable(format!("RiverData payload is not JSON: {e}")))?;
            (v, ts)
        }
        None => (outer, None),
    };
    request(payload, sent, replies)
}

/// Reads the data of a Leaf on `infer.request.submit`: the same forms as the River's
/// payload, or NimsForest's flat form (`messages`/`prompt`, `params`, `request_id`,
/// `reply_to`, `context` side by side), under the same rule for `reply_to`.
pub fn parse_submit(leaf: &Leaf, replies: &[String]) -> Result<ForestRequest, Unusable> {
    request(leaf.data.clone(), Some(leaf.ts.clone()), replies)
}

/// The reply subjects a frontend answers on unless told otherwise.
pub const DEFAULT_REPLY_PREFIX: &str = "infer.result.";

/// Whether `subject` starts with one of `prefixes`; never a `$` subject (JetStream's
/// API and key-value buckets) nor the fleet's own `pdserve.` subjects.
pub fn reply_allowed(subject: &str, prefixes: &[String]) -> bool {
    let reserved = subject.starts_with('$') || subject.starts_with("pdserve.");
    !reserved && prefixes.iter().any(|p| subject.starts_with(p.as_str()))
}

/// `(payload bytes, ts)` of a RiverData envelope.
fn river_data(v: &Value) -> Option<(Vec<u8>, Option<String>)> {
    let o = v.as_object()?;
    let data = o.get("data")?.as_str()?;
    o.get("subject")?.as_str()?;
    let bytes = base64::engine::general_purpose::STANDARD.decode(data).ok()?;
    Some((bytes, o.get("ts").and_then(Value::as_str).map(String::from)))
}

fn request(payload: Value, sent: Option<String>, replies: &[String]) -> Result<ForestRequest, Unusable> {
    let Value::Object(mut o) = payload else {
        return Err(Unusable {
            request_id: None,
            reason: "the payload is not a JSON object".into(),
            context: Value::Null,
        });
    };
    // An http_webhook Source's payload: the request is its body.
    let mut headers = Map::new();
    if let (Some(Value::Object(body)), None, None) = (o.get("body"), o.get("messages"), o.get("prompt")) {
        if let Some(Value::Object(h)) = o.get("headers") {
            headers = h.clone();
        }
        o = body.clone();
    }
    let ext = match o.remove("nimsforest") {
        Some(Value::Object(e)) => e,
        _ => Map::new(),
    };
    // NimsForest's flat form keeps these beside the request.
    let take = |k: &str, o: &mut Map<String, Value>| ext.get(k).cloned().or_else(|| o.remove(k));
    let header = |name: &str| headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).and_then(|(_, v)| v.as_str());
    let request_id = take("request_id", &mut o)
        .and_then(|v| v.as_str().map(String::from))
        .or_else(|| header("X-Request-Id").map(String::from));
    let context = take("context", &mut o).unwrap_or(Value::Null);
    let fail =
        |reason: &str| Unusable { request_id: request_id.clone(), reason: reason.into(), context: context.clone() };
    let reply_to = take("reply_to", &mut o)
        .and_then(|v| v.as_str().map(String::from))
        .or_else(|| header("X-Reply-To").map(String::from));
    let priority = take("priority", &mut o).and_then(|v| v.as_i64()).unwrap_or(0);
    let deadline_ms = take("deadline_ms", &mut o).and_then(|v| v.as_u64());
    if let Some(Value::Object(params)) = o.remove("params") {
        for (k, v) in params {
            o.entry(k).or_insert(v);
        }
    }
    let api = match (o.contains_key("messages"), o.contains_key("prompt")) {
        (true, false) => Api::ChatCompletions,
        (false, true) => Api::Completions,
        _ => return Err(fail("an inference request needs `messages` (chat) or `prompt` (completions), not both")),
    };
    if request_id.as_deref().is_some_and(|id| !valid_token(id)) {
        return Err(fail("request_id may hold only letters, digits, `_` and `-` (at most 128)"));
    }
    if reply_to.as_deref().is_some_and(|r| r.is_empty() || r.contains(' ')) {
        return Err(fail("reply_to must be a NATS subject"));
    }
    if reply_to.as_deref().is_some_and(|r| !reply_allowed(r, replies)) {
        return Err(fail("reply_to is not under a subject this frontend answers on (--river-reply-prefix)"));
    }
    let request_id = request_id.unwrap_or_else(new_request_id);
    let reply_to = reply_to.unwrap_or_else(|| format!("infer.result.{request_id}"));
    Ok(ForestRequest { request_id, reply_to, priority, deadline_ms, sent, context, api, body: Value::Object(o) })
}

/// A subject token NimsForest accepts: `[A-Za-z0-9_-]`.
fn valid_token(s: &str) -> bool {
    !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn new_request_id() -> String {
    let mut b = [0u8; 12];
    if getrandom_fill(&mut b).is_err() {
        let n = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
        b.copy_from_slice(&n.to_le_bytes()[..12]);
    }
    format!("req_{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
}

fn getrandom_fill(b: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn river(payload: &Value) -> Vec<u8> {
        let data = base64::engine::general_purpose::STANDARD.encode(payload.to_string());
        json!({"subject": "river.infer.requests", "data": data, "ts": "2026-01-15T12:00:00Z"}).to_string().into_bytes()
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_nanoseconds() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_768_479_688, 123_456_789);
        assert_eq!(rfc3339(t), "2026-01-15T12:21:28.123456789Z");
        assert_eq!(rfc3339(UNIX_EPOCH + std::time::Duration::from_secs(951_782_400)), "2000-02-29T00:00:00.000000000Z");
    }

    #[test]
    fn leaves_round_trip_and_are_validated_like_go() {
        let leaf = Leaf::new("infer.request.accepted", "nim:pdserve", json!({"request_id": "r1"}));
        assert_eq!(Leaf::parse(&leaf.to_bytes(), "infer.request.accepted").unwrap(), leaf);
        assert!(Leaf::parse(&leaf.to_bytes(), "infer.other").is_err());
        assert!(Leaf::parse(br#"{"subject":"a","data":1,"source":"","ts":"2026-01-01T00:00:00Z"}"#, "a").is_err());
        assert!(Leaf::parse(br#"{"subject":"a","source":"x","ts":"2026-01-01T00:00:00Z"}"#, "a").is_err());
    }

    #[test]
    fn every_payload_form_becomes_a_request() {
        let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
        // RiverData around a webhook payload, ids from the copied headers.
        let hook = json!({"headers": {"X-Request-Id": "hook-1", "X-Reply-To": "my.replies"}, "body": chat,
                          "timestamp": "2026-01-15T12:00:00Z", "source": "infer-api"});
        let r = parse_river_all(&river(&hook)).unwrap();
        assert_eq!((r.request_id.as_str(), r.reply_to.as_str(), r.api), ("hook-1", "my.replies", Api::ChatCompletions));
        assert_eq!(r.body, chat);
        assert_eq!(r.sent.as_deref(), Some("2026-01-15T12:00:00Z"));
        // A bare request with the nimsforest object, published raw (no envelope).
        let bare =
            json!({"prompt": "Hi", "nimsforest": {"request_id": "b-2", "deadline_ms": 500, "context": {"chat": 42}}});
        let r = parse_river_all(bare.to_string().as_bytes()).unwrap();
        assert_eq!((r.request_id.as_str(), r.reply_to.as_str(), r.api), ("b-2", "infer.result.b-2", Api::Completions));
        assert_eq!((r.deadline_ms, r.context.clone()), (Some(500), json!({"chat": 42})));
        assert_eq!(r.body, json!({"prompt": "Hi"}));
        // NimsForest's flat form, params folded in.
        let flat = json!({"request_id": "f-3", "messages": [], "params": {"max_tokens": 9}, "reply_to": "x.y"});
        let r = parse_river_all(&river(&flat)).unwrap();
        assert_eq!(r.body, json!({"messages": [], "max_tokens": 9}));
        assert!(parse_river_all(&river(&json!({"messages": []}))).unwrap().request_id.starts_with("req_"));
    }

    /// Any reply subject but the reserved ones.
    fn parse_river_all(bytes: &[u8]) -> Result<ForestRequest, Unusable> {
        parse_river(bytes, &["".to_string()])
    }

    #[test]
    fn reply_subjects_are_held_to_the_prefixes_and_never_reserved() {
        let ours = [DEFAULT_REPLY_PREFIX.to_string()];
        let cases = [
            ("infer.result.r-1", &ours[..], true),
            ("my.replies", &ours[..], false),
            ("$KV.INFER_LOAD.planner", &["".to_string()][..], false),
            ("$JS.API.STREAM.PURGE.KV_INFER_REQ", &["$JS.".to_string()][..], false),
            ("pdserve.traffic", &["".to_string()][..], false),
            ("forest.replies.x", &["forest.replies.".to_string(), DEFAULT_REPLY_PREFIX.to_string()][..], true),
        ];
        for (subject, prefixes, want) in cases {
            assert_eq!(reply_allowed(subject, prefixes), want, "{subject}");
        }
        let evil =
            json!({"prompt": "hi", "nimsforest": {"request_id": "evil-1", "reply_to": "$KV.INFER_LOAD.planner"}});
        let e = parse_river(evil.to_string().as_bytes(), &ours).unwrap_err();
        assert!(e.reason.contains("reply_to"), "{}", e.reason);
    }

    #[test]
    fn unusable_messages_say_why() {
        for bad in [
            b"not json".to_vec(),
            river(&json!([1, 2])),
            river(&json!({"model": "m"})),
            river(&json!({"prompt": "a", "messages": []})),
            river(&json!({"prompt": "a", "nimsforest": {"request_id": "has space"}})),
            json!({"subject": "river.infer.requests", "data": "%%%", "ts": "x"}).to_string().into_bytes(),
        ] {
            let e = parse_river_all(&bad).unwrap_err();
            assert!(!e.reason.is_empty());
        }
        let e = parse_river_all(&river(&json!({"model": "m", "nimsforest": {"request_id": "r-9", "context": 1}})))
            .unwrap_err();
        assert_eq!((e.request_id.as_deref(), e.context), (Some("r-9"), json!(1)));
    }
}
