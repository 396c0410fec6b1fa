//! Durations as users write them: `500ms`, `10s`, `2m`, `1h`.
//!
//! For the `distlock` CLI (its `--lease`/`--wait` flags) and backends' messages, so a duration reads
//! the same everywhere; the URL grammar's `?lease=` parses with it too.

use std::time::Duration;

use crate::error::{Error, ErrorKind, Result};

/// Parses `500ms`, `10s`, `1.5s`, `2m`, `1h`; a bare number is seconds.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::duration::parse;
/// assert_eq!(parse("500ms").unwrap(), Duration::from_millis(500));
/// assert_eq!(parse("1.5s").unwrap(), Duration::from_millis(1500));
/// assert_eq!(parse("2m").unwrap(), Duration::from_secs(120));
/// assert!(parse("soon").is_err());
/// ```
pub fn parse(text: &str) -> Result<Duration> {
    let invalid = || {
        Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "invalid duration {text:?}: write a number with a unit, like 500ms, 10s, 2m or 1h"
            ),
        )
    };
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| invalid())?;
    let seconds = match unit.trim() {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86400.0,
        _ => return Err(invalid()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid())
}

/// Formats a duration the way [`parse`] reads it, rounded for humans.
///
/// ```
/// use std::time::Duration;
/// use distlock_core::duration::format;
/// assert_eq!(format(Duration::from_millis(1500)), "1.5s");
/// assert_eq!(format(Duration::from_millis(20)), "20ms");
/// ```
pub fn format(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}
