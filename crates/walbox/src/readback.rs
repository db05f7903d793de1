//! The configured broker read back without taking anything from anyone:
//! what `walbox audit` and the continuous audit compare with what walbox
//! sent. Each broker's reader is in its crate; this is where the
//! configuration picks one, and says why a broker cannot be read.
//!
//! | broker | read | partition, offset |
//! |---|---|---|
//! | Kafka | the topics, `read_committed` | partition, offset |
//! | NATS JetStream | each stream taking the subjects, an ordered consumer | 0, stream sequence |
//! | RabbitMQ | the audit stream (`rabbitmq.audit_stream`), to a marker | 0, stream offset |
//! | SQS, webhooks | cannot be | — |

use std::time::Duration;

use sink_core::readback::{RangeRead, ReadBack, ReadFrom, ReadSummary};
use sink_kafka::SinkConfig;

use crate::config::unreadable;
use crate::config::SinkSettings;

/// What takes the records a read hands over, one at a time (a reader of
/// Kafka runs on a thread of its own, so it is moved there and back).
pub trait Each: Send + 'static {
    /// One record; an error ends the read with it.
    fn each(&mut self, record: &dyn ReadBack) -> Result<(), String>;
}

/// A broker that can be read back.
#[derive(Clone, Debug)]
pub enum Readback {
    /// Kafka's topics.
    Kafka(SinkConfig),
    /// JetStream's streams.
    Nats(sink_nats::NatsConfig),
    /// RabbitMQ's audit stream.
    RabbitMq(Box<sink_amqp::AmqpConfig>, sink_amqp::AuditStream),
}

impl Readback {
    /// The configured broker's reader, or why it cannot be read back.
    pub fn of(sink: &SinkSettings) -> Result<Readback, String> {
        match sink {
            SinkSettings::Kafka(k) => Ok(Readback::Kafka(k.clone())),
            SinkSettings::Nats(n) => Ok(Readback::Nats(n.clone())),
            SinkSettings::RabbitMq(r) => match &r.audit_stream {
                Some(stream) => Ok(Readback::RabbitMq(Box::new(r.clone()), stream.clone())),
                None => Err(unreadable::NO_AUDIT_STREAM.into()),
            },
            SinkSettings::Sqs(_) => Err(unreadable::SQS.into()),
            SinkSettings::Webhook(_) => Err(unreadable::WEBHOOK.into()),
        }
    }

    /// Hands every record of `topics` from `from` to their end (when the
    /// read started) to `each`, one at a time; gives `each` back.
    pub async fn read_topics<E: Each>(
        &self,
        topics: Vec<String>,
        from: ReadFrom,
        stall: Duration,
        mut each: E,
    ) -> Result<(ReadSummary, E), String> {
        match self {
            Readback::Kafka(config) => {
                let config = config.clone();
                // librdkafka's consumer blocks.
                tokio::task::spawn_blocking(move || {
                    sink_kafka::read_topics(&config, &topics, from, stall, |r| each.each(r))
                        .map(|summary| (summary, each))
                        .map_err(|e| format!("kafka: {e}"))
                })
                .await
                .map_err(|e| e.to_string())?
            }
            Readback::Nats(config) => {
                let from = by_arrival(from);
                let summary =
                    sink_nats::read_streams(config, &topics, from, stall, |r| each.each(r)).await?;
                Ok((summary, each))
            }
            Readback::RabbitMq(config, stream) => {
                // The stream holds every topic: the caller picks.
                let from = by_arrival(from);
                let summary =
                    sink_amqp::read_stream(config, stream, from, stall, |r| each.each(r)).await?;
                Ok((summary, each))
            }
        }
    }

    /// Reads offsets `from..to` of one partition (a Kafka topic's, or a
    /// JetStream stream's) for the continuous audit.
    pub async fn read_range<E: Each>(
        &self,
        place: &str,
        partition: i32,
        range: (i64, i64),
        stall: Duration,
        mut each: E,
    ) -> Result<(RangeRead, E), String> {
        // The range readers take every record; the first refusal of
        // `each` is the read's error.
        let mut refused = None;
        let read = match self {
            Readback::Kafka(config) => {
                let (config, topic) = (config.clone(), place.to_owned());
                // librdkafka's consumer blocks.
                let (read, back, why) = tokio::task::spawn_blocking(move || {
                    let mut refused = None;
                    let read =
                        sink_kafka::read_range(&config, &topic, partition, range, stall, |r| {
                            if let Err(e) = each.each(r) {
                                refused.get_or_insert(e);
                            }
                        });
                    (read, each, refused)
                })
                .await
                .map_err(|e| e.to_string())?;
                (each, refused) = (back, why);
                read?
            }
            Readback::Nats(config) => {
                sink_nats::read_range(config, place, range, stall, |r| {
                    if let Err(e) = each.each(r) {
                        refused.get_or_insert(e);
                    }
                })
                .await?
            }
            Readback::RabbitMq(..) => return Err(unreadable::CONFIRM_HAS_NO_OFFSET.into()),
        };
        match refused {
            Some(e) => Err(e),
            None => Ok((read, each)),
        }
    }
}

/// Streams keep the time a message arrived, not the event's: a little
/// after it, or before it by the difference of the two servers' clocks.
/// A read from a time starts this much earlier (what else it reads is
/// out of the window, and passed over by the audit).
const ARRIVAL_MARGIN_MS: i64 = 60_000;

fn by_arrival(from: ReadFrom) -> ReadFrom {
    match from {
        ReadFrom::Time(ms) => ReadFrom::Time(ms.saturating_sub(ARRIVAL_MARGIN_MS)),
        ReadFrom::Beginning => ReadFrom::Beginning,
    }
}
