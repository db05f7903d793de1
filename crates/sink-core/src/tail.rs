//! What a broker already holds of a stream's records: how a restart finds
//! the events a crashed process delivered but never confirmed, so that it
//! does not send them again.
//!
//! Every record walbox publishes to a broker that can be read back carries
//! its [`Origin`] in the header [`ORIGIN_HEADER`] ([`Origin::mark`]): the
//! stream (the slot), the server history it was read on, the commit
//! position of its transaction and its index there. At a start, the relay
//! asks a [`TailReader`] what a topic holds of its stream from the end
//! back to a record of the stream older than the slot's confirmed position
//! ([`TailQuery`]); the events it finds ([`Tail::found`]) are delivered,
//! exactly those, and are not sent again. Nothing is inferred from a later
//! record: an event refused for good is absent while later ones are there.
//!
//! A capability of its own, like [`crate::Transactional`]: only a broker
//! that keeps its records in order and lets them be read implements it
//! (Kafka).

use std::future::Future;
use std::pin::Pin;

use crate::{Delivered, Origin};

/// The header that carries a record's [`Origin::mark`].
pub const ORIGIN_HEADER: &str = "walbox.origin";

/// A server history's identity in a mark: FNV-1a (64 bits) of its text
/// (system identifier and timeline). Stable across processes and builds.
pub fn history_id(history: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in history.bytes() {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// A mark read back from a record's [`ORIGIN_HEADER`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark<'a> {
    /// The stream (slot) it came from.
    pub stream: &'a str,
    /// The server history it was read on ([`history_id`]).
    pub history: u64,
    /// Its transaction's commit position.
    pub position: u64,
    /// Its index in that transaction.
    pub index: u64,
    /// Its transaction's commit time (µs since the Unix epoch).
    pub commit_time: i64,
}

impl<'a> Mark<'a> {
    /// Parses `<stream>/<X>/<Y>/<index>@<history as 16 hex digits>.<commit
    /// time as hex>`; `None` for anything else (another producer's header,
    /// a damaged one). Never panics.
    pub fn parse(value: &'a [u8]) -> Option<Mark<'a>> {
        let text = std::str::from_utf8(value).ok()?;
        let (origin, when) = text.rsplit_once('@')?;
        let (history, commit_time) = when.split_once('.')?;
        if history.len() != 16 || commit_time.is_empty() || commit_time.len() > 16 {
            return None;
        }
        let history = u64::from_str_radix(history, 16).ok()?;
        let commit_time = i64::try_from(u64::from_str_radix(commit_time, 16).ok()?).ok()?;
        let mut parts = origin.rsplitn(4, '/');
        let index = parts.next()?.parse::<u64>().ok()?;
        let low = parts.next()?;
        let high = parts.next()?;
        let stream = parts.next()?;
        let hex = |s: &str| {
            (!s.is_empty() && s.len() <= 8)
                .then(|| u32::from_str_radix(s, 16).ok())
                .flatten()
        };
        let position = (u64::from(hex(high)?) << 32) | u64::from(hex(low)?);
        Some(Mark {
            stream,
            history,
            position,
            index,
            commit_time,
        })
    }
}

/// Room for a mark written by [`Origin::write_mark`]: a slot name of 63
/// bytes (Postgres' limit) and the rest at their longest.
pub const MARK_ROOM: usize = 160;

impl Origin {
    /// [`Origin::mark`] written into `room` without allocating (a record's
    /// header on the hot path); `None` when it does not fit (a stream name
    /// longer than a slot's).
    pub fn write_mark<'r>(&self, room: &'r mut [u8; MARK_ROOM]) -> Option<&'r [u8]> {
        let written = MarkWriter::new(&mut room[..]).write(self)?;
        Some(&room[..written])
    }

    /// The header value that says where a record came from:
    /// [`Origin::id`], `@`, the history as 16 hexadecimal digits, `.`, and
    /// the commit time in hexadecimal µs, e.g.
    /// `walbox/0/16B3748/2@9f3c2a1b4d5e6f70.63f1a2b3c4d5e`. A negative
    /// commit time (none is before 1970) is written as 0.
    pub fn mark(&self) -> String {
        let mut room = vec![0; self.stream.len() + MARK_NUMBERS];
        let written = MarkWriter::new(&mut room)
            .write(self)
            .expect("room for the longest numbers");
        room.truncate(written);
        String::from_utf8(room).expect("a stream name and ASCII")
    }
}

