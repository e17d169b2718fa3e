//! The log engine's statements, rendered per table, and [`PgLog`], which runs them on the
//! pool: each in the transaction and with the planner settings it needs.

use std::collections::HashSet;
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::future::BoxFuture;

use super::LogTable;
use crate::connect::PgPool;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::relay::outcome::{CLAIM_PLAN, MessageColumns, OUTCOME_DEAD, OUTCOME_RETRY, Outcome};
use crate::sql::{Sql, TableName, micros, statement};

statement! {
    /// Takes the cursor's lease, or renews it.
    pub(crate) struct Take {
        owner: Text = String,
        lease_us: BigInt = i64,
    }
}

statement! {
    /// Opens the next tick, if anything committed since the last one.
    pub(crate) struct OpenTick {
        token: BigInt = i64,
        tick: BigInt = i64,
        hi: Text = String,
        lease_us: BigInt = i64,
    }
}

statement! {
    /// Reads the next page of the open tick.
    pub(crate) struct ReadPage {
        from: BigInt = i64,
        ceiling: BigInt = i64,
        lo: Text = String,
        hi: Text = String,
        limit: BigInt = i64,
        max_bytes: BigInt = i64,
    }
}

statement! {
    /// The aggregates, of those given, that have rows on the per-row side.
    pub(crate) struct PendingAggregates {
        keys: Array<Text> = Vec<String>,
    }
}

statement! {
    /// Moves the cursor past a finished page: a compare-and-set on token, tick and position.
    pub(crate) struct Advance {
        token: BigInt = i64,
        tick: BigInt = i64,
        from: BigInt = i64,
        to: BigInt = i64,
        page_attempts: Integer = i32,
        lease_us: BigInt = i64,
    }
}

statement! {
    /// Hands rows of the log over to the per-row side, as parallel arrays.
    pub(crate) struct HandOver {
        ids: Array<BigInt> = Vec<i64>,
        kinds: Array<Text> = Vec<&'static str>,
        delays_us: Array<BigInt> = Vec<i64>,
        errors: Array<Nullable<Text>> = Vec<Option<String>>,
        attempts: Array<Integer> = Vec<i32>,
    }
}

statement! {
    /// Gives the cursor's lease back.
    pub(crate) struct GiveBack {
        owner: Text = String,
        token: BigInt = i64,
    }
}

statement! {
    /// Whether anything committed since the last tick.
    pub(crate) struct Committed {
        hi: Text = String,
    }
}

/// The log engine's statements for one table.
#[derive(Debug, Clone)]
pub(crate) struct LogStatements {
    pub(crate) take: Sql<Take>,
    pub(crate) open_tick: Sql<OpenTick>,
    pub(crate) read_page: Sql<ReadPage>,
    pub(crate) pending_aggregates: Sql<PendingAggregates>,
    pub(crate) advance: Sql<Advance>,
    pub(crate) hand_over: Sql<HandOver>,
    pub(crate) give_back: Sql<GiveBack>,
    pub(crate) committed: Sql<Committed>,
}

