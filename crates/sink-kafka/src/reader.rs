//! Reading topics back: [`read_topics`] hands every record of some topics
//! from a point in time to their end to a callback, one at a time, with a
//! `read_committed` consumer that joins no group and commits nothing. What
//! `walbox audit` compares with the outbox table.
//!
//! - **From**: each partition's first record whose timestamp is at or after
//!   `from_ms` (the broker's time index, `offsets_for_times`), or its first
//!   record ([`ReadFrom::Beginning`]: for brokers without a time index, such
//!   as librdkafka's MockCluster, which answers every lookup with "none").
//! - **To**: each partition's high watermark when the read starts. A
//!   `read_committed` consumer is told only the last stable offset, so its
//!   position (which passes transaction markers and aborted records
//!   without a message) says when a partition is read.
//! - **Memory**: one record at a time; librdkafka's prefetch queue is
//!   bounded (`queued.max.messages.kbytes`).
//! - **Errors**: transient client errors (a broker restarting) are waited
//!   through; a fatal one, or a partition that makes no progress for
//!   `stall`, ends the read with an error naming it. A topic the broker
//!   does not know holds no records.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Headers, Message, Timestamp};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{redact_values, SinkConfig};
use sink_core::readback::ReadBack;
pub use sink_core::readback::{RangeRead, ReadFrom, ReadSummary, RecordTime, Truncated};

/// One record read back, borrowed for the callback's duration.
pub struct ReadRecord<'a> {
    /// Its topic.
    pub topic: &'a str,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key.
    pub key: Option<&'a [u8]>,
    /// Timestamp.
    pub time: RecordTime,
    message: &'a rdkafka::message::BorrowedMessage<'a>,
}

impl<'a> ReadRecord<'a> {
    fn of(m: &'a rdkafka::message::BorrowedMessage<'a>) -> ReadRecord<'a> {
        ReadRecord {
            topic: m.topic(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key(),
            time: match m.timestamp() {
                Timestamp::CreateTime(t) => RecordTime::Create(t),
                Timestamp::LogAppendTime(t) => RecordTime::LogAppend(t),
                Timestamp::NotAvailable => RecordTime::None,
            },
            message: m,
        }
    }

    /// The value of the first header called `name`.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        let headers = self.message.headers()?;
        headers.iter().find(|h| h.key == name).and_then(|h| h.value)
    }
}

impl ReadBack for ReadRecord<'_> {
    fn topic(&self) -> &str {
        self.topic
    }
    fn partition(&self) -> i32 {
        self.partition
    }
    fn offset(&self) -> i64 {
        self.offset
    }
    fn key(&self) -> Option<&[u8]> {
        self.key
    }
    fn time(&self) -> RecordTime {
        self.time
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        ReadRecord::header(self, name)
    }
}

/// The readers' prefetch queue, in KiB: what they hold besides the record
/// being handed over.
const PREFETCH_KIB: &str = "16384";

/// How long a metadata, offset or watermark request may take before the
/// read fails (the brokers unreachable).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The two consumers a read takes: `ends` (`read_uncommitted`, told the
/// high watermarks) and `reader` (`read_committed`, no group, nothing
/// committed, a bounded prefetch), and how to scrub secrets from errors.
struct Readers {
    ends: BaseConsumer<Quiet>,
    reader: BaseConsumer<Quiet>,
    secrets: Arc<[String]>,
}

impl Readers {
    fn new(config: &SinkConfig) -> Result<Readers, String> {
        let secrets: Arc<[String]> = config.secret_values().into();
        let tokens = config.tokens().map_err(|e| e.to_string())?;
        let quiet = || Quiet {
            secrets: Arc::clone(&secrets),
            tokens: tokens.clone(),
        };
        let connection = config.connection_config();
        let create = |c: &mut rdkafka::ClientConfig| {
            let consumer: BaseConsumer<Quiet> = c
                .create_with_context(quiet())
                .map_err(|e| redact_values(&format!("create a consumer: {e}"), &secrets))?;
            if let Some(tokens) = &tokens {
                tokens.prime(consumer.client());
            }
            Ok::<_, String>(consumer)
        };
        let ends = create(
            connection
                .clone()
                .set("isolation.level", "read_uncommitted"),
        )?;
        let reader = create(
            connection
                .clone()
                .set("group.id", "walbox-reader")
                .set("isolation.level", "read_committed")
                .set("enable.partition.eof", "true")
                .set("enable.auto.commit", "false")
                .set("enable.auto.offset.store", "false")
                // Prefetched records, at most (librdkafka's default is 64 MiB).
                .set("queued.max.messages.kbytes", PREFETCH_KIB),
        )?;
        Ok(Readers {
            ends,
            reader,
            secrets,
        })
    }

