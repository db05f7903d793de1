//! What walbox writes to stderr, and how.
//!
//! - Text or JSON ([`LogFormat`]); in JSON mode every line is one JSON object,
//!   the final fatal line included ([`fatal`]).
//! - Colour only when stderr is a terminal and `NO_COLOR` is not set: files,
//!   journald and `kubectl logs` get plain text.
//! - Filtering as `RUST_LOG` does (`info`, `walbox=debug,rdkafka=warn`, …),
//!   read from `WALBOX_LOG`, else `RUST_LOG`, else `info`.
//! - Repeated warnings and errors are rate-limited ([`Repeats`]): the first
//!   [`BURST`] lines alike in a [`WINDOW`] are written, the rest counted and
//!   summed up in one line when the window ends ([`report_repeats`]). A
//!   flapping dependency costs a handful of lines, not hundreds.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::sync::{Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::LogFormat;

/// Lines alike written per window before the rest are only counted.
pub const BURST: u32 = 3;
/// The rate-limiting window.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Fields whose value changes from one repetition to the next without making
/// it a different problem (a backoff's jittered delay, a position, a
/// duration): left out when deciding whether two lines are alike.
const VOLATILE_FIELDS: [&str; 4] = ["retry_in", "stalled_for", "lsn", "slot"];

static FORMAT: OnceLock<LogFormat> = OnceLock::new();
static REPEATS: Mutex<Option<Repeats<Key>>> = Mutex::new(None);

/// Sets up logging to stderr, once (later calls change nothing).
pub fn init(format: LogFormat) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = FORMAT.set(format);
        *REPEATS.lock().unwrap_or_else(|p| p.into_inner()) = Some(Repeats::default());
        let filter = EnvFilter::try_from_env("WALBOX_LOG")
            .or_else(|_| EnvFilter::try_from_default_env())
            .unwrap_or_else(|_| EnvFilter::new("info"));
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(crate::redaction::Stderr)
            .with_ansi(colour());
        let registry = tracing_subscriber::registry().with(filter).with(RateLimit);
        let _ = match format {
            LogFormat::Text => registry.with(fmt).try_init(),
            LogFormat::Json => registry.with(fmt.json()).try_init(),
        };
    });
}

/// Colour codes only for a person at a terminal.
fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Writes the line a failed command ends with, in the format of the lines
/// before it. Before logging was set up (a configuration error) JSON is
/// used when `WALBOX_LOG_FORMAT=json` or `--log-format json` asked for it.
pub fn fatal(line: &str) {
    report_repeats_now();
    let line: &str = &crate::redaction::redact(line);
    let json = match FORMAT.get() {
        Some(f) => *f == LogFormat::Json,
        None => asked_for_json(),
    };
    if json {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        // The shape and key order of tracing-subscriber's JSON lines.
        let object = format!(
            r#"{{"timestamp":{},"level":"ERROR","fields":{{"message":{}}},"target":"walbox"}}"#,
            serde_json::Value::from(crate::mapping::timestamp::rfc3339_ms(now)),
            serde_json::Value::from(line),
        );
        eprintln!("{object}");
    } else {
        eprintln!("{line}");
    }
}

/// Whether the environment or the command line asked for JSON logs.
pub fn asked_for_json() -> bool {
    if std::env::var("WALBOX_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json")) {
        return true;
    }
    let args: Vec<String> = std::env::args().collect();
    args.iter().enumerate().any(|(i, a)| {
        a == "--log-format=json"
            || (a == "--log-format" && args.get(i + 1).is_some_and(|v| v == "json"))
    })
}

/// Writes one line for every kind of line suppressed in a window that has
/// ended. `walbox run` calls it every few seconds.
pub fn report_repeats() {
    report(Instant::now());
}

/// Same, for every window, ended or not (before exiting).
fn report_repeats_now() {
    report(Instant::now() + WINDOW);
}

fn report(now: Instant) {
    let due = match REPEATS.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
        Some(r) => r.due(now),
        None => return,
    };
    for (line, count) in due {
        tracing::warn!(
            target: "walbox::logging",
            suppressed = count,
            "{count} more lines like this in the last {} s were not written: {line}",
            WINDOW.as_secs()
        );
    }
}

/// The layer that asks [`Repeats`] whether a warning or error is written.
struct RateLimit;

impl<S: Subscriber> Layer<S> for RateLimit {
    fn event_enabled(&self, event: &Event<'_>, _: Context<'_, S>) -> bool {
        let meta = event.metadata();
        if *meta.level() > Level::WARN || meta.target() == "walbox::logging" {
            return true;
        }
        let mut key = Fingerprint::default();
        event.record(&mut key);
        let key = (meta.callsite(), key.fields);
        let Ok(mut guard) = REPEATS.lock() else {
            return true;
        };
        match guard.as_mut() {
            Some(r) => r.admit(key, || meta_message(event), Instant::now()),
            None => true,
        }
    }
}

