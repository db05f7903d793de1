//! What can go wrong with a record or the producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use sink_core::{DeliveryError, DeliveryErrorKind};

/// A record's failure as librdkafka gave it: its kind, the librdkafka
/// code, and a message. The caller gets it as the neutral
/// [`DeliveryError`] ([`Failure::into_error`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} delivery failure: {message}")]
pub(crate) struct Failure {
    /// What to do about it.
    pub(crate) kind: DeliveryErrorKind,
    /// The librdkafka error code, when there is one.
    pub(crate) code: Option<RDKafkaErrorCode>,
    /// What happened.
    pub(crate) message: String,
}

/// Error codes that no retry will fix.
const PERMANENT: &[RDKafkaErrorCode] = &[
    RDKafkaErrorCode::MessageSizeTooLarge,
    RDKafkaErrorCode::InvalidMessageSize,
    RDKafkaErrorCode::MessageBatchTooLarge,
    RDKafkaErrorCode::TopicAuthorizationFailed,
    RDKafkaErrorCode::ClusterAuthorizationFailed,
    RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
    RDKafkaErrorCode::InvalidTopic,
    RDKafkaErrorCode::UnknownTopic,
    RDKafkaErrorCode::UnknownTopicOrPartition,
    RDKafkaErrorCode::UnknownPartition,
    RDKafkaErrorCode::InvalidRecord,
    RDKafkaErrorCode::PolicyViolation,
    RDKafkaErrorCode::InvalidRequiredAcks,
    RDKafkaErrorCode::InvalidMessage,
    RDKafkaErrorCode::UnsupportedVersion,
    RDKafkaErrorCode::UnsupportedForMessageFormat,
    RDKafkaErrorCode::InvalidTimestamp,
];

impl Failure {
    pub(crate) fn new(
        kind: DeliveryErrorKind,
        code: Option<RDKafkaErrorCode>,
        message: impl Into<String>,
    ) -> Self {
        Failure {
            kind,
            code,
            message: message.into(),
        }
    }

    /// The neutral error: a fatal error that fenced the producer is
    /// [`DeliveryErrorKind::Fenced`].
    pub(crate) fn into_error(self) -> DeliveryError {
        let kind = if self.is_fenced() {
            DeliveryErrorKind::Fenced
        } else {
            self.kind
        };
        DeliveryError::new(kind, self.message)
    }

    /// The record failed because its producer was fenced: a newer producer
    /// initialised the same transactional id (librdkafka raises it as a
    /// fatal error whose cause names the fencing; the report carries that
    /// cause's code).
    fn is_fenced(&self) -> bool {
        self.kind == DeliveryErrorKind::Fatal
            && matches!(
                self.code,
                Some(
                    RDKafkaErrorCode::Fenced
                        | RDKafkaErrorCode::ProducerFenced
                        | RDKafkaErrorCode::InvalidProducerEpoch
                )
            )
    }

    /// Adds what to grant when the broker refused for lack of a right: the
    /// ACL a principal needs to write to `topic` (idempotently), in words an
    /// operator can paste into `kafka-acls`.
    pub(crate) fn with_authorization_hint(mut self, topic: &str) -> Self {
        let hint = match self.code {
            Some(RDKafkaErrorCode::TopicAuthorizationFailed) => format!(
                "walbox's principal needs Write and Describe on topic {topic} (kafka-acls --add --allow-principal User:… --operation Write --operation Describe --topic {topic})"
            ),
            Some(RDKafkaErrorCode::ClusterAuthorizationFailed) => "the broker gave walbox's idempotent producer no producer id: its principal needs Write on the event topics (Kafka 3.0+) or IdempotentWrite on the cluster (kafka-acls --add --allow-principal User:… --operation IdempotentWrite --cluster)".to_owned(),
            _ => return self,
        };
        self.message = format!("{}; {hint}", self.message);
        self
    }

    /// Classifies a delivery report's error.
    pub(crate) fn from_kafka(e: &KafkaError) -> Failure {
        let code = e.rdkafka_error_code();
        let kind = match code {
            Some(RDKafkaErrorCode::Fatal) => DeliveryErrorKind::Fatal,
            Some(RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::PurgeInflight) => {
                DeliveryErrorKind::Purged
            }
            Some(RDKafkaErrorCode::MessageTimedOut) => DeliveryErrorKind::RetriableExhausted,
            Some(c) if PERMANENT.contains(&c) => DeliveryErrorKind::Permanent,
            // Anything else after librdkafka's own retries: never skip it
            // silently. Retriable codes reach here only when retries ran out.
            Some(_) | None => DeliveryErrorKind::RetriableExhausted,
        };
        Failure::new(kind, code, e.to_string())
    }
}

/// The sink could not be created or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SinkError {
    /// A bad setting.
    #[error("invalid Kafka settings: {0}")]
    Config(String),
    /// The brokers did not answer.
    #[error("{}", match last { Some(why) => why.clone(), None => format!("metadata request failed: {source}") })]
    Unreachable {
        /// The metadata request's error.
        source: KafkaError,
        /// The last connection failure librdkafka reported, if any.
        last: Option<String>,
    },
    /// A broker refused the connection for a reason no retry fixes: its
    /// certificate is not trusted, or it refused the credentials.
    #[error("{0}")]
    Refused(crate::BrokerProblem),
    /// librdkafka refused to create the producer (the message names the
    /// property, never a secret value).
    #[error("create the Kafka producer: {0}")]
    Create(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_codes() {
        let kind = |c| Failure::from_kafka(&KafkaError::MessageProduction(c)).kind;
        assert_eq!(
            kind(RDKafkaErrorCode::MessageSizeTooLarge),
            DeliveryErrorKind::Permanent
        );
        assert_eq!(
            kind(RDKafkaErrorCode::TopicAuthorizationFailed),
            DeliveryErrorKind::Permanent
        );
        assert_eq!(kind(RDKafkaErrorCode::Fatal), DeliveryErrorKind::Fatal);
        // A timestamp outside the topic's message.timestamp.*.ms window
        // never becomes acceptable by retrying.
        assert_eq!(
            kind(RDKafkaErrorCode::InvalidTimestamp),
            DeliveryErrorKind::Permanent
        );
        assert_eq!(
            kind(RDKafkaErrorCode::MessageTimedOut),
            DeliveryErrorKind::RetriableExhausted
        );
        assert_eq!(
            kind(RDKafkaErrorCode::PurgeInflight),
            DeliveryErrorKind::Purged
        );
        assert_eq!(
            kind(RDKafkaErrorCode::NotLeaderForPartition),
            DeliveryErrorKind::RetriableExhausted
        );
    }
}
