//! The quarantine policy (`on_failure = "quarantine"`), stated once: what
//! walbox does with an event that fails for good when neither stopping
//! (nothing else flows) nor a dead-letter topic (later events of its
//! aggregate overtake it) will do.
//!
//! - An event that fails for good (unmappable, or refused by the broker for
//!   good) is **held**: written, as the record it is or would be, to
//!   `walbox.quarantine` with its place in the stream, and its aggregate
//!   (the record key) is held from then on.
//! - Every later event of a held aggregate is held too, in stream order,
//!   instead of being sent: its aggregate's order is kept.
//! - Every other aggregate flows, and the slot advances past held events
//!   once they are written: a held event counts as delivered only when the
//!   write that holds it committed (the slot never passes an event that is
//!   neither acknowledged by the broker nor in `walbox.quarantine`).
//! - `walbox quarantine release KEY` asks the running walbox to republish
//!   the aggregate's held events in stream order; events of it that arrive
//!   meanwhile keep joining the quarantine, behind the ones being released,
//!   and the aggregate flows again only once none is left. A batch's rows
//!   are deleted only after the broker acknowledged all of it: a crash
//!   mid-release sends some again (at least once), never out of order, and
//!   never loses one. A released event refused again ends the release; the
//!   aggregate stays held, with the error shown by `walbox quarantine list`.
//!   Each batch's first event is sent alone, the rest once it is
//!   acknowledged: a cause not fixed yet refuses it before any later event
//!   of the aggregate is sent. (An event refused for its own sake later in
//!   a batch can be overtaken by the events after it in that batch.)
//! - `walbox quarantine drop KEY` deletes the aggregate's held events and
//!   lets it flow again: the one way an event is given up, on an operator's
//!   word.
//! - The quarantine is bounded (`quarantine.max_events`): an event that
//!   would exceed it stops walbox, with the slot before it.
//!
//! What it does not promise:
//! - A record refused by the broker for its own sake (its size) is learnt
//!   of from its delivery report: later events of its aggregate already
//!   sent by then (within the in-flight bounds) are not held back and reach
//!   the broker before it. Refusals of a whole topic (authorization, a missing
//!   topic) refuse those later events too, so they are held in order.
//! - An unmappable event can be held only when its aggregate id and topic
//!   can be read; one without (a NULL aggregate id) stops walbox. Its held
//!   record carries the payload as stored: fix it with SQL
//!   (`UPDATE walbox.quarantine SET value = …`) before releasing it, or drop
//!   the aggregate.
//! - At-least-once delivery only; backfills and heals stop on such an event.

use std::collections::HashMap;

use bytes::Bytes;
use pgoutput_decoder::Lsn;
use sink_core::Record;

/// An event's place in the stream: its transaction's commit position and
/// its index among the transaction's events. Held events are released in
/// this order, which is the order the stream delivered them in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    /// The commit position of the event's transaction.
    pub commit_lsn: Lsn,
    /// The event's index among its transaction's events, from 0.
    pub index: u64,
}

/// What the operator asked for a held aggregate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// Republish its held events in order, then let it flow.
    Release,
    /// Delete its held events, then let it flow.
    Drop,
}

impl Request {
    /// The word stored in `walbox.quarantined_keys.request`.
    pub fn as_str(self) -> &'static str {
        match self {
            Request::Release => "release",
            Request::Drop => "drop",
        }
    }

    /// The request stored as `word`.
    pub fn parse(word: &str) -> Option<Request> {
        match word {
            "release" => Some(Request::Release),
            "drop" => Some(Request::Drop),
            _ => None,
        }
    }
}

/// A held aggregate, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldKey {
    /// Its record key.
    pub key: Bytes,
    /// What the operator asked, if anything.
    pub request: Option<Request>,
}

/// A held event: the record it is (or would be), and why it is held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldEvent {
    /// Its place in the stream.
    pub place: Place,
    /// The row's (or message's) own WAL position, for people.
    pub lsn: Lsn,
    /// Its aggregate: the record key.
    pub key: Bytes,
    /// The record, as it is published on release.
    pub record: Record<()>,
    /// `unmappable`, `refused`, or `held` (an event behind one of those).
    pub kind: String,
    /// The error, or for a `held` event the aggregate's.
    pub error: String,
}

