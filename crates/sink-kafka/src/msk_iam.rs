//! Amazon MSK's IAM authentication (`sasl.mechanism = AWS_MSK_IAM`).
//!
//! MSK takes, as the OAUTHBEARER token, a SigV4-presigned URL for the action
//! `kafka-cluster:Connect`: `https://kafka.<region>.amazonaws.com/?Action=…`
//! signed for the service `kafka-cluster`, valid 15 minutes, with a
//! `User-Agent` parameter added after signing, encoded as unpadded base64url.
//! This is what AWS's own signer libraries (aws-msk-iam-sasl-signer for
//! Python, Go, JavaScript) send; the broker checks the signature with IAM
//! and the principal's `kafka-cluster:*` permissions.
//!
//! The credentials come from the AWS SDK's default chain: environment,
//! profiles (`AWS_PROFILE`, SSO, `credential_process`, assumed roles), web
//! identity (EKS' IRSA), the ECS container endpoint and EC2's instance
//! metadata. librdkafka asks for a token when it first connects and again at
//! 80% of its lifetime; each client walbox makes is also given one as it is
//! created ([`Tokens::prime`]), so it never waits for a poll to
//! authenticate.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use aws_credential_types::Credentials;
use base64::Engine;

/// The `sasl.mechanism` value that selects MSK IAM.
pub const MECHANISM: &str = "AWS_MSK_IAM";

/// How long a token is valid (the signers' own fixed choice).
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(900);

/// Tests only: tokens valid this many seconds instead, to see them
/// refreshed within a test.
const TEST_LIFETIME: &str = "WALBOX_TEST_MSK_TOKEN_SECONDS";

const SIGNING_NAME: &str = "kafka-cluster";
const ACTION: &str = "kafka-cluster:Connect";
const USER_AGENT: &str = concat!("walbox/", env!("CARGO_PKG_VERSION"));
/// The principal librdkafka records with the token (the broker takes its
/// own from the signature).
const PRINCIPAL: &str = "aws-msk-iam";

/// Credentials are resolved again when they expire within this, or when
/// they were resolved this long ago (a profile file may have changed).
const CREDENTIALS_REUSE: Duration = Duration::from_secs(300);
/// Most time resolving credentials may take (a metadata endpoint or STS
/// that does not answer).
const CREDENTIALS_TIMEOUT: Duration = Duration::from_secs(20);

/// A token and when it stops being valid.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthToken {
    /// The unpadded base64url of the presigned URL.
    pub token: String,
    /// Its expiry, in milliseconds since the Unix epoch.
    pub expires_ms: i64,
}

impl std::fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthToken")
            .field("token", &"<redacted>")
            .field("expires_ms", &self.expires_ms)
            .finish()
    }
}

/// The presigned URL MSK takes as a token, for `region`, signed with
/// `credentials` at `at`.
pub fn presigned_url(
    region: &str,
    credentials: &Credentials,
    at: SystemTime,
    lifetime: Duration,
    user_agent: &str,
) -> Result<String, String> {
    use aws_sigv4::http_request::{
        sign, SignableBody, SignableRequest, SignatureLocation, SigningSettings,
    };
    let host = format!("kafka.{region}.amazonaws.com");
    let action = format!("Action={}", percent_encode(ACTION));
    let url = format!("https://{host}/?{action}");
    let identity = credentials.clone().into();
    let mut settings = SigningSettings::default();
    settings.signature_location = SignatureLocation::QueryParams;
    settings.expires_in = Some(lifetime);
    let params = aws_sigv4::sign::v4::SigningParams::builder()
        .identity(&identity)
        .region(region)
        .name(SIGNING_NAME)
        .time(at)
        .settings(settings)
        .build()
        .map_err(|e| format!("sign the MSK token: {e}"))?
        .into();
    let request = SignableRequest::new(
        "GET",
        url.as_str(),
        std::iter::once(("host", host.as_str())),
        SignableBody::Bytes(&[]),
    )
    .map_err(|e| format!("sign the MSK token: {e}"))?;
    let (instructions, _) = sign(request, &params)
        .map_err(|e| format!("sign the MSK token: {e}"))?
        .into_parts();
    let mut out = url;
    for (name, value) in instructions.params() {
        out.push('&');
        out.push_str(name);
        out.push('=');
        out.push_str(&percent_encode(value));
    }
    out.push_str("&User-Agent=");
    out.push_str(&percent_encode(user_agent));
    Ok(out)
}

