//! Stop strings over streamed text.
//!
//! Text arrives in pieces (one per token), and a stop string can span pieces, so the
//! matcher holds back any tail that could still grow into a stop string. When a stop
//! string appears, everything before it is released and the rest (the match and
//! anything after it) is dropped.

/// Finds the first stop string in a stream of text pieces.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released: at most a proper prefix of some stop string, or
    /// (while inactive) text that may later match.
    pending: String,
    stopped: bool,
    /// The stop string that matched.
    matched: Option<usize>,
}

/// What a piece of text amounts to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Text safe to show now.
    pub text: String,
    /// A stop string matched; nothing more will be released.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, ..Default::default() }
    }

    /// Adds `piece`. While `active` is false (fewer than `min_tokens` generated) no
    /// stop string can end the text, but a tail that could start one is still held
    /// back, so a match that straddles the switch is found.
    pub fn push(&mut self, piece: &str, active: bool) -> Released {
        if self.stopped {
            return Released { text: String::new(), stopped: true };
        }
        if self.stops.is_empty() {
            return Released { text: piece.to_string(), stopped: false };
        }
        self.pending.push_str(piece);
        if active {
            if let Some((at, which)) = self.first_match() {
                self.pending.truncate(at);
                (self.stopped, self.matched) = (true, Some(which));
                return Released { text: std::mem::take(&mut self.pending), stopped: true };
            }
        }
        let keep = self.held_back_len();
        let text = self.pending.drain(..self.pending.len() - keep).collect();
        Released { text, stopped: false }
    }

    /// The end of the stream: releases whatever was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Byte offset of the earliest stop string in `pending`, and which one it is.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops.iter().enumerate().filter_map(|(i, s)| Some((self.pending.find(s.as_str())?, i))).min()
    }

    /// Length of the longest tail of `pending` that is a proper prefix of a stop
    /// string (always a whole number of characters).
    fn held_back_len(&self) -> usize {
        let p = &self.pending;
        self.stops
            .iter()
            .flat_map(|s| (1..s.len()).rev().filter(|&k| s.is_char_boundary(k) && p.ends_with(&s[..k])).take(1))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p, true);
            out.push(r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push(m.finish());
        (out, false)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), (vec!["a".into(), "b".into(), "".into()], false));
    }

    #[test]
    fn match_across_pieces_cuts_before_it() {
        let (out, stopped) = run(&["END"], &["hello E", "N", "D and more"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hello ");
        // The possible start of the stop string was held back, not shown early.
        assert_eq!(out[0], "hello ");
        assert_eq!(out[1], "");
    }

    #[test]
    fn false_start_is_released() {
        let (out, stopped) = run(&["END"], &["E", "N", "x"]);
        assert!(!stopped);
        assert_eq!(out, vec!["", "", "ENx", ""]);
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (out, stopped) = run(&["world", "lo"], &["hello world"]);
        assert!(stopped);
        assert_eq!(out.concat(), "hel");
        let mut m = StopMatcher::new(vec!["world".into(), "lo".into()]);
        assert_eq!(m.matched(), None);
        m.push("hello world", true);
        assert_eq!(m.matched(), Some("lo"), "the one that ended the text is named");
    }

    #[test]
    fn held_tail_is_released_at_the_end() {
        let (out, stopped) = run(&["\n\n"], &["a\n"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "a\n");
    }

    #[test]
    fn multibyte_stop_strings() {
        let (out, stopped) = run(&["é!"], &["caf", "é", "!"]);
        assert!(stopped);
        assert_eq!(out.concat(), "caf");
    }

    #[test]
    fn inactive_text_is_never_cut() {
        let mut m = StopMatcher::new(vec!["ab".into()]);
        assert_eq!(m.push("xab", false), Released { text: "xab".into(), stopped: false });
        assert_eq!(m.push("a", false).text, "");
        assert_eq!(m.push("b", true), Released { text: String::new(), stopped: true });
    }
}