/// Why the quarantine cannot take an event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuarantineError {
    /// The configured maximum of held events is reached.
    #[error("the quarantine holds {held} events, its maximum (quarantine.max_events): walbox stops before the next one; release or drop held aggregates (walbox quarantine list), or raise the maximum")]
    Full {
        /// Events held.
        held: u64,
    },
    /// The event has no aggregate to hold it under.
    #[error(
        "{0}: it has no aggregate id (record key) to be held under, so walbox stops before it"
    )]
    NoKey(String),
}

/// What the session must do next for the quarantine, one step at a time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read every held aggregate, its request, and the number of held
    /// events (as a session starts).
    Sync,
    /// Read the requests.
    Poll,
    /// Write the held events waiting ([`Quarantine::take_pending`]).
    Write,
    /// Read up to a batch of `key`'s held events after `after`.
    Load {
        /// The aggregate being released.
        key: Bytes,
        /// The last place already released, if any.
        after: Option<Place>,
    },
    /// Delete `key`'s released events through `through`.
    Released {
        /// The aggregate being released.
        key: Bytes,
        /// The last place of the acknowledged batch.
        through: Place,
    },
    /// Forget `key` and whatever is still held of it (a finished release,
    /// or a drop).
    Forget {
        /// The aggregate.
        key: Bytes,
    },
    /// Record that `key`'s release failed, and why.
    ReleaseFailed {
        /// The aggregate.
        key: Bytes,
        /// Why.
        error: String,
    },
}

/// Which release a released record belongs to. Reports are matched to
/// their release by it: a failed release's late acknowledgements (or
/// refusals) never count for the release after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReleaseId(u64);

/// A release under way: one aggregate at a time, a batch at a time.
#[derive(Debug)]
struct Release {
    id: ReleaseId,
    key: Bytes,
    /// The last place released (its batch acknowledged and deleted).
    after: Option<Place>,
    /// The batch sent: its last place, and how many of it are unacknowledged.
    batch: Option<(Place, u64)>,
    /// The batch's events after its first, sent once the first was
    /// acknowledged (until then, the first is the release's only record in
    /// flight).
    rest: Vec<HeldEvent>,
    /// What the session must do next for it.
    next: Option<Step>,
}

/// The quarantine's state in `walbox run`: which aggregates are held, the
/// events waiting to be written, and the release under way. `T` is what
/// travels with a held event until its write commits (the relay's token).
#[derive(Debug)]
pub struct Quarantine<T> {
    max_events: u64,
    /// Held aggregates and their requests.
    keys: HashMap<Bytes, Option<Request>>,
    /// Held events written, as last counted.
    written: u64,
    /// Held events not yet written, with their tokens.
    pending: Vec<(HeldEvent, T)>,
    release: Option<Release>,
    /// The id of the next release (ids are never reused in a process).
    next_release: u64,
    /// A read of every held aggregate is due.
    sync_due: bool,
    /// A read of the requests is due.
    poll_due: bool,
}

/// At most this many held events a release reads and sends at a time…
pub const RELEASE_BATCH: u32 = 500;
/// …and about this many bytes of them (at least one event).
pub const RELEASE_BATCH_BYTES: i64 = 16 * 1024 * 1024;

impl<T> Quarantine<T> {
    /// An empty quarantine of at most `max_events` events; the session
    /// reads what is held first.
    pub fn new(max_events: u64) -> Self {
        Quarantine {
            max_events,
            keys: HashMap::new(),
            written: 0,
            pending: Vec::new(),
            release: None,
            next_release: 0,
            sync_due: true,
            poll_due: false,
        }
    }

    /// A session starts: what was waiting or under way belonged to the
    /// last one (its events are sent again by the server, its release
    /// resumes after the last batch deleted). The held aggregates are read
    /// again before the first event.
    pub fn start_session(&mut self) {
        self.pending.clear();
        self.release = None;
        self.sync_due = true;
    }

