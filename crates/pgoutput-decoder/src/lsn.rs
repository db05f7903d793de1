//! WAL positions.

use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log (a `pg_lsn`), printed by Postgres as `X/Y`:
/// the high and low 32 bits in upper-case hexadecimal.
///
/// `Lsn` orders like the WAL itself. The difference of two positions is a byte
/// distance, which is how retained WAL and replication lag are measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(u64);

impl Lsn {
    /// The invalid position `0/0`. `START_REPLICATION … LOGICAL 0/0` means
    /// "from the slot's confirmed_flush_lsn".
    pub const ZERO: Lsn = Lsn(0);

    /// Wraps a raw 64-bit position.
    pub const fn new(raw: u64) -> Self {
        Lsn(raw)
    }

    /// The raw 64-bit position.
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// Bytes of WAL from `earlier` to `self`, or 0 when `earlier` is not earlier.
    pub const fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The position `bytes` further on, or `None` on overflow.
    pub const fn checked_add(self, bytes: u64) -> Option<Lsn> {
        match self.0.checked_add(bytes) {
            Some(v) => Some(Lsn(v)),
            None => None,
        }
    }
}

impl From<u64> for Lsn {
    fn from(raw: u64) -> Self {
        Lsn(raw)
    }
}

impl From<Lsn> for u64 {
    fn from(lsn: Lsn) -> Self {
        lsn.0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text was not a WAL position of the form `X/Y` (hexadecimal, each part
/// at most 8 digits).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {input:?}: expected two hexadecimal numbers of at most 8 digits, as in 16/B374D848")]
pub struct ParseLsnError {
    input: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.chars().take(64).collect(),
        };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let part = |p: &str| -> Result<u64, ParseLsnError> {
            if p.is_empty() || p.len() > 8 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u64::from_str_radix(p, 16).map_err(|_| err())
        };
        Ok(Lsn((part(hi)? << 32) | part(lo)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_postgres() {
        assert_eq!(Lsn::new(0).to_string(), "0/0");
        assert_eq!(Lsn::new(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn::new(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn parses_what_postgres_prints() {
        assert_eq!(
            "16/B374D848".parse::<Lsn>().unwrap(),
            Lsn::new(0x16_B374_D848)
        );
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        assert_eq!("a/1b".parse::<Lsn>().unwrap(), Lsn::new(0xA_0000_001B));
        for v in [
            0,
            1,
            0xFFFF_FFFF,
            0x1_0000_0000,
            u64::MAX,
            0x0123_4567_89AB_CDEF,
        ] {
            assert_eq!(Lsn::new(v).to_string().parse::<Lsn>().unwrap(), Lsn::new(v));
        }
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "/",
            "1/",
            "/1",
            "1/2/3",
            "123456789/0",
            "0/123456789",
            "g/0",
            "+1/0",
            " 1/0",
            "1",
        ] {
            let e = bad.parse::<Lsn>().unwrap_err();
            assert!(e.to_string().contains("invalid LSN"), "{bad}: {e}");
        }
    }

    #[test]
    fn orders_and_measures_distance() {
        let a: Lsn = "0/FFFFFFFF".parse().unwrap();
        let b: Lsn = "1/0".parse().unwrap();
        assert!(a < b);
        assert_eq!(b.bytes_since(a), 1);
        assert_eq!(a.bytes_since(b), 0);
        assert_eq!(a.checked_add(1), Some(b));
        assert_eq!(Lsn::new(u64::MAX).checked_add(1), None);
    }
}
