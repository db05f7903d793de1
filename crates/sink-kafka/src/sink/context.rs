//! The librdkafka callback side of the sink: the client and producer
//! context. Delivery callbacks hand their reports to [`super::Reports`]
//! without ever waiting (the channel has room for every record in flight);
//! client errors are logged once, scrubbed of secrets.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{DeliveryResult, ProducerContext};
use rdkafka::ClientContext;
use tokio::sync::{mpsc, Notify};

use sink_core::{Delivered, DeliveryErrorKind, Permit, Record};

use crate::config::redact_values;
use crate::error::Failure;
use crate::problem::{ProblemLog, Verdict};
use bytes::Bytes;

/// What travels with a record through librdkafka.
pub(super) struct Pending<T> {
    pub(super) token: T,
    pub(super) permits: Permit,
}

/// A delivery callback's result, sent to [`Reports`] with the permits.
pub(super) struct Raw<T> {
    pub(super) pending: Pending<T>,
    pub(super) report: Result<Delivered, Failure>,
    pub(super) returned: Option<Record<()>>,
    /// librdkafka's latency of a delivered record (see
    /// [`sink_core::Report::client_micros`]).
    pub(super) client_micros: Option<u64>,
}

pub(super) struct SinkContext<T> {
    pub(super) tx: mpsc::UnboundedSender<Raw<T>>,
    pub(super) room: Arc<Notify>,
    /// Secret property values, scrubbed from librdkafka's messages.
    pub(super) secrets: Arc<[String]>,
    /// Connection-level failures, for the startup check and for logging
    /// each one once rather than on every reconnect.
    pub(super) problems: Arc<ProblemLog>,
    pub(super) gap: Arc<Gap>,
    pub(super) movement: Arc<Movement>,
    pub(super) stats: Arc<crate::stats::StatsCell>,
    /// `AWS_MSK_IAM`'s token maker.
    pub(super) tokens: Option<Arc<crate::msk_iam::Tokens>>,
}

/// When the sink last saw deliveries move: a report, or records starting
/// to wait after none did. See [`Sink::stalled_for`].
pub(super) struct Movement {
    pub(super) start: Instant,
    /// Milliseconds since `start`.
    pub(super) last: AtomicU64,
}

impl Movement {
    pub(super) fn new() -> Movement {
        Movement {
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    pub(super) fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    pub(super) fn since(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Whether a record failed for good while the sink is gapless (see
/// [`SinkConfig::gapless`]): from then on nothing more is produced.
pub(super) struct Gap {
    pub(super) gapless: bool,
    pub(super) failed: AtomicBool,
}

impl Gap {
    /// Notes a record's failure.
    pub(super) fn note(&self, kind: DeliveryErrorKind) {
        if self.gapless
            && matches!(
                kind,
                DeliveryErrorKind::Permanent | DeliveryErrorKind::Fatal
            )
        {
            self.failed.store(true, Ordering::Release);
        }
    }

    /// True when nothing more may be produced.
    pub(super) fn closed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

impl<T: Send + Sync + 'static> ClientContext for SinkContext<T> {
    crate::msk_iam::serve_tokens!(tokens);

    fn error(&self, error: KafkaError, reason: &str) {
        let reason = redact_values(reason, &self.secrets);
        let verdict = match error.rdkafka_error_code() {
            Some(code) => self.problems.record(code, &reason),
            None => Verdict::Log(None),
        };
        match verdict {
            Verdict::Quiet => {}
            Verdict::Log(Some(problem)) if problem.kind.is_definite() => {
                tracing::error!(%problem, "Kafka refuses walbox's connection; deliveries wait until this is fixed (nothing is confirmed past them)");
            }
            Verdict::Log(_) => {
                let error = redact_values(&error.to_string(), &self.secrets);
                tracing::warn!(%error, %reason, "kafka client error");
            }
        }
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        self.stats.record(&statistics);
    }

    // librdkafka's own log lines repeat what the error callback reports
    // (above, deduplicated and scrubbed); keep the rest.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "FAIL" {
            return;
        }
        // walbox sets this one on purpose (see SinkConfig::gapless); the
        // "experimental" warning would greet every start.
        if fac == "CONFWARN" && log_message.contains("enable.gapless.guarantee is experimental") {
            return;
        }
        let line = redact_values(log_message, &self.secrets);
        rdkafka::client::DefaultClientContext.log(level, fac, &line);
    }
}

impl<T: Send + Sync + 'static> ProducerContext for SinkContext<T> {
    type DeliveryOpaque = Box<Pending<T>>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Box<Pending<T>>) {
        let raw = match result {
            Ok(m) => Raw {
                pending: *pending,
                report: Ok(Delivered::Kafka {
                    partition: m.partition(),
                    offset: m.offset(),
                }),
                returned: None,
                client_micros: latency_micros(m),
            },
            Err((e, m)) => {
                let error = Failure::from_kafka(e).with_authorization_hint(m.topic());
                self.gap.note(error.kind);
                // Copied only for the rare permanent refusal.
                let returned = (error.kind == DeliveryErrorKind::Permanent).then(|| Record {
                    topic: m.topic().into(),
                    key: m.key().map(Bytes::copy_from_slice),
                    value: m.payload().map(Bytes::copy_from_slice),
                    headers: m
                        .headers()
                        .map(|hs| {
                            hs.iter()
                                .map(|h| sink_core::Header {
                                    name: h.key.to_owned().into(),
                                    value: Bytes::copy_from_slice(h.value.unwrap_or_default()),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis(),
                    origin: None,
                    token: (),
                });
                Raw {
                    pending: *pending,
                    report: Err(error),
                    returned,
                    client_micros: None,
                }
            }
        };
        self.movement.touch();
        // Never waits. The channel is unbounded, but what it holds is
        // bounded by the admission: each report carries its record's permit.
        let _ = self.tx.send(raw);
        self.room.notify_waiters();
    }
}

/// librdkafka's latency of the record `m` reports, from its `produce()`
/// call until now (the delivery report), in µs; `None` when it keeps none.
#[allow(unsafe_code)]
fn latency_micros(m: &rdkafka::message::BorrowedMessage<'_>) -> Option<u64> {
    // SAFETY: `m` is the message of the delivery report being handled, valid
    // for the callback; the call only reads its enqueue time.
    let micros = unsafe { rdkafka::bindings::rd_kafka_message_latency(m.ptr()) };
    u64::try_from(micros).ok()
}
