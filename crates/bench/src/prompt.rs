//! Prompt content: random token ids, or the same ids rendered as words for servers
//! (and chat endpoints) that only take text.
//!
//! Token ids come from a range that avoids the special tokens at the low end of the
//! vocabulary (`--token-range`, default `1000..40000`, inside SmolLM2's 49,152). Text
//! prompts map each id to one common English word, so a prompt of N ids becomes about
//! N tokens for a BPE tokenizer (each " word" is one token in the usual vocabularies;
//! the server's reported `prompt_tokens` is what gets recorded when it sends one).

use crate::error::BenchError;
use crate::rng::Rng;
use std::fmt;
use std::str::FromStr;

/// Half-open range of token ids to draw from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenRange {
    pub lo: u32,
    pub hi: u32,
}

impl Default for TokenRange {
    fn default() -> Self {
        Self { lo: 1000, hi: 40_000 }
    }
}

impl FromStr for TokenRange {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BenchError::BadFlag(format!("bad token range {s:?}: expected LO..HI with LO < HI"));
        let (a, b) = s.split_once("..").ok_or_else(bad)?;
        let (lo, hi) = (a.trim().parse::<u32>().map_err(|_| bad())?, b.trim().parse::<u32>().map_err(|_| bad())?);
        if lo >= hi {
            return Err(bad());
        }
        Ok(Self { lo, hi })
    }
}

impl fmt::Display for TokenRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.lo, self.hi)
    }
}

impl serde::Serialize for TokenRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl TokenRange {
    /// `len` ids drawn uniformly from the range.
    pub fn random_ids(&self, rng: &mut Rng, len: usize) -> Vec<u32> {
        (0..len).map(|_| rng.range(u64::from(self.lo), u64::from(self.hi)) as u32).collect()
    }
}

/// How prompts travel to the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptKind {
    /// A list of token ids as `prompt` (completions only; exact lengths).
    Ids,
    /// Words (approximate lengths; works with any server and with chat).
    Text,
}

impl FromStr for PromptKind {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ids" | "tokens" => Ok(Self::Ids),
            "text" => Ok(Self::Text),
            _ => Err(BenchError::BadFlag(format!("unknown prompt kind {s:?}: expected ids or text"))),
        }
    }
}

/// One request's prompt: an optional shared prefix (a system prompt in chat) and the
/// request's own part, both as token ids.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prompt {
    pub prefix: Vec<u32>,
    pub body: Vec<u32>,
}

impl Prompt {
    /// Prefix then body, as one id list.
    pub fn ids(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(&self.prefix);
        v.extend_from_slice(&self.body);
        v
    }

    pub fn len(&self) -> usize {
        self.prefix.len() + self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Ids rendered as space-separated words, one word per id.
pub fn ids_to_text(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 6);
    for (i, &id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[id as usize % WORDS.len()]);
    }
    s
}

/// Common English words that are single tokens (with their leading space) in the usual
/// BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her",
    "it", "an", "are", "were", "which", "be", "this", "has", "had", "not", "but", "they", "their", "one", "two",
    "three", "first", "new", "after", "also", "other", "time", "year", "years", "city", "world", "state", "school",
    "family", "people", "house", "water", "river", "game", "team", "music", "book", "film", "group", "war", "life",
    "work", "line", "home", "king", "land", "light", "road", "sea", "story", "north", "south", "east", "west", "small",
    "large", "long", "great", "old", "young", "high", "good", "early", "late", "later", "during", "before", "under",
    "over", "about", "between", "into", "through", "while", "where", "when", "because", "most", "many", "some", "such",
    "only", "more", "than", "then", "there", "these", "would", "could", "should", "may", "will", "made", "used",
    "known", "called", "built", "found", "began", "became", "played", "held", "left", "took", "name", "part", "place",
    "area", "week", "day", "night", "month", "car", "tree", "stone", "field", "garden", "window", "door", "table",
    "paper", "letter", "number", "color", "green", "blue", "red", "white", "black", "bird", "horse", "dog", "cat",
    "fish", "food", "bread", "milk", "wine", "fire", "wind", "rain", "snow", "sun", "moon", "star", "sky", "island",
    "forest", "mountain", "valley", "bridge", "tower", "church", "market", "train", "ship", "port", "plant", "power",
    "energy", "system", "report", "law", "court", "party", "army", "union", "church", "college", "art", "science",
    "history", "language", "money", "price", "trade", "company", "office",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ranges_parse_and_ids_stay_inside() {
        let r: TokenRange = "1000..1010".parse().unwrap();
        let ids = r.random_ids(&mut Rng::new(1), 500);
        assert!(ids.iter().all(|&i| (1000..1010).contains(&i)));
        for bad in ["10..10", "20..10", "x..5", "100"] {
            assert!(bad.parse::<TokenRange>().is_err(), "{bad:?}");
        }
        assert_eq!(TokenRange::default().to_string(), "1000..40000");
    }

    #[test]
    fn text_has_one_word_per_id() {
        let t = ids_to_text(&[0, 1, 2, 12345]);
        assert_eq!(t.split(' ').count(), 4);
        assert!(t.starts_with("the of and"));
        assert_eq!(ids_to_text(&[]), "");
    }

    #[test]
    fn prompt_ids_are_prefix_then_body() {
        let p = Prompt { prefix: vec![1, 2], body: vec![3] };
        assert_eq!(p.ids(), vec![1, 2, 3]);
        assert_eq!(p.len(), 3);
        assert!(Prompt::default().is_empty());
    }
}
