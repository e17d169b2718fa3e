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
use crate::relay::outcome::{MessageColumns, OUTCOME_DEAD, OUTCOME_RETRY, Outcome};
use crate::sql::plan::planned;
use crate::sql::{Sql, TableName, micros, statement};

statement! {
    /// Takes the cursor's lease, or renews it.
    pub(crate) struct Take {
        owner: Text = String,
        lease_us: BigInt = i64,
    }
}

statement! {
    /// Opens the next tick, if the open one is done as the relay knows it and anything
    /// committed since.
    pub(crate) struct OpenTick {
        token: BigInt = i64,
        tick: BigInt = i64,
        hi: Text = String,
        ceiling: BigInt = i64,
        lease_us: BigInt = i64,
    }
}

statement! {
    /// Reads the next page of the open tick, walking the primary key from `from`.
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
    /// Reads the next page of the open tick where it starts before `walk_from`: there the
    /// tick holds rows of transactions that were running when `lo` was taken only, found
    /// by their transaction ids.
    pub(crate) struct ReadLatePage {
        from: BigInt = i64,
        walk_from: BigInt = i64,
        ceiling: BigInt = i64,
        lo: Text = String,
        hi: Text = String,
        limit: BigInt = i64,
        max_bytes: BigInt = i64,
    }
}

