//! The raw figures of a run (one line per phase, metric and run, also
//! written to `results.tsv` as they come) and what the report makes of
//! them: the median over the runs, with the range.

use std::fs::File;
use std::io::Write;
use std::path::Path;

struct Figure {
    phase: String,
    metric: String,
    value: f64,
}

pub(crate) struct Results {
    figures: Vec<Figure>,
    run: u32,
    file: File,
}

impl Results {
    pub(crate) fn create(path: &Path) -> std::io::Result<Results> {
        Ok(Results {
            figures: Vec::new(),
            run: 1,
            file: File::create(path)?,
        })
    }

    /// The run the next figures belong to (1-based).
    pub(crate) fn set_run(&mut self, run: u32) {
        self.run = run;
    }

    pub(crate) fn record(&mut self, phase: &str, metric: &str, value: f64) {
        // The file is a copy for later digging; a failed write loses nothing
        // the report needs.
        let _ = writeln!(self.file, "{phase}\t{metric}\t{}\t{value}", self.run);
        self.figures.push(Figure {
            phase: phase.to_owned(),
            metric: metric.to_owned(),
            value,
        });
    }

    fn values(&self, phase: &str, metric: &str) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .figures
            .iter()
            .filter(|f| f.phase == phase && f.metric == metric)
            .map(|f| f.value)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    pub(crate) fn has(&self, phase: &str, metric: &str) -> bool {
        self.figures
            .iter()
            .any(|f| f.phase == phase && f.metric == metric)
    }

    pub(crate) fn median(&self, phase: &str, metric: &str) -> Option<f64> {
        median(&self.values(phase, metric))
    }

    /// The median with `decimals` and `unit`, and the range when the runs
    /// differ: `1.52 s (1.49 s–1.60 s)`; `–` when never measured.
    pub(crate) fn stat(&self, phase: &str, metric: &str, decimals: usize, unit: &str) -> String {
        let v = self.values(phase, metric);
        let Some(m) = median(&v) else {
            return "–".into();
        };
        let (lo, hi) = (v[0], v[v.len() - 1]);
        let f = |x: f64| format!("{x:.decimals$}{unit}");
        if v.len() > 1 && f(lo) != f(hi) {
            format!("{} ({}–{})", f(m), f(lo), f(hi))
        } else {
            f(m)
        }
    }

    /// The median of `a` over the median of `b`, of one phase.
    pub(crate) fn ratio(&self, phase: &str, a: &str, b: &str) -> Option<f64> {
        let (a, b) = (self.median(phase, a)?, self.median(phase, b)?);
        (b > 0.0).then(|| a / b)
    }
}

fn median(sorted: &[f64]) -> Option<f64> {
    let n = sorted.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(sorted[n / 2]),
        _ => Some((sorted[n / 2 - 1] + sorted[n / 2]) / 2.0),
    }
}

/// The exact `q` quantile (0–1) of sorted values: the smallest value with
/// at least `q` of all at or below it.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_ranges_and_quantiles() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Results::create(&dir.path().join("r.tsv")).unwrap();
        for (run, v) in [(1, 3.0), (2, 1.0), (3, 2.0)] {
            r.set_run(run);
            r.record("p", "m", v);
        }
        r.record("p", "one", 5.0);
        assert_eq!(r.stat("p", "m", 1, " s"), "2.0 s (1.0 s–3.0 s)");
        assert_eq!(r.stat("p", "one", 0, ""), "5");
        assert_eq!(r.stat("p", "none", 0, ""), "–");
        assert_eq!(r.ratio("p", "one", "m"), Some(2.5));
        let file = std::fs::read_to_string(dir.path().join("r.tsv")).unwrap();
        assert!(file.starts_with("p\tm\t1\t3\n"), "{file}");

        let v: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 500.0);
        assert_eq!(quantile(&v, 0.99), 990.0);
        assert_eq!(quantile(&v, 0.999), 999.0);
        assert_eq!(quantile(&v, 1.0), 1000.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }
}
