//! Progress on stderr while a point runs: on a terminal, a one-line bar redrawn with
//! `\r`; otherwise (logs, pipes, CI) a plain line every 10 s, so a long benchmark
//! never looks hung.

use crate::point::Bounds;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Counters the runner updates and the bar reads.
#[derive(Debug, Default)]
pub struct Counters {
    pub sent: AtomicUsize,
    pub done: AtomicUsize,
    pub failed: AtomicUsize,
}

impl Counters {
    pub fn on_sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    pub fn on_done(&self, ok: bool) {
        self.done.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// A bar redrawn in place every 200 ms (stderr is a terminal).
    Bar,
    /// A line every 10 s.
    Lines,
}

impl Style {
    pub fn detect() -> Style {
        if std::io::stderr().is_terminal() {
            Style::Bar
        } else {
            Style::Lines
        }
    }

    fn period(self) -> Duration {
        match self {
            Style::Bar => Duration::from_millis(200),
            Style::Lines => Duration::from_secs(10),
        }
    }
}

/// Shows progress forever (the caller drops it when the point ends).
pub async fn draw_forever(label: &str, bounds: Bounds, counters: &Counters, style: Style) {
    let start = Instant::now();
    loop {
        tokio::time::sleep(style.period()).await;
        let line = render(label, bounds, counters, start.elapsed().as_secs_f64());
        let mut err = std::io::stderr().lock();
        let _ = match style {
            Style::Bar => write!(err, "\r\x1b[2K{line}"),
            Style::Lines => writeln!(err, "{line}"),
        };
        let _ = err.flush();
    }
}

/// Erases the bar (lines stay).
pub fn clear(style: Style) {
    if style == Style::Bar {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K");
        let _ = err.flush();
    }
}

/// The bar's text: progress is the nearer of the request and the time bound.
pub fn render(label: &str, bounds: Bounds, c: &Counters, elapsed: f64) -> String {
    let (sent, done, failed) =
        (c.sent.load(Ordering::Relaxed), c.done.load(Ordering::Relaxed), c.failed.load(Ordering::Relaxed));
    let by_requests = done as f64 / bounds.max_requests.max(1) as f64;
    let by_time = if bounds.max_seconds.is_finite() { elapsed / bounds.max_seconds } else { 0.0 };
    let frac = by_requests.max(by_time).clamp(0.0, 1.0);
    let width = 24;
    let filled = (frac * width as f64).round() as usize;
    format!(
        "{label} [{}{}] {done}/{} done, {} in flight, {failed} failed, {elapsed:.1} s",
        "#".repeat(filled),
        "-".repeat(width - filled),
        bounds.max_requests,
        sent - done
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bar_shows_the_nearer_bound() {
        let c = Counters::default();
        for _ in 0..4 {
            c.on_sent();
        }
        c.on_done(true);
        c.on_done(false);
        let b = Bounds::open(8, 10.0);
        let s = render("C=4", b, &c, 5.0);
        assert!(s.starts_with("C=4 [############------------] 2/8 done, 2 in flight, 1 failed"), "{s}");
        assert!(render("x", b, &c, 99.0).contains(&"#".repeat(24)));
    }
}
