//! Kafka for tests: the broker named by `WALBOX_TEST_KAFKA`, or an in-process
//! rdkafka `MockCluster`, a random topic per test, and consuming helpers.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::{Offset, TopicPartitionList};

/// How long an external broker may take to answer before the test fails.
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// The Kafka broker a test talks to.
pub enum TestKafka {
    /// A broker process named by `WALBOX_TEST_KAFKA` (in CI: Apache Kafka).
    External {
        /// The bootstrap list.
        bootstrap: String,
    },
    /// A broker that needs client settings (TLS, SASL): they are added to
    /// every client the harness creates.
    Secured {
        /// The bootstrap list.
        bootstrap: String,
        /// librdkafka properties, e.g. `security.protocol`.
        properties: Vec<(String, String)>,
    },
    /// librdkafka's in-process mock cluster, with fault injection.
    Mock(MockCluster<'static, DefaultProducerContext>),
}

impl std::fmt::Debug for TestKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TestKafka::External { bootstrap } => write!(f, "TestKafka::External({bootstrap})"),
            TestKafka::Secured { bootstrap, .. } => write!(f, "TestKafka::Secured({bootstrap})"),
            TestKafka::Mock(m) => write!(f, "TestKafka::Mock({})", m.bootstrap_servers()),
        }
    }
}

impl TestKafka {
    /// `WALBOX_TEST_KAFKA` when set, else the Kafka container with
    /// `WALBOX_TEST_DOCKER=1`, else a 3-broker [`TestKafka::mock`].
    pub fn from_env() -> TestKafka {
        if std::env::var("WALBOX_TEST_DOCKER").is_ok_and(|v| v == "1") {
            if let Some(bootstrap) = crate::pg::shared().docker_kafka() {
                return TestKafka::External {
                    bootstrap: bootstrap.to_owned(),
                };
            }
        }
        match std::env::var("WALBOX_TEST_KAFKA")
            .ok()
            .filter(|b| !b.trim().is_empty())
        {
            Some(bootstrap) => TestKafka::External { bootstrap },
            None => TestKafka::mock(3),
        }
    }

    /// An in-process mock cluster of `brokers` brokers, whatever the environment
    /// says: for tests that inject faults.
    pub fn mock(brokers: i32) -> TestKafka {
        TestKafka::Mock(MockCluster::new(brokers).expect("start an rdkafka MockCluster"))
    }

