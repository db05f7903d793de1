//! The protocol's framing on one socket: reading whole backend messages
//! (cancel-safe, bounded), writing frontend ones, and simple queries.

use std::io;

use bytes::{Buf, BytesMut};
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{Header, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::Error;

/// Largest backend message accepted (Postgres' own limit is 1 GiB): bounds the
/// read buffer whatever a peer claims.
const MAX_FRAME: usize = (1 << 30) + 64;
/// Read in chunks of at least this much.
const READ_CHUNK: usize = 64 * 1024;

/// A socket, plain or TLS.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// What came off the wire: a CopyBothResponse, which postgres-protocol does
/// not know, or any message it parses.
pub(crate) enum Incoming {
    CopyBoth,
    Message(Message),
}

/// One connection's socket and buffers.
pub(crate) struct Wire {
    io: Box<dyn Io>,
    read_buf: BytesMut,
    /// Frontend messages are written here, then [`Wire::flush`]ed.
    pub(crate) write_buf: BytesMut,
    /// `host:port` (or the socket path), for errors; never credentials.
    pub(crate) target: String,
}

/// A protocol error: `what` arrived during `during`.
pub(crate) fn unexpected(what: &str, during: &str) -> Error {
    Error::Protocol(format!("unexpected {what} during {during}"))
}

/// A backend message's name, for errors.
pub(crate) fn message_name(m: &Message) -> &'static str {
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

impl Wire {
    pub(crate) fn new(io: Box<dyn Io>, target: String) -> Wire {
        Wire {
            io,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::with_capacity(1024),
            target,
        }
    }

    /// Writes out what is in `write_buf`.
    pub(crate) async fn flush(&mut self) -> Result<(), Error> {
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
    pub(crate) async fn read(&mut self) -> Result<Incoming, Error> {
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
    pub(crate) async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, Error> {
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
                    error = Some(Error::from_response(&body))
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
}
