//! RabbitMQ as sink-core's [`Destination`]: how a record becomes a
//! message, and a confirm or refusal a report.
//!
//! A record becomes a persistent message on the configured exchange: its
//! topic the routing key (with `.<n>` appended when
//! [`AmqpConfig::partitions`] > 1, `n` the FNV-1a hash of its key modulo
//! the partitions: one queue per `n`, one consumer each, keeps each key's
//! order), the value of its [`AmqpConfig::message_id_header`] header the
//! `message_id`, its headers AMQP headers, its key the [`KEY_HEADER`]
//! header and its timestamp the `timestamp` property. A confirm is a
//! delivery; a nack or a return is a refusal for good
//! ([`DeliveryErrorKind::Permanent`]), with the record returned for the
//! caller's dead-letter copy or quarantine.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use sink_core::{
    Admission, Delivered, Deliveries, DeliveryErrorKind, Destination, Permit, Record, Report,
};

use crate::{AmqpConfig, AmqpSink, ConnectError, Message, Reports};

/// The header that carries the record key.
pub const KEY_HEADER: &str = "walbox.key";

/// A record on its way: its token, and itself for a refusal's report.
#[derive(Debug)]
pub(crate) struct Carried<T> {
    token: T,
    record: Record<()>,
    routing_key: String,
}

/// Publishes records to RabbitMQ; their reports arrive on [`Confirms`].
#[derive(Debug)]
pub struct Publisher<T> {
    sink: AmqpSink<Carried<T>>,
    partitions: u32,
    message_id_header: String,
}

/// Each published record's report, once.
#[derive(Debug)]
pub struct Confirms<T> {
    reports: Reports<Carried<T>>,
    exchange: Arc<str>,
}

impl<T: Send + 'static> Publisher<T> {
    /// Connects once (a broker that refuses walbox fails now, in one
    /// line), then publishes through a task of its own.
    pub async fn connect(config: AmqpConfig) -> Result<(Self, Confirms<T>), ConnectError> {
        let partitions = config.partitions.max(1);
        let message_id_header = config.message_id_header.clone();
        let exchange = Arc::from(config.exchange.as_str());
        let (sink, reports) = AmqpSink::connect(config).await?;
        Ok((
            Publisher {
                sink,
                partitions,
                message_id_header,
            },
            Confirms { reports, exchange },
        ))
    }

    /// Waits up to `within` for confirms, then closes the connection; how
    /// many messages were left unconfirmed.
    pub async fn close(self, within: Duration) -> usize {
        self.sink.close(within).await
    }

    /// Connections opened so far (the first included).
    pub fn connections(&self) -> usize {
        self.sink.connections()
    }

    /// `record` as a message.
    fn message(&self, record: &Record<()>) -> Message {
        let key = record.key.clone().unwrap_or_default();
        let routing_key = match self.partitions {
            1 => record.topic.to_string(),
            n => format!("{}.{}", record.topic, partition_of(&key, n)),
        };
        let mut headers: Vec<(String, Bytes)> = record
            .headers
            .iter()
            .map(|h| (h.name.to_string(), h.value.clone()))
            .collect();
        headers.push((KEY_HEADER.to_owned(), key));
        Message {
            routing_key,
            body: record.value.clone().unwrap_or_default(),
            message_id: record
                .headers
                .iter()
                .find(|h| h.name == self.message_id_header)
                .map(|h| String::from_utf8_lossy(&h.value).into_owned()),
            headers,
            timestamp_s: record
                .timestamp_ms
                .and_then(|ms| u64::try_from(ms / 1000).ok()),
        }
    }
}

/// The routing partition of `key` among `partitions` (32-bit FNV-1a).
pub fn partition_of(key: &[u8], partitions: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in key {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h % partitions.max(1)
}

impl<T: Send + 'static> Destination<T> for Publisher<T> {
    fn admission(&self) -> &Admission {
        self.sink.worker().admission()
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        let (record, token) = record.split_token();
        let message = self.message(&record);
        let routing_key = message.routing_key.clone();
        let carried = Carried {
            token,
            record,
            routing_key,
        };
        self.sink.worker().publish(permit, message, carried);
    }
}

impl<T: Send + 'static> Deliveries<T> for Confirms<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        let report = self.reports.next().await?;
        let Carried {
            token,
            record,
            routing_key,
        } = report.token;
        Some(match report.result {
            Ok(()) => Report::delivered(
                token,
                Delivered::Amqp {
                    exchange: Arc::clone(&self.exchange),
                    routing_key,
                },
            ),
            Err(refusal) => Report::failed(
                token,
                DeliveryErrorKind::Permanent,
                refusal.to_string(),
                record,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_spread_keys_and_keep_each_key_on_one() {
        assert_eq!(partition_of(b"anything", 1), 0);
        let counts = (0..1000).fold([0u32; 4], |mut c, i| {
            c[partition_of(format!("agg-{i}").as_bytes(), 4) as usize] += 1;
            c
        });
        assert!(counts.iter().all(|&n| n > 150), "{counts:?}");
        // FNV-1a 32 of "a" is 0xe40c292c.
        assert_eq!(partition_of(b"a", 1 << 31), 0xe40c_292c % (1 << 31));
    }
}