    /// The mock cluster, for fault injection; `None` for an external broker.
    pub fn mock_cluster(&self) -> Option<&MockCluster<'static, DefaultProducerContext>> {
        match self {
            TestKafka::Mock(m) => Some(m),
            TestKafka::External { .. } | TestKafka::Secured { .. } => None,
        }
    }

    /// The bootstrap list to give clients.
    pub fn bootstrap(&self) -> String {
        match self {
            TestKafka::External { bootstrap } | TestKafka::Secured { bootstrap, .. } => {
                bootstrap.clone()
            }
            TestKafka::Mock(m) => m.bootstrap_servers(),
        }
    }

    /// A client configuration for this broker, with reconnect backoff lowered
    /// so tests recover quickly from injected outages.
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap())
            .set("reconnect.backoff.ms", "20")
            .set("reconnect.backoff.max.ms", "500")
            .set("socket.connection.setup.timeout.ms", "5000");
        if let TestKafka::Secured { properties, .. } = self {
            for (k, v) in properties {
                c.set(k, v);
            }
        }
        c
    }

    /// Creates a topic with a fresh name and `partitions` partitions and waits
    /// until its metadata is visible; returns the name.
    ///
    /// # Panics
    ///
    /// With one line when an external broker does not answer within 10 s.
    pub async fn create_topic(&self, partitions: i32) -> String {
        self.create_topic_with(partitions, 1).await
    }

    /// [`TestKafka::create_topic`] with `replication` copies of each
    /// partition (an external cluster of that many brokers).
    pub async fn create_topic_with(&self, partitions: i32, replication: i32) -> String {
        self.create_topic_configured(partitions, replication, &[])
            .await
    }

    /// [`TestKafka::create_topic_with`] with topic settings (`config`, e.g.
    /// `cleanup.policy=compact`; the mock cluster ignores them).
    pub async fn create_topic_configured(
        &self,
        partitions: i32,
        replication: i32,
        config: &[(&str, &str)],
    ) -> String {
        let topic = crate::unique_name("walbox_test").replace('_', "-");
        match self {
            TestKafka::Mock(m) => m
                .create_topic(&topic, partitions, 1)
                .unwrap_or_else(|e| panic!("create mock topic {topic}: {e}")),
            TestKafka::External { bootstrap } | TestKafka::Secured { bootstrap, .. } => {
                let admin: AdminClient<DefaultClientContext> = self
                    .client_config()
                    .create()
                    .unwrap_or_else(|e| panic!("create an admin client for {bootstrap}: {e}"));
                let new = config.iter().fold(
                    NewTopic::new(&topic, partitions, TopicReplication::Fixed(replication)),
                    |t, (k, v)| t.set(k, v),
                );
                let opts = AdminOptions::new().operation_timeout(Some(BROKER_TIMEOUT));
                let created =
                    tokio::time::timeout(BROKER_TIMEOUT, admin.create_topics([&new], &opts)).await;
                match created {
                    Err(_) => panic!(
                        "WALBOX_TEST_KAFKA={bootstrap} did not answer within {BROKER_TIMEOUT:?}"
                    ),
                    Ok(Err(e)) => {
                        panic!("WALBOX_TEST_KAFKA={bootstrap}: create topic {topic}: {e}")
                    }
                    Ok(Ok(results)) => {
                        for r in results {
                            if let Err((name, code)) = r {
                                panic!(
                                    "WALBOX_TEST_KAFKA={bootstrap}: create topic {name}: {code}"
                                );
                            }
                        }
                    }
                }
            }
        }
        let config = self.client_config();
        let name = topic.clone();
        tokio::task::spawn_blocking(move || wait_for_partitions(&config, &name, partitions))
            .await
            .expect("metadata thread")
            .unwrap_or_else(|e| panic!("{e}"));
        topic
    }
}

fn wait_for_partitions(config: &ClientConfig, topic: &str, partitions: i32) -> Result<(), String> {
    let consumer: BaseConsumer = config
        .create()
        .map_err(|e| format!("create a metadata client: {e}"))?;
    crate::wait::wait_for_blocking(
        &format!("topic {topic} to have {partitions} partitions"),
        BROKER_TIMEOUT,
        || {
            let md = consumer
                .fetch_metadata(Some(topic), Duration::from_secs(2))
                .map_err(|e| e.to_string())?;
            let t = md
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .ok_or("topic missing")?;
            if t.error().is_none() && t.partitions().len() == partitions as usize {
                Ok(())
            } else {
                Err(format!(
                    "{} partitions, error {:?}",
                    t.partitions().len(),
                    t.error()
                ))
            }
        },
    )
    .map_err(|e| {
        format!(
            "broker at {:?}: {e}",
            config.get("bootstrap.servers").unwrap_or("?")
        )
    })
}

/// Consumes from the start of every partition of `topic` until `n` messages
/// have arrived, and returns them (partition by partition, each in offset
/// order, as they arrived). Errors when `timeout` passes first, saying how
/// many came.
pub async fn consume_n(
    kafka: &TestKafka,
    topic: &str,
    n: usize,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let config = kafka.client_config();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || consume_blocking(&config, &topic, Some(n), None, timeout))
        .await
        .map_err(|e| format!("consumer thread: {e}"))?
}

/// Consumes everything in `topic` until no message has arrived for `quiet`
/// (bounded by `timeout`): for asserting that nothing beyond the expected
/// messages was published.
pub async fn consume_until_quiet(
    kafka: &TestKafka,
    topic: &str,
    quiet: Duration,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    consume_until_quiet_with(kafka.client_config(), topic, quiet, timeout).await
}

/// [`consume_until_quiet`] with `isolation.level=read_uncommitted`: also
/// what aborted (and still open) transactions wrote, which a
/// `read_committed` consumer (the default) never sees.
pub async fn consume_uncommitted_until_quiet(
    kafka: &TestKafka,
    topic: &str,
    quiet: Duration,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let mut config = kafka.client_config();
    config.set("isolation.level", "read_uncommitted");
    consume_until_quiet_with(config, topic, quiet, timeout).await
}

