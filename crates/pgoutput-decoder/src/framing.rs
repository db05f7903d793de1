//! Replication framing: what travels inside `CopyData` on a replication
//! connection, around the output plugin's messages.
//!
//! From the server: [`XLogData`](ReplicationMessage::XLogData) (`w`) carries
//! one pgoutput message; a [primary keepalive](ReplicationMessage::PrimaryKeepalive)
//! (`k`) reports the server's WAL end and may ask for a reply. To the server:
//! the [standby status update](StandbyStatusUpdate) (`r`) reports how far the
//! client has written, flushed and applied; `flush` is what moves the slot.

use bytes::{BufMut, Bytes, BytesMut};

use crate::error::{DecodeError, DecodeErrorKind};
use crate::lsn::Lsn;
use crate::reader::Reader;
use crate::time::PgTimestamp;

/// A message from the server inside a replication `CopyData`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplicationMessage {
    /// WAL data: one output plugin message.
    XLogData(XLogDataBody),
    /// The server's position and clock, possibly asking for a status update.
    PrimaryKeepalive(PrimaryKeepaliveBody),
}

impl ReplicationMessage {
    /// Decodes the payload of one `CopyData` message. `frame` must hold exactly
    /// one message; the `XLogData` payload is a slice of it (no copy).
    pub fn parse(frame: Bytes) -> Result<ReplicationMessage, DecodeError> {
        let mut r = Reader::new(frame, "replication message");
        if r.remaining() == 0 {
            return Err(r.error(DecodeErrorKind::Empty));
        }
        match r.u8("tag")? {
            b'w' => {
                r.rename("XLogData");
                let wal_start = r.lsn("WAL start")?;
                let wal_end = r.lsn("WAL end")?;
                let server_time = PgTimestamp::from_pg_micros(r.i64("server time")?);
                let data = r.bytes(r.remaining(), "data")?;
                Ok(ReplicationMessage::XLogData(XLogDataBody {
                    wal_start,
                    wal_end,
                    server_time,
                    data,
                }))
            }
            b'k' => {
                r.rename("primary keepalive");
                let wal_end = r.lsn("WAL end")?;
                let server_time = PgTimestamp::from_pg_micros(r.i64("server time")?);
                let at = r.position();
                let reply = match r.u8("reply flag")? {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(r.error_at(
                            at,
                            DecodeErrorKind::UnexpectedMarker {
                                found: other as char,
                                expected: "0 or 1",
                            },
                        ))
                    }
                };
                r.finish()?;
                Ok(ReplicationMessage::PrimaryKeepalive(PrimaryKeepaliveBody {
                    wal_end,
                    server_time,
                    reply_requested: reply,
                }))
            }
            other => Err(r.error_at(0, DecodeErrorKind::UnknownTag(other as char))),
        }
    }
}

/// `XLogData`: one output plugin message and the WAL range it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XLogDataBody {
    pub(crate) wal_start: Lsn,
    pub(crate) wal_end: Lsn,
    pub(crate) server_time: PgTimestamp,
    pub(crate) data: Bytes,
}

impl XLogDataBody {
    /// The WAL position of the data (0/0 for some messages, e.g. Commit's
    /// follow-ups; do not use it as a progress marker).
    pub fn wal_start(&self) -> Lsn {
        self.wal_start
    }

    /// The server's current end of WAL.
    pub fn wal_end(&self) -> Lsn {
        self.wal_end
    }

    /// The server's clock when it sent this.
    pub fn server_time(&self) -> PgTimestamp {
        self.server_time
    }

    /// The output plugin message (decode it with [`crate::Decoder`]).
    pub fn data(&self) -> &Bytes {
        &self.data
    }

    /// Takes the output plugin message.
    pub fn into_data(self) -> Bytes {
        self.data
    }
}

/// Primary keepalive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrimaryKeepaliveBody {
    pub(crate) wal_end: Lsn,
    pub(crate) server_time: PgTimestamp,
    pub(crate) reply_requested: bool,
}

impl PrimaryKeepaliveBody {
    /// The server's current end of WAL. With nothing in flight, a client may
    /// confirm up to here.
    pub fn wal_end(&self) -> Lsn {
        self.wal_end
    }

    /// The server's clock when it sent this.
    pub fn server_time(&self) -> PgTimestamp {
        self.server_time
    }

    /// The server asks for a status update at once (it is about to time the
    /// client out otherwise).
    pub fn reply_requested(&self) -> bool {
        self.reply_requested
    }
}

