//! The audit stream: a RabbitMQ stream queue bound to walbox's exchange for
//! every routing key, so that what walbox published can be read back
//! without taking it from anyone (`walbox audit`).
//!
//! - **Declared by walbox** on each connection when it is missing (durable,
//!   `x-queue-type: stream`, `x-max-age` for its retention) and bound to the
//!   exchange with `#` (a topic exchange) or no key (fanout). One that
//!   exists is used as it is, whatever its arguments.
//! - **Every message reaches it.** Publishes are `mandatory`, and a message
//!   no queue of the user's is bound for is no longer returned: the stream
//!   takes it. Such events are delivered, not refused.
//! - **Read to a marker.** A stream tells an AMQP 0-9-1 client neither its
//!   length nor its last offset. A read publishes a marker to the stream
//!   itself (through the default exchange: no other queue sees it) and
//!   reads up to it: everything confirmed before the read started lies
//!   before the marker. Markers stay in the stream, one per read, and are
//!   passed over.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use amqprs::channel::{
    BasicAckArguments, BasicConsumeArguments, BasicPublishArguments, BasicQosArguments, Channel,
    QueueBindArguments, QueueDeclareArguments,
};
use amqprs::connection::Connection;
use amqprs::{BasicProperties, FieldTable, FieldValue};
use sink_core::readback::{ReadBack, ReadFrom, ReadSummary, RecordTime, Truncated};

use crate::connection::{classify, connect};
use crate::{AmqpConfig, ConnectError, KEY_HEADER};

/// The header that marks the end of a read.
pub const MARKER_HEADER: &str = "walbox.audit-marker";
/// Deliveries a reader holds unacknowledged (a stream consumer needs a
/// prefetch): its memory bound, with the message handed over.
const PREFETCH: u16 = 500;

/// How far the broker's clock may be behind walbox's.
const CLOCK_SKEW_MS: i64 = 60_000;

/// The stream, and how long it keeps messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditStream {
    /// The stream queue's name.
    pub name: String,
    /// Its `x-max-age` when walbox declares it (`7D`, `24h`, …).
    pub max_age: String,
}

/// Declares the stream if it is missing and binds it to the exchange.
pub(crate) async fn declare(
    connection: &Connection,
    config: &AmqpConfig,
    stream: &AuditStream,
) -> Result<(), ConnectError> {
    let refused = |detail: String| ConnectError::Exchange {
        url: config.url.to_string(),
        exchange: config.exchange.clone(),
        detail: format!("the audit stream {:?}: {detail}", stream.name),
    };
    let failed = |e: amqprs::error::Error| classify(config, e);
    // A passive declare of a missing queue closes its channel: one of its own.
    let probe = connection.open_channel(None).await.map_err(failed)?;
    let passive = QueueDeclareArguments::new(&stream.name)
        .passive(true)
        .finish();
    if probe.queue_declare(passive).await.is_err() {
        let channel = connection.open_channel(None).await.map_err(failed)?;
        let mut arguments = FieldTable::new();
        insert(&mut arguments, "x-queue-type", text("stream"));
        insert(&mut arguments, "x-max-age", text(&stream.max_age));
        let create = QueueDeclareArguments::new(&stream.name)
            .durable(true)
            .arguments(arguments)
            .finish();
        channel
            .queue_declare(create)
            .await
            .map_err(|e| refused(format!("cannot declare it as a stream queue: {e}")))?;
        let _ = channel.close().await;
    } else {
        let _ = probe.close().await;
    }
    let key = match config.exchange_type.as_str() {
        "fanout" => "",
        _ => "#",
    };
    let channel = connection.open_channel(None).await.map_err(failed)?;
    channel
        .queue_bind(QueueBindArguments::new(&stream.name, &config.exchange, key))
        .await
        .map_err(|e| refused(format!("cannot bind it to the exchange: {e}")))?;
    let _ = channel.close().await;
    Ok(())
}

/// `v` as an AMQP long string.
fn text(v: &str) -> Option<FieldValue> {
    v.to_owned().try_into().ok().map(FieldValue::S)
}

fn insert(table: &mut FieldTable, name: &str, value: Option<FieldValue>) {
    if let (Ok(key), Some(value)) = (name.to_owned().try_into(), value) {
        table.insert(key, value);
    }
}

/// A delivery from the stream, as [`ReadBack`].
struct Delivery<'a> {
    topic: &'a str,
    offset: i64,
    headers: Option<&'a FieldTable>,
}

impl ReadBack for Delivery<'_> {
    fn topic(&self) -> &str {
        self.topic
    }
    fn partition(&self) -> i32 {
        0
    }
    fn offset(&self) -> i64 {
        self.offset
    }
    fn key(&self) -> Option<&[u8]> {
        self.header(KEY_HEADER)
    }
    fn time(&self) -> RecordTime {
        // The timestamp property has whole seconds: too coarse to place a
        // record in a window of milliseconds.
        RecordTime::None
    }
    fn header(&self, name: &str) -> Option<&[u8]> {
        header(self.headers?, name)
    }
}

fn header<'a>(headers: &'a FieldTable, name: &str) -> Option<&'a [u8]> {
    let key = name.to_owned().try_into().ok()?;
    match headers.get(&key)? {
        FieldValue::S(s) => Some(s.as_ref().as_bytes()),
        _ => None,
    }
}

