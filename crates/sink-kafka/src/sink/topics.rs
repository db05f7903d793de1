//! Topic administration: checking once per topic that the brokers know it,
//! creating it when the configuration says how, and making sure a
//! compacted topic (exactly-once progress) is compacted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer;

use super::produce::TopicHandle;
use super::Sink;
use crate::config::TopicSpec;
use sink_core::DeliveryErrorKind;

use crate::error::Failure;

/// How long the first send to a topic may take to learn whether it exists.
const TOPIC_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// After a topic check found no broker, checks are skipped for this long
/// (records are produced and librdkafka waits for the brokers): an outage
/// costs one check's timeout, not one per new topic.
const BROKERS_DOWN_BACKOFF: Duration = Duration::from_secs(30);
/// How long a topic the broker does not know is waited for before it
/// counts as refused. Kept short: the caller waits meanwhile (and answers
/// no keepalive), and a topic created just before its first record shows
/// in metadata well within it.
const MISSING_TOPIC_GRACE: Duration = Duration::from_secs(5);
/// After a topic was found missing, its records are refused at once for
/// this long (each one waiting out the grace would stall the stream); then
/// it is looked up again.
const MISSING_TOPIC_MEMORY: Duration = Duration::from_secs(30);
/// How often a missing topic is looked up again meanwhile.
const TOPIC_RECHECK: Duration = Duration::from_millis(500);
/// At most this many topics are remembered as checked; past it the set
/// starts over (a topic template fed by arbitrary values must not grow
/// memory).
pub(super) const MAX_KNOWN_TOPICS: usize = 10_000;

/// The compacted topics' cleanup policy.
const COMPACT: &str = "compact";
/// How long describing a topic's configuration may take.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The refusal of a record whose topic the broker does not know.
pub(super) fn missing_topic(topic: &str) -> Failure {
    Failure::new(
        DeliveryErrorKind::Permanent,
        Some(RDKafkaErrorCode::UnknownTopicOrPartition),
        format!("topic {topic} does not exist (waited {MISSING_TOPIC_GRACE:?}): create it, set topics.create = true, or fix the topic template"),
    )
}

/// Why creating a topic failed.
pub(crate) enum CreateError {
    /// The brokers refused it: permanent for this record.
    Refused(Failure),
    /// No broker (or no controller) answered in time: nothing is known.
    Unanswered(String),
}

/// Why [`Sink::ensure_compacted_topic`] could not make sure of a topic.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompactedTopicError {
    /// No broker answered in time (an outage, a broker just back from
    /// one): nothing is known yet; ask again later.
    #[error("{0}")]
    Unanswered(String),
    /// The topic is not compacted, or the brokers refuse to create it.
    #[error("{0}")]
    Refused(String),
}

/// True for the codes that mean "no answer" rather than "no": a timeout,
/// a lost connection, a controller moving.
fn no_answer(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::NotController
    )
}

/// What a topic check found.
pub(crate) enum TopicVerdict {
    Known,
    /// The broker does not know the topic (yet).
    Missing(Failure),
    Refused(Failure),
    /// The broker answered without a clear verdict: produce.
    Unsure,
    /// No broker answered.
    NoBroker,
}

