//! The configured broker ([`SinkSettings`]) as one [`Destination`]: every
//! path that publishes (the stream, backfills, heals, resyncs, a recreated
//! slot, quarantine releases, dead letters) connects here, so none can
//! reach another broker than `sink`, and a new broker is one variant.
//!
//! What differs between brokers stays in their crates (how a record
//! becomes a message, what a confirm or refusal means); what is Kafka's
//! alone is said where it is used: waiting for an unreachable cluster at
//! start ([`Patience`]), transactions ([`Broker::transactional`]) and the
//! producer's statistics.

use std::time::Duration;

use sink_core::{Admission, Deliveries, Destination, Permit, Record, Report};
use sink_kafka::Sink;
use tokio::sync::watch;

use crate::config::SinkSettings;
use crate::metrics::Metrics;
use crate::relay::{Backoff, RunError, Stop};

/// How long the brokers may take to answer one check at startup.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Where events go.
pub enum Broker<T: Send + Sync + 'static> {
    /// `sink = "kafka"`.
    Kafka(Sink<T>),
    /// `sink = "rabbitmq"`.
    RabbitMq(sink_amqp::Publisher<T>),
    /// `sink = "sqs"`.
    Sqs(sink_sqs::Publisher<T>),
    /// `sink = "nats"` (boxed: the client is large beside the others).
    Nats(Box<sink_nats::Publisher<T>>),
    /// `sink = "webhook"`.
    Webhook(sink_webhook::Publisher<T>),
}

/// Its reports.
pub enum BrokerReports<T: Send + Sync + 'static> {
    /// Kafka's delivery reports.
    Kafka(sink_kafka::Reports<T>),
    /// RabbitMQ's publisher confirms.
    RabbitMq(sink_amqp::Confirms<T>),
    /// SQS's answers.
    Sqs(sink_sqs::Outcomes<T>),
    /// JetStream's acks (boxed: it holds the ack being awaited).
    Nats(Box<sink_nats::Acks<T>>),
    /// The endpoint's answers.
    Webhook(sink_webhook::Answers<T>),
}

impl<T: Send + Sync + 'static> std::fmt::Debug for Broker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Broker").field(&self.name()).finish()
    }
}

impl<T: Send + Sync + 'static> std::fmt::Debug for BrokerReports<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BrokerReports")
    }
}

/// How long a connection waits for an unreachable broker.
#[derive(Debug)]
pub enum Patience<'a> {
    /// Fail if it does not answer now (a command such as `resync`).
    Once,
    /// As long as it takes, until a signal (`walbox run`: routine broker
    /// maintenance must not crash-loop the pod).
    UntilStopped(&'a watch::Receiver<Stop>),
}

