//! Argument types shared by the commands: durations (`500ms`, `30s`, `7d`) and ages
//! (a duration, or `off`), each shown in `--help` as it is parsed.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A duration as written on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span(pub(crate) Duration);

impl FromStr for Span {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim_start().starts_with('-') {
            return Err("a negative duration is not allowed".into());
        }
        humantime::parse_duration(s)
            .map(Span)
            .map_err(|e| format!("{e} (examples: 500ms, 30s, 12h, 7d)"))
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
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
        s.parse::<Span>().map(|span| Age(Some(span.0)))
    }
}

impl fmt::Display for Age {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => Span(d).fmt(f),
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
            assert_eq!(Span(d).to_string().parse::<Span>(), Ok(Span(d)));
            assert_eq!(Age(Some(d)).to_string().parse::<Age>(), Ok(Age(Some(d))));
        }
        assert_eq!("off".parse::<Age>(), Ok(Age(None)));
        assert!("-5d".parse::<Span>().unwrap_err().contains("negative"));
    }
}
