//! What the planner measures of the traffic: every request's arrival and end over a
//! sliding window, fed by the router's front (its `Migrating`) as the client
//! sees them, or, for a planner in another process, by the frontends' [`Signals::tap`]s.

use pdserve_types::RequestSample as Record;
use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Requests kept at most, whatever the window: a bound on memory under a flood.
const KEPT: usize = 4096;
/// Arrivals a window holds at least, where the last [`LONGEST`] hold them: a rate
/// read off two or three arrivals is mostly Poisson noise (one burst of four in 12 s
/// reads as twice the rate), and a planner that followed it would switch on it.
const MIN_ARRIVALS: usize = 8;
/// The longest a sparse window is widened to.
const LONGEST: Duration = Duration::from_secs(60);

/// The window of request records.
pub struct Signals {
    window: Duration,
    /// When these signals were made (the server's start): a window is never
    /// widened past it, where nothing could have arrived.
    began: Instant,
    records: Mutex<VecDeque<(Instant, Record)>>,
    /// Where each record is also sent, if someone publishes them.
    tap: Mutex<Option<mpsc::Sender<Record>>>,
}

/// The window's traffic, summed up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Traffic {
    /// Seconds the window covers.
    pub seconds: f64,
    /// Arrivals per second.
    pub rate: f64,
    pub prompt_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    /// One `(prompt, expected output)` per arrival; the output is `max_tokens` scaled
    /// by how much of it ended requests used.
    pub samples: Vec<(usize, usize)>,
    /// 10th, 50th and 90th percentiles of prompt and output lengths.
    pub isl: [usize; 3],
    pub osl: [usize; 3],
    /// Ended requests, and the shares that met each SLO.
    pub ended: usize,
    pub failed: usize,
    pub ttft_attained: f64,
    pub tpot_attained: f64,
    /// The share that met both.
    pub attained: f64,
}

impl Signals {
    pub fn new(window: Duration) -> Self {
        Signals { window, began: Instant::now(), records: Mutex::default(), tap: Mutex::default() }
    }

    /// Every record from now on is also sent to the returned receiver, while it keeps
    /// up: one that falls `capacity` behind loses records, never slows a request.
    pub fn tap(&self, capacity: usize) -> mpsc::Receiver<Record> {
        let (tx, rx) = mpsc::channel(capacity);
        *self.tap.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        rx
    }

    /// Takes a record made elsewhere (a frontend's, for a fleet planner).
    pub fn record(&self, r: Record) {
        self.push(r);
    }

    pub fn arrived(&self, prompt: usize, max_tokens: usize) {
        self.push(Record::Arrived { prompt, max_tokens });
    }

    /// A request ended after `out` tokens; `ttft` and `tpot` in seconds when it had a
    /// first (and a second) token.
    pub fn ended(&self, out: usize, max_tokens: usize, ttft: Option<f64>, tpot: Option<f64>, failed: bool) {
        self.push(Record::Ended { out, max_tokens, ttft, tpot, failed });
    }

    fn push(&self, r: Record) {
        if let Some(tx) = self.tap.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
            let _ = tx.try_send(r);
        }
        let now = Instant::now();
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let kept_for = self.window.max(LONGEST);
        while records.len() >= KEPT || records.front().is_some_and(|(at, _)| now - *at > kept_for) {
            records.pop_front();
        }
        records.push_back((now, r));
    }

    /// The traffic of the window up to now, judged against the SLOs: the window
    /// widened, up to [`LONGEST`], to hold [`MIN_ARRIVALS`] arrivals.
    pub fn traffic(&self, ttft_slo: f64, tpot_slo: f64) -> Traffic {
        let now = Instant::now();
        let records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let nth_newest = records
            .iter()
            .rev()
            .filter(|(_, r)| matches!(r, Record::Arrived { .. }))
            .nth(MIN_ARRIVALS - 1)
            .map(|(at, _)| now - *at);
        drop(records);
        let widest = LONGEST.min(now - self.began).max(self.window);
        let window = nth_newest.map_or(widest, |age| age.min(widest)).max(self.window);
        // The same instant as the age above: a later one would leave the window
        // just short of the arrival it was widened to hold.
        self.summed(now, window, ttft_slo, tpot_slo)
    }

    /// The traffic of the last `window` (at most the unwidened window), judged
    /// against the SLOs.
    pub fn traffic_within(&self, window: Duration, ttft_slo: f64, tpot_slo: f64) -> Traffic {
        self.summed(Instant::now(), window.min(self.window), ttft_slo, tpot_slo)
    }

    fn summed(&self, now: Instant, window: Duration, ttft_slo: f64, tpot_slo: f64) -> Traffic {
        let records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        let live: Vec<Record> = records.iter().filter(|(at, _)| now - *at <= window).map(|&(_, r)| r).collect();
        drop(records);
        let seconds = window.as_secs_f64();
        let (mut used, mut asked, mut out_tokens) = (0usize, 0usize, 0usize);
        let (mut ended, mut failed, mut ttft_ok, mut tpot_ok, mut both_ok) = (0usize, 0usize, 0usize, 0usize, 0usize);
        for r in &live {
            if let Record::Ended { out, max_tokens, ttft, tpot, failed: f } = *r {
                ended += 1;
                failed += usize::from(f);
                (used, asked, out_tokens) = (used + out, asked + max_tokens, out_tokens + out);
                let ttft_met = !f && ttft.is_some_and(|s| s <= ttft_slo);
                let tpot_met = !f && tpot.is_none_or(|s| s <= tpot_slo);
                ttft_ok += usize::from(ttft_met);
                tpot_ok += usize::from(tpot_met);
                both_ok += usize::from(ttft_met && tpot_met);
            }
        }
        let used_share = if asked > 0 { used as f64 / asked as f64 } else { 1.0 };
        let samples: Vec<(usize, usize)> = live
            .iter()
            .filter_map(|r| match *r {
                Record::Arrived { prompt, max_tokens } => {
                    Some((prompt, ((max_tokens as f64 * used_share).round() as usize).max(1)))
                }
                Record::Ended { .. } => None,
            })
            .collect();
        let share = |ok: usize| if ended > 0 { ok as f64 / ended as f64 } else { 1.0 };
        Traffic {
            seconds,
            rate: samples.len() as f64 / seconds,
            prompt_tokens_per_s: samples.iter().map(|s| s.0).sum::<usize>() as f64 / seconds,
            output_tokens_per_s: out_tokens as f64 / seconds,
            isl: percentiles(samples.iter().map(|s| s.0).collect()),
            osl: percentiles(samples.iter().map(|s| s.1).collect()),
            samples,
            ended,
            failed,
            ttft_attained: share(ttft_ok),
            tpot_attained: share(tpot_ok),
            attained: share(both_ok),
        }
    }
}