/// Reads every message of the audit stream from `from` to a marker
/// published when the read starts (see the module docs), one at a time,
/// without taking any from the stream. A routing key is handed over as the
/// topic, without its routing partition (`.<n>`) when
/// [`AmqpConfig::partitions`] > 1.
pub async fn read_stream(
    config: &AmqpConfig,
    stream: &AuditStream,
    from: ReadFrom,
    stall: Duration,
    mut each: impl FnMut(&dyn ReadBack) -> Result<(), String>,
) -> Result<ReadSummary, String> {
    let shown = config.url.to_string();
    let name = &stream.name;
    let fail = |what: &str, e: amqprs::error::Error| {
        format!("RabbitMQ at {shown}: the audit stream {name:?}: {what}: {e}")
    };
    let connection = connect(config).await.map_err(|e| e.to_string())?;
    let probe = connection
        .open_channel(None)
        .await
        .map_err(|e| fail("a channel", e))?;
    let passive = QueueDeclareArguments::new(name).passive(true).finish();
    if let Err(e) = probe.queue_declare(passive).await {
        let _ = connection.close().await;
        return Err(format!("RabbitMQ at {shown}: the audit stream {name:?} is not there ({e}): walbox run declares it (rabbitmq.audit_stream), and it holds what was published since"));
    }
    let marker = marker_id();
    publish_marker(&probe, name, &marker)
        .await
        .map_err(|e| fail("publishing the read's end marker", e))?;

    let channel = connection
        .open_channel(None)
        .await
        .map_err(|e| fail("a channel", e))?;
    channel
        .basic_qos(BasicQosArguments::new(0, PREFETCH, false))
        .await
        .map_err(|e| fail("a prefetch", e))?;
    let mut arguments = FieldTable::new();
    let offset = match from {
        ReadFrom::Beginning => text("first"),
        // Whole seconds, rounded down: a stream starts at the chunk that
        // holds that time, so never after it. Never after the marker
        // either (a minute before now, for the broker's clock).
        ReadFrom::Time(ms) => {
            let now_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let s = ms.min(now_ms - CLOCK_SKEW_MS).div_euclid(1000);
            Some(FieldValue::T(u64::try_from(s).unwrap_or(0)))
        }
    };
    insert(&mut arguments, "x-stream-offset", offset);
    let mut consume = BasicConsumeArguments::new(name, "walbox-audit");
    consume.manual_ack(true).arguments(arguments);
    let (_tag, mut deliveries) = channel
        .basic_consume_rx(consume)
        .await
        .map_err(|e| fail("a reader", e))?;

    let partitioned = config.partitions > 1;
    let mut summary = ReadSummary::default();
    let mut first = true;
    let result = loop {
        let Ok(Some(delivery)) = tokio::time::timeout(stall, deliveries.recv()).await else {
            break Err(format!("RabbitMQ at {shown}: the audit stream {name:?}: no message for {stall:?} before the read's end marker"));
        };
        let (Some(deliver), Some(properties)) = (&delivery.deliver, &delivery.basic_properties)
        else {
            continue;
        };
        let headers = properties.headers();
        let offset = headers.and_then(stream_offset).unwrap_or(-1);
        let tag = deliver.delivery_tag();
        if tag % u64::from(PREFETCH / 2) == 0 {
            let _ = channel.basic_ack(BasicAckArguments::new(tag, true)).await;
        }
        // A marker: this read's ends it, an earlier read's is passed over.
        match headers.and_then(|h| header(h, MARKER_HEADER)) {
            Some(m) if m == marker.as_bytes() => break Ok(()),
            Some(_) => continue,
            None => {}
        }
        if std::mem::take(&mut first) && offset > 0 {
            let deleted_before = match from {
                ReadFrom::Beginning => true,
                ReadFrom::Time(ms) => properties.timestamp().is_some_and(|s| {
                    i64::try_from(s).unwrap_or(i64::MAX).saturating_mul(1000) > ms
                }),
            };
            if deleted_before {
                summary.truncated.push(Truncated {
                    topic: name.clone(),
                    partition: 0,
                    first_offset: offset,
                });
            }
        }
        let routing_key = deliver.routing_key().as_str();
        let topic = match routing_key.rsplit_once('.') {
            Some((topic, n)) if partitioned && n.parse::<u32>().is_ok() => topic,
            _ => routing_key,
        };
        summary.records += 1;
        if let Err(e) = each(&Delivery {
            topic,
            offset,
            headers,
        }) {
            break Err(e);
        }
    };
    let _ = connection.close().await;
    result.map(|()| summary)
}

/// The offset a stream gives each delivery, in its `x-stream-offset` header.
fn stream_offset(headers: &FieldTable) -> Option<i64> {
    let key = "x-stream-offset".to_owned().try_into().ok()?;
    match headers.get(&key)? {
        FieldValue::l(n) => Some(*n),
        FieldValue::I(n) => Some(i64::from(*n)),
        _ => None,
    }
}

/// An id no other read's marker has.
fn marker_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}", std::process::id())
}

async fn publish_marker(
    channel: &Channel,
    stream: &str,
    marker: &str,
) -> Result<(), amqprs::error::Error> {
    let mut headers = FieldTable::new();
    insert(&mut headers, MARKER_HEADER, text(marker));
    let mut properties = BasicProperties::default();
    properties.with_delivery_mode(2).with_headers(headers);
    // The default exchange routes by queue name: only the stream sees it.
    let args = BasicPublishArguments::new("", stream);
    channel
        .basic_publish(properties.finish(), Vec::new(), args)
        .await
}
