//! The continuous audit inside `walbox run` (`audit.interval`): every
//! interval, one event the broker acknowledged is read back from its
//! partition (Kafka) or stream (NATS JetStream: partition 0, offset the
//! stream sequence), with the records around it, on a reader of its own
//! ([`Readback::read_range`]). It
//! proves what an acknowledgement alone cannot: that the broker still holds
//! the event (retention, `DeleteRecords`, an unclean leader election or a
//! compaction can take an acknowledged record away), and how many copies
//! of it sit near it (a reconnect's or a restart's re-sends land within
//! the in-flight bound after the original).
//!
//! The relay's core takes part through a [`Tap`]: when the audit wants a
//! sample, the next event queued is marked in its token, and its
//! delivery report hands the id, topic, partition and offset back. An
//! event costs the relay one atomic load; the primary nothing (the outbox
//! table is never read).
//!
//! Counted (`walbox_audit_*_total`):
//! - **checked**: the record at the acknowledged offset carries the event's id;
//! - **missing**: the offset is below the partition's first (deleted), or
//!   its record is gone (at least once; in exactly-once mode a record
//!   `read_committed` does not see may be of an aborted transaction, whose
//!   events were written again: not counted);
//! - **duplicates**: copies of the id beyond the first within
//!   [`NEIGHBOURS`] offsets either side.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sink_core::readback::ReadBack;
use sink_core::Delivered;

use crate::readback::Readback;

use crate::mapping::ID_HEADER;
use crate::metrics::Metrics;

/// Records read either side of a sample for its copies.
pub const NEIGHBOURS: i64 = 1_000;
/// Samples waiting to be verified, at most (more are not taken).
const MAX_PENDING: usize = 16;
/// Tries before a sample that is not readable yet is given up.
const MAX_TRIES: u32 = 10;
/// How long reading a sample may stand still.
const STALL: Duration = Duration::from_secs(10);

/// An acknowledged event to read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Its id.
    pub id: Box<str>,
    /// Where it landed: the Kafka topic, or the JetStream stream.
    pub topic: Arc<str>,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    tries: u32,
}

/// The relay's side of the audit: asked for a sample, it tags one event.
#[derive(Debug, Default)]
pub struct Tap {
    want: AtomicBool,
    pending: Mutex<VecDeque<Sample>>,
}

impl Tap {
    /// A tap that wants nothing until [`Tap::ask`].
    pub fn new() -> Arc<Tap> {
        Arc::new(Tap::default())
    }

    /// The next event queued is sampled.
    pub fn ask(&self) {
        self.want.store(true, Ordering::Relaxed);
    }

    /// Called for each event queued: whether it is the one sampled.
    pub fn take(&self) -> bool {
        self.want.load(Ordering::Relaxed) && self.want.swap(false, Ordering::Relaxed)
    }

    /// A sampled event's acknowledgement.
    pub fn delivered(&self, id: &str, topic: &Arc<str>, at: &Delivered) {
        // Brokers whose acknowledgement says where the event is (the
        // configuration refuses the others).
        let (topic, partition, offset) = match at {
            Delivered::Kafka { partition, offset } => (Arc::clone(topic), *partition, *offset),
            Delivered::Nats {
                stream,
                sequence,
                duplicate: false,
            } => (
                Arc::from(stream.as_str()),
                0,
                i64::try_from(*sequence).unwrap_or(i64::MAX),
            ),
            _ => return,
        };
        if let Ok(mut pending) = self.pending.lock() {
            if pending.len() < MAX_PENDING {
                pending.push_back(Sample {
                    id: id.into(),
                    topic,
                    partition,
                    offset,
                    tries: 0,
                });
            }
        }
    }

    /// The samples acknowledged and not verified yet, taken.
    pub(crate) fn drain(&self) -> Vec<Sample> {
        self.pending
            .lock()
            .map(|mut p| p.drain(..).collect())
            .unwrap_or_default()
    }

    fn put_back(&self, sample: Sample) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.push_front(sample);
        }
    }
}

/// What reading a sample back found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// On the broker, with this many more copies near it.
    Held {
        /// Copies beyond the first.
        duplicates: u64,
    },
    /// Gone: below the partition's first offset (`deleted`), or its record
    /// is not there.
    Missing {
        /// Deleted (below the first offset) rather than absent.
        deleted: bool,
    },
    /// Not readable yet (a transaction still open, the broker slow): try
    /// again later.
    NotYet,
    /// Exactly-once: `read_committed` does not show it; it may be of an
    /// aborted transaction.
    Unverifiable,
}

/// Judges what [`read_range`] found around `sample`: the partition's first
/// offset, how far the reading got, whether the record at the offset carries
/// the id (`None`: no record there), and the copies of the id seen.
pub fn judge(
    sample_offset: i64,
    low: i64,
    read_to: i64,
    at_offset: Option<bool>,
    copies: u64,
    exactly_once: bool,
) -> Verdict {
    if sample_offset < low {
        return Verdict::Missing { deleted: true };
    }
    match at_offset {
        Some(true) => Verdict::Held {
            duplicates: copies.saturating_sub(1),
        },
        _ if read_to <= sample_offset => Verdict::NotYet,
        _ if exactly_once => Verdict::Unverifiable,
        _ => Verdict::Missing { deleted: false },
    }
}

/// What reading around a sample saw: whether the record at its offset
/// carries its id (`None`: no record there), and the copies of the id.
struct Around {
    id: Box<str>,
    offset: i64,
    at_offset: Option<bool>,
    copies: u64,
}

