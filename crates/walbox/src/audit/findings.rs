//! What the audit finds, from the two sides sorted: pure, no I/O.
//!
//! **By event id** ([`Sighting`]s sorted by id): each id's outbox row (if
//! the window holds it) and its copies on the topics (main, dead-letter).
//! - a row with no copy: **missing** (or *unconfirmed* when the slot has
//!   not been confirmed past the audit's snapshot: it may be in flight);
//! - copies beyond the first, on either topic: **duplicates**;
//! - a main copy of an id the window's rows do not hold, with a timestamp in
//!   the window: **unknown** (on the broker, not in the table);
//! - a row whose first copy is on another topic or key than its mapping
//!   gives: **misrouted**;
//! - a row whose only copies are on the dead-letter topic: dead-lettered (the
//!   configured policy, not a finding).
//!
//! **By key** ([`Arrival`]s sorted by topic, key, partition, offset): the
//! first copy of each row, in the order the topic holds them. A first copy
//! whose row comes before the previous first copy's row in the table's
//! order is **out of order** (per key; counted as the torture suite's
//! checker counts it).

use std::collections::BTreeMap;

use serde::Serialize;

use super::spill::{codec, Entry};

/// Most event types counted apart; the rest are counted as [`OTHER_TYPES`].
const MAX_TYPES: usize = 1_000;
/// The event type the types past [`MAX_TYPES`] are counted under.
pub(crate) const OTHER_TYPES: &str = "(other event types)";
/// The event type of a row or record that has none.
pub(crate) const NO_TYPE: &str = "(none)";

/// Where an event id was seen.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Place {
    /// Its outbox row, `rank`-th in the table's order; `route` is the
    /// topic and key its mapping gives (`None`: it cannot be mapped).
    Row {
        rank: u64,
        route: Option<(String, Vec<u8>)>,
        event_type: String,
    },
    /// A record on its topic.
    Copy {
        topic: String,
        partition: i32,
        offset: i64,
        key: Vec<u8>,
        event_type: String,
        /// Its timestamp is in the window (records outside it are only
        /// matched, never reported as unknown).
        in_window: bool,
    },
    /// A record on the dead-letter topic.
    DeadLetter { partition: i32, offset: i64 },
}

/// An event id and one place it was seen: the first pass's entry.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Sighting {
    pub(crate) id: String,
    pub(crate) place: Place,
}

/// A row's first copy: the second pass's entry.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Arrival {
    topic: String,
    key: Vec<u8>,
    partition: i32,
    offset: i64,
    rank: u64,
    id: String,
    event_type: String,
}

/// Counts, overall or for one event type.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Outbox rows in the window.
    pub rows: u64,
    /// Rows with a copy on their topic.
    pub delivered: u64,
    /// Rows whose only copies are on the dead-letter topic.
    pub dead_lettered: u64,
    /// Rows with no copy anywhere, the slot confirmed past them.
    pub missing: u64,
    /// Rows with no copy anywhere that the slot has not been confirmed
    /// past: maybe in flight.
    pub unconfirmed: u64,
    /// Copies beyond the first.
    pub duplicates: u64,
    /// First copies out of the table's order, per key.
    pub out_of_order: u64,
    /// Records in the window whose event id no row in the window has.
    pub unknown: u64,
    /// Rows whose first copy is on another topic or key than their mapping's.
    pub misrouted: u64,
}

impl Counts {
    /// Findings: what exits 1.
    pub fn findings(&self) -> u64 {
        self.missing + self.duplicates + self.out_of_order + self.unknown + self.misrouted
    }
}

/// One finding, for the operator to look up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Example {
    /// `missing`, `duplicate`, `out_of_order`, `unknown`, `misrouted`.
    pub kind: &'static str,
    /// The event id.
    pub id: String,
    /// The event type.
    pub event_type: String,
    /// The topic (the mapping's for a missing event).
    pub topic: Option<String>,
    /// The key, as text (lossy).
    pub key: Option<String>,
    /// Where the copy in question is.
    pub partition: Option<i32>,
    /// Where the copy in question is.
    pub offset: Option<i64>,
}

/// Everything found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Findings {
    /// Overall.
    pub total: Counts,
    /// Per event type.
    pub by_event_type: BTreeMap<String, Counts>,
    /// The first findings of each kind, at most `max_examples` each.
    pub examples: Vec<Example>,
    #[serde(skip)]
    max_examples: usize,
    #[serde(skip)]
    shown: BTreeMap<&'static str, usize>,
}

