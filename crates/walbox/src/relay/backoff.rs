//! Exponential backoff with jitter between replication sessions.

use std::time::Duration;

/// 0.5 s doubling to 30 s, each delay ±25 %; reset once a session streams.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    seed: u64,
}

impl Backoff {
    const MIN: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(30);

    /// Starts at the shortest delay.
    pub fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        Backoff {
            next: Self::MIN,
            seed,
        }
    }

    /// Back to the shortest delay.
    pub fn reset(&mut self) {
        self.next = Self::MIN;
    }

    /// The next delay.
    pub fn delay(&mut self) -> Duration {
        // xorshift64: jitter needs no cryptographic randomness.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let jitter = 0.75 + (self.seed % 1000) as f64 / 2000.0;
        let d = self.next.mul_f64(jitter);
        self.next = (self.next * 2).min(Self::MAX);
        d
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new();
        let first = b.delay();
        assert!(first >= Backoff::MIN.mul_f64(0.75) && first <= Backoff::MIN.mul_f64(1.25));
        for _ in 0..20 {
            assert!(b.delay() <= Backoff::MAX.mul_f64(1.25));
        }
        assert!(b.delay() >= Backoff::MAX.mul_f64(0.75));
        b.reset();
        assert!(b.delay() <= Backoff::MIN.mul_f64(1.25));
    }
}
