//! Producer settings: the ones the delivery contract depends on, and the
//! operator's own, passed through to librdkafka.

use std::collections::BTreeMap;
use std::fmt;

use rdkafka::producer::BaseProducer;

/// Settings walbox applies to every producer unless the operator overrides
/// them, with the reason for each.
///
/// * `acks=all`, `enable.idempotence=true`: an acknowledged message is on every
///   in-sync replica, and retries neither duplicate nor reorder within a partition.
/// * `message.timeout.ms=0` (infinite): a long broker outage stalls the relay
///   instead of failing deliveries. The outbox in Postgres is the buffer; a
///   stalled relay is correct, a dropped event is not.
/// * `compression.type=lz4`: cheap compression.
/// * `linger.ms=1`: a request waits at most 1 ms for more messages. Measured
///   (docs/benchmarks.md): against librdkafka's 5, it takes ~4 ms off the
///   median commit-to-ack of a live stream (2.8–3.0 ms against 5.8–7.3 ms)
///   and brings the p99 at 5,000 events/s in transactions of 10 under 10 ms,
///   while a backlog drain costs no more CPU per event and goes no slower:
///   while requests are in flight, messages accumulate into full batches
///   anyway.
/// * `partitioner=murmur2_random`: a key lands on the partition the Java
///   client (Debezium, Kafka Connect, any JVM producer) would choose, so
///   switching to walbox keeps every aggregate on its partition. librdkafka's
///   own default (`consistent_random`, CRC32) would move them.
pub fn contract_defaults() -> Vec<(&'static str, &'static str)> {
    vec![
        ("acks", "all"),
        ("enable.idempotence", "true"),
        ("message.timeout.ms", "0"),
        ("compression.type", "lz4"),
        ("linger.ms", "1"),
        ("partitioner", "murmur2_random"),
    ]
}

/// Settings an operator may not override, because the guarantees rely on them.
pub const CONTRACT_PINNED: &[&str] = &["acks", "enable.idempotence"];

/// librdkafka's property for "a failed batch stops the producer".
const GAPLESS: &str = "enable.gapless.guarantee";

/// librdkafka's property that makes a producer transactional.
const TRANSACTIONAL_ID: &str = "transactional.id";

/// librdkafka's default `message.max.bytes`.
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// Configuration of a [`crate::Sink`].
#[derive(Clone)]
pub struct SinkConfig {
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// Any other librdkafka producer property (security: `security.protocol`,
    /// `sasl.mechanism`, `sasl.username`, `sasl.password`, `ssl.ca.location`, …).
    /// Applied over [`contract_defaults`]; [`CONTRACT_PINNED`] keys are refused.
    pub properties: BTreeMap<String, String>,
    /// Most records sent and not yet reported back to the caller.
    pub max_in_flight: usize,
    /// Most bytes (key, value, headers) in flight.
    pub max_in_flight_bytes: usize,
    /// After a record fails for good, write nothing more: later records are
    /// reported [`crate::DeliveryErrorKind::Withheld`], and librdkafka's
    /// `enable.gapless.guarantee` stops the producer rather than let records
    /// already on the wire close the gap. On (the default) whenever a failed
    /// record halts the caller: otherwise later records of its partition
    /// would be stored before it is ever sent again. Off when failed records
    /// go elsewhere (a dead-letter topic) and the stream goes on.
    pub gapless: bool,
    /// Create a topic the broker does not know, like this; `None`: a
    /// missing topic is waited for briefly, then refused.
    pub create_topics: Option<TopicSpec>,
    /// Make the producer transactional with this `transactional.id` (see
    /// `transaction.rs`). Records then carry no `message.timeout.ms` of
    /// their own: librdkafka bounds them by `transaction.timeout.ms`, and a
    /// record that times out aborts its transaction (to be written again)
    /// rather than stalling it past the coordinator's patience.
    /// [`SinkConfig::gapless`] does not apply: a failed record fails its
    /// whole transaction.
    pub transactional_id: Option<String>,
    /// The AWS region of the MSK cluster, for `sasl.mechanism = AWS_MSK_IAM`
    /// (see `msk_iam.rs`); `None`: the region in the brokers' MSK host
    /// names, else the AWS SDK's (`AWS_REGION`, the profile).
    pub aws_region: Option<String>,
    /// `AWS_MSK_IAM`'s token maker, made on first use and shared by every
    /// clone of this configuration: one credential resolver (its thread,
    /// its cached credentials) for all the clients made from it.
    msk_tokens: std::sync::Arc<std::sync::Mutex<Option<std::sync::Arc<crate::msk_iam::Tokens>>>>,
}

