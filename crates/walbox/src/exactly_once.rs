//! Exactly-once delivery: the rule, and the progress record that carries it.
//!
//! # The rule
//!
//! In exactly-once mode the events of one or more Postgres transactions go
//! into one Kafka transaction, and its last record is a *progress record*:
//! how far into the slot's stream the events inside reach. Kafka makes the
//! events and the record visible together, or neither. So the last
//! committed progress record says exactly what a `read_committed` consumer
//! has seen, and on a restart (or a new session) walbox skips what
//! Postgres re-sends up to it:
//!
//! - a replayed transaction whose commit LSN is below the record's, or
//!   equal to it when the record covers the whole transaction: all its
//!   events are skipped;
//! - the transaction the record names with an event count (a transaction
//!   too large for one Kafka transaction is split; see [`Bounds`]): its
//!   first that many outbox rows are skipped, the rest published;
//! - anything later: published.
//!
//! The slot is confirmed only after the Kafka transaction holding its
//! events committed, so Postgres never forgets an event Kafka has not
//! shown. Counting outbox rows is deterministic: a replay decodes the same
//! WAL into the same rows in the same order.
//!
//! LSNs compare only within one server history (system identifier and
//! timeline): a record written before a failover or a restore is not used
//! to skip anything on the new history (the slot's position rules; events
//! after it may repeat), and walbox says so.
//!
//! # The record
//!
//! Key: the transactional id. Value: JSON, versioned:
//! `{"version":1,"slot":"walbox","history":"system 7… timeline 1",
//! "commit_lsn":"0/16B3748","events":null,"walbox":"0.1.0"}` (`events`: null
//! for the whole transaction, or how many of its outbox rows were written).
//! The topic is compacted, so the last record per key is kept for good.

use std::time::Duration;

use pgoutput_decoder::Lsn;

use crate::event_source::EventSource;
use serde::{Deserialize, Serialize};

/// The progress record's format version.
const VERSION: u32 = 1;

/// Where the committed events reach in the slot's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Position {
    /// The server history the LSN belongs to.
    pub history: String,
    /// The commit LSN of the last Postgres transaction with events inside.
    pub commit_lsn: Lsn,
    /// `None`: that whole transaction; `Some(n)`: its first `n` outbox rows.
    pub events: Option<u64>,
    /// What `events` counts: the `source` of the run that wrote the record
    /// (rows, messages, or both). `None` in records of walbox versions that
    /// did not say.
    pub counts: Option<EventSource>,
}

/// What to do with a replayed transaction's outbox rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Publish them all.
    Nothing,
    /// Publish none: Kafka has them.
    All,
    /// Skip the first this many, publish the rest.
    First(u64),
}

impl Skip {
    /// True when the outbox row at `index` (0-based) in its transaction is skipped.
    pub fn skips(self, index: u64) -> bool {
        match self {
            Skip::Nothing => false,
            Skip::All => true,
            Skip::First(n) => index < n,
        }
    }
}

impl Position {
    /// What the transaction committing at `commit_lsn`, on `history`, has
    /// in Kafka already.
    pub fn skip(&self, history: &str, commit_lsn: Lsn) -> Skip {
        if history != self.history || commit_lsn > self.commit_lsn {
            return Skip::Nothing;
        }
        match self.events {
            Some(n) if commit_lsn == self.commit_lsn => Skip::First(n),
            _ => Skip::All,
        }
    }

    /// True when the record lies past `server_wal`, the end of the server's
    /// WAL: it cannot describe this WAL (see [`Position::skip`]), whose
    /// transactions at those positions came after a restore.
    pub fn beyond(&self, server_wal: Lsn) -> bool {
        self.commit_lsn > server_wal
    }

    /// The record's value.
    pub fn encode(&self, slot: &str) -> Vec<u8> {
        serde_json::to_vec(&Record {
            version: VERSION,
            slot: slot.to_owned(),
            history: self.history.clone(),
            commit_lsn: self.commit_lsn.to_string(),
            events: self.events,
            counts: self.counts,
            walbox: env!("CARGO_PKG_VERSION").to_owned(),
        })
        .expect("a record serialises")
    }

