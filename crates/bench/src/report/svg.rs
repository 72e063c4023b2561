//! A small SVG line-plot writer: axes, ticks, labels, one line per series, legend.
//! Enough for "metric vs concurrency, one line per topology"; no plotting crate.

use std::fmt::Write;

/// One line of the plot. `None` values leave a gap (e.g. a point where every request
/// failed, so the metric does not exist).
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, Option<f64>)>,
}

/// A plot description.
#[derive(Clone, Debug, PartialEq)]
pub struct LinePlot {
    pub title: String,
    /// A smaller second line under the title (may be empty).
    pub subtitle: String,
    pub x_label: String,
    pub y_label: String,
    /// Log base 2 x axis (concurrency 1, 2, 4, ... evenly spaced).
    pub log2_x: bool,
    pub series: Vec<Series>,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 52.0;
const BOTTOM: f64 = 56.0;
const COLORS: &[&str] = &["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// Escapes text for SVG content and attributes.
pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Round tick positions covering `[lo, hi]`: steps of 1, 2 or 5 × 10^k, about 5 ticks.
pub fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::EPSILON);
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let start = (lo / step).floor() as i64;
    let end = (hi / step).ceil() as i64;
    (start..=end).map(|i| i as f64 * step).collect()
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 || (v.abs() >= 1.0 && v.fract() == 0.0) {
        format!("{v:.0}")
    } else if v.abs() >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

impl LinePlot {
    /// The SVG document.
    pub fn render(&self) -> String {
        let xs: Vec<f64> = self.series.iter().flat_map(|s| s.points.iter().map(|p| self.tx(p.0))).collect();
        let ys: Vec<f64> = self.series.iter().flat_map(|s| s.points.iter().filter_map(|p| p.1)).collect();
        let (x0, x1) = span(&xs, 0.0, 1.0);
        let yticks = nice_ticks(0.0_f64.min(min(&ys)), max(&ys).max(f64::MIN_POSITIVE));
        let (y0, y1) = (yticks.first().copied().unwrap_or(0.0), yticks.last().copied().unwrap_or(1.0));
        let frame = Frame { x0, x1, y0, y1: if y1 > y0 { y1 } else { y0 + 1.0 } };
        let mut s = String::new();
        let _ = write!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = write!(s, r#"<rect x="0" y="0" width="{W}" height="{H}" fill="white"/>"#);
        let _ = write!(
            s,
            r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
            W / 2.0,
            escape(&self.title)
        );
        self.axes(&mut s, &frame, &yticks);
        if ys.is_empty() {
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">no data</text>"#,
                frame.px(0.5 * (x0 + x1)),
                H / 2.0
            );
        }
        for (i, series) in self.series.iter().enumerate() {
            self.line(&mut s, &frame, series, COLORS[i % COLORS.len()]);
        }
        self.legend(&mut s);
        s.push_str("</svg>\n");
        s
    }

    /// Data x → axis x (log2 when asked; non-positive values are clamped).
    fn tx(&self, x: f64) -> f64 {
        if self.log2_x {
            x.max(f64::MIN_POSITIVE).log2()
        } else {
            x
        }
    }

