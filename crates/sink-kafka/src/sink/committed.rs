//! Reading what was committed: [`Sink::read_committed_last`] reads a
//! compacted topic with a `read_committed` consumer up to its end and
//! returns the last value written under a key: how a caller finds the
//! progress it committed together with its records.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use super::Sink;
use crate::msk_iam::TokenContext;

impl<T: Send + Sync + 'static> Sink<T> {
    /// Reads `topic` from its start to its end with a `read_committed`
    /// consumer and returns the last value written under `key` (`None`:
    /// the key has no value; a deletion marker counts as none). Only what
    /// committed transactions wrote is seen; the end is the last stable
    /// offset, so call it after [`Sink::init_transactions`] has completed
    /// whatever an older producer left open.
    pub async fn read_committed_last(
        &self,
        topic: &str,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Bytes>, String> {
        let config = self.inner.connection.clone();
        let (topic, key) = (topic.to_owned(), key.to_owned());
        let secrets = Arc::clone(&self.inner.secrets);
        let context = ReaderContext {
            secrets: Arc::clone(&secrets),
            tokens: self.inner.tokens.clone(),
        };
        tokio::task::spawn_blocking(move || {
            read_last_blocking(config, context, &topic, &key, timeout)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| crate::config::redact_values(&e, &secrets))
    }
}

/// The reading consumer's client context: the end of a partition is what
/// it reads for, not an error to log; other errors are logged scrubbed.
pub(super) struct ReaderContext {
    pub(super) secrets: Arc<[String]>,
    pub(super) tokens: Option<Arc<crate::msk_iam::Tokens>>,
}

impl rdkafka::ClientContext for ReaderContext {
    crate::msk_iam::serve_tokens!(tokens);

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        let reason = crate::config::redact_values(reason, &self.secrets);
        tracing::warn!(%reason, "kafka client error while reading a topic back");
    }
}

impl ConsumerContext for ReaderContext {}

fn read_last_blocking(
    mut config: rdkafka::ClientConfig,
    context: ReaderContext,
    topic: &str,
    key: &str,
    timeout: Duration,
) -> Result<Option<Bytes>, String> {
    let deadline = Instant::now() + timeout;
    // The end to read to is the high watermark, which only a
    // read_uncommitted client is told: a read_committed one hears of the
    // last stable offset, which stops at the first record of any open
    // transaction, also another producer's (shards share the progress
    // topic), and the records committed after it would go unseen.
    let tokens = context.tokens.clone();
    let ends: BaseConsumer<TokenContext> = config
        .clone()
        .set("isolation.level", "read_uncommitted")
        .create_with_context(TokenContext(tokens.clone()))
        .map_err(|e| format!("create a consumer: {e}"))?;
    let consumer: BaseConsumer<ReaderContext> = config
        .set("group.id", "walbox-progress-reader")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create_with_context(context)
        .map_err(|e| format!("create a consumer: {e}"))?;
    if let Some(tokens) = &tokens {
        tokens.prime(ends.client());
        tokens.prime(consumer.client());
    }
    let md = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("read topic {topic}: {e}"))?;
    let partitions = match md.topics().iter().find(|t| t.name() == topic) {
        // A topic that does not exist holds no progress.
        Some(t) if t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
            return Ok(None)
        }
        None => return Ok(None),
        // Anything else (a leader election, an authorization refusal) is
        // an error to retry, never "nothing there".
        Some(t) => match t.error() {
            Some(e) => {
                return Err(format!(
                    "read topic {topic}: {:?}",
                    RDKafkaErrorCode::from(e)
                ))
            }
            None => t.partitions().len() as i32,
        },
    };
    if partitions == 0 {
        return Ok(None);
    }
    let mut tpl = TopicPartitionList::new();
    let mut targets: HashMap<i32, i64> = HashMap::new();
    for p in 0..partitions {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let (_, high) = ends
            .fetch_watermarks(topic, p, remaining)
            .map_err(|e| format!("read the end of topic {topic} [{p}]: {e}"))?;
        if high > 0 {
            targets.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
    }
    if targets.is_empty() {
        return Ok(None);
    }
    consumer
        .assign(&tpl)
        .map_err(|e| format!("read topic {topic}: {e}"))?;
    let mut last: Option<Bytes> = None;
    let mut waiting_since: Option<Instant> = None;
    let mut told = false;
    while !targets.is_empty() {
        if Instant::now() >= deadline {
            return Err(format!(
                "read topic {topic}: not at its end within {timeout:?} (a transaction on it still open?)"
            ));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if m.key() == Some(key.as_bytes()) {
                    last = m.payload().map(Bytes::copy_from_slice);
                }
                // Past the end captured above: this partition is read.
                if m.offset() + 1 >= targets.get(&m.partition()).copied().unwrap_or(0) {
                    targets.remove(&m.partition());
                }
                continue;
            }
            // The end of what a read_committed consumer may read now: the
            // end captured above, or an open transaction's first record.
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => return Err(format!("read topic {topic}: {e}")),
        }
        // Commit and abort markers (and aborted records) are skipped
        // without a message: the position says how far the reading got.
        let position = consumer
            .position()
            .map_err(|e| format!("read topic {topic}: {e}"))?;
        for e in position.elements() {
            if let Offset::Offset(o) = e.offset() {
                if o >= targets.get(&e.partition()).copied().unwrap_or(i64::MAX) {
                    targets.remove(&e.partition());
                }
            }
        }
        if !targets.is_empty() {
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if !told && since.elapsed() > Duration::from_secs(5) {
                told = true;
                tracing::warn!(%topic, "reading the committed progress waits for a transaction still open on the progress topic (another producer's, e.g. a killed shard's, until its transaction.timeout.ms)");
            }
        }
    }
    Ok(last)
}
