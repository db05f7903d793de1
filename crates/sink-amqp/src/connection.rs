//! Opening a connection to the broker, and what a failure to means: a
//! refusal for good (credentials, TLS) or a broker that did not answer.

use amqprs::connection::{Connection, OpenConnectionArguments};

use crate::{AmqpConfig, ConnectError};

/// The AMQP heartbeat, in seconds: a silent broker is noticed within two.
const HEARTBEAT_S: u16 = 10;

/// What a failure to connect (or to set up the connection) means.
pub(crate) fn classify(config: &AmqpConfig, e: amqprs::error::Error) -> ConnectError {
    let url = &config.url;
    let shown = url.to_string();
    let detail = e.to_string();
    if let Some(why) = tls_refusal(&detail) {
        ConnectError::Tls {
            url: shown.clone(),
            detail: format!("{detail}: {why}"),
        }
    } else if ["ACCESS_REFUSED", "NOT_ALLOWED", "403", "530"]
        .iter()
        .any(|s| detail.contains(s))
    {
        ConnectError::Refused {
            url: shown.clone(),
            detail,
        }
    } else if detail.contains("Connection reset by peer")
        && url.tls
        && config.tls.cert_file.is_none()
    {
        // Over TLS 1.3 a broker that wants a client certificate
        // says so in an alert after the handshake, which the reset
        // that follows may overtake: then it reads as a login the
        // broker ended.
        ConnectError::Tls {
                url: shown.clone(),
                detail: format!("the broker closed the connection during the login ({detail}): it wants a client certificate it trusts (rabbitmq.cert_file and rabbitmq.key_file), or the user or password is wrong"),
            }
    } else if detail.contains("Connection reset by peer") {
        // RabbitMQ ends a failed login by closing the socket, with
        // no reason, for clients (such as this one) that do not
        // ask for one: a reset during the handshake is that, but
        // for a broker that went away at that very moment.
        ConnectError::Refused {
                url: shown.clone(),
                detail: format!("the broker closed the connection during the login ({detail}): most likely a wrong user or password, or amqp:// to a TLS port (write amqps://)"),
            }
    } else {
        ConnectError::Unavailable {
            url: shown.clone(),
            detail,
        }
    }
}

/// A connection to the broker (over TLS for `amqps://`).
pub(crate) async fn connect(config: &AmqpConfig) -> Result<Connection, ConnectError> {
    let url = &config.url;
    let shown = url.to_string();
    let mut args = OpenConnectionArguments::new(&url.host, url.port, &url.user, &url.password);
    args.virtual_host(&url.vhost)
        .connection_name(&config.connection_name)
        .heartbeat(HEARTBEAT_S);
    if url.tls {
        let adaptor = config
            .tls
            .adaptor(&url.host)
            .map_err(|e| ConnectError::Tls {
                url: shown.clone(),
                detail: e.to_string(),
            })?;
        args.tls_adaptor(adaptor);
    }
    Connection::open(&args)
        .await
        .map_err(|e| classify(config, e))
}

/// What to check when `detail` (amqprs' error text, rustls' words in it)
/// is TLS failing for good; `None` for anything else.
fn tls_refusal(detail: &str) -> Option<&'static str> {
    if detail.contains("invalid peer certificate") {
        Some("the broker's certificate is not trusted or not for this host: check rabbitmq.ca_file (the CA that signed it), and that the URL's host or rabbitmq.server_name is a name the certificate carries")
    } else if detail.contains("CertificateRequired") || detail.contains("received fatal alert") {
        Some("the broker refused the TLS handshake: a broker with verify_peer and fail_if_no_peer_cert wants a client certificate it trusts (rabbitmq.cert_file and rabbitmq.key_file)")
    } else if detail.contains("invalid dnsname") {
        Some("the URL's host is not a DNS name or an IP address (rabbitmq.server_name sets the name to verify)")
    } else if detail.contains("peer is incompatible")
        || detail.contains("InvalidContentType")
        || detail.contains("corrupt message")
    {
        Some("the broker does not speak TLS on this port: is it the TLS listener (5671 by default), or should the URL be amqp://?")
    } else {
        None
    }
}
