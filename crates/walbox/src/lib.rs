//! The walbox connector: the outbox mapping, the ack tracker that decides
//! which WAL position may be confirmed, and (with the binary) the CLI.
//!
//! The binary (`src/main.rs`) is the operator surface; this library holds the
//! logic it runs, so it can be tested without processes.

pub mod acks;
pub mod config;
pub mod mapping;
pub mod metrics;
pub mod relay;