impl LogStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let cursor = table.quoted_with("_cursor");
        let lease = |p: &dyn std::fmt::Display| format!("now() + {p} * interval '1 microsecond'");
        // Rows not visible in `hi`: those of transactions running when it was taken, and
        // those of transactions begun since. Both are ranges of the `(xid, id)` index.
        let after_hi = |hi: &dyn std::fmt::Display| {
            format!(
                "(o.xid = ANY(ARRAY(SELECT pg_snapshot_xip({hi}::pg_snapshot))) \
                 OR o.xid >= pg_snapshot_xmax({hi}::pg_snapshot)) \
                 AND NOT pg_visible_in_snapshot(o.xid, {hi}::pg_snapshot)"
            )
        };
        LogStatements {
            // Expired, given back, or already this relay's. A lease taken from another
            // relay gets a new token (fencing that relay's pages) and, when that relay had
            // not finished its tick, counts one more attempt at the page it was on: a page
            // that kills or wedges every relay goes to the per-row side after max_attempts.
            take: Sql::new(format!(
                "UPDATE {cursor} SET\n\
                 \x20   token = CASE WHEN owner = {owner} THEN token ELSE least(token, 9223372036854775806) + 1 END,\n\
                 \x20   page_attempts = CASE WHEN owner IS NOT NULL AND owner <> {owner} AND after < ceiling \
                 THEN least(page_attempts, 2147483646) + 1 ELSE page_attempts END,\n\
                 \x20   owner = {owner}, lease_until = {until}\n\
                 WHERE part = 0 AND (owner = {owner} OR owner IS NULL OR lease_until <= now())\n\
                 RETURNING lo::text AS lo, hi::text AS hi, ceiling, after, tick, page_attempts, token",
                owner = Take::owner,
                until = lease(&Take::lease_us),
            )),
            // The new tick is every row visible now and not in the old `hi`. It opens only
            // when the old one is done and has rows; its commit is flushed (synchronous
            // commit) before any page of it is read, so a writer's asynchronous commit is
            // never published and then lost in a crash.
            open_tick: Sql::new(format!(
                "WITH s AS MATERIALIZED (SELECT pg_current_snapshot() AS cur),\n\
                 n AS MATERIALIZED (\n\
                 \x20   SELECT min(o.id) AS floor, max(o.id) AS ceiling FROM {t} o, s\n\
                 \x20   WHERE o.status = 'logged' AND {fresh} AND pg_visible_in_snapshot(o.xid, s.cur)\n\
                 )\n\
                 UPDATE {cursor} c SET lo = c.hi, hi = s.cur, ceiling = n.ceiling, after = n.floor - 1, \
                 tick = c.tick + 1, page_attempts = 0, lease_until = {until}\n\
                 FROM s, n\n\
                 WHERE c.part = 0 AND c.token = {token} AND c.tick = {tick} AND c.after = c.ceiling \
                 AND n.floor IS NOT NULL\n\
                 RETURNING c.lo::text AS lo, c.hi::text AS hi, c.ceiling, c.after, c.tick, c.page_attempts, c.token",
                fresh = after_hi(&OpenTick::hi),
                until = lease(&OpenTick::lease_us),
                token = OpenTick::token,
                tick = OpenTick::tick,
            )),
            // In id order (within a tick, each aggregate's order), with the cursor's values
            // as parameters so the scan walks the primary key from `from` and stops at the
            // page's end. The status is compared as an expression the `(xid, id) WHERE
            // status = 'logged'` index cannot stand for: offered that smaller index, the
            // planner would read every row of the tick past `from` and sort them, per page. Cut at the byte
            // budget (always one row); `read` says how many rows the scan found, so a page
            // cut by bytes is not taken for the tick's end.
            read_page: Sql::new(format!(
                "SELECT id, key, topic, aggregate_key, payload, content_type, headers, created_at, \
                 delayed, read FROM (\n\
                 \x20   SELECT p.*, sum(p.bytes) OVER (ORDER BY p.id) AS total, \
                 row_number() OVER (ORDER BY p.id) AS n, count(*) OVER () AS read FROM (\n\
                 \x20       SELECT o.id, o.idempotency_key AS key, o.topic, o.aggregate_key, o.payload, \
                 o.content_type, o.headers::text AS headers, \
                 CASE WHEN o.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' \
                 THEN o.created_at END AS created_at, o.available_at > now() AS delayed, \
                 octet_length(o.payload) + octet_length(o.headers::text) AS bytes\n\
                 \x20       FROM {t} o WHERE o.id > {from} AND o.id <= {ceiling} AND (o.status || '') = 'logged'\n\
                 \x20       AND pg_visible_in_snapshot(o.xid, {hi}::pg_snapshot) \
                 AND NOT pg_visible_in_snapshot(o.xid, {lo}::pg_snapshot)\n\
                 \x20       ORDER BY o.id LIMIT {limit}\n\
                 \x20   ) AS p\n\
                 ) AS q WHERE n < {limit} AND (n = 1 OR total <= {max_bytes}) ORDER BY id",
                from = ReadPage::from,
                ceiling = ReadPage::ceiling,
                hi = ReadPage::hi,
                lo = ReadPage::lo,
                limit = ReadPage::limit,
                max_bytes = ReadPage::max_bytes,
            )),
            pending_aggregates: Sql::new(format!(
                "SELECT DISTINCT aggregate_key AS key FROM {t} \
                 WHERE status = 'pending' AND aggregate_key = ANY({keys}::text[])",
                keys = PendingAggregates::keys,
            )),
            advance: Sql::new(format!(
                "UPDATE {cursor} SET after = {to}, page_attempts = {attempts}, lease_until = {until}\n\
                 WHERE part = 0 AND token = {token} AND tick = {tick} AND after = {from}",
                to = Advance::to,
                attempts = Advance::page_attempts,
                until = lease(&Advance::lease_us),
                token = Advance::token,
                tick = Advance::tick,
                from = Advance::from,
            )),
            // A failure is an attempt spent, as on the per-row side; a move is none.
            hand_over: Sql::new(format!(
                "UPDATE {t} t SET\n\
                 \x20   status = CASE o.kind WHEN '{OUTCOME_DEAD}' THEN 'dead' ELSE 'pending' END,\n\
                 \x20   dead_at = CASE WHEN o.kind = '{OUTCOME_DEAD}' THEN now() END,\n\
                 \x20   available_at = CASE WHEN o.kind = '{OUTCOME_RETRY}' \
                 THEN now() + o.delay_us * interval '1 microsecond' ELSE t.available_at END,\n\
                 \x20   attempts = o.attempt,\n\
                 \x20   last_error = o.err\n\
                 FROM unnest({ids}::bigint[], {kinds}::text[], {delays}::bigint[], {errors}::text[], \
                 {attempts}::integer[]) AS o(id, kind, delay_us, err, attempt)\n\
                 WHERE t.id = ANY({ids}::bigint[]) AND t.id = o.id AND t.status = 'logged'",
                ids = HandOver::ids,
                kinds = HandOver::kinds,
                delays = HandOver::delays_us,
                errors = HandOver::errors,
                attempts = HandOver::attempts,
            )),
            give_back: Sql::new(format!(
                "UPDATE {cursor} SET owner = NULL, lease_until = now() \
                 WHERE part = 0 AND owner = {owner} AND token = {token}",
                owner = GiveBack::owner,
                token = GiveBack::token,
            )),
            // The relay's look for work while it lingers: as the first matching row of
            // each range in xid order, so that walking the `(xid, id)` index and stopping
            // at the first match is the only sensible plan whatever the statistics say.
            committed: Sql::new(format!(
                "SELECT (SELECT o.xid FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid >= pg_snapshot_xmax({hi}::pg_snapshot) \
                 AND pg_visible_in_snapshot(o.xid, pg_current_snapshot()) ORDER BY o.xid LIMIT 1) IS NOT NULL \
                 OR (SELECT o.xid FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip({hi}::pg_snapshot))) \
                 AND pg_visible_in_snapshot(o.xid, pg_current_snapshot()) ORDER BY o.xid LIMIT 1) IS NOT NULL \
                 AS found",
                hi = Committed::hi,
            )),
        }
    }
}

