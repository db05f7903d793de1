//! The walbox connector: configuration, the outbox mapping, the progress
//! that decides which WAL position may be confirmed, the dead-letter policy,
//! the relay loop, metrics, and the subcommands the binary dispatches to.
//!
//! The binary (`src/main.rs`) only parses the command line and dispatches;
//! everything it runs is here, so it can be tested without processes.

pub mod audit;
pub mod backfill;
pub mod backlog;
pub mod bookkeeping;
pub mod broker;
pub mod claim_check;
pub mod commands;
pub mod config;
pub mod continuous_audit;
pub mod dead_letter;
pub mod doctor;
pub mod error_text;
pub mod event_source;
pub mod exactly_once;
pub mod logging;
pub mod mapping;
pub mod metrics;
pub mod progress;
pub mod quarantine;
pub mod readback;
pub mod receipts;
pub mod redaction;
pub mod relay;
pub mod retention;
pub mod schema_registry;
pub mod spans;
pub mod stall;
pub mod table_fit;
pub mod testpoint;
