//! Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
//!
//! Bounded and in memory: the newest [`MAX_RESPONSES`] stored responses, at most
//! [`MAX_BYTES`] of them in all; storing one more drops the oldest first. They are this
//! frontend's alone and gone when it restarts (OpenAI keeps them 30 days; a server on
//! someone's own machine should not grow without bound).

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Responses kept at most.
pub const MAX_RESPONSES: usize = 1024;
/// Bytes kept at most, counted as the stored JSON's length.
pub const MAX_BYTES: usize = 64 << 20;

/// One stored response and the conversation that led to it.
#[derive(Debug, Clone)]
pub struct Stored {
    /// The response object as it was answered.
    pub response: Value,
    /// The conversation's items before this response: earlier turns and this
    /// request's input.
    pub input: Vec<Value>,
}

impl Stored {
    /// The conversation after this response: its input, then its output items.
    pub fn conversation(&self) -> Vec<Value> {
        let output = self.response["output"].as_array().cloned().unwrap_or_default();
        self.input.iter().cloned().chain(output).collect()
    }

    fn bytes(&self) -> usize {
        self.response.to_string().len() + self.input.iter().map(|i| i.to_string().len()).sum::<usize>()
    }
}

#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, (Stored, usize)>,
    /// Ids oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().by_id.get(id).map(|(s, _)| s.clone())
    }

    /// Keeps `stored` under `id`, dropping the oldest responses past the bounds. One
    /// larger than [`MAX_BYTES`] alone is not kept.
    pub fn put(&self, id: String, stored: Stored) {
        let size = stored.bytes();
        if size > MAX_BYTES {
            return;
        }
        let mut inner = self.lock();
        inner.remove(&id);
        while inner.order.len() >= MAX_RESPONSES || inner.bytes + size > MAX_BYTES {
            let Some(oldest) = inner.order.front().cloned() else { break };
            inner.remove(&oldest);
        }
        inner.bytes += size;
        inner.order.push_back(id.clone());
        inner.by_id.insert(id, (stored, size));
    }

    /// Forgets `id`; whether it was there.
    pub fn delete(&self, id: &str) -> bool {
        self.lock().remove(id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere while holding the lock leaves a consistent map.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
    fn remove(&mut self, id: &str) -> bool {
        let Some((_, size)) = self.by_id.remove(id) else { return false };
        self.bytes -= size;
        self.order.retain(|o| o != id);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str) -> Stored {
        Stored {
            response: json!({"output": [{"type": "message", "text": text}]}),
            input: vec![json!({"role": "user"})],
        }
    }

    #[test]
    fn the_oldest_go_first_past_the_count() {
        let store = ResponseStore::default();
        for i in 0..MAX_RESPONSES + 2 {
            store.put(format!("r{i}"), stored("x"));
        }
        assert!(store.get("r0").is_none() && store.get("r1").is_none());
        assert!(store.get("r2").is_some() && store.get(&format!("r{}", MAX_RESPONSES + 1)).is_some());
        assert!(store.delete("r2") && !store.delete("r2") && store.get("r2").is_none());
    }

    #[test]
    fn the_oldest_go_first_past_the_bytes() {
        let store = ResponseStore::default();
        let big = "x".repeat(MAX_BYTES / 3);
        for i in 0..4 {
            store.put(format!("r{i}"), stored(&big));
        }
        let kept: Vec<bool> = (0..4).map(|i| store.get(&format!("r{i}")).is_some()).collect();
        assert_eq!(kept, [false, false, true, true]);
        store.put("huge".into(), stored(&"x".repeat(MAX_BYTES + 1)));
        assert!(store.get("huge").is_none() && store.get("r3").is_some());
        assert!(store.lock().bytes <= MAX_BYTES);
    }

    #[test]
    fn a_conversation_is_its_input_then_its_output() {
        let c = stored("hi").conversation();
        assert_eq!(c.len(), 2);
        assert_eq!(c[1]["text"], "hi");
    }
}
