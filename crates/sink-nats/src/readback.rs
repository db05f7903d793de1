//! Reading JetStream back without consuming: an ordered consumer (ephemeral,
//! unacknowledged, gone when the read ends) on each stream that takes the
//! subjects read. A stream's messages stay for every other consumer.
//!
//! - **Order**: a stream orders every subject it takes by one sequence
//!   number: partition 0, offset the sequence.
//! - **From**: the first message stored at or after a time (the server's
//!   arrival time), or the first one.
//! - **To**: the stream's last sequence when the read starts.
//! - **Streams that forget what was consumed** (retention `workqueue` or
//!   `interest`) cannot be read back: what a consumer took is gone, so a
//!   read refuses them, in one line.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::context::GetStreamByNameErrorKind;
use async_nats::jetstream::stream::{RetentionPolicy, State, Stream};
use async_nats::jetstream::Message;
use futures_util::StreamExt;
use sink_core::readback::{RangeRead, ReadBack, ReadFrom, ReadSummary, RecordTime, Truncated};

use crate::{connect, NatsConfig, KEY_HEADER};

/// A stored message, as [`ReadBack`].
struct Stored<'a> {
    message: &'a Message,
    sequence: u64,
    time_ms: i64,
}

impl ReadBack for Stored<'_> {
    fn topic(&self) -> &str {
        self.message.subject.as_str()
    }
    fn partition(&self) -> i32 {
        0
    }
    fn offset(&self) -> i64 {
        i64::try_from(self.sequence).unwrap_or(i64::MAX)
    }
    fn key(&self) -> Option<&[u8]> {
        self.header(KEY_HEADER)
    }
    fn time(&self) -> RecordTime {
        RecordTime::LogAppend(self.time_ms)
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        let headers = self.message.headers.as_ref()?;
        headers.get(name).map(|v| v.as_str().as_bytes())
    }
}

/// Reads every message of `subjects` from `from` to their streams' ends,
/// one at a time (see the module docs). A subject no stream takes is
/// absent; a stream that stands still for `stall` ends the read with an
/// error naming it.
pub async fn read_streams(
    config: &NatsConfig,
    subjects: &[String],
    from: ReadFrom,
    stall: Duration,
    mut each: impl FnMut(&dyn ReadBack) -> Result<(), String>,
) -> Result<ReadSummary, String> {
    let (_client, jetstream, shown) = connect(config).await.map_err(|e| e.to_string())?;
    let mut summary = ReadSummary::default();
    // stream → the subjects read from it.
    let mut streams: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for subject in subjects {
        match jetstream.stream_by_subject(subject.as_str()).await {
            Ok(name) => streams.entry(name).or_default().push(subject.clone()),
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                summary.absent_topics.push(subject.clone());
            }
            Err(e) => return Err(format!("NATS at {shown}: the stream of {subject}: {e}")),
        }
    }
    for (name, subjects) in streams {
        let (stream, state) = readable(&jetstream, &name, &shown).await?;
        if state.messages == 0 {
            continue;
        }
        let deliver_policy = match from {
            ReadFrom::Beginning => DeliverPolicy::All,
            ReadFrom::Time(ms) => DeliverPolicy::ByStartTime {
                start_time: time_of(ms),
            },
        };
        let mut first = true;
        read(
            &stream,
            &name,
            subjects,
            deliver_policy,
            state.last_sequence,
            stall,
            |stored| {
                if std::mem::take(&mut first) && state.first_sequence > 1 {
                    let truncated = match from {
                        ReadFrom::Beginning => true,
                        ReadFrom::Time(ms) => {
                            stored.sequence == state.first_sequence && stored.time_ms > ms
                        }
                    };
                    if truncated {
                        summary.truncated.push(Truncated {
                            topic: name.clone(),
                            partition: 0,
                            first_offset: stored.offset(),
                        });
                    }
                }
                summary.records += 1;
                each(stored)
            },
        )
        .await?;
    }
    Ok(summary)
}

/// Reads sequences `from..to` of `stream` (clamped to what it holds), every
/// subject, handing each message to `each`.
pub async fn read_range(
    config: &NatsConfig,
    stream: &str,
    (from, to): (i64, i64),
    stall: Duration,
    mut each: impl FnMut(&dyn ReadBack),
) -> Result<RangeRead, String> {
    let (_client, jetstream, shown) = connect(config).await.map_err(|e| e.to_string())?;
    let (handle, state) = readable(&jetstream, stream, &shown).await?;
    let low = i64::try_from(state.first_sequence).unwrap_or(i64::MAX);
    let high = i64::try_from(state.last_sequence)
        .unwrap_or(i64::MAX)
        .saturating_add(1);
    let (start, end) = (from.max(low).max(1), to.min(high));
    if start >= end || state.messages == 0 {
        return Ok(RangeRead {
            low,
            read_to: end.max(start),
        });
    }
    let last = u64::try_from(end - 1).unwrap_or(0);
    let start_sequence = u64::try_from(start).unwrap_or(1);
    read(
        &handle,
        stream,
        Vec::new(),
        DeliverPolicy::ByStartSequence { start_sequence },
        last,
        stall,
        |stored| {
            each(stored);
            Ok(())
        },
    )
    .await?;
    // The read ends at `last` or when nothing more is pending: sequences
    // after the last message read were deleted.
    Ok(RangeRead { low, read_to: end })
}

/// The stream `name` and its state when the read starts (one request),
/// if its messages stay when consumed.
async fn readable(
    jetstream: &async_nats::jetstream::Context,
    name: &str,
    shown: &str,
) -> Result<(Stream, State), String> {
    let stream = jetstream
        .get_stream(name)
        .await
        .map_err(|e| format!("NATS at {shown}: stream {name}: {e}"))?;
    let info = stream.cached_info();
    let retention = info.config.retention;
    match retention {
        RetentionPolicy::Limits => {
            let state = info.state.clone();
            Ok((stream, state))
        }
        RetentionPolicy::WorkQueue | RetentionPolicy::Interest => Err(format!(
            "NATS stream {name} keeps messages only until they are consumed (retention {}): what a consumer took cannot be read back; audit a stream with retention limits",
            if retention == RetentionPolicy::WorkQueue { "workqueue" } else { "interest" }
        )),
    }
}

/// Reads `stream` with an ordered consumer from `deliver_policy` up to
/// sequence `last` (or until nothing more is pending), only `subjects`
/// (every subject when empty).
async fn read(
    stream: &Stream,
    name: &str,
    subjects: Vec<String>,
    deliver_policy: DeliverPolicy,
    last: u64,
    stall: Duration,
    mut each: impl FnMut(&Stored<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subjects: subjects,
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| format!("NATS stream {name}: a reader: {e}"))?;
    if consumer.cached_info().num_pending == 0 {
        return Ok(());
    }
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("NATS stream {name}: a reader: {e}"))?;
    loop {
        let message = tokio::time::timeout(stall, messages.next())
            .await
            .ok()
            .flatten()
            .ok_or_else(|| format!("NATS stream {name}: no message for {stall:?} before its end"))?
            .map_err(|e| format!("NATS stream {name}: reading: {e}"))?;
        let info = message
            .info()
            .map_err(|e| format!("NATS stream {name}: a message without its place: {e}"))?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        if sequence > last {
            return Ok(());
        }
        let time_ms =
            i64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX);
        each(&Stored {
            message: &message,
            sequence,
            time_ms,
        })?;
        if sequence >= last || pending == 0 {
            return Ok(());
        }
    }
}

/// `ms` after the Unix epoch.
fn time_of(ms: i64) -> time::OffsetDateTime {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
}
