//! `sink = "sqs"`: the `[sqs]` settings, and what is refused with them
//! ([`super::broker_limits`]).

use sink_sqs::SqsConfig;

use super::raw::RawSink;
use super::{Config, ConfigError};

/// Most batches on their way at once.
const MAX_CONCURRENCY: u64 = 64;

impl Config {
    /// With `sink = "sqs"`, the dead-letter topic `sqs.dead_letter_queue_url`
    /// stands for; else `dead_letter_topic`.
    pub(super) fn dead_letter_topic(&self) -> Option<String> {
        let r = &self.raw;
        match (r.sink, &r.sqs.dead_letter_queue_url) {
            (RawSink::Sqs, Some(_)) => Some(sink_sqs::DEAD_LETTER_TOPIC.to_owned()),
            (RawSink::Sqs, None) => None,
            _ => r.dead_letter_topic.clone(),
        }
    }

    /// `[sqs]`, checked (with `sink = "sqs"`).
    pub(super) fn sqs(
        &self,
        max_in_flight: usize,
        max_in_flight_bytes: usize,
        gapless: bool,
    ) -> Result<SqsConfig, ConfigError> {
        let r = &self.raw;
        let q = &r.sqs;
        let Some(queue_url) = &q.queue_url else {
            return Err(ConfigError(
                "sink = \"sqs\" needs sqs.queue_url (https://sqs.<region>.amazonaws.com/<account>/<queue>; WALBOX_SQS_QUEUE_URL)".into(),
            ));
        };
        http_url("sqs.queue_url", queue_url)?;
        if let Some(dl) = &q.dead_letter_queue_url {
            http_url("sqs.dead_letter_queue_url", dl)?;
            if dl == queue_url {
                return Err(ConfigError(
                    "sqs.dead_letter_queue_url: the events' queue itself; name another queue"
                        .into(),
                ));
            }
        }
        if r.dead_letter_topic.is_some() {
            return Err(ConfigError(
                "dead_letter_topic: with sink = \"sqs\" dead letters go to a queue: set sqs.dead_letter_queue_url instead".into(),
            ));
        }
        if let Some(e) = &q.endpoint {
            http_url("sqs.endpoint", e)?;
        }
        if q.region.as_deref() == Some("") {
            return Err(ConfigError("sqs.region: must not be empty".into()));
        }
        if !(1..=MAX_CONCURRENCY).contains(&q.concurrency) {
            return Err(ConfigError(format!(
                "sqs.concurrency: from 1 to {MAX_CONCURRENCY}"
            )));
        }
        super::broker_limits::refuse(r)?;
        Ok(SqsConfig {
            queue_url: queue_url.clone(),
            dead_letter_queue_url: q.dead_letter_queue_url.clone(),
            region: q.region.clone(),
            endpoint: q.endpoint.clone(),
            lanes: q.concurrency as usize,
            max_in_flight,
            max_in_flight_bytes,
            gapless,
        })
    }
}

fn http_url(key: &str, url: &str) -> Result<(), ConfigError> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        Some(rest) if !rest.is_empty() && !rest.starts_with('/') => Ok(()),
        _ => Err(ConfigError(format!(
            "{key} {url:?}: expected an http:// or https:// URL"
        ))),
    }
}
