//! The registry's Confluent-compatible REST API: a subject's latest
//! version (`GET /subjects/{subject}/versions/latest`) and, for derived
//! schemas, registering one (`POST /subjects/{subject}/versions`), with
//! basic authentication and the CA to trust, each answer classified as an
//! outage (tried again) or a refusal (walbox stops).

use serde::Deserialize;

use super::{RegistryConfig, SchemaError, REQUEST_TIMEOUT};

/// Why rustls refused the registry's certificate, if that is why `error`
/// happened: no retry fixes it (the CA or the URL must change).
fn untrusted(error: &reqwest::Error) -> Option<String> {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = next {
        if let Some(rustls::Error::InvalidCertificate(why)) = e.downcast_ref::<rustls::Error>() {
            return Some(format!("{why:?}"));
        }
        // An io::Error hides the error it wraps from `source()` (and
        // reqwest's connector wraps one io::Error in another).
        next = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

/// The largest answer read: a schema larger than this is refused.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// A client of one registry.
#[derive(Clone)]
pub struct RegistryClient {
    http: reqwest::Client,
    base: String,
    username: Option<String>,
    password: Option<String>,
}

/// `GET /subjects/{subject}/versions/latest`'s answer.
#[derive(Deserialize)]
struct Version {
    id: u32,
    schema: String,
    /// Absent for Avro.
    #[serde(default, rename = "schemaType")]
    schema_type: Option<String>,
}

/// `POST /subjects/{subject}/versions`' answer.
#[derive(Deserialize)]
struct Id {
    id: u32,
}

/// What a request is, for its refusals.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Call {
    Latest,
    Register,
}

impl RegistryClient {
    /// A client of the configured registry.
    pub fn new(config: &RegistryConfig) -> Result<RegistryClient, SchemaError> {
        let mut http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT);
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path).map_err(|e| {
                SchemaError::Setup(format!("schema_registry.ca_file {}: {e}", path.display()))
            })?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem).map_err(|e| {
                SchemaError::Setup(format!(
                    "schema_registry.ca_file {}: not PEM certificates: {e}",
                    path.display()
                ))
            })?;
            http = http.tls_certs_only(certs);
        }
        let http = http
            .build()
            .map_err(|e| SchemaError::Setup(format!("cannot set up the HTTP client: {e}")))?;
        Ok(RegistryClient {
            http,
            base: config.url.trim_end_matches('/').to_owned(),
            username: config.username.clone(),
            password: config.password.clone(),
        })
    }

    /// The id, text and type (`schemaType`, absent for Avro) of
    /// `subject`'s latest schema.
    pub async fn latest(
        &self,
        subject: &str,
    ) -> Result<(u32, String, Option<String>), SchemaError> {
        match self.latest_if_any(subject).await? {
            Some(latest) => Ok(latest),
            None => Err(SchemaError::Refused {
                subject: subject.to_owned(),
                detail: "no schema is registered under this subject (HTTP 404): register it, or check schema_registry.subject_strategy and schema_registry.url".into(),
            }),
        }
    }

    /// [`RegistryClient::latest`], `None` when the subject has no schema.
    pub async fn latest_if_any(
        &self,
        subject: &str,
    ) -> Result<Option<(u32, String, Option<String>)>, SchemaError> {
        let url = format!(
            "{}/subjects/{}/versions/latest",
            self.base,
            path_segment(subject)
        );
        let request = self.http.get(&url);
        let Some(body) = self.call(subject, request, Call::Latest).await? else {
            return Ok(None);
        };
        let version: Version = serde_json::from_slice(&body).map_err(|e| SchemaError::Refused {
            subject: subject.to_owned(),
            detail: format!("the registry's answer is not a schema version: {e}"),
        })?;
        Ok(Some((version.id, version.schema, version.schema_type)))
    }

    /// Registers `schema` (of `schema_type`: AVRO, JSON) under `subject`;
    /// its id (the one it already had, when it was registered before).
    pub async fn register(
        &self,
        subject: &str,
        schema_type: &str,
        schema: &str,
    ) -> Result<u32, SchemaError> {
        let url = format!("{}/subjects/{}/versions", self.base, path_segment(subject));
        let body = serde_json::json!({"schemaType": schema_type, "schema": schema});
        let request = self
            .http
            .post(&url)
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/vnd.schemaregistry.v1+json",
            )
            .body(body.to_string());
        let refused = |detail: String| SchemaError::Refused {
            subject: subject.to_owned(),
            detail,
        };
        let Some(answer) = self.call(subject, request, Call::Register).await? else {
            return Err(refused(
                "the registry has no such API (HTTP 404 on registering): check schema_registry.url"
                    .into(),
            ));
        };
        let id: Id = serde_json::from_slice(&answer).map_err(|e| {
            refused(format!(
                "the registry's answer to a registration has no id: {e}"
            ))
        })?;
        Ok(id.id)
    }

    /// Sends `request`; its answer's body, `None` for a 404, or the outage
    /// or refusal its failure is.
    async fn call(
        &self,
        subject: &str,
        request: reqwest::RequestBuilder,
        call: Call,
    ) -> Result<Option<bytes::Bytes>, SchemaError> {
        let unavailable = |detail: String| SchemaError::Unavailable {
            subject: subject.to_owned(),
            detail,
        };
        let refused = |detail: String| SchemaError::Refused {
            subject: subject.to_owned(),
            detail,
        };
        let mut request = request.header(
            reqwest::header::ACCEPT,
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some(user) = &self.username {
            request = request.basic_auth(user, self.password.as_deref());
        }
        // reqwest's errors name the URL, which holds no secret (user
        // information in it is refused by the configuration).
        let response = request.send().await.map_err(|e| match untrusted(&e) {
            Some(why) => refused(format!(
                "the registry's TLS certificate is not trusted ({why}): check schema_registry.ca_file, and that the URL names a host the certificate is for"
            )),
            None => unavailable(crate::error_text::chain(&e)),
        })?;
        let status = response.status();
        if response
            .content_length()
            .is_some_and(|n| n > MAX_ANSWER_BYTES as u64)
        {
            return Err(refused(format!(
                "the registry's answer is larger than {MAX_ANSWER_BYTES} bytes"
            )));
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| unavailable(crate::error_text::chain(&e)))?;
        if body.len() > MAX_ANSWER_BYTES {
            return Err(refused(format!(
                "the registry's answer is larger than {MAX_ANSWER_BYTES} bytes"
            )));
        }
        let said = || {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]);
            text.split_whitespace().collect::<Vec<_>>().join(" ")
        };
        match status.as_u16() {
            200 => {}
            401 | 403 => {
                return Err(refused(format!(
                    "the registry refused access (HTTP {status}: {}): check schema_registry.username and password",
                    said()
                )))
            }
            404 => return Ok(None),
            409 if call == Call::Register => {
                return Err(refused(format!(
                    "the registry refused the schema walbox derived from this event as incompatible with the subject's earlier versions (HTTP 409: {}): its compatibility rule forbids what the event changed; relax the subject's rule, or register a schema and set schema_registry.schemas = \"registered\"",
                    said()
                )))
            }
            422 if call == Call::Register => {
                return Err(refused(format!(
                    "the registry refused the schema walbox derived as invalid (HTTP 422: {})",
                    said()
                )))
            }
            408 | 429 | 500..=599 => {
                return Err(unavailable(format!("HTTP {status}: {}", said())))
            }
            _ => return Err(refused(format!("HTTP {status}: {}", said()))),
        }
        Ok(Some(body))
    }
}

/// `subject` as one path segment: unreserved characters as they are, every
/// other byte percent-encoded.
fn path_segment(subject: &str) -> String {
    let mut out = String::with_capacity(subject.len());
    for b in subject.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_is_one_path_segment() {
        assert_eq!(path_segment("orders-value"), "orders-value");
        assert_eq!(path_segment("a/b c?é"), "a%2Fb%20c%3F%C3%A9");
    }

    #[tokio::test]
    async fn an_unreachable_registry_is_an_outage() {
        // A port nothing listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let client = RegistryClient::new(&RegistryConfig {
            url: format!("http://127.0.0.1:{port}"),
            username: Some("u".into()),
            password: Some("hunter2".into()),
            ca_file: None,
            strategy: Default::default(),
            kind: Default::default(),
            keys: false,
            derive: false,
        })
        .unwrap();
        let e = client.latest("t-value").await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert!(!e.to_string().contains("hunter2"));
    }
}