/// The most a mark's numbers and separators take: the position's halves
/// (8 hexadecimal digits each), the index (20 decimal digits), the history
/// (16) and the commit time (16), and five separators.
const MARK_NUMBERS: usize = 8 + 8 + 20 + 16 + 16 + 5;

/// Writes an origin's mark: the one place its format is written. By hand,
/// not with `format_args!`: it runs once per record, and the formatting
/// machinery cost a few percent of the relay's thread.
struct MarkWriter<'a> {
    out: &'a mut [u8],
    at: usize,
}

impl<'a> MarkWriter<'a> {
    fn new(out: &'a mut [u8]) -> Self {
        MarkWriter { out, at: 0 }
    }

    /// `<stream>/<X>/<Y>/<index>@<history:016x>.<commit time:x>`: the bytes
    /// written, or `None` when they do not fit.
    fn write(mut self, o: &Origin) -> Option<usize> {
        self.bytes(o.stream.as_bytes())?;
        self.bytes(b"/")?;
        self.hex(o.position >> 32, 1, HEX_UPPER)?;
        self.bytes(b"/")?;
        self.hex(o.position & 0xFFFF_FFFF, 1, HEX_UPPER)?;
        self.bytes(b"/")?;
        self.decimal(o.index)?;
        self.bytes(b"@")?;
        self.hex(o.history, 16, HEX_LOWER)?;
        self.bytes(b".")?;
        self.hex(o.commit_time.max(0) as u64, 1, HEX_LOWER)?;
        Some(self.at)
    }

    fn bytes(&mut self, b: &[u8]) -> Option<()> {
        let end = self.at.checked_add(b.len())?;
        self.out.get_mut(self.at..end)?.copy_from_slice(b);
        self.at = end;
        Some(())
    }

    /// `v` in hexadecimal, at least `width` digits (zero-padded).
    fn hex(&mut self, v: u64, width: usize, digits: &[u8; 16]) -> Option<()> {
        let mut buf = [0u8; 16];
        let n = (16 - v.leading_zeros() as usize / 4).max(width);
        for (i, d) in buf[..n].iter_mut().rev().enumerate() {
            *d = digits[((v >> (4 * i)) & 0xF) as usize];
        }
        self.bytes(&buf[..n])
    }

    fn decimal(&mut self, mut v: u64) -> Option<()> {
        let mut buf = [0u8; 20];
        let mut start = buf.len();
        loop {
            start -= 1;
            buf[start] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.bytes(&buf[start..])
    }
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";
const HEX_LOWER: &[u8; 16] = b"0123456789abcdef";

/// What to look for in a topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TailQuery {
    /// The stream whose records count.
    pub stream: String,
    /// On this history only ([`history_id`]): never skip across histories.
    pub history: u64,
    /// The slot's confirmed position: a record of the stream whose
    /// position is below it ends the look-back of its partition (what
    /// precedes it was confirmed).
    pub since: u64,
    /// Records read back per partition at most: past it, the partition's
    /// older records are not looked at (their events are sent again).
    pub look_back: u64,
}

/// One event found delivered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Its transaction's commit position.
    pub position: u64,
    /// Its index there.
    pub index: u64,
    /// Its transaction's commit time (µs since the Unix epoch): an event
    /// counts as found only when its own is the same.
    pub commit_time: i64,
    /// Where it is.
    pub at: Delivered,
}

/// What a topic holds of a stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tail {
    /// The stream's events at or past `since`, each once.
    pub found: Vec<Found>,
    /// The topic's partitions (0 when the broker does not know it).
    pub partitions: u32,
    /// Records read.
    pub read: u64,
    /// Partitions whose look-back ended before a record of the stream
    /// older than `since`: events there before what was read are sent again
    /// if they come up.
    pub cut_short: Vec<i32>,
}

