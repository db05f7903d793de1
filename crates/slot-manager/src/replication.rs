//! The replication-mode connection (a walsender session), on postgres-protocol
//! and tokio.
//!
//! Upstream tokio-postgres has no replication mode, so this module speaks the
//! protocol itself: startup with `replication=database`, the SSL request,
//! trust / cleartext / md5 / SCRAM-SHA-256 authentication, simple queries
//! (`IDENTIFY_SYSTEM`, `START_REPLICATION`), and the CopyBoth sub-protocol.
//! Its shape follows the replication fork of tokio-postgres
//! ([`ReplicationClient::start_logical_replication`] returns a
//! [`LogicalReplicationStream`] of decoded frames that also sends standby
//! status updates), so it could be swapped for it later.
//!
//! ```text
//! client                                   walsender
//!   │── SSLRequest ───────────────────────────►│  'S' → TLS handshake
//!   │── Startup(user, database, replication=database)
//!   │◄──────────── Authentication* / ParameterStatus / BackendKeyData / ReadyForQuery
//!   │── Query "START_REPLICATION SLOT … LOGICAL 0/0 (…)"
//!   │◄──────────── CopyBothResponse ('W': postgres-protocol cannot parse it; handled here)
//!   │◄──────────── CopyData('w' XLogData | 'k' keepalive) …
//!   │── CopyData('r' standby status update) ──►│
//! ```
//!
//! Reading is cancel-safe: bytes accumulate in a buffer and a frame is
//! consumed only when complete, so [`LogicalReplicationStream::next_message`]
//! can sit in a `select!` beside a timer.

use std::io;
use std::time::Duration;

use bytes::{Buf, BytesMut};
use fallible_iterator::FallibleIterator;
use pgoutput_decoder::{Lsn, ReplicationMessage, StandbyStatusUpdate};
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::backend::{ErrorResponseBody, Header, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::Host;

use crate::config::{PgConfig, SslMode};
use crate::error::Error;
use crate::sql::{quote_ident, quote_literal};
use crate::tls;

/// Largest backend message accepted (Postgres' own limit is 1 GiB): bounds the
/// read buffer whatever a peer claims.
const MAX_FRAME: usize = (1 << 30) + 64;
/// Read in chunks of at least this much.
const READ_CHUNK: usize = 64 * 1024;
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// What came off the wire: a CopyBothResponse, which postgres-protocol does
/// not know, or any message it parses.
enum Incoming {
    CopyBoth,
    Message(Message),
}

/// `IDENTIFY_SYSTEM`'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifySystem {
    /// The cluster's system identifier.
    pub system_id: String,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database this session is connected to.
    pub dbname: Option<String>,
}

/// When pgoutput streams large in-progress transactions (protocol v2+).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Streaming {
    /// Transactions are sent whole, after they commit.
    #[default]
    Off,
    /// Large transactions are streamed in blocks before they commit (v2+).
    On,
    /// As `On`, for parallel apply; Stream Abort carries LSN and time (v4).
    Parallel,
}

/// The options of `START_REPLICATION … LOGICAL` for pgoutput.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicationOptions {
    /// `proto_version`, 1–4.
    pub proto_version: u32,
    /// The publications to stream.
    pub publication_names: Vec<String>,
    /// Also send `pg_logical_emit_message` messages (Postgres 14+).
    pub messages: bool,
    /// Stream large transactions.
    pub streaming: Streaming,
}

impl ReplicationOptions {
    /// Protocol 1, one publication, no messages, no streaming.
    pub fn new(publication: impl Into<String>) -> Self {
        ReplicationOptions {
            proto_version: 1,
            publication_names: vec![publication.into()],
            messages: false,
            streaming: Streaming::Off,
        }
    }

    /// The option list, names and values quoted: `(proto_version '1', publication_names '"a","b"')`.
    pub fn to_sql(&self) -> String {
        let names: Vec<String> = self
            .publication_names
            .iter()
            .map(|n| quote_ident(n))
            .collect();
        let mut opts = vec![
            format!("proto_version '{}'", self.proto_version),
            format!("publication_names {}", quote_literal(&names.join(","))),
        ];
        if self.messages {
            opts.push("messages 'true'".into());
        }
        match self.streaming {
            Streaming::Off => {}
            Streaming::On => opts.push("streaming 'on'".into()),
            Streaming::Parallel => opts.push("streaming 'parallel'".into()),
        }
        format!("({})", opts.join(", "))
    }
}

