//! HTTP webhooks as sink-core's [`Destination`]: a signed POST per event.
//!
//! - **One request in flight per key.** Events of one key (aggregate) are
//!   POSTed one after another, each once the previous one was answered, so
//!   the endpoint sees each aggregate's events in commit order; up to
//!   `concurrency` keys are in flight at once.
//! - **Answered 2xx: delivered.** A 4xx (but 408, 425 and 429) is a refusal
//!   for good ([`DeliveryErrorKind::Permanent`], the record returned for a
//!   dead-letter copy or the quarantine). A 5xx, 408, 425, 429, a timeout
//!   or a connection that fails is tried again, with a backoff of 0.5 s
//!   doubling to 30 s, as long as it takes (the endpoint down stalls the
//!   relay, as a broker down does; nothing is skipped). An `https://`
//!   endpoint whose certificate cannot be verified (not trusted, not for
//!   its host) or that does not speak TLS fails every event the same way:
//!   [`DeliveryErrorKind::Fatal`], walbox stops in one line.
//! - **The request.** The record's value is the body (`Content-Type:
//!   application/json`); headers say the rest: `Walbox-Topic`, `Walbox-Key`,
//!   `Idempotency-Key` (the event's place in the source stream, the same on
//!   every re-send), each record header as `Walbox-Header-<name>`, and with
//!   a secret, `Walbox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
//!   "<t>.<body>">`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hmac::{Hmac, KeyInit, Mac};
use sink_core::{
    Admission, Delivered, Deliveries, DeliveryErrorKind, Destination, Permit, Record, Report,
};
use tokio::sync::mpsc;

/// The first wait before trying a request again, doubled up to
/// [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Where to POST, and how.
#[derive(Clone)]
pub struct WebhookConfig {
    /// The endpoint (`http://` or `https://`).
    pub url: url::Url,
    /// The HMAC key of `Walbox-Signature`; `None`: unsigned.
    pub secret: Option<String>,
    /// PEM certificates to trust for `https://` instead of the system's.
    pub ca_file: Option<std::path::PathBuf>,
    /// How long one request may take.
    pub timeout: Duration,
    /// Keys with a request in flight, at most.
    pub concurrency: usize,
    /// Most records not answered yet.
    pub max_in_flight: usize,
    /// Most bytes not answered yet.
    pub max_in_flight_bytes: usize,
}

impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("url", &shown(&self.url))
            .field("signed", &self.secret.is_some())
            .field("timeout", &self.timeout)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

/// The endpoint as shown: no user information, no query (either may hold
/// a token).
pub fn shown(url: &url::Url) -> String {
    let mut u = url.clone();
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.set_query(None);
    u.set_fragment(None);
    u.to_string()
}

/// Why the client cannot be set up.
#[derive(Debug, thiserror::Error)]
#[error("webhook: {0}")]
pub struct SetupError(String);

/// A record on its way.
struct Job<T> {
    record: Record<()>,
    token: T,
    permit: Permit,
}

/// POSTs records; their reports arrive on [`Answers`].
pub struct Publisher<T> {
    admission: Admission,
    jobs: mpsc::UnboundedSender<Job<T>>,
    shown: String,
}

/// Each record's report, once.
pub struct Answers<T> {
    reports: mpsc::UnboundedReceiver<Report<T>>,
}

impl<T> std::fmt::Debug for Publisher<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("url", &self.shown)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Publisher<T> {
    /// Sets up the client and the task that sends; nothing is sent yet
    /// (an endpoint has no handshake: the first request tells).
    pub fn new(config: WebhookConfig) -> Result<(Publisher<T>, Answers<T>), SetupError> {
        let mut http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout);
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| SetupError(format!("webhook.ca_file {}: {e}", path.display())))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                SetupError(format!(
                    "webhook.ca_file {}: not PEM certificates: {e}",
                    path.display()
                ))
            })?;
            http = http.tls_certs_only(certs);
        }
        let http = http
            .build()
            .map_err(|e| SetupError(format!("cannot set up the HTTP client: {e}")))?;
        let (jobs, rx) = mpsc::unbounded_channel();
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let shown = shown(&config.url);
        let dispatcher = Dispatcher {
            sender: Arc::new(Sender {
                http,
                url: config.url.clone(),
                secret: config.secret.clone(),
                shown: shown.clone(),
            }),
            concurrency: config.concurrency.max(1),
            reports: reports_tx,
        };
        tokio::spawn(dispatcher.run(rx));
        Ok((
            Publisher {
                admission: Admission::new(config.max_in_flight, config.max_in_flight_bytes),
                jobs,
                shown,
            },
            Answers { reports },
        ))
    }

    /// The endpoint, as shown.
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// Waits up to `within` for what is in flight to be answered; returns
    /// how many were not.
    pub async fn close(self, within: Duration) -> usize {
        self.admission
            .drained(tokio::time::Instant::now() + within)
            .await
    }
}