#[cfg(test)]
impl crate::sql::Listed for LogStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let LogStatements {
            take,
            open_tick,
            read_page,
            pending_aggregates,
            advance,
            hand_over,
            give_back,
            committed,
        } = self;
        vec![
            ("log take".into(), take.text()),
            ("log open_tick".into(), open_tick.text()),
            ("log read_page".into(), read_page.text()),
            ("log pending_aggregates".into(), pending_aggregates.text()),
            ("log advance".into(), advance.text()),
            ("log hand_over".into(), hand_over.text()),
            ("log give_back".into(), give_back.text()),
            ("log committed".into(), committed.text()),
        ]
    }
}

/// The cursor row: the open tick (rows visible in `hi` and not in `lo`), how far into it
/// the relays are done (`after`; `ceiling` is the tick's largest id), and the lease.
#[derive(QueryableByName, Debug, Clone, PartialEq, Eq)]
pub(crate) struct CursorRow {
    #[diesel(sql_type = Text)]
    pub(crate) lo: String,
    #[diesel(sql_type = Text)]
    pub(crate) hi: String,
    #[diesel(sql_type = BigInt)]
    pub(crate) ceiling: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) after: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) tick: i64,
    #[diesel(sql_type = Integer)]
    pub(crate) page_attempts: i32,
    #[diesel(sql_type = BigInt)]
    pub(crate) token: i64,
}

/// A row of a page of the log.
#[derive(QueryableByName)]
pub(crate) struct PageRow {
    #[diesel(embed)]
    pub(crate) message: MessageColumns,
    /// Its `available_at` is ahead: it waits on the per-row side.
    #[diesel(sql_type = Bool)]
    pub(crate) delayed: bool,
    /// How many rows the read found (the same in every row of a page): a page cut by its
    /// byte budget is not taken for the tick's end.
    #[diesel(sql_type = BigInt)]
    pub(crate) read: i64,
}

#[derive(QueryableByName)]
struct KeyRow {
    #[diesel(sql_type = Text)]
    key: String,
}

