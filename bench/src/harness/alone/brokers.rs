//! `brokers`: the small backlog drained by walbox to each broker it sends
//! to (Apache Kafka, RabbitMQ, an SQS FIFO and a standard queue on
//! ElasticMQ, a NATS JetStream stream, a webhook endpoint), beside
//! pg_recvlogical (the slot's own limit); and each broker's own limit on
//! this machine: the same number of messages of the same size sent by
//! walbox's client for it alone (no Postgres, no decoding), with the same
//! bounds on what is in flight.

use std::time::{Duration, Instant};

use amqprs::channel::{ExchangeDeclareArguments, QueueBindArguments, QueueDeclareArguments};
use amqprs::connection::{Connection, OpenConnectionArguments};
use bytes::Bytes;
use walbox_test_harness::elasticmq::ElasticMq;
use walbox_test_harness::rabbitmq::RabbitMq;

use crate::peers::{preload, recvlogical, Backlog};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::Results;
use crate::world::World;

/// The brokers, as the report names them.
pub(crate) const BROKERS: [(&str, &str); 6] = [
    ("kafka", "Apache Kafka 4.1.2 (KRaft, one node; acks=all)"),
    (
        "rabbitmq",
        "RabbitMQ 3.10 (Debian's; persistent messages, publisher confirms)",
    ),
    (
        "sqs_fifo",
        "SQS FIFO queue (ElasticMQ 1.7.1; groups = aggregates)",
    ),
    ("sqs_standard", "SQS standard queue (ElasticMQ 1.7.1)"),
    (
        "nats",
        "NATS JetStream (nats-server 2.15.2, one node; file storage, publish acks)",
    ),
    (
        "webhook",
        "HTTP webhook (an axum endpoint in the harness answering 200; signed, 16 aggregates at a time)",
    ),
];

/// The webhook's signing key (walbox signs every request).
const WEBHOOK_SECRET: &str = "bench-signing-key";

/// walbox's in-flight bounds (its defaults), for the clients alone too.
const IN_FLIGHT: usize = 10_000;
const IN_FLIGHT_BYTES: usize = 8 << 20;

/// A broker of the phase's own, with the queue walbox's events land in.
enum Broker {
    Kafka,
    Rabbit(RabbitMq),
    Sqs {
        server: ElasticMq,
        queue: String,
        /// The broker alone sends to a queue of its own (ElasticMQ slows
        /// down as a queue grows: the same queue would not compare).
        flood: String,
    },
    Nats(walbox_test_harness::nats::NatsServer),
    Webhook(Endpoint),
}

/// A webhook endpoint answering 200 to every POST, counting them.
struct Endpoint {
    addr: std::net::SocketAddr,
    posts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    server: tokio::task::JoinHandle<()>,
}

impl Endpoint {
    async fn start() -> Endpoint {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let posts = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&posts);
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |_body: Bytes| {
                counted.fetch_add(1, Ordering::Relaxed);
                async { "" }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port for the endpoint");
        let addr = listener.local_addr().expect("its address");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Endpoint {
            addr,
            posts,
            server,
        }
    }

    fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    fn posts(&self) -> u64 {
        self.posts.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Broker {
    async fn start(name: &str, world: &World) -> Broker {
        match name {
            "kafka" => {
                world.create_topic("walbox.order").await;
                world.create_topic("walbox.flood").await;
                Broker::Kafka
            }
            "rabbitmq" => {
                let broker = RabbitMq::start();
                let (connection, channel) = rabbit(&broker).await;
                channel
                    .exchange_declare(
                        ExchangeDeclareArguments::new("walbox", "topic")
                            .durable(true)
                            .finish(),
                    )
                    .await
                    .expect("declare the exchange");
                channel
                    .queue_declare(QueueDeclareArguments::durable_client_named("bench"))
                    .await
                    .expect("declare the queue");
                channel
                    .queue_bind(QueueBindArguments::new("bench", "walbox", "walbox.order"))
                    .await
                    .expect("bind the queue");
                let _ = connection.close().await;
                Broker::Rabbit(broker)
            }
            "nats" => {
                let server = walbox_test_harness::nats::NatsServer::start();
                let client = async_nats::connect(server.url()).await.expect("NATS");
                let js = async_nats::jetstream::new(client);
                for (stream, subject) in [("BENCH", "walbox.order"), ("FLOOD", "walbox.flood")] {
                    js.create_stream(async_nats::jetstream::stream::Config {
                        name: stream.into(),
                        subjects: vec![subject.into()],
                        ..Default::default()
                    })
                    .await
                    .expect("create the stream");
                }
                Broker::Nats(server)
            }
            "webhook" => Broker::Webhook(Endpoint::start().await),
            _ => {
                let server = ElasticMq::start();
                let name = if name == "sqs_fifo" {
                    "bench.fifo"
                } else {
                    "bench"
                };
                let client = sqs_client(&server).await;
                let queue = create_queue(&client, name).await;
                let flood = create_queue(&client, &name.replace("bench", "flood")).await;
                Broker::Sqs {
                    server,
                    queue,
                    flood,
                }
            }
        }
    }

    /// `walbox run`'s flags for this broker.
    fn flags(&self) -> Vec<String> {
        match self {
            Broker::Kafka => vec![],
            Broker::Rabbit(b) => vec![
                "--sink".into(),
                "rabbitmq".into(),
                "--rabbitmq-url".into(),
                b.url(),
            ],
            Broker::Sqs { server, queue, .. } => vec![
                "--sink".into(),
                "sqs".into(),
                "--sqs-queue-url".into(),
                queue.clone(),
                "--sqs-endpoint".into(),
                server.endpoint(),
                "--sqs-region".into(),
                "us-east-1".into(),
            ],
            Broker::Nats(server) => vec![
                "--sink".into(),
                "nats".into(),
                "--nats-url".into(),
                server.url(),
            ],
            Broker::Webhook(endpoint) => vec![
                "--sink".into(),
                "webhook".into(),
                "--webhook-url".into(),
                endpoint.url(),
                "--webhook-secret".into(),
                WEBHOOK_SECRET.into(),
            ],
        }
    }

    /// Messages in the broker's queue (or on the topic since `from`).
    async fn count(&self, world: &World, from: &[i64]) -> i64 {
        match self {
            Broker::Kafka => world.count_since("walbox.order", from),
            Broker::Rabbit(b) => {
                let (connection, channel) = rabbit(b).await;
                let passive = QueueDeclareArguments::durable_client_named("bench")
                    .passive(true)
                    .finish();
                let (_, n, _) = channel
                    .queue_declare(passive)
                    .await
                    .expect("the queue")
                    .expect("its counts");
                let _ = connection.close().await;
                i64::from(n)
            }
            Broker::Sqs { server, queue, .. } => {
                let out = sqs_client(server)
                    .await
                    .get_queue_attributes()
                    .queue_url(queue)
                    .attribute_names(
                        aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages,
                    )
                    .send()
                    .await
                    .expect("the queue's attributes");
                out.attributes()
                    .and_then(|a| {
                        a.get(&aws_sdk_sqs::types::QueueAttributeName::ApproximateNumberOfMessages)
                    })
                    .and_then(|v| v.parse().ok())
                    .expect("ApproximateNumberOfMessages")
            }
            Broker::Nats(server) => {
                let client = async_nats::connect(server.url()).await.expect("NATS");
                let mut stream = async_nats::jetstream::new(client)
                    .get_stream("BENCH")
                    .await
                    .expect("the stream");
                let info = stream.info().await.expect("its state");
                info.state.messages as i64
            }
            Broker::Webhook(endpoint) => endpoint.posts() as i64,
        }
    }

    /// The broker alone: `events` messages like walbox's (body of `size`
    /// bytes, key one of 1,000 aggregates, id and type headers) sent by
    /// walbox's client for it; seconds until every one was acknowledged.
    async fn flood(&self, world: &World, events: usize, size: usize) -> f64 {
        let body = Bytes::from(format!(
            "{{\"pad\":\"{}\"}}",
            "x".repeat(size.saturating_sub(10))
        ));
        let t0 = Instant::now();
        match self {
            Broker::Kafka => {
                let mut config = sink_kafka::SinkConfig::new(world.bootstrap());
                config.max_in_flight = IN_FLIGHT;
                config.max_in_flight_bytes = IN_FLIGHT_BYTES;
                let (sink, mut reports) = sink_kafka::Sink::<()>::new(&config).expect("a producer");
                let feed = async {
                    for i in 0..events {
                        let permit = sink.reserve(body.len()).await;
                        let record = sink_kafka::Record::new(
                            "walbox.flood",
                            Some(Bytes::from(format!("order-{}", i % 1000))),
                            Some(body.clone()),
                            (),
                        );
                        sink.send(permit, record).await;
                    }
                };
                let drain = async {
                    for _ in 0..events {
                        let r = reports.next().await.expect("a report");
                        assert!(r.result.is_ok(), "Kafka refused: {:?}", r.result);
                    }
                };
                tokio::join!(feed, drain);
            }
            Broker::Rabbit(b) => {
                let config = sink_amqp::AmqpConfig {
                    url: sink_amqp::AmqpUrl::parse(&b.url()).expect("the URL"),
                    tls: Default::default(),
                    exchange: "walbox".into(),
                    declare_exchange: false,
                    exchange_type: "topic".into(),
                    max_in_flight: IN_FLIGHT,
                    max_in_flight_bytes: IN_FLIGHT_BYTES,
                    connection_name: "walbox-bench flood".into(),
                    partitions: 1,
                    message_id_header: "id".into(),
                    audit_stream: None,
                };
                let (sink, mut reports) = sink_amqp::AmqpSink::<()>::connect(config)
                    .await
                    .expect("RabbitMQ");
                let feed = async {
                    for i in 0..events {
                        let permit = sink.worker().reserve(body.len()).await;
                        let message = sink_amqp::Message {
                            routing_key: "walbox.order".into(),
                            body: body.clone(),
                            message_id: Some(format!("e-{i}")),
                            headers: headers(i),
                            timestamp_s: None,
                        };
                        sink.worker().publish(permit, message, ());
                    }
                };
                let drain = async {
                    for _ in 0..events {
                        let r = reports.next().await.expect("a report");
                        assert!(r.result.is_ok(), "RabbitMQ refused: {:?}", r.result);
                    }
                };
                tokio::join!(feed, drain);
                sink.close(Duration::from_secs(5)).await;
            }
            Broker::Sqs { server, flood, .. } => {
                let config = sink_sqs::SqsConfig {
                    queue_url: flood.clone(),
                    dead_letter_queue_url: None,
                    region: Some("us-east-1".into()),
                    endpoint: Some(server.endpoint()),
                    lanes: 4,
                    max_in_flight: IN_FLIGHT,
                    max_in_flight_bytes: IN_FLIGHT_BYTES,
                    gapless: false,
                };
                let (sink, mut reports) =
                    sink_sqs::SqsSink::<()>::connect(config).await.expect("SQS");
                let feed = async {
                    for i in 0..events {
                        let permit = sink.worker().reserve(body.len()).await;
                        let message = sink_sqs::Message {
                            queue: sink_sqs::QueueRole::Events,
                            body: body.clone(),
                            key: Some(Bytes::from(format!("order-{}", i % 1000))),
                            dedup: format!("flood-{i}"),
                            attributes: headers(i),
                        };
                        sink.publish(permit, message, ());
                    }
                };
                let drain = async {
                    for _ in 0..events {
                        let r = reports.next().await.expect("a report");
                        assert!(r.result.is_ok(), "SQS refused: {:?}", r.result);
                    }
                };
                tokio::join!(feed, drain);
                sink.close(Duration::from_secs(5)).await;
            }
            Broker::Nats(server) => {
                let config = sink_nats::NatsConfig {
                    url: sink_nats::NatsUrl::parse(&server.url()).expect("the URL"),
                    ca_file: None,
                    max_in_flight: IN_FLIGHT,
                    max_in_flight_bytes: IN_FLIGHT_BYTES,
                    ack_timeout: Duration::from_secs(10),
                    connection_name: "walbox-bench flood".into(),
                };
                let (sink, mut acks) = sink_nats::Publisher::<()>::connect(config)
                    .await
                    .expect("NATS");
                flood_through(&sink, &mut acks, "walbox.flood", events, &body).await;
                sink.close(Duration::from_secs(5)).await;
            }
            Broker::Webhook(endpoint) => {
                let config = sink_webhook::WebhookConfig {
                    url: endpoint.url().parse().expect("the URL"),
                    secret: Some(WEBHOOK_SECRET.into()),
                    ca_file: None,
                    timeout: Duration::from_secs(10),
                    concurrency: 16,
                    max_in_flight: IN_FLIGHT,
                    max_in_flight_bytes: IN_FLIGHT_BYTES,
                };
                let (sink, mut answers) =
                    sink_webhook::Publisher::<()>::new(config).expect("a client");
                flood_through(&sink, &mut answers, "walbox.flood", events, &body).await;
            }
        }
        t0.elapsed().as_secs_f64()
    }
}

/// `events` records like walbox's (key one of 1,000 aggregates, id and
/// type headers, the place in the stream walbox gives each) through a
/// sink-core destination, waiting for every report.
async fn flood_through<D, R>(sink: &D, reports: &mut R, topic: &str, events: usize, body: &Bytes)
where
    D: sink_core::Destination<()>,
    R: sink_core::Deliveries<()>,
{
    let feed = async {
        for i in 0..events {
            let mut record = sink_core::Record::new(
                topic,
                Some(Bytes::from(format!("order-{}", i % 1000))),
                Some(body.clone()),
                (),
            )
            .with_origin(sink_core::Origin {
                stream: std::sync::Arc::from("bench"),
                history: 0,
                position: 0x100 + (i / 100) as u64,
                index: (i % 100) as u64,
                commit_time: 0,
            });
            for (name, value) in headers(i) {
                if name != "walbox.key" {
                    record = record.with_header(name, value);
                }
            }
            let permit = sink.reserve(record.size()).await;
            sink.send(permit, record).await;
        }
    };
    let drain = async {
        for _ in 0..events {
            let r = reports.next().await.expect("a report");
            assert!(r.result.is_ok(), "refused: {:?}", r.result);
        }
    };
    tokio::join!(feed, drain);
}

fn headers(i: usize) -> Vec<(String, Bytes)> {
    vec![
        ("id".into(), Bytes::from(format!("e-{i}"))),
        ("event_type".into(), Bytes::from_static(b"OrderCreated")),
        (
            "walbox.key".into(),
            Bytes::from(format!("order-{}", i % 1000)),
        ),
    ]
}

async fn rabbit(broker: &RabbitMq) -> (Connection, amqprs::channel::Channel) {
    // The harness's broker takes guest on loopback.
    let args = OpenConnectionArguments::new("127.0.0.1", broker.port(), "guest", "guest");
    let connection = Connection::open(&args).await.expect("connect to RabbitMQ");
    let channel = connection.open_channel(None).await.expect("a channel");
    (connection, channel)
}

/// Creates queue `name` (FIFO for a `.fifo` name); its URL.
async fn create_queue(client: &aws_sdk_sqs::Client, name: &str) -> String {
    let mut create = client.create_queue().queue_name(name);
    if name.ends_with(".fifo") {
        create = create.attributes(aws_sdk_sqs::types::QueueAttributeName::FifoQueue, "true");
    }
    create
        .send()
        .await
        .expect("create the queue")
        .queue_url()
        .expect("its URL")
        .to_owned()
}

async fn sqs_client(server: &ElasticMq) -> aws_sdk_sqs::Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .endpoint_url(server.endpoint())
        .credentials_provider(aws_sdk_sqs::config::Credentials::new(
            "bench",
            "bench",
            None,
            None,
            "walbox-bench",
        ))
        .build();
    aws_sdk_sqs::Client::from_conf(config)
}

pub(crate) async fn brokers(results: &mut Results, walbox: &str, events: i64) {
    // The ElasticMQ client in walbox reads its credentials from the chain.
    std::env::set_var("AWS_ACCESS_KEY_ID", "bench");
    std::env::set_var("AWS_SECRET_ACCESS_KEY", "bench");
    let n = events as f64;
    results.record("brokers", "events", n);
    for (i, (name, _)) in BROKERS.iter().enumerate() {
        let world = World::start(walbox).await;
        Kind::Walbox.init(&world).await;
        if i == 0 {
            world.create_slot("bench_recvlogical").await;
        }
        eprintln!("bench: brokers: {name}: writing {events} events");
        let end = preload(&world, Backlog::small("brokers", events)).await;
        if i == 0 {
            let (secs, _) = recvlogical(&world, &end, false).await;
            results.record("brokers", "recvlogical_s", secs);
            results.record("brokers", "recvlogical_eps", n / secs);
        }
        let broker = Broker::start(name, &world).await;
        let from = match broker {
            Broker::Kafka => world.ends("walbox.order"),
            _ => vec![],
        };
        let flags = broker.flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        eprintln!("bench: brokers: walbox drains them to {name}");
        let t0 = Instant::now();
        let mut relay = Relay::start_with(Kind::Walbox, &world, &flags);
        crate::alone::wait_confirmed(&world, &mut [&mut relay], "walbox", &end).await;
        let secs = t0.elapsed().as_secs_f64();
        let usage = procstat::usage(relay.pid()).expect("walbox runs");
        relay.stop();
        let stored = broker.count(&world, &from).await;
        assert!(
            stored >= events,
            "{name}: {stored} of {events} events stored"
        );
        let p = |m: &str| format!("{name}_{m}");
        results.record("brokers", &p("s"), secs);
        results.record("brokers", &p("eps"), n / secs);
        results.record("brokers", &p("cpu_s"), usage.cpu_s);
        results.record("brokers", &p("rss_mib"), usage.peak_rss_mib);
        results.record("brokers", &p("stored"), stored as f64);
        eprintln!("bench: brokers: {name} alone takes {events} messages from walbox's client");
        let alone = broker.flood(&world, events as usize, 200).await;
        results.record("brokers", &p("alone_s"), alone);
        results.record("brokers", &p("alone_eps"), n / alone);
    }
}