/// A connection in replication mode (`replication=database`).
pub struct ReplicationClient {
    io: Box<dyn Io>,
    read_buf: BytesMut,
    write_buf: BytesMut,
    target: String,
    backend_pid: Option<i32>,
    server_version: Option<String>,
}

impl std::fmt::Debug for ReplicationClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationClient")
            .field("target", &self.target)
            .field("backend_pid", &self.backend_pid)
            .finish()
    }
}

fn server_error(body: &ErrorResponseBody) -> Error {
    let (mut code, mut message, mut detail, mut hint) = (String::new(), String::new(), None, None);
    let mut fields = body.fields();
    while let Ok(Some(field)) = fields.next() {
        let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
        match field.type_() {
            b'C' => code = value,
            b'M' => message = value,
            b'D' => detail = Some(value),
            b'H' => hint = Some(value),
            _ => {}
        }
    }
    Error::Server {
        code,
        message,
        detail,
        hint,
    }
}

fn unexpected(what: &str, during: &str) -> Error {
    Error::Protocol(format!("unexpected {what} during {during}"))
}

fn message_name(m: &Message) -> &'static str {
    match m {
        Message::AuthenticationOk => "AuthenticationOk",
        Message::CopyData(_) => "CopyData",
        Message::CopyDone => "CopyDone",
        Message::CopyOutResponse(_) => "CopyOutResponse",
        Message::CopyInResponse(_) => "CopyInResponse",
        Message::DataRow(_) => "DataRow",
        Message::ReadyForQuery(_) => "ReadyForQuery",
        Message::RowDescription(_) => "RowDescription",
        Message::CommandComplete(_) => "CommandComplete",
        Message::ErrorResponse(_) => "ErrorResponse",
        _ => "message",
    }
}