impl Findings {
    /// No findings yet; keeps up to `max_examples` of each kind.
    pub(crate) fn new(max_examples: usize) -> Self {
        Findings {
            max_examples,
            ..Findings::default()
        }
    }

    /// Adds to the count `which` picks, overall and for `event_type`.
    fn count(&mut self, event_type: &str, which: fn(&mut Counts) -> &mut u64) {
        *which(&mut self.total) += 1;
        let known = self.by_event_type.contains_key(event_type);
        let name = if known || self.by_event_type.len() < MAX_TYPES {
            event_type
        } else {
            OTHER_TYPES
        };
        *which(self.by_event_type.entry(name.to_owned()).or_default()) += 1;
    }

    fn example(&mut self, example: Example) {
        let shown = self.shown.entry(example.kind).or_default();
        if *shown < self.max_examples {
            *shown += 1;
            self.examples.push(example);
        }
    }

    /// The first pass: one id's sightings (its row first, then its copies
    /// in topic, partition, offset order, then its dead letters).
    /// `confirmed`: the slot was confirmed past every row in the window.
    pub(crate) fn id(&mut self, id: &str, places: &[Place], confirmed: bool) -> Verdict {
        let row = places.iter().find_map(|p| match p {
            Place::Row {
                rank,
                route,
                event_type,
            } => Some((*rank, route, event_type)),
            _ => None,
        });
        let copies: Vec<&Place> = places
            .iter()
            .filter(|p| matches!(p, Place::Copy { .. }))
            .collect();
        let dead = places
            .iter()
            .filter(|p| matches!(p, Place::DeadLetter { .. }))
            .count() as u64;
        let Some((rank, route, row_type)) = row else {
            // No row in the window: only copies in the window are news,
            // if the table does not hold them now (see [`Findings::unknown`]).
            let unknown = copies
                .into_iter()
                .filter_map(|copy| match copy {
                    Place::Copy {
                        topic,
                        partition,
                        offset,
                        key,
                        event_type,
                        in_window: true,
                    } => Some(Example {
                        kind: "unknown",
                        id: id.to_owned(),
                        event_type: event_type.clone(),
                        topic: Some(topic.clone()),
                        key: Some(String::from_utf8_lossy(key).into_owned()),
                        partition: Some(*partition),
                        offset: Some(*offset),
                    }),
                    _ => None,
                })
                .collect();
            return Verdict {
                arrival: None,
                unknown,
            };
        };
        self.count(row_type, |c| &mut c.rows);
        let copies_total = copies.len() as u64 + dead;
        for _ in 1..copies_total.max(1) {
            self.count(row_type, |c| &mut c.duplicates);
        }
        if copies_total > 1 {
            let (topic, partition, offset) = match copies.get(1).or(copies.first()) {
                Some(Place::Copy {
                    topic,
                    partition,
                    offset,
                    ..
                }) => (Some(topic.clone()), Some(*partition), Some(*offset)),
                _ => (None, None, None),
            };
            self.example(Example {
                kind: "duplicate",
                id: id.to_owned(),
                event_type: row_type.clone(),
                topic,
                key: route
                    .as_ref()
                    .map(|(_, k)| String::from_utf8_lossy(k).into_owned()),
                partition,
                offset,
            });
        }
        let Some(Place::Copy {
            topic,
            partition,
            offset,
            key,
            ..
        }) = copies.first()
        else {
            if dead > 0 {
                self.count(row_type, |c| &mut c.dead_lettered);
            } else if confirmed {
                self.count(row_type, |c| &mut c.missing);
                self.example(Example {
                    kind: "missing",
                    id: id.to_owned(),
                    event_type: row_type.clone(),
                    topic: route.as_ref().map(|(t, _)| t.clone()),
                    key: route
                        .as_ref()
                        .map(|(_, k)| String::from_utf8_lossy(k).into_owned()),
                    partition: None,
                    offset: None,
                });
            } else {
                self.count(row_type, |c| &mut c.unconfirmed);
            }
            return Verdict::default();
        };
        self.count(row_type, |c| &mut c.delivered);
        if let Some((want_topic, want_key)) = route {
            if want_topic != topic || want_key != key {
                self.count(row_type, |c| &mut c.misrouted);
                self.example(Example {
                    kind: "misrouted",
                    id: id.to_owned(),
                    event_type: row_type.clone(),
                    topic: Some(topic.clone()),
                    key: Some(String::from_utf8_lossy(key).into_owned()),
                    partition: Some(*partition),
                    offset: Some(*offset),
                });
            }
        }
        Verdict {
            arrival: Some(Arrival {
                topic: topic.clone(),
                key: key.clone(),
                partition: *partition,
                offset: *offset,
                rank,
                id: id.to_owned(),
                event_type: row_type.clone(),
            }),
            unknown: Vec::new(),
        }
    }

