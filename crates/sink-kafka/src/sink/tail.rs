//! Reading a topic back from its end ([`sink_core::tail`]): which of a
//! stream's records each partition holds, from its end back to the first
//! record of the stream older than the slot's confirmed position.
//!
//! - **Backwards, in growing chunks.** Kafka reads forwards only, so each
//!   partition is read in chunks ending where the last one began: 500
//!   records, then four times more each round, within the look-back. All
//!   partitions still looking are read together, by one consumer.
//! - **`read_committed`, to the last stable offset.** Records of an aborted
//!   transaction (walbox in exactly-once mode before) are never taken for
//!   delivered; another producer's open transaction is not waited for (what
//!   follows it is not looked at, and sent again if it comes up).
//! - **Exactly what is there.** A record counts when its
//!   [`ORIGIN_HEADER`](sink_core::tail::ORIGIN_HEADER) names the stream and
//!   the history asked for; other producers' records are passed over.
//! - **Bounded.** At most `look_back` records per partition; the events
//!   found are kept (each at most once), nothing else.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use sink_core::tail::{Found, Mark, Tail, TailQuery, TailReader, ORIGIN_HEADER};
use sink_core::Delivered;

use super::committed::ReaderContext;
use super::Sink;
use crate::reader::partitions_of;

/// The first chunk read back per partition.
const FIRST_CHUNK: i64 = 500;
/// How much larger each next chunk is.
const GROWTH: i64 = 4;
/// How long a metadata or offsets request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the reading may make no progress before it fails.
const STALL: Duration = Duration::from_secs(20);

impl<T: Send + Sync + 'static> TailReader for Sink<T> {
    fn read_tail<'a>(
        &'a self,
        topic: &'a str,
        query: &'a TailQuery,
    ) -> Pin<Box<dyn Future<Output = Result<Tail, String>> + 'a>> {
        let config = self.inner.connection.clone();
        let secrets = Arc::clone(&self.inner.secrets);
        let context = ReaderContext {
            secrets: Arc::clone(&secrets),
            tokens: self.inner.tokens.clone(),
        };
        let (topic, query) = (topic.to_owned(), query.clone());
        Box::pin(async move {
            // librdkafka's consumer blocks.
            tokio::task::spawn_blocking(move || read_tail(config, context, &topic, &query))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| crate::config::redact_values(&e, &secrets))
        })
    }
}

/// One partition's look-back.
struct Partition {
    /// Its first offset (records before it were deleted).
    low: i64,
    /// Where the part still to read ends (exclusive).
    end: i64,
    /// The next chunk's length.
    chunk: i64,
    /// Records read back so far.
    read: u64,
    /// A record of the stream older than `since` was read: done.
    boundary: bool,
}

