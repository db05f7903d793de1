//! Postgres timestamps on the wire.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds from the Unix epoch to the Postgres epoch (2000-01-01 00:00:00 UTC).
const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;

/// A timestamp as the replication protocol sends it: microseconds since
/// 2000-01-01 00:00:00 UTC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PgTimestamp(i64);

impl PgTimestamp {
    /// Wraps microseconds since the Postgres epoch.
    pub const fn from_pg_micros(micros: i64) -> Self {
        PgTimestamp(micros)
    }

    /// Microseconds since the Postgres epoch, as on the wire.
    pub const fn as_pg_micros(self) -> i64 {
        self.0
    }

    /// Microseconds since the Unix epoch (saturating).
    pub const fn as_unix_micros(self) -> i64 {
        self.0.saturating_add(PG_EPOCH_UNIX_SECS * 1_000_000)
    }

    /// Milliseconds since the Unix epoch (saturating), as Kafka timestamps are.
    pub const fn as_unix_millis(self) -> i64 {
        self.as_unix_micros().div_euclid(1000)
    }

    /// The timestamp for a point in time (saturating at the representable range).
    pub fn from_system_time(t: SystemTime) -> Self {
        let unix_micros = match t.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
            Err(e) => i64::try_from(e.duration().as_micros()).map_or(i64::MIN, |m| -m),
        };
        PgTimestamp(unix_micros.saturating_sub(PG_EPOCH_UNIX_SECS * 1_000_000))
    }

    /// Now.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// The point in time, when it is representable.
    pub fn to_system_time(self) -> Option<SystemTime> {
        let micros = self.as_unix_micros();
        if micros >= 0 {
            UNIX_EPOCH.checked_add(Duration::from_micros(micros as u64))
        } else {
            UNIX_EPOCH.checked_sub(Duration::from_micros(micros.unsigned_abs()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_between_epochs() {
        assert_eq!(
            PgTimestamp::from_pg_micros(0).as_unix_micros(),
            946_684_800_000_000
        );
        assert_eq!(
            PgTimestamp::from_pg_micros(1_500).as_unix_millis(),
            946_684_800_001
        );
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let pg = PgTimestamp::from_system_time(t);
        assert_eq!(pg.to_system_time(), Some(t));
        assert_eq!(
            PgTimestamp::from_pg_micros(i64::MAX).as_unix_micros(),
            i64::MAX
        );
    }
}