    /// Counts a copy [`Findings::id`] could not explain and the table does
    /// not hold now either: an event on the broker that is not in the table.
    pub(crate) fn unknown(&mut self, example: Example) {
        self.count(&example.event_type, |c| &mut c.unknown);
        self.example(example);
    }

    /// The second pass: first copies in topic, key, partition, offset
    /// order.
    pub(crate) fn arrivals(
        &mut self,
        arrivals: impl Iterator<Item = std::io::Result<Arrival>>,
    ) -> std::io::Result<()> {
        let mut previous: Option<Arrival> = None;
        for a in arrivals {
            let a = a?;
            if let Some(p) = &previous {
                if p.topic == a.topic && p.key == a.key && p.rank > a.rank {
                    self.count(&a.event_type, |c| &mut c.out_of_order);
                    self.example(Example {
                        kind: "out_of_order",
                        id: a.id.clone(),
                        event_type: a.event_type.clone(),
                        topic: Some(a.topic.clone()),
                        key: Some(String::from_utf8_lossy(&a.key).into_owned()),
                        partition: Some(a.partition),
                        offset: Some(a.offset),
                    });
                }
            }
            previous = Some(a);
        }
        Ok(())
    }
}

/// What [`Findings::id`] leaves to the caller.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// The row's first copy, for the second pass.
    pub(crate) arrival: Option<Arrival>,
    /// Copies in the window no row in the snapshot explains: unknown
    /// unless the table holds their ids now (committed after the snapshot).
    pub(crate) unknown: Vec<Example>,
}

/// Sorted sightings, grouped by id.
pub(crate) struct ById<I: Iterator> {
    sightings: std::iter::Peekable<I>,
}

impl<I: Iterator<Item = std::io::Result<Sighting>>> ById<I> {
    /// Groups `sightings`, which come sorted.
    pub(crate) fn new(sightings: I) -> Self {
        ById {
            sightings: sightings.peekable(),
        }
    }
}

impl<I: Iterator<Item = std::io::Result<Sighting>>> Iterator for ById<I> {
    type Item = std::io::Result<(String, Vec<Place>)>;

    fn next(&mut self) -> Option<Self::Item> {
        let first = match self.sightings.next()? {
            Ok(s) => s,
            Err(e) => return Some(Err(e)),
        };
        let mut places = vec![first.place];
        while let Some(Ok(next)) = self.sightings.peek() {
            if next.id != first.id {
                break;
            }
            if let Some(Ok(next)) = self.sightings.next() {
                places.push(next.place);
            }
        }
        Some(Ok((first.id, places)))
    }
}

/// The heap a string or byte string holds: its bytes and the allocator's
/// rounding and header (measured: 500,000 rows and their records took
/// about 380 bytes each, four small allocations and the entry itself).
fn heap(b: impl AsRef<[u8]>) -> usize {
    match b.as_ref().len() {
        0 => 0,
        n => n + 32,
    }
}

fn put_i32(out: &mut Vec<u8>, v: i32) {
    codec::put_u64(out, v as u32 as u64);
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    codec::put_u64(out, v as u64);
}

fn i32_of(input: &mut &[u8]) -> Option<i32> {
    u32::try_from(codec::u64(input)?).ok().map(|v| v as i32)
}

fn i64_of(input: &mut &[u8]) -> Option<i64> {
    codec::u64(input).map(|v| v as i64)
}

impl Entry for Sighting {
    fn encode(&self, out: &mut Vec<u8>) {
        codec::put_bytes(out, self.id.as_bytes());
        match &self.place {
            Place::Row {
                rank,
                route,
                event_type,
            } => {
                out.push(0);
                codec::put_u64(out, *rank);
                match route {
                    None => out.push(0),
                    Some((topic, key)) => {
                        out.push(1);
                        codec::put_bytes(out, topic.as_bytes());
                        codec::put_bytes(out, key);
                    }
                }
                codec::put_bytes(out, event_type.as_bytes());
            }
            Place::Copy {
                topic,
                partition,
                offset,
                key,
                event_type,
                in_window,
            } => {
                out.push(1);
                codec::put_bytes(out, topic.as_bytes());
                put_i32(out, *partition);
                put_i64(out, *offset);
                codec::put_bytes(out, key);
                codec::put_bytes(out, event_type.as_bytes());
                out.push(u8::from(*in_window));
            }
            Place::DeadLetter { partition, offset } => {
                out.push(2);
                put_i32(out, *partition);
                put_i64(out, *offset);
            }
        }
    }

