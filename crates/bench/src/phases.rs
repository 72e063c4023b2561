//! A shifting workload: phases played back to back in one run, each with its own
//! arrival rate and length mix, so a server (and its planner) sees the traffic change
//! under it.
//!
//! A phase is written `LABEL:SECONDS:RATE:SHAPES[:sin=PERIOD]` (flag `--phase`,
//! repeated), where `SHAPES` is one or more `ISL/OSL` pairs joined by `+`, each length
//! in the forms of `--input-len`:
//! - `prefill-heavy:60:0.4:2048/32`: Poisson arrivals at 0.4/s for 60 s, every
//!   request 2048 prompt tokens and 32 output tokens;
//! - `mixed:60:0.5:2048/32+128/512`: each request draws one of the shapes at random;
//! - `sin:120:0.5:2048/32+128/512:sin=60`: two shapes whose shares swing as a sine of
//!   period 60 s: all of the first at the phase's start, all of the second half a
//!   period later (in the manner of Dynamo's sinusoidal load generator, which swings
//!   the mix between prefill- and decode-heavy requests).
//!
//! The phases compile to a synthetic trace (arrival time and lengths per request,
//! random prompts), replayed as a trace is; the summary is then split per phase by
//! each request's scheduled time.

use crate::error::BenchError;
use crate::lengths::LengthSpec;
use crate::metrics::{Slo, Summary};
use crate::record::RequestRecord;
use crate::rng::{mix, Rng};
use crate::trace::TraceRow;
use std::str::FromStr;

/// One request shape: its prompt and output lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub input: LengthSpec,
    pub output: LengthSpec,
}

/// One phase of a shifting workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Phase {
    pub label: String,
    pub seconds: f64,
    /// Poisson arrival rate, requests per second.
    pub rate: f64,
    pub shapes: Vec<Shape>,
    /// Swing the share of two shapes as a sine of this period (seconds).
    pub sin_period: Option<f64>,
}

/// Where a phase lies in the run, for reports.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Span {
    pub label: String,
    pub start_s: f64,
    pub end_s: f64,
}

/// One phase's share of a point's records.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PhaseResult {
    pub span: Span,
    pub summary: Summary,
}

fn bad<T>(spec: &str, why: &str) -> Result<T, BenchError> {
    Err(BenchError::BadFlag(format!("bad --phase {spec:?}: {why}")))
}

fn positive_f64(s: &str) -> Option<f64> {
    s.trim().parse::<f64>().ok().filter(|x| x.is_finite() && *x > 0.0)
}

impl FromStr for Shape {
    type Err = BenchError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((i, o)) = s.split_once('/') else { return bad(s, "a shape is ISL/OSL") };
        Ok(Self { input: i.parse()?, output: o.parse()? })
    }
}

impl FromStr for Phase {
    type Err = BenchError;
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = spec.split(':').collect();
        if !(4..=5).contains(&parts.len()) {
            return bad(spec, "expected LABEL:SECONDS:RATE:ISL/OSL[+ISL/OSL][:sin=PERIOD]");
        }
        let label = parts[0].trim();
        if label.is_empty() {
            return bad(spec, "the label is empty");
        }
        let Some(seconds) = positive_f64(parts[1]) else { return bad(spec, "SECONDS must be a positive number") };
        let Some(rate) = positive_f64(parts[2]) else { return bad(spec, "RATE must be a positive number") };
        let shapes = parts[3].split('+').map(str::parse).collect::<Result<Vec<Shape>, _>>()?;
        let sin_period = match parts.get(4) {
            None => None,
            Some(p) => match p.strip_prefix("sin=").and_then(positive_f64) {
                Some(period) if shapes.len() == 2 => Some(period),
                Some(_) => return bad(spec, "sin= swings between exactly two shapes"),
                None => return bad(spec, "the fifth field is sin=PERIOD (seconds)"),
            },
        };
        Ok(Self { label: label.to_string(), seconds, rate, shapes, sin_period })
    }
}

