//! Idempotent restart (`skip_delivered`): the events a crashed process
//! delivered and never confirmed are still on the broker, each marked with
//! its origin ([`sink_core::tail`]). A session that starts reads back each
//! topic the replay sends to, the first time a replayed record for it comes
//! up, and does not send again the events it found there: exactly those,
//! found by their origin, never inferred from a later record (one refused
//! for good is absent while later ones are there).
//!
//! - **The window.** Only events of transactions committed before the
//!   session started (`until`, the server's WAL position then) can have
//!   been sent before; the first record past it ends the look-up for the
//!   session, and what was found is dropped.
//! - **One history.** A record counts only when it was read on the same
//!   server history ([`sink_core::tail::history_id`]) and its transaction
//!   has the same commit time: a restore to a new timeline, or one on the
//!   same timeline that reuses WAL positions, re-sends everything
//!   unconfirmed, never skips.
//! - **What cannot be read** (an error, no right to read the topic) is
//!   said once per topic, and its events are sent again: duplicates, never
//!   loss.
//!
//! Records are checked as they reach the front of the queue, before they
//! are serialized or stored in the object store: dead-letter copies are
//! checked against the dead-letter topic like events against theirs.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pgoutput_decoder::Lsn;
use sink_core::tail::{Tail, TailQuery};
use sink_core::Delivered;
use tokio::time::Instant;

use super::{Core, Mode, Observation};

/// How long a session's reads may take together. The replication stream is
/// not read meanwhile (nor answered: the walsender ends a connection silent
/// for `wal_sender_timeout`, 60 s by default), so past it the topics not
/// read yet are sent to without a look (duplicates, never loss), and the
/// session cannot be ended by its own reads over and over.
const READ_BUDGET_MICROS: u64 = 20_000_000;
use crate::progress::Ack;
use crate::relay::{Carries, RunError};

/// A session's look-up of what the broker already holds.
#[derive(Debug)]
pub(super) struct Resume {
    query: TailQuery,
    /// The server's WAL position as the session started: no transaction
    /// past it was ever sent.
    until: Lsn,
    /// Topics read back (or found unreadable) in this session.
    read: HashSet<Arc<str>>,
    /// Events found, by commit position and index (with their commit
    /// time), until their turn.
    found: HashMap<(u64, u64), (i64, Delivered)>,
    /// Time the reads took so far.
    spent_micros: u64,
}

/// What a session's start decides about the look-up.
pub(super) struct ResumeStart<'s> {
    pub(super) stream: &'s str,
    pub(super) history: u64,
    pub(super) confirmed: Lsn,
    pub(super) server_wal: Lsn,
}

impl Core<'_> {
    /// A session started: the look-up, when `skip_delivered` is on, the
    /// delivery is at least once, and there is a replay to look for.
    pub(super) fn start_resume(&mut self, start: ResumeStart<'_>) {
        self.resume = match (self.config.skip_delivered, &self.mode) {
            (Some(look_back), Mode::AtLeastOnce { .. }) if start.server_wal > start.confirmed => {
                Some(Resume {
                    query: TailQuery {
                        stream: start.stream.to_owned(),
                        history: start.history,
                        since: start.confirmed.as_u64(),
                        look_back,
                    },
                    until: start.server_wal,
                    read: HashSet::new(),
                    found: HashMap::new(),
                    spent_micros: 0,
                })
            }
            _ => None,
        };
    }

    /// Before the first waiting record is readied: skips it (and the next
    /// ones) while the broker is found to hold it already. `Some`: the
    /// topic to read back first, and what to look for; hand the outcome to
    /// [`Core::on_tail`], then ask again.
    pub(in crate::relay) fn check_front(
        &mut self,
        now: Instant,
    ) -> Result<Option<(Arc<str>, TailQuery)>, RunError> {
        loop {
            let (Some(resume), Some(front)) = (&mut self.resume, self.outgoing.front()) else {
                return Ok(None);
            };
            let token = &front.token;
            if !matches!(
                token.carries,
                Carries::Event { .. } | Carries::DeadLetter(_)
            ) {
                return Ok(None);
            }
            if token.commit_lsn > resume.until {
                // Past what any earlier process read: the look-up is over.
                self.resume = None;
                return Ok(None);
            }
            if !resume.read.contains(&front.topic) {
                if resume.spent_micros < READ_BUDGET_MICROS {
                    return Ok(Some((Arc::clone(&front.topic), resume.query.clone())));
                }
                resume.read.insert(Arc::clone(&front.topic));
                self.effects.observe(Observation::TailUnreadable {
                    topic: Arc::clone(&front.topic),
                    error: format!(
                        "not read: this start's reads took {} s already",
                        READ_BUDGET_MICROS / 1_000_000
                    ),
                });
                return Ok(None);
            }
            let key = (token.commit_lsn.as_u64(), token.index);
            // The same place and commit time: the same event (a restore on
            // the same timeline reuses places, never with the same times).
            let commit_time = token.origin_time();
            let at = match resume.found.remove(&key) {
                Some((time, at)) if time == commit_time => at,
                _ => return Ok(None),
            };
            let (_, token) = self
                .outgoing
                .pop_front()
                .expect("the front was looked at")
                .split_token();
            match self.progress.ack(token.event, now)? {
                Ack::Current(update) => {
                    self.sampled(&token, &at);
                    self.effects
                        .observe(Observation::FoundDelivered { token, at });
                    self.effects.status(update);
                }
                Ack::Stale => {}
            }
        }
    }

    /// What reading `topic` back found (or why it could not be read,
    /// `micros` after it began).
    pub(in crate::relay) fn on_tail(
        &mut self,
        topic: Arc<str>,
        tail: Result<Tail, String>,
        micros: u64,
    ) {
        let Some(resume) = &mut self.resume else {
            return;
        };
        resume.read.insert(Arc::clone(&topic));
        resume.spent_micros = resume.spent_micros.saturating_add(micros);
        match tail {
            Ok(tail) => {
                let found = tail.found.len();
                for f in tail.found {
                    resume
                        .found
                        .insert((f.position, f.index), (f.commit_time, f.at));
                }
                self.effects.observe(Observation::TailRead {
                    topic,
                    partitions: tail.partitions,
                    read: tail.read,
                    found,
                    cut_short: tail.cut_short,
                    micros,
                });
            }
            Err(error) => self
                .effects
                .observe(Observation::TailUnreadable { topic, error }),
        }
    }

    /// The history id records of this session are marked with.
    pub(in crate::relay) fn history_id(&self) -> u64 {
        self.history_id
    }
}
