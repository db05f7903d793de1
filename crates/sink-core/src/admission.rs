//! The one in-flight bound every sink keeps: at most so many records and
//! so many bytes sent and not yet reported.
//!
//! A caller [`Admission::reserve`]s room before sending a record; the
//! [`Permit`] travels with the record and is dropped when its report is
//! received, which frees the room. Bytes are counted in KiB (a semaphore
//! counts in `u32`), and a record larger than the whole byte budget waits
//! for all of it, so one oversized record still goes, alone.
//!
//! The admission also keeps the stall clock: how long records have waited
//! without any report, which walbox turns into a warning, a metric and
//! readiness.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes per unit of the byte budget.
const UNIT: usize = 1024;

/// The in-flight bound of one sink. Clones share it.
#[derive(Clone, Debug)]
pub struct Admission {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    slots: Arc<Semaphore>,
    slots_total: usize,
    units: Arc<Semaphore>,
    units_total: u32,
    clock: Clock,
}

/// Room for one record, held until its report is received (or dropped
/// unused).
#[derive(Debug)]
pub struct Permit {
    _slot: OwnedSemaphorePermit,
    _units: OwnedSemaphorePermit,
    /// Stamps the stall clock when the room is given back.
    inner: Arc<Inner>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inner.clock.stamp();
    }
}

impl Admission {
    /// At most `max_records` records and `max_bytes` bytes in flight (each
    /// at least 1).
    pub fn new(max_records: usize, max_bytes: usize) -> Self {
        let slots_total = max_records.clamp(1, Semaphore::MAX_PERMITS);
        let units_total = u32::try_from(max_bytes.div_ceil(UNIT).max(1))
            .unwrap_or(u32::MAX)
            .min(u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        Admission {
            inner: Arc::new(Inner {
                slots: Arc::new(Semaphore::new(slots_total)),
                slots_total,
                units: Arc::new(Semaphore::new(units_total as usize)),
                units_total,
                clock: Clock::new(),
            }),
        }
    }

    /// Waits for room for one record of `size` bytes. Cancel-safe: a
    /// cancelled wait holds nothing.
    pub async fn reserve(&self, size: usize) -> Permit {
        let units = u32::try_from(size.div_ceil(UNIT).max(1))
            .unwrap_or(u32::MAX)
            .min(self.inner.units_total);
        let slot = Arc::clone(&self.inner.slots)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let units = Arc::clone(&self.inner.units)
            .acquire_many_owned(units)
            .await
            .expect("the semaphore is never closed");
        if self.in_flight() == 1 {
            // Records wait from now, not from the last report long ago.
            self.inner.clock.stamp();
        }
        Permit {
            _slot: slot,
            _units: units,
            inner: Arc::clone(&self.inner),
        }
    }

    /// Records holding room: reserved or sent, report not yet received.
    pub fn in_flight(&self) -> usize {
        self.inner.slots_total - self.inner.slots.available_permits()
    }

    /// Their bytes (in whole KiB, as reserved).
    pub fn in_flight_bytes(&self) -> usize {
        (self.inner.units_total as usize - self.inner.units.available_permits()) * UNIT
    }

    /// Waits until no record holds room (every report received and
    /// dropped), or `deadline`; returns how many still do.
    pub async fn drained(&self, deadline: tokio::time::Instant) -> usize {
        while self.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.in_flight()
    }

    /// How long records have waited without any report: zero when none
    /// waits.
    pub fn stalled_for(&self) -> Duration {
        if self.in_flight() == 0 {
            return Duration::ZERO;
        }
        self.inner.clock.since()
    }
}

/// The time of the last movement: a report received, or the first record
/// after a time with none waiting.
#[derive(Debug)]
struct Clock {
    origin: Instant,
    moved_ms: AtomicU64,
}

impl Clock {
    fn new() -> Self {
        Clock {
            origin: Instant::now(),
            moved_ms: AtomicU64::new(0),
        }
    }

    fn stamp(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.moved_ms.store(ms, Ordering::Relaxed);
    }

    fn since(&self) -> Duration {
        let moved = Duration::from_millis(self.moved_ms.load(Ordering::Relaxed));
        self.origin.elapsed().saturating_sub(moved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn room_is_bounded_by_records_and_bytes_and_freed_by_dropping_a_permit() {
        let a = Admission::new(2, 4096);
        let p1 = a.reserve(100).await;
        let p2 = a.reserve(100).await;
        assert_eq!((a.in_flight(), a.in_flight_bytes()), (2, 2048));
        let third = tokio::time::timeout(Duration::from_millis(20), a.reserve(1)).await;
        assert!(third.is_err(), "a third record waits for room");
        drop(p1);
        let p3 = a.reserve(1).await;
        assert_eq!(a.in_flight(), 2);
        drop((p2, p3));
        assert_eq!((a.in_flight(), a.in_flight_bytes()), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn drained_waits_for_the_room_held_up_to_its_deadline() {
        let a = Admission::new(2, 4096);
        let held = a.reserve(10).await;
        let until = tokio::time::Instant::now() + Duration::from_millis(100);
        assert_eq!(a.drained(until).await, 1, "still held at the deadline");
        assert!(tokio::time::Instant::now() >= until);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(held);
        });
        let later = tokio::time::Instant::now() + Duration::from_secs(5);
        assert_eq!(a.drained(later).await, 0);
        assert!(tokio::time::Instant::now() < later, "returned once drained");
    }

    #[tokio::test]
    async fn a_record_larger_than_the_budget_waits_for_all_of_it_then_goes() {
        let a = Admission::new(10, 2048);
        let small = a.reserve(1).await;
        let big = tokio::time::timeout(Duration::from_millis(20), a.reserve(1 << 20)).await;
        assert!(big.is_err(), "waits while anything else holds bytes");
        drop(small);
        let big = a.reserve(1 << 20).await;
        assert_eq!(a.in_flight_bytes(), 2048);
        drop(big);
    }

    #[tokio::test]
    async fn the_stall_clock_runs_only_while_records_wait() {
        let a = Admission::new(10, 1 << 20);
        assert_eq!(a.stalled_for(), Duration::ZERO);
        tokio::time::sleep(Duration::from_millis(30)).await;
        let p = a.reserve(1).await;
        // It starts at the first record, not at the admission's making.
        assert!(a.stalled_for() < Duration::from_millis(30));
        let q = a.reserve(1).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(a.stalled_for() >= Duration::from_millis(30));
        drop(p);
        assert!(
            a.stalled_for() < Duration::from_millis(30),
            "a report moves it"
        );
        drop(q);
        assert_eq!(a.stalled_for(), Duration::ZERO, "nothing waits");
    }
}
