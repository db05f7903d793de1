//! NATS JetStream as sink-core's [`Destination`]: each record published to
//! the subject its topic names, reported delivered once a stream stored it.
//!
//! - **Stored, then reported.** A record is a JetStream publish: its report
//!   comes with the stream's ack (the stream and sequence it was stored
//!   at). Acks are read in publish order, so reports come in order.
//! - **Re-sends dropped by the stream.** Every message carries its place
//!   in the source stream ([`sink_core::Origin::dedup_id`]) as `Nats-Msg-Id`:
//!   within the stream's duplicate window (2 minutes by default) a re-sent
//!   event is stored once, and its ack says `duplicate`.
//! - **Refusals.** No stream taking the subject, a message over the
//!   server's `max_payload`, a header NATS cannot carry: for good
//!   ([`DeliveryErrorKind::Permanent`], the record returned for a
//!   dead-letter copy or the quarantine). An ack that does not come (the
//!   server gone, a stream leader changing) is
//!   [`DeliveryErrorKind::RetriableExhausted`]: the caller starts again
//!   from what it confirmed, and the re-sends are deduplicated.
//! - The record's key is the `walbox.key` header; its headers are headers
//!   (text only); its value the payload.

mod readback;
mod url;

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::publish::PublishAck;
use async_nats::HeaderMap;
use bytes::Bytes;
use sink_core::{
    Admission, Delivered, Deliveries, DeliveryErrorKind, Destination, Permit, Record, Report,
};
use tokio::sync::mpsc;

pub use readback::{read_range, read_streams};
pub use url::{NatsUrl, UrlError};

/// The header that carries the record key.
pub const KEY_HEADER: &str = "walbox.key";
/// JetStream's deduplication header.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Where to publish, and how much may wait for acks.
#[derive(Clone, Debug)]
pub struct NatsConfig {
    /// The server, and the credentials in its URL.
    pub url: NatsUrl,
    /// PEM certificates to trust for `tls://` instead of the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// Most records without an ack.
    pub max_in_flight: usize,
    /// Most bytes without an ack.
    pub max_in_flight_bytes: usize,
    /// How long an ack may take before the record counts as not delivered.
    pub ack_timeout: Duration,
    /// The connection's name, as the server's monitoring shows it.
    pub connection_name: String,
}

/// Why the server cannot be used at all.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// It refused walbox (credentials, authorization, TLS): no retry helps.
    #[error("NATS at {url} refused the connection: {detail}")]
    Refused {
        /// The server, without credentials.
        url: String,
        /// What happened.
        detail: String,
    },
    /// It did not answer.
    #[error("NATS at {url} did not answer: {detail}")]
    Unavailable {
        /// The server, without credentials.
        url: String,
        /// What happened.
        detail: String,
    },
}

impl ConnectError {
    /// True when trying again later may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, ConnectError::Unavailable { .. })
    }
}

/// A publish on its way: its ack (or why it was not sent), and what the
/// report gives back.
struct Pending<T> {
    ack: Result<AckFuture, (DeliveryErrorKind, String)>,
    subject: Arc<str>,
    token: T,
    record: Record<()>,
    _permit: Permit,
}

type AckResult = Result<PublishAck, async_nats::jetstream::context::PublishError>;
type AckFuture = Pin<Box<dyn Future<Output = AckResult> + Send>>;

/// A record handed to the publishing task: its message, or why NATS
/// cannot carry it.
struct Job<T> {
    message: Result<(HeaderMap, Bytes), (DeliveryErrorKind, String)>,
    subject: Arc<str>,
    token: T,
    record: Record<()>,
    permit: Permit,
}

/// Publishes records to JetStream; their reports arrive on [`Acks`].
///
/// [`Destination::send`] never waits on the server: it hands the record
/// to a task of the publisher's, which publishes in order. While the
/// server is gone, the client's buffer fills and that task waits, not the
/// caller (a shutdown's drain ends on its deadline); the admission bounds
/// what waits.
pub struct Publisher<T> {
    client: async_nats::Client,
    admission: Admission,
    jobs: mpsc::UnboundedSender<Job<T>>,
    max_payload: usize,
    shown: String,
}

/// Each published record's report, once, in publish order.
pub struct Acks<T> {
    pending: mpsc::UnboundedReceiver<Pending<T>>,
    current: Option<Pending<T>>,
}