    fn scrub(&self, e: String) -> String {
        redact_values(&e, &self.secrets)
    }

    /// A consumer error while polling: fatal (`what` ends with it), or
    /// transient (a broker restarting: librdkafka reconnects, the read goes
    /// on).
    fn on_error(&self, e: &KafkaError, what: &str) -> Result<(), String> {
        if let Some((code, reason)) = self.reader.client().fatal_error() {
            return Err(self.scrub(format!("{what}: {code:?}: {reason}")));
        }
        tracing::debug!(error = %self.scrub(e.to_string()), "{what}: a transient error");
        Ok(())
    }
}

/// Reads every record of `topics` from `from` to their end (see the
/// module docs) and hands each to `each`, partition by partition
/// in offset order (partitions interleave). Blocking: call it from
/// `spawn_blocking`. An error from `each` ends the read with it.
pub fn read_topics(
    config: &SinkConfig,
    topics: &[String],
    from: ReadFrom,
    stall: Duration,
    mut each: impl FnMut(&ReadRecord<'_>) -> Result<(), String>,
) -> Result<ReadSummary, String> {
    let metadata = REQUEST_TIMEOUT.min(stall);
    let readers = Readers::new(config)?;
    let scrub = |e: String| readers.scrub(e);
    let (ends, consumer) = (&readers.ends, &readers.reader);

    let mut summary = ReadSummary::default();
    let mut start = TopicPartitionList::new();
    // (topic, partition) → the offset that ends it.
    let mut targets: HashMap<(String, i32), i64> = HashMap::new();
    for topic in topics {
        let Some(partitions) = partitions_of(ends, topic, metadata).map_err(scrub)? else {
            summary.absent_topics.push(topic.clone());
            continue;
        };
        let firsts = match from {
            ReadFrom::Time(ms) => {
                let mut times = TopicPartitionList::new();
                for p in 0..partitions {
                    times
                        .add_partition_offset(topic, p, Offset::Offset(ms))
                        .map_err(|e| e.to_string())?;
                }
                Some(ends.offsets_for_times(times, metadata).map_err(|e| {
                    scrub(format!("find the offsets of topic {topic} at {ms} ms: {e}"))
                })?)
            }
            ReadFrom::Beginning => None,
        };
        for p in 0..partitions {
            let (low, high) = ends
                .fetch_watermarks(topic, p, metadata)
                .map_err(|e| scrub(format!("read the ends of {topic} [{p}]: {e}")))?;
            let first = match &firsts {
                None => low,
                Some(firsts) => match firsts.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o,
                    // No record at or after the time: nothing to read.
                    _ => continue,
                },
            };
            if first >= high {
                continue;
            }
            if low > 0 && first == low {
                summary.truncated.push(Truncated {
                    topic: topic.clone(),
                    partition: p,
                    first_offset: low,
                });
            }
            start
                .add_partition_offset(topic, p, Offset::Offset(first))
                .map_err(|e| e.to_string())?;
            targets.insert((topic.clone(), p), high);
        }
    }
    if targets.is_empty() {
        return Ok(summary);
    }
    consumer
        .assign(&start)
        .map_err(|e| scrub(format!("read the topics: {e}")))?;
    let mut moved = Instant::now();
    while !targets.is_empty() {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                moved = Instant::now();
                let id = (m.topic().to_owned(), m.partition());
                let Some(&end) = targets.get(&id) else {
                    continue;
                };
                if m.offset() < end {
                    summary.records += 1;
                    each(&ReadRecord::of(&m))?;
                }
                if m.offset() + 1 >= end {
                    targets.remove(&id);
                }
                continue;
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => readers.on_error(&e, "read the topics")?,
        }
        // Markers and aborted records take offsets without a message: the
        // position says how far the reading got.
        let position = consumer
            .position()
            .map_err(|e| scrub(format!("read the topics: {e}")))?;
        for e in position.elements() {
            if let Offset::Offset(o) = e.offset() {
                let id = (e.topic().to_owned(), e.partition());
                if targets.get(&id).is_some_and(|end| o >= *end) {
                    targets.remove(&id);
                    moved = Instant::now();
                }
            }
        }
        if !targets.is_empty() && moved.elapsed() > stall {
            let mut left: Vec<String> = targets.keys().map(|(t, p)| format!("{t} [{p}]")).collect();
            left.sort();
            return Err(format!(
                "reading {} made no progress for {stall:?} (a broker down, or a transaction left open until the broker's transaction.timeout.ms)",
                left.join(", ")
            ));
        }
    }
    Ok(summary)
}

