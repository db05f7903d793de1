//! walbox's own span per event, exported over OTLP when `otlp_endpoint` is
//! set: from the event's commit in Postgres to the broker's acknowledgement
//! (exactly-once: to its Kafka transaction's commit).
//!
//! The span joins the trace of the request that wrote the event: its parent
//! is the event's `traceparent` (a header from the row or the message). The
//! record then carries walbox's span as its `traceparent`, so a consumer's
//! span is a child of walbox's, which is a child of the writer's:
//!
//! ```text
//! request (app) ──► publish outbox.event.order (walbox: commit → ack) ──► process (consumer)
//! ```
//!
//! An event without a `traceparent` starts a trace of its own. One whose
//! `traceparent` says "not sampled" gets no span and keeps its header as
//! written. Off by default: then nothing here runs, and the header passes
//! through untouched. Export is best effort: a batch processor on its own
//! thread, a bounded queue (spans beyond it are dropped, never waited for).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracerProvider};
use pgoutput_decoder::{Lsn, PgTimestamp};
use sink_core::Header;

use crate::mapping::{MappedEvent, TRACEPARENT, TRACESTATE};

/// The exporter, shared by the sessions.
#[derive(Clone)]
pub struct Spans {
    provider: SdkTracerProvider,
    tracer: Arc<opentelemetry_sdk::trace::Tracer>,
    endpoint: String,
}

impl std::fmt::Debug for Spans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spans")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

/// A span begun when its event was mapped, ended at its acknowledgement.
#[derive(Clone, Debug)]
pub struct EventSpan {
    trace_id: TraceId,
    span_id: SpanId,
    /// The writer's span, from the event's `traceparent`.
    parent: Option<(SpanId, TraceState)>,
    event_id: String,
    key: String,
}

/// A parsed W3C `traceparent`: trace id, parent span id, flags.
pub fn parse_traceparent(value: &[u8]) -> Option<(TraceId, SpanId, TraceFlags)> {
    let text = std::str::from_utf8(value).ok()?;
    // Version 00 is exactly 55 characters; a later version may append
    // fields after these (read as 00), and ff is invalid.
    let version = text.get(0..2)?;
    if version == "ff" || (version == "00" && text.len() != 55) || text.len() < 55 {
        return None;
    }
    let hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let (v, trace, span, flags) = (&text[0..2], &text[3..35], &text[36..52], &text[53..55]);
    if ![v, trace, span, flags].iter().all(|p| hex(p))
        || [2, 35, 52].iter().any(|&i| text.as_bytes()[i] != b'-')
        || (text.len() > 55 && text.as_bytes()[55] != b'-')
    {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    Some((trace_id, span_id, flags))
}

impl Spans {
    /// Exports to the OTLP/HTTP collector at `endpoint` (`http://host:4318`;
    /// spans go to `<endpoint>/v1/traces`, protobuf).
    pub fn new(endpoint: &str) -> Result<Spans, String> {
        let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| {
                let shown = crate::config::redact_userinfo(endpoint);
                crate::config::redact_userinfo(&format!("otlp_endpoint {shown:?}: {e}"))
            })?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("walbox")
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build();
        let tracer = Arc::new(provider.tracer("walbox"));
        Ok(Spans {
            provider,
            tracer,
            endpoint: endpoint.to_owned(),
        })
    }

    /// Begins `event`'s span: its `traceparent` becomes walbox's span, a
    /// child of the one the event carried. `None` when the writer's trace
    /// is not sampled.
    pub fn begin(&self, event: &mut MappedEvent) -> Option<Box<EventSpan>> {
        let parent = event.header(TRACEPARENT).and_then(|v| parse_traceparent(v));
        if parent.is_some_and(|(_, _, flags)| !flags.is_sampled()) {
            return None;
        }
        let ids = RandomIdGenerator::default();
        let trace_id = parent.map_or_else(|| ids.new_trace_id(), |(t, _, _)| t);
        let span_id = ids.new_span_id();
        let state = event
            .header(TRACESTATE)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|s| TraceState::from_key_value(parse_tracestate(s)).ok())
            .unwrap_or_default();
        let value = Bytes::from(format!("00-{trace_id}-{span_id}-01"));
        match event.headers.iter_mut().find(|h| h.name == TRACEPARENT) {
            Some(h) => h.value = value,
            None => event.headers.push(Header {
                name: TRACEPARENT.into(),
                value,
            }),
        }
        Some(Box::new(EventSpan {
            trace_id,
            span_id,
            parent: parent.map(|(_, span, _)| (span, state)),
            event_id: event.event_id.clone(),
            key: event.aggregate_id.clone(),
        }))
    }

    /// Ends `span` now: it started at the event's commit.
    pub fn end(&self, span: &EventSpan, committed: PgTimestamp, topic: &str, lsn: Lsn) {
        let micros = committed.as_unix_micros();
        let start = if micros >= 0 {
            SystemTime::UNIX_EPOCH + Duration::from_micros(micros as u64)
        } else {
            SystemTime::now()
        };
        let builder = self
            .tracer
            .span_builder(format!("publish {topic}"))
            .with_kind(SpanKind::Producer)
            .with_start_time(start)
            .with_trace_id(span.trace_id)
            .with_span_id(span.span_id)
            .with_attributes([
                KeyValue::new("messaging.system", "kafka"),
                KeyValue::new("messaging.operation.type", "publish"),
                KeyValue::new("messaging.destination.name", topic.to_owned()),
                KeyValue::new("messaging.message.id", span.event_id.clone()),
                KeyValue::new("messaging.kafka.message.key", span.key.clone()),
                KeyValue::new("db.system.name", "postgresql"),
                KeyValue::new("walbox.lsn", lsn.to_string()),
            ]);
        let cx = match &span.parent {
            Some((parent, state)) => Context::new().with_remote_span_context(SpanContext::new(
                span.trace_id,
                *parent,
                TraceFlags::SAMPLED,
                true,
                state.clone(),
            )),
            None => Context::new(),
        };
        let mut s = self.tracer.build_with_context(builder, &cx);
        opentelemetry::trace::Span::end_with_timestamp(&mut s, SystemTime::now());
    }

    /// Exports what is queued and stops the exporter (on its own thread:
    /// the HTTP client blocks).
    pub async fn shutdown(self) {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || provider.shutdown()).await;
    }
}

/// `key=value` pairs of a `tracestate`, without the optional spaces W3C
/// allows around its commas (`TraceState`'s own `FromStr` keeps them in the
/// keys and refuses the state); invalid pairs make
/// [`TraceState::from_key_value`] drop the whole state.
fn parse_tracestate(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter_map(|member| {
            let (k, v) = member.trim().split_once('=')?;
            Some((k.to_owned(), v.to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_w3c_traceparents() {
        let (t, s, f) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(t.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(s.to_string(), "00f067aa0ba902b7");
        assert!(f.is_sampled());
        let (_, _, f) =
            parse_traceparent(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!f.is_sampled());
        // A later version may append fields.
        assert!(parse_traceparent(
            b"cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds"
        )
        .is_some());
        for bad in [
            &b""[..],
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            b"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            b"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            b"\xff\xfe",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }
}
