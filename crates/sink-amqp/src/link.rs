//! The connection's task: publishes, matches confirms and returns to
//! messages, and after a lost connection opens another and publishes the
//! unconfirmed messages again, in their order.
//!
//! Confirms name a message by its delivery tag, which the broker counts
//! from 1 per channel in publishing order: the task numbers its publishes
//! the same way. A `basic.return` names no tag; it comes before the
//! confirm of the same message, which it is matched to by `message_id`
//! (the oldest unconfirmed message with that id).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use amqprs::callbacks::{ChannelCallback, ConnectionCallback};
use amqprs::channel::{
    BasicPublishArguments, Channel, ConfirmSelectArguments, ExchangeDeclareArguments,
};
use amqprs::connection::Connection;
use amqprs::{
    Ack, BasicProperties, Cancel, Close, CloseChannel, FieldTable, FieldValue, Nack, Return,
};
use tokio::sync::{mpsc, oneshot};

/// What amqprs' callbacks return.
type AmqpResult<T> = Result<T, amqprs::error::Error>;
use tokio::time::Instant;

use sink_core::worker::{Command, Job};

use crate::connection::{classify, connect};
use crate::{AmqpConfig, ConnectError, Message, Refusal, Report};

/// The first wait before connecting again, doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// What the broker said, from the callbacks, for the connection `link`.
enum Event {
    Ack {
        link: u64,
        tag: u64,
        multiple: bool,
    },
    Nack {
        link: u64,
        tag: u64,
        multiple: bool,
    },
    Return {
        link: u64,
        /// The delivery tag of the returned publish, from its
        /// [`PUBLISH_HEADER`] (`None`: not one of walbox's).
        tag: Option<u64>,
        code: u16,
        text: String,
        exchange: String,
        routing_key: String,
    },
    Closed {
        link: u64,
        why: String,
    },
}

struct Events {
    link: u64,
    tx: mpsc::UnboundedSender<Event>,
}

#[async_trait::async_trait]
impl ChannelCallback for Events {
    async fn close(&mut self, _: &Channel, close: CloseChannel) -> AmqpResult<()> {
        let why = format!("the broker closed the channel: {close}");
        let _ = self.tx.send(Event::Closed {
            link: self.link,
            why,
        });
        Ok(())
    }
    async fn cancel(&mut self, _: &Channel, _: Cancel) -> AmqpResult<()> {
        Ok(())
    }
    async fn flow(&mut self, _: &Channel, active: bool) -> AmqpResult<bool> {
        Ok(active)
    }
    async fn publish_ack(&mut self, _: &Channel, ack: Ack) {
        let (tag, multiple) = (ack.delivery_tag(), ack.mutiple());
        let _ = self.tx.send(Event::Ack {
            link: self.link,
            tag,
            multiple,
        });
    }
    async fn publish_nack(&mut self, _: &Channel, nack: Nack) {
        let (tag, multiple) = (nack.delivery_tag(), nack.multiple());
        let _ = self.tx.send(Event::Nack {
            link: self.link,
            tag,
            multiple,
        });
    }
    async fn publish_return(
        &mut self,
        _: &Channel,
        ret: Return,
        properties: BasicProperties,
        _: Vec<u8>,
    ) {
        let _ = self.tx.send(Event::Return {
            link: self.link,
            tag: publish_tag(&properties, self.link),
            code: ret.reply_code(),
            text: ret.reply_text().clone(),
            exchange: ret.exchange().clone(),
            routing_key: ret.routing_key().clone(),
        });
    }
}

#[async_trait::async_trait]
impl ConnectionCallback for Events {
    async fn close(&mut self, _: &Connection, close: Close) -> AmqpResult<()> {
        let why = format!("the broker closed the connection: {close}");
        let _ = self.tx.send(Event::Closed {
            link: self.link,
            why,
        });
        Ok(())
    }
    async fn blocked(&mut self, _: &Connection, reason: String) {
        tracing::warn!(%reason, "RabbitMQ blocked walbox's connection (a resource alarm): publishing waits");
    }
    async fn unblocked(&mut self, _: &Connection) {
        tracing::info!("RabbitMQ unblocked walbox's connection");
    }
    async fn secret_updated(&mut self, _: &Connection) {}
}

