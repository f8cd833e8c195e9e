//! The archive's timestamps (milliseconds since the Unix epoch, UTC) as people read and write them:
//! `--since` and the UI's `since=` filter, and the times the CLI and the UI show.

use jiff::Timestamp;
use jiff::civil::Date;
use jiff::tz::TimeZone;

/// A `since` value that is neither a date nor an RFC 3339 timestamp.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is neither YYYY-MM-DD nor an RFC 3339 timestamp (e.g. 2026-11-24 or 2026-11-24T18:00:00Z)")]
pub struct BadSince(pub String);

/// Read `YYYY-MM-DD` (midnight UTC) or an RFC 3339 timestamp (with its offset) as milliseconds since
/// the epoch.
pub fn parse_since(text: &str) -> Result<i64, BadSince> {
    let bad = || BadSince(text.to_owned());
    let at = if text.len() == 10 {
        let date: Date = text.parse().map_err(|_| bad())?;
        date.to_zoned(TimeZone::UTC).map_err(|_| bad())?.timestamp()
    } else {
        text.parse::<Timestamp>().map_err(|_| bad())?
    };
    Ok(at.as_millisecond())
}

/// A timestamp for people: RFC 3339, UTC, to the second.
pub fn show_time(ms: i64) -> String {
    match Timestamp::from_millisecond(ms.div_euclid(1000) * 1000) {
        Ok(at) => at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        Err(_) => format!("{ms} ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_reads_dates_and_rfc3339_timestamps() {
        assert_eq!(parse_since("2024-03-01").unwrap(), 1_709_251_200_000);
        assert_eq!(parse_since("2024-03-01T12:30:00Z").unwrap(), 1_709_296_200_000);
        assert_eq!(parse_since("2024-03-01T14:30:00.250+02:00").unwrap(), 1_709_296_200_250);
        for wrong in ["yesterday", "now", "2460000", "2024-13-01", "01-03-2024", "", "2024-03-01T12:30:00"] {
            let err = parse_since(wrong).unwrap_err().to_string();
            assert!(err.contains(&format!("{wrong:?}")), "{wrong}: {err}");
        }
    }

    #[test]
    fn show_time_formats_utc_to_the_second_and_reads_back() {
        assert_eq!(show_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(show_time(1_709_296_200_999), "2024-03-01T12:30:00Z");
        assert_eq!(show_time(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(show_time(-1000), "1969-12-31T23:59:59Z");
        assert_eq!(show_time(-1), "1969-12-31T23:59:59Z");
        for ms in [1_709_251_200_000_i64, 4_102_444_799_000, 86_400_000 * 365 * 30 + 12_345_000] {
            assert_eq!(parse_since(&show_time(ms)).unwrap(), ms);
        }
    }
}
