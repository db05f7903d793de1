//! `walbox doctor`: a deployment checked end to end before it goes live,
//! one [`Finding`] per check — what was seen, the verdict, and the fix
//! (the exact SQL or property).
//!
//! Each area gathers its facts (the only I/O) and judges them in a plain
//! function, so that every verdict is tested without a server:
//! [`postgres`] (the server, the role, the publication, the tables, the
//! slot), [`kafka`] (topics, their settings and the principal's rights, by
//! a look that writes nothing) and [`local`] (the metrics port, the
//! certificates). The command ([`crate::commands::doctor`]) prints them and
//! turns the worst verdict into the exit status.

pub mod brokers;
pub mod kafka;
pub mod local;
pub mod postgres;

use serde::Serialize;

/// A check's verdict, from best to worst as the exit status ranks them
/// (`Unchecked` ranks between a warning and a failure: a check that could
/// not be made may hide one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Fine.
    Pass,
    /// Nothing to judge, said for the record (a slot not yet created, a
    /// right no look can reveal): never changes the exit status.
    Info,
    /// Works, but risks an outage or data held longer than needed.
    Warn,
    /// Could not be checked: what it needed was unreachable or refused.
    Unchecked,
    /// `walbox run` would fail, or lose or stall events.
    Fail,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Info => "info",
            Verdict::Warn => "WARN",
            Verdict::Unchecked => "UNCHECKED",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// The check, dotted: `postgres.wal_level`, `kafka.topic.replication`.
    pub check: &'static str,
    /// Its verdict.
    pub verdict: Verdict,
    /// What it saw (and, past a pass, why that matters).
    pub saw: String,
    /// How to fix it: a statement or a property; `None` on a pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    /// A pass.
    pub fn pass(check: &'static str, saw: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Pass, saw, None::<String>)
    }

    /// For the record.
    pub fn info(check: &'static str, saw: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Info, saw, None::<String>)
    }

    /// A warning, with its fix.
    pub fn warn(check: &'static str, saw: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Warn, saw, Some(fix))
    }

    /// A warning whose text already says its fix (walbox's own warnings).
    pub fn warn_said(check: &'static str, saw: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Warn, saw, None::<String>)
    }

    /// A failure, with its fix.
    pub fn fail(check: &'static str, saw: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Fail, saw, Some(fix))
    }

    /// Not checked, and why (the fix: what to make reachable).
    pub fn unchecked(check: &'static str, why: impl Into<String>) -> Finding {
        Finding::new(check, Verdict::Unchecked, why, None::<String>)
    }

    fn new(
        check: &'static str,
        verdict: Verdict,
        saw: impl Into<String>,
        fix: Option<impl Into<String>>,
    ) -> Finding {
        Finding {
            check,
            verdict,
            saw: one_line(&saw.into()),
            fix: fix.map(|f| one_line(&f.into())),
        }
    }

    /// The text form: one line.
    pub fn line(&self) -> String {
        let mut line = format!("{:9} {}: {}", self.verdict.label(), self.check, self.saw);
        if let Some(fix) = &self.fix {
            line.push_str(" — fix: ");
            line.push_str(fix);
        }
        crate::redaction::redact(&line).into_owned()
    }
}

/// Line breaks folded: a finding is one line.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every finding of one run.
#[derive(Debug, Default)]
pub struct Report {
    findings: Vec<Finding>,
}

impl Report {
    /// Adds findings.
    pub fn extend(&mut self, findings: impl IntoIterator<Item = Finding>) {
        self.findings.extend(findings);
    }

    /// The findings, in the order made.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// The exit status: 0 when everything passed, 1 a warning, 2 a
    /// failure, 3 a check that could not be made (and no failure).
    pub fn exit_status(&self) -> u8 {
        let worst = self.findings.iter().map(|f| f.verdict).max();
        match worst {
            None | Some(Verdict::Pass) | Some(Verdict::Info) => 0,
            Some(Verdict::Warn) => 1,
            Some(Verdict::Unchecked) => 3,
            Some(Verdict::Fail) => 2,
        }
    }

    /// How many of each verdict, in words: "2 failed, 1 warning".
    pub fn summary(&self) -> String {
        let count = |v: Verdict| self.findings.iter().filter(|f| f.verdict == v).count();
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        let mut parts = vec![plural(count(Verdict::Pass), "passed", "passed")];
        for (v, one, many) in [
            (Verdict::Warn, "warning", "warnings"),
            (Verdict::Fail, "failed", "failed"),
            (Verdict::Unchecked, "not checked", "not checked"),
        ] {
            let n = count(v);
            if n > 0 {
                parts.push(plural(n, one, many));
            }
        }
        parts.join(", ")
    }

    /// The JSON form: `{"checks": [...], "summary": ..., "exit_status": n}`,
    /// secrets redacted like the text.
    pub fn json(&self) -> String {
        let value = serde_json::json!({
            "checks": self.findings,
            "summary": self.summary(),
            "exit_status": self.exit_status(),
        });
        crate::redaction::redact(&value.to_string()).into_owned()
    }
}

/// A byte count for people: `1.5 GiB`.
pub(crate) fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{n} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_verdict_sets_the_exit_status() {
        let mut r = Report::default();
        assert_eq!(r.exit_status(), 0);
        r.extend([Finding::pass("a", "ok"), Finding::info("b", "slot absent")]);
        assert_eq!(r.exit_status(), 0);
        r.extend([Finding::warn("c", "one replica", "more")]);
        assert_eq!(r.exit_status(), 1);
        r.extend([Finding::unchecked("d", "unreachable")]);
        assert_eq!(r.exit_status(), 3);
        r.extend([Finding::fail("e", "wal_level replica", "set it")]);
        assert_eq!(r.exit_status(), 2);
        assert_eq!(r.summary(), "1 passed, 1 warning, 1 failed, 1 not checked");
    }

    #[test]
    fn a_finding_is_one_redacted_line() {
        let f = Finding::fail(
            "postgres.connect",
            "cannot connect to postgres://walbox:hunter2@db/app:\nrefused",
            "check pg_url",
        );
        let line = f.line();
        assert!(!line.contains('\n'), "{line}");
        assert!(!line.contains("hunter2"), "{line}");
        assert!(line.starts_with("FAIL      postgres.connect: "), "{line}");
        assert!(line.ends_with(" — fix: check pg_url"), "{line}");
        let mut r = Report::default();
        r.extend([f]);
        assert!(!r.json().contains("hunter2"));
        let parsed: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(parsed["checks"][0]["verdict"], "fail");
        assert_eq!(parsed["exit_status"], 2);
    }

    #[test]
    fn bytes_read_as_units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }
}
