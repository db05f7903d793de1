//! `sink = "webhook"`: the `[webhook]` settings, and what is refused with
//! them ([`super::broker_limits`]).

use std::time::Duration;

use sink_webhook::WebhookConfig;

use super::{Config, ConfigError};

/// Most keys with a request out at once.
const MAX_CONCURRENCY: u64 = 256;

impl Config {
    /// `[webhook]`, checked (with `sink = "webhook"`).
    pub(super) fn webhook(
        &self,
        max_in_flight: usize,
        max_in_flight_bytes: usize,
    ) -> Result<WebhookConfig, ConfigError> {
        let r = &self.raw;
        let w = &r.webhook;
        let Some(url) = &w.url else {
            return Err(ConfigError(
                "sink = \"webhook\" needs webhook.url (https://…; WALBOX_WEBHOOK_URL or WALBOX_WEBHOOK_URL_FILE)".into(),
            ));
        };
        // The url crate's errors quote nothing of the input.
        let url = url::Url::parse(url.expose())
            .map_err(|e| ConfigError(format!("webhook.url: {e}; expected https://host/path")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(ConfigError(
                "webhook.url: expected http:// or https:// with a host".into(),
            ));
        }
        if w.ca_file.is_some() && url.scheme() != "https" {
            return Err(ConfigError("webhook.ca_file is for https:// URLs".into()));
        }
        if let Some(ca) = &w.ca_file {
            std::fs::metadata(ca).map_err(|e| ConfigError(format!("webhook.ca_file {ca}: {e}")))?;
        }
        if !(1..=MAX_CONCURRENCY).contains(&w.concurrency) {
            return Err(ConfigError(format!(
                "webhook.concurrency: from 1 to {MAX_CONCURRENCY}"
            )));
        }
        if !(1..=600_000).contains(&w.timeout_ms) {
            return Err(ConfigError("webhook.timeout_ms: from 1 to 600000".into()));
        }
        if w.secret.as_ref().is_some_and(|s| s.expose().is_empty()) {
            return Err(ConfigError("webhook.secret: must not be empty".into()));
        }
        super::broker_limits::refuse(r)?;
        Ok(WebhookConfig {
            url,
            secret: w.secret.as_ref().map(|s| s.expose().to_owned()),
            ca_file: w.ca_file.as_ref().map(Into::into),
            timeout: Duration::from_millis(w.timeout_ms),
            concurrency: w.concurrency as usize,
            max_in_flight,
            max_in_flight_bytes,
        })
    }
}