impl<T: Send + Sync + 'static> Broker<T> {
    /// Connects to the broker `settings` name. A refusal (TLS, SASL, the
    /// credentials, a queue that is not there) is definite; `None`: a
    /// signal came while waiting.
    pub async fn connect(
        settings: &SinkSettings,
        patience: Patience<'_>,
        metrics: &Metrics,
    ) -> Result<Option<(Broker<T>, BrokerReports<T>)>, RunError> {
        match settings {
            SinkSettings::Kafka(config) => {
                let (sink, reports) = Sink::<T>::new(config)?;
                tracing::info!(bootstrap = %config.bootstrap_servers, "connecting to Kafka");
                let brokers = match patience {
                    Patience::Once => check_brokers(&sink, &config.bootstrap_servers).await?,
                    Patience::UntilStopped(shutdown) => {
                        match wait_for_brokers(&sink, &config.bootstrap_servers, metrics, shutdown)
                            .await?
                        {
                            Some(brokers) => brokers,
                            None => return Ok(None),
                        }
                    }
                };
                tracing::info!(
                    brokers = brokers.count,
                    answered_by = %brokers.answered_by,
                    "connected to Kafka"
                );
                Ok(Some((Broker::Kafka(sink), BrokerReports::Kafka(reports))))
            }
            SinkSettings::RabbitMq(config) => {
                let (publisher, confirms) = sink_amqp::Publisher::connect(config.clone()).await?;
                tracing::info!(url = %config.url, exchange = %config.exchange, partitions = config.partitions, "connected to RabbitMQ");
                Ok(Some((
                    Broker::RabbitMq(publisher),
                    BrokerReports::RabbitMq(confirms),
                )))
            }
            SinkSettings::Sqs(config) => {
                let (publisher, outcomes) = sink_sqs::Publisher::connect(config.clone()).await?;
                let events = publisher.events_queue();
                tracing::info!(queue = %events.url, fifo = events.fifo, max_message_bytes = events.max_message_bytes, dead_letter_queue = ?publisher.dead_letter_queue().map(|q| &q.url), "connected to SQS");
                if !events.fifo {
                    tracing::warn!(queue = %events.url, "a standard SQS queue: events arrive in no particular order, and a re-sent event arrives twice (docs/sqs.md)");
                }
                Ok(Some((Broker::Sqs(publisher), BrokerReports::Sqs(outcomes))))
            }
            SinkSettings::Webhook(config) => {
                let (publisher, answers) = sink_webhook::Publisher::new(config.clone())?;
                tracing::info!(url = %publisher.url(), signed = config.secret.is_some(), "POSTing events to a webhook");
                Ok(Some((
                    Broker::Webhook(publisher),
                    BrokerReports::Webhook(answers),
                )))
            }
            SinkSettings::Nats(config) => {
                let (publisher, acks) = sink_nats::Publisher::connect(config.clone()).await?;
                tracing::info!(url = %publisher.url(), "connected to NATS (JetStream)");
                Ok(Some((
                    Broker::Nats(Box::new(publisher)),
                    BrokerReports::Nats(Box::new(acks)),
                )))
            }
        }
    }

    /// The largest message the broker takes, where it says so at
    /// connection: an SQS queue's MaximumMessageSize. Kafka's limit is the
    /// topic's, and RabbitMQ's the broker's setting, neither known here.
    pub fn message_limit(&self) -> Option<usize> {
        match self {
            Broker::Sqs(publisher) => Some(publisher.events_queue().max_message_bytes),
            Broker::Kafka(_) | Broker::RabbitMq(_) | Broker::Nats(_) | Broker::Webhook(_) => None,
        }
    }

    /// The claim-check for this broker: its threshold under the broker's
    /// message limit (said once, when lowered).
    pub fn claim_check(
        &self,
        config: Option<&crate::claim_check::ClaimCheckConfig>,
    ) -> Result<Option<crate::claim_check::ClaimCheck>, crate::claim_check::ClaimCheckError> {
        let Some(config) = config else {
            return Ok(None);
        };
        let configured = config.threshold;
        let (config, lowered) = config.clone().within(self.message_limit());
        if lowered {
            tracing::info!(
                configured,
                threshold = config.threshold,
                "claim_check.threshold_bytes lowered under the broker's largest message (the SQS queue's MaximumMessageSize, less 1 KiB for what SQS counts besides the record)"
            );
        }
        crate::claim_check::ClaimCheck::new(config).map(Some)
    }

    /// The broker, as `sink` names it.
    pub fn name(&self) -> &'static str {
        match self {
            Broker::Kafka(_) => "kafka",
            Broker::RabbitMq(_) => "rabbitmq",
            Broker::Sqs(_) => "sqs",
            Broker::Nats(_) => "nats",
            Broker::Webhook(_) => "webhook",
        }
    }

    /// The transactional producer, when the broker has transactions
    /// (Kafka's alone; the configuration refuses exactly-once elsewhere).
    pub fn transactional(&self) -> Option<&Sink<T>> {
        match self {
            Broker::Kafka(sink) => Some(sink),
            Broker::RabbitMq(_) | Broker::Sqs(_) | Broker::Nats(_) | Broker::Webhook(_) => None,
        }
    }

    /// What reads the broker back from the end of its topics at a start
    /// (`skip_delivered`): Kafka's alone (the configuration says why each
    /// other broker cannot).
    pub fn tail_reader(&self) -> Option<&dyn sink_core::tail::TailReader> {
        match self {
            Broker::Kafka(sink) => Some(sink),
            Broker::RabbitMq(_) | Broker::Sqs(_) | Broker::Nats(_) | Broker::Webhook(_) => None,
        }
    }

    /// Kafka's producer statistics into the metrics (the other brokers
    /// keep none).
    pub fn observe(&self, metrics: &Metrics) {
        if let Broker::Kafka(sink) = self {
            if let Some(stats) = sink.statistics() {
                metrics.set_producer_stats(&stats);
            }
        }
    }

    /// Waits up to `within` for what is in flight, then lets go of the
    /// broker; how many records were left without a delivery (never
    /// confirmed to the slot, so sent again after a restart).
    pub async fn close(self, reports: BrokerReports<T>, within: Duration) -> usize {
        match (self, reports) {
            (Broker::Kafka(sink), BrokerReports::Kafka(reports)) => {
                sink_kafka::shutdown(sink, reports, within)
                    .await
                    .iter()
                    .filter(|r| r.result.is_err())
                    .count()
            }
            (Broker::Kafka(sink), _) => {
                // Reports of another broker: never made by `connect`.
                sink.flush(within).await;
                sink.in_flight()
            }
            (Broker::RabbitMq(publisher), _) => publisher.close(within).await,
            (Broker::Sqs(publisher), _) => publisher.close(within).await,
            (Broker::Nats(publisher), _) => (*publisher).close(within).await,
            (Broker::Webhook(publisher), _) => publisher.close(within).await,
        }
    }
}

