//! Records handed to a destination.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;

/// One header (a Kafka header, an AMQP header, an SQS message attribute):
/// a name and raw bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Header name: usually one of a few fixed names, so not allocated per
    /// record.
    pub name: Cow<'static, str>,
    /// Header value, as bytes (headers are not required to be text).
    pub value: Bytes,
}

/// A message to publish, with the token that identifies it in its delivery report.
///
/// Values and keys are [`Bytes`], so a record built from a replication frame
/// can point into that frame without copying.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record<T> {
    /// Where it goes: a Kafka topic, a RabbitMQ routing key (before
    /// partitioning), the events or dead-letter queue on SQS. Shared by the
    /// records of one topic.
    pub topic: Arc<str>,
    /// Message key (the aggregate id): one key's messages stay in order.
    pub key: Option<Bytes>,
    /// Message value.
    pub value: Option<Bytes>,
    /// Headers, in order.
    pub headers: Vec<Header>,
    /// Message timestamp in milliseconds since the Unix epoch; `None` lets the
    /// producer stamp the send time.
    pub timestamp_ms: Option<i64>,
    /// Where in its source stream the record came from, for brokers that
    /// deduplicate by it (an SQS FIFO deduplication id); `None` for records
    /// that stand for no event of a stream.
    pub origin: Option<Origin>,
    /// What the caller gets back in this record's delivery report.
    pub token: T,
}

/// A record's place in its source stream: the same on every re-send of its
/// event, and never shared by two events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The stream (walbox: its replication slot).
    pub stream: Arc<str>,
    /// The server history the stream was read on
    /// ([`crate::tail::history_id`]): positions compare only within one.
    pub history: u64,
    /// The position of the transaction the event belongs to (walbox: its
    /// commit LSN).
    pub position: u64,
    /// The event's index in that transaction.
    pub index: u64,
    /// The transaction's commit time (µs since the Unix epoch; 0: none):
    /// two histories that reuse a position (a restore on the same
    /// timeline) differ here.
    pub commit_time: i64,
}

impl Origin {
    /// `<stream>/<position as X/Y hexadecimal>/<index>`, e.g.
    /// `walbox/0/16B3748/2`: at most the stream's length plus 37 bytes.
    pub fn id(&self) -> String {
        format!(
            "{}/{:X}/{:X}/{}",
            self.stream,
            self.position >> 32,
            self.position & 0xFFFF_FFFF,
            self.index
        )
    }
}

impl Origin {
    /// A deduplication id, for brokers that drop a re-sent message by one
    /// (SQS FIFO, JetStream, a webhook's `Idempotency-Key`):
    /// [`Origin::id`], then `.` and the commit time in hexadecimal µs when
    /// there is one. The same on every re-send of an event; a server
    /// restored on the same timeline reuses positions, and its new events
    /// differ by their commit times, so none is dropped as a re-send.
    pub fn dedup_id(&self) -> String {
        if self.commit_time > 0 {
            format!("{}.{:x}", self.id(), self.commit_time)
        } else {
            self.id()
        }
    }
}

impl Record<()> {
    /// The record carrying `token` (the inverse of [`Record::split_token`]).
    pub fn with_token<T>(self, token: T) -> Record<T> {
        self.replace_token(token).0
    }
}

impl<T> Record<T> {
    /// A record with a topic, key, value and token, and no headers or timestamp.
    pub fn new(topic: impl AsRef<str>, key: Option<Bytes>, value: Option<Bytes>, token: T) -> Self {
        Record {
            topic: Arc::from(topic.as_ref()),
            key,
            value,
            headers: Vec::new(),
            timestamp_ms: None,
            origin: None,
            token,
        }
    }

    /// Adds a header.
    pub fn with_header(
        mut self,
        name: impl Into<Cow<'static, str>>,
        value: impl Into<Bytes>,
    ) -> Self {
        self.headers.push(Header {
            name: name.into(),
            value: value.into(),
        });
        self
    }

    /// Sets where in its source stream the record came from.
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// Sets the message timestamp (milliseconds since the Unix epoch).
    pub fn with_timestamp_ms(mut self, ms: i64) -> Self {
        self.timestamp_ms = Some(ms);
        self
    }

    /// The record without its token, and the token.
    pub fn split_token(self) -> (Record<()>, T) {
        self.replace_token(())
    }

    /// The record carrying `token` instead, and the token it carried.
    fn replace_token<U>(self, token: U) -> (Record<U>, T) {
        let Record {
            topic,
            key,
            value,
            headers,
            timestamp_ms,
            origin,
            token: old,
        } = self;
        (
            Record {
                topic,
                key,
                value,
                headers,
                timestamp_ms,
                origin,
                token,
            },
            old,
        )
    }

    /// Bytes this record holds (key, value and headers): what in-flight byte
    /// limits count.
    pub fn size(&self) -> usize {
        self.key.as_ref().map_or(0, Bytes::len)
            + self.value.as_ref().map_or(0, Bytes::len)
            + self
                .headers
                .iter()
                .map(|h| h.name.len() + h.value.len())
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_counts_key_value_and_headers() {
        let r = Record::new(
            "t",
            Some(Bytes::from_static(b"key")),
            Some(Bytes::from_static(b"value")),
            7u64,
        )
        .with_header("id", "0123")
        .with_timestamp_ms(1);
        assert_eq!(r.size(), 3 + 5 + 2 + 4);
        assert_eq!(r.token, 7);
        assert_eq!(r.timestamp_ms, Some(1));
    }

    #[test]
    fn an_origin_reads_as_a_wal_position() {
        let o = Origin {
            stream: Arc::from("walbox"),
            history: 0,
            position: 0x1_0000_00AB,
            index: 3,
            commit_time: 0,
        };
        assert_eq!(o.id(), "walbox/1/AB/3");
        assert_eq!(o.dedup_id(), "walbox/1/AB/3", "no commit time");
        let timed = Origin {
            commit_time: 0x10,
            ..o
        };
        assert_eq!(timed.dedup_id(), "walbox/1/AB/3.10");
    }
}