impl Phase {
    /// The share of the first shape `t` seconds into the phase, under the sine.
    fn first_share(&self, t: f64) -> f64 {
        match self.sin_period {
            Some(p) => 0.5 * (1.0 + (std::f64::consts::TAU * t / p).cos()),
            None => 1.0 / self.shapes.len() as f64,
        }
    }

    /// The shape of a request arriving `t` seconds into the phase.
    fn shape(&self, t: f64, rng: &mut Rng) -> Shape {
        let u = rng.next_f64();
        if self.sin_period.is_some() {
            return self.shapes[usize::from(u >= self.first_share(t))];
        }
        self.shapes[((u * self.shapes.len() as f64) as usize).min(self.shapes.len() - 1)]
    }
}

/// The phases of one run, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Phases(pub Vec<Phase>);

impl Phases {
    /// Checks the labels are distinct (reports are keyed by them).
    pub fn new(phases: Vec<Phase>) -> Result<Self, BenchError> {
        for (i, p) in phases.iter().enumerate() {
            if phases[..i].iter().any(|q| q.label == p.label) {
                return Err(BenchError::BadFlag(format!("--phase label {:?} is used twice", p.label)));
            }
        }
        Ok(Self(phases))
    }

    /// Each phase's place in the run.
    pub fn spans(&self) -> Vec<Span> {
        let mut t = 0.0;
        self.0
            .iter()
            .map(|p| {
                let span = Span { label: p.label.clone(), start_s: t, end_s: t + p.seconds };
                t += p.seconds;
                span
            })
            .collect()
    }

    /// The requests of the run as trace rows (timestamps in ms): Poisson arrivals in
    /// each phase, lengths drawn from its shapes. The same seed gives the same rows.
    pub fn rows(&self, seed: u64) -> Vec<TraceRow> {
        let mut rows = Vec::new();
        for (i, (phase, span)) in self.0.iter().zip(self.spans()).enumerate() {
            let mut rng = Rng::new(mix(&[seed, 0x0fa5_e5ed, i as u64]));
            let mut t = crate::arrivals::exponential(&mut rng, phase.rate);
            while t < phase.seconds {
                let shape = phase.shape(t, &mut rng);
                rows.push(TraceRow {
                    timestamp: (span.start_s + t) * 1000.0,
                    input_length: shape.input.sample(&mut rng),
                    output_length: shape.output.sample(&mut rng),
                    hash_ids: None,
                });
                t += crate::arrivals::exponential(&mut rng, phase.rate);
            }
        }
        rows
    }

    /// A short description for reports.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|p| {
                let shapes: Vec<String> = p.shapes.iter().map(|s| format!("{}/{}", s.input, s.output)).collect();
                let sin = p.sin_period.map_or(String::new(), |s| format!(" swinging every {s} s"));
                format!("{} {} s at {}/s of {}{sin}", p.label, p.seconds, p.rate, shapes.join(" + "))
            })
            .collect();
        format!("phases: {}", parts.join(", then "))
    }
}