/// How the sink creates a missing topic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopicSpec {
    /// Partitions; `None` for the broker's `num.partitions`.
    pub partitions: Option<i32>,
    /// Replication factor; `None` for the broker's `default.replication.factor`.
    pub replication_factor: Option<i32>,
    /// Topic configuration (`retention.ms`, `min.insync.replicas`, …).
    pub config: BTreeMap<String, String>,
}

impl SinkConfig {
    /// Defaults for `bootstrap_servers`: 10,000 records / 8 MiB in flight
    /// (walbox's defaults).
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        SinkConfig {
            bootstrap_servers: bootstrap_servers.into(),
            properties: BTreeMap::new(),
            max_in_flight: 10_000,
            max_in_flight_bytes: 8 * 1024 * 1024,
            gapless: true,
            create_topics: None,
            transactional_id: None,
            aws_region: None,
            msk_tokens: std::sync::Arc::default(),
        }
    }

    /// Sets a librdkafka property.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.insert(key.into(), value.into());
        self
    }

    /// The producer's `message.max.bytes`.
    pub fn message_max_bytes(&self) -> usize {
        self.properties
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES)
    }

    /// `text` with the value of every secret property replaced by
    /// `<redacted>`: for anything built from librdkafka's own messages.
    pub fn redact(&self, text: &str) -> String {
        redact_userinfo(&redact_values(text, &self.secret_values()))
    }

    /// The values of the secret properties (see [`is_secret_property`]).
    pub(crate) fn secret_values(&self) -> Vec<String> {
        self.properties
            .iter()
            .filter(|(k, v)| is_secret_property(k) && !v.is_empty())
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Checks everything the producer would be created with, without
    /// connecting: walbox's own rules ([`CONTRACT_PINNED`] and the
    /// properties it sets itself), then librdkafka's: each property known,
    /// each value of its type and range, on a configuration made in memory;
    /// then the checks librdkafka makes only as a client is made
    /// (idempotence against `max.in.flight…`, a SASL mechanism this build
    /// lacks, PLAIN without its password), on a producer made with no
    /// broker to connect to and dropped. `walbox config` and `walbox run`
    /// refuse the same configurations with the same words.
    pub fn validate(&self) -> Result<(), crate::SinkError> {
        let mut c = self.client_config()?;
        c.create_native_config()
            .map(drop)
            .map_err(|e| crate::SinkError::Config(self.refusal(&e)))?;
        c.set("bootstrap.servers", "");
        let made = if self.msk_iam() {
            c.create_with_context::<_, BaseProducer<Offline<true>>>(Offline)
                .map(drop)
        } else {
            c.create_with_context::<_, BaseProducer<Offline<false>>>(Offline)
                .map(drop)
        };
        made.map_err(|e| crate::SinkError::Config(self.refusal(&e)))
    }

    /// librdkafka's refusal of this configuration, naming the property but
    /// never its value (rdkafka's own text ends with the value), secrets
    /// redacted from the rest.
    pub(crate) fn refusal(&self, error: &rdkafka::error::KafkaError) -> String {
        let text = match error {
            rdkafka::error::KafkaError::ClientConfig(_, description, key, _value) => {
                let description = description.replace(&format!(" {key}"), "");
                format!("{description} (property {key})")
            }
            rdkafka::error::KafkaError::ClientCreation(text) => text.clone(),
            other => {
                let text = other.to_string();
                // OpenSSL's words for a key it could not decrypt.
                if text.contains("ssl.key.location") && text.contains("PEM lib") {
                    format!("{text} (a wrong ssl.key.password, or a key file that is not PEM)")
                } else {
                    text
                }
            }
        };
        self.redact(&text)
    }

    /// The librdkafka properties walbox sets itself, as the producer gets
    /// them: the contract defaults the operator did not override, the
    /// gapless and transactional settings, the queue limits derived from
    /// the in-flight bounds (not `bootstrap.servers`, nor the operator's
    /// own properties). What `walbox config` shows as walbox's.
    pub fn walbox_properties(&self) -> Result<Vec<(String, String)>, crate::SinkError> {
        let c = self.client_config()?;
        Ok(c.config_map()
            .into_iter()
            .filter(|(k, _)| *k != "bootstrap.servers" && !self.properties.contains_key(*k))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect())
    }

    /// The full librdkafka configuration: contract defaults, the operator's
    /// properties, and queue limits sized so the in-flight bounds, not the
    /// producer queue, are what fill up.
    pub(crate) fn client_config(&self) -> Result<rdkafka::ClientConfig, crate::SinkError> {
        if let Some(key) = CONTRACT_PINNED
            .iter()
            .find(|k| self.properties.contains_key(**k))
        {
            let value = &self.properties[*key];
            let default = contract_defaults()
                .into_iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v);
            if Some(value.as_str()) != default {
                return Err(crate::SinkError::Config(format!(
                    "{key}={value} would break walbox's delivery guarantees; it is fixed at {}",
                    default.unwrap_or("?")
                )));
            }
        }
        if self.properties.contains_key(GAPLESS) {
            return Err(crate::SinkError::Config(format!(
                "{GAPLESS} is set by walbox: on without a dead-letter topic, off with one"
            )));
        }
        if self.properties.contains_key("bootstrap.servers") {
            return Err(crate::SinkError::Config(
                "bootstrap.servers is kafka.brokers (WALBOX_KAFKA_BROKERS, --kafka-brokers): give the brokers there, not as a property (which would override it)".into(),
            ));
        }
        if self.properties.contains_key(TRANSACTIONAL_ID) {
            return Err(crate::SinkError::Config(format!(
                "{TRANSACTIONAL_ID} is set by walbox from its transactions settings"
            )));
        }
        self.check_sasl_credentials()?;
        if self.max_in_flight == 0 || self.max_in_flight_bytes == 0 {
            return Err(crate::SinkError::Config(
                "max in-flight records and bytes must be above 0".into(),
            ));
        }
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers);
        for (k, v) in contract_defaults() {
            if k == "message.timeout.ms" && self.transactional_id.is_some() {
                continue;
            }
            c.set(k, v);
        }
        match &self.transactional_id {
            Some(id) => {
                c.set(TRANSACTIONAL_ID, id);
                c.set(GAPLESS, "false");
            }
            None => {
                c.set(GAPLESS, if self.gapless { "true" } else { "false" });
            }
        }
        // Room for everything the sink lets into flight, twice over.
        c.set(
            "queue.buffering.max.messages",
            (self.max_in_flight * 2 + 16).min(2_147_483_647).to_string(),
        );
        c.set(
            "queue.buffering.max.kbytes",
            ((self.max_in_flight_bytes * 2) / 1024 + 1024)
                .min(2_147_483_647)
                .to_string(),
        );
        // For the queue and round-trip metrics (the operator may change it).
        c.set(
            "statistics.interval.ms",
            crate::stats::STATISTICS_INTERVAL_MS,
        );
        for (k, v) in &self.properties {
            c.set(k, v);
        }
        self.check_msk_iam()?;
        self.translate_msk_iam(&mut c);
        Ok(c)
    }

    /// True with `sasl.mechanism = AWS_MSK_IAM`.
    pub fn msk_iam(&self) -> bool {
        self.properties
            .get(SASL_MECHANISM)
            .is_some_and(|m| m.eq_ignore_ascii_case(crate::msk_iam::MECHANISM))
    }

    /// The settings `AWS_MSK_IAM` cannot go with.
    fn check_msk_iam(&self) -> Result<(), crate::SinkError> {
        if !self.msk_iam() {
            return Ok(());
        }
        match self.properties.get(SECURITY_PROTOCOL).map(|p| p.to_ascii_uppercase()) {
            None => {}
            Some(p) if p == "SASL_SSL" || p == "SASL_PLAINTEXT" => {}
            Some(p) => {
                return Err(crate::SinkError::Config(format!(
                    "sasl.mechanism = AWS_MSK_IAM needs security.protocol = SASL_SSL (MSK's IAM listener, port 9098), not {p}"
                )))
            }
        }
        if let Some(key) = [
            "sasl.username",
            "sasl.password",
            "sasl.oauthbearer.method",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.token.endpoint.url",
            "sasl.oauthbearer.client.id",
            "sasl.oauthbearer.client.secret",
            "enable.sasl.oauthbearer.unsecure.jwt",
        ]
        .into_iter()
        .find(|k| self.properties.contains_key(*k))
        {
            return Err(crate::SinkError::Config(format!(
                "{key} contradicts sasl.mechanism = AWS_MSK_IAM (the token is signed with AWS credentials): remove it"
            )));
        }
        if let Some(region) = &self.aws_region {
            let valid = !region.is_empty()
                && region
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid {
                return Err(crate::SinkError::Config(format!(
                    "kafka.aws_region {region:?}: expected a region name such as eu-west-1"
                )));
            }
        }
        Ok(())
    }

    /// `AWS_MSK_IAM` as librdkafka has it: OAUTHBEARER with tokens from
    /// walbox, over TLS unless the operator said otherwise.
    pub(crate) fn translate_msk_iam(&self, c: &mut rdkafka::ClientConfig) {
        if self.msk_iam() {
            c.set(SASL_MECHANISM, "OAUTHBEARER");
            if !self.properties.contains_key(SECURITY_PROTOCOL) {
                c.set(SECURITY_PROTOCOL, "SASL_SSL");
            }
        }
    }

    /// The SASL mechanism is one librdkafka has (else it is found only as
    /// it connects), and PLAIN and SCRAM have a user name and a password
    /// (the same): refusals, rather than a crash loop.
    fn check_sasl_credentials(&self) -> Result<(), crate::SinkError> {
        /// What this build speaks (librdkafka compares them as written).
        const MECHANISMS: [&str; 5] = [
            "GSSAPI",
            "PLAIN",
            "SCRAM-SHA-256",
            "SCRAM-SHA-512",
            "OAUTHBEARER",
        ];
        let get = |k: &str| self.properties.get(k).filter(|v| !v.is_empty());
        let sasl =
            get(SECURITY_PROTOCOL).is_some_and(|p| p.to_ascii_uppercase().starts_with("SASL_"));
        if !sasl || self.msk_iam() {
            return Ok(());
        }
        let mechanism = get(SASL_MECHANISM)
            .or_else(|| get("sasl.mechanisms"))
            .map_or("GSSAPI", |m| m.as_str());
        if !MECHANISMS.contains(&mechanism) {
            return Err(crate::SinkError::Config(format!(
                "sasl.mechanism={mechanism} is not one of {}, {} (written in capitals)",
                MECHANISMS.join(", "),
                crate::msk_iam::MECHANISM
            )));
        }
        if !(mechanism == "PLAIN" || mechanism.starts_with("SCRAM-")) {
            return Ok(());
        }
        let missing: Vec<&str> = ["sasl.username", "sasl.password"]
            .into_iter()
            .filter(|k| get(k).is_none())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(crate::SinkError::Config(format!(
            "sasl.mechanism={mechanism} needs {} (a password is best kept in a file: WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE)",
            missing.join(" and ")
        )))
    }

    /// The token maker of `AWS_MSK_IAM`, if that is the mechanism.
    pub(crate) fn tokens(
        &self,
    ) -> Result<Option<std::sync::Arc<crate::msk_iam::Tokens>>, crate::SinkError> {
        if !self.msk_iam() {
            return Ok(None);
        }
        let region = self
            .aws_region
            .clone()
            .or_else(|| crate::msk_iam::region_of_brokers(&self.bootstrap_servers));
        let mut shared = self.msk_tokens.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tokens) = shared.as_ref().filter(|t| t.region() == region.as_deref()) {
            return Ok(Some(std::sync::Arc::clone(tokens)));
        }
        let tokens = crate::msk_iam::Tokens::new(region).map_err(crate::SinkError::Config)?;
        *shared = Some(std::sync::Arc::clone(&tokens));
        Ok(Some(tokens))
    }
}

