//! The two relay engines a table can be on, and moving a table from one to the other.

use std::fmt;
use std::str::FromStr;

use diesel::QueryableByName;
use diesel::sql_types::Bool;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::TableName;

/// How relays keep track of what they have published: a table's choice, made by
/// [`Outbox::migrate`] when the `Outbox` was built with
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

/// The statements that tell and move a table's engine.
#[derive(Debug, Clone)]
pub(crate) struct EngineStatements {
    /// Whether the table is on the log engine: its cursor exists.
    pub(crate) is_log: String,
    /// Per-row to log, in one transaction.
    pub(crate) to_log: String,
    /// Log to per-row, in one transaction.
    pub(crate) to_per_row: String,
}

/// How long a move waits for the table's lock before it gives up (and changes nothing):
/// a transaction holding the table (a prepared one, say) would otherwise queue every
/// writer behind the move.
const LOCK_TIMEOUT: &str = "10s";

impl EngineStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let cursor = table.quoted_with("_cursor");
        EngineStatements {
            is_log: format!("SELECT EXISTS (SELECT 1 FROM {cursor}) AS log"),
            // Under the table's lock no writer is half-way: every row committed before is
            // `pending` (left to the per-row side) or done, and every row written after
            // is `logged` with a transaction id the cursor has not passed. The cursor
            // starts at `x:x:`, `x` the lesser of the snapshot's xmin and this
            // transaction's own id (its own id counts as visible in its own snapshot).
            to_log: format!(
                "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';\n\
                 LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE;\n\
                 ALTER TABLE {t} ALTER COLUMN status SET DEFAULT 'logged';\n\
                 INSERT INTO {cursor} (part, lo, hi)\n\
                 \x20   SELECT 0, s, s FROM (SELECT (x || ':' || x || ':')::pg_snapshot AS s FROM \
                 (SELECT least(pg_snapshot_xmin(pg_current_snapshot()), pg_current_xact_id()) AS x) AS a) AS b\n\
                 ON CONFLICT (part) DO NOTHING"
            ),
            // Deleting the cursor fences every log relay still running (their page
            // finishes find no cursor). Rows behind it are sent (since their enqueue, for
            // retention), the rest pending again, in id order as the per-row side reads.
            to_per_row: format!(
                "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';\n\
                 LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE;\n\
                 UPDATE {t} t SET status = 'sent', sent_at = t.created_at FROM {cursor} c\n\
                 \x20   WHERE t.status = 'logged' AND (pg_visible_in_snapshot(t.xid, c.lo) \
                 OR (pg_visible_in_snapshot(t.xid, c.hi) AND t.id <= c.after));\n\
                 UPDATE {t} SET status = 'pending', available_at = now() WHERE status = 'logged';\n\
                 ALTER TABLE {t} ALTER COLUMN status SET DEFAULT 'pending';\n\
                 DELETE FROM {cursor}"
            ),
        }
    }
}

#[cfg(test)]
impl crate::sql::Listed for EngineStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let EngineStatements {
            is_log,
            to_log,
            to_per_row,
        } = self;
        vec![
            ("engine is_log".into(), is_log),
            ("engine to_log".into(), to_log),
            ("engine to_per_row".into(), to_per_row),
        ]
    }
}

impl Outbox {
    /// The engine the table is on now.
    ///
    /// # Errors
    /// A database error (a table not migrated to schema version 4 has no cursor table).
    pub async fn engine(&self, conn: &mut AsyncPgConnection) -> Result<Engine> {
        #[derive(QueryableByName)]
        struct IsLog {
            #[diesel(sql_type = Bool)]
            log: bool,
        }
        let row: IsLog = diesel::sql_query(self.statements().engine.is_log.as_str())
            .get_result(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(if row.log { Engine::Log } else { Engine::PerRow })
    }

    /// Moves the table to `engine`, inside the caller's transaction (`migrate`'s), under
    /// the table's lock. Nothing happens when it is on `engine` already.
    pub(crate) async fn move_engine(
        &self,
        conn: &mut AsyncPgConnection,
        engine: Engine,
    ) -> Result<()> {
        let now = self.engine(conn).await?;
        if now == engine {
            return Ok(());
        }
        let sql = &self.statements().engine;
        let statements = match engine {
            Engine::Log => &sql.to_log,
            Engine::PerRow => &sql.to_per_row,
        };
        conn.batch_execute(statements)
            .await
            .map_err(|e| self.db_error(e))?;
        tracing::info!(table = %self.table(), from = %now, to = %engine, "outbox engine moved");
        Ok(())
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