statement! {
    /// The aggregates, of those given, that have rows on the per-row side besides `besides`.
    pub(crate) struct PendingAggregates {
        keys: Array<Text> = Vec<String>,
        besides: Array<BigInt> = Vec<i64>,
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
    /// Who holds the cursor's lease, and for how much longer.
    pub(crate) struct Holder {}
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
    pub(crate) read_late_page: Sql<ReadLatePage>,
    pub(crate) pending_aggregates: Sql<PendingAggregates>,
    pub(crate) advance: Sql<Advance>,
    pub(crate) hand_over: Sql<HandOver>,
    pub(crate) give_back: Sql<GiveBack>,
    pub(crate) holder: Sql<Holder>,
    pub(crate) committed: Sql<Committed>,
}

/// Planner settings for the statements that look up the per-row side by arrays of the
/// page's keys: index scans only, and a plan made for the parameters of each call, since
/// their best plan depends on the arrays' lengths.
const LOG_PLAN: &str = crate::sql::plan::CUSTOM_PLANS;

/// Planner settings for the tick open and the page reads: index scans only, and PostgreSQL's
/// own choice between a plan for the call's parameters and the generic plan it settles on
/// after five calls. Their generic plans walk the log's index from the place asked for
/// whatever the statistics say (`tests/plans.rs` plans each generic on a table that grew
/// after its statistics were taken), while planning them anew cost more than running them:
/// about 0.4 ms a tick open and 0.2 ms a page read, which a steady stream pays per message.
const READ_PLAN: &str = crate::sql::plan::INDEX_SCANS;

/// Makes the commit of the statement's transaction synchronous whatever the session says
/// (evaluated in its `WHERE`, so no round trip of its own): a write of the cursor that a
/// crash or a failover could lose would send the relays back over pages they published.
const SYNCHRONOUS: &str = "set_config('synchronous_commit', 'on', true) IS NOT NULL";

/// The columns of a page's rows, from the table as `o`.
const PAGE_COLUMNS: &str = "o.id, o.idempotency_key AS key, o.topic, o.aggregate_key, o.payload, \
     o.content_type, o.headers::text AS headers, \
     CASE WHEN o.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' \
     THEN o.created_at END AS created_at, o.available_at > now() AS delayed, \
     octet_length(o.payload) + octet_length(o.headers::text) AS bytes";

/// A page of `rows` (in id order, at most `limit`), cut at the byte budget (always one row);
/// `read` says how many rows the scan found, so a page cut by bytes is not taken for the
/// tick's end.
fn page_of(rows: &str, limit: &dyn std::fmt::Display, max_bytes: &dyn std::fmt::Display) -> String {
    format!(
        "SELECT id, key, topic, aggregate_key, payload, content_type, headers, created_at, \
         delayed, read FROM (\n\
         \x20   SELECT p.*, sum(p.bytes) OVER (ORDER BY p.id) AS total, \
         row_number() OVER (ORDER BY p.id) AS n, count(*) OVER () AS read FROM (\n\
         {rows}\n\
         \x20   ) AS p\n\
         ) AS q WHERE n < {limit} AND (n = 1 OR total <= {max_bytes}) ORDER BY id"
    )
}

impl LogStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let cursor = table.quoted_with("_cursor");
        let lease = |p: &dyn std::fmt::Display| format!("now() + {p} * interval '1 microsecond'");
        let returning = "lo::text AS lo, hi::text AS hi, ceiling, after, walk_from, tick, \
                         page_attempts, token";
        // The tick's rows past `from`, walking the primary key: in id order (within a
        // tick, each aggregate's order), with the cursor's values as parameters so the scan
        // starts at `from` and stops at the page's end. The status is compared as an
        // expression the `(xid, id) WHERE status = 'logged'` index cannot stand for:
        // offered that smaller index, the planner would read every row of the tick past
        // `from` and sort them, per page. Each snapshot is cast once per call (a scalar
        // subquery), not once per row: a generic plan keeps the cast of a parameter in its
        // filter, and a snapshot lists every transaction that was running.
        let walk = |from: &dyn std::fmt::Display,
                    ceiling: &dyn std::fmt::Display,
                    lo: &dyn std::fmt::Display,
                    hi: &dyn std::fmt::Display,
                    limit: &dyn std::fmt::Display| {
            format!(
                "SELECT {PAGE_COLUMNS}\n\
                 \x20       FROM {t} o WHERE o.id > {from} AND o.id <= {ceiling} AND (o.status || '') = 'logged'\n\
                 \x20       AND pg_visible_in_snapshot(o.xid, (SELECT {hi}::pg_snapshot)) \
                 AND NOT pg_visible_in_snapshot(o.xid, (SELECT {lo}::pg_snapshot))\n\
                 \x20       ORDER BY o.id LIMIT {limit}"
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
                 WHERE part = 0 AND (owner = {owner} OR owner IS NULL OR lease_until <= now()) AND {SYNCHRONOUS}\n\
                 RETURNING {returning}",
                owner = Take::owner,
                until = lease(&Take::lease_us),
            )),
            // The new tick is every row visible now and not in the old `hi`: rows of the
            // transactions running when `hi` was taken (by their ids) and of those begun
            // since (a range of ids), each an index condition of its own whatever the plan.
            // It opens only when the open tick is done, as the relay knows it, and has
            // rows. Page reads walk the primary key from the smallest id of the rows of
            // transactions begun since `hi` (`walk_from`); below it the tick holds only
            // rows of the transactions that were running, which are found by their ids.
            // When nothing opens, the cursor as it is comes back, so that the relay can tell
            // a cursor that moved under it (a write the database lost, an operator) from
            // nothing new.
            open_tick: Sql::new(format!(
                "WITH s AS MATERIALIZED (SELECT pg_current_snapshot() AS cur),\n\
                 n AS MATERIALIZED (\n\
                 \x20   SELECT min(o.id) AS floor, max(o.id) AS ceiling, \
                 min(o.id) FILTER (WHERE o.xid >= (SELECT pg_snapshot_xmax({hi}::pg_snapshot))) AS fresh\n\
                 \x20   FROM (\n\
                 \x20       SELECT i.id, i.xid FROM {t} i WHERE i.status = 'logged' \
                 AND i.xid = ANY(ARRAY(SELECT pg_snapshot_xip({hi}::pg_snapshot)))\n\
                 \x20       UNION ALL\n\
                 \x20       SELECT i.id, i.xid FROM {t} i WHERE i.status = 'logged' \
                 AND i.xid >= pg_snapshot_xmax({hi}::pg_snapshot)\n\
                 \x20   ) AS o, s\n\
                 \x20   WHERE NOT pg_visible_in_snapshot(o.xid, (SELECT {hi}::pg_snapshot)) \
                 AND pg_visible_in_snapshot(o.xid, s.cur)\n\
                 ), opened AS (\n\
                 \x20   UPDATE {cursor} c SET lo = c.hi, hi = s.cur, ceiling = n.ceiling, after = n.floor - 1, \
                 walk_from = coalesce(n.fresh - 1, n.ceiling), tick = c.tick + 1, page_attempts = 0, \
                 lease_until = {until}\n\
                 \x20   FROM s, n\n\
                 \x20   WHERE c.part = 0 AND c.token = {token} AND c.tick = {tick} AND c.after = {ceiling} \
                 AND c.ceiling = {ceiling} AND c.hi::text = {hi} AND n.floor IS NOT NULL\n\
                 \x20   RETURNING c.lo::text AS lo, c.hi::text AS hi, c.ceiling, c.after, c.walk_from, c.tick, \
                 c.page_attempts, c.token\n\
                 )\n\
                 SELECT lo, hi, ceiling, after, walk_from, tick, page_attempts, token, true AS opened FROM opened\n\
                 UNION ALL\n\
                 SELECT {returning}, false FROM {cursor} WHERE part = 0 AND NOT EXISTS (SELECT 1 FROM opened)",
                hi = OpenTick::hi,
                ceiling = OpenTick::ceiling,
                until = lease(&OpenTick::lease_us),
                token = OpenTick::token,
                tick = OpenTick::tick,
            )),
            read_page: Sql::new(page_of(
                &walk(
                    &ReadPage::from,
                    &ReadPage::ceiling,
                    &ReadPage::lo,
                    &ReadPage::hi,
                    &ReadPage::limit,
                ),
                &ReadPage::limit,
                &ReadPage::max_bytes,
            )),
            // Up to `walk_from` the tick holds only rows of transactions that were running
            // when `lo` was taken (a transaction left open, committed late): each is found
            // through the `(xid, id)` index by its transaction id, so the ids of everything
            // the relays passed meanwhile are skipped, not walked. Past `walk_from`, the
            // primary key is walked as by `read_page`.
            read_late_page: Sql::new(page_of(
                &format!(
                    "SELECT * FROM (\n\
                     \x20       (SELECT r.* FROM pg_snapshot_xip({lo}::pg_snapshot) AS x(xid)\n\
                     \x20       CROSS JOIN LATERAL (SELECT {PAGE_COLUMNS} FROM {t} o \
                     WHERE o.status = 'logged' AND o.xid = x.xid AND o.id > {from} AND o.id <= {walk_from} \
                     ORDER BY o.id LIMIT {limit}) AS r\n\
                     \x20       WHERE pg_visible_in_snapshot(x.xid, (SELECT {hi}::pg_snapshot)) ORDER BY r.id LIMIT {limit})\n\
                     \x20       UNION ALL\n\
                     \x20       ({rest})\n\
                     \x20   ) AS u ORDER BY u.id LIMIT {limit}",
                    lo = ReadLatePage::lo,
                    hi = ReadLatePage::hi,
                    from = ReadLatePage::from,
                    walk_from = ReadLatePage::walk_from,
                    limit = ReadLatePage::limit,
                    rest = walk(
                        &ReadLatePage::walk_from,
                        &ReadLatePage::ceiling,
                        &ReadLatePage::lo,
                        &ReadLatePage::hi,
                        &ReadLatePage::limit,
                    ),
                ),
                &ReadLatePage::limit,
                &ReadLatePage::max_bytes,
            )),
            pending_aggregates: Sql::new(format!(
                "SELECT DISTINCT aggregate_key AS key FROM {t} \
                 WHERE status = 'pending' AND aggregate_key = ANY({keys}::text[]) \
                 AND id <> ALL({besides}::bigint[])",
                keys = PendingAggregates::keys,
                besides = PendingAggregates::besides,
            )),
            // The cursor's token comes back too, so that a guard that matched nothing tells
            // a takeover (another token) from a cursor that moved under this relay.
            advance: Sql::new(format!(
                "WITH moved AS (\n\
                 \x20   UPDATE {cursor} SET after = {to}, page_attempts = {attempts}, lease_until = {until}\n\
                 \x20   WHERE part = 0 AND token = {token} AND tick = {tick} AND after = {from} AND {SYNCHRONOUS}\n\
                 \x20   RETURNING 1\n\
                 )\n\
                 SELECT EXISTS (SELECT 1 FROM moved) AS moved, \
                 (SELECT c.token FROM {cursor} c WHERE c.part = 0) AS token",
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
                 WHERE part = 0 AND owner = {owner} AND token = {token} AND {SYNCHRONOUS}",
                owner = GiveBack::owner,
                token = GiveBack::token,
            )),
            // Read by a relay that could not take the cursor, to say whom it waits for.
            holder: Sql::new(format!(
                "SELECT owner, greatest(0, floor(extract(epoch FROM lease_until - now()) * 1000000))::bigint \
                 AS lease_left_us FROM {cursor} WHERE part = 0"
            )),
            // The relay's look for work while it lingers: as the first matching row of
            // each range in xid order, so that walking the `(xid, id)` index and stopping
            // at the first match is the only sensible plan whatever the statistics say.
            committed: Sql::new(format!(
                "SELECT (SELECT o.xid FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid >= (SELECT pg_snapshot_xmax({hi}::pg_snapshot)) \
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
            read_late_page,
            pending_aggregates,
            advance,
            hand_over,
            give_back,
            holder,
            committed,
        } = self;
        vec![
            take.named("log take"),
            open_tick.named_under("log open_tick", READ_PLAN),
            read_page.named_under("log read_page", READ_PLAN),
            read_late_page.named_under("log read_late_page", READ_PLAN),
            pending_aggregates.named_under("log pending_aggregates", LOG_PLAN),
            advance.named("log advance"),
            hand_over.named_under("log hand_over", LOG_PLAN),
            give_back.named("log give_back"),
            holder.named("log holder"),
            committed.named("log committed"),
        ]
    }
}

