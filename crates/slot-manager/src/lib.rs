//! Everything walbox does to Postgres other than decoding bytes.
//!
//! This crate owns the server side of a connector's life:
//!
//! * the publication on the outbox table and the `pgoutput` logical replication
//!   slot (create, inspect, drop), over ordinary SQL;
//! * the replication-mode connection (`replication=database`) that streams the
//!   slot, built on `postgres-protocol` and tokio because upstream
//!   tokio-postgres has no replication mode;
//! * LSN feedback: the standby status updates that move the slot's
//!   `confirmed_flush_lsn` forward, never backward and never past what the
//!   caller confirmed.
//!
//! It depends on `pgoutput-decoder` for the bytes and knows nothing of Kafka.
//!
//! Today it provides the SQL building blocks those operations share:
//! [`quote_ident`], [`quote_literal`] and [`TableName`].

mod sql;

pub use sql::{quote_ident, quote_literal, ParseTableNameError, TableName};