/// A broker whose topics can be read back from their end.
pub trait TailReader {
    /// Reads `topic` back (see the module docs).
    fn read_tail<'a>(
        &'a self,
        topic: &'a str,
        query: &'a TailQuery,
    ) -> Pin<Box<dyn Future<Output = Result<Tail, String>> + 'a>>;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_mark_reads_back_as_written() {
        let o = Origin {
            stream: Arc::from("walbox/shard-1"),
            history: history_id("system 7 timeline 1"),
            position: 0x1_0000_00AB,
            index: 3,
            commit_time: 1_700_000_000_123_456,
        };
        let mark = o.mark();
        assert!(mark.starts_with("walbox/shard-1/1/AB/3@"), "{mark}");
        assert!(mark.ends_with(".60a2418202240"), "{mark}");
        let mut room = [0u8; MARK_ROOM];
        assert_eq!(o.write_mark(&mut room), Some(mark.as_bytes()));
        let long = Origin {
            stream: Arc::from("s".repeat(200)),
            ..o.clone()
        };
        assert_eq!(long.write_mark(&mut room), None, "does not fit");
        let back = Mark::parse(mark.as_bytes()).unwrap();
        assert_eq!(back.stream, "walbox/shard-1");
        assert_eq!(back.history, o.history);
        assert_eq!(back.position, o.position);
        assert_eq!(back.index, 3);
        assert_eq!(back.commit_time, o.commit_time);
    }

    /// The hand-written mark is the text `format!` gives for the same
    /// numbers (the format of the marks earlier versions wrote), at every
    /// width: zero, single digits, the largest values, a negative time.
    #[test]
    fn the_mark_is_the_text_of_its_numbers() {
        let numbers = [
            0u64,
            1,
            9,
            10,
            15,
            16,
            255,
            0xABCD,
            0xFFFF_FFFF,
            u64::MAX / 3,
            u64::MAX,
        ];
        for &position in &numbers {
            for &index in &numbers {
                for &history in &[0u64, 1, u64::MAX] {
                    for &commit_time in &[-5i64, 0, 1, 1_700_000_000_123_456, i64::MAX] {
                        let o = Origin {
                            stream: Arc::from("walbox_slot"),
                            history,
                            position,
                            index,
                            commit_time,
                        };
                        let expected = format!(
                            "walbox_slot/{:X}/{:X}/{}@{:016x}.{:x}",
                            position >> 32,
                            position & 0xFFFF_FFFF,
                            index,
                            history,
                            commit_time.max(0)
                        );
                        assert_eq!(o.mark(), expected);
                        let mut room = [0u8; MARK_ROOM];
                        assert_eq!(o.write_mark(&mut room), Some(expected.as_bytes()));
                        let back = Mark::parse(expected.as_bytes()).unwrap();
                        assert_eq!((back.position, back.index), (position, index));
                    }
                }
            }
        }
        // The longest numbers with a slot name of 63 bytes fit the room.
        let o = Origin {
            stream: Arc::from("s".repeat(63)),
            history: u64::MAX,
            position: u64::MAX,
            index: u64::MAX,
            commit_time: i64::MAX,
        };
        let mut room = [0u8; MARK_ROOM];
        assert_eq!(o.write_mark(&mut room), Some(o.mark().as_bytes()));
    }

    #[test]
    fn anything_else_is_no_mark() {
        for bad in [
            &b""[..],
            b"@",
            b"walbox/0/1/2",
            b"walbox/0/1/2@123.1",
            b"walbox/0/1/2@0000000000000001",
            b"walbox/0/1/2@0000000000000001.",
            b"walbox/0/1/2@0000000000000001.ffffffffffffffff",
            b"walbox/0/1/2@0000000000000001.11111111111111111",
            b"walbox/0/1/x@0000000000000001.1",
            b"walbox/0/123456789/2@0000000000000001.1",
            b"0/1/2@0000000000000001.1",
            b"walbox/0//2@0000000000000001.1",
            b"\xff\xfe@0000000000000001.1",
            b"walbox/0/1/2@000000000000000g.1",
        ] {
            assert_eq!(Mark::parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn histories_differ_by_their_text() {
        assert_ne!(
            history_id("system 7 timeline 1"),
            history_id("system 7 timeline 2")
        );
        assert_eq!(history_id(""), 0xcbf2_9ce4_8422_2325);
    }
}