/// The token for `region` from `credentials` at `at`, valid `lifetime`:
/// the presigned URL in unpadded base64url, and its expiry.
pub fn auth_token(
    region: &str,
    credentials: &Credentials,
    at: SystemTime,
    lifetime: Duration,
) -> Result<AuthToken, String> {
    let url = presigned_url(region, credentials, at, lifetime, USER_AGENT)?;
    let signed_ms = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| "the clock is before 1970".to_owned())?
        .as_secs()
        * 1000;
    Ok(AuthToken {
        token: base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(url),
        expires_ms: i64::try_from(signed_ms + lifetime.as_millis() as u64).unwrap_or(i64::MAX),
    })
}

/// RFC 3986 encoding of everything but the unreserved characters, as
/// SigV4's canonical query string has it.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The AWS region in MSK broker host names
/// (`b-1.name.abc123.c2.kafka.eu-west-1.amazonaws.com:9098`, serverless
/// `boot-x.c1.kafka-serverless.eu-west-1.amazonaws.com`): the first host
/// that names one.
pub fn region_of_brokers(bootstrap_servers: &str) -> Option<String> {
    bootstrap_servers.split(',').find_map(|server| {
        let host = server.trim().rsplit_once(':').map_or(server, |(h, _)| h);
        let labels: Vec<&str> = host.split('.').collect();
        let n = labels.len();
        (n >= 4
            && labels[n - 2] == "amazonaws"
            && labels[n - 1] == "com"
            && matches!(labels[n - 4], "kafka" | "kafka-serverless")
            && !labels[n - 3].is_empty())
        .then(|| labels[n - 3].to_owned())
    })
}

/// Where the credentials and the region come from.
enum Source {
    /// The SDK's default chains, loaded on first use.
    Chain,
    /// A given provider (tests).
    #[cfg_attr(not(test), allow(dead_code))]
    Given(SharedCredentialsProvider),
}

/// A request for credentials, answered on `reply`: the region and the
/// credentials.
type Ask = std::sync::mpsc::Sender<Result<(String, Credentials), String>>;

/// Makes tokens for one sink's clients, from librdkafka's threads.
///
/// The AWS SDK's providers do their I/O (STS, the metadata endpoints) on a
/// runtime of their own, on a thread of their own: librdkafka asks for a
/// token from any thread, walbox's own runtime's included, which may be
/// the one thread that runtime has (a wait there for work it would have
/// to run itself never ends).
pub(crate) struct Tokens {
    /// The region from the settings or the brokers' names; else the SDK's
    /// region chain's.
    region: Option<String>,
    asks: tokio::sync::mpsc::UnboundedSender<Ask>,
    /// The last credentials, their region and when they were resolved.
    cached: Mutex<Option<(String, Credentials, SystemTime)>>,
    /// [`TOKEN_LIFETIME`], unless a test says otherwise.
    lifetime: Duration,
}

impl Tokens {
    /// Tokens for `region` (else the brokers' or the SDK's), from the
    /// default credential chain.
    pub(crate) fn new(region: Option<String>) -> Result<Arc<Tokens>, String> {
        Self::with_source(region, Source::Chain)
    }

    /// Tokens from `provider` (tests).
    #[cfg(test)]
    pub(crate) fn with_provider(
        region: &str,
        provider: impl ProvideCredentials + 'static,
    ) -> Result<Arc<Tokens>, String> {
        Self::with_source(
            Some(region.to_owned()),
            Source::Given(SharedCredentialsProvider::new(provider)),
        )
    }