impl ReplicationClient {
    /// Connects, negotiates TLS per `sslmode`, authenticates, and waits until
    /// the walsender is ready for commands. Bounded by `connect_timeout`
    /// (default 30 s).
    pub async fn connect(config: &PgConfig) -> Result<ReplicationClient, Error> {
        let (host, port) = config.host_port();
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
            io,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::with_capacity(1024),
            target,
            backend_pid: None,
            server_version: None,
        };
        client.startup(config).await?;
        Ok(client)
    }

    async fn startup(&mut self, config: &PgConfig) -> Result<(), Error> {
        let application_name = config
            .tokio_config()
            .get_application_name()
            .unwrap_or("walbox");
        let params = [
            ("user", config.user()),
            ("database", config.dbname()),
            ("replication", "database"),
            ("application_name", application_name),
            ("client_encoding", "UTF8"),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.write_buf)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        self.flush().await?;

        let password = || {
            config.password().ok_or_else(|| {
                Error::Config("the server asks for a password, and none was given".into())
            })
        };
        let mut scram: Option<ScramSha256> = None;
        loop {
            match self.read().await? {
                Incoming::Message(Message::AuthenticationOk) => break,
                Incoming::Message(Message::AuthenticationCleartextPassword) => {
                    frontend::password_message(password()?, &mut self.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    self.flush().await?;
                }
                Incoming::Message(Message::AuthenticationMd5Password(body)) => {
                    let hash = md5_hash(config.user().as_bytes(), password()?, body.salt());
                    frontend::password_message(hash.as_bytes(), &mut self.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    self.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSasl(body)) => {
                    let mut mechanisms = body.mechanisms();
                    let mut has_scram = false;
                    while let Some(m) = mechanisms.next().map_err(|e| Error::Protocol(e.to_string()))? {
                        has_scram |= m == SCRAM_SHA_256;
                    }
                    if !has_scram {
                        return Err(Error::Config("the server offers no SASL mechanism walbox supports (SCRAM-SHA-256)".into()));
                    }
                    // Channel binding is not used ('n'): correct with and without TLS.
                    let s = ScramSha256::new(password()?, ChannelBinding::unsupported());
                    frontend::sasl_initial_response(SCRAM_SHA_256, s.message(), &mut self.write_buf)
                        .map_err(|e| Error::Protocol(e.to_string()))?;
                    scram = Some(s);
                    self.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSaslContinue(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL continue", "authentication"))?;
                    s.update(body.data()).map_err(|e| Error::Protocol(format!("SCRAM: {e}")))?;
                    frontend::sasl_response(s.message(), &mut self.write_buf).map_err(|e| Error::Protocol(e.to_string()))?;
                    self.flush().await?;
                }
                Incoming::Message(Message::AuthenticationSaslFinal(body)) => {
                    let s = scram.as_mut().ok_or_else(|| unexpected("SASL final", "authentication"))?;
                    s.finish(body.data())
                        .map_err(|e| Error::Protocol(format!("SCRAM: the server's proof is invalid: {e}")))?;
                }
                Incoming::Message(Message::ErrorResponse(body)) => return Err(server_error(&body)),
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
            match self.read().await? {
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
                Incoming::Message(Message::ErrorResponse(body)) => return Err(server_error(&body)),
                Incoming::Message(other) => {
                    return Err(unexpected(message_name(&other), "startup"))
                }
                Incoming::CopyBoth => return Err(unexpected("CopyBothResponse", "startup")),
            }
        }
    }

    /// The walsender's process id.
    pub fn backend_pid(&self) -> Option<i32> {
        self.backend_pid
    }

    /// The server's `server_version`.
    pub fn server_version(&self) -> Option<&str> {
        self.server_version.as_deref()
    }

    async fn flush(&mut self) -> Result<(), Error> {
        let result = async {
            self.io.write_all(&self.write_buf).await?;
            self.io.flush().await
        }
        .await;
        self.write_buf.clear();
        result.map_err(|source| Error::Io {
            target: self.target.clone(),
            source,
        })
    }

    /// Reads one message. Cancel-safe: a frame is consumed only when whole.
    async fn read(&mut self) -> Result<Incoming, Error> {
        loop {
            if let Some(header) =
                Header::parse(&self.read_buf).map_err(|e| Error::Protocol(e.to_string()))?
            {
                let frame_len = header.len() as usize + 1;
                if frame_len > MAX_FRAME {
                    return Err(Error::Protocol(format!(
                        "backend message of {frame_len} bytes exceeds the 1 GiB limit"
                    )));
                }
                if header.tag() == b'W' {
                    // CopyBothResponse: format and column formats, not needed.
                    if self.read_buf.len() >= frame_len {
                        self.read_buf.advance(frame_len);
                        return Ok(Incoming::CopyBoth);
                    }
                } else if let Some(m) = Message::parse(&mut self.read_buf)
                    .map_err(|e| Error::Protocol(e.to_string()))?
                {
                    return Ok(Incoming::Message(m));
                }
                self.read_buf.reserve(
                    frame_len
                        .saturating_sub(self.read_buf.len())
                        .max(READ_CHUNK),
                );
            } else {
                self.read_buf.reserve(READ_CHUNK);
            }
            let n = self
                .io
                .read_buf(&mut self.read_buf)
                .await
                .map_err(|source| Error::Io {
                    target: self.target.clone(),
                    source,
                })?;
            if n == 0 {
                return Err(Error::Io {
                    target: self.target.clone(),
                    source: io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the server closed the connection",
                    ),
                });
            }
        }
    }

    /// Runs a simple query (replication commands included) and returns its
    /// rows as text.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, Error> {
        frontend::query(sql, &mut self.write_buf).map_err(|e| Error::Protocol(e.to_string()))?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            match self.read().await? {
                Incoming::Message(Message::DataRow(body)) => {
                    let mut row = Vec::new();
                    let mut ranges = body.ranges();
                    while let Some(range) =
                        ranges.next().map_err(|e| Error::Protocol(e.to_string()))?
                    {
                        row.push(
                            range
                                .and_then(|r| body.buffer().get(r))
                                .map(|b| String::from_utf8_lossy(b).into_owned()),
                        );
                    }
                    rows.push(row);
                }
                Incoming::Message(Message::ErrorResponse(body)) => {
                    error = Some(server_error(&body))
                }
                Incoming::Message(Message::ReadyForQuery(_)) => return error.map_or(Ok(rows), Err),
                Incoming::Message(
                    Message::RowDescription(_)
                    | Message::CommandComplete(_)
                    | Message::EmptyQueryResponse
                    | Message::NoticeResponse(_)
                    | Message::ParameterStatus(_),
                ) => {}
                Incoming::Message(other) => {
                    return Err(unexpected(message_name(&other), "a simple query"))
                }
                Incoming::CopyBoth => return Err(unexpected("CopyBothResponse", "a simple query")),
            }
        }
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<IdentifySystem, Error> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .filter(|r| r.len() >= 3)
            .ok_or_else(|| unexpected("answer", "IDENTIFY_SYSTEM"))?;
        let text = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
        Ok(IdentifySystem {
            system_id: text(0),
            timeline: text(1)
                .parse()
                .map_err(|_| unexpected("timeline", "IDENTIFY_SYSTEM"))?,
            xlogpos: text(2)
                .parse()
                .map_err(|_| unexpected("xlogpos", "IDENTIFY_SYSTEM"))?,
            dbname: row.get(3).cloned().flatten(),
        })
    }

    /// `START_REPLICATION SLOT <slot> LOGICAL <start> (<options>)`. Pass
    /// [`Lsn::ZERO`] to start from the slot's `confirmed_flush_lsn`.
    ///
    /// A missing slot is [`Error::SlotMissing`], a slot held by another
    /// process [`Error::SlotActive`], an invalidated one
    /// [`Error::SlotInvalidated`].
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &ReplicationOptions,
    ) -> Result<LogicalReplicationStream, Error> {
        let sql = format!(
            "START_REPLICATION SLOT {} LOGICAL {start} {}",
            quote_ident(slot),
            options.to_sql()
        );
        frontend::query(&sql, &mut self.write_buf).map_err(|e| Error::Protocol(e.to_string()))?;
        self.flush().await?;
        let mut error = None;
        loop {
            match self.read().await? {
                Incoming::CopyBoth if error.is_none() => {
                    return Ok(LogicalReplicationStream { client: self })
                }
                Incoming::Message(Message::ErrorResponse(body)) => {
                    error = Some(server_error(&body))
                }
                Incoming::Message(Message::ReadyForQuery(_)) => {
                    let e =
                        error.unwrap_or_else(|| unexpected("ReadyForQuery", "START_REPLICATION"));
                    return Err(classify_slot_error(slot, e));
                }
                Incoming::Message(Message::NoticeResponse(_)) => {}
                Incoming::Message(other) => {
                    return Err(unexpected(message_name(&other), "START_REPLICATION"))
                }
                Incoming::CopyBoth => {
                    return Err(unexpected(
                        "CopyBothResponse after an error",
                        "START_REPLICATION",
                    ))
                }
            }
        }
    }
}