/// The context of a producer made only to be checked: its log lines (the
/// missing brokers) are not walbox's to show. `TOKENS`: it answers token
/// refreshes, as the real producer does with `AWS_MSK_IAM`.
struct Offline<const TOKENS: bool>;

impl<const TOKENS: bool> rdkafka::ClientContext for Offline<TOKENS> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = TOKENS;

    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, _: &str, _: &str) {}

    fn generate_oauth_token(
        &self,
        _: Option<&str>,
    ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
        Err("not connecting".into())
    }
}

impl<const TOKENS: bool> rdkafka::producer::ProducerContext for Offline<TOKENS> {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: ()) {}
}

const SASL_MECHANISM: &str = "sasl.mechanism";
const SECURITY_PROTOCOL: &str = "security.protocol";

/// True for librdkafka property names whose values are secrets (passwords,
/// client secrets, tokens, key material, SASL/JAAS and OAUTHBEARER
/// configuration): never shown. A name mistyped is judged by what it looks
/// like (`sasl.passwd`, `sasl.pwd`), and every `sasl.*` property but the
/// ones known to hold no secret is one.
pub fn is_secret_property(key: &str) -> bool {
    /// `sasl.*` properties known to hold no secret.
    const PUBLIC_SASL: [&str; 12] = [
        "sasl.mechanism",
        "sasl.mechanisms",
        "sasl.username",
        "sasl.kerberos.service.name",
        "sasl.kerberos.principal",
        "sasl.kerberos.kinit.cmd",
        "sasl.kerberos.min.time.before.relogin",
        "sasl.oauthbearer.method",
        "sasl.oauthbearer.client.id",
        "sasl.oauthbearer.scope",
        "sasl.oauthbearer.token.endpoint.url",
        "sasl.oauthbearer.sub.claim.name",
    ];
    let k = key.to_ascii_lowercase();
    k.contains("pass")
        || k.contains("pwd")
        || k.contains("secret")
        || k.contains("token") && k != "sasl.oauthbearer.token.endpoint.url"
        || k.contains("credential")
        || k.contains("jaas")
        || k.starts_with("sasl.") && !PUBLIC_SASL.contains(&k.as_str())
        || k.starts_with("ssl.key.") && k != "ssl.key.location"
        || k.ends_with("key.pem")
        || k.ends_with(".key")
        || k.contains("keystore")
}

