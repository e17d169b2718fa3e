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
    /// A transaction left open holds nothing back: its rows are read by their transaction's
    /// id when it commits, not by walking the rows committed meanwhile. The relay trusts
    /// the database's cursor over its own view: a write of the cursor the database lost (a
    /// failover to an asynchronous standby, a crash) or an operator's change makes it read
    /// on from where the cursor is, publishing again what lies between.
    ///
    /// Hazards: one relay at a time holds the cursor (others relay the per-row side and take
    /// the cursor over within its lease, renewed by a heartbeat: a relay killed while it
    /// holds it stalls the log for about
    /// [`RelayBuilder::cursor_lease`](crate::RelayBuilder::cursor_lease), 5 s by default),
    /// and a publish that hangs holds the next tick back
    /// until the publisher's timeout ends it. A dead message redriven while later messages
    /// of its aggregate are being published from the log may be published beside them.
    /// Retention keeps a message of the log for the retention after its enqueue, not after
    /// its publish. After a failover to an asynchronous standby the new primary may lack
    /// commits the relays published from the old one (PostgreSQL's loss of those commits).
    /// The rows carry the cluster's transaction ids, so a table copied into another cluster
    /// (a dump restored, a logical copy) must be moved to [`Engine::PerRow`] before the copy
    /// and back after it.
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