/// The standby status update a client sends to report progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    /// Last WAL position received and written.
    pub write: Lsn,
    /// Last WAL position durably processed: the slot's `confirmed_flush_lsn`
    /// moves here.
    pub flush: Lsn,
    /// Last WAL position applied.
    pub apply: Lsn,
    /// The client's clock.
    pub client_time: PgTimestamp,
    /// Ask the server to answer with a keepalive at once.
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// Size of the encoded message.
    pub const ENCODED_LEN: usize = 34;

    /// Appends the `CopyData` payload (`r` and its fields) to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.reserve(Self::ENCODED_LEN);
        buf.put_u8(b'r');
        buf.put_u64(self.write.as_u64());
        buf.put_u64(self.flush.as_u64());
        buf.put_u64(self.apply.as_u64());
        buf.put_i64(self.client_time.as_pg_micros());
        buf.put_u8(u8::from(self.reply_requested));
    }

    /// Decodes a status update (what a server, or a test playing one, reads).
    pub fn parse(frame: Bytes) -> Result<StandbyStatusUpdate, DecodeError> {
        let mut r = Reader::new(frame, "standby status update");
        match r.u8("tag")? {
            b'r' => {}
            other => return Err(r.error_at(0, DecodeErrorKind::UnknownTag(other as char))),
        }
        let update = StandbyStatusUpdate {
            write: r.lsn("write position")?,
            flush: r.lsn("flush position")?,
            apply: r.lsn("apply position")?,
            client_time: PgTimestamp::from_pg_micros(r.i64("client time")?),
            reply_requested: r.u8("reply flag")? != 0,
        };
        r.finish()?;
        Ok(update)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xlogdata(data: &[u8]) -> Vec<u8> {
        let mut v = vec![b'w'];
        v.extend_from_slice(&0x0000_0001_0000_0010u64.to_be_bytes());
        v.extend_from_slice(&0x0000_0001_0000_0020u64.to_be_bytes());
        v.extend_from_slice(&42i64.to_be_bytes());
        v.extend_from_slice(data);
        v
    }

    #[test]
    fn decodes_xlogdata_without_copying() {
        let frame = Bytes::from(xlogdata(b"B12345"));
        let base = frame.as_ptr() as usize;
        let ReplicationMessage::XLogData(x) = ReplicationMessage::parse(frame).unwrap() else {
            panic!("not XLogData")
        };
        assert_eq!(x.wal_start(), Lsn::new(0x1_0000_0010));
        assert_eq!(x.wal_end(), Lsn::new(0x1_0000_0020));
        assert_eq!(x.server_time().as_pg_micros(), 42);
        assert_eq!(&x.data()[..], b"B12345");
        assert_eq!(
            x.data().as_ptr() as usize,
            base + 25,
            "a slice of the frame"
        );
    }

    #[test]
    fn decodes_keepalives() {
        let mut v = vec![b'k'];
        v.extend_from_slice(&7u64.to_be_bytes());
        v.extend_from_slice(&9i64.to_be_bytes());
        v.push(1);
        let ReplicationMessage::PrimaryKeepalive(k) =
            ReplicationMessage::parse(Bytes::from(v.clone())).unwrap()
        else {
            panic!("not a keepalive")
        };
        assert_eq!((k.wal_end(), k.reply_requested()), (Lsn::new(7), true));

        v[17] = 2;
        let e = ReplicationMessage::parse(Bytes::from(v.clone())).unwrap_err();
        assert_eq!((e.message(), e.offset()), ("primary keepalive", 17));
        v[17] = 0;
        v.push(0);
        let e = ReplicationMessage::parse(Bytes::from(v)).unwrap_err();
        assert_eq!(e.kind(), &DecodeErrorKind::TrailingBytes(1));
    }

    #[test]
    fn rejects_malformed_frames() {
        let e = ReplicationMessage::parse(Bytes::new()).unwrap_err();
        assert_eq!(e.kind(), &DecodeErrorKind::Empty);
        let e = ReplicationMessage::parse(Bytes::from_static(b"x")).unwrap_err();
        assert_eq!(e.kind(), &DecodeErrorKind::UnknownTag('x'));
        let full = xlogdata(b"");
        for cut in 1..full.len() {
            let e = ReplicationMessage::parse(Bytes::copy_from_slice(&full[..cut])).unwrap_err();
            assert!(
                matches!(e.kind(), DecodeErrorKind::Truncated { .. }),
                "{cut}: {e}"
            );
            assert!(
                e.to_string().starts_with("malformed XLogData at byte "),
                "{e}"
            );
        }
    }

    #[test]
    fn status_update_round_trips() {
        let u = StandbyStatusUpdate {
            write: Lsn::new(3),
            flush: Lsn::new(2),
            apply: Lsn::new(2),
            client_time: PgTimestamp::from_pg_micros(-5),
            reply_requested: true,
        };
        let mut buf = BytesMut::new();
        u.encode(&mut buf);
        assert_eq!(buf.len(), StandbyStatusUpdate::ENCODED_LEN);
        assert_eq!(buf[0], b'r');
        assert_eq!(&buf[9..17], &2u64.to_be_bytes());
        assert_eq!(StandbyStatusUpdate::parse(buf.freeze()).unwrap(), u);
    }
}