impl crate::readback::Each for Around {
    fn each(&mut self, r: &dyn ReadBack) -> Result<(), String> {
        let same = r.header(ID_HEADER) == Some(self.id.as_bytes());
        self.copies += u64::from(same);
        if r.offset() == self.offset {
            self.at_offset = Some(same);
        }
        Ok(())
    }
}

/// Reads `sample` back.
async fn verify(
    readback: &Readback,
    sample: &Sample,
    exactly_once: bool,
) -> Result<Verdict, String> {
    let around = Around {
        id: sample.id.clone(),
        offset: sample.offset,
        at_offset: None,
        copies: 0,
    };
    let (read, around) = readback
        .read_range(
            &sample.topic,
            sample.partition,
            (
                sample.offset.saturating_sub(NEIGHBOURS),
                sample.offset.saturating_add(NEIGHBOURS + 1),
            ),
            STALL,
            around,
        )
        .await?;
    Ok(judge(
        sample.offset,
        read.low,
        read.read_to,
        around.at_offset,
        around.copies,
        exactly_once,
    ))
}

/// Runs the audit until the process ends: each `interval`, reads back the
/// samples taken, then asks for the next.
pub async fn run(
    tap: Arc<Tap>,
    readback: Readback,
    interval: Duration,
    exactly_once: bool,
    metrics: Arc<Metrics>,
) {
    tap.ask();
    loop {
        tokio::time::sleep(interval).await;
        for mut sample in tap.drain() {
            let verdict = verify(&readback, &sample, exactly_once).await;
            match verdict {
                Ok(Verdict::Held { duplicates }) => {
                    metrics.audit_checked.inc();
                    metrics.audit_duplicates.inc_by(duplicates);
                    if duplicates > 0 {
                        tracing::info!(event_id = %sample.id, topic = %sample.topic, partition = sample.partition, offset = sample.offset, duplicates, "audit: the event has copies near it on the broker (re-sent after a reconnect or restart; consumers deduplicate by its id)");
                    }
                }
                Ok(Verdict::Missing { deleted }) => {
                    metrics.audit_checked.inc();
                    metrics.audit_missing.inc();
                    let why = if deleted {
                        "below the partition's first offset: deleted (retention, DeleteRecords)"
                    } else {
                        "no record at its offset any more (compaction, or a broker that lost it)"
                    };
                    tracing::error!(event_id = %sample.id, topic = %sample.topic, partition = sample.partition, offset = sample.offset, "audit: an event the broker acknowledged is gone from it: {why}");
                }
                Ok(Verdict::Unverifiable) => {
                    tracing::debug!(event_id = %sample.id, "audit: not visible to read_committed (an aborted transaction's record); not counted");
                }
                Ok(Verdict::NotYet) | Err(_) => {
                    if let Err(e) = &verdict {
                        tracing::debug!(error = %e, "audit: reading a sample back failed; tried again later");
                    }
                    sample.tries += 1;
                    if sample.tries < MAX_TRIES {
                        tap.put_back(sample);
                    } else {
                        tracing::warn!(event_id = %sample.id, topic = %sample.topic, partition = sample.partition, offset = sample.offset, "audit: could not read the event back {MAX_TRIES} times; not counted");
                    }
                }
            }
        }
        tap.ask();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_at_its_offset_with_its_id_is_held_with_its_nearby_copies() {
        assert_eq!(
            judge(10, 0, 2001, Some(true), 1, false),
            Verdict::Held { duplicates: 0 }
        );
        assert_eq!(
            judge(10, 0, 2001, Some(true), 3, false),
            Verdict::Held { duplicates: 2 }
        );
    }

    #[test]
    fn an_offset_below_the_first_is_deleted_whatever_else() {
        assert_eq!(
            judge(10, 11, 11, None, 0, false),
            Verdict::Missing { deleted: true }
        );
        assert_eq!(
            judge(10, 11, 11, None, 0, true),
            Verdict::Missing { deleted: true }
        );
    }

    #[test]
    fn a_record_gone_from_a_partition_read_past_it_is_missing_unless_transactional() {
        assert_eq!(
            judge(10, 0, 50, None, 0, false),
            Verdict::Missing { deleted: false }
        );
        assert_eq!(
            judge(10, 0, 50, Some(false), 0, false),
            Verdict::Missing { deleted: false }
        );
        assert_eq!(judge(10, 0, 50, None, 0, true), Verdict::Unverifiable);
    }

    #[test]
    fn a_partition_not_read_up_to_the_offset_is_tried_again() {
        assert_eq!(judge(10, 0, 10, None, 0, false), Verdict::NotYet);
        assert_eq!(judge(10, 0, 5, None, 0, true), Verdict::NotYet);
    }

    #[test]
    fn the_tap_samples_one_event_per_ask_and_bounds_what_waits() {
        let tap = Tap::new();
        assert!(!tap.take());
        tap.ask();
        assert!(tap.take());
        assert!(!tap.take());
        let topic: Arc<str> = Arc::from("t");
        for i in 0..100 {
            tap.delivered(
                "b",
                &topic,
                &Delivered::Kafka {
                    partition: 0,
                    offset: i,
                },
            );
        }
        let drained = tap.drain();
        assert_eq!(drained.len(), MAX_PENDING);
        assert_eq!(drained[0].offset, 0);
        assert!(tap.drain().is_empty());
    }
}