    fn decode(mut input: &[u8]) -> Option<Self> {
        let i = &mut input;
        let id = codec::string(i)?;
        let (tag, rest) = i.split_first()?;
        *i = rest;
        let place = match tag {
            0 => {
                let rank = codec::u64(i)?;
                let (has_route, rest) = i.split_first()?;
                *i = rest;
                let route = match has_route {
                    0 => None,
                    1 => Some((codec::string(i)?, codec::bytes(i)?.to_vec())),
                    _ => return None,
                };
                Place::Row {
                    rank,
                    route,
                    event_type: codec::string(i)?,
                }
            }
            1 => {
                let topic = codec::string(i)?;
                let partition = i32_of(i)?;
                let offset = i64_of(i)?;
                let key = codec::bytes(i)?.to_vec();
                let event_type = codec::string(i)?;
                let (in_window, rest) = i.split_first()?;
                *i = rest;
                Place::Copy {
                    topic,
                    partition,
                    offset,
                    key,
                    event_type,
                    in_window: *in_window == 1,
                }
            }
            2 => Place::DeadLetter {
                partition: i32_of(i)?,
                offset: i64_of(i)?,
            },
            _ => return None,
        };
        input.is_empty().then_some(Sighting { id, place })
    }

    fn weight(&self) -> usize {
        heap(&self.id)
            + match &self.place {
                Place::Row {
                    route, event_type, ..
                } => heap(event_type) + route.as_ref().map_or(0, |(t, k)| heap(t) + heap(k)),
                Place::Copy {
                    topic,
                    key,
                    event_type,
                    ..
                } => heap(topic) + heap(key) + heap(event_type),
                Place::DeadLetter { .. } => 0,
            }
    }
}

impl Entry for Arrival {
    fn encode(&self, out: &mut Vec<u8>) {
        codec::put_bytes(out, self.topic.as_bytes());
        codec::put_bytes(out, &self.key);
        put_i32(out, self.partition);
        put_i64(out, self.offset);
        codec::put_u64(out, self.rank);
        codec::put_bytes(out, self.id.as_bytes());
        codec::put_bytes(out, self.event_type.as_bytes());
    }

    fn decode(mut input: &[u8]) -> Option<Self> {
        let i = &mut input;
        let a = Arrival {
            topic: codec::string(i)?,
            key: codec::bytes(i)?.to_vec(),
            partition: i32_of(i)?,
            offset: i64_of(i)?,
            rank: codec::u64(i)?,
            id: codec::string(i)?,
            event_type: codec::string(i)?,
        };
        input.is_empty().then_some(a)
    }

    fn weight(&self) -> usize {
        heap(&self.topic) + heap(&self.key) + heap(&self.id) + heap(&self.event_type)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, rank: u64, key: &str) -> Sighting {
        Sighting {
            id: id.into(),
            place: Place::Row {
                rank,
                route: Some(("t".into(), key.as_bytes().to_vec())),
                event_type: "Made".into(),
            },
        }
    }

    fn copy(id: &str, key: &str, offset: i64) -> Sighting {
        Sighting {
            id: id.into(),
            place: Place::Copy {
                topic: "t".into(),
                partition: 0,
                offset,
                key: key.as_bytes().to_vec(),
                event_type: "Made".into(),
                in_window: true,
            },
        }
    }

    fn dead(id: &str, offset: i64) -> Sighting {
        Sighting {
            id: id.into(),
            place: Place::DeadLetter {
                partition: 0,
                offset,
            },
        }
    }

    /// Both passes, in memory.
    fn audit(mut sightings: Vec<Sighting>, confirmed: bool) -> Findings {
        sightings.sort();
        let mut f = Findings::new(10);
        let mut arrivals = Vec::new();
        for group in ById::new(sightings.into_iter().map(Ok)) {
            let (id, places) = group.unwrap();
            let verdict = f.id(&id, &places, confirmed);
            arrivals.extend(verdict.arrival);
            for unknown in verdict.unknown {
                f.unknown(unknown);
            }
        }
        arrivals.sort();
        f.arrivals(arrivals.into_iter().map(Ok)).unwrap();
        f
    }

    #[test]
    fn each_row_once_in_order_is_clean() {
        let f = audit(
            vec![
                row("a", 1, "k"),
                row("b", 2, "k"),
                copy("a", "k", 0),
                copy("b", "k", 1),
            ],
            true,
        );
        assert_eq!(f.total.rows, 2);
        assert_eq!(f.total.delivered, 2);
        assert_eq!(f.total.findings(), 0, "{f:?}");
        assert!(f.examples.is_empty());
    }