/// `text` with the user information of every URL in it (`user:password@`
/// between `scheme://` and the host) replaced by `<redacted>@`:
/// `http://walbox:s3cret@collector:4318` is shown as
/// `http://<redacted>@collector:4318`.
pub fn redact_userinfo(text: &str) -> String {
    redact_authorities(text, |_| true)
}

/// [`redact_userinfo`] for the user information that holds a password
/// only: a user's name alone stays (`amqps://walbox@rmq`). What walbox's
/// output passes through, where secrets without a colon (a NATS token) are
/// known by value.
pub fn redact_url_passwords(text: &str) -> String {
    redact_authorities(text, |userinfo| userinfo.contains(':'))
}

/// `text` with the user information of each URL for which `secret` holds
/// replaced by `<redacted>`.
fn redact_authorities(text: &str, secret: impl Fn(&str) -> bool) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // The authority ends at the path, query, fragment, a quote or the
        // text's end.
        let end = tail
            .find(|c: char| matches!(c, '/' | '?' | '#' | '"' | '\'') || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) if secret(&authority[..at]) => {
                out.push_str("<redacted>");
                out.push_str(&authority[at..]);
            }
            _ => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// `text` with each of `secrets` replaced by `<redacted>`.
pub(crate) fn redact_values(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_owned();
    for s in secrets {
        if !s.is_empty() && out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "<redacted>");
        }
    }
    out
}

