//! The comparison's plots: for each workload and each plotted metric, one SVG with one
//! line per topology against the sweep (log2 x axis).

use super::CompareReport;
use crate::analysis::metric::Metric;
use crate::error::BenchError;
use crate::report::svg::{LinePlot, Series};
use std::path::{Path, PathBuf};

/// The plots of a report, as (file name, document).
pub fn render_all(r: &CompareReport) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for info in &r.workloads {
        let (w, description) = (info.name, &info.description);
        for m in Metric::PLOTTED {
            let series = r
                .runs
                .iter()
                .filter(|run| !run.workloads.is_empty())
                .map(|run| Series { name: run.topology.name.clone(), points: r.series(&run.topology.name, w, m) })
                .collect();
            let plot = LinePlot {
                title: format!("{} vs {} — {}", m.label(), r.x_name, w.name()),
                subtitle: format!("{description}; budget {} threads", r.budget),
                x_label: r.x_name.clone(),
                y_label: m.label().into(),
                log2_x: true,
                series,
            };
            out.push((format!("{}-{}.svg", w.name(), m.slug()), plot.render()));
        }
    }
    out
}

/// Writes every plot under `dir`; returns their paths.
pub fn write_all(dir: &Path, r: &CompareReport) -> Result<Vec<PathBuf>, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    let mut paths = Vec::new();
    for (name, doc) in render_all(r) {
        let path = dir.join(name);
        std::fs::write(&path, doc).map_err(|e| BenchError::io(&path, e))?;
        paths.push(path);
    }
    Ok(paths)
}