    /// Whether `key`'s events are held.
    pub fn holds(&self, key: &[u8]) -> bool {
        self.keys.contains_key(key)
    }

    /// Held aggregates.
    pub fn aggregates(&self) -> usize {
        self.keys.len()
    }

    /// Held events, written or waiting.
    pub fn events(&self) -> u64 {
        self.written + self.pending.len() as u64
    }

    /// Holds `event` (its aggregate from now on), to be written before its
    /// token counts as delivered; refused past the maximum.
    pub fn hold(&mut self, event: HeldEvent, token: T) -> Result<(), QuarantineError> {
        if self.events() >= self.max_events {
            return Err(QuarantineError::Full {
                held: self.events(),
            });
        }
        self.keys.entry(event.key.clone()).or_insert(None);
        self.pending.push((event, token));
        Ok(())
    }

    /// Whether held events wait to be written.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The held events waiting to be written, taken.
    pub fn take_pending(&mut self) -> Vec<(HeldEvent, T)> {
        std::mem::take(&mut self.pending)
    }

    /// `new` held events were written (a replayed one is not new).
    pub fn on_written(&mut self, new: u64) {
        self.written += new;
    }

    /// The poll timer fired. Requests name held aggregates, which only
    /// this process holds: with none held there is nothing to read.
    pub fn poll_now(&mut self) {
        self.poll_due = !self.keys.is_empty();
    }

    /// Every held aggregate and the number of held events, read: the table
    /// is the truth (only this process writes it; the operator requests).
    pub fn on_synced(&mut self, keys: Vec<HeldKey>, events: u64) {
        self.sync_due = false;
        self.poll_due = false;
        self.written = events;
        self.keys = keys.into_iter().map(|k| (k.key, k.request)).collect();
    }

    /// The requests read: those of held aggregates are taken.
    pub fn on_polled(&mut self, requests: Vec<HeldKey>) {
        self.poll_due = false;
        for k in requests {
            if let Some(request) = self.keys.get_mut(&k.key) {
                *request = k.request;
            }
        }
    }

    /// The next step for the session, if any: waiting events are written
    /// first, so that a release or a drop reads every event held so far.
    pub fn next_step(&mut self) -> Option<Step> {
        if !self.pending.is_empty() {
            return Some(Step::Write);
        }
        if self.sync_due {
            return Some(Step::Sync);
        }
        if self.poll_due {
            return Some(Step::Poll);
        }
        if let Some(r) = &mut self.release {
            return r.next.take();
        }
        // The oldest request first (the keys' order does not matter for
        // correctness: each aggregate's events keep their own order).
        let (key, request) = self
            .keys
            .iter()
            .filter_map(|(k, r)| r.map(|r| (k.clone(), r)))
            .min_by(|a, b| a.0.cmp(&b.0))?;
        match request {
            Request::Drop => {
                self.keys.insert(key.clone(), None);
                Some(Step::Forget { key })
            }
            Request::Release => {
                self.keys.insert(key.clone(), None);
                let id = ReleaseId(self.next_release);
                self.next_release += 1;
                self.release = Some(Release {
                    id,
                    key: key.clone(),
                    after: None,
                    batch: None,
                    rest: Vec::new(),
                    next: None,
                });
                Some(Step::Load { key, after: None })
            }
        }
    }

    /// A batch of the released aggregate's events was read: the record to
    /// send now, its first (none: the release is finished, and the session
    /// forgets the aggregate). The rest follow once it is acknowledged: a
    /// cause not fixed yet refuses the first, and nothing of the aggregate
    /// overtakes it.
    ///
    /// The records carry the release's id: their reports are for
    /// [`Quarantine::on_release_acked`] and [`Quarantine::on_release_refused`].
    /// `None` without a release under way.
    pub fn on_loaded(&mut self, mut batch: Vec<HeldEvent>) -> Option<(ReleaseId, Vec<HeldEvent>)> {
        let r = self.release.as_mut()?;
        match batch.last() {
            Some(last) => r.batch = Some((last.place, batch.len() as u64)),
            None => r.next = Some(Step::Forget { key: r.key.clone() }),
        }
        if batch.len() > 1 {
            r.rest = batch.split_off(1);
        }
        Some((r.id, batch))
    }

