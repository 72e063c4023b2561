//! What a constrained request's output must match. The engine compiles it into a
//! token mask per step; here it is only a value that travels with the request, across
//! processes too.

use serde::{Deserialize, Serialize};

/// The language of a constrained output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "source")]
pub enum GrammarSpec {
    /// A JSON Schema, as JSON text (`{"type": "object"}` for any object).
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect, which also embeds JSON schemas).
    Lark(String),
}

/// A grammar and how far a request already went through it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grammar {
    pub spec: GrammarSpec,
    /// The last `replayed` prompt tokens were generated under this grammar before
    /// (a request that moved to another worker with its tokens so far): the matcher
    /// consumes them before the first new token.
    #[serde(default)]
    pub replayed: u32,
}

impl Grammar {
    pub fn new(spec: GrammarSpec) -> Self {
        Grammar { spec, replayed: 0 }
    }
}