    fn with_source(region: Option<String>, source: Source) -> Result<Arc<Tokens>, String> {
        let (asks, mut questions) = tokio::sync::mpsc::unbounded_channel::<Ask>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("AWS_MSK_IAM: start the credential resolver: {e}"))?;
        let wanted = region.clone();
        std::thread::Builder::new()
            .name("walbox-aws-credentials".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let mut chain: Option<(String, SharedCredentialsProvider)> = match source {
                        Source::Given(p) => Some((wanted.clone().unwrap_or_default(), p)),
                        Source::Chain => None,
                    };
                    // Ends when the last Tokens is dropped.
                    while let Some(reply) = questions.recv().await {
                        let answer = resolve(&mut chain, wanted.as_deref()).await;
                        let _ = reply.send(answer);
                    }
                });
            })
            .map_err(|e| format!("AWS_MSK_IAM: start the credential resolver: {e}"))?;
        let lifetime = std::env::var(TEST_LIFETIME)
            .ok()
            .and_then(|s| s.parse().ok())
            .map_or(TOKEN_LIFETIME, Duration::from_secs);
        Ok(Arc::new(Tokens {
            region,
            asks,
            cached: Mutex::new(None),
            lifetime,
        }))
    }

    /// The region given (else found by the brokers' names or the SDK).
    pub(crate) fn region(&self) -> Option<&str> {
        self.region.as_deref()
    }

    /// A fresh token. Blocks while credentials are resolved (at most
    /// [`CREDENTIALS_TIMEOUT`]); callable from any thread.
    pub(crate) fn token(&self) -> Result<AuthToken, String> {
        let now = SystemTime::now();
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        let reusable = cached.as_ref().is_some_and(|(_, c, at)| {
            now.duration_since(*at).unwrap_or_default() < CREDENTIALS_REUSE
                && c.expiry().is_none_or(|e| e > now + CREDENTIALS_REUSE)
        });
        if !reusable {
            let (reply, answer) = std::sync::mpsc::channel();
            self.asks
                .send(reply)
                .map_err(|_| "AWS_MSK_IAM: the credential resolver stopped".to_owned())?;
            let (region, credentials) = answer
                .recv_timeout(CREDENTIALS_TIMEOUT + Duration::from_secs(5))
                .map_err(|_| "AWS_MSK_IAM: the credential resolver did not answer".to_owned())??;
            *cached = Some((region, credentials, now));
        }
        let (region, credentials, _) = cached.as_ref().expect("resolved above");
        let region = self.region.as_deref().unwrap_or(region);
        auth_token(region, credentials, now, self.lifetime)
    }

    /// Gives `client` a token now: librdkafka asks for one through its
    /// main queue only, which an admin client never polls and a consumer
    /// polls only once it reads. Failures are logged; the client then
    /// waits for the next refresh.
    pub(crate) fn prime<C: rdkafka::ClientContext>(&self, client: &rdkafka::client::Client<C>) {
        match self.token() {
            Ok(token) => {
                if let Err(e) = set_token(client, &token) {
                    tracing::warn!(error = %e, "AWS_MSK_IAM: librdkafka refused the token");
                }
            }
            Err(e) => tracing::warn!(error = %e, "AWS_MSK_IAM: no token yet"),
        }
    }
}