/// Turns the server's answers about a slot into the errors callers act on.
pub(crate) fn classify_slot_error(slot: &str, e: Error) -> Error {
    let Error::Server {
        code,
        message,
        detail,
        ..
    } = &e
    else {
        return e;
    };
    let invalidated =
        |text: &str| text.contains("invalidated") || text.contains("no longer get changes");
    match code.as_str() {
        "42704" => Error::SlotMissing {
            slot: slot.to_owned(),
        },
        "55006" => {
            // "replication slot \"x\" is active for PID 1234"
            let pid = message
                .rsplit(' ')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            Error::SlotActive {
                slot: slot.to_owned(),
                pid,
            }
        }
        // "can no longer get changes from replication slot" (PG 13/14), or
        // "cannot read from logical replication slot" with an "invalidated"
        // detail (PG 15+).
        "55000" if invalidated(message) || detail.as_deref().is_some_and(invalidated) => {
            Error::SlotInvalidated {
                slot: slot.to_owned(),
            }
        }
        _ => e,
    }
}

/// A running logical replication stream: decoded frames in, status updates out.
#[derive(Debug)]
pub struct LogicalReplicationStream {
    client: ReplicationClient,
}

impl LogicalReplicationStream {
    /// The next frame from the server: XLogData or a keepalive. When the
    /// server ends the stream (a clean walsender shutdown sends CommandComplete,
    /// a server-side CopyDone ends it too) this is [`Error::StreamEnded`],
    /// which is transient: reconnect. Cancel-safe.
    pub async fn next_message(&mut self) -> Result<ReplicationMessage, Error> {
        loop {
            match self.client.read().await? {
                Incoming::Message(Message::CopyData(body)) => {
                    return Ok(ReplicationMessage::parse(body.into_bytes())?);
                }
                Incoming::Message(Message::CopyDone | Message::CommandComplete(_)) => {
                    return Err(Error::StreamEnded)
                }
                Incoming::Message(Message::ErrorResponse(body)) => return Err(server_error(&body)),
                Incoming::Message(Message::NoticeResponse(_) | Message::ParameterStatus(_)) => {}
                Incoming::Message(other) => {
                    return Err(unexpected(message_name(&other), "streaming"))
                }
                Incoming::CopyBoth => return Err(unexpected("CopyBothResponse", "streaming")),
            }
        }
    }