impl<T: Send + 'static> Destination<T> for Publisher<T> {
    fn admission(&self) -> &Admission {
        &self.admission
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        let (record, token) = record.split_token();
        let _ = self.jobs.send(Job {
            record,
            token,
            permit,
        });
    }
}

impl<T: Send + 'static> Deliveries<T> for Answers<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        self.reports.recv().await
    }
}

/// Sends one request, as often as it takes.
struct Sender {
    http: reqwest::Client,
    url: url::Url,
    secret: Option<String>,
    shown: String,
}

/// What one POST came to.
enum Outcome {
    Delivered(u16),
    /// This event, for good: the failure policy's.
    Refused(String),
    /// Every event, for good (TLS cannot verify the endpoint): stop.
    Broken(String),
    Again(String),
}

impl Sender {
    /// POSTs `record` until it is answered 2xx or refused for good.
    async fn deliver(&self, record: &Record<()>) -> Result<u16, (DeliveryErrorKind, String)> {
        let mut backoff = FIRST_BACKOFF;
        let mut warned = false;
        loop {
            match self.post(record).await {
                Outcome::Delivered(status) => return Ok(status),
                Outcome::Refused(why) => return Err((DeliveryErrorKind::Permanent, why)),
                Outcome::Broken(why) => return Err((DeliveryErrorKind::Fatal, why)),
                Outcome::Again(why) => {
                    if !warned {
                        tracing::warn!(url = %self.shown, error = %why, "webhook not answered; trying again until it is");
                        warned = true;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn post(&self, record: &Record<()>) -> Outcome {
        let body = record.value.clone().unwrap_or_default();
        let mut request = self
            .http
            .post(self.url.clone())
            .header("content-type", "application/json")
            .header("walbox-topic", record.topic.as_ref());
        if let Some(key) = &record.key {
            match std::str::from_utf8(key) {
                Ok(k) => request = request.header("walbox-key", k),
                Err(_) => {
                    return Outcome::Refused(
                        "the key is not UTF-8 text, which an HTTP header needs".into(),
                    )
                }
            }
        }
        if let Some(origin) = &record.origin {
            request = request.header("idempotency-key", origin.dedup_id());
        }
        for h in &record.headers {
            let name = format!("walbox-header-{}", h.name);
            let value = match reqwest::header::HeaderValue::from_bytes(&h.value) {
                Ok(v) => v,
                Err(_) => {
                    return Outcome::Refused(format!(
                    "header {:?}: not a value HTTP can carry (a line break or a control character)",
                    h.name
                ))
                }
            };
            match reqwest::header::HeaderName::from_bytes(name.as_bytes()) {
                Ok(n) => request = request.header(n, value),
                Err(_) => {
                    return Outcome::Refused(format!(
                        "header name {:?}: not an HTTP header name",
                        h.name
                    ))
                }
            }
        }
        if let Some(secret) = &self.secret {
            request = request.header("walbox-signature", signature(secret, now_s(), &body));
        }
        match request.body(body).send().await {
            Err(e) => {
                let why = without_url(&e);
                match tls_refusal(&why) {
                    Some(fix) => {
                        Outcome::Broken(format!("the webhook at {}: TLS: {why}: {fix}", self.shown))
                    }
                    None => Outcome::Again(why),
                }
            }
            Ok(response) => {
                let status = response.status().as_u16();
                match status {
                    200..=299 => Outcome::Delivered(status),
                    408 | 425 | 429 => Outcome::Again(format!("HTTP {status}")),
                    400..=499 => {
                        let text = response.text().await.unwrap_or_default();
                        let text: String =
                            text.chars().filter(|c| !c.is_control()).take(200).collect();
                        Outcome::Refused(format!(
                            "the webhook refused the event (HTTP {status}): {text}"
                        ))
                    }
                    _ => Outcome::Again(format!("HTTP {status}")),
                }
            }
        }
    }
}

/// What to check when a request failed because TLS cannot verify the
/// endpoint (rustls' words in `detail`); `None` for anything else.
fn tls_refusal(detail: &str) -> Option<&'static str> {
    if detail.contains("invalid peer certificate") {
        Some("the endpoint's certificate is not trusted or not for its host: check webhook.ca_file (the CA that signed it) and that the URL's host is a name the certificate carries")
    } else if detail.contains("InvalidContentType") || detail.contains("corrupt message") {
        Some("the endpoint does not speak TLS on this port: should the URL be http://?")
    } else {
        None
    }
}

/// reqwest's error with its causes (reqwest shows only "error sending
/// request"), without the URL it names (its query may hold a token).
fn without_url(e: &reqwest::Error) -> String {
    let mut e = {
        let mut text = e.to_string();
        let mut cause = std::error::Error::source(e);
        while let Some(c) = cause {
            let shown = c.to_string();
            if !text.contains(&shown) {
                text = format!("{text}: {shown}");
            }
            cause = c.source();
        }
        text
    };
    if let Some(start) = e.find(" for url (") {
        if let Some(end) = e[start..].find(')') {
            e.replace_range(start..start + end + 1, "");
        }
    }
    e
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `t=<t>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
pub fn signature(secret: &str, t: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={hex}")
}

/// Keeps one request in flight per key, `concurrency` keys at once.
struct Dispatcher<T> {
    sender: Arc<Sender>,
    concurrency: usize,
    reports: mpsc::UnboundedSender<Report<T>>,
}

impl<T: Send + 'static> Dispatcher<T> {
    /// Until the publisher is gone: then the requests still out (an
    /// endpoint being retried) are dropped with it, not left retrying.
    async fn run(self, mut jobs: mpsc::UnboundedReceiver<Job<T>>) {
        // Each key's waiting jobs; `out` the requests out, each giving back
        // its key; `ready` the keys with jobs waiting and none out, in
        // arrival order.
        let mut waiting: HashMap<Bytes, VecDeque<Job<T>>> = HashMap::new();
        let mut active: HashSet<Bytes> = HashSet::new();
        let mut ready: VecDeque<Bytes> = VecDeque::new();
        let mut out: tokio::task::JoinSet<Bytes> = tokio::task::JoinSet::new();
        loop {
            while active.len() < self.concurrency {
                let Some(key) = ready.pop_front() else { break };
                let job = waiting
                    .get_mut(&key)
                    .and_then(VecDeque::pop_front)
                    .expect("a ready key has a job");
                active.insert(key.clone());
                let (sender, reports) = (Arc::clone(&self.sender), self.reports.clone());
                out.spawn(async move {
                    let result = sender.deliver(&job.record).await;
                    let report = match result {
                        Ok(status) => Report::delivered(job.token, Delivered::Http { status }),
                        Err((kind, why)) => Report::failed(job.token, kind, why, job.record),
                    };
                    drop(job.permit);
                    let _ = reports.send(report);
                    key
                });
            }
            tokio::select! {
                job = jobs.recv() => match job {
                    Some(job) => {
                        let key = job.record.key.clone().unwrap_or_default();
                        let queue = waiting.entry(key.clone()).or_default();
                        queue.push_back(job);
                        // Its first job, and nothing of it out: its turn
                        // comes in arrival order.
                        if queue.len() == 1 && !active.contains(&key) {
                            ready.push_back(key);
                        }
                    }
                    // The publisher is gone: `out` aborts what is left.
                    None => return,
                },
                Some(done) = out.join_next(), if !out.is_empty() => {
                    let Ok(key) = done else { continue };
                    active.remove(&key);
                    if waiting.get(&key).is_some_and(|q| !q.is_empty()) {
                        ready.push_back(key);
                    } else {
                        waiting.remove(&key);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_an_hmac_of_time_and_body() {
        // hmac.new(b"k", b"1700000000.{}", hashlib.sha256).hexdigest(),
        // by Python's standard library.
        assert_eq!(
            signature("k", 1_700_000_000, b"{}"),
            "t=1700000000,v1=c6ef4734033cee2367414a0939385eca0397754aa7a59716da7463a9298b5146"
        );
        assert_ne!(signature("k", 1, b"{}"), signature("k", 2, b"{}"));
    }

    /// An endpoint that answers every request 503 and counts them.
    async fn always_busy() -> (url::Url, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url =
            url::Url::parse(&format!("http://{}/hook", listener.local_addr().unwrap())).unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&count);
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let counted = Arc::clone(&counted);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let reply =
                            b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";
                        if socket.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, count)
    }

    #[tokio::test]
    async fn a_busy_endpoint_is_retried_until_the_publisher_is_gone() {
        let (url, count) = always_busy().await;
        let config = WebhookConfig {
            url,
            secret: None,
            ca_file: None,
            timeout: Duration::from_secs(5),
            concurrency: 4,
            max_in_flight: 10,
            max_in_flight_bytes: 1 << 20,
        };
        let (publisher, answers) = Publisher::<u32>::new(config).unwrap();
        let permit = publisher.reserve(10).await;
        publisher
            .send(
                permit,
                Record::new("t", None, Some(Bytes::from_static(b"{}")), 1),
            )
            .await;
        let seen = || count.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..100 {
            if seen() >= 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(seen() >= 2, "retried: {} requests", seen());
        assert_eq!(
            publisher.close(Duration::from_millis(10)).await,
            1,
            "not answered"
        );
        drop(answers);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let then = seen();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(seen(), then, "still retrying after the publisher is gone");
    }

    #[test]
    fn the_shown_url_holds_no_token() {
        let u = url::Url::parse("https://user:Zq9pw@hooks.example/outbox?token=Zq9tok").unwrap();
        assert_eq!(shown(&u), "https://hooks.example/outbox");
    }
}
