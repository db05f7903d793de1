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

/// A slot made by [`ReplicationClient::create_slot_exporting_snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedSlot {
    /// Where streaming from the slot starts: every transaction that commits
    /// after it is streamed, every earlier one is in the snapshot.
    pub consistent_point: Lsn,
    /// The snapshot's name, for `SET TRANSACTION SNAPSHOT` in another
    /// session. It exists only while this connection stays open and runs
    /// no other command.
    pub snapshot: String,
}

impl ReplicationClient {
    /// Creates the pgoutput slot `slot` and exports the snapshot of its
    /// consistent point: what a reader of the snapshot sees and what the
    /// slot streams meet exactly, with no gap and no overlap.
    ///
    /// `slot` must be a valid slot name (lower-case letters, digits,
    /// underscores). `failover` needs Postgres 17.
    pub async fn create_slot_exporting_snapshot(
        &mut self,
        slot: &str,
        failover: bool,
    ) -> Result<ExportedSlot, Error> {
        if slot.is_empty()
            || !slot
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(Error::Config(format!(
                "slot {slot:?}: slot names are lower-case letters, digits and underscores"
            )));
        }
        let version = self.server_version_num();
        if failover && version < 170_000 {
            return Err(Error::Precondition(format!(
                "failover slots need Postgres 17 or later; this server is {}",
                version / 10_000
            )));
        }
        // The option list arrived in Postgres 15; the keyword form is the
        // only one before it.
        let command = match (version >= 150_000, failover) {
            (true, true) => format!(
                "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
            ),
            (true, false) => {
                format!("CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export')")
            }
            (false, _) => {
                format!("CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput EXPORT_SNAPSHOT")
            }
        };
        let rows = self.simple_query(&command).await?;
        // slot_name, consistent_point, snapshot_name, output_plugin
        let row = rows
            .first()
            .filter(|r| r.len() >= 3)
            .ok_or_else(|| unexpected("answer", "CREATE_REPLICATION_SLOT"))?;
        let consistent_point = row[1]
            .as_deref()
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| unexpected("consistent_point", "CREATE_REPLICATION_SLOT"))?;
        let snapshot = row[2]
            .clone()
            .ok_or_else(|| unexpected("snapshot_name", "CREATE_REPLICATION_SLOT"))?;
        Ok(ExportedSlot {
            consistent_point,
            snapshot,
        })
    }

    /// `server_version` as a number (`150004`); 0 when unknown.
    fn server_version_num(&self) -> i32 {
        let Some(v) = self.server_version() else {
            return 0;
        };
        let mut parts = v
            .split(|c: char| !c.is_ascii_digit())
            .filter(|p| !p.is_empty())
            .map(|p| p.parse::<i32>().unwrap_or(0));
        let major = parts.next().unwrap_or(0);
        let minor = parts.next().unwrap_or(0);
        major * 10_000 + minor
    }
}
