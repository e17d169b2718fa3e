//! Durations (`500ms`, `30s`, `7d`) and ages (a duration, or `off`) as the commands take
//! them, each shown in `--help` as it is written.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A duration as written on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Period(pub(crate) Duration);

impl FromStr for Period {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim_start().starts_with('-') {
            return Err("a negative duration is not allowed".into());
        }
        humantime::parse_duration(s)
            .map(Period)
            .map_err(|e| format!("{e} (examples: 500ms, 30s, 12h, 7d)"))
    }
}

impl fmt::Display for Period {
    /// In the largest unit that divides it: `7d`, `5m`, `30s`, `1500ms`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 && d.as_secs() > 0 {
            for (secs, unit) in [(86_400, "d"), (3_600, "h"), (60, "m"), (1, "s")] {
                if d.as_secs().is_multiple_of(secs) {
                    return write!(f, "{}{unit}", d.as_secs() / secs);
                }
            }
        }
        if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}", humantime::format_duration(d))
        }
    }
}

/// An age, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Age(pub(crate) Option<Duration>);

impl FromStr for Age {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" {
            return Ok(Age(None));
        }
        s.parse::<Period>().map(|span| Age(Some(span.0)))
    }
}

impl fmt::Display for Age {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => Period(d).fmt(f),
            None => f.write_str("off"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_shown_in_help_parse_back_to_themselves() {
        for d in [
            Duration::from_millis(1500),
            Duration::from_secs(30),
            Duration::from_secs(5 * 60),
            Duration::from_secs(7 * 24 * 60 * 60),
        ] {
            assert_eq!(Period(d).to_string().parse::<Period>(), Ok(Period(d)));
            assert_eq!(Age(Some(d)).to_string().parse::<Age>(), Ok(Age(Some(d))));
        }
        assert_eq!(
            Period(Duration::from_secs(7 * 24 * 60 * 60)).to_string(),
            "7d"
        );
        assert_eq!(Period(Duration::from_secs(300)).to_string(), "5m");
        assert_eq!(Period(Duration::from_millis(1500)).to_string(), "1500ms");
        assert_eq!("off".parse::<Age>(), Ok(Age(None)));
        assert!("-5d".parse::<Period>().unwrap_err().contains("negative"));
    }
}
