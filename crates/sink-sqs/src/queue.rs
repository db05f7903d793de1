//! The SQS client (the AWS SDK's, with walbox's timeouts and no retries
//! of its own: the sender retries) and what walbox reads of a queue.

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::BehaviorVersion;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::QueueAttributeName;
use aws_sdk_sqs::Client;

use crate::{ConnectError, SqsConfig};

/// How long a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request may take (an SQS that stopped answering is given
/// up on, and the batch sent again).
pub(crate) const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// A queue as read at connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueInfo {
    /// Its URL.
    pub url: String,
    /// A FIFO queue (`FifoQueue`): message groups and deduplication ids.
    pub fifo: bool,
    /// Its `MaximumMessageSize`, in bytes.
    pub max_message_bytes: usize,
}

/// The AWS region in an SQS queue URL
/// (`https://sqs.<region>.amazonaws.com/…`, or the legacy
/// `https://<region>.queue.amazonaws.com/…`).
pub fn region_of(queue_url: &str) -> Option<String> {
    let rest = queue_url
        .strip_prefix("https://")
        .or_else(|| queue_url.strip_prefix("http://"))?;
    let host = rest.split(['/', ':']).next()?;
    let labels: Vec<&str> = host.split('.').collect();
    let region = match labels.as_slice() {
        ["sqs", region, "amazonaws", ..] => region,
        [region, "queue", "amazonaws", ..] => region,
        _ => return None,
    };
    let valid = !region.is_empty()
        && region
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    valid.then(|| (*region).to_owned())
}

/// The client: the AWS credential chain, the region from the settings,
/// the queue URL or the chain, the endpoint from the settings or the
/// region.
pub(crate) async fn client(config: &SqsConfig) -> Result<Client, ConnectError> {
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .retry_config(RetryConfig::standard().with_max_attempts(1))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(CONNECT_TIMEOUT)
                .operation_attempt_timeout(ATTEMPT_TIMEOUT)
                .build(),
        );
    let region = config
        .region
        .clone()
        .or_else(|| region_of(&config.queue_url));
    if let Some(region) = region {
        loader = loader.region(aws_config::Region::new(region));
    }
    if let Some(endpoint) = &config.endpoint {
        loader = loader.endpoint_url(endpoint);
    }
    let sdk = loader.load().await;
    if sdk.region().is_none() {
        return Err(ConnectError::Refused {
            queue: config.queue_url.clone(),
            detail: "no AWS region: set sqs.region (or AWS_REGION)".into(),
        });
    }
    Ok(Client::new(&sdk))
}

/// What walbox needs of the queue at `url`.
pub(crate) async fn attributes(client: &Client, url: &str) -> Result<QueueInfo, ConnectError> {
    let answer = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::FifoQueue)
        .attribute_names(QueueAttributeName::MaximumMessageSize)
        .send()
        .await;
    let out = match answer {
        Ok(out) => out,
        Err(e) => {
            let detail = describe(&e);
            let queue = url.to_owned();
            return Err(match Class::of(&e) {
                Class::Transient => ConnectError::Unavailable { queue, detail },
                _ => ConnectError::Refused { queue, detail },
            });
        }
    };
    let attributes = out.attributes();
    let get = |name: &QueueAttributeName| attributes.and_then(|a| a.get(name));
    let fifo = get(&QueueAttributeName::FifoQueue).is_some_and(|v| v == "true");
    // 256 KiB, SQS's limit for years, when the queue does not say.
    let max_message_bytes = get(&QueueAttributeName::MaximumMessageSize)
        .and_then(|v| v.parse().ok())
        .unwrap_or(262_144);
    Ok(QueueInfo {
        url: url.to_owned(),
        fifo,
        max_message_bytes,
    })
}

/// What a failed request means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// Try again later: no answer, throttled, a server error.
    Transient,
    /// The batch is larger than SQS takes at once: send its messages one
    /// by one.
    BatchTooLong,
    /// No retry helps: the queue, the credentials, the permissions.
    Definite,
}

/// Error codes that mean "later".
const TRANSIENT_CODES: &[&str] = &[
    "RequestThrottled",
    "ThrottlingException",
    "Throttling",
    "KmsThrottled",
    "KMS.ThrottlingException",
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
];

impl Class {
    pub(crate) fn of<E: ProvideErrorMetadata>(e: &SdkError<E>) -> Class {
        match e {
            SdkError::ConstructionFailure(_) => Class::Definite,
            SdkError::ServiceError(s) => {
                let code = s.err().code().unwrap_or("");
                let code = code.strip_prefix("AWS.SimpleQueueService.").unwrap_or(code);
                if code == "BatchRequestTooLong" {
                    Class::BatchTooLong
                } else if s.raw().status().is_server_error() || TRANSIENT_CODES.contains(&code) {
                    Class::Transient
                } else {
                    Class::Definite
                }
            }
            // No answer, a timeout, an answer that could not be read.
            _ => Class::Transient,
        }
    }
}

/// A failed request in one line (the SDK's error and its causes).
pub(crate) fn describe<E>(e: &SdkError<E>) -> String
where
    E: std::error::Error + ProvideErrorMetadata + 'static,
{
    match e {
        SdkError::ServiceError(s) => {
            let err = s.err();
            format!(
                "{} (HTTP {}): {}",
                err.code().unwrap_or("error"),
                s.raw().status().as_u16(),
                err.message().unwrap_or("no message")
            )
        }
        _ => DisplayErrorContext(e).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::region_of;

    #[test]
    fn the_region_is_read_from_sqs_queue_urls() {
        let r = |u| region_of(u);
        assert_eq!(
            r("https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo").as_deref(),
            Some("eu-west-1")
        );
        assert_eq!(
            r("https://sqs.cn-north-1.amazonaws.com.cn/1/q").as_deref(),
            Some("cn-north-1")
        );
        assert_eq!(
            r("https://us-east-2.queue.amazonaws.com/1/q").as_deref(),
            Some("us-east-2")
        );
        assert_eq!(r("http://127.0.0.1:4566/000000000000/q"), None);
        assert_eq!(r("https://sqs.EVIL/x.amazonaws.com/1/q"), None);
        assert_eq!(r("sqs.eu-west-1.amazonaws.com/1/q"), None);
    }
}
