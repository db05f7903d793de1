//! Where events come from: rows of the outbox table, logical decoding
//! messages, or both. A leaf: the configuration chooses it, the relay and
//! the exactly-once progress record read it.

use serde::{Deserialize, Serialize};

/// Where events come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventSource {
    /// Rows inserted into the outbox table.
    #[default]
    Table,
    /// Transactional logical decoding messages with the configured prefix
    /// (`walbox.emit`, `pg_logical_emit_message`; Postgres 14+).
    Messages,
    /// Both, in commit order.
    Both,
}

impl EventSource {
    /// Rows of the outbox table are events.
    pub fn table(self) -> bool {
        self != EventSource::Messages
    }

    /// Logical decoding messages are events.
    pub fn messages(self) -> bool {
        self != EventSource::Table
    }
}