    /// The aggregate was forgotten (released or dropped): it flows again.
    /// True when that ends its release.
    pub fn on_forgotten(&mut self, key: &[u8], deleted: u64) -> bool {
        self.keys.remove(key);
        self.written = self.written.saturating_sub(deleted);
        let released = self.release.as_ref().is_some_and(|r| r.key == key);
        if released {
            self.release = None;
        }
        released
    }

    /// A record of release `id` was acknowledged: the records to send now
    /// (the rest of the batch, once its first was acknowledged). An
    /// acknowledgement of an earlier release (one that failed with records
    /// still in flight) counts for nothing: its events are still held, and
    /// only the current release's acknowledgements may let its rows be
    /// deleted.
    pub fn on_release_acked(&mut self, id: ReleaseId) -> Vec<HeldEvent> {
        let Some(r) = self.release.as_mut().filter(|r| r.id == id) else {
            return Vec::new();
        };
        let rest = std::mem::take(&mut r.rest);
        if let Some((last, unacked)) = &mut r.batch {
            // Each record of the batch is reported once: more
            // acknowledgements than records is a bug, never a deletion.
            *unacked = unacked
                .checked_sub(1)
                .expect("no more acknowledgements than records in a release batch");
            if *unacked == 0 {
                r.next = Some(Step::Released {
                    key: r.key.clone(),
                    through: *last,
                });
            }
        }
        rest
    }

    /// The acknowledged batch's events were deleted: read the next one.
    pub fn on_released(&mut self, deleted: u64) {
        self.written = self.written.saturating_sub(deleted);
        let Some(r) = &mut self.release else { return };
        if let Some((last, _)) = r.batch.take() {
            r.after = Some(last);
            r.next = Some(Step::Load {
                key: r.key.clone(),
                after: r.after,
            });
        }
    }

    /// A record of release `id` was refused again: the release ends, the
    /// aggregate stays held (the rest of the batch may still be
    /// acknowledged: those events are sent again by the next release). A
    /// refusal of an earlier release is that release's, already ended.
    /// Returns the key of the release it ended.
    pub fn on_release_refused(&mut self, id: ReleaseId, error: String) -> Option<Bytes> {
        let r = self.release.as_mut().filter(|r| r.id == id)?;
        let key = r.key.clone();
        r.batch = None;
        r.rest.clear();
        r.next = Some(Step::ReleaseFailed {
            key: r.key.clone(),
            error,
        });
        Some(key)
    }

