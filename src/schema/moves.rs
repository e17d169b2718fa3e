//! Moving a table from one relay engine to the other, and telling which it is on.

use diesel::QueryableByName;
use diesel::sql_types::Bool;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::engine::Engine;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::sql::TableName;

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