impl<T: Send + Sync + 'static> Destination<T> for Broker<T> {
    fn admission(&self) -> &Admission {
        match self {
            Broker::Kafka(d) => Destination::admission(d),
            Broker::RabbitMq(d) => d.admission(),
            Broker::Sqs(d) => d.admission(),
            Broker::Nats(d) => d.admission(),
            Broker::Webhook(d) => d.admission(),
        }
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        match self {
            Broker::Kafka(d) => Destination::send(d, permit, record).await,
            Broker::RabbitMq(d) => d.send(permit, record).await,
            Broker::Sqs(d) => d.send(permit, record).await,
            Broker::Nats(d) => d.send(permit, record).await,
            Broker::Webhook(d) => d.send(permit, record).await,
        }
    }

    fn stalled_for(&self) -> Duration {
        match self {
            Broker::Kafka(d) => Destination::stalled_for(d),
            Broker::RabbitMq(d) => d.stalled_for(),
            Broker::Sqs(d) => d.stalled_for(),
            Broker::Nats(d) => d.stalled_for(),
            Broker::Webhook(d) => d.stalled_for(),
        }
    }

    fn problem(&self) -> Option<String> {
        match self {
            Broker::Kafka(d) => Destination::problem(d),
            Broker::RabbitMq(d) => d.problem(),
            Broker::Sqs(d) => d.problem(),
            Broker::Nats(d) => d.problem(),
            Broker::Webhook(d) => d.problem(),
        }
    }
}

impl<T: Send + Sync + 'static> Deliveries<T> for BrokerReports<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        match self {
            BrokerReports::Kafka(r) => Deliveries::next(r).await,
            BrokerReports::RabbitMq(r) => r.next().await,
            BrokerReports::Sqs(r) => r.next().await,
            BrokerReports::Nats(r) => r.next().await,
            BrokerReports::Webhook(r) => r.next().await,
        }
    }
}

/// Fails fast on Kafka brokers that are not there at all, or refuse
/// walbox; once running, an outage only stalls deliveries (the outbox in
/// Postgres is the buffer).
pub async fn check_brokers<T: Send + Sync + 'static>(
    sink: &Sink<T>,
    brokers: &str,
) -> Result<sink_kafka::Brokers, RunError> {
    let brokers = brokers.to_owned();
    match sink.check_brokers(BROKER_CHECK_TIMEOUT).await {
        Ok(found) => Ok(found),
        Err(sink_kafka::SinkError::Refused(problem)) => {
            let problem = Box::new(problem);
            Err(RunError::BrokerRefused { brokers, problem })
        }
        Err(source) => {
            let source = Box::new(source);
            Err(RunError::Broker { brokers, source })
        }
    }
}

/// Waits until a Kafka broker answers, as long as it takes, like an
/// unreachable Postgres. Each attempt waits up to 10 s, then a backoff
/// (0.5 s doubling to 30 s); walbox is not ready meanwhile, counts each
/// failed attempt in `walbox_reconnects_total{reason="kafka"}`, and logs
/// one line per distinct cause. A refusal (TLS, SASL) is definite and
/// returned. `None`: a signal came first (a pod terminated while Kafka is
/// down exits at once, and 0).
async fn wait_for_brokers<T: Send + Sync + 'static>(
    sink: &Sink<T>,
    bootstrap: &str,
    metrics: &Metrics,
    shutdown: &watch::Receiver<Stop>,
) -> Result<Option<sink_kafka::Brokers>, RunError> {
    let mut shutdown = shutdown.clone();
    let mut backoff = Backoff::new();
    let mut said: Option<String> = None;
    loop {
        let checked = tokio::select! {
            checked = check_brokers(sink, bootstrap) => checked,
            _ = shutdown.wait_for(|s| *s != Stop::No) => return Ok(None),
        };
        match checked {
            Ok(brokers) => return Ok(Some(brokers)),
            Err(e @ RunError::Broker { .. }) => {
                metrics.count_reconnect(e.reason());
                let delay = backoff.delay();
                let error = crate::logging::chain(&e);
                let cause = without_attempt_details(&error);
                if said.as_deref() != Some(cause.as_str()) {
                    tracing::warn!(%error, retry_in = ?delay, "Kafka unreachable; not streaming, will retry until a broker answers");
                    said = Some(cause);
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    _ = shutdown.wait_for(|s| *s != Stop::No) => return Ok(None),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// librdkafka's error text without what changes from one attempt to the
/// next ("(after 3ms in state CONNECT, 2 identical error(s) suppressed)").
fn without_attempt_details(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(" (after ") {
        out.push_str(&rest[..start]);
        // To the parenthesis that closes it ("error(s)" nests one).
        let mut depth = 0;
        let close = rest[start + 1..].char_indices().find_map(|(i, c)| {
            match c {
                '(' => depth += 1,
                ')' if depth == 1 => return Some(start + 1 + i),
                ')' => depth -= 1,
                _ => {}
            }
            None
        });
        rest = close.map_or("", |end| &rest[end + 1..]);
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cause_is_the_same_whatever_the_attempt() {
        assert_eq!(
            super::without_attempt_details("b:9092/bootstrap: Connect to ipv4#10.0.0.1:9092 failed: Connection refused (after 0ms in state CONNECT, 4 identical error(s) suppressed): more"),
            "b:9092/bootstrap: Connect to ipv4#10.0.0.1:9092 failed: Connection refused: more"
        );
    }
}