fn percentiles(mut v: Vec<usize>) -> [usize; 3] {
    if v.is_empty() {
        return [0; 3];
    }
    v.sort_unstable();
    [10, 50, 90].map(|p| v[(v.len() - 1) * p / 100])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_sums_rates_lengths_and_attainment() {
        let s = Signals::new(Duration::from_secs(10));
        for i in 0..10 {
            s.arrived(if i % 2 == 0 { 100 } else { 2000 }, 64);
        }
        s.ended(32, 64, Some(1.0), Some(0.01), false);
        s.ended(32, 64, Some(9.0), Some(0.01), false);
        s.ended(32, 64, Some(9.0), Some(0.1), false);
        s.ended(32, 64, Some(1.0), Some(0.1), false);
        let t = s.traffic(5.0, 0.05);
        assert!((t.rate - 1.0).abs() < 1e-9);
        assert_eq!(t.isl, [100, 100, 2000], "a bimodal mix shows in its percentiles");
        // Ended requests used half their max_tokens: the expected outputs follow.
        assert_eq!(t.osl, [32, 32, 32]);
        assert_eq!((t.ended, t.ttft_attained, t.tpot_attained, t.attained), (4, 0.5, 0.5, 0.25));
    }

    #[tokio::test(start_paused = true)]
    async fn the_newest_seconds_show_a_shift_the_window_still_averages() {
        let s = Signals::new(Duration::from_secs(12));
        for _ in 0..90 {
            s.arrived(128, 512);
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        for _ in 0..30 {
            s.arrived(2048, 32);
        }
        let (whole, newest) = (s.traffic(5.0, 0.05), s.traffic_within(Duration::from_secs(3), 5.0, 0.05));
        assert!((whole.rate - 10.0).abs() < 1e-9 && whole.isl[1] == 128, "{whole:?}");
        assert!((newest.rate - 10.0).abs() < 1e-9 && newest.isl == [2048; 3], "{newest:?}");
        // Never more than the window kept.
        assert_eq!(s.traffic_within(Duration::from_secs(60), 5.0, 0.05), whole);
    }

    #[tokio::test(start_paused = true)]
    async fn a_sparse_window_widens_to_hold_enough_arrivals() {
        let s = Signals::new(Duration::from_secs(12));
        tokio::time::advance(Duration::from_secs(100)).await;
        // One arrival every 5 s: the 12 s window would hold two or three.
        for _ in 0..20 {
            s.arrived(1024, 128);
            tokio::time::advance(Duration::from_secs(5)).await;
        }
        let t = s.traffic(5.0, 0.05);
        assert_eq!(t.samples.len(), MIN_ARRIVALS, "{t:?}");
        assert!((t.seconds - 40.0).abs() < 1e-9 && (t.rate - 0.2).abs() < 1e-9, "{t:?}");
        // The newest seconds stay as narrow as asked.
        assert_eq!(s.traffic_within(Duration::from_secs(3), 5.0, 0.05).samples.len(), 0);
        // Dense traffic keeps the window as it is.
        for _ in 0..50 {
            s.arrived(128, 64);
        }
        assert_eq!(s.traffic(5.0, 0.05).seconds, 12.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_window_is_never_widened_past_the_start() {
        let s = Signals::new(Duration::from_secs(12));
        tokio::time::advance(Duration::from_secs(20)).await;
        s.arrived(512, 128);
        s.arrived(512, 128);
        let t = s.traffic(5.0, 0.05);
        assert!((t.seconds - 20.0).abs() < 1e-9 && (t.rate - 0.1).abs() < 1e-9, "{t:?}");
    }
}
