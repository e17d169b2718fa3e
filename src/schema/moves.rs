//! Moving a table from one relay engine to the other, and telling which it is on.
//!
//! A move runs under the table's ACCESS EXCLUSIVE lock, at READ COMMITTED, so that each of
//! its statements sees every row committed before the lock was granted, whatever the
//! session's default isolation says. It rewrites under the lock only what decides where
//! each message goes next; a move off the log turns the log's published rows into `sent`
//! after the lock, in batches that hold no writer up ([`Outbox::settle_engine`]).

use diesel::QueryableByName;
use diesel::sql_types::{Bool, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::TableName;

/// The statements that tell and move a table's engine.
#[derive(Debug, Clone)]
pub(crate) struct EngineStatements {
    /// Whether the table is on the log engine: its cursor exists.
    pub(crate) is_log: String,
    /// Per-row to log, in the migration's transaction.
    pub(crate) to_log: String,
    /// Log to per-row, in the migration's transaction.
    pub(crate) to_per_row: String,
    /// After a move off the log: up to [`SETTLE_BATCH`] of the rows the cursor had passed
    /// become `sent`, in a transaction of their own.
    pub(crate) settle_passed: String,
    /// Whether the status check is still to be validated.
    pub(crate) check_unvalidated: String,
    /// Validates the status check, without holding writers up.
    pub(crate) validate_check: String,
}

/// How long a move waits for the table's lock before it gives up (and changes nothing):
/// a transaction holding the table (a prepared one, say) would otherwise queue every
/// writer behind the move.
const LOCK_TIMEOUT: &str = "10s";

/// Rows turned `sent` per statement after a move off the log.
const SETTLE_BATCH: i64 = 10_000;

impl EngineStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let cursor = table.quoted_with("_cursor");
        let check = table.object("_status_check");
        let statuses = |with_logged: bool| {
            format!(
                "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {check}, ADD CONSTRAINT {check} \
                 CHECK (status IN ('pending', 'sent', 'dead'{})) NOT VALID",
                if with_logged { ", 'logged'" } else { "" }
            )
        };
        EngineStatements {
            is_log: format!("SELECT EXISTS (SELECT 1 FROM {cursor}) AS log"),
            // Under the table's lock no writer is half-way: every row committed before is
            // `pending` (left to the per-row side) or done, and every row written after
            // is `logged` with a transaction id the cursor has not passed. The cursor
            // starts at `x:x:`, `x` the lesser of the snapshot's xmin and this
            // transaction's own id (its own id counts as visible in its own snapshot).
            // Rows a move off the log left `logged` (it stopped before it had settled
            // them all) were published: they are `sent` first.
            to_log: format!(
                "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';\n\
                 LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE;\n\
                 UPDATE {t} SET status = 'sent', sent_at = now() WHERE status = 'logged';\n\
                 {check_with};\n\
                 ALTER TABLE {t} ALTER COLUMN status SET DEFAULT 'logged';\n\
                 INSERT INTO {cursor} (part, lo, hi)\n\
                 \x20   SELECT 0, s, s FROM (SELECT (x || ':' || x || ':')::pg_snapshot AS s FROM \
                 (SELECT least(pg_snapshot_xmin(pg_current_snapshot()), pg_current_xact_id()) AS x) AS a) AS b\n\
                 ON CONFLICT (part) DO NOTHING",
                check_with = statuses(true),
            ),
            // Deleting the cursor fences every log relay still running (their page
            // finishes find no cursor). Under the lock, the rows the cursor had not passed
            // (those of transactions after `hi`, and of the open tick after `after`) are
            // pending again, found by their transaction ids; the rows it had passed stay
            // `logged` until `settle_passed` makes them `sent`, and no writer can add a
            // `logged` row any more.
            to_per_row: format!(
                "SET LOCAL lock_timeout = '{LOCK_TIMEOUT}';\n\
                 LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE;\n\
                 WITH c AS MATERIALIZED (SELECT lo, hi, after FROM {cursor} WHERE part = 0),\n\
                 backlog AS MATERIALIZED (\n\
                 \x20   SELECT o.id, o.xid FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip(lo) FROM c))\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT o.id, o.xid FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid >= (SELECT pg_snapshot_xmax(lo) FROM c)\n\
                 )\n\
                 UPDATE {t} t SET status = 'pending', available_at = now() FROM backlog b, c\n\
                 \x20   WHERE t.id = b.id AND NOT (pg_visible_in_snapshot(b.xid, c.lo) \
                 OR (pg_visible_in_snapshot(b.xid, c.hi) AND b.id <= c.after));\n\
                 ALTER TABLE {t} ALTER COLUMN status SET DEFAULT 'pending';\n\
                 {check_without};\n\
                 DELETE FROM {cursor}",
                check_without = statuses(false),
            ),
            // Oldest transactions first, through the log's index: every `logged` row left
            // on a table without a cursor was published. Its key is kept for a whole
            // retention from now, as a row the per-row engine sends.
            settle_passed: format!(
                "WITH passed AS MATERIALIZED (\n\
                 \x20   SELECT id FROM {t} WHERE status = 'logged' ORDER BY xid, id LIMIT {SETTLE_BATCH} \
                 FOR UPDATE SKIP LOCKED\n\
                 )\n\
                 UPDATE {t} t SET status = 'sent', sent_at = now() FROM passed \
                 WHERE t.id = passed.id AND t.status = 'logged' \
                 AND NOT EXISTS (SELECT 1 FROM {cursor})"
            ),
            check_unvalidated: format!(
                "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = '{t}'::regclass \
                 AND conname = '{name}' AND NOT convalidated) AS unvalidated",
                name = check.trim_matches('"'),
            ),
            validate_check: format!("ALTER TABLE {t} VALIDATE CONSTRAINT {check}"),
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
            settle_passed,
            check_unvalidated,
            validate_check,
        } = self;
        vec![
            ("engine is_log".into(), is_log),
            ("engine to_log".into(), to_log),
            ("engine to_per_row".into(), to_per_row),
            ("engine settle_passed".into(), settle_passed),
            ("engine check_unvalidated".into(), check_unvalidated),
            ("engine validate_check".into(), validate_check),
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
    ///
    /// # Errors
    /// [`Error::Migration`] when the transaction is not at READ COMMITTED: its snapshot
    /// may predate rows committed before the lock, which the move would then not see.
    pub(crate) async fn move_engine(
        &self,
        conn: &mut AsyncPgConnection,
        engine: Engine,
    ) -> Result<()> {
        let now = self.engine(conn).await?;
        if now == engine {
            return Ok(());
        }
        #[derive(QueryableByName)]
        struct Isolation {
            #[diesel(sql_type = Text)]
            level: String,
        }
        let isolation: Isolation =
            diesel::sql_query("SELECT current_setting('transaction_isolation') AS level")
                .get_result(conn)
                .await
                .map_err(|e| self.db_error(e))?;
        if isolation.level != "read committed" {
            return Err(Error::Migration(
                format!(
                    "moving table {} to the {engine} engine needs a READ COMMITTED transaction, \
                     and the one migrate runs in is {}: call migrate outside a transaction of \
                     your own (it then opens one at READ COMMITTED)",
                    self.table(),
                    isolation.level
                )
                .into(),
            ));
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

    /// What a move leaves for after its lock, each step in a transaction of its own when
    /// `conn` has none open: the rows a move off the log left `logged` (published) become
    /// `sent`, in batches, and the status check a move loosened or tightened is validated
    /// (which reads the table without holding writers up). Nothing to do costs two
    /// lookups.
    pub(crate) async fn settle_engine(&self, conn: &mut AsyncPgConnection) -> Result<()> {
        #[derive(QueryableByName)]
        struct Unvalidated {
            #[diesel(sql_type = Bool)]
            unvalidated: bool,
        }
        let sql = &self.statements().engine;
        let mut settled = 0u64;
        if self.engine(conn).await? == Engine::PerRow {
            loop {
                let n = diesel::sql_query(sql.settle_passed.as_str())
                    .execute(conn)
                    .await
                    .map_err(|e| self.db_error(e))?;
                settled += n as u64;
                if (n as i64) < SETTLE_BATCH {
                    break;
                }
            }
        }
        if settled > 0 {
            tracing::info!(table = %self.table(), rows = settled, "rows the log had published are now sent");
        }
        let check: Unvalidated = diesel::sql_query(sql.check_unvalidated.as_str())
            .get_result(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        if check.unvalidated {
            conn.batch_execute(&sql.validate_check)
                .await
                .map_err(|e| self.db_error(e))?;
        }
        Ok(())
    }
}
