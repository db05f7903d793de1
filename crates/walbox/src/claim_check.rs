//! Claim-check for oversized events (`claim_check.bucket`), stated once: a
//! record larger than `claim_check.threshold_bytes` is not refused by the
//! broker for its size; its value is stored as an object in an
//! S3-compatible store, and the record carries a pointer to it instead.
//!
//! - The object's key is `claim_check.prefix` followed by the value's
//!   SHA-256 (hex): writing it again (a replay, a restart) writes the same
//!   object, and two events with the same value share it.
//! - The object is written before the record is produced, and the record
//!   counts as delivered (its slot position may be confirmed) only when the
//!   broker acknowledged it: the slot never passes an event whose object or
//!   record is missing.
//! - The record keeps its topic, key and headers; its value becomes
//!   `{"claim_check":{"url":"s3://BUCKET/KEY","sha256":"…","size":N}}`, and
//!   three headers say so: `walbox.claim-check.url`,
//!   `walbox.claim-check.sha256` (of the object's bytes) and
//!   `walbox.claim-check.size` (bytes). A consumer fetches the object and
//!   checks its SHA-256 (docs/configuration.md, "Claim-check").
//! - A store that does not answer (or answers with a server error) ends the
//!   session: the event is read again and stored again after a backoff. A
//!   store that refuses (no such bucket, access denied, bad credentials)
//!   stops walbox with the slot before the event.
//! - walbox never deletes the objects: expire them with a bucket lifecycle
//!   rule longer than your topics' retention.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use sha2::{Digest, Sha256};
use sink_core::{Header, Record};

/// Header names on claim-checked records.
pub mod headers {
    /// Where the value is: `s3://BUCKET/KEY`.
    pub const URL: &str = "walbox.claim-check.url";
    /// The SHA-256 of the object's bytes, hex.
    pub const SHA256: &str = "walbox.claim-check.sha256";
    /// The object's size in bytes.
    pub const SIZE: &str = "walbox.claim-check.size";
}

/// How long storing one object may take before the session is deemed
/// broken (also what a shutdown may wait past its bound while one is under
/// way).
pub const STORE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where oversized values go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimCheckConfig {
    /// The bucket.
    pub bucket: String,
    /// An S3-compatible endpoint (`http://…` or `https://…`); `None`: AWS.
    pub endpoint: Option<String>,
    /// The region; `None`: `AWS_REGION` / `AWS_DEFAULT_REGION`, else
    /// `us-east-1`.
    pub region: Option<String>,
    /// Prepended to each object's key.
    pub prefix: String,
    /// Records larger than this (key, value and headers) are claim-checked.
    pub threshold: usize,
}

/// What a message's size may reach beyond its record's (key, value and
/// headers) on a broker that counts more (SQS: each attribute's type name).
const BROKER_OVERHEAD: usize = 1024;

impl ClaimCheckConfig {
    /// The configuration for a broker that takes messages of at most
    /// `limit` bytes (SQS: the queue's MaximumMessageSize, read at
    /// connection): a threshold at or past it would let the broker refuse
    /// what the claim-check is there to take, so it is brought under it.
    /// Returns whether it was lowered.
    pub fn within(mut self, limit: Option<usize>) -> (ClaimCheckConfig, bool) {
        let Some(limit) = limit else {
            return (self, false);
        };
        let most = limit.saturating_sub(BROKER_OVERHEAD).max(1);
        let lowered = self.threshold > most;
        self.threshold = self.threshold.min(most);
        (self, lowered)
    }
}

/// Why a value could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum ClaimCheckError {
    /// The store did not answer, or failed on its side: a new session
    /// tries again.
    #[error("claim-check: storing the value of a {size}-byte record in bucket {bucket} failed: {detail}; trying again")]
    Unavailable {
        /// The bucket.
        bucket: String,
        /// The record's size.
        size: usize,
        /// What happened.
        detail: String,
    },
    /// The store refused for good: no such bucket, access denied.
    #[error("claim-check: bucket {bucket} refused the value of a {size}-byte record: {detail}; the slot stays before this event (check claim_check.bucket, the endpoint and the credentials' s3:PutObject permission)")]
    Refused {
        /// The bucket.
        bucket: String,
        /// The record's size.
        size: usize,
        /// What happened.
        detail: String,
    },
    /// The store cannot be set up from the configuration.
    #[error("claim-check: {0}")]
    Setup(String),
}

impl ClaimCheckError {
    /// True when a new session may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ClaimCheckError::Unavailable { .. })
    }
}

/// The store, ready to take values.
#[derive(Debug, Clone)]
pub struct ClaimCheck {
    config: ClaimCheckConfig,
    store: Arc<dyn ObjectStore>,
}

