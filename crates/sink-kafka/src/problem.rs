//! What the client last found wrong with the brokers.
//!
//! librdkafka reports connection-level failures (TLS handshakes, SASL
//! authentication, refused connections) only through its error callback and
//! retries them forever. The sink keeps the last one here, so that a startup
//! check can say *why* no broker answered, and stop at once when the answer
//! is one no retry will change: the broker's certificate is not trusted, or
//! the credentials are refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::error::RDKafkaErrorCode;

/// The kind of a connection-level failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProblemKind {
    /// The TLS handshake failed (untrusted or mismatched certificate,
    /// a client certificate the broker refused, TLS against a plain port).
    Tls,
    /// The broker refused the SASL credentials or mechanism.
    Authentication,
    /// The connection failed or broke (refused, reset, name not resolved).
    Transport,
}

impl ProblemKind {
    /// True when retrying with the same settings cannot help: a human must
    /// change the configuration (or the broker's).
    pub fn is_definite(self) -> bool {
        matches!(self, ProblemKind::Tls | ProblemKind::Authentication)
    }

    /// Classifies a client-level error code; `None` for codes that say
    /// nothing about why (e.g. "all brokers are down", which follows the
    /// specific failure).
    pub(crate) fn of(code: RDKafkaErrorCode, reason: &str) -> Option<ProblemKind> {
        use RDKafkaErrorCode as C;
        match code {
            // A handshake the broker ended (e.g. "alert certificate
            // required") arrives as a transport failure with OpenSSL's text.
            C::BrokerTransportFailure if reason.contains("SSL routines") => Some(ProblemKind::Tls),
            C::SSL => Some(ProblemKind::Tls),
            C::Authentication | C::SaslAuthenticationFailed | C::UnsupportedSASLMechanism => {
                Some(ProblemKind::Authentication)
            }
            C::BrokerTransportFailure | C::Resolve | C::NetworkException => {
                Some(ProblemKind::Transport)
            }
            _ => None,
        }
    }
}

/// A connection-level failure, described without secret values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerProblem {
    /// What kind of failure.
    pub kind: ProblemKind,
    /// librdkafka's explanation, without its broker prefix and timing suffix.
    pub detail: String,
}

impl std::fmt::Display for BrokerProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hint = match self.kind {
            ProblemKind::Tls => {
                " (check security.protocol, ssl.ca.location and, for mutual TLS, ssl.certificate.location and ssl.key.location)"
            }
            ProblemKind::Authentication if self.detail.contains(crate::msk_iam::MECHANISM) => {
                " (check the AWS credentials walbox finds (AWS_PROFILE, AWS_ACCESS_KEY_ID, the role of the pod, task or instance), that their IAM policy allows kafka-cluster:Connect on the cluster, and kafka.aws_region)"
            }
            ProblemKind::Authentication if self.detail.contains("OAUTHBEARER") => {
                " (check sasl.oauthbearer.client.id, sasl.oauthbearer.client.secret, sasl.oauthbearer.token.endpoint.url and sasl.oauthbearer.scope)"
            }
            ProblemKind::Authentication => {
                " (check sasl.mechanism, sasl.username and sasl.password)"
            }
            ProblemKind::Transport => "",
        };
        write!(f, "{}{hint}", self.detail)
    }
}

impl BrokerProblem {
    /// Builds a problem from librdkafka's `reason`, e.g.
    /// `sasl_ssl://host:9093/bootstrap: SSL handshake failed: … (after 2ms in state SSL_HANDSHAKE)`.
    pub(crate) fn new(kind: ProblemKind, reason: &str) -> BrokerProblem {
        BrokerProblem {
            kind,
            detail: tidy(reason),
        }
    }
}

/// Drops the broker-name prefix librdkafka repeats and the timing suffix.
fn tidy(reason: &str) -> String {
    let mut text = reason.trim();
    // "[<proto>://]<host>:<port>/<id>: " names the broker; the caller names
    // the bootstrap list already.
    if let Some((prefix, rest)) = text.split_once(": ") {
        if prefix.contains('/') && !prefix.contains(' ') {
            text = rest;
        }
    }
    if let Some(at) = text.rfind(" (after ") {
        if text.ends_with(')') {
            text = &text[..at];
        }
    }
    // One line, whatever the server or the TLS library put in.
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// What to do with a client error [`ProblemLog::record`] has seen.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Logged a moment ago, or a startup check reports it.
    Quiet,
    /// Log it; with its classification when it is a connection problem.
    Log(Option<BrokerProblem>),
}

/// The last problem, and when the same one was last logged.
#[derive(Default)]
pub(crate) struct ProblemLog {
    state: Mutex<State>,
    /// A startup check is running: it reports what goes wrong itself.
    checking: AtomicBool,
    /// `sasl.mechanism = AWS_MSK_IAM`: an authentication failure says so.
    msk_iam: bool,
}

#[derive(Default)]
struct State {
    last: Option<BrokerProblem>,
    logged: Option<(String, Instant)>,
}