impl<T> std::fmt::Debug for Publisher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("url", &self.shown)
            .field("in_flight", &self.admission.in_flight())
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Publisher<T> {
    /// Connects (a server that refuses walbox fails now, in one line) and
    /// checks that JetStream is on.
    pub async fn connect(config: NatsConfig) -> Result<(Publisher<T>, Acks<T>), ConnectError> {
        let (client, jetstream, shown) = connect(&config).await?;
        let max_payload = client.server_info().max_payload;
        let (tx, rx) = mpsc::unbounded_channel();
        let (jobs, queued) = mpsc::unbounded_channel();
        tokio::spawn(publishing(jetstream, shown.clone(), queued, tx));
        Ok((
            Publisher {
                client,
                admission: Admission::new(config.max_in_flight, config.max_in_flight_bytes),
                jobs,
                max_payload,
                shown,
            },
            Acks {
                pending: rx,
                current: None,
            },
        ))
    }

    /// The server, without credentials.
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// Waits up to `within` for the acks of what is in flight (their
    /// reports arrive meanwhile); returns how many did not come.
    pub async fn close(self, within: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        let _ = tokio::time::timeout_at(deadline, self.client.flush()).await;
        self.admission.drained(deadline).await
    }

    /// The message for `record`, or why NATS cannot carry it.
    fn message(&self, record: &Record<()>) -> Result<(HeaderMap, Bytes), String> {
        let mut headers = HeaderMap::new();
        let text = |what: &str, name: &str, v: &[u8]| {
            std::str::from_utf8(v)
                .ok()
                .filter(|s| !s.contains(['\r', '\n']))
                .map(str::to_owned)
                .ok_or_else(|| format!("{what} {name:?}: NATS headers are one line of UTF-8 text"))
        };
        for h in &record.headers {
            if h.name.is_empty() || h.name.contains([':', ' ', '\r', '\n']) {
                return Err(format!(
                    "header name {:?}: NATS takes no empty name and no ':', space or line break",
                    h.name
                ));
            }
            headers.append(h.name.as_ref(), text("header", &h.name, &h.value)?.as_str());
        }
        if let Some(key) = &record.key {
            headers.insert(KEY_HEADER, text("key", KEY_HEADER, key)?.as_str());
        }
        if let Some(origin) = &record.origin {
            headers.insert(MSG_ID_HEADER, origin.dedup_id().as_str());
        }
        let payload = record.value.clone().unwrap_or_default();
        // The server counts headers and payload against max_payload.
        let size = record.size() + MSG_ID_HEADER.len() + KEY_HEADER.len();
        if size > self.max_payload {
            return Err(format!(
                "message of {size} bytes: the server takes at most {} (its max_payload)",
                self.max_payload
            ));
        }
        Ok((headers, payload))
    }
}

/// A connection to the server with JetStream on, and the server's URL
/// without credentials.
async fn connect(
    config: &NatsConfig,
) -> Result<(async_nats::Client, async_nats::jetstream::Context, String), ConnectError> {
    let shown = config.url.to_string();
    let mut options = async_nats::ConnectOptions::new()
        .name(&config.connection_name)
        .connection_timeout(Duration::from_secs(10));
    options = match &config.url.auth {
        url::Auth::None => options,
        url::Auth::Token(token) => options.token(token.clone()),
        url::Auth::UserPassword(user, password) => {
            options.user_and_password(user.clone(), password.clone())
        }
    };
    // Given for nats:// too: a server that requires TLS upgrades the
    // connection anyway, and async-nats would otherwise build its own.
    let tls = tls_config(config.ca_file.as_deref(), config.url.tls).map_err(|detail| {
        ConnectError::Refused {
            url: shown.clone(),
            detail,
        }
    })?;
    options = options.tls_client_config(tls).require_tls(config.url.tls);
    let client = options
        .connect(config.url.server_addr())
        .await
        .map_err(|e| {
            use async_nats::ConnectErrorKind as K;
            let detail = e.to_string();
            if detail.contains("invalid peer certificate") {
                // rustls' verdict, reported by async-nats as I/O.
                return ConnectError::Refused {
                    url: shown.clone(),
                    detail: format!("TLS: {detail}: the server's certificate is not trusted or not for this host: check nats.ca_file (the CA that signed it) and that the URL's host is a name the certificate carries"),
                };
            }
            match e.kind() {
                K::Authentication | K::AuthorizationViolation | K::Tls => ConnectError::Refused {
                    url: shown.clone(),
                    detail,
                },
                _ => ConnectError::Unavailable {
                    url: shown.clone(),
                    detail,
                },
            }
        })?;
    let mut jetstream = async_nats::jetstream::new(client.clone());
    jetstream.set_timeout(config.ack_timeout);
    jetstream
            .query_account()
            .await
            .map_err(|e| ConnectError::Refused {
                url: shown.clone(),
                detail: format!("JetStream is not available to this account ({e}): start the server with JetStream on (nats-server -js) and give the account JetStream limits"),
            })?;
    Ok((client, jetstream, shown))
}