/// The cursor row: the open tick (rows visible in `hi` and not in `lo`), how far into it
/// the relays are done (`after`; `ceiling` is the tick's largest id; past `walk_from` page
/// reads walk the primary key), and the lease's token.
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
    pub(crate) walk_from: i64,
    #[diesel(sql_type = BigInt)]
    pub(crate) tick: i64,
    #[diesel(sql_type = Integer)]
    pub(crate) page_attempts: i32,
    #[diesel(sql_type = BigInt)]
    pub(crate) token: i64,
}

impl CursorRow {
    /// Whether `other` is the same place in the log (its lease's token aside, and the
    /// attempts counted at that place).
    pub(crate) fn same_place(&self, other: &CursorRow) -> bool {
        (
            self.tick,
            self.after,
            self.ceiling,
            self.walk_from,
            &self.lo,
            &self.hi,
        ) == (
            other.tick,
            other.after,
            other.ceiling,
            other.walk_from,
            &other.lo,
            &other.hi,
        )
    }
}

/// The relay that holds the cursor's lease (`None`: it was given back), and how long
/// its lease has left unless renewed.
#[derive(QueryableByName, Debug, Clone, PartialEq, Eq)]
pub(crate) struct HolderRow {
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) owner: Option<String>,
    #[diesel(sql_type = BigInt)]
    pub(crate) lease_left_us: i64,
}

