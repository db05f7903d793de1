//! Reading delivered records back, without taking them from anyone: what
//! `walbox audit` and the continuous audit compare with what walbox sent.
//!
//! Each broker that can be read so has its reader in its crate (Kafka's
//! partitions, a RabbitMQ stream queue, a JetStream stream); they hand
//! records over as [`ReadBack`] and say what they covered in these types,
//! so the audit is written once. A *partition* here is where the broker
//! orders records and an *offset* a record's place in it: a Kafka
//! partition and offset, or the one order of a stream (partition 0) and
//! its offset or sequence number.

/// A record's timestamp, as the broker keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordTime {
    /// Set by the producer (walbox: the event's timestamp column).
    Create(i64),
    /// Set by the broker when it stored the record (Kafka's
    /// `LogAppendTime`, a stream's arrival time).
    LogAppend(i64),
    /// None.
    None,
}

/// One record read back, borrowed for the callback's duration.
pub trait ReadBack {
    /// The topic it was published to (for RabbitMQ, its routing key
    /// without the routing partition).
    fn topic(&self) -> &str;
    /// Where the broker ordered it.
    fn partition(&self) -> i32;
    /// Its place there.
    fn offset(&self) -> i64;
    /// Its key.
    fn key(&self) -> Option<&[u8]>;
    /// Its timestamp.
    fn time(&self) -> RecordTime;
    /// The value of the first header called `name`.
    fn header(&self, name: &str) -> Option<&[u8]>;
}

/// Where a read starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadFrom {
    /// The first record stored at or after this (Unix ms), or earlier: a
    /// broker may start before it (a stream's chunk), never after.
    Time(i64),
    /// The first record.
    Beginning,
}

/// A partition whose first record is newer than the point read from:
/// records were deleted before it (retention, `DeleteRecords`, a stream's
/// limits), and some of them may have been from the time read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncated {
    /// The topic (Kafka) or stream.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Its first offset.
    pub first_offset: i64,
}

/// What a read covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadSummary {
    /// Records handed to the callback.
    pub records: u64,
    /// Topics the broker does not know (for JetStream: no stream takes
    /// their subject).
    pub absent_topics: Vec<String>,
    /// Partitions that begin after records from the time read were deleted.
    pub truncated: Vec<Truncated>,
}

/// What a read of one partition's offsets found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeRead {
    /// The partition's first offset (records before it were deleted).
    pub low: i64,
    /// Where the reading got: the end asked for (clamped to the partition's
    /// end when the read started), or less when what follows is not
    /// readable yet within the read's stall bound.
    pub read_to: i64,
}