    /// Reads a record's value; the error says what is wrong with it.
    pub fn decode(value: &[u8]) -> Result<Position, String> {
        let r: Record =
            serde_json::from_slice(value).map_err(|e| format!("not a progress record: {e}"))?;
        if r.version != VERSION {
            return Err(format!(
                "progress record version {} (this walbox reads {VERSION})",
                r.version
            ));
        }
        let commit_lsn = r
            .commit_lsn
            .parse()
            .map_err(|_| format!("commit_lsn {:?} is not an LSN", r.commit_lsn))?;
        Ok(Position {
            history: r.history,
            commit_lsn,
            events: r.events,
            counts: r.counts,
        })
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.events {
            None => write!(f, "transaction {} (all of it)", self.commit_lsn),
            Some(n) => write!(
                f,
                "transaction {} (its first {n} outbox rows)",
                self.commit_lsn
            ),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct Record {
    version: u32,
    slot: String,
    history: String,
    commit_lsn: String,
    events: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    counts: Option<EventSource>,
    walbox: String,
}

/// When a Kafka transaction is committed: whichever bound is reached first.
/// A Postgres transaction larger than the event or byte bound is split
/// across Kafka transactions, so memory stays bounded whatever its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Events (and dead-letter copies) in one Kafka transaction.
    pub max_events: usize,
    /// Their bytes.
    pub max_bytes: usize,
    /// How long a Kafka transaction stays open after its first record: the
    /// most an event waits to become visible, beyond the commit itself.
    pub max_time: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_events: 10_000,
            max_bytes: 16 * 1024 * 1024,
            max_time: Duration::from_millis(20),
        }
    }
}

/// What exactly-once mode needs to know.
#[derive(Clone, Debug)]
pub struct ExactlyOnce {
    /// The compacted topic of progress records.
    pub progress_topic: String,
    /// The transactional id: also the progress record's key.
    pub transactional_id: String,
    /// The slot, written into each record for operators.
    pub slot: String,
    /// Where events come from: what a record's event count counts.
    pub source: EventSource,
    /// When to commit.
    pub bounds: Bounds,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(lsn: u64, events: Option<u64>) -> Position {
        Position {
            history: "h1".into(),
            commit_lsn: Lsn::from(lsn),
            events,
            counts: Some(EventSource::Table),
        }
    }

    #[test]
    fn replays_up_to_the_committed_position_are_skipped() {
        let whole = at(1000, None);
        assert_eq!(whole.skip("h1", Lsn::from(999)), Skip::All);
        assert_eq!(whole.skip("h1", Lsn::from(1000)), Skip::All);
        assert_eq!(whole.skip("h1", Lsn::from(1001)), Skip::Nothing);
        let part = at(1000, Some(3));
        assert_eq!(part.skip("h1", Lsn::from(999)), Skip::All);
        assert_eq!(part.skip("h1", Lsn::from(1000)), Skip::First(3));
        assert_eq!(part.skip("h1", Lsn::from(1001)), Skip::Nothing);
        assert!(Skip::First(3).skips(2) && !Skip::First(3).skips(3));
    }

    #[test]
    fn another_history_skips_nothing() {
        assert_eq!(at(1000, None).skip("h2", Lsn::from(5)), Skip::Nothing);
    }

    #[test]
    fn the_record_round_trips_and_bad_ones_are_named() {
        let p = at(0x16B_3748, Some(7));
        let value = p.encode("walbox");
        let text = String::from_utf8(value.clone()).unwrap();
        assert!(text.contains("\"commit_lsn\":\"0/16B3748\""), "{text}");
        assert!(text.contains("\"slot\":\"walbox\""), "{text}");
        assert_eq!(Position::decode(&value).unwrap(), p);
        assert!(Position::decode(b"{}")
            .unwrap_err()
            .contains("not a progress record"));
        let future = text.replace("\"version\":1", "\"version\":9");
        assert!(Position::decode(future.as_bytes())
            .unwrap_err()
            .contains("version 9"));
        let bad = text.replace("0/16B3748", "nope");
        assert!(Position::decode(bad.as_bytes())
            .unwrap_err()
            .contains("nope"));
    }
}