/// One connection and its confirm-mode channel.
pub(crate) struct Link {
    connection: Connection,
    channel: Channel,
    id: u64,
    next_tag: u64,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Link {
    /// Connects, opens a channel in confirm mode, declares the exchange
    /// (and the audit stream, bound to it).
    pub(crate) async fn open(config: &AmqpConfig, id: u64) -> Result<Link, ConnectError> {
        let shown = config.url.to_string();
        let failed = |e: amqprs::error::Error| classify(config, e);
        let connection = connect(config).await?;
        let (tx, events) = mpsc::unbounded_channel();
        connection
            .register_callback(Events {
                link: id,
                tx: tx.clone(),
            })
            .await
            .map_err(failed)?;
        let channel = connection.open_channel(None).await.map_err(failed)?;
        channel
            .register_callback(Events {
                link: id,
                tx: tx.clone(),
            })
            .await
            .map_err(failed)?;
        let declare = ExchangeDeclareArguments::new(&config.exchange, &config.exchange_type)
            .durable(true)
            .passive(!config.declare_exchange)
            .finish();
        if let Err(e) = channel.exchange_declare(declare).await {
            let _ = connection.close().await;
            return Err(ConnectError::Exchange {
                url: shown,
                exchange: config.exchange.clone(),
                detail: match config.declare_exchange {
                    true => format!(
                        "cannot declare it as a durable {} exchange: {e}",
                        config.exchange_type
                    ),
                    false => format!("it is not there (rabbitmq.declare_exchange = false): {e}"),
                },
            });
        }
        if let Some(stream) = &config.audit_stream {
            if let Err(e) = crate::stream::declare(&connection, config, stream).await {
                let _ = connection.close().await;
                return Err(e);
            }
        }
        channel
            .confirm_select(ConfirmSelectArguments::default())
            .await
            .map_err(failed)?;
        let watched = connection.clone();
        tokio::spawn(async move {
            if watched.listen_network_io_failure().await {
                let why = "the network connection failed".to_owned();
                let _ = tx.send(Event::Closed { link: id, why });
            }
        });
        Ok(Link {
            connection,
            channel,
            id,
            next_tag: 1,
            events,
        })
    }
}

/// What the sink reads of the task's state.
pub(crate) struct Counters {
    pub(crate) connections: Arc<AtomicUsize>,
}

/// A message waiting for its confirm, and a return that came for it.
struct Slot<T> {
    pending: Box<Job<Message, T>>,
    returned: Option<Refusal>,
}

/// The task that owns the connection.
pub(crate) struct Publisher<T> {
    config: AmqpConfig,
    link: Option<Link>,
    links_opened: u64,
    commands: mpsc::UnboundedReceiver<Command<Message, T>>,
    reports: mpsc::UnboundedSender<Report<T>>,
    counters: Counters,
    /// Published on the current link, by delivery tag.
    unconfirmed: BTreeMap<u64, Slot<T>>,
    /// Taken while no link was up: published when one is.
    backlog: VecDeque<Slot<T>>,
    /// Ids given to messages that came without one.
    next_id: u64,
    closing: Option<(Instant, oneshot::Sender<usize>)>,
}

impl<T: Send + 'static> Publisher<T> {
    pub(crate) fn new(
        config: AmqpConfig,
        first: Link,
        commands: mpsc::UnboundedReceiver<Command<Message, T>>,
        reports: mpsc::UnboundedSender<Report<T>>,
        counters: Counters,
    ) -> Self {
        Publisher {
            config,
            link: Some(first),
            links_opened: 1,
            commands,
            reports,
            counters,
            unconfirmed: BTreeMap::new(),
            backlog: VecDeque::new(),
            next_id: 0,
            closing: None,
        }
    }