async fn consume_until_quiet_with(
    config: ClientConfig,
    topic: &str,
    quiet: Duration,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        consume_blocking(&config, &topic, None, Some(quiet), timeout)
    })
    .await
    .map_err(|e| format!("consumer thread: {e}"))?
}

/// Every record of `topic` a `read_committed` consumer sees, read until the
/// consumer's position in each partition reaches the high watermark taken
/// at the start (what a `read_uncommitted` client is told): exact also on
/// transactional topics, whose commit markers and aborted records take
/// offsets no record is returned for. Records written after the start may
/// be included.
pub async fn consume_to_end(
    kafka: &TestKafka,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let config = kafka.client_config();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || consume_to_end_blocking(&config, &topic, timeout))
        .await
        .map_err(|e| format!("consumer thread: {e}"))?
}

fn consume_to_end_blocking(
    config: &ClientConfig,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let deadline = Instant::now() + timeout;
    let ends: BaseConsumer = config
        .clone()
        .set("isolation.level", "read_uncommitted")
        .create()
        .map_err(|e| format!("create a consumer: {e}"))?;
    let consumer: BaseConsumer = config
        .clone()
        .set("group.id", crate::unique_name("walbox_test_group"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .create()
        .map_err(|e| format!("create a consumer: {e}"))?;
    let md = consumer
        .fetch_metadata(Some(topic), BROKER_TIMEOUT)
        .map_err(|e| format!("metadata of {topic}: {e}"))?;
    let partitions = md
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map_or(0, |t| t.partitions().len() as i32);
    let mut tpl = TopicPartitionList::new();
    let mut targets: HashMap<i32, i64> = HashMap::new();
    for p in 0..partitions {
        let (_, high) = ends
            .fetch_watermarks(topic, p, BROKER_TIMEOUT)
            .map_err(|e| format!("watermarks of {topic} [{p}]: {e}"))?;
        if high > 0 {
            targets.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
    }
    consumer.assign(&tpl).map_err(|e| format!("assign: {e}"))?;
    let mut out = Vec::new();
    let mut transient = None;
    while !targets.is_empty() {
        if Instant::now() > deadline {
            return Err(format!(
                "read {topic}: partitions {:?} not read to their end within {timeout:?} ({} records so far){}",
                targets.keys().collect::<Vec<_>>(),
                out.len(),
                last_error(&transient)
            ));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if m.offset() + 1 >= targets.get(&m.partition()).copied().unwrap_or(i64::MAX) {
                    targets.remove(&m.partition());
                }
                out.push(m.detach());
                continue;
            }
            Some(Err(e)) => {
                transient = Some(
                    fatal_or_transient(&consumer, e).map_err(|e| format!("read {topic}: {e}"))?,
                );
                continue;
            }
            None => {}
        }
        let position = consumer.position().map_err(|e| e.to_string())?;
        for e in position.elements() {
            if let Offset::Offset(o) = e.offset() {
                if o >= targets.get(&e.partition()).copied().unwrap_or(i64::MAX) {
                    targets.remove(&e.partition());
                }
            }
        }
    }
    Ok(out)
}

fn consume_blocking(
    config: &ClientConfig,
    topic: &str,
    n: Option<usize>,
    quiet: Option<Duration>,
    timeout: Duration,
) -> Result<Vec<OwnedMessage>, String> {
    let mut config = config.clone();
    if config.get("isolation.level").is_none() {
        // librdkafka's default, said out loud: what a consumer of walbox's
        // exactly-once topics must use.
        config.set("isolation.level", "read_committed");
    }
    let consumer: BaseConsumer = config
        .set("group.id", crate::unique_name("walbox_test_group"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(|e| format!("create a consumer: {e}"))?;
    let deadline = Instant::now() + timeout;
    // A topic walbox creates itself (topics.create) appears with its first
    // event: wait for it within the timeout.
    let partitions = loop {
        let md = consumer
            .fetch_metadata(Some(topic), BROKER_TIMEOUT)
            .map_err(|e| format!("metadata of {topic}: {e}"))?;
        let found = md
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none())
            .map_or(0, |t| t.partitions().len());
        if found > 0 {
            break found;
        }
        if Instant::now() >= deadline {
            return Err(format!("topic {topic} has no partitions"));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions as i32 {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .map_err(|e| e.to_string())?;
    }
    consumer
        .assign(&tpl)
        .map_err(|e| format!("assign {topic}: {e}"))?;
    let mut got = Vec::new();
    let mut last_arrival = Instant::now();
    let mut transient = None;
    loop {
        if n.is_some_and(|n| got.len() >= n) {
            return Ok(got);
        }
        if quiet.is_some_and(|q| last_arrival.elapsed() >= q) {
            return Ok(got);
        }
        if Instant::now() >= deadline {
            return match n {
                Some(n) => Err(format!(
                    "timed out after {timeout:?}: {} of {n} messages arrived on {topic}{}",
                    got.len(),
                    last_error(&transient)
                )),
                None => Ok(got),
            };
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                got.push(m.detach());
                last_arrival = Instant::now();
            }
            Some(Err(e)) => {
                transient = Some(
                    fatal_or_transient(&consumer, e)
                        .map_err(|e| format!("consume {topic}: {e}"))?,
                );
            }
            None => {}
        }
    }
}

/// A consumer's error from `poll`: librdkafka reports a broker it lost
/// (a killed or restarting broker: `BrokerTransportFailure`,
/// `AllBrokersDown`) and goes on by itself, so the read goes on until its
/// deadline and the error is kept for the message if that passes. Only a
/// fatal client error ends the read now.
fn fatal_or_transient(
    consumer: &BaseConsumer,
    error: rdkafka::error::KafkaError,
) -> Result<String, String> {
    if let Some((code, reason)) = consumer.client().fatal_error() {
        return Err(format!("{error} (fatal: {code:?}: {reason})"));
    }
    std::thread::sleep(Duration::from_millis(100));
    Ok(error.to_string())
}

fn last_error(transient: &Option<String>) -> String {
    transient
        .as_ref()
        .map(|e| format!("; last consumer error: {e}"))
        .unwrap_or_default()
}

/// A message's headers as a name → UTF-8 value map (lossy), for assertions.
pub fn headers_of(m: &OwnedMessage) -> HashMap<String, String> {
    m.headers()
        .map(|hs| {
            hs.iter()
                .map(|h| {
                    (
                        h.key.to_owned(),
                        String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

    fn produce(kafka: &TestKafka, topic: &str, from: usize, n: usize) {
        let producer: BaseProducer = kafka.client_config().create().expect("producer");
        for i in from..from + n {
            let value = format!("event {i}");
            producer
                .send(BaseRecord::<str, str>::to(topic).payload(&value))
                .expect("queue a record");
        }
        producer.flush(Duration::from_secs(10)).expect("flush");
    }

    /// A broker lost while a test reads (killed, restarting) is a pause,
    /// not the end of the read: the consumer reconnects and the read gets
    /// every record.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_read_outlives_its_broker_going_down_and_up() {
        let kafka = TestKafka::mock(1);
        let topic = kafka.create_topic(1).await;
        produce(&kafka, &topic, 0, 10);
        let reading = {
            let config = kafka.client_config();
            let topic = topic.clone();
            std::thread::spawn(move || {
                consume_blocking(&config, &topic, Some(20), None, Duration::from_secs(60))
            })
        };
        std::thread::sleep(Duration::from_millis(1500));
        let mock = kafka.mock_cluster().expect("a mock cluster");
        mock.broker_down(1).expect("broker down");
        std::thread::sleep(Duration::from_secs(3));
        mock.broker_up(1).expect("broker up");
        produce(&kafka, &topic, 10, 10);
        let got = reading
            .join()
            .expect("reader thread")
            .expect("read every record");
        let values: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned())
            .collect();
        let expected: Vec<String> = (0..20).map(|i| format!("event {i}")).collect();
        assert_eq!(values, expected);
    }
}
