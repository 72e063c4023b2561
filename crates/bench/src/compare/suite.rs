//! The named workloads of `bench compare`.
//!
//! | name          | prompt                                        | output |
//! |---------------|-----------------------------------------------|--------|
//! | prefill-heavy | 2048 random tokens                            | 64     |
//! | decode-heavy  | 128 random tokens                             | 512    |
//! | balanced      | 512 random tokens                             | 128    |
//! | shared-prefix | one of 8 system prompts of 1024 tokens + 128  | 128    |
//!
//! A shared-prefix request draws its system prompt at random: taken in turn, the
//! prefixes line up with round-robin routing over an even number of workers.

use crate::error::BenchError;
use crate::lengths::LengthSpec;
use crate::prompt::TokenRange;
use crate::rng::mix;
use crate::workload::{PrefixOrder, Source, Workload};
use std::str::FromStr;

/// A workload of the comparison suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Named {
    PrefillHeavy,
    DecodeHeavy,
    Balanced,
    SharedPrefix,
}

impl Named {
    pub const ALL: [Named; 4] = [Self::PrefillHeavy, Self::DecodeHeavy, Self::Balanced, Self::SharedPrefix];

    pub fn name(self) -> &'static str {
        match self {
            Self::PrefillHeavy => "prefill-heavy",
            Self::DecodeHeavy => "decode-heavy",
            Self::Balanced => "balanced",
            Self::SharedPrefix => "shared-prefix",
        }
    }

    /// The workload, seeded per name so no two workloads share prompt prefixes.
    pub fn workload(self, seed: u64, range: TokenRange) -> Workload {
        let random = |isl, osl| Source::Random { input: LengthSpec::Fixed(isl), output: LengthSpec::Fixed(osl) };
        let source = match self {
            Self::PrefillHeavy => random(2048, 64),
            Self::DecodeHeavy => random(128, 512),
            Self::Balanced => random(512, 128),
            Self::SharedPrefix => Source::SharedPrefix {
                prefixes: 8,
                prefix_len: 1024,
                order: PrefixOrder::Random,
                share: 1.0,
                input: LengthSpec::Fixed(128),
                output: LengthSpec::Fixed(128),
            },
        };
        Workload { source, range, seed: mix(&[seed, self as u64 + 1]) }
    }
}

impl FromStr for Named {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|w| w.name() == s).ok_or_else(|| {
            BenchError::BadFlag(format!("unknown workload {s:?}: expected {}", Self::ALL.map(Self::name).join(", ")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_workloads_do_not_share_prompts() {
        for w in Named::ALL {
            assert_eq!(w.name().parse::<Named>().unwrap(), w);
        }
        assert!("heavy".parse::<Named>().is_err());
        let r = TokenRange::default();
        let a = Named::PrefillHeavy.workload(1, r).request(0, 0);
        let b = Named::Balanced.workload(1, r).request(0, 0);
        assert_eq!((a.prompt.len(), a.output_len, b.prompt.len(), b.output_len), (2048, 64, 512, 128));
        assert_ne!(a.prompt.body[..512], b.prompt.body[..]);
        let s = Named::SharedPrefix.workload(1, r).request(0, 3);
        assert_eq!((s.prompt.prefix.len(), s.prompt.body.len()), (1024, 128));
    }
}