    #[test]
    fn a_row_without_a_copy_is_missing_once_the_slot_passed_it() {
        let rows = vec![row("a", 1, "k"), row("b", 2, "k"), copy("a", "k", 0)];
        let f = audit(rows.clone(), true);
        assert_eq!((f.total.missing, f.total.unconfirmed), (1, 0));
        assert_eq!(f.examples[0].kind, "missing");
        assert_eq!(f.examples[0].id, "b");
        assert_eq!(f.examples[0].key.as_deref(), Some("k"));
        let f = audit(rows, false);
        assert_eq!((f.total.missing, f.total.unconfirmed), (0, 1));
        assert_eq!(f.total.findings(), 0);
    }

    #[test]
    fn copies_beyond_the_first_are_duplicates_on_either_topic() {
        let f = audit(
            vec![
                row("a", 1, "k"),
                copy("a", "k", 0),
                copy("a", "k", 5),
                dead("a", 0),
                row("b", 2, "k"),
                dead("b", 1),
                dead("b", 2),
            ],
            true,
        );
        assert_eq!(f.total.duplicates, 3);
        assert_eq!(f.total.delivered, 1);
        assert_eq!(f.total.dead_lettered, 1);
        assert_eq!(f.total.missing, 0);
    }

    #[test]
    fn first_arrivals_out_of_the_tables_order_count_per_key() {
        // Key k: rows 1, 2, 3 arrive as 2, 1, 3 (one violation: 1 after 2);
        // a later duplicate of 1 is not an arrival. Key j is in order.
        let f = audit(
            vec![
                row("a", 1, "k"),
                row("b", 2, "k"),
                row("c", 3, "k"),
                copy("b", "k", 0),
                copy("a", "k", 1),
                copy("c", "k", 2),
                copy("a", "k", 3),
                row("x", 4, "j"),
                row("y", 5, "j"),
                copy("x", "j", 4),
                copy("y", "j", 5),
            ],
            true,
        );
        assert_eq!(f.total.out_of_order, 1);
        assert_eq!(f.total.duplicates, 1);
        let ex = f
            .examples
            .iter()
            .find(|e| e.kind == "out_of_order")
            .unwrap();
        assert_eq!((ex.id.as_str(), ex.offset), ("a", Some(1)));
    }

    #[test]
    fn a_copy_no_row_explains_is_unknown_only_inside_the_window() {
        let mut outside = copy("z", "k", 9);
        if let Place::Copy { in_window, .. } = &mut outside.place {
            *in_window = false;
        }
        let f = audit(vec![copy("y", "k", 8), outside], true);
        assert_eq!(f.total.unknown, 1);
        assert_eq!(f.examples[0].id, "y");
        assert_eq!(f.total.rows, 0);
    }

    #[test]
    fn a_first_copy_under_another_key_is_misrouted() {
        let f = audit(vec![row("a", 1, "k"), copy("a", "other", 0)], true);
        assert_eq!(f.total.misrouted, 1);
        assert_eq!(f.total.delivered, 1);
    }

    #[test]
    fn counts_split_by_event_type_and_examples_are_bounded() {
        let mut s = Vec::new();
        for i in 0..30 {
            s.push(row(&format!("id{i:02}"), i, "k"));
        }
        let f = audit(s, true);
        assert_eq!(f.total.missing, 30);
        assert_eq!(f.by_event_type["Made"].missing, 30);
        assert_eq!(f.examples.len(), 10);
    }

    #[test]
    fn sightings_and_arrivals_survive_their_encoding() {
        let mut unmapped = row("u", 7, "k");
        unmapped.place = Place::Row {
            rank: 7,
            route: None,
            event_type: NO_TYPE.into(),
        };
        for s in [
            row("a", 1, "k"),
            unmapped,
            copy("b", "kk", -1),
            dead("c", i64::MAX),
        ] {
            let mut out = Vec::new();
            s.encode(&mut out);
            assert_eq!(Sighting::decode(&out), Some(s.clone()));
            assert_eq!(Sighting::decode(&out[..out.len() - 1]), None);
        }
        let a = Arrival {
            topic: "t".into(),
            key: vec![0, 255],
            partition: 3,
            offset: 42,
            rank: 9,
            id: "e".into(),
            event_type: "T".into(),
        };
        let mut out = Vec::new();
        a.encode(&mut out);
        assert_eq!(Arrival::decode(&out), Some(a));
    }
}
