//! walbox on its own, on Apache Kafka (docs/benchmarks.md, "Results"):
//!
//! * `eos`: exactly-once beside at-least-once on the same backlog, both
//!   from their own slot, on the broker's real transactions; one
//!   transaction of a million rows split across Kafka transactions; and
//!   commit → ack at 5,000 events/s in each mode.
//! * `shards`: the small backlog drained by 1, 2 and 4 shards.
//! * `cleanup` and `writecost`: what keeping the outbox small, and writing
//!   an event, cost the primary (no relay runs).
//! * `retention`: 5,000 events/s for minutes with walbox's retention off,
//!   on, and on a partitioned outbox.
//! * `brokers`: a backlog drained to Kafka, RabbitMQ and SQS, beside
//!   pg_recvlogical and each broker alone.
//! * `audit`: what auditing costs: the continuous audit's effect on a
//!   drain, and `walbox audit` over every event of it.

mod audit;
mod brokers;
mod eos;
mod primary;
mod retention;
mod shards;

pub(crate) use audit::{audit, MEMORY as AUDIT_MEMORY, WAYS as AUDIT_WAYS};
pub(crate) use brokers::{brokers, BROKERS};
pub(crate) use eos::eos;
pub(crate) use primary::{cleanup, write_cost, CLEANUP_WAYS, WRITE_WAYS};
pub(crate) use retention::{retention, WAYS as RETENTION_WAYS};
pub(crate) use shards::{shards, SHARDS};

use crate::relay::Relay;
use crate::world::World;

/// Waits until `slot` (a `LIKE` pattern: every slot it names) confirmed
/// `lsn`, failing when `relays` exited.
pub(crate) async fn wait_confirmed(
    world: &World,
    relays: &mut [&mut Relay],
    slot: &str,
    lsn: &str,
) {
    let t0 = std::time::Instant::now();
    while !world.all_confirmed(slot, lsn).await {
        for r in relays.iter_mut() {
            crate::peers::watch(r, t0, "walbox");
        }
        tokio::time::sleep(crate::peers::TICK).await;
    }
}