    pub(crate) async fn run(mut self) {
        let mut backoff = FIRST_BACKOFF;
        loop {
            if let Some((deadline, _)) = &self.closing {
                if self.is_idle() || Instant::now() >= *deadline {
                    return self.finish().await;
                }
            }
            if self.link.is_none() {
                match Link::open(&self.config, self.links_opened).await {
                    Ok(link) => {
                        self.links_opened += 1;
                        self.counters.connections.fetch_add(1, Ordering::Relaxed);
                        backoff = FIRST_BACKOFF;
                        tracing::info!(url = %self.config.url, unconfirmed = self.unconfirmed.len() + self.backlog.len(), "connected to RabbitMQ again: publishing the unconfirmed messages again");
                        self.link = Some(link);
                        self.republish().await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "RabbitMQ: connecting failed; nothing is skipped, trying again");
                        self.wait(backoff).await;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
                continue;
            }
            let deadline = self.closing.as_ref().map(|(d, _)| *d);
            let link = self.link.as_mut().expect("checked");
            tokio::select! {
                event = link.events.recv() => match event {
                    Some(event) => self.on_event(event),
                    None => self.lost("the connection's callbacks ended".into()),
                },
                command = self.commands.recv(), if deadline.is_none() => match command {
                    Some(Command::Publish(pending)) => self.publish(Slot { pending, returned: None }).await,
                    Some(Command::Close(within, done)) => self.closing = Some((Instant::now() + within, done)),
                    None => {
                        let (done, _) = oneshot::channel();
                        self.closing = Some((Instant::now(), done));
                    }
                },
                () = async { tokio::time::sleep_until(deadline.expect("guarded")).await }, if deadline.is_some() => {}
            }
        }
    }

    fn is_idle(&self) -> bool {
        self.unconfirmed.is_empty() && self.backlog.is_empty()
    }

    /// Sleeps `d`, taking commands meanwhile (into the backlog).
    async fn wait(&mut self, d: Duration) {
        let until = Instant::now() + d;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => return,
                command = self.commands.recv(), if self.closing.is_none() => match command {
                    Some(Command::Publish(pending)) => self.backlog.push_back(Slot { pending, returned: None }),
                    Some(Command::Close(within, done)) => {
                        self.closing = Some((Instant::now() + within, done));
                        return;
                    }
                    // Every handle dropped without a close: end now, not
                    // connect forever.
                    None => {
                        let (done, _) = oneshot::channel();
                        self.closing = Some((Instant::now(), done));
                        return;
                    }
                },
            }
        }
    }

    /// Publishes a message on the current link (or keeps it for the next).
    async fn publish(&mut self, mut slot: Slot<T>) {
        let m = &mut slot.pending.message;
        if m.routing_key.len() > 255 {
            let refusal = Refusal::RoutingKeyTooLong(m.routing_key.len());
            return self.report(slot, Err(refusal));
        }
        if let Some((name, _)) = m.headers.iter().find(|(name, _)| name.len() > 255) {
            let refusal = Refusal::HeaderNameTooLong(name.len());
            return self.report(slot, Err(refusal));
        }
        if m.message_id.is_none() {
            self.next_id += 1;
            m.message_id = Some(format!("walbox-{}", self.next_id));
        }
        let Some(link) = self.link.as_mut() else {
            self.backlog.push_back(slot);
            return;
        };
        let tag = link.next_tag;
        link.next_tag += 1;
        let (properties, body, args) =
            frame(&self.config.exchange, &slot.pending.message, (link.id, tag));
        let sent = link.channel.basic_publish(properties, body, args).await;
        self.unconfirmed.insert(tag, slot);
        if let Err(e) = sent {
            self.lost(format!("publishing failed: {e}"));
        }
    }

    /// On a new link: the unconfirmed messages, then those taken since, in
    /// their order.
    async fn republish(&mut self) {
        let mut again: VecDeque<Slot<T>> = std::mem::take(&mut self.unconfirmed)
            .into_values()
            .collect();
        again.append(&mut self.backlog);
        while let Some(mut slot) = again.pop_front() {
            // A return belongs to the publish it answered: this one is new.
            slot.returned = None;
            self.publish(slot).await;
            if self.link.is_none() {
                // Lost again: what is left waits for the next link.
                again.append(&mut self.backlog);
                self.backlog = again;
                return;
            }
        }
    }

    /// The link is gone: what it did not confirm is published again on the
    /// next one.
    fn lost(&mut self, why: String) {
        if let Some(link) = self.link.take() {
            tracing::warn!(%why, unconfirmed = self.unconfirmed.len(), "RabbitMQ connection lost: the unconfirmed messages are published again after reconnecting (some may arrive twice)");
            tokio::spawn(async move {
                let _ = link.connection.close().await;
            });
        }
    }

    fn on_event(&mut self, event: Event) {
        let current = self.link.as_ref().map(|l| l.id);
        match event {
            Event::Ack {
                link,
                tag,
                multiple,
            } if Some(link) == current => {
                for slot in self.take(tag, multiple) {
                    let result = match slot.returned.clone() {
                        Some(refusal) => Err(refusal),
                        None => Ok(()),
                    };
                    self.report(slot, result);
                }
            }
            Event::Nack {
                link,
                tag,
                multiple,
            } if Some(link) == current => {
                for slot in self.take(tag, multiple) {
                    self.report(slot, Err(Refusal::Nacked));
                }
            }
            Event::Return {
                link,
                tag,
                code,
                text,
                exchange,
                routing_key,
            } if Some(link) == current => {
                // The publish itself, named by its tag: never another
                // message with the same id (ids repeat across tables, and a
                // re-sent event may be in flight twice).
                let slot = tag.and_then(|tag| self.unconfirmed.get_mut(&tag));
                match slot {
                    Some(slot) => {
                        slot.returned = Some(Refusal::Unroutable {
                            code,
                            text,
                            exchange,
                            routing_key,
                        })
                    }
                    None => {
                        tracing::warn!(?tag, "RabbitMQ returned a message walbox does not wait for")
                    }
                }
            }
            Event::Closed { link, why } if Some(link) == current => self.lost(why),
            // From a link already given up.
            _ => {}
        }
    }

    /// The unconfirmed messages a confirm of `tag` covers.
    fn take(&mut self, tag: u64, multiple: bool) -> Vec<Slot<T>> {
        if !multiple {
            return self.unconfirmed.remove(&tag).into_iter().collect();
        }
        let rest = self.unconfirmed.split_off(&(tag + 1));
        std::mem::replace(&mut self.unconfirmed, rest)
            .into_values()
            .collect()
    }

    fn report(&mut self, slot: Slot<T>, result: Result<(), Refusal>) {
        // The room is given back when the caller receives the report.
        let refused = result.is_err();
        let _ = self.reports.send(slot.pending.answer(result, refused));
    }

    async fn finish(mut self) {
        let left = self.unconfirmed.len() + self.backlog.len();
        if let Some(link) = self.link.take() {
            let _ = link.connection.close().await;
        }
        if let Some((_, done)) = self.closing.take() {
            let _ = done.send(left);
        }
    }
}

