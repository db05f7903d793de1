//! `sink = "nats"`: the `[nats]` settings, and what is refused with them
//! ([`super::broker_limits`]).

use std::time::Duration;

use sink_nats::{NatsConfig, NatsUrl};

use super::{Config, ConfigError};

impl Config {
    /// `[nats]`, checked (with `sink = "nats"`).
    pub(super) fn nats(
        &self,
        max_in_flight: usize,
        max_in_flight_bytes: usize,
    ) -> Result<NatsConfig, ConfigError> {
        let r = &self.raw;
        let n = &r.nats;
        let Some(url) = &n.url else {
            return Err(ConfigError(
                "sink = \"nats\" needs nats.url (nats://[user:password@]host:4222, tls:// for TLS; WALBOX_NATS_URL or WALBOX_NATS_URL_FILE)".into(),
            ));
        };
        let url =
            NatsUrl::parse(url.expose()).map_err(|e| ConfigError(format!("nats.url: {e}")))?;
        if n.ca_file.is_some() && !url.tls {
            return Err(ConfigError(
                "nats.ca_file is for TLS: write the URL as tls://".into(),
            ));
        }
        if let Some(ca) = &n.ca_file {
            std::fs::metadata(ca).map_err(|e| ConfigError(format!("nats.ca_file {ca}: {e}")))?;
        }
        if !(1..=600_000).contains(&n.ack_timeout_ms) {
            return Err(ConfigError("nats.ack_timeout_ms: from 1 to 600000".into()));
        }
        super::broker_limits::refuse(r)?;
        Ok(NatsConfig {
            url,
            ca_file: n.ca_file.as_ref().map(Into::into),
            max_in_flight,
            max_in_flight_bytes,
            ack_timeout: Duration::from_millis(n.ack_timeout_ms),
            connection_name: format!("walbox {}", r.slot),
        })
    }
}
