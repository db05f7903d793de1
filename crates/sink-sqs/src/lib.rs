//! The Amazon SQS side of walbox: `SendMessageBatch` with the delivery
//! contract walbox keeps on Kafka.
//!
//! - **A report per message.** A message's [`Report`] comes when SQS
//!   stored it (it is in the batch's `Successful` list) or refused it for
//!   good (a per-entry failure at the sender's fault, or a message SQS
//!   cannot take, checked before sending: [`Refusal`]). The caller
//!   dead-letters a refused message or stops.
//! - **Nothing skipped.** A request that fails (SQS unreachable, throttled,
//!   a server error) and an entry that fails at SQS's fault are sent again,
//!   in their order, with a backoff of 0.5 s to 10 s, for as long as it
//!   takes. A request whose answer was lost may so store a message twice:
//!   on a FIFO queue its deduplication id makes SQS drop the second copy
//!   within five minutes; on a standard queue it arrives twice (at least
//!   once, as on Kafka).
//! - **Per-key order on FIFO queues.** The key is the message group; each
//!   group's messages go through one lane, one batch at a time, a batch
//!   holding one message per group ([`batch`]).
//! - **Bounded.** The caller reserves room before each message
//!   ([`SqsSink::reserve`]): at most `max_in_flight` messages and
//!   `max_in_flight_bytes` bytes are unreported.
//! - **Dead letters fit.** A dead-letter message larger than its queue
//!   takes is sent with a note in place of its body (its attributes say
//!   what it was and why it failed).
//! - **Definite failures stop.** A request SQS refuses for good (no such
//!   queue, access denied, bad credentials) reports its messages as
//!   [`Failure::Stopped`]: the caller stops, and nothing after them is
//!   confirmed.
//!
//! One task sends ([`sender`]); the sink and its reports talk to it
//! through channels.

mod batch;
mod destination;
mod message;
mod queue;
mod sender;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use sink_core::worker::{Answer, Answers, Worker};
use sink_core::Permit;

pub use destination::{Outcomes, Publisher, DEAD_LETTER_TOPIC, KEY_ATTRIBUTE};

pub use message::{fifo_id, Message, QueueRole, Refusal, MAX_ATTRIBUTES, NO_KEY_GROUP};
pub use queue::{region_of, QueueInfo};

/// Where to send, and how much may wait for SQS.
#[derive(Clone, Debug)]
pub struct SqsConfig {
    /// The events' queue.
    pub queue_url: String,
    /// The dead-letter queue, if dead letters are sent.
    pub dead_letter_queue_url: Option<String>,
    /// The region; else the queue URL's, else the AWS chain's
    /// (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// Another SQS endpoint (an SQS-compatible server, a VPC endpoint).
    pub endpoint: Option<String>,
    /// How many batches may be on their way at once (each message group
    /// keeps to one).
    pub lanes: usize,
    /// Most unreported messages.
    pub max_in_flight: usize,
    /// Most unreported bytes (a larger message waits for all room).
    pub max_in_flight_bytes: usize,
    /// After a message is refused, send nothing more: what waits is
    /// reported [`Failure::Withheld`] (the caller stops on a refusal, and
    /// nothing after the refused message may arrive ahead of it).
    pub gapless: bool,
}

/// Why a message was not stored.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// SQS will never take it as it is.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Its request was refused for good (the queue, the credentials or
    /// their permissions): the caller must stop.
    #[error("{0}")]
    Stopped(String),
    /// Not sent: an earlier message was refused and the sink is gapless
    /// ([`SqsConfig::gapless`]).
    #[error("not sent: an earlier message was refused")]
    Withheld,
}

/// Where SQS stored a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The message id SQS gave it.
    pub message_id: String,
    /// Its sequence number in its group (FIFO queues).
    pub sequence_number: Option<String>,
}

/// A message's fate: stored, or not for good (with the message, when
/// refused, for a dead-letter copy).
pub type Report<T> = Answer<Message, T, Stored, Failure>;

/// Each sent message's report, once.
pub type Reports<T> = Answers<Message, T, Stored, Failure>;

/// Sends messages; their reports arrive on [`Reports`].
pub struct SqsSink<T> {
    worker: Worker<Message, T>,
    /// Messages sent and not reported, as the sending task counts them.
    unreported: Arc<AtomicUsize>,
    events: QueueInfo,
    dead_letters: Option<QueueInfo>,
}

impl<T> std::fmt::Debug for SqsSink<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsSink")
            .field("events", &self.events)
            .field("in_flight", &self.worker.in_flight())
            .finish_non_exhaustive()
    }
}

/// Why the queue cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// SQS refused: no such queue, no credentials, access denied. No retry
    /// helps.
    #[error("SQS queue {queue}: {detail}")]
    Refused {
        /// The queue URL.
        queue: String,
        /// What went wrong.
        detail: String,
    },
    /// SQS did not answer.
    #[error("SQS queue {queue}: no answer: {detail}")]
    Unavailable {
        /// The queue URL.
        queue: String,
        /// What happened.
        detail: String,
    },
}

impl ConnectError {
    /// True when trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ConnectError::Unavailable { .. })
    }
}

impl<T: Send + 'static> SqsSink<T> {
    /// Reads the queues' attributes (so that a queue that is not there, or
    /// credentials SQS refuses, fail now in one line), then sends through
    /// a task of its own.
    pub async fn connect(config: SqsConfig) -> Result<(SqsSink<T>, Reports<T>), ConnectError> {
        let client = queue::client(&config).await?;
        let events = queue::attributes(&client, &config.queue_url).await?;
        let dead_letters = match &config.dead_letter_queue_url {
            Some(url) => Some(queue::attributes(&client, url).await?),
            None => None,
        };
        let (worker, commands_rx) = Worker::new(config.max_in_flight, config.max_in_flight_bytes);
        let (reports_tx, reports) = Reports::channel();
        let unreported = Arc::new(AtomicUsize::new(0));
        let sink = SqsSink {
            worker,
            unreported: Arc::clone(&unreported),
            events: events.clone(),
            dead_letters: dead_letters.clone(),
        };
        let task = sender::Sender::new(
            client,
            sender::Queues {
                events,
                dead_letters,
            },
            config.lanes,
            config.gapless,
            commands_rx,
            reports_tx,
            sender::Counters {
                in_flight: unreported,
            },
        );
        tokio::spawn(task.run());
        Ok((sink, reports))
    }

    /// The events' queue, as read at connect.
    pub fn events_queue(&self) -> &QueueInfo {
        &self.events
    }

    /// The dead-letter queue, as read at connect.
    pub fn dead_letter_queue(&self) -> Option<&QueueInfo> {
        self.dead_letters.as_ref()
    }

    /// Room, messages handed to the sending task, and what is in flight.
    pub fn worker(&self) -> &Worker<Message, T> {
        &self.worker
    }

    /// Sends `message`; its fate arrives on [`Reports::next`].
    pub fn publish(&self, permit: Permit, message: Message, token: T) {
        self.unreported.fetch_add(1, Ordering::Relaxed);
        self.worker.publish(permit, message, token);
    }

    /// Waits up to `within` for the reports of what is in flight (they
    /// arrive meanwhile), then stops sending. Returns how many messages
    /// were left unreported.
    pub async fn close(self, within: std::time::Duration) -> usize {
        self.worker.close(within).await
    }
}
