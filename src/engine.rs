//! `Engine`: how relays keep track of what they have published, a table's choice.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// How relays keep track of what they have published: a table's choice, made by
/// [`Outbox::migrate`](crate::Outbox::migrate) when the `Outbox` was built with
/// [`OutboxBuilder::engine`](crate::OutboxBuilder::engine).
///
/// Both engines keep every guarantee of the crate (at least once, fencing, per-aggregate
/// order, the outage rule, dead letters, retention) and the same API; enqueue costs the
/// writer the same on both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Engine {
    /// Each relayed row is claimed (leased, with a fencing token) and then marked with its
    /// outcome: two row writes per message. The default.
    #[default]
    PerRow,
    /// Relays read committed rows in commit order through snapshots and record progress
    /// once per page of messages in a cursor row (`<table>_cursor`), leased and fenced
    /// like a row: no row write per message on the common path. A message that fails, is
    /// delayed, or follows a failed message of its aggregate is handed to the per-row
    /// machinery, whose retries, backoff and dead letters apply to it from there.
    ///
    /// Hazards: a transaction left open holds back nothing but makes the page reads walk
    /// past the rows committed meanwhile once; the rows carry the cluster's transaction
    /// ids, so a table copied into another cluster (a dump restored, a logical copy) must
    /// be moved to [`Engine::PerRow`] before the copy and back after it.
    Log,
}

impl Engine {
    /// The name the CLI takes: `per-row` or `log`.
    pub fn name(self) -> &'static str {
        match self {
            Engine::PerRow => "per-row",
            Engine::Log => "log",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Engine {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per-row" => Ok(Engine::PerRow),
            "log" => Ok(Engine::Log),
            other => Err(Error::invalid_option(format!(
                "engine {other:?} is not one of per-row, log"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_parse_from_their_names_and_nothing_else() {
        for engine in [Engine::PerRow, Engine::Log] {
            assert_eq!(engine.name().parse::<Engine>().unwrap(), engine);
        }
        let err = "rows".parse::<Engine>().unwrap_err();
        assert!(err.to_string().contains("per-row, log"), "{err}");
    }
}
