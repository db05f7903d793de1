//! walbox's broker-neutral delivery layer.
//!
//! Every broker's sink (sink-kafka, sink-amqp, sink-sqs) speaks these
//! types, and the relay speaks nothing else, so a new broker implements
//! [`Destination`] and [`Deliveries`] once and every path that publishes
//! (the stream, backfills, heals, resyncs, quarantine releases, dead
//! letters) reaches it.
//!
//! ```text
//!  caller ── reserve(size) ──► Permit ── send(permit, Record<T>) ──► broker
//!     ▲                                                                │
//!     └──────── Deliveries::next ◄── Report<T> { token, Delivered | DeliveryError }
//! ```
//!
//! - A [`Record`] carries an opaque *token* the caller gets back in the
//!   record's [`Report`], once: walbox's token names the transaction, and so
//!   the WAL position, an event came from.
//! - [`Admission`] is the one in-flight bound: a record is sent only with
//!   a [`Permit`] for it, and the permit is returned when its report is
//!   received, so memory stays bounded whatever the broker does.
//! - A capability some brokers lack is its own trait: [`Transactional`]
//!   (Kafka's transactions) extends [`Destination`], and nothing answers
//!   "unsupported".
//! - Reading back what a broker holds of a stream at a restart
//!   ([`tail::TailReader`]) is another: a crash then leaves no duplicates
//!   where the broker kept its records.
//! - Failures are typed by what the caller does: [`DeliveryErrorKind`]
//!   for one record, [`TxnErrorKind`] for a transactional call.

mod admission;
mod destination;
pub mod percent;
pub mod readback;
mod record;
mod report;
pub mod tail;
pub mod tls;
pub mod worker;

pub use admission::{Admission, Permit};
pub use destination::{Deliveries, Destination, Transactional, TxnError, TxnErrorKind};
pub use record::{Header, Origin, Record};
pub use report::{Delivered, DeliveryError, DeliveryErrorKind, Report};