#[derive(QueryableByName)]
struct OpenedRow {
    #[diesel(embed)]
    cursor: CursorRow,
    #[diesel(sql_type = Bool)]
    opened: bool,
}

#[derive(QueryableByName)]
struct AdvanceRow {
    #[diesel(sql_type = Bool)]
    moved: bool,
    #[diesel(sql_type = Nullable<BigInt>)]
    token: Option<i64>,
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

/// What a tick open found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Opened {
    /// A tick opened: the cursor at its start.
    Tick(CursorRow),
    /// None opened: the cursor as the database holds it (`None`: the table has none).
    Not(Option<CursorRow>),
}

/// What a page finish's compare-and-set found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Advanced {
    /// The cursor moved past the page.
    Moved,
    /// The guard matched nothing; the cursor's token now (`None`: the table has no cursor).
    Guarded { token: Option<i64> },
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
    ) -> BoxFuture<'a, Result<Opened>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let query = self.sql().open_tick.bind(OpenTick {
                token: at.token,
                tick: at.tick,
                hi: at.hi.clone(),
                ceiling: at.ceiling,
                lease_us: micros(lease),
            });
            let rows: Vec<OpenedRow> = planned(&mut conn, READ_PLAN, query)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(match rows.into_iter().next() {
                Some(row) if row.opened => Opened::Tick(row.cursor),
                row => Opened::Not(row.map(|r| r.cursor)),
            })
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
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let max_bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
            let sql = self.sql();
            let query = if from < at.walk_from {
                sql.read_late_page.bind(ReadLatePage {
                    from,
                    walk_from: at.walk_from,
                    ceiling: at.ceiling,
                    lo: at.lo.clone(),
                    hi: at.hi.clone(),
                    limit,
                    max_bytes,
                })
            } else {
                sql.read_page.bind(ReadPage {
                    from,
                    ceiling: at.ceiling,
                    lo: at.lo.clone(),
                    hi: at.hi.clone(),
                    limit,
                    max_bytes,
                })
            };
            planned(&mut conn, READ_PLAN, query)
                .await
                .map_err(|e| self.outbox.db_error(e))
        })
    }

    fn pending_aggregates<'a>(
        &'a self,
        keys: Vec<String>,
        besides: Vec<i64>,
    ) -> BoxFuture<'a, Result<HashSet<String>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let query = self
                .sql()
                .pending_aggregates
                .bind(PendingAggregates { keys, besides });
            let keys: Vec<KeyRow> = planned(&mut conn, LOG_PLAN, query)
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
    ) -> BoxFuture<'a, Result<Advanced>> {
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
            let Some(hand) = hand else {
                // A finish that hands nothing over writes the cursor alone, in one statement
                // (its own transaction, committed synchronously).
                let row: AdvanceRow = advance
                    .get_result(&mut conn)
                    .await
                    .map_err(|e| self.outbox.db_error(e))?;
                return Ok(if row.moved {
                    Advanced::Moved
                } else {
                    Advanced::Guarded { token: row.token }
                });
            };
            // The table before the cursor, as every transaction that writes both takes
            // them (a tick open reads the table, then writes the cursor; a move locks the
            // table, then deletes the cursor): a finish and a move never wait on each other
            // in a cycle.
            let mut guarded = None;
            let done = conn
                .transaction(async |c| {
                    // Index scans for the hand-over's rows (whatever plan the connection
                    // cached while the table was small); the cursor's update after it has
                    // its primary key either way.
                    c.batch_execute(LOG_PLAN).await?;
                    hand.execute(c).await?;
                    let row: AdvanceRow = advance.get_result(c).await?;
                    if !row.moved {
                        // Nothing of this finish may stay.
                        guarded = Some(row.token);
                        return Err(diesel::result::Error::RollbackTransaction);
                    }
                    Ok(())
                })
                .await;
            match (done, guarded) {
                (Ok(()), _) => Ok(Advanced::Moved),
                (Err(_), Some(token)) => Ok(Advanced::Guarded { token }),
                (Err(e), None) => Err(self.outbox.db_error(e)),
            }
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

    fn holder(&self) -> BoxFuture<'_, Result<Option<HolderRow>>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            let rows: Vec<HolderRow> = self
                .sql()
                .holder
                .bind(Holder {})
                .load(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            Ok(rows.into_iter().next())
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
