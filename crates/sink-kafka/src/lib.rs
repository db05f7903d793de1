//! The Kafka side of walbox.
//!
//! This crate owns producing: an rdkafka producer configured to protect the
//! delivery contract, records that carry an opaque *ack token*, and the delivery
//! reports that tell the caller each token's fate. It knows nothing of Postgres:
//! the caller decides what a token means (walbox uses it to find the
//! transaction, and so the LSN, an event came from).
//!
//! Today it provides the record type ([`Record`]) and the producer settings the
//! delivery contract rests on ([`contract_defaults`]).

mod config;
mod record;

pub use config::{contract_defaults, CONTRACT_PINNED};
pub use record::{Header, Record};
