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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Bytes per unit of the byte budget.
const UNIT: usize = 1024;

/// The in-flight bound of one sink. Clones share it.
#[derive(Clone, Debug)]
pub struct Admission {
    inner: Arc<Inner>,
}

/// The room held, in one word so that taking a record's slot and its bytes
/// is one compare-and-swap and giving them back one subtraction: records
/// in the high 32 bits, KiB units in the low. Every record reserves and
/// releases room, so this is on the hot path: two semaphores cost two
/// lock round trips per record (a semaphore's release takes its waiters'
/// lock), about a tenth of the relay thread.
#[derive(Debug)]
struct Inner {
    held: AtomicU64,
    records_total: u32,
    units_total: u32,
    /// Reservers on the slow path: while any waits, new ones queue behind
    /// it (no barging past a large record waiting for room), and releases
    /// wake them.
    waiting: AtomicUsize,
    /// The waiters' order: first come, first served (tokio's mutex is fair).
    queue: tokio::sync::Mutex<()>,
    freed: Notify,
    clock: Clock,
}

const RECORD: u64 = 1 << 32;
const UNITS: u64 = RECORD - 1;

impl Inner {
    /// Takes one record's slot and `units`, if both fit.
    fn try_take(&self, units: u32) -> bool {
        let mut held = self.held.load(Ordering::SeqCst);
        loop {
            let records = held >> 32;
            let used = held & UNITS;
            if records >= u64::from(self.records_total)
                || used + u64::from(units) > u64::from(self.units_total)
            {
                return false;
            }
            match self.held.compare_exchange_weak(
                held,
                held + RECORD + u64::from(units),
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return true,
                Err(now) => held = now,
            }
        }
    }

    fn release(&self, units: u32) {
        self.held
            .fetch_sub(RECORD + u64::from(units), Ordering::SeqCst);
        // A waiter counts itself before its last look at `held`: either
        // that look sees this release, or this sees the waiter.
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.freed.notify_waiters();
        }
    }
}

/// Room for one record, held until its report is received (or dropped
/// unused).
#[derive(Debug)]
pub struct Permit {
    units: u32,
    inner: Arc<Inner>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inner.release(self.units);
        // Stamps the stall clock: the room is given back.
        self.inner.clock.stamp();
    }
}

/// Counts a reserver out of the waiters however its wait ends (a
/// cancelled wait included).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    /// At most `max_records` records and `max_bytes` bytes in flight (each
    /// at least 1).
    pub fn new(max_records: usize, max_bytes: usize) -> Self {
        let records_total = u32::try_from(max_records.max(1)).unwrap_or(u32::MAX);
        let units_total = u32::try_from(max_bytes.div_ceil(UNIT).max(1)).unwrap_or(u32::MAX);
        Admission {
            inner: Arc::new(Inner {
                held: AtomicU64::new(0),
                records_total,
                units_total,
                waiting: AtomicUsize::new(0),
                queue: tokio::sync::Mutex::new(()),
                freed: Notify::new(),
                clock: Clock::new(),
            }),
        }
    }

    /// Waits for room for one record of `size` bytes. Cancel-safe: a
    /// cancelled wait holds nothing. Waiters are served in order.
    pub async fn reserve(&self, size: usize) -> Permit {
        let inner = &self.inner;
        let units = u32::try_from(size.div_ceil(UNIT).max(1))
            .unwrap_or(u32::MAX)
            .min(inner.units_total);
        if inner.waiting.load(Ordering::SeqCst) > 0 || !inner.try_take(units) {
            inner.waiting.fetch_add(1, Ordering::SeqCst);
            let _waiting = Waiting(&inner.waiting);
            let _turn = inner.queue.lock().await;
            loop {
                let freed = inner.freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if inner.try_take(units) {
                    break;
                }
                freed.await;
            }
        }
        if self.in_flight() == 1 {
            // Records wait from now, not from the last report long ago.
            inner.clock.stamp();
        }
        Permit {
            units,
            inner: Arc::clone(inner),
        }
    }

    /// Records holding room: reserved or sent, report not yet received.
    pub fn in_flight(&self) -> usize {
        (self.inner.held.load(Ordering::SeqCst) >> 32) as usize
    }

    /// Their bytes (in whole KiB, as reserved).
    pub fn in_flight_bytes(&self) -> usize {
        (self.inner.held.load(Ordering::SeqCst) & UNITS) as usize * UNIT
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

    /// A large record waiting for room is not passed by smaller ones that
    /// come after it: waiters are served in order.
    #[tokio::test]
    async fn waiters_are_served_in_order_and_none_barges_past_a_large_one() {
        let a = Admission::new(10, 4096);
        let held: Vec<Permit> = vec![a.reserve(1024).await, a.reserve(1024).await];
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        // A reserver that notes its name once it has room.
        let reserver = |size: usize, name: &'static str| {
            let (a, order) = (a.clone(), Arc::clone(&order));
            tokio::spawn(async move {
                let p = a.reserve(size).await;
                order.lock().unwrap().push(name);
                p
            })
        };
        let big = reserver(4096, "big");
        tokio::time::sleep(Duration::from_millis(20)).await;
        // Room for a small one now, but the big one came first.
        let small = reserver(1, "small");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            order.lock().unwrap().is_empty(),
            "the small one queues behind the big one"
        );
        drop(held);
        let big = big.await.unwrap();
        assert_eq!(*order.lock().unwrap(), ["big"]);
        drop(big);
        drop(small.await.unwrap());
        assert_eq!(*order.lock().unwrap(), ["big", "small"]);
        assert_eq!((a.in_flight(), a.in_flight_bytes()), (0, 0));
    }

    /// Reservers and releases on several threads: the bound holds at every
    /// moment, no wake-up is lost (every reserver finishes), and all room
    /// comes back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_bound_holds_and_no_wake_up_is_lost_across_threads() {
        let a = Admission::new(8, 16 * 1024);
        let peak = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for t in 0..16u64 {
            let (a, peak) = (a.clone(), Arc::clone(&peak));
            tasks.push(tokio::spawn(async move {
                for i in 0..2_000u64 {
                    let size = (((t * 7919 + i * 104_729) % 5) as usize) * 1024 + 1;
                    let p = a.reserve(size).await;
                    let (records, bytes) = (a.in_flight(), a.in_flight_bytes());
                    assert!(
                        records <= 8 && bytes <= 16 * 1024,
                        "{records} records, {bytes} bytes"
                    );
                    peak.fetch_max(records, Ordering::Relaxed);
                    if i % 3 == 0 {
                        tokio::task::yield_now().await;
                    }
                    drop(p);
                }
            }));
        }
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("no reserver left waiting")
                .unwrap();
        }
        assert!(peak.load(Ordering::Relaxed) > 1, "the reservers overlapped");
        assert_eq!((a.in_flight(), a.in_flight_bytes()), (0, 0));
    }
}
