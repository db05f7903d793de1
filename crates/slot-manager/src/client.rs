//! A connection in replication mode (`replication=database`): what it
//! knows of its server, simple replication commands, and the way into
//! streaming ([`ReplicationClient::start_logical_replication`], in
//! `stream.rs`).

use pgoutput_decoder::Lsn;

use crate::error::Error;
use crate::wire::{unexpected, Wire};

/// `IDENTIFY_SYSTEM`'s answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifySystem {
    /// The cluster's system identifier.
    pub system_id: String,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database this session is connected to.
    pub dbname: Option<String>,
}

/// A connection in replication mode (`replication=database`); open one with
/// [`ReplicationClient::connect`].
pub struct ReplicationClient {
    pub(crate) wire: Wire,
    pub(crate) backend_pid: Option<i32>,
    pub(crate) server_version: Option<String>,
}

impl std::fmt::Debug for ReplicationClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationClient")
            .field("target", &self.wire.target)
            .field("backend_pid", &self.backend_pid)
            .finish()
    }
}

impl ReplicationClient {
    /// The walsender's process id.
    pub fn backend_pid(&self) -> Option<i32> {
        self.backend_pid
    }

    /// The server's `server_version`.
    pub fn server_version(&self) -> Option<&str> {
        self.server_version.as_deref()
    }

    /// Runs a simple query (replication commands included) and returns its
    /// rows as text.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, Error> {
        self.wire.simple_query(sql).await
    }

    /// `IDENTIFY_SYSTEM`.
    pub async fn identify_system(&mut self) -> Result<IdentifySystem, Error> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = rows
            .first()
            .filter(|r| r.len() >= 3)
            .ok_or_else(|| unexpected("answer", "IDENTIFY_SYSTEM"))?;
        let text = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
        Ok(IdentifySystem {
            system_id: text(0),
            timeline: text(1)
                .parse()
                .map_err(|_| unexpected("timeline", "IDENTIFY_SYSTEM"))?,
            xlogpos: text(2)
                .parse()
                .map_err(|_| unexpected("xlogpos", "IDENTIFY_SYSTEM"))?,
            dbname: row.get(3).cloned().flatten(),
        })
    }
}