/// The number of partitions of `topic`; `None` when the broker does not
/// know it. Any other error (a leader election, an authorization refusal)
/// is an error, never "no records".
pub(crate) fn partitions_of<C: ConsumerContext>(
    client: &BaseConsumer<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<i32>, String> {
    let md = client
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("read the metadata of topic {topic}: {e}"))?;
    match md.topics().iter().find(|t| t.name() == topic) {
        None => Ok(None),
        Some(t) => match t.error() {
            Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => Ok(None),
            Some(e) => Err(format!(
                "read the metadata of topic {topic}: {:?}",
                RDKafkaErrorCode::from(e)
            )),
            None => Ok(Some(t.partitions().len() as i32)),
        },
    }
}

/// The reading consumer's context: the end of a partition is what it reads
/// for; other client errors are logged at debug, scrubbed (the read itself
/// reports what stops it).
pub(crate) struct Quiet {
    pub(crate) secrets: Arc<[String]>,
    pub(crate) tokens: Option<Arc<crate::msk_iam::Tokens>>,
}

impl rdkafka::ClientContext for Quiet {
    crate::msk_iam::serve_tokens!(tokens);

    /// librdkafka's own log lines (a broker unreachable is one per
    /// reconnect) at debug: what ends the read is its error.
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        let line = redact_values(log_message, &self.secrets);
        tracing::debug!(%fac, %line, "librdkafka");
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        let reason = redact_values(reason, &self.secrets);
        tracing::debug!(%reason, "kafka client error while reading topics back");
    }
}

impl ConsumerContext for Quiet {}

/// Reads offsets `from..to` of one partition (clamped to what it holds)
/// with a `read_committed` consumer that joins no group, handing each
/// record to `each`. Blocking: call it from `spawn_blocking`.
pub fn read_range(
    config: &SinkConfig,
    topic: &str,
    partition: i32,
    (from, to): (i64, i64),
    stall: Duration,
    mut each: impl FnMut(&ReadRecord<'_>),
) -> Result<RangeRead, String> {
    let readers = Readers::new(config)?;
    let scrub = |e: String| readers.scrub(e);
    let (ends, consumer) = (&readers.ends, &readers.reader);
    let (low, high) = ends
        .fetch_watermarks(topic, partition, REQUEST_TIMEOUT.min(stall))
        .map_err(|e| scrub(format!("read the ends of {topic} [{partition}]: {e}")))?;
    let (start, end) = (from.max(low), to.min(high));
    let mut read = RangeRead {
        low,
        read_to: start,
    };
    if start >= end {
        read.read_to = end.max(start);
        return Ok(read);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))
        .map_err(|e| e.to_string())?;
    consumer
        .assign(&tpl)
        .map_err(|e| scrub(format!("read {topic} [{partition}]: {e}")))?;
    let mut moved = Instant::now();
    while read.read_to < end && moved.elapsed() <= stall {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                moved = Instant::now();
                if m.offset() < end {
                    each(&ReadRecord::of(&m));
                }
                read.read_to = read.read_to.max(m.offset() + 1);
                continue;
            }
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => readers.on_error(&e, &format!("read {topic} [{partition}]"))?,
        }
        let position = consumer
            .position()
            .map_err(|e| scrub(format!("read {topic} [{partition}]: {e}")))?;
        for e in position.elements() {
            if let Offset::Offset(o) = e.offset() {
                if o > read.read_to {
                    read.read_to = o;
                    moved = Instant::now();
                }
            }
        }
    }
    read.read_to = read.read_to.min(end);
    Ok(read)
}