    /// The failed release was recorded.
    pub fn on_release_failed_recorded(&mut self) {
        if let Some(r) = self.release.take() {
            // Withdrawn in the table: a request read before that is stale.
            self.keys.insert(r.key, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(key: &str, index: u64) -> HeldEvent {
        HeldEvent {
            place: Place {
                commit_lsn: Lsn::new(100),
                index,
            },
            lsn: Lsn::new(90 + index),
            key: Bytes::copy_from_slice(key.as_bytes()),
            record: Record::new("t", Some(Bytes::copy_from_slice(key.as_bytes())), None, ()),
            kind: "refused".into(),
            error: "too large".into(),
        }
    }

    fn requested(key: &str) -> HeldKey {
        HeldKey {
            key: Bytes::copy_from_slice(key.as_bytes()),
            request: Some(Request::Release),
        }
    }

    /// A release refused again is not started over by the request read
    /// before the failure withdrew it.
    #[test]
    fn a_failed_release_is_not_retried_on_a_stale_request() {
        let mut q = Quarantine::<()>::new(10);
        assert_eq!(q.next_step(), Some(Step::Sync));
        q.on_synced(vec![requested("a")], 2);
        let load = q.next_step();
        assert!(
            matches!(load, Some(Step::Load { after: None, .. })),
            "{load:?}"
        );
        let (id, first) = q.on_loaded(vec![held("a", 0), held("a", 1)]).unwrap();
        assert_eq!(first.len(), 1, "the batch's first alone");
        q.on_release_refused(id, "still too large".into());
        // The poll reads the request the failure has not withdrawn yet.
        q.poll_now();
        assert_eq!(q.next_step(), Some(Step::Poll));
        q.on_polled(vec![requested("a")]);
        assert!(matches!(q.next_step(), Some(Step::ReleaseFailed { .. })));
        q.on_release_failed_recorded();
        assert_eq!(q.next_step(), None);
        assert!(q.holds(b"a"));
    }

    /// A batch's rest goes out once its first is acknowledged; the batch is
    /// deleted once all of it is, and the next one read after it.
    #[test]
    fn a_release_goes_batch_by_batch_after_each_first_event() {
        let mut q = Quarantine::<()>::new(10);
        q.on_synced(vec![requested("a")], 3);
        assert!(matches!(q.next_step(), Some(Step::Load { .. })));
        let batch = vec![held("a", 0), held("a", 1), held("a", 2)];
        let (id, first) = q.on_loaded(batch).unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(q.next_step(), None, "waiting for the first's ack");
        assert_eq!(q.on_release_acked(id).len(), 2, "the rest");
        assert!(q.on_release_acked(id).is_empty());
        assert_eq!(q.next_step(), None);
        assert!(q.on_release_acked(id).is_empty());
        let through = Place {
            commit_lsn: Lsn::new(100),
            index: 2,
        };
        let key = Bytes::from_static(b"a");
        assert_eq!(
            q.next_step(),
            Some(Step::Released {
                key: key.clone(),
                through
            })
        );
        q.on_released(3);
        assert_eq!(
            q.next_step(),
            Some(Step::Load {
                key: key.clone(),
                after: Some(through)
            })
        );
        assert!(q.on_loaded(Vec::new()).unwrap().1.is_empty());
        assert_eq!(q.next_step(), Some(Step::Forget { key: key.clone() }));
        q.on_forgotten(&key, 0);
        assert!(!q.holds(b"a"));
        assert_eq!(q.events(), 0);
    }

    /// A failed release's records still in flight are acknowledged (or
    /// refused) while the next release runs: they count for nothing in it.
    /// The next release sends its batch's rest only on its own first's
    /// acknowledgement, and asks to delete its rows only once every one of
    /// them is acknowledged.
    #[test]
    fn a_failed_releases_late_reports_do_not_count_for_the_next_release() {
        let mut q = Quarantine::<()>::new(10);
        q.on_synced(vec![requested("a"), requested("b")], 5);
        assert!(matches!(q.next_step(), Some(Step::Load { key, .. }) if key == "a"));
        let (a, _) = q
            .on_loaded(vec![held("a", 0), held("a", 1), held("a", 2)])
            .unwrap();
        assert_eq!(q.on_release_acked(a).len(), 2, "a's rest in flight");
        q.on_release_refused(a, "refused again".into());
        assert!(matches!(q.next_step(), Some(Step::ReleaseFailed { .. })));
        q.on_release_failed_recorded();
        assert!(matches!(q.next_step(), Some(Step::Load { key, .. }) if key == "b"));
        let (b, first) = q.on_loaded(vec![held("b", 0), held("b", 1)]).unwrap();
        assert_ne!(a, b);
        assert_eq!(first.len(), 1);
        // a's late reports.
        assert!(q.on_release_acked(a).is_empty(), "b's rest waits for b0");
        q.on_release_refused(a, "late".into());
        assert_eq!(q.next_step(), None, "neither deletes nor fails b");
        assert_eq!(q.on_release_acked(b).len(), 1, "b0 acknowledged: b1 goes");
        assert_eq!(q.next_step(), None, "b1 is not acknowledged yet");
        assert!(q.on_release_acked(b).is_empty());
        assert!(matches!(q.next_step(), Some(Step::Released { key, .. }) if key == "b"));
    }
}