    fn axes(&self, s: &mut String, f: &Frame, yticks: &[f64]) {
        let (l, r, t, b) = (LEFT, W - RIGHT, TOP, H - BOTTOM);
        let _ = write!(s, r#"<g stroke="black" fill="none"><path d="M{l} {t} L{l} {b} L{r} {b}"/></g>"#);
        for &v in yticks {
            let y = f.py(v);
            let _ = write!(s, r##"<line x1="{l}" y1="{y:.1}" x2="{r}" y2="{y:.1}" stroke="#e0e0e0"/>"##);
            let _ = write!(s, r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#, l - 6.0, y + 4.0, fmt_tick(v));
        }
        for (pos, label) in self.xticks(f) {
            let x = f.px(pos);
            let _ = write!(s, r#"<line x1="{x:.1}" y1="{b}" x2="{x:.1}" y2="{}" stroke="black"/>"#, b + 5.0);
            let _ = write!(s, r#"<text x="{x:.1}" y="{}" text-anchor="middle">{label}</text>"#, b + 19.0);
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            (l + r) / 2.0,
            H - 12.0,
            escape(&self.x_label)
        );
        let _ = write!(
            s,
            r#"<text x="18" y="{0}" text-anchor="middle" transform="rotate(-90 18 {0})">{1}</text>"#,
            (t + b) / 2.0,
            escape(&self.y_label)
        );
    }

    /// (axis position, label) of each x tick: powers of two on a log2 axis.
    fn xticks(&self, f: &Frame) -> Vec<(f64, String)> {
        if self.log2_x {
            let (a, b) = (f.x0.ceil() as i32, f.x1.floor() as i32);
            (a..=b).map(|k| (f64::from(k), fmt_tick(2f64.powi(k)))).collect()
        } else {
            nice_ticks(f.x0, f.x1).into_iter().filter(|v| *v >= f.x0 && *v <= f.x1).map(|v| (v, fmt_tick(v))).collect()
        }
    }

    fn line(&self, s: &mut String, f: &Frame, series: &Series, color: &str) {
        let mut points: Vec<(f64, Option<f64>)> = series.points.iter().map(|&(x, y)| (self.tx(x), y)).collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        for run in points.split(|p| p.1.is_none()).filter(|r| !r.is_empty()) {
            let coords: Vec<String> =
                run.iter().filter_map(|&(x, y)| Some(format!("{:.1},{:.1}", f.px(x), f.py(y?)))).collect();
            let _ =
                write!(s, r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#, coords.join(" "));
        }
        for &(x, y) in &points {
            if let Some(y) = y {
                let _ = write!(s, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#, f.px(x), f.py(y));
            }
        }
    }

    fn legend(&self, s: &mut String) {
        let x = W - RIGHT + 16.0;
        for (i, series) in self.series.iter().enumerate() {
            let y = TOP + 10.0 + 20.0 * i as f64;
            let color = COLORS[i % COLORS.len()];
            let _ =
                write!(s, r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{color}" stroke-width="3"/>"#, x + 22.0);
            let _ = write!(s, r#"<text x="{}" y="{}">{}</text>"#, x + 28.0, y + 4.0, escape(&series.name));
        }
    }
}

/// Maps data coordinates to pixels.
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.x0) / (self.x1 - self.x0) * (W - RIGHT - LEFT)
    }
    fn py(&self, y: f64) -> f64 {
        H - BOTTOM - (y - self.y0) / (self.y1 - self.y0) * (H - BOTTOM - TOP)
    }
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

/// `[min, max]` of `v` with 5 % of room on each side (so end points do not sit on the
/// frame), widened when empty or a single value.
fn span(v: &[f64], lo: f64, hi: f64) -> (f64, f64) {
    if v.is_empty() {
        return (lo, hi);
    }
    let (a, b) = (min(v), max(v));
    if b > a {
        let pad = 0.05 * (b - a);
        (a - pad, b + pad)
    } else {
        (a - 0.5, b + 0.5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal XML well-formedness check: tags balance, attributes are quoted,
    /// text has no raw `<` or `&` outside entities.
    fn check_xml(doc: &str) -> Result<Vec<String>, String> {
        let mut stack: Vec<String> = Vec::new();
        let mut names = Vec::new();
        let mut rest = doc.trim();
        while !rest.is_empty() {
            if let Some(after) = rest.strip_prefix('<') {
                let end = after.find('>').ok_or("unclosed tag")?;
                let tag = &after[..end];
                if tag.matches('"').count() % 2 != 0 {
                    return Err(format!("unbalanced quotes in <{tag}>"));
                }
                if let Some(name) = tag.strip_prefix('/') {
                    if stack.pop().as_deref() != Some(name) {
                        return Err(format!("unexpected </{name}>"));
                    }
                } else {
                    let name = tag.split_whitespace().next().ok_or("empty tag")?.trim_end_matches('/').to_string();
                    names.push(name.clone());
                    if !tag.ends_with('/') {
                        stack.push(name);
                    }
                }
                rest = &after[end + 1..];
            } else {
                let end = rest.find('<').unwrap_or(rest.len());
                let text = &rest[..end];
                for (i, _) in text.match_indices('&') {
                    if !["&amp;", "&lt;", "&gt;", "&quot;"].iter().any(|e| text[i..].starts_with(e)) {
                        return Err(format!("raw & in {text:?}"));
                    }
                }
                rest = &rest[end..];
            }
        }
        if stack.is_empty() {
            Ok(names)
        } else {
            Err(format!("unclosed {stack:?}"))
        }
    }

    fn plot(series: Vec<Series>) -> LinePlot {
        LinePlot {
            title: "TTFT p99 <prefill-heavy> & co".into(),
            subtitle: "ISL 2048 / OSL 64".into(),
            x_label: "concurrency".into(),
            y_label: "ms".into(),
            log2_x: true,
            series,
        }
    }

    #[test]
    fn plot_is_well_formed_with_one_line_per_series_and_a_legend() {
        let p = plot(vec![
            Series { name: "single".into(), points: vec![(1.0, Some(10.0)), (2.0, Some(20.0)), (4.0, Some(35.0))] },
            Series { name: "disagg-1p1d".into(), points: vec![(1.0, Some(12.0)), (2.0, None), (4.0, Some(30.0))] },
        ]);
        let doc = p.render();
        let names = check_xml(&doc).unwrap();
        assert_eq!(names[0], "svg");
        // Series 2 is split by its gap into two runs.
        assert_eq!(names.iter().filter(|n| *n == "polyline").count(), 3);
        assert_eq!(names.iter().filter(|n| *n == "circle").count(), 5);
        assert!(doc.contains("&lt;prefill-heavy&gt; &amp; co"));
        assert!(doc.contains(">single</text>") && doc.contains(">disagg-1p1d</text>"));
        for tick in [">1</text>", ">2</text>", ">4</text>"] {
            assert!(doc.contains(tick), "missing x tick {tick}");
        }
    }

    #[test]
    fn empty_and_single_point_plots_still_render() {
        assert!(check_xml(&plot(vec![]).render()).unwrap().contains(&"svg".to_string()));
        let one = plot(vec![Series { name: "a".into(), points: vec![(8.0, Some(3.0))] }]);
        let doc = one.render();
        check_xml(&doc).unwrap();
        assert!(!doc.contains("NaN") && !doc.contains("inf"));
        let none = plot(vec![Series { name: "a".into(), points: vec![(8.0, None)] }]).render();
        assert!(none.contains("no data"));
    }

    #[test]
    fn nice_ticks_cover_the_range_with_round_steps() {
        assert_eq!(nice_ticks(0.0, 10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = nice_ticks(0.0, 237.0);
        assert_eq!((t[0], t[1], *t.last().unwrap()), (0.0, 50.0, 250.0));
        assert!(nice_ticks(0.0, 0.003).len() >= 3);
    }
}