/// The header naming one publish of a message: `<connection>.<delivery
/// tag>`, new on every publish (a message published again after a lost
/// connection gets another). A `basic.return` carries the message's
/// headers, so it names the very publish it refuses.
pub const PUBLISH_HEADER: &str = "walbox.publish";

/// The delivery tag named by a returned message's [`PUBLISH_HEADER`], if it
/// was published on connection `link`.
fn publish_tag(properties: &BasicProperties, link: u64) -> Option<u64> {
    let key = PUBLISH_HEADER.to_owned().try_into().ok()?;
    let text = match properties.headers()?.get(&key)? {
        FieldValue::S(s) => s.to_string(),
        _ => return None,
    };
    let (on, tag) = text.split_once('.')?;
    (on.parse::<u64>().ok()? == link).then_some(())?;
    tag.parse().ok()
}

/// The AMQP frame parts of `m`, as publish `(link, tag)`: persistent,
/// mandatory, its id, headers (and [`PUBLISH_HEADER`]) and timestamp.
fn frame(
    exchange: &str,
    m: &Message,
    (link, tag): (u64, u64),
) -> (BasicProperties, Vec<u8>, BasicPublishArguments) {
    let mut headers = FieldTable::new();
    // Names are at most 255 bytes (checked before), values far below
    // AMQP's 4 GiB.
    for (name, value) in &m.headers {
        let text = String::from_utf8_lossy(value).into_owned();
        if let (Ok(key), Ok(v)) = (name.clone().try_into(), text.try_into()) {
            headers.insert(key, FieldValue::S(v));
        }
    }
    // Last: an event's own header of that name does not replace it.
    if let (Ok(key), Ok(v)) = (
        PUBLISH_HEADER.to_owned().try_into(),
        format!("{link}.{tag}").try_into(),
    ) {
        headers.insert(key, FieldValue::S(v));
    }
    let mut properties = BasicProperties::default();
    properties.with_delivery_mode(2).with_headers(headers);
    if let Some(id) = &m.message_id {
        properties.with_message_id(id);
    }
    if let Some(ts) = m.timestamp_s {
        properties.with_timestamp(ts);
    }
    let args = BasicPublishArguments::new(exchange, &m.routing_key)
        .mandatory(true)
        .finish();
    (properties.finish(), m.body.to_vec(), args)
}
