//! Everything walbox does to Postgres other than decoding bytes.
//!
//! This crate owns the server side of a connector's life:
//!
//! * the publication on the outbox table and the `pgoutput` logical replication
//!   slot (create, inspect, drop), over ordinary SQL;
//! * the replication-mode connection (`replication=database`) that streams the
//!   slot, built on `postgres-protocol` and tokio because upstream
//!   tokio-postgres has no replication mode;
//! * the standby status update on the wire (its content, what may be
//!   confirmed and when, is the caller's: walbox's `progress` module).
//!
//! It depends on `pgoutput-decoder` for the bytes and knows nothing of Kafka.
//!
//! Errors say what to do about them: [`Error::is_transient`] separates what
//! a run loop should retry (network, server restart, a slot busy elsewhere)
//! from what must stop the process with its message (authentication, a
//! missing slot or table, `wal_level` not logical).

mod config;
mod control;
mod error;
mod replication;
mod sql;
mod tls;

pub use config::{PgConfig, SslMode};
pub use control::{
    check_slot_usable, connect_control, drop_slot, ensure_publication, ensure_slot, preflight,
    slot_status, start_streaming, Dropped, Ensured, SlotStatus,
};
pub use error::Error;
pub use replication::{
    IdentifySystem, LogicalReplicationStream, ReplicationClient, ReplicationOptions, Streaming,
};
pub use sql::{quote_ident, quote_literal, ParseTableNameError, TableName};
