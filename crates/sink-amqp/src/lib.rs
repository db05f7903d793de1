//! The RabbitMQ side of walbox: AMQP 0-9-1 publishing with the delivery
//! contract walbox keeps on Kafka.
//!
//! - **Publisher confirms.** Every message is published persistent
//!   (`delivery_mode` 2) and `mandatory` on a channel in confirm mode; its
//!   [`Report`] comes when the broker confirmed it (`basic.ack`: on disk in
//!   every queue it was routed to) or refused it (`basic.nack`, or
//!   `basic.return` for a message no queue is bound for). A refusal is
//!   definite: the caller dead-letters the message or stops.
//! - **A lost connection loses nothing.** Messages not confirmed when the
//!   connection or channel goes are kept, and published again, in their
//!   order, on the next connection (tried again with a backoff of 0.5 s to
//!   10 s). A message may so arrive twice (at least once, as on Kafka);
//!   none is skipped, and the first arrivals keep their order.
//! - **Bounded.** The caller reserves room before each message
//!   ([`AmqpSink::reserve`]): at most `max_in_flight` messages and
//!   `max_in_flight_bytes` bytes are unconfirmed.
//!
//! One task owns the connection ([`link`]); the sink and its reports talk
//! to it through channels.

mod connection;
mod destination;
mod link;
mod stream;
mod tls;
mod url;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use sink_core::worker::{Answer, Answers, Worker};

pub use destination::{partition_of, Confirms, Publisher, KEY_HEADER};
pub use link::PUBLISH_HEADER;
pub use stream::{read_stream, AuditStream, MARKER_HEADER};
pub use tls::{TlsError, TlsFiles};
pub use url::{AmqpUrl, UrlError};

/// Where to publish, and how much may wait for confirms.
#[derive(Clone)]
pub struct AmqpConfig {
    /// The broker.
    pub url: AmqpUrl,
    /// TLS's files and verified name, for an `amqps://` URL.
    pub tls: TlsFiles,
    /// The exchange every message is published to.
    pub exchange: String,
    /// Declare the exchange (durable, of `exchange_type`) on each
    /// connection; else it must exist.
    pub declare_exchange: bool,
    /// The declared exchange's type (`topic`, `direct`, …).
    pub exchange_type: String,
    /// Most unconfirmed messages.
    pub max_in_flight: usize,
    /// Most unconfirmed bytes (a larger message waits for all room).
    pub max_in_flight_bytes: usize,
    /// The connection's name, shown by `rabbitmqctl list_connections`.
    pub connection_name: String,
    /// Routing partitions ([`Publisher`]): above 1, a record's routing key
    /// is `<topic>.<n>`, `n` the hash of its key modulo the partitions.
    pub partitions: u32,
    /// The record header whose value becomes the `message_id` property
    /// ([`Publisher`]).
    pub message_id_header: String,
    /// A stream queue bound to the exchange for `walbox audit` to read
    /// back ([`read_stream`]): declared when missing, bound on each
    /// connection.
    pub audit_stream: Option<AuditStream>,
}

impl std::fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.url)
            .field("tls", &self.tls)
            .field("exchange", &self.exchange)
            .field("declare_exchange", &self.declare_exchange)
            .field("exchange_type", &self.exchange_type)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("partitions", &self.partitions)
            .field("audit_stream", &self.audit_stream)
            .finish_non_exhaustive()
    }
}

/// One message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its routing key (at most 255 bytes).
    pub routing_key: String,
    /// Its body.
    pub body: Bytes,
    /// The `message_id` property.
    pub message_id: Option<String>,
    /// Headers, each a byte string.
    pub headers: Vec<(String, Bytes)>,
    /// The `timestamp` property, in seconds since the Unix epoch.
    pub timestamp_s: Option<u64>,
}

impl Message {
    /// Its size, for the in-flight bound.
    pub fn size(&self) -> usize {
        self.body.len()
            + self.routing_key.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }
}

