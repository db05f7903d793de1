//! Opening a replication connection: the socket (TCP or Unix), TLS
//! negotiation per `sslmode`, the startup message with
//! `replication=database`, and authentication (trust, cleartext, md5,
//! SCRAM-SHA-256, and SCRAM-SHA-256-PLUS with channel binding over TLS, as
//! libpq's `channel_binding` asks), until the walsender is ready for commands.

use std::io;
use std::time::Duration;

use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::ChannelBinding as BindingMode;
use tokio_postgres::config::Host;

use crate::client::ReplicationClient;
use crate::config::{PgConfig, SslMode, TargetSession};
use crate::error::Error;
use crate::tls;
use crate::wire::{message_name, unexpected, Incoming, Io, Wire};

const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// The control connection's keepalive and user-timeout settings, on the
/// replication socket too: a peer that vanished without closing shows as an
/// error within about a minute, whatever walbox's own receive timeout does.
fn set_keepalives(tcp: &TcpStream, config: &PgConfig) -> io::Result<()> {
    let c = config.tokio_config();
    let socket = socket2::SockRef::from(tcp);
    if c.get_keepalives() {
        let mut keepalive = socket2::TcpKeepalive::new().with_time(c.get_keepalives_idle());
        if let Some(interval) = c.get_keepalives_interval() {
            keepalive = keepalive.with_interval(interval);
        }
        if let Some(retries) = c.get_keepalives_retries() {
            keepalive = keepalive.with_retries(retries);
        }
        socket.set_tcp_keepalive(&keepalive)?;
    }
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Some(t) = c.get_tcp_user_timeout() {
        socket.set_tcp_user_timeout(Some(*t))?;
    }
    Ok(())
}

