//! Streaming a logical slot: `START_REPLICATION` with pgoutput's options,
//! the CopyBoth sub-protocol (XLogData and keepalives in, standby status
//! updates out), and [`start_streaming`], which also re-reads the slot.
//!
//! ```text
//! client                                   walsender
//!   │── Query "START_REPLICATION SLOT … LOGICAL 0/0 (…)"
//!   │◄──────────── CopyBothResponse ('W': postgres-protocol cannot parse it; handled in wire.rs)
//!   │◄──────────── CopyData('w' XLogData | 'k' keepalive) …
//!   │── CopyData('r' standby status update) ──►│
//! ```
//!
//! Reading is cancel-safe: bytes accumulate in a buffer and a frame is
//! consumed only when complete, so [`LogicalReplicationStream::next_message`]
//! can sit in a `select!` beside a timer.

use std::time::Duration;

use bytes::BytesMut;
use pgoutput_decoder::{Lsn, ReplicationMessage, StandbyStatusUpdate};
use postgres_protocol::message::backend::Message;
use postgres_protocol::message::frontend;
use tokio_postgres::Client;

use crate::client::{IdentifySystem, ReplicationClient};
use crate::config::PgConfig;
use crate::control::{slot_status, SlotStatus};
use crate::error::Error;
use crate::sql::{quote_ident, quote_replication_literal};
use crate::wire::{message_name, unexpected, Incoming};

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
            format!(
                "publication_names {}",
                quote_replication_literal(&names.join(","))
            ),
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

impl ReplicationClient {
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
        frontend::query(&sql, &mut self.wire.write_buf)
            .map_err(|e| Error::Protocol(e.to_string()))?;
        self.wire.flush().await?;
        let mut error = None;
        loop {
            match self.wire.read().await? {
                Incoming::CopyBoth if error.is_none() => {
                    return Ok(LogicalReplicationStream { client: self })
                }
                Incoming::Message(Message::ErrorResponse(body)) => {
                    error = Some(Error::from_response(&body))
                }
                Incoming::Message(Message::ReadyForQuery(_)) => {
                    let e =
                        error.unwrap_or_else(|| unexpected("ReadyForQuery", "START_REPLICATION"));
                    return Err(crate::error::classify_slot_error(slot, e));
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
            match self.client.wire.read().await? {
                Incoming::Message(Message::CopyData(body)) => {
                    return Ok(ReplicationMessage::parse(body.into_bytes())?);
                }
                Incoming::Message(Message::CopyDone | Message::CommandComplete(_)) => {
                    return Err(Error::StreamEnded)
                }
                Incoming::Message(Message::ErrorResponse(body)) => {
                    return Err(Error::from_response(&body))
                }
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
            .write(&mut self.client.wire.write_buf);
        self.client.wire.flush().await
    }

    /// The walsender's process id.
    pub fn backend_pid(&self) -> Option<i32> {
        self.client.backend_pid
    }

    /// Ends the stream cleanly: CopyDone, wait (bounded) for the server's
    /// acknowledgement, then Terminate. Errors are not reported: the
    /// connection is going away either way.
    pub async fn close(mut self) {
        frontend::copy_done(&mut self.client.wire.write_buf);
        if self.client.wire.flush().await.is_err() {
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(m) = self.client.wire.read().await {
                if matches!(m, Incoming::Message(Message::ReadyForQuery(_))) {
                    break;
                }
            }
        })
        .await;
        frontend::terminate(&mut self.client.wire.write_buf);
        let _ = self.client.wire.flush().await;
    }
}

/// A stream just started: the stream, the slot as it was then, and the
/// server's identity (whose system identifier and timeline say whether LSNs
/// of an earlier session compare with this one's).
#[derive(Debug)]
pub struct Started {
    /// The stream.
    pub stream: LogicalReplicationStream,
    /// The slot, read after `START_REPLICATION`.
    pub slot: SlotStatus,
    /// `IDENTIFY_SYSTEM`, read before it.
    pub system: IdentifySystem,
}

/// Starts streaming `slot` and then re-reads the slot over `control`, as the
/// run loop must: a slot dropped or invalidated meanwhile is a definite error
/// ([`Error::SlotMissing`], [`Error::SlotInvalidated`]), not an endless retry.
pub async fn start_streaming(
    config: &PgConfig,
    control: &Client,
    slot: &str,
    start: Lsn,
    options: &ReplicationOptions,
) -> Result<Started, Error> {
    let refusal = |e: Error| e.explain_replication_refusal(config.user());
    let mut client = ReplicationClient::connect(config).await.map_err(refusal)?;
    let system = client.identify_system().await.map_err(refusal)?;
    let stream = client
        .start_logical_replication(slot, start, options)
        .await
        .map_err(refusal)?;
    let status = check_slot_usable(control, slot).await?;
    Ok(Started {
        stream,
        slot: status,
        system,
    })
}

/// After `START_REPLICATION`: the slot must still exist and be usable. A
/// missing slot is [`Error::SlotMissing`], a lost one [`Error::SlotInvalidated`].
pub async fn check_slot_usable(client: &Client, slot: &str) -> Result<SlotStatus, Error> {
    let status = slot_status(client, slot)
        .await?
        .ok_or_else(|| Error::SlotMissing {
            slot: slot.to_owned(),
        })?;
    if status.wal_status.as_deref() == Some("lost") {
        return Err(Error::SlotInvalidated {
            slot: slot.to_owned(),
        });
    }
    Ok(status)
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
}