fn read_tail(
    config: rdkafka::ClientConfig,
    context: ReaderContext,
    topic: &str,
    query: &TailQuery,
) -> Result<Tail, String> {
    let tokens = context.tokens.clone();
    let consumer: BaseConsumer<ReaderContext> = config
        .clone()
        .set("group.id", "walbox-tail-reader")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("queued.max.messages.kbytes", "16384")
        .create_with_context(context)
        .map_err(|e| format!("create a consumer: {e}"))?;
    if let Some(tokens) = &tokens {
        tokens.prime(consumer.client());
    }
    let mut tail = Tail::default();
    let Some(count) = partitions_of(&consumer, topic, REQUEST_TIMEOUT)? else {
        return Ok(tail);
    };
    tail.partitions = count as u32;
    let mut partitions: HashMap<i32, Partition> = HashMap::new();
    for p in 0..count {
        // A read_committed consumer is told the last stable offset.
        let (low, end) = consumer
            .fetch_watermarks(topic, p, REQUEST_TIMEOUT)
            .map_err(|e| format!("read the ends of {topic} [{p}]: {e}"))?;
        if end > low {
            partitions.insert(
                p,
                Partition {
                    low,
                    end,
                    chunk: FIRST_CHUNK,
                    read: 0,
                    boundary: false,
                },
            );
        }
    }
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    while !partitions.is_empty() {
        // (partition) → (start, end) of this round's chunk.
        let mut round: HashMap<i32, (i64, i64)> = HashMap::new();
        let mut tpl = TopicPartitionList::new();
        for (&p, part) in &partitions {
            let left = query.look_back.saturating_sub(part.read);
            let length = part.chunk.min(i64::try_from(left).unwrap_or(i64::MAX));
            let start = (part.end - length).max(part.low);
            round.insert(p, (start, part.end));
            tpl.add_partition_offset(topic, p, Offset::Offset(start))
                .map_err(|e| e.to_string())?;
        }
        consumer
            .assign(&tpl)
            .map_err(|e| format!("read {topic} back: {e}"))?;
        let mut reading: HashMap<i32, i64> = round.iter().map(|(&p, &(_, end))| (p, end)).collect();
        let mut moved = Instant::now();
        while !reading.is_empty() {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    moved = Instant::now();
                    let p = m.partition();
                    let Some(&end) = reading.get(&p) else {
                        continue;
                    };
                    if m.offset() < end {
                        let part = partitions.get_mut(&p).expect("read only while looking");
                        part.read += 1;
                        tail.read += 1;
                        let mark = m.headers().and_then(|h| {
                            h.iter()
                                .find(|h| h.key == ORIGIN_HEADER)
                                .and_then(|h| h.value)
                                .and_then(Mark::parse)
                        });
                        if let Some(mark) = mark.filter(|mark| {
                            mark.stream == query.stream && mark.history == query.history
                        }) {
                            if mark.position < query.since {
                                part.boundary = true;
                            } else if seen.insert((mark.position, mark.index)) {
                                tail.found.push(Found {
                                    position: mark.position,
                                    index: mark.index,
                                    commit_time: mark.commit_time,
                                    at: Delivered::Kafka {
                                        partition: p,
                                        offset: m.offset(),
                                    },
                                });
                            }
                        }
                    }
                    if m.offset() + 1 >= end {
                        reading.remove(&p);
                    }
                    continue;
                }
                Some(Err(KafkaError::PartitionEOF(_))) | None => {}
                Some(Err(e)) => {
                    if let Some((code, reason)) = consumer.client().fatal_error() {
                        return Err(format!("read {topic} back: {code:?}: {reason}"));
                    }
                    // No retry grants a right: said at once, not after the
                    // stall bound.
                    if matches!(
                        e.rdkafka_error_code(),
                        Some(
                            RDKafkaErrorCode::TopicAuthorizationFailed
                                | RDKafkaErrorCode::ClusterAuthorizationFailed
                        )
                    ) {
                        return Err(format!(
                            "read {topic} back: {e}; walbox's principal needs Describe and Read on it"
                        ));
                    }
                    tracing::debug!(error = %e, %topic, "reading a topic back: a transient error");
                }
            }
            // Transaction markers take offsets without a message: the
            // position says how far the reading got.
            let position = consumer
                .position()
                .map_err(|e| format!("read {topic} back: {e}"))?;
            for e in position.elements() {
                if let Offset::Offset(o) = e.offset() {
                    if reading.get(&e.partition()).is_some_and(|end| o >= *end) {
                        reading.remove(&e.partition());
                        moved = Instant::now();
                    }
                }
            }
            if !reading.is_empty() && moved.elapsed() > STALL {
                let mut left: Vec<String> = reading.keys().map(|p| format!("[{p}]")).collect();
                left.sort();
                return Err(format!(
                    "reading {topic} {} back made no progress for {STALL:?}",
                    left.join(", ")
                ));
            }
        }
        for (p, (start, _)) in round {
            let part = partitions.get_mut(&p).expect("read this round");
            part.end = start;
            part.chunk = part.chunk.saturating_mul(GROWTH);
            if part.boundary || start <= part.low {
                partitions.remove(&p);
            } else if part.read >= query.look_back {
                tail.cut_short.push(p);
                partitions.remove(&p);
            }
        }
    }
    tail.cut_short.sort_unstable();
    Ok(tail)
}
