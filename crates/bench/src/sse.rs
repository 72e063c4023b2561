//! An incremental server-sent-events parser (the subset OpenAI-style servers use).
//!
//! Bytes arrive in arbitrary pieces (a read may end mid-line, mid-UTF-8 character or
//! between `\r` and `\n`), so complete lines are cut from a byte buffer before
//! decoding. Per the SSE rules: a line ends with `\n`, `\r\n` or `\r`; `data:` lines
//! accumulate (joined with `\n`); `event:` names the event; `:` starts a comment; a
//! blank line dispatches the event.

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SseEvent {
    /// The `event:` field, empty when absent (the default "message").
    pub event: String,
    pub data: String,
}

/// Feed it bytes, get events.
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    /// The last byte seen was `\r`: a following `\n` belongs to the same line ending.
    after_cr: bool,
    event: String,
    data: String,
    has_data: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes a piece of the body; returns the events it completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in bytes {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.line);
                    if let Some(ev) = self.on_line(&line) {
                        out.push(ev);
                    }
                }
                _ => self.line.push(b),
            }
        }
        out
    }

    /// At end of body: an event left without its blank line is still delivered, since
    /// some servers end the stream right after the last `data:` line.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let line = std::mem::take(&mut self.line);
        if !line.is_empty() {
            if let Some(ev) = self.on_line(&line) {
                return Some(ev);
            }
        }
        self.dispatch()
    }

    fn on_line(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        let text = String::from_utf8_lossy(line);
        if text.starts_with(':') {
            return None;
        }
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (text.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = value.to_string(),
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = std::mem::take(&mut self.event);
        if !self.has_data {
            return None;
        }
        self.has_data = false;
        Some(SseEvent { event, data: std::mem::take(&mut self.data) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_at_once(body: &str) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut v = p.feed(body.as_bytes());
        v.extend(p.finish());
        v
    }

    fn data(events: &[SseEvent]) -> Vec<&str> {
        events.iter().map(|e| e.data.as_str()).collect()
    }

    const BODY: &str = "data: {\"choices\":[{\"text\":\"h\u{e9}\"}]}\n\n: keep-alive\n\ndata: {\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n";

    #[test]
    fn whole_body_gives_every_event_including_usage_and_done() {
        let ev = all_at_once(BODY);
        assert_eq!(
            data(&ev),
            vec!["{\"choices\":[{\"text\":\"h\u{e9}\"}]}", "{\"usage\":{\"completion_tokens\":2}}", "[DONE]"]
        );
    }

    #[test]
    fn any_split_of_the_body_gives_the_same_events() {
        let want = all_at_once(BODY);
        let bytes = BODY.as_bytes();
        for cut in 0..bytes.len() {
            for cut2 in cut..bytes.len() {
                let mut p = SseParser::new();
                let mut got = p.feed(&bytes[..cut]);
                got.extend(p.feed(&bytes[cut..cut2]));
                got.extend(p.feed(&bytes[cut2..]));
                got.extend(p.finish());
                assert_eq!(got, want, "cut at {cut}/{cut2}");
            }
        }
    }

    #[test]
    fn byte_by_byte_with_crlf_and_cr_line_endings() {
        let body = "data: a\r\n\r\ndata: b\r\rdata: c\n\n";
        let mut p = SseParser::new();
        let mut got = Vec::new();
        for b in body.as_bytes() {
            got.extend(p.feed(std::slice::from_ref(b)));
        }
        assert_eq!(data(&got), vec!["a", "b", "c"]);
    }

    #[test]
    fn error_events_and_multiline_data() {
        let ev = all_at_once("event: error\ndata: {\"error\":\ndata: \"boom\"}\n\ndata:x\n\n");
        assert_eq!(ev[0].event, "error");
        assert_eq!(ev[0].data, "{\"error\":\n\"boom\"}");
        assert_eq!(ev[1], SseEvent { event: String::new(), data: "x".into() });
    }

    #[test]
    fn unterminated_last_event_is_delivered_and_empty_events_are_not() {
        assert_eq!(data(&all_at_once("data: [DONE]")), vec!["[DONE]"]);
        assert!(all_at_once("\n\nevent: ping\n\n: c\n").is_empty());
    }
}