/// The event's message, for the summary line.
fn meta_message(event: &Event<'_>) -> String {
    struct Message(String);
    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                let _ = write!(self.0, "{value:?}");
            }
        }
    }
    let mut m = Message(String::new());
    event.record(&mut m);
    m.0
}

/// The field values that make two lines alike.
#[derive(Default)]
struct Fingerprint {
    fields: String,
}

impl Visit for Fingerprint {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if !VOLATILE_FIELDS.contains(&field.name()) {
            let _ = write!(self.fields, "{}={value:?};", field.name());
        }
    }
}

/// Identifies lines alike: the call site and its fields' values.
type Key = (tracing::callsite::Identifier, String);

/// Counts lines alike per window: the rate limiter's state, apart from the
/// clock so it can be tested.
pub struct Repeats<K> {
    seen: HashMap<K, Window>,
}

impl<K> Default for Repeats<K> {
    fn default() -> Self {
        Repeats {
            seen: HashMap::new(),
        }
    }
}

struct Window {
    started: Instant,
    written: u32,
    suppressed: u64,
    line: String,
}

/// At most this many kinds of lines are tracked; past it, lines are written.
const MAX_KINDS: usize = 1_000;

impl<K: std::hash::Hash + Eq> Repeats<K> {
    /// Whether a line with this key is written now; `line` (its message,
    /// for the summary) is only rendered for a line that is not.
    fn admit(&mut self, key: K, line: impl FnOnce() -> String, now: Instant) -> bool {
        if self.seen.len() >= MAX_KINDS && !self.seen.contains_key(&key) {
            self.seen
                .retain(|_, w| now.duration_since(w.started) < WINDOW);
            if self.seen.len() >= MAX_KINDS {
                return true;
            }
        }
        let w = self.seen.entry(key).or_insert_with(|| Window {
            started: now,
            written: 0,
            suppressed: 0,
            line: String::new(),
        });
        if now.duration_since(w.started) >= WINDOW && w.suppressed == 0 {
            w.started = now;
            w.written = 0;
        }
        if w.written < BURST && now.duration_since(w.started) < WINDOW {
            w.written += 1;
            return true;
        }
        w.suppressed += 1;
        w.line = line();
        false
    }

    /// The suppressed lines of windows ended by `now`, with their counts;
    /// those windows start again.
    fn due(&mut self, now: Instant) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        self.seen.retain(|_, w| {
            if now.duration_since(w.started) < WINDOW {
                return true;
            }
            if w.suppressed > 0 {
                out.push((std::mem::take(&mut w.line), w.suppressed));
            }
            false
        });
        out
    }
}

pub use crate::error_text::chain;

#[cfg(test)]
mod tests {
    use super::*;

    fn key(fields: &str) -> String {
        fields.to_owned()
    }

    #[test]
    fn a_burst_is_written_then_counted_then_summed_up_once() {
        let mut r = Repeats::<String>::default();
        let t0 = Instant::now();
        let written = (0..400)
            .filter(|i| {
                r.admit(
                    key("error=refused"),
                    || "broker down".into(),
                    t0 + Duration::from_millis(25 * i),
                )
            })
            .count();
        assert_eq!(written, BURST as usize, "400 lines alike in 10 s");
        assert!(
            r.due(t0 + Duration::from_secs(30)).is_empty(),
            "window not over"
        );
        assert_eq!(
            r.due(t0 + WINDOW),
            vec![("broker down".to_owned(), 400 - u64::from(BURST))]
        );
        assert!(r.due(t0 + WINDOW * 2).is_empty(), "said once");
        assert!(
            r.admit(
                key("error=refused"),
                || "broker down".into(),
                t0 + WINDOW * 2
            ),
            "a new window"
        );
    }

    #[test]
    fn different_lines_are_not_alike() {
        let mut r = Repeats::<String>::default();
        let t0 = Instant::now();
        for i in 0..10 {
            assert!(r.admit(key(&format!("error={i}")), || "x".into(), t0));
        }
    }

    #[test]
    fn lines_alike_but_spaced_out_are_all_written() {
        let mut r = Repeats::<String>::default();
        let t0 = Instant::now();
        for i in 0..10 {
            assert!(
                r.admit(key("e"), || "x".into(), t0 + WINDOW * i),
                "line {i}"
            );
        }
    }

    #[test]
    fn the_number_of_kinds_tracked_is_bounded() {
        let mut r = Repeats::<String>::default();
        let t0 = Instant::now();
        for i in 0..MAX_KINDS * 2 {
            assert!(r.admit(key(&i.to_string()), || "x".into(), t0));
        }
        assert!(r.seen.len() <= MAX_KINDS);
    }
}