/// Splits a point's records by the phase each was scheduled in, one summary each.
pub fn split(spans: &[Span], records: &[RequestRecord], slo: Slo) -> Vec<PhaseResult> {
    spans
        .iter()
        .map(|span| {
            let inside: Vec<RequestRecord> = records
                .iter()
                .filter(|r| {
                    let at = r.scheduled_s.unwrap_or(r.start_s);
                    at >= span.start_s && at < span.end_s
                })
                .cloned()
                .collect();
            PhaseResult { span: span.clone(), summary: Summary::of(&inside, slo) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phase(s: &str) -> Phase {
        s.parse().unwrap()
    }

    #[test]
    fn phases_parse_and_bad_ones_say_why() {
        let p = phase("mix:120:0.5:2048/32+128/512:sin=60");
        assert_eq!((p.label.as_str(), p.seconds, p.rate, p.sin_period), ("mix", 120.0, 0.5, Some(60.0)));
        assert_eq!(p.shapes[1], Shape { input: LengthSpec::Fixed(128), output: LengthSpec::Fixed(512) });
        assert_eq!(phase("a:1:2:100..200/8").shapes[0].input, LengthSpec::Uniform { min: 100, max: 200 });
        for (spec, why) in [
            ("a:1:2", "expected LABEL"),
            (":1:2:3/4", "label is empty"),
            ("a:0:2:3/4", "SECONDS"),
            ("a:1:-2:3/4", "RATE"),
            ("a:1:2:34", "ISL/OSL"),
            ("a:1:2:3/4:sin=5", "exactly two shapes"),
            ("a:1:2:3/4+5/6:cos=5", "sin=PERIOD"),
        ] {
            let e = spec.parse::<Phase>().unwrap_err().to_string();
            assert!(e.contains(why), "{spec}: {e}");
        }
        let twice = Phases::new(vec![phase("a:1:1:3/4"), phase("a:2:1:3/4")]).unwrap_err().to_string();
        assert!(twice.contains("used twice"), "{twice}");
    }

    #[test]
    fn rows_follow_each_phase_rate_and_shape_in_order() {
        let ps = Phases::new(vec![phase("p:100:2:2048/32"), phase("d:50:4:128/512")]).unwrap();
        let rows = ps.rows(7);
        assert_eq!(rows, ps.rows(7), "reproducible");
        let (first, second): (Vec<&TraceRow>, Vec<&TraceRow>) = rows.iter().partition(|r| r.timestamp < 100_000.0);
        assert!((170..=230).contains(&first.len()), "{}", first.len());
        assert!((170..=230).contains(&second.len()), "{}", second.len());
        assert!(first.iter().all(|r| (r.input_length, r.output_length) == (2048, 32)));
        assert!(second.iter().all(|r| (r.input_length, r.output_length) == (128, 512) && r.timestamp < 150_000.0));
        assert!(rows.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        assert_eq!(ps.spans()[1], Span { label: "d".into(), start_s: 100.0, end_s: 150.0 });
    }

    #[test]
    fn a_sine_swings_the_mix_from_the_first_shape_to_the_second_and_back() {
        let ps = Phases::new(vec![phase("mix:400:20:2048/32+128/512:sin=400")]).unwrap();
        let rows = ps.rows(1);
        let share = |lo: f64, hi: f64| {
            let w: Vec<&TraceRow> = rows.iter().filter(|r| r.timestamp >= lo * 1e3 && r.timestamp < hi * 1e3).collect();
            w.iter().filter(|r| r.input_length == 2048).count() as f64 / w.len() as f64
        };
        assert!(share(0.0, 40.0) > 0.9, "{}", share(0.0, 40.0));
        assert!(share(180.0, 220.0) < 0.1, "{}", share(180.0, 220.0));
        assert!(share(360.0, 400.0) > 0.9);
        assert!((share(0.0, 400.0) - 0.5).abs() < 0.05);
    }

    #[test]
    fn records_are_split_by_their_scheduled_time() {
        let spans = Phases::new(vec![phase("a:10:1:3/4"), phase("b:10:1:3/4")]).unwrap().spans();
        let rec = |i: usize, at: f64| RequestRecord {
            scheduled_s: Some(at),
            ..RequestRecord::succeeded(i, at, vec![0.1, 0.2], 2, 0.3)
        };
        let records = vec![rec(0, 0.5), rec(1, 5.0), rec(2, 10.0), rec(3, 19.9), rec(4, 20.0)];
        let out = split(&spans, &records, Slo::default());
        assert_eq!((out[0].summary.requests, out[1].summary.requests), (2, 2));
        assert_eq!(out[1].span.label, "b");
    }
}