impl ClaimCheck {
    /// A client of the configured store, with credentials from the AWS
    /// chain: `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`,
    /// web identity (`AWS_WEB_IDENTITY_TOKEN_FILE`, `AWS_ROLE_ARN`: EKS),
    /// ECS task or EKS pod identity credentials, EC2 instance metadata.
    pub fn new(config: ClaimCheckConfig) -> Result<ClaimCheck, ClaimCheckError> {
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(&config.bucket)
            .with_retry(object_store::RetryConfig {
                max_retries: 3,
                retry_timeout: STORE_TIMEOUT,
                ..Default::default()
            });
        if let Some(region) = &config.region {
            builder = builder.with_region(region);
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        let store = builder
            .build()
            .map_err(|e| ClaimCheckError::Setup(e.to_string()))?;
        Ok(ClaimCheck::with_store(config, Arc::new(store)))
    }

    /// The claim-check writing to `store` (any object_store store: the
    /// relay's tests use an in-memory one) as if it were `config.bucket`.
    pub fn with_store(config: ClaimCheckConfig, store: Arc<dyn ObjectStore>) -> ClaimCheck {
        ClaimCheck { config, store }
    }

    /// Whether `record` must be claim-checked: larger than the threshold,
    /// with a value, and not claim-checked already.
    pub fn needs<T>(&self, record: &Record<T>) -> bool {
        record.size() > self.config.threshold
            && record.value.is_some()
            && !record.headers.iter().any(|h| h.name == headers::URL)
    }

    /// Stores `record`'s value and makes the record point to it; returns
    /// the object's size.
    pub async fn store<T>(&self, record: &mut Record<T>) -> Result<usize, ClaimCheckError> {
        let size = record.size();
        let value = record.value.take().unwrap_or_default();
        let digest = sha256_hex(&value);
        let key = format!("{}{digest}", self.config.prefix);
        let path = Path::from(key.as_str());
        let put = self.store.put(&path, PutPayload::from(value.clone()));
        let result = match tokio::time::timeout(STORE_TIMEOUT, put).await {
            Ok(result) => result.map(|_| ()).map_err(|e| self.error(size, e)),
            Err(_) => Err(ClaimCheckError::Unavailable {
                bucket: self.config.bucket.clone(),
                size,
                detail: format!("no answer within {STORE_TIMEOUT:?}"),
            }),
        };
        if let Err(e) = result {
            record.value = Some(value);
            return Err(e);
        }
        let url = format!("s3://{}/{key}", self.config.bucket);
        let pointer = serde_json::json!({
            "claim_check": { "url": url, "sha256": digest, "size": value.len() }
        });
        record.value = Some(Bytes::from(pointer.to_string()));
        let mut add = |name: &'static str, text: String| {
            record.headers.push(Header {
                name: name.into(),
                value: Bytes::from(text),
            })
        };
        add(headers::URL, url);
        add(headers::SHA256, digest);
        add(headers::SIZE, value.len().to_string());
        Ok(value.len())
    }

    fn error(&self, size: usize, e: object_store::Error) -> ClaimCheckError {
        let detail = e.to_string();
        let bucket = self.config.bucket.clone();
        match e {
            object_store::Error::NotFound { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => ClaimCheckError::Refused {
                bucket,
                size,
                detail,
            },
            _ => ClaimCheckError::Unavailable {
                bucket,
                size,
                detail,
            },
        }
    }
}

/// The SHA-256 of `bytes`, as lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(threshold: usize) -> ClaimCheck {
        ClaimCheck::new(ClaimCheckConfig {
            bucket: "b".into(),
            endpoint: Some("http://127.0.0.1:1".into()),
            region: Some("us-east-1".into()),
            prefix: "walbox/".into(),
            threshold,
        })
        .unwrap()
    }

    #[test]
    fn the_threshold_is_brought_under_a_brokers_message_limit() {
        let config = check(900_000).config;
        assert_eq!(config.clone().within(None), (config.clone(), false));
        let (sqs, lowered) = config.clone().within(Some(262_144));
        assert!(lowered);
        assert_eq!(sqs.threshold, 262_144 - 1024);
        let (roomy, lowered) = config.within(Some(4 << 20));
        assert!(!lowered);
        assert_eq!(roomy.threshold, 900_000);
    }

    #[test]
    fn only_values_of_records_past_the_threshold_not_yet_checked() {
        let c = check(10);
        let small = Record::new("t", None, Some(Bytes::from_static(b"12345")), ());
        let big = Record::new("t", None, Some(Bytes::from(vec![b'x'; 20])), ());
        let no_value = Record::new("t", Some(Bytes::from(vec![b'k'; 20])), None, ());
        assert!(!c.needs(&small));
        assert!(c.needs(&big));
        assert!(!c.needs(&no_value), "nothing to store");
        let done = big.clone().with_header(headers::URL, "s3://b/k");
        assert!(!c.needs(&done), "checked once");
    }

    #[test]
    fn the_digest_is_sha256_in_hex() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[tokio::test]
    async fn an_unreachable_store_is_transient_and_the_record_keeps_its_value() {
        let c = check(1);
        let mut r = Record::new("t", None, Some(Bytes::from_static(b"payload")), ());
        let e = c.store(&mut r).await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert_eq!(r.value.as_deref(), Some(&b"payload"[..]));
        assert!(r.headers.is_empty());
    }
}