impl fmt::Debug for SinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let props: BTreeMap<&str, String> = self
            .properties
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str(),
                    if is_secret_property(k) {
                        "<redacted>".to_owned()
                    } else {
                        redact_userinfo(v)
                    },
                )
            })
            .collect();
        f.debug_struct("SinkConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("properties", &props)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_in_flight_bytes", &self.max_in_flight_bytes)
            .field("gapless", &self.gapless)
            .field("create_topics", &self.create_topics)
            .field("transactional_id", &self.transactional_id)
            .field("aws_region", &self.aws_region)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_msk_iam_is_oauthbearer_over_tls_with_nothing_contradicting_it() {
        let msk = SinkConfig::new("b-1.x.c2.kafka.eu-west-1.amazonaws.com:9098")
            .set("sasl.mechanism", "AWS_MSK_IAM");
        assert!(msk.msk_iam());
        let c = msk.client_config().unwrap();
        assert_eq!(c.get("sasl.mechanism"), Some("OAUTHBEARER"));
        assert_eq!(c.get("security.protocol"), Some("SASL_SSL"));
        let c = msk.connection_config();
        assert_eq!(c.get("sasl.mechanism"), Some("OAUTHBEARER"));
        assert_eq!(c.get("security.protocol"), Some("SASL_SSL"));
        msk.validate().unwrap();
        // An operator's SASL_PLAINTEXT (a local proxy) is kept.
        let plain = msk.clone().set("security.protocol", "SASL_PLAINTEXT");
        let c = plain.client_config().unwrap();
        assert_eq!(c.get("security.protocol"), Some("SASL_PLAINTEXT"));
        for (key, value, says) in [
            (
                "security.protocol",
                "SSL",
                "needs security.protocol = SASL_SSL",
            ),
            (
                "security.protocol",
                "PLAINTEXT",
                "needs security.protocol = SASL_SSL",
            ),
            (
                "sasl.username",
                "walbox",
                "sasl.username contradicts sasl.mechanism = AWS_MSK_IAM",
            ),
            (
                "sasl.oauthbearer.method",
                "oidc",
                "sasl.oauthbearer.method contradicts",
            ),
        ] {
            let e = msk
                .clone()
                .set(key, value)
                .validate()
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{key}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        let mut bad = msk.clone();
        bad.aws_region = Some("eu west 1".into());
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("kafka.aws_region \"eu west 1\""));
        // Other mechanisms are left as they are.
        let scram = SinkConfig::new("k:9092").set("sasl.mechanism", "SCRAM-SHA-512");
        assert!(!scram.msk_iam());
        assert_eq!(
            scram.client_config().unwrap().get("sasl.mechanism"),
            Some("SCRAM-SHA-512")
        );
    }

    #[test]
    fn clones_of_a_configuration_share_one_token_maker() {
        let msk = SinkConfig::new("b-1.x.c2.kafka.eu-west-1.amazonaws.com:9098")
            .set("sasl.mechanism", "AWS_MSK_IAM");
        let mut clone = msk.clone();
        clone.transactional_id = Some("t".into());
        let (a, b) = (
            msk.tokens().unwrap().unwrap(),
            clone.tokens().unwrap().unwrap(),
        );
        assert!(std::sync::Arc::ptr_eq(&a, &b), "one credential resolver");
        assert_eq!(a.region(), Some("eu-west-1"));
        let mut other = msk.clone();
        other.aws_region = Some("us-east-1".into());
        let c = other.tokens().unwrap().unwrap();
        assert_eq!(c.region(), Some("us-east-1"));
        assert!(SinkConfig::new("k:9092").tokens().unwrap().is_none());
    }

    #[test]
    fn defaults_protect_the_contract() {
        let d = contract_defaults();
        let get = |k: &str| d.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
        assert_eq!(get("acks"), Some("all"));
        assert_eq!(get("enable.idempotence"), Some("true"));
        assert_eq!(get("message.timeout.ms"), Some("0"));
        for pinned in CONTRACT_PINNED {
            assert!(
                get(pinned).is_some(),
                "{pinned} is pinned but has no default"
            );
        }
    }

    #[test]
    fn pinned_settings_cannot_be_weakened() {
        let e = SinkConfig::new("b:9092")
            .set("acks", "1")
            .client_config()
            .unwrap_err();
        assert!(e.to_string().contains("acks=1 would break"), "{e}");
        assert!(SinkConfig::new("k:9092")
            .set("acks", "1")
            .validate()
            .is_err());
        assert!(SinkConfig::new("b:9092")
            .set("acks", "all")
            .client_config()
            .is_ok());
        let c = SinkConfig::new("b:9092")
            .set("linger.ms", "20")
            .client_config()
            .unwrap();
        assert_eq!(c.get("linger.ms"), Some("20"));
        assert_eq!(c.get("enable.idempotence"), Some("true"));
    }

    #[test]
    fn librdkafka_refusals_are_found_without_connecting() {
        SinkConfig::new("b:9092")
            .set("linger.ms", "5")
            .set("compression.type", "zstd")
            .validate()
            .unwrap();
        for (key, value, says) in [
            ("lingr.ms", "5", "lingr.ms"),
            ("batch.num.messages", "many", "batch.num.messages"),
            ("compression.type", "brotli", "compression.type"),
            ("security.protocol", "TLS", "security.protocol"),
        ] {
            let e = SinkConfig::new("b:9092")
                .set(key, value)
                .set("sasl.password", "hunter2")
                .validate()
                .map_or_else(|e| e.to_string(), |()| "accepted".to_owned());
            assert!(
                e.contains(says) && !e.contains("hunter2"),
                "{key}={value}: {e}"
            );
        }
    }

    #[test]
    fn userinfo_is_redacted_in_every_url() {
        for (given, shown) in [
            (
                "http://user:s3cret@collector:4318/v1",
                "http://<redacted>@collector:4318/v1",
            ),
            (
                "https://id:p%40ss@idp.example/token?x=1",
                "https://<redacted>@idp.example/token?x=1",
            ),
            (
                "a http://u:p@h b https://h2/c",
                "a http://<redacted>@h b https://h2/c",
            ),
            ("http://collector:4318", "http://collector:4318"),
            (
                "postgres://walbox:pw@db/app",
                "postgres://<redacted>@db/app",
            ),
            ("no url", "no url"),
            ("://@", "://<redacted>@"),
        ] {
            assert_eq!(redact_userinfo(given), shown);
        }
    }

    #[test]
    fn walbox_properties_are_the_ones_it_sets() {
        let props = SinkConfig::new("b:9092")
            .set("linger.ms", "20")
            .walbox_properties()
            .unwrap();
        let get = |k: &str| {
            props
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("acks"), Some("all"));
        assert_eq!(get("enable.idempotence"), Some("true"));
        assert_eq!(get("partitioner"), Some("murmur2_random"));
        assert_eq!(get("enable.gapless.guarantee"), Some("true"));
        assert_eq!(get("linger.ms"), None, "the operator's own");
        assert_eq!(get("bootstrap.servers"), None);
    }

    #[test]
    fn debug_redacts_secrets() {
        let c = SinkConfig::new("b:9092")
            .set("sasl.password", "hunter2")
            .set("ssl.key.password", "hunter3")
            .set("sasl.username", "walbox");
        let text = format!("{c:?}");
        assert!(
            !text.contains("hunter2") && !text.contains("hunter3"),
            "{text}"
        );
        assert!(text.contains("walbox"));
    }
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    #[test]
    fn secret_properties_are_recognised() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "ssl.truststore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "sasl.oauthbearer.extensions",
            "sasl.jaas.config",
            "ssl.key.pem",
            "SASL.PASSWORD",
            // Mistyped names, judged by what they look like.
            "sasl.passwd",
            "sasl.pass",
            "sasl.pwd",
            "sasl.secret",
            "ssl.key.passphrase",
        ] {
            assert!(is_secret_property(k), "{k}");
        }
        for k in [
            "sasl.username",
            "sasl.mechanism",
            "security.protocol",
            "ssl.ca.location",
            "ssl.key.location",
            "sasl.oauthbearer.client.id",
            "sasl.oauthbearer.token.endpoint.url",
            "partitioner",
        ] {
            assert!(!is_secret_property(k), "{k}");
        }
    }

    #[test]
    fn redaction_replaces_every_secret_value() {
        let c = SinkConfig::new("k:9092")
            .set("sasl.password", "hunter2")
            .set("ssl.key.password", "pw2")
            .set("sasl.username", "walbox");
        let r = c.redact("user walbox, password hunter2 and pw2, again hunter2");
        assert_eq!(
            r,
            "user walbox, password <redacted> and <redacted>, again <redacted>"
        );
    }

    #[test]
    fn the_java_compatible_partitioner_is_the_default_and_can_be_overridden() {
        let c = SinkConfig::new("k:9092").client_config().unwrap();
        assert_eq!(c.get("partitioner"), Some("murmur2_random"));
        let c = SinkConfig::new("k:9092")
            .set("partitioner", "consistent_random")
            .client_config()
            .unwrap();
        assert_eq!(c.get("partitioner"), Some("consistent_random"));
    }
}