#[derive(QueryableByName)]
struct Found {
    #[diesel(sql_type = Bool)]
    found: bool,
}

/// The guard of a page's finish: the cursor as the page was read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Guard {
    pub(crate) token: i64,
    pub(crate) tick: i64,
    /// `after` as the page was read from it.
    pub(crate) from: i64,
}

/// The log's statements run on the pool: each call checks a connection out.
pub(crate) struct PgLog {
    pub(crate) outbox: Outbox,
    pub(crate) pool: PgPool,
}

impl PgLog {
    fn sql(&self) -> &LogStatements {
        &self.outbox.statements().log
    }
}

impl LogTable for PgLog {
    fn take<'a>(
        &'a self,
        owner: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<CursorRow>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let rows: Vec<CursorRow> = self
                .sql()
                .take
                .bind(Take {
                    owner: owner.to_owned(),
                    lease_us: micros(lease),
                })
                .load(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(rows.into_iter().next())
        })
    }

    fn open_tick<'a>(
        &'a self,
        at: &'a CursorRow,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<CursorRow>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let query = self.sql().open_tick.bind(OpenTick {
                token: at.token,
                tick: at.tick,
                hi: at.hi.clone(),
                lease_us: micros(lease),
            });
            let rows: Vec<CursorRow> = conn
                .transaction(async move |c| {
                    // Stale statistics must not turn the tick's index ranges into a scan of
                    // the table's whole history.
                    c.batch_execute(
                        "SET LOCAL synchronous_commit = on; SET LOCAL enable_seqscan = off",
                    )
                    .await?;
                    query.load(c).await
                })
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(rows.into_iter().next())
        })
    }

    fn read_page<'a>(
        &'a self,
        at: &'a CursorRow,
        from: i64,
        limit: usize,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<PageRow>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let query = self.sql().read_page.bind(ReadPage {
                from,
                ceiling: at.ceiling,
                lo: at.lo.clone(),
                hi: at.hi.clone(),
                limit: i64::try_from(limit).unwrap_or(i64::MAX),
                max_bytes: i64::try_from(max_bytes).unwrap_or(i64::MAX),
            });
            conn.transaction(async move |c| {
                c.batch_execute(CLAIM_PLAN).await?;
                query.load(c).await
            })
            .await
            .map_err(|e| self.outbox.db_error(e))
        })
    }

    fn pending_aggregates<'a>(
        &'a self,
        keys: Vec<String>,
    ) -> BoxFuture<'a, Result<HashSet<String>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let keys: Vec<KeyRow> = self
                .sql()
                .pending_aggregates
                .bind(PendingAggregates { keys })
                .load(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(keys.into_iter().map(|k| k.key).collect())
        })
    }

    fn advance<'a>(
        &'a self,
        guard: Guard,
        to: i64,
        page_attempts: i32,
        hand_over: &'a [Outcome],
        lease: Duration,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let sql = self.sql();
            let advance = sql.advance.bind(Advance {
                token: guard.token,
                tick: guard.tick,
                from: guard.from,
                to,
                page_attempts,
                lease_us: micros(lease),
            });
            let hand = (!hand_over.is_empty()).then(|| {
                sql.hand_over.bind(HandOver {
                    ids: hand_over.iter().map(|o| o.id).collect(),
                    kinds: hand_over.iter().map(|o| o.kind).collect(),
                    delays_us: hand_over.iter().map(|o| micros(o.delay)).collect(),
                    errors: hand_over.iter().map(|o| o.error.clone()).collect(),
                    attempts: hand_over
                        .iter()
                        .map(|o| i32::try_from(o.attempt).unwrap_or(i32::MAX))
                        .collect(),
                })
            });
            conn.transaction(async move |c| {
                // The cursor first: two finishes never both hold a lock they must upgrade.
                if advance.execute(c).await? == 0 {
                    return Ok(false);
                }
                if let Some(hand) = hand {
                    hand.execute(c).await?;
                }
                Ok(true)
            })
            .await
            .map_err(|e: diesel::result::Error| self.outbox.db_error(e))
        })
    }

    fn committed<'a>(&'a self, hi: &'a str) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let found: Found = self
                .sql()
                .committed
                .bind(Committed { hi: hi.to_owned() })
                .get_result(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(found.found)
        })
    }

    fn give_back<'a>(&'a self, owner: &'a str, token: i64) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.sql()
                .give_back
                .bind(GiveBack {
                    owner: owner.to_owned(),
                    token,
                })
                .execute(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(())
        })
    }
}
