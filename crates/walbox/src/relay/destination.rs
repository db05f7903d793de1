//! Where events go: records in, delivery reports out.

use sink_kafka::{Permit, Record, Report, Reports, Sink};

use super::Token;

/// Takes records, within bounds on what is in flight. Methods take `&self`
/// so that reserving room and receiving reports ([`Deliveries`]) can wait in
/// one `select!`.
#[allow(async_fn_in_trait)]
pub trait Destination {
    /// Room for one record, returned when its report is received.
    type Permit;

    /// Waits for room for a record of `size` bytes. Cancel-safe.
    async fn reserve(&self, size: usize) -> Self::Permit;

    /// Sends a record; its fate arrives on [`Deliveries::next`].
    async fn send(&self, permit: Self::Permit, record: Record<Token>);

    /// Records sent whose report was not received yet.
    fn in_flight(&self) -> usize;

    /// Their bytes.
    fn in_flight_bytes(&self) -> usize;
}

/// Each sent record's fate, once.
#[allow(async_fn_in_trait)]
pub trait Deliveries {
    /// The next report; `None` when the destination is gone. Cancel-safe.
    async fn next(&mut self) -> Option<Report<Token>>;
}

impl Destination for Sink<Token> {
    type Permit = Permit;

    async fn reserve(&self, size: usize) -> Permit {
        Sink::reserve(self, size).await
    }

    async fn send(&self, permit: Permit, record: Record<Token>) {
        Sink::send(self, permit, record).await
    }

    fn in_flight(&self) -> usize {
        Sink::in_flight(self)
    }

    fn in_flight_bytes(&self) -> usize {
        Sink::in_flight_bytes(self)
    }
}

impl Deliveries for Reports<Token> {
    async fn next(&mut self) -> Option<Report<Token>> {
        Reports::next(self).await
    }
}