/// The same problem is logged again at most this often (librdkafka reports
/// it on every reconnect attempt).
const RELOG_AFTER: Duration = Duration::from_secs(60);

impl ProblemLog {
    /// A log for a client that authenticates with `AWS_MSK_IAM` or not.
    pub(crate) fn new(msk_iam: bool) -> ProblemLog {
        ProblemLog {
            msk_iam,
            ..ProblemLog::default()
        }
    }

    /// Records a client error (classified and tidied once, here) and says
    /// whether to log it: it is new, or was last logged a while ago, and no
    /// startup check is running.
    pub(crate) fn record(&self, code: RDKafkaErrorCode, reason: &str) -> Verdict {
        let mut problem =
            ProblemKind::of(code, reason).map(|kind| BrokerProblem::new(kind, reason));
        if let Some(p) = problem.as_mut().filter(|p| {
            self.msk_iam
                && p.kind == ProblemKind::Authentication
                && !p.detail.contains(crate::msk_iam::MECHANISM)
        }) {
            p.detail = format!("{}: {}", crate::msk_iam::MECHANISM, p.detail);
        }
        let text = problem
            .as_ref()
            .map_or_else(|| tidy(reason), |p| p.detail.clone());
        let mut state = self.state.lock().expect("not poisoned");
        if problem.is_some() {
            state.last.clone_from(&problem);
        }
        if self.checking.load(Ordering::Relaxed) {
            return Verdict::Quiet;
        }
        let now = Instant::now();
        let fresh = match &state.logged {
            Some((same, at)) => *same != text || now.duration_since(*at) >= RELOG_AFTER,
            None => true,
        };
        if !fresh {
            return Verdict::Quiet;
        }
        state.logged = Some((text, now));
        Verdict::Log(problem)
    }

    /// The last classified problem, if any.
    pub(crate) fn last(&self) -> Option<BrokerProblem> {
        self.state.lock().expect("not poisoned").last.clone()
    }

    /// While `on`, problems are recorded but not logged: the startup check
    /// that sets it reports them in its result.
    pub(crate) fn set_checking(&self, on: bool) {
        self.checking.store(on, Ordering::Relaxed);
    }

    /// Forgets the last problem (a broker answered since).
    pub(crate) fn clear(&self) {
        self.state.lock().expect("not poisoned").last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tidies_librdkafka_reasons() {
        let p = BrokerProblem::new(
            ProblemKind::Tls,
            "sasl_ssl://127.0.0.1:19093/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified (after 2ms in state SSL_HANDSHAKE, 1 identical error(s) suppressed)",
        );
        assert_eq!(
            p.detail,
            "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified"
        );
        assert!(p.to_string().contains("ssl.ca.location"), "{p}");
        assert_eq!(
            tidy("127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)"),
            "Connect to ipv4#127.0.0.1:1 failed: Connection refused"
        );
        // Text without the usual shape is kept as it is, on one line.
        assert_eq!(tidy("odd:\nreason (x)"), "odd: reason (x)");
    }

    #[test]
    fn classifies_codes() {
        use RDKafkaErrorCode as C;
        assert_eq!(ProblemKind::of(C::SSL, ""), Some(ProblemKind::Tls));
        assert_eq!(
            ProblemKind::of(C::Authentication, ""),
            Some(ProblemKind::Authentication)
        );
        assert_eq!(
            ProblemKind::of(
                C::BrokerTransportFailure,
                "b:1/bootstrap: Receive failed: error:0A00045C:SSL routines::tlsv13 alert certificate required"
            ),
            Some(ProblemKind::Tls)
        );
        assert_eq!(
            ProblemKind::of(C::BrokerTransportFailure, "Connection refused"),
            Some(ProblemKind::Transport)
        );
        assert_eq!(ProblemKind::of(C::AllBrokersDown, ""), None);
        assert!(ProblemKind::Authentication.is_definite());
        assert!(!ProblemKind::Transport.is_definite());
    }

    #[test]
    fn logs_a_repeated_problem_once_and_keeps_the_specific_one() {
        let log = ProblemLog::default();
        let reason =
            "ssl://b:1/bootstrap: SSL handshake failed: x (after 1ms in state SSL_HANDSHAKE)";
        assert_eq!(
            log.record(RDKafkaErrorCode::SSL, reason),
            Verdict::Log(Some(BrokerProblem::new(ProblemKind::Tls, reason)))
        );
        assert_eq!(
            log.record(
                RDKafkaErrorCode::SSL,
                "ssl://b:1/bootstrap: SSL handshake failed: x (after 3ms in state SSL_HANDSHAKE)"
            ),
            Verdict::Quiet
        );
        assert_eq!(
            log.record(RDKafkaErrorCode::AllBrokersDown, "1/1 brokers are down"),
            Verdict::Log(None)
        );
        assert_eq!(log.last().map(|p| p.kind), Some(ProblemKind::Tls));
        log.clear();
        assert_eq!(log.last(), None);
    }
}
