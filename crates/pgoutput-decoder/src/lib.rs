//! Decoding of Postgres logical replication streams that use the `pgoutput` plugin.
//!
//! This crate owns the bytes: it turns the payload of a replication `CopyData`
//! message into typed values and encodes the one message a client sends back
//! (the standby status update). It does no I/O and knows nothing of sockets,
//! tokio or Kafka, so every parser can be tested and fuzzed from byte fixtures.
//!
//! What lives here:
//!
//! * [`Lsn`]: a WAL position (`X/Y`), with parsing, formatting, ordering and
//!   byte distances.
//!
//! Every decoder in this crate checks each length against the bytes that remain
//! before using it: malformed input is an error carrying the byte offset and what
//! was expected, never a panic and never an allocation sized by an unchecked length.

mod lsn;

pub use lsn::{Lsn, ParseLsnError};