/// Why the broker will not take a message: for good, as it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `basic.nack`: the broker could not take it (a queue at its length
    /// limit with `overflow = reject-publish`, an internal error).
    #[error("RabbitMQ refused the message (basic.nack): a queue it routes to is full with overflow = reject-publish, or the broker failed to store it")]
    Nacked,
    /// `basic.return`: no queue is bound for its routing key.
    #[error("RabbitMQ returned the message as unroutable ({code} {text}): no queue is bound to exchange {exchange:?} for routing key {routing_key:?}")]
    Unroutable {
        /// The reply code (312 NO_ROUTE).
        code: u16,
        /// The reply text.
        text: String,
        /// The exchange.
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// A routing key AMQP cannot carry.
    #[error("routing key of {0} bytes: AMQP allows at most 255")]
    RoutingKeyTooLong(usize),
    /// A header name AMQP cannot carry.
    #[error("header name of {0} bytes: AMQP allows at most 255")]
    HeaderNameTooLong(usize),
}

/// A message's fate: confirmed, or refused for good (with the message,
/// for a dead-letter copy).
pub type Report<T> = Answer<Message, T, (), Refusal>;

/// Each published message's report, once.
pub type Reports<T> = Answers<Message, T, (), Refusal>;

/// Publishes messages through the connection's task; their reports arrive
/// on [`Reports`].
pub struct AmqpSink<T> {
    worker: Worker<Message, T>,
    connections: Arc<AtomicUsize>,
}

impl<T> std::fmt::Debug for AmqpSink<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("in_flight", &self.worker.in_flight())
            .finish_non_exhaustive()
    }
}

/// Why the broker cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// It refused walbox's credentials or virtual host: no retry helps.
    #[error("RabbitMQ at {url} refused the connection: {detail}; check the user, password and virtual host in the URL")]
    Refused {
        /// The broker, without credentials.
        url: String,
        /// What it said.
        detail: String,
    },
    /// TLS failed for good: a certificate that is not trusted or not for
    /// the host, a client certificate the broker wants and does not get or
    /// accept, or TLS files walbox cannot use.
    #[error("RabbitMQ at {url}: TLS: {detail}")]
    Tls {
        /// The broker, without credentials.
        url: String,
        /// What failed, and what to check.
        detail: String,
    },
    /// It did not answer, or went away.
    #[error("RabbitMQ at {url} did not answer: {detail}")]
    Unavailable {
        /// The broker, without credentials.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The exchange cannot be used (not there, or of another type).
    #[error("RabbitMQ at {url}: exchange {exchange:?}: {detail}")]
    Exchange {
        /// The broker, without credentials.
        url: String,
        /// The exchange.
        exchange: String,
        /// What the broker said.
        detail: String,
    },
}

impl ConnectError {
    /// True when trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ConnectError::Unavailable { .. })
    }
}

impl<T: Send + 'static> AmqpSink<T> {
    /// Connects once (so that a broker that refuses walbox fails now, in
    /// one line), then publishes through a task of its own.
    pub async fn connect(config: AmqpConfig) -> Result<(AmqpSink<T>, Reports<T>), ConnectError> {
        let first = link::Link::open(&config, 0).await?;
        let (worker, commands) = Worker::new(config.max_in_flight, config.max_in_flight_bytes);
        let (reports_tx, reports) = Reports::channel();
        let connections = Arc::new(AtomicUsize::new(1));
        let sink = AmqpSink {
            worker,
            connections: Arc::clone(&connections),
        };
        let task = link::Publisher::new(
            config,
            first,
            commands,
            reports_tx,
            link::Counters { connections },
        );
        tokio::spawn(task.run());
        Ok((sink, reports))
    }

    /// Room, messages handed to the connection's task, and what is in
    /// flight.
    pub fn worker(&self) -> &Worker<Message, T> {
        &self.worker
    }

    /// Connections opened so far (the first included): each after the
    /// first followed a lost one.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Waits up to `within` for the confirms of what is in flight (their
    /// reports arrive meanwhile), then closes the connection. Returns how
    /// many messages were left unconfirmed.
    pub async fn close(self, within: std::time::Duration) -> usize {
        self.worker.close(within).await
    }
}
