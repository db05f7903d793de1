//! The brokers other than Kafka, checked by connecting as `walbox run`
//! does, without creating anything: RabbitMQ's exchange looked up
//! passively (a missing one is declared by `run`, not here), SQS's queues
//! by their attributes (their type, and `MaximumMessageSize` against the
//! largest payload), NATS and webhooks by their connection.
//!
//! What no look reveals without a side effect is said, not guessed: an
//! AMQP user's configure/write permissions show only by declaring or
//! publishing, SQS's `SendMessage` right only by sending.

use crate::broker::{Broker, Patience};
use crate::config::SinkSettings;

use super::{bytes, Finding};

/// The checks of `settings` (not Kafka); `largest_payload`: the largest
/// in the outbox, in bytes; `claim_check`: its threshold, when on.
pub async fn check(
    settings: &SinkSettings,
    largest_payload: Option<i64>,
    claim_check: Option<usize>,
) -> Vec<Finding> {
    match settings {
        SinkSettings::Kafka(_) => Vec::new(),
        SinkSettings::RabbitMq(config) => rabbitmq(config).await,
        SinkSettings::Sqs(config) => sqs(config, largest_payload, claim_check).await,
        other => connect_only(other).await,
    }
}

async fn rabbitmq(config: &sink_amqp::AmqpConfig) -> Vec<Finding> {
    let mut look = config.clone();
    look.declare_exchange = false;
    look.audit_stream = None;
    look.connection_name = format!("{} (walbox doctor)", config.connection_name);
    let exchange = &config.exchange;
    let looked = match sink_amqp::Publisher::<()>::connect(look).await {
        // Connected, the exchange there (the publisher dropped at once).
        Ok(_) => Ok(Finding::pass(
            "rabbitmq.exchange",
            format!("exchange {exchange:?} exists"),
        )),
        Err(sink_amqp::ConnectError::Exchange { .. }) if config.declare_exchange => Ok(Finding::info(
            "rabbitmq.exchange",
            format!("exchange {exchange:?} does not exist yet: walbox run declares it (durable, {}), which needs the configure permission on it", config.exchange_type),
        )),
        Err(e @ sink_amqp::ConnectError::Exchange { .. }) => Ok(Finding::fail(
            "rabbitmq.exchange",
            e.to_string(),
            format!("declare it (rabbitmqadmin declare exchange name={exchange} type={} durable=true), or set rabbitmq.declare_exchange = true", config.exchange_type),
        )),
        Err(e) => Err(e),
    };
    let mut out = match looked {
        Ok(exchange) => vec![
            Finding::pass(
                "rabbitmq.connect",
                format!("{}: connected, the credentials and virtual host accepted", config.url),
            ),
            exchange,
        ],
        Err(e) => vec![Finding::fail(
            "rabbitmq.connect",
            e.to_string(),
            "check rabbitmq.url (host, port, user, password, virtual host) and its TLS settings (docs/rabbitmq.md)",
        )],
    };
    if let Some(stream) = &config.audit_stream {
        out.push(Finding::info(
            "rabbitmq.audit_stream",
            format!("stream {:?}: walbox run declares it when missing and binds it; not looked up here (a passive look of a missing queue closes the channel, and declaring it would create it)", stream.name),
        ));
    }
    out.push(Finding::info(
        "rabbitmq.permissions",
        "the user's write permission on the exchange shows only by publishing: walbox run stops at its first refused publish with the permission to grant",
    ));
    out
}

async fn sqs(
    config: &sink_sqs::SqsConfig,
    largest_payload: Option<i64>,
    claim_check: Option<usize>,
) -> Vec<Finding> {
    let (publisher, _outcomes) = match sink_sqs::Publisher::<()>::connect(config.clone()).await {
        Ok(p) => p,
        Err(e) => {
            return vec![Finding::fail(
                "sqs.queue",
                e.to_string(),
                "check sqs.queue_url, the region and the credentials (GetQueueAttributes is what failed), docs/sqs.md",
            )]
        }
    };
    let events = publisher.events_queue().clone();
    let mut out = vec![match events.fifo {
        true => Finding::pass(
            "sqs.queue",
            format!("{}: a FIFO queue (per-aggregate order, re-sends dropped by deduplication id within 5 minutes)", events.url),
        ),
        false => Finding::warn(
            "sqs.queue",
            format!("{}: a standard queue: events arrive in no particular order, and a re-sent event arrives twice", events.url),
            "use a FIFO queue (.fifo) when consumers need per-aggregate order (docs/sqs.md)",
        ),
    }];
    if let Some(dlq) = publisher.dead_letter_queue() {
        out.push(Finding::pass(
            "sqs.dead_letter_queue",
            format!("{}: readable", dlq.url),
        ));
    }
    let max = events.max_message_bytes as i64;
    match (claim_check, largest_payload) {
        (Some(threshold), _) if threshold as i64 > max => out.push(Finding::fail(
            "sqs.max_message_size",
            format!("{}: MaximumMessageSize {max} is below claim_check.threshold ({threshold})", events.url),
            format!("set claim_check.threshold under {max}"),
        )),
        (Some(_), _) => {}
        (None, Some(largest)) if largest > max => out.push(Finding::fail(
            "sqs.max_message_size",
            format!("{}: the largest payload in the outbox ({}) is over the queue's MaximumMessageSize ({max}): SQS refuses that event for good", events.url, bytes(largest)),
            "turn on claim_check (docs/claim-check.md), or raise MaximumMessageSize (at most 1 MiB)",
        )),
        (None, Some(largest)) => out.push(Finding::pass(
            "sqs.max_message_size",
            format!("{}: the largest payload in the outbox ({}) fits MaximumMessageSize ({max})", events.url, bytes(largest)),
        )),
        (None, None) => {}
    }
    drop(publisher);
    out.push(Finding::info(
        "sqs.permissions",
        "sqs:SendMessage shows only by sending: walbox run stops at its first refused send with the permission to grant",
    ));
    out
}

async fn connect_only(settings: &SinkSettings) -> Vec<Finding> {
    let metrics = crate::metrics::Metrics::new();
    let name = settings.name();
    let connected = Broker::<()>::connect(settings, Patience::Once, &metrics).await;
    match (settings, connected) {
        (SinkSettings::Nats(_), Ok(_)) => vec![
            Finding::pass("nats.connect", "connected with the configured credentials and TLS"),
            Finding::info(
                "nats.stream",
                "whether a JetStream stream captures the subjects shows at the first publish (no stream: walbox run stops with the subject to add)",
            ),
        ],
        (_, Ok(_)) => vec![Finding::info(
            "webhook.connect",
            "the client is built as walbox run builds it (URL, TLS files, signing secret); an endpoint has no look that sends nothing: the first delivery shows whether it accepts",
        )],
        (_, Err(e)) => vec![Finding::fail(
            if name == "nats" { "nats.connect" } else { "webhook.connect" },
            format!("{name}: {e}"),
            format!("check the [{name}] settings (docs/{}.md)", if name == "webhook" { "webhooks" } else { name }),
        )],
    }
}
