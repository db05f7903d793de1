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
//! | module | concern |
//! |---|---|
//! | `config` | the connection string, TLS settings, never the password in output |
//! | `tls` | rustls with libpq's `sslmode` semantics, for both connections |
//! | `wire` | framing on one socket: whole messages (cancel-safe, bounded), simple queries |
//! | `startup` | socket, TLS negotiation, startup and authentication |
//! | `client` | a replication-mode connection and its commands |
//! | `stream` | `START_REPLICATION`, the CopyBoth stream, [`start_streaming`] |
//! | `control` | preflight, publication and slot lifecycle, slot status over SQL |
//! | `tables` | the outbox tables: a list or patterns, and picking up a new one safely |
//! | `error` | one error type; server errors from either connection built in one place |
//!
//! Errors say what to do about them: [`Error::is_transient`] separates what
//! a run loop should retry (network, server restart, a slot busy elsewhere)
//! from what must stop the process with its message (authentication, a
//! missing slot or table, `wal_level` not logical).

mod binding;
mod client;
mod config;
mod conninfo;
mod control;
mod coverage;
mod error;
mod pgpass;
mod shard;
mod sql;
mod startup;
mod stream;
mod tables;
mod tls;
mod wire;

pub use client::{ExportedSlot, IdentifySystem, ReplicationClient};
pub use config::{PgConfig, SslMode, TargetSession};
pub use control::{
    check_server, check_table, connect_control, domain_base_types, drop_slot,
    ensure_message_publication, ensure_publication, ensure_slot, ensure_tables_publication,
    pending_events, preflight, slot_status, Dropped, Ensured, Pending, SlotStatus, LEAST_SERVER,
    MAY_REPLICATE,
};
pub use coverage::{
    coverage, describe_change, message_coverage, ChangeInFlight, Coverage, CoverageReader,
    TableCoverage,
};
pub use error::Error;
pub use shard::{ShardFilter, LEAST_SHARDED_SERVER, MAX_SHARDS};
pub use sql::{
    quote_ident, quote_literal, quote_replication_literal, ParseTableNameError, TableName,
    MAX_NAME_BYTES,
};
pub use stream::{
    check_slot_usable, start_streaming, LogicalReplicationStream, ReplicationOptions, Started,
    Streaming,
};
pub use tables::{
    joined, pick_up, publication_tables, rows_before_joining, EarlierRows, Joined, OutboxTables,
    PickUp, EARLIER_ROWS_COUNTED,
};