/// The region and fresh credentials, loading the SDK's chain on first use
/// (kept in `chain`: its providers hold their HTTP clients).
async fn resolve(
    chain: &mut Option<(String, SharedCredentialsProvider)>,
    wanted: Option<&str>,
) -> Result<(String, Credentials), String> {
    if chain.is_none() {
        let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .load()
            .await;
        let region = match wanted {
            Some(r) => r.to_owned(),
            None => config
                .region()
                .map(|r| r.to_string())
                .ok_or_else(|| NO_REGION.to_owned())?,
        };
        let provider = config
            .credentials_provider()
            .ok_or_else(|| "AWS_MSK_IAM: the AWS SDK found no credential provider".to_owned())?;
        *chain = Some((region, provider));
    }
    let (region, provider) = chain.as_ref().expect("loaded above");
    let credentials = tokio::time::timeout(CREDENTIALS_TIMEOUT, provider.provide_credentials())
        .await
        .map_err(|_| {
            format!(
                "AWS_MSK_IAM: no AWS credentials within {}s (a metadata endpoint or STS did not answer)",
                CREDENTIALS_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("AWS_MSK_IAM: no AWS credentials: {}", error_chain(&e)))?;
    Ok((region.clone(), credentials))
}

const NO_REGION: &str = "AWS_MSK_IAM: no AWS region: set kafka.aws_region (or AWS_REGION), or use the brokers' MSK host names";

/// `error` and its sources on one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text.replace('\n', " ")
}

/// librdkafka's `rd_kafka_oauthbearer_set_token` for `client`.
#[allow(unsafe_code)]
fn set_token<C: rdkafka::ClientContext>(
    client: &rdkafka::client::Client<C>,
    token: &AuthToken,
) -> Result<(), String> {
    use std::ffi::{c_char, CStr, CString};
    let value = CString::new(token.token.as_str()).map_err(|e| e.to_string())?;
    let principal = CString::new(PRINCIPAL).expect("no NUL");
    let mut error = [0 as c_char; 512];
    // SAFETY: the client pointer is live for the borrow of `client`; the
    // strings are NUL-terminated and outlive the call, which copies them;
    // no extensions (a null array of size 0); `error` has the size given.
    let code = unsafe {
        rdkafka::bindings::rd_kafka_oauthbearer_set_token(
            client.native_ptr(),
            value.as_ptr(),
            token.expires_ms,
            principal.as_ptr(),
            std::ptr::null_mut(),
            0,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if code == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
        return Ok(());
    }
    // SAFETY: librdkafka wrote a NUL-terminated message into `error`
    // (zeroed, so terminated even if it wrote nothing).
    let message = unsafe { CStr::from_ptr(error.as_ptr()) };
    Err(message.to_string_lossy().into_owned())
}

/// The token for librdkafka's refresh callback
/// ([`rdkafka::ClientContext::generate_oauth_token`]).
pub(crate) fn oauth_token(
    tokens: Option<&Tokens>,
) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
    let tokens = tokens.ok_or(
        "walbox makes OAUTHBEARER tokens for sasl.mechanism = AWS_MSK_IAM only (for OIDC set sasl.oauthbearer.method = oidc)",
    )?;
    let token = tokens.token()?;
    Ok(rdkafka::client::OAuthToken {
        token: token.token,
        principal_name: PRINCIPAL.to_owned(),
        lifetime_ms: token.expires_ms,
    })
}

/// The two items of an [`rdkafka::ClientContext`] that hand librdkafka
/// `AWS_MSK_IAM`'s tokens from the context's field `$tokens` (an
/// `Option<Arc<Tokens>>`). librdkafka asks only with `OAUTHBEARER`, which
/// walbox sets for `AWS_MSK_IAM` alone; OIDC's tokens are librdkafka's own.
macro_rules! serve_tokens {
    ($tokens:tt) => {
        const ENABLE_REFRESH_OAUTH_TOKEN: bool = true;

        fn generate_oauth_token(
            &self,
            _: Option<&str>,
        ) -> Result<rdkafka::client::OAuthToken, Box<dyn std::error::Error>> {
            $crate::msk_iam::oauth_token(self.$tokens.as_deref())
        }
    };
}
pub(crate) use serve_tokens;

/// The client context of walbox's short-lived helper clients (a probe, a
/// watermark reader): librdkafka's defaults, plus `AWS_MSK_IAM`'s tokens.
pub(crate) struct TokenContext(pub(crate) Option<Arc<Tokens>>);

impl rdkafka::ClientContext for TokenContext {
    serve_tokens!(0);
}

impl rdkafka::consumer::ConsumerContext for TokenContext {}

impl rdkafka::producer::ProducerContext for TokenContext {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::producer::DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    const ACCESS_KEY: &str = "AKIDEXAMPLE";
    const SECRET_KEY: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    const SESSION_TOKEN: &str = "AQoDYXdzEPT//////////wEXAMPLEtc764bNrC9SAPBSM22wDOk4x4HIZ8j4FZTwdQWLWsKWHGBuFqwAeMicRXmxfpSPfIeoIYRqTflfKD8YUuwthAx7mSEI/qkPpKPi/kMcGdQrmGdeehM4IC1NtBmUpp2wUE8phUZampKsburEDy0KPkyQDYwT7WZ0wq5VSXDvp75YU9HFvlRd8Tx6q6fE8YQcHNVXAkiY9q6d+xo0rKwT38xVqr7ZD0u0iPPkUL64lIZbqBAz+scqKmlzm8FDrypNC9Yjc8fPOLn9FX9KSYvKTr4rvx3iSIlTJabIQwj2ICCR/oLxBA==";

    /// 2015-08-30T12:36:00Z, the date of AWS's SigV4 test suite.
    fn suite_time() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_440_938_160)
    }

    /// The URLs AWS's own signer produced for the same request (botocore's
    /// `SigV4QueryAuth`, as aws-msk-iam-sasl-signer-python calls it, with
    /// its clock set to the suite's date), byte for byte.
    #[test]
    fn the_url_is_what_awss_signer_makes() {
        let plain = Credentials::new(ACCESS_KEY, SECRET_KEY, None, None, "test");
        assert_eq!(
            presigned_url(
                "us-east-1",
                &plain,
                suite_time(),
                TOKEN_LIFETIME,
                "walbox/test"
            )
            .unwrap(),
            "https://kafka.us-east-1.amazonaws.com/?Action=kafka-cluster%3AConnect\
             &X-Amz-Algorithm=AWS4-HMAC-SHA256\
             &X-Amz-Credential=AKIDEXAMPLE%2F20150830%2Fus-east-1%2Fkafka-cluster%2Faws4_request\
             &X-Amz-Date=20150830T123600Z&X-Amz-Expires=900&X-Amz-SignedHeaders=host\
             &X-Amz-Signature=c413a83bc64a339e31a5e5e9ed99d778ff843206b427540cafa5122c01e3e993\
             &User-Agent=walbox%2Ftest"
        );
        let session = Credentials::new(
            ACCESS_KEY,
            SECRET_KEY,
            Some(SESSION_TOKEN.into()),
            None,
            "test",
        );
        let url = presigned_url(
            "us-east-1",
            &session,
            suite_time(),
            TOKEN_LIFETIME,
            "walbox/test",
        )
        .unwrap();
        assert!(
            url.contains(&format!(
                "&X-Amz-Security-Token={}&",
                percent_encode(SESSION_TOKEN)
            )),
            "{url}"
        );
        assert!(
            url.contains(
                "&X-Amz-Signature=7da19d2bd34a256a60afe69ad5a878c2b00d26df953c91dce2cec9a91b27808f&"
            ),
            "{url}"
        );
    }

    #[test]
    fn the_token_is_the_url_in_unpadded_base64url_with_its_expiry() {
        let c = Credentials::new(
            ACCESS_KEY,
            SECRET_KEY,
            Some(SESSION_TOKEN.into()),
            None,
            "test",
        );
        let token = auth_token("eu-west-1", &c, suite_time(), TOKEN_LIFETIME).unwrap();
        assert!(!token.token.contains(['=', '+', '/']), "{}", token.token);
        let url = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(&token.token)
            .unwrap();
        let url = String::from_utf8(url).unwrap();
        assert!(url
            .starts_with("https://kafka.eu-west-1.amazonaws.com/?Action=kafka-cluster%3AConnect&"));
        assert!(url.ends_with(&format!(
            "&User-Agent=walbox%2F{}",
            env!("CARGO_PKG_VERSION")
        )));
        assert_eq!(token.expires_ms, (1_440_938_160 + 900) * 1000);
        assert!(!format!("{token:?}").contains(&token.token));
    }

    #[test]
    fn the_region_is_read_from_msk_broker_names() {
        for (servers, region) in [
            (
                "b-1.orders.abc123.c2.kafka.eu-west-1.amazonaws.com:9098,b-2.orders.abc123.c2.kafka.eu-west-1.amazonaws.com:9098",
                Some("eu-west-1"),
            ),
            (
                "boot-ab12.c1.kafka-serverless.us-east-2.amazonaws.com:9098",
                Some("us-east-2"),
            ),
            ("localhost:9092, b-1.x.c2.kafka.ap-south-1.amazonaws.com:9098", Some("ap-south-1")),
            ("kafka.internal:9092", None),
            ("amazonaws.com:9092", None),
            ("", None),
        ] {
            assert_eq!(region_of_brokers(servers).as_deref(), region, "{servers}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn credentials_are_resolved_once_and_reused() {
        #[derive(Debug, Default)]
        struct Counting(std::sync::atomic::AtomicUsize);
        impl ProvideCredentials for Counting {
            fn provide_credentials<'a>(
                &'a self,
            ) -> aws_credential_types::provider::future::ProvideCredentials<'a>
            where
                Self: 'a,
            {
                let n = self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                aws_credential_types::provider::future::ProvideCredentials::ready(Ok(
                    Credentials::new(format!("AKID{n}"), SECRET_KEY, None, None, "test"),
                ))
            }
        }
        let tokens = Tokens::with_provider("eu-west-1", Counting::default()).unwrap();
        // From a runtime thread, as librdkafka's callbacks may run anywhere.
        let first = tokens.token().unwrap();
        let second = tokio::task::spawn_blocking({
            let tokens = Arc::clone(&tokens);
            move || tokens.token().unwrap()
        })
        .await
        .unwrap();
        for t in [&first, &second] {
            let url = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(&t.token)
                .unwrap();
            assert!(String::from_utf8(url)
                .unwrap()
                .contains("X-Amz-Credential=AKID0%2F"));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_provider_failure_is_one_line_without_secrets() {
        #[derive(Debug)]
        struct Failing;
        impl ProvideCredentials for Failing {
            fn provide_credentials<'a>(
                &'a self,
            ) -> aws_credential_types::provider::future::ProvideCredentials<'a>
            where
                Self: 'a,
            {
                aws_credential_types::provider::future::ProvideCredentials::ready(Err(
                    aws_credential_types::provider::error::CredentialsError::provider_error(
                        "the metadata endpoint said no\nsecond line",
                    ),
                ))
            }
        }
        let tokens = Tokens::with_provider("eu-west-1", Failing).unwrap();
        let e = tokens.token().unwrap_err();
        assert!(e.starts_with("AWS_MSK_IAM: no AWS credentials: "), "{e}");
        assert!(e.contains("the metadata endpoint said no"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