impl ReplicationClient {
    /// Connects, negotiates TLS per `sslmode`, authenticates, and waits until
    /// the walsender is ready for commands. With several hosts, tries each in
    /// order until one answers and is what `target_session_attrs` asks for
    /// (after a failover, the new primary). Each try is bounded by
    /// `connect_timeout` (default 30 s).
    pub async fn connect(config: &PgConfig) -> Result<ReplicationClient, Error> {
        let mut refused = Vec::new();
        let mut last = None;
        for (host, port) in config.hosts() {
            match Self::connect_one(config, host, port).await {
                Ok(mut client) => match client.fits(config.target_session()).await {
                    Ok(None) => return Ok(client),
                    Ok(Some(why)) => refused.push(format!("{}: {why}", client.wire.target)),
                    Err(e) => {
                        refused.push(format!("{}: {e}", client.wire.target));
                        last = Some(e);
                    }
                },
                // Another host may do; a definite error (authentication,
                // TLS, a missing database) is the same on every host.
                Err(e) if e.is_transient() => {
                    refused.push(e.to_string());
                    last = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        match (refused.len(), last) {
            (1, Some(e)) => Err(e),
            _ => Err(Error::NoSuitableHost(refused.join("; "))),
        }
    }

    /// `None` when this server is what `target` asks for, else why not.
    async fn fits(&mut self, target: TargetSession) -> Result<Option<String>, Error> {
        if target == TargetSession::Any {
            return Ok(None);
        }
        let rows = self
            .simple_query("SELECT pg_is_in_recovery()::text, current_setting('default_transaction_read_only')")
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| Error::Protocol("no answer to pg_is_in_recovery()".into()))?;
        let in_recovery = row.first().and_then(Option::as_deref) == Some("true");
        let read_only = row.get(1).and_then(Option::as_deref) == Some("on");
        Ok(match target {
            _ if in_recovery => Some("in recovery (a standby)".to_owned()),
            TargetSession::ReadWrite if read_only => {
                Some("read-only (default_transaction_read_only = on)".to_owned())
            }
            _ => None,
        })
    }

    /// One host, bounded by `connect_timeout` (default 30 s).
    async fn connect_one(
        config: &PgConfig,
        host: Host,
        port: u16,
    ) -> Result<ReplicationClient, Error> {
        let target = match &host {
            Host::Tcp(h) => format!("{h}:{port}"),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{port}", dir.display()),
        };
        let timeout = config
            .tokio_config()
            .get_connect_timeout()
            .copied()
            .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        match tokio::time::timeout(
            timeout,
            Self::connect_inner(config, host, port, target.clone()),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(Error::Io {
                target,
                source: io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no answer within {timeout:?}"),
                ),
            }),
        }
    }

    async fn connect_inner(
        config: &PgConfig,
        host: Host,
        port: u16,
        target: String,
    ) -> Result<Self, Error> {
        let io_err = |target: &str| {
            let target = target.to_owned();
            move |source| Error::Io { target, source }
        };
        // Over TLS: the server certificate's channel-binding data, if any.
        let mut binding: Option<Option<Vec<u8>>> = None;
        let io: Box<dyn Io> = match &host {
            Host::Unix(dir) => Box::new(
                UnixStream::connect(dir.join(format!(".s.PGSQL.{port}")))
                    .await
                    .map_err(io_err(&target))?,
            ),
            Host::Tcp(h) => {
                let mut tcp = TcpStream::connect((h.as_str(), port))
                    .await
                    .map_err(io_err(&target))?;
                tcp.set_nodelay(true).map_err(io_err(&target))?;
                set_keepalives(&tcp, config).map_err(io_err(&target))?;
                match tls::client_config(config)? {
                    None => Box::new(tcp),
                    Some(tls_config) => {
                        let mut request = BytesMut::new();
                        frontend::ssl_request(&mut request);
                        tcp.write_all(&request).await.map_err(io_err(&target))?;
                        match tcp.read_u8().await.map_err(io_err(&target))? {
                            b'S' => {
                                let name = tls::server_name(h)?;
                                let stream = tokio_rustls::TlsConnector::from(tls_config)
                                    .connect(name, tcp)
                                    .await
                                    .map_err(|e| {
                                        Error::Tls(format!("handshake with {target}: {e}"))
                                    })?;
                                binding = Some(
                                    stream
                                        .get_ref()
                                        .1
                                        .peer_certificates()
                                        .and_then(|certs| certs.first())
                                        .and_then(|cert| {
                                            crate::binding::server_end_point(cert.as_ref())
                                        }),
                                );
                                Box::new(stream)
                            }
                            b'N' if config.ssl_mode() == SslMode::Prefer => Box::new(tcp),
                            b'N' => {
                                return Err(Error::Tls(format!(
                                    "{target} does not accept TLS connections, but sslmode={}",
                                    config.ssl_mode()
                                )))
                            }
                            other => {
                                return Err(Error::Protocol(format!(
                                    "unexpected answer {:?} to the SSL request",
                                    other as char
                                )))
                            }
                        }
                    }
                }
            }
        };
        let mut client = ReplicationClient {
            wire: Wire::new(io, target),
            backend_pid: None,
            server_version: None,
        };
        client.startup(config, binding).await?;
        Ok(client)
    }

    /// `binding`: `None` without TLS; over TLS, the server certificate's
    /// channel-binding data when it has one.
    async fn startup(
        &mut self,
        config: &PgConfig,
        binding: Option<Option<Vec<u8>>>,
    ) -> Result<(), Error> {
        let mode = config.tokio_config().get_channel_binding();
        if mode == BindingMode::Require && binding.is_none() {
            return Err(Error::Config(
                "channel_binding=require needs TLS, but this connection is not encrypted (sslmode)"
                    .into(),
            ));
        }
        let mut bound = false;
        let application_name = config
            .tokio_config()
            .get_application_name()
            .unwrap_or("walbox");
        let params = [
            ("user", config.user()),
            ("database", config.dbname()),
            ("replication", "database"),
            ("application_name", application_name),
            // The text walbox parses must not depend on the database's or
            // role's defaults (`ALTER DATABASE … SET datestyle = 'SQL, DMY'`
            // would turn every timestamp into `21/11/2026 23:51:18.55 UTC`).
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO, MDY"),
            ("IntervalStyle", "postgres"),
            ("extra_float_digits", "3"),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.wire.write_buf)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        self.wire.flush().await?;

        let password = || {
            config.password().ok_or_else(|| {
                Error::Config("the server asks for a password, and none was given".into())
            })
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.wire.read().await? {
                Incoming::Message(Message::AuthenticationOk) => {
                    if mode == BindingMode::Require && !bound {
                        return Err(Error::Config(
                            "channel_binding=require, but the server authenticated walbox without channel binding (it must use scram-sha-256 in pg_hba.conf)".into(),
                        ));
                    }
                    break;
                }
                Incoming::Message(Message::AuthenticationCleartextPassword) => {
                    frontend::password_message(password()?, &mut self.wire.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    self.wire.flush().await?;
                }
                Incoming::Message(Message::AuthenticationMd5Password(body)) => {
                    let hash = md5_hash(config.user().as_bytes(), password()?, body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.wire.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    self.wire.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSasl(body)) => {
                    let mut mechanisms = body.mechanisms();
                    let (mut has_scram, mut has_plus) = (false, false);
                    while let Some(m) = mechanisms.next().map_err(|e| Error::Protocol(e.to_string()))? {
                        has_scram |= m == SCRAM_SHA_256;
                        has_plus |= m == SCRAM_SHA_256_PLUS;
                    }
                    let data = binding.clone().flatten();
                    let (mechanism, channel) = match (&data, has_plus, mode) {
                        (Some(d), true, BindingMode::Prefer | BindingMode::Require) => {
                            bound = true;
                            (SCRAM_SHA_256_PLUS, ChannelBinding::tls_server_end_point(d.clone()))
                        }
                        (_, _, BindingMode::Require) => {
                            return Err(Error::Config(if data.is_none() {
                                "channel_binding=require, but the server certificate's signature algorithm gives no channel-binding hash".into()
                            } else {
                                "channel_binding=require, but the server does not offer SCRAM-SHA-256-PLUS".into()
                            }))
                        }
                        // Over TLS walbox could bind: 'y' tells the server
                        // that it was not offered (a downgrade shows).
                        (Some(_), false, _) => (SCRAM_SHA_256, ChannelBinding::unrequested()),
                        _ => (SCRAM_SHA_256, ChannelBinding::unsupported()),
                    };
                    if mechanism == SCRAM_SHA_256 && !has_scram {
                        return Err(Error::Config("the server offers no SASL mechanism walbox supports (SCRAM-SHA-256, SCRAM-SHA-256-PLUS)".into()));
                    }
                    let s = ScramSha256::new(password()?, channel);
                    frontend::sasl_initial_response(mechanism, s.message(), &mut self.wire.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    scram = Some(s);
                    self.wire.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSaslContinue(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL continue", "authentication"))?;
                    s.update(body.data()).map_err(|e| Error::Protocol(format!("SCRAM: {e}")))?;
                    frontend::sasl_response(s.message(), &mut self.wire.write_buf).map_err(|e| Error::Protocol(e.to_string()))?;
                    self.wire.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSaslFinal(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL final", "authentication"))?;
                    s.finish(body.data())
                        .map_err(|e| Error::Protocol(format!("SCRAM: the server's proof is invalid: {e}")))?;
                }
                Incoming::Message(Message::ErrorResponse(body)) => return Err(Error::from_response(&body)),
                Incoming::Message(Message::NoticeResponse(_)) => {}
                Incoming::Message(
                    Message::AuthenticationKerberosV5
                    | Message::AuthenticationScmCredential
                    | Message::AuthenticationGss
                    | Message::AuthenticationSspi,
                ) => {
                    return Err(Error::Config(
                        "the server asks for Kerberos/GSS/SSPI authentication; walbox supports trust, password, md5 and scram-sha-256".into(),
                    ))
                }
                Incoming::Message(other) => return Err(unexpected(message_name(&other), "authentication")),
                Incoming::CopyBoth => return Err(unexpected("CopyBothResponse", "authentication")),
            }
        }
        loop {
            match self.wire.read().await? {
                Incoming::Message(Message::ReadyForQuery(_)) => return Ok(()),
                Incoming::Message(Message::BackendKeyData(body)) => {
                    self.backend_pid = Some(body.process_id())
                }
                Incoming::Message(Message::ParameterStatus(body)) => {
                    if body.name().ok() == Some("server_version") {
                        self.server_version = body.value().ok().map(str::to_owned);
                    }
                }
                Incoming::Message(Message::NoticeResponse(_)) => {}
                Incoming::Message(Message::ErrorResponse(body)) => {
                    return Err(Error::from_response(&body))
                }
                Incoming::Message(other) => {
                    return Err(unexpected(message_name(&other), "startup"))
                }
                Incoming::CopyBoth => return Err(unexpected("CopyBothResponse", "startup")),
            }
        }
    }
}