    /// Sends a standby status update. Not cancel-safe: await it to the end.
    pub async fn send_standby_status_update(
        &mut self,
        update: StandbyStatusUpdate,
    ) -> Result<(), Error> {
        let mut payload = BytesMut::with_capacity(StandbyStatusUpdate::ENCODED_LEN);
        update.encode(&mut payload);
        frontend::CopyData::new(payload.freeze())
            .map_err(|e| Error::Protocol(e.to_string()))?
            .write(&mut self.client.write_buf);
        self.client.flush().await
    }

    /// The walsender's process id.
    pub fn backend_pid(&self) -> Option<i32> {
        self.client.backend_pid
    }

    /// Ends the stream cleanly: CopyDone, wait (bounded) for the server's
    /// acknowledgement, then Terminate. Errors are not reported: the
    /// connection is going away either way.
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.client.write_buf);
        if self.client.flush().await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(m) = self.client.read().await {
                if matches!(m, Incoming::Message(Message::ReadyForQuery(_))) {
                    break;
                }
            }
        })
        .await;
        frontend::terminate(&mut self.client.write_buf);
        let _ = self.client.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_quote_names() {
        let mut o = ReplicationOptions::new("walbox_outbox");
        assert_eq!(
            o.to_sql(),
            "(proto_version '1', publication_names '\"walbox_outbox\"')"
        );
        o.publication_names = vec!["my pub".into(), "it's\"x".into()];
        o.messages = true;
        o.streaming = Streaming::Parallel;
        o.proto_version = 4;
        assert_eq!(
            o.to_sql(),
            "(proto_version '4', publication_names '\"my pub\",\"it''s\"\"x\"', messages 'true', streaming 'parallel')"
        );
    }

    #[test]
    fn classifies_slot_errors() {
        let server = |code: &str, message: &str| Error::Server {
            code: code.into(),
            message: message.into(),
            detail: None,
            hint: None,
        };
        assert!(matches!(
            classify_slot_error(
                "s",
                server("42704", "replication slot \"s\" does not exist")
            ),
            Error::SlotMissing { .. }
        ));
        assert!(matches!(
            classify_slot_error(
                "s",
                server("55006", "replication slot \"s\" is active for PID 4242")
            ),
            Error::SlotActive { pid: 4242, .. }
        ));
        assert!(matches!(
            classify_slot_error(
                "s",
                server(
                    "55000",
                    "can no longer get changes from replication slot \"s\""
                )
            ),
            Error::SlotInvalidated { .. }
        ));
        let pg15 = Error::Server {
            code: "55000".into(),
            message: "cannot read from logical replication slot \"s\"".into(),
            detail: Some(
                "This slot has been invalidated because it exceeded the maximum reserved size."
                    .into(),
            ),
            hint: None,
        };
        assert!(matches!(
            classify_slot_error("s", pg15),
            Error::SlotInvalidated { .. }
        ));
    }
}
