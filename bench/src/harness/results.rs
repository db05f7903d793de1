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
    /// Where figures are written as they come; `None` for figures loaded
    /// from an earlier run's file.
    file: Option<File>,
}

impl Results {
    pub(crate) fn create(path: &Path) -> std::io::Result<Results> {
        Ok(Results {
            figures: Vec::new(),
            run: 1,
            file: Some(File::create(path)?),
        })
    }

    /// The figures an earlier run wrote to `path` (its `results.tsv`), to
    /// write its report again.
    pub(crate) fn load(path: &Path) -> Result<Results, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
        let mut r = Results {
            figures: Vec::new(),
            run: 1,
            file: None,
        };
        for (n, line) in text.lines().enumerate() {
            let bad = || {
                format!(
                    "{}:{}: not phase, metric, run and value separated by tabs",
                    path.display(),
                    n + 1
                )
            };
            let mut f = line.split('\t');
            let (Some(phase), Some(metric), Some(run), Some(value), None) =
                (f.next(), f.next(), f.next(), f.next(), f.next())
            else {
                return Err(bad());
            };
            r.run = run.parse().map_err(|_| bad())?;
            r.record(phase, metric, value.parse().map_err(|_| bad())?);
        }
        Ok(r)
    }

    /// The runs recorded, and the phases they ran (a retention way's
    /// figures count as the phase `retention`).
    pub(crate) fn runs_and_phases(&self) -> (u32, Vec<String>) {
        let mut phases: Vec<String> = Vec::new();
        for f in &self.figures {
            let p = if f.phase.starts_with("retention_") {
                "retention"
            } else {
                &f.phase
            };
            if !phases.iter().any(|q| q == p) {
                phases.push(p.to_owned());
            }
        }
        (self.run, phases)
    }

    /// The run the next figures belong to (1-based).
    pub(crate) fn set_run(&mut self, run: u32) {
        self.run = run;
    }

    pub(crate) fn record(&mut self, phase: &str, metric: &str, value: f64) {
        // The file is a copy for later digging; a failed write loses nothing
        // the report needs.
        if let Some(file) = &mut self.file {
            let _ = writeln!(file, "{phase}\t{metric}\t{}\t{value}", self.run);
        }
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

    /// Every figure of `metric` over the runs, sorted.
    pub(crate) fn all(&self, phase: &str, metric: &str) -> Vec<f64> {
        self.values(phase, metric)
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
        self.stat_scaled(phase, metric, 1.0, decimals, unit)
    }

    /// [`Results::stat`] of the figures times `factor` (bytes as MB: 1e-6).
    pub(crate) fn stat_scaled(
        &self,
        phase: &str,
        metric: &str,
        factor: f64,
        decimals: usize,
        unit: &str,
    ) -> String {
        let v: Vec<f64> = self
            .values(phase, metric)
            .into_iter()
            .map(|x| x * factor)
            .collect();
        let Some(m) = median(&v) else {
            return "–".into();
        };
        let (lo, hi) = (v[0], v[v.len() - 1]);
        let f = |x: f64| format!("{}{unit}", grouped(x, decimals));
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

/// `x` with `decimals`, its whole part in groups of three from 10,000 up
/// (`129,462`; `4.88`; `2500`).
fn grouped(x: f64, decimals: usize) -> String {
    let text = format!("{x:.decimals$}");
    let (sign, digits) = text
        .strip_prefix('-')
        .map_or(("", text.as_str()), |d| ("-", d));
    let (whole, fraction) = digits
        .split_once('.')
        .map_or((digits, None), |(w, f)| (w, Some(f)));
    if whole.len() < 5 {
        return text;
    }
    let mut out = String::from(sign);
    for (i, c) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if let Some(f) = fraction {
        out.push('.');
        out.push_str(f);
    }
    out
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

    #[test]
    fn large_figures_are_grouped_by_thousands() {
        assert_eq!(grouped(129_462.4, 0), "129,462");
        assert_eq!(grouped(1_000_000.0, 0), "1,000,000");
        assert_eq!(grouped(27_303_936.0, 1), "27,303,936.0");
        assert_eq!(grouped(2500.0, 0), "2500");
        assert_eq!(grouped(4.876, 2), "4.88");
        assert_eq!(grouped(-12_345.0, 0), "-12,345");
    }

    #[test]
    fn a_run_s_file_loads_back_into_the_same_report() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.tsv");
        let mut r = Results::create(&path).unwrap();
        for (run, v) in [(1, 3.0), (2, 1.0)] {
            r.set_run(run);
            r.record("small", "walbox_eps", v);
            r.record("retention_none", "p99_ms", v * 2.0);
        }
        let back = Results::load(&path).unwrap();
        assert_eq!(
            back.stat("small", "walbox_eps", 1, ""),
            r.stat("small", "walbox_eps", 1, "")
        );
        assert_eq!(
            back.runs_and_phases(),
            (2, vec!["small".to_owned(), "retention".to_owned()])
        );
        std::fs::write(&path, "small\twalbox_eps\tone\t3\n").unwrap();
        let Err(e) = Results::load(&path) else {
            panic!("a run that is not a number loaded");
        };
        assert!(e.contains("results.tsv:1"), "{e}");
    }
}
