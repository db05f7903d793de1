//! `sink = "rabbitmq"`: the relay's [`Destination`] on RabbitMQ
//! (sink-amqp). A record becomes a persistent message on the configured
//! exchange, its topic the routing key (with `.<n>` appended when
//! `rabbitmq.partitions` > 1, `n` the FNV-1a hash of the aggregate id
//! modulo the partitions: one queue per `n`, one consumer each, keeps each
//! aggregate's order), its event id the `message_id`, its headers AMQP
//! headers and its key the `walbox.key` header. A confirm is a delivery,
//! a nack or a return a refusal for good, which the dead-letter policy
//! handles as a broker's refusal on Kafka.

use bytes::Bytes;
use sink_amqp::{AmqpSink, Message, Permit, Reports};
use sink_kafka::{Delivered, DeliveryError, DeliveryErrorKind, Record, Report};

use super::destination::{Deliveries, Destination};
use super::Token;
use crate::mapping::ID_HEADER;

/// The header that carries the record key (the aggregate id).
pub const KEY_HEADER: &str = "walbox.key";

/// A record on its way: its token, and itself for a dead-letter copy.
#[derive(Debug)]
pub struct Sent {
    token: Token,
    record: Record<()>,
    partition: i32,
}

/// Publishes records to RabbitMQ.
#[derive(Debug)]
pub struct Rabbit {
    sink: AmqpSink<Sent>,
    partitions: u32,
}

impl Rabbit {
    /// The destination on `sink`, routing over `partitions`.
    pub fn new(sink: AmqpSink<Sent>, partitions: u32) -> Self {
        Rabbit { sink, partitions }
    }

    /// Closes the connection after waiting up to `within` for confirms;
    /// how many messages were left unconfirmed.
    pub async fn close(self, within: std::time::Duration) -> usize {
        self.sink.close(within).await
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

impl Destination for Rabbit {
    type Permit = Permit;

    async fn reserve(&self, size: usize) -> Permit {
        self.sink.reserve(size).await
    }

    async fn send(&self, permit: Permit, record: Record<Token>) {
        let (record, token) = record.split_token();
        let key = record.key.clone().unwrap_or_default();
        let partition = partition_of(&key, self.partitions);
        let routing_key = match self.partitions {
            1 => record.topic.to_string(),
            _ => format!("{}.{partition}", record.topic),
        };
        let mut headers: Vec<(String, Bytes)> = record
            .headers
            .iter()
            .map(|h| (h.name.to_string(), h.value.clone()))
            .collect();
        headers.push((KEY_HEADER.to_owned(), key));
        let message = Message {
            routing_key,
            body: record.value.clone().unwrap_or_default(),
            message_id: record
                .headers
                .iter()
                .find(|h| h.name == ID_HEADER)
                .map(|h| String::from_utf8_lossy(&h.value).into_owned()),
            headers,
            timestamp_s: record
                .timestamp_ms
                .and_then(|ms| u64::try_from(ms / 1000).ok()),
        };
        let sent = Sent {
            token,
            record,
            partition: partition as i32,
        };
        self.sink.publish(permit, message, sent);
    }

    fn in_flight(&self) -> usize {
        self.sink.in_flight()
    }

    fn in_flight_bytes(&self) -> usize {
        self.sink.in_flight_bytes()
    }
}

/// RabbitMQ's reports as the relay reads Kafka's: a confirm lands at the
/// record's routing partition (offset -1: RabbitMQ has none); a refusal is
/// permanent and returns the record for its dead-letter copy.
#[derive(Debug)]
pub struct RabbitReports(pub Reports<Sent>);

impl Deliveries for RabbitReports {
    async fn next(&mut self) -> Option<Report<Token>> {
        let r = self.0.next().await?;
        let Sent {
            token,
            record,
            partition,
        } = r.token;
        Some(match r.result {
            Ok(()) => Report {
                token,
                result: Ok(Delivered {
                    partition,
                    offset: -1,
                }),
                returned: None,
            },
            Err(refusal) => Report {
                token,
                result: Err(DeliveryError {
                    kind: DeliveryErrorKind::Permanent,
                    code: None,
                    message: refusal.to_string(),
                }),
                returned: Some(record),
            },
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