impl<T: Send + Sync + 'static> Sink<T> {
    /// Remembers that the brokers know `topic`: its records are produced
    /// without another check, through the handle returned (`None`: a name
    /// librdkafka refuses).
    pub(crate) fn remember_known(&self, topic: &str) -> Option<TopicHandle> {
        let mut known = self.inner.known_topics.lock().expect("not poisoned");
        if let Some(handle) = known.get(topic) {
            return Some(handle.clone());
        }
        if known.len() >= MAX_KNOWN_TOPICS {
            known.clear();
        }
        let handle = self.inner.topic_handle(topic)?;
        known.insert(topic.to_owned(), handle.clone());
        Some(handle)
    }

    /// Checks once per topic that the broker knows it. A topic it does not
    /// know is created when [`SinkConfig::create_topics`] says how, and
    /// otherwise waited for up to [`MISSING_TOPIC_GRACE`] (one created a
    /// moment before its first record is not refused). While the brokers
    /// are unreachable the check is skipped (see [`BROKERS_DOWN_BACKOFF`]).
    ///
    /// The handle to produce with is returned for a topic found known;
    /// `None` when the check was skipped or unsure (the record is produced
    /// all the same).
    pub(super) async fn check_topic(&self, topic: &str) -> Result<Option<TopicHandle>, Failure> {
        if let Some(handle) = self
            .inner
            .known_topics
            .lock()
            .expect("not poisoned")
            .get(topic)
        {
            return Ok(Some(handle.clone()));
        }
        let down_until = *self.inner.brokers_down_until.lock().expect("not poisoned");
        if down_until.is_some_and(|t| Instant::now() < t) {
            return Ok(None);
        }
        // Found missing a moment ago: refused at once; found missing a while
        // ago: one more look, without the grace.
        let mut deadline = Instant::now() + MISSING_TOPIC_GRACE;
        {
            let mut missing = self.inner.missing_topics.lock().expect("not poisoned");
            match missing.get(topic) {
                Some(since) if since.elapsed() < MISSING_TOPIC_MEMORY => {
                    return Err(missing_topic(topic))
                }
                Some(_) => {
                    missing.remove(topic);
                    deadline = Instant::now();
                }
                None => {}
            }
        }
        let mut created = false;
        loop {
            match self.topic_verdict(topic).await {
                TopicVerdict::Known => return Ok(self.remember_known(topic)),
                TopicVerdict::Missing(e) => {
                    if let (Some(spec), false) = (&self.inner.create_topics, created) {
                        match self.create_topic(topic, spec).await {
                            Ok(_) => created = true,
                            Err(CreateError::Refused(e)) => return Err(e),
                            Err(CreateError::Unanswered(why)) => {
                                self.brokers_down(topic, &why);
                                return Ok(None);
                            }
                        }
                    } else if Instant::now() >= deadline {
                        let mut missing = self.inner.missing_topics.lock().expect("not poisoned");
                        if missing.len() >= MAX_KNOWN_TOPICS {
                            missing.clear();
                        }
                        missing.insert(topic.to_owned(), Instant::now());
                        return Err(e);
                    } else if !created {
                        tracing::info!(topic, "topic does not exist (yet); waiting up to {MISSING_TOPIC_GRACE:?} for it");
                    }
                    tokio::time::sleep(TOPIC_RECHECK).await;
                }
                TopicVerdict::Refused(e) => return Err(e),
                TopicVerdict::Unsure => return Ok(None),
                TopicVerdict::NoBroker => {
                    self.brokers_down(topic, "no broker answered a metadata request");
                    return Ok(None);
                }
            }
        }
    }

    /// No broker answered a check of `topic`: its records are produced
    /// (librdkafka waits for the brokers) and checks are skipped for
    /// [`BROKERS_DOWN_BACKOFF`].
    fn brokers_down(&self, topic: &str, why: &str) {
        tracing::warn!(
            topic,
            why,
            "no broker answered a topic check; producing without it for {BROKERS_DOWN_BACKOFF:?}"
        );
        *self.inner.brokers_down_until.lock().expect("not poisoned") =
            Some(Instant::now() + BROKERS_DOWN_BACKOFF);
    }

    /// What the broker's metadata says about `topic`.
    pub(crate) async fn topic_verdict(&self, topic: &str) -> TopicVerdict {
        self.verdict_on(topic, None).await
    }

    /// [`Sink::topic_verdict`], asked on `admin` (which never has the
    /// broker auto-create the topic) or on the producer.
    async fn verdict_on(
        &self,
        topic: &str,
        admin: Option<Arc<AdminClient<DefaultClientContext>>>,
    ) -> TopicVerdict {
        let inner = Arc::clone(&self.inner);
        let name = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let metadata = match &admin {
                Some(admin) => admin.inner().fetch_metadata(Some(&name), TOPIC_CHECK_TIMEOUT),
                None => inner.producer.client().fetch_metadata(Some(&name), TOPIC_CHECK_TIMEOUT),
            };
            match metadata {
                Ok(md) => match md.topics().iter().find(|t| t.name() == name) {
                    Some(t) if t.error().is_none() && !t.partitions().is_empty() => TopicVerdict::Known,
                    Some(t) => match t.error().map(RDKafkaErrorCode::from) {
                        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
                            TopicVerdict::Missing(missing_topic(&name))
                        }
                        Some(code @ (RDKafkaErrorCode::InvalidTopic | RDKafkaErrorCode::TopicAuthorizationFailed)) => {
                            TopicVerdict::Refused(Failure::new(
                                DeliveryErrorKind::Permanent,
                                Some(code),
                                format!("topic {name} cannot be produced to: {code} (grant walbox Write on it, or fix the topic template)"),
                            ))
                        }
                        // Leader election and the like: produce and let librdkafka wait.
                        _ => TopicVerdict::Unsure,
                    },
                    None => TopicVerdict::Unsure,
                },
                // The broker is unreachable: not the topic's fault; librdkafka waits.
                Err(_) => TopicVerdict::NoBroker,
            }
        })
        .await
        .unwrap_or(TopicVerdict::Unsure)
    }

    /// Creates `topic` as `spec` says. An existing topic is fine (another
    /// process made it first, or the broker auto-created it): `Ok(false)`,
    /// and it has the settings it has, not necessarily `spec`'s. A refusal
    /// is permanent for this record.
    pub(crate) async fn create_topic(
        &self,
        topic: &str,
        spec: &TopicSpec,
    ) -> Result<bool, CreateError> {
        let refused = |why: String| {
            CreateError::Refused(Failure::new(
                DeliveryErrorKind::Permanent,
                None,
                format!("topic {topic} does not exist and could not be created: {why}"),
            ))
        };
        let unanswered = |why: String| {
            CreateError::Unanswered(format!(
                "topic {topic} does not exist and no broker answered its creation: {why}"
            ))
        };
        let admin = self.inner.admin().map_err(|e| refused(e.to_string()))?;
        let mut new = NewTopic::new(
            topic,
            spec.partitions.unwrap_or(-1),
            TopicReplication::Fixed(spec.replication_factor.unwrap_or(-1)),
        );
        for (k, v) in &spec.config {
            new = new.set(k, v);
        }
        let options = AdminOptions::new().operation_timeout(Some(TOPIC_CHECK_TIMEOUT));
        let result = admin.create_topics([&new], &options).await;
        match result.as_deref() {
            Ok([Ok(_)]) => {
                tracing::info!(topic, partitions = ?spec.partitions, replication_factor = ?spec.replication_factor, "created topic");
                Ok(true)
            }
            Ok([Err((_, RDKafkaErrorCode::TopicAlreadyExists))]) => {
                tracing::info!(topic, "topic already exists (made by another process, or auto-created by the broker): it keeps its own settings");
                Ok(false)
            }
            Ok([Err((_, code)), ..]) if no_answer(*code) => Err(unanswered(code.to_string())),
            Ok([Err((_, code)), ..]) => Err(refused(
                if *code == RDKafkaErrorCode::TopicAuthorizationFailed
                    || *code == RDKafkaErrorCode::ClusterAuthorizationFailed
                {
                    format!("{code} (walbox's principal needs Create on the topic or the cluster: kafka-acls --add --allow-principal User:… --operation Create --topic {topic}; or create the topic yourself)")
                } else {
                    code.to_string()
                },
            )),
            Ok(_) => Err(unanswered("no answer for the topic".into())),
            Err(e) if e.rdkafka_error_code().is_some_and(no_answer) => {
                Err(unanswered(self.inner.redact(&e.to_string())))
            }
            Err(e) => Err(refused(self.inner.redact(&e.to_string()))),
        }
    }

    /// Makes sure `topic` exists and is compacted: created (one partition,
    /// `cleanup.policy=compact`, the topic settings of
    /// [`SinkConfig::create_topics`] otherwise) when missing; an existing
    /// one with another `cleanup.policy` is refused, since deleting old
    /// segments would delete the last value of a quiet key. A broker that
    /// cannot describe topic configurations is let through with a warning.
    ///
    /// The topic is looked up on the admin client, whose metadata requests
    /// never ask the broker to create a topic: the producer's do
    /// (librdkafka's `allow.auto.create.topics` is on for producers), and a
    /// broker with `auto.create.topics.enable=true` (Kafka's default) would
    /// make it with its default `cleanup.policy=delete` before walbox could
    /// create it compacted.
    pub async fn ensure_compacted_topic(&self, topic: &str) -> Result<(), CompactedTopicError> {
        let admin = self
            .inner
            .admin()
            .map_err(|e| CompactedTopicError::Refused(e.to_string()))?;
        match self.verdict_on(topic, Some(admin)).await {
            TopicVerdict::Missing(_) => {
                if self.create_compacted_topic(topic).await? {
                    return Ok(());
                }
                // Made by someone else meanwhile: its policy is read below.
            }
            TopicVerdict::Refused(e) => return Err(CompactedTopicError::Refused(e.message)),
            TopicVerdict::NoBroker => {
                return Err(CompactedTopicError::Unanswered(format!(
                    "topic {topic}: no broker answered a metadata request within {TOPIC_CHECK_TIMEOUT:?}"
                )))
            }
            // Its records are produced without another check.
            TopicVerdict::Known => {
                self.remember_known(topic);
            }
            TopicVerdict::Unsure => {}
        }
        let admin = self
            .inner
            .admin()
            .map_err(|e| CompactedTopicError::Refused(e.to_string()))?;
        // A broker that does not implement DescribeConfigs (librdkafka's
        // MockCluster) never answers: a short wait, then a warning.
        let options = AdminOptions::new()
            .request_timeout(Some(DESCRIBE_TIMEOUT))
            .operation_timeout(Some(DESCRIBE_TIMEOUT));
        let described = tokio::time::timeout(
            DESCRIBE_TIMEOUT + Duration::from_secs(1),
            admin.describe_configs([&ResourceSpecifier::Topic(topic)], &options),
        )
        .await;
        let policy = match described {
            Ok(Ok(results)) => match results.into_iter().next() {
                Some(Ok(resource)) => {
                    match resource.get("cleanup.policy").and_then(|e| e.value.clone()) {
                        Some(policy) => policy,
                        None => {
                            tracing::warn!(topic, "the broker did not say the topic's cleanup.policy; make sure it is compact");
                            return Ok(());
                        }
                    }
                }
                Some(Err(RDKafkaErrorCode::UnknownTopicOrPartition)) => {
                    return self.create_compacted_topic(topic).await.map(drop)
                }
                Some(Err(code)) => {
                    tracing::warn!(topic, %code, "cannot read the topic's cleanup.policy; make sure it is compact");
                    return Ok(());
                }
                None => return Ok(()),
            },
            Ok(Err(e)) => {
                tracing::warn!(topic, error = %self.inner.redact(&e.to_string()), "cannot read the topic's cleanup.policy (the broker does not describe configurations?); make sure it is compact");
                return Ok(());
            }
            Err(_) => {
                tracing::warn!(
                    topic,
                    "no answer describing the topic; make sure its cleanup.policy is compact"
                );
                return Ok(());
            }
        };
        if policy.split(',').any(|p| p.trim() == COMPACT) {
            Ok(())
        } else {
            Err(CompactedTopicError::Refused(format!(
                "topic {topic} has cleanup.policy={policy}: its old records would be deleted with the last value of a quiet key; set cleanup.policy=compact on it"
            )))
        }
    }

    /// Creates `topic` with one partition and `cleanup.policy=compact`
    /// (the replication factor and other settings of
    /// [`SinkConfig::create_topics`], if any), as the sink creates any topic.
    /// `Ok(false)`: it existed already, with whatever policy it has.
    async fn create_compacted_topic(&self, topic: &str) -> Result<bool, CompactedTopicError> {
        let mut spec = self.inner.create_topics.clone().unwrap_or_default();
        spec.partitions = Some(1);
        spec.config.remove("retention.ms");
        spec.config.insert("cleanup.policy".into(), COMPACT.into());
        self.create_topic(topic, &spec).await.map_err(|e| match e {
            CreateError::Refused(e) => CompactedTopicError::Refused(format!(
                "{} (it must have cleanup.policy=compact)",
                e.message
            )),
            CreateError::Unanswered(why) => CompactedTopicError::Unanswered(why),
        })
    }
}
