//! Postgres' text output of `timestamptz` / `timestamp` as Unix milliseconds
//! (the message timestamp of a mapped event), and back as RFC 3339 (the
//! CloudEvents `time` attribute).

/// Days from 1970-01-01 to a civil date (proleptic Gregorian).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses Postgres' text output of `timestamptz` (`2026-11-21 17:00:00.123456+00`,
/// `…+05:30`, `…-03`), RFC 3339 (`2026-11-21T17:00:00Z`) or `timestamp` (no
/// offset: UTC) into Unix milliseconds.
/// `infinity` and BC dates are not representable: `None`.
pub fn parse_timestamp_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if part.is_empty() || !part.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        part.parse().ok()
    };
    if b.len() < 19
        || b[4] != b'-'
        || b[7] != b'-'
        || (b[10] != b' ' && b[10] != b'T')
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || !(1..=31).contains(&day)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut i = 19;
    let mut micros = 0i64;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        let mut end = start;
        while end < b.len() && b[end].is_ascii_digit() {
            end += 1;
        }
        let digits = s.get(start..end)?;
        if digits.is_empty() || digits.len() > 6 {
            return None;
        }
        micros = digits.parse::<i64>().ok()? * 10i64.pow(6 - digits.len() as u32);
        i = end;
    }
    let mut offset_secs = 0i64;
    if b.get(i) == Some(&b'Z') && b.len() == i + 1 {
        // RFC 3339's UTC (an envelope written outside Postgres).
    } else if let Some(&sign) = b.get(i) {
        let sign = match sign {
            b'+' => 1,
            b'-' => -1,
            _ => return None,
        };
        let rest = s.get(i + 1..)?;
        let mut parts = rest.split(':');
        let h: i64 = parts
            .next()
            .filter(|p| p.len() == 2)
            .and_then(|p| p.parse().ok())?;
        let m: i64 = parts.next().map_or(Some(0), |p| p.parse().ok())?;
        let sec: i64 = parts.next().map_or(Some(0), |p| p.parse().ok())?;
        if parts.next().is_some() {
            return None;
        }
        offset_secs = sign * (h * 3600 + m * 60 + sec);
    }
    let secs = days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second
        - offset_secs;
    Some(secs * 1000 + micros / 1000)
}

/// Unix milliseconds as RFC 3339 in UTC: `2026-11-22T15:30:00.123Z`.
pub fn rfc3339_ms(ms: i64) -> String {
    let (days, rem) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_postgres_timestamps() {
        assert_eq!(parse_timestamp_ms("1970-01-01 00:00:00+00"), Some(0));
        assert_eq!(
            parse_timestamp_ms("2026-11-21 17:00:00.123456+00"),
            Some(1_795_280_400_123)
        );
        assert_eq!(
            parse_timestamp_ms("2026-11-21 22:30:00.1+05:30"),
            Some(1_795_280_400_100)
        );
        assert_eq!(
            parse_timestamp_ms("2026-11-21 14:00:00-03"),
            Some(1_795_280_400_000)
        );
        assert_eq!(
            parse_timestamp_ms("2026-11-21 17:00:00"),
            Some(1_795_280_400_000),
            "timestamp without zone: UTC"
        );
        assert_eq!(
            parse_timestamp_ms("2000-02-29 00:00:00+00"),
            Some(951_782_400_000)
        );
        for bad in [
            "infinity",
            "",
            "2026-13-01 00:00:00+00",
            "2026-11-21",
            "2026-11-21 17:00:00 BC",
            "2026-11-21 17:00:00.1234567+00",
        ] {
            assert_eq!(parse_timestamp_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn formats_times_as_rfc3339() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_795_280_400_123), "2026-11-21T17:00:00.123Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
        for ms in [0, 1, 86_399_999, 951_782_400_000, 4_102_444_799_999] {
            assert_eq!(parse_timestamp_ms(&rfc3339_ms(ms)), Some(ms), "{ms}");
        }
    }
}