/// TLS trusting `ca_file`'s certificates, else the system's
/// ([`sink_core::tls`]); with none there, an error when TLS is `required`.
fn tls_config(
    ca_file: Option<&std::path::Path>,
    required: bool,
) -> Result<rustls::ClientConfig, String> {
    let (roots, problem) = sink_core::tls::roots(ca_file, "nats.ca_file")?;
    if roots.is_empty() && required {
        return Err(format!(
            "tls://: no trusted certificate in the system's store{}; install the ca-certificates package or set nats.ca_file",
            problem.map(|p| format!(" ({p})")).unwrap_or_default()
        ));
    }
    Ok(sink_core::tls::builder(roots)?.with_no_client_auth())
}

/// Whether `subject` is one NATS publishes to: dot-separated tokens, no
/// wildcard, no whitespace.
fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject
            .split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace))
}

impl<T: Send + 'static> Destination<T> for Publisher<T> {
    fn admission(&self) -> &Admission {
        &self.admission
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        let (record, token) = record.split_token();
        let subject = Arc::clone(&record.topic);
        let message = match self.message(&record) {
            Err(why) => Err((DeliveryErrorKind::Permanent, why)),
            Ok(_) if !valid_subject(&subject) => Err((
                DeliveryErrorKind::Permanent,
                format!("subject {subject:?}: NATS publishes to dot-separated tokens without wildcards or spaces"),
            )),
            Ok(message) => Ok(message),
        };
        let _ = self.jobs.send(Job {
            message,
            subject,
            token,
            record,
            permit,
        });
    }
}

/// The publishing task: each job published in order, its ack (or why it
/// was not sent) handed to [`Acks`]; ends with the publisher, or when
/// nobody reads the acks any more.
async fn publishing<T>(
    jetstream: async_nats::jetstream::Context,
    shown: String,
    mut jobs: mpsc::UnboundedReceiver<Job<T>>,
    pending: mpsc::UnboundedSender<Pending<T>>,
) {
    while let Some(job) = jobs.recv().await {
        let ack = match job.message {
            Err(failure) => Err(failure),
            Ok((headers, payload)) => {
                let publish = async_nats::jetstream::context::Publish::build()
                    .payload(payload)
                    .headers(headers);
                tokio::select! {
                    sent = jetstream.send_publish(job.subject.to_string(), publish) => match sent {
                        Ok(ack) => Ok(Box::pin(IntoFuture::into_future(ack)) as AckFuture),
                        Err(e) => Err((
                            DeliveryErrorKind::RetriableExhausted,
                            format!("publishing to NATS at {shown} failed: {e}"),
                        )),
                    },
                    () = pending.closed() => return,
                }
            }
        };
        let sent = pending.send(Pending {
            ack,
            subject: job.subject,
            token: job.token,
            record: job.record,
            _permit: job.permit,
        });
        if sent.is_err() {
            return;
        }
    }
}

impl<T: Send + 'static> Deliveries<T> for Acks<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        if self.current.is_none() {
            self.current = Some(self.pending.recv().await?);
        }
        // The ack in progress stays in `current` if this is cancelled.
        let current = self.current.as_mut().expect("set above");
        let result = match &mut current.ack {
            Err(failure) => Err(failure.clone()),
            Ok(ack) => ack
                .as_mut()
                .await
                .map_err(|e| classify(&current.subject, &e)),
        };
        let Pending { token, record, .. } = self.current.take().expect("set above");
        Some(match result {
            Ok(ack) => Report::delivered(
                token,
                Delivered::Nats {
                    stream: ack.stream,
                    sequence: ack.sequence,
                    duplicate: ack.duplicate,
                },
            ),
            Err((kind, why)) => Report::failed(token, kind, why, record),
        })
    }
}

/// What a failed publish means for the record.
fn classify(
    subject: &str,
    e: &async_nats::jetstream::context::PublishError,
) -> (DeliveryErrorKind, String) {
    match e.kind() {
        PublishErrorKind::StreamNotFound => (
            DeliveryErrorKind::Permanent,
            format!("no JetStream stream takes subject {subject:?}: add it to a stream's subjects"),
        ),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => (
            DeliveryErrorKind::RetriableExhausted,
            format!("no ack from JetStream for subject {subject:?} ({e}): sent again after a restart, the stream drops the copy it has"),
        ),
        _ => {
            let text = e.to_string();
            let passing = ["unavailable", "not ready", "timeout", "insufficient resources"];
            let kind = if passing.iter().any(|p| text.to_lowercase().contains(p)) {
                DeliveryErrorKind::RetriableExhausted
            } else {
                DeliveryErrorKind::Permanent
            };
            (kind, format!("JetStream refused the message for subject {subject:?}: {text}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_tokens_without_wildcards() {
        assert!(valid_subject("outbox.event.order"));
        assert!(valid_subject("orders"));
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b", "a.\tb"] {
            assert!(!valid_subject(bad), "{bad:?}");
        }
    }
}
