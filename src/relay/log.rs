//! The log engine's side of the relay ([`Engine::Log`](crate::Engine::Log)): the cursor and
//! its lease, ticks, pages read in commit order, and each page finished with one
//! compare-and-set of the cursor, handing the rare failed or delayed message (and its
//! aggregate's later ones) to the per-row machinery. ARCHITECTURE.md gives the protocol
//! and why each invariant holds.
//!
//! One relay holds the cursor at a time (its lease, renewed as it works). Pages of one
//! tick are pipelined like per-row batches: each is read after the one before it, and
//! finished after the one before it finished, so the cursor only moves forward and only
//! past pages whose every message was confirmed or handed over. A page whose messages of
//! an aggregate follow an earlier page's still in flight waits for that page's finish
//! before it looks which aggregates the per-row side holds. A tick is opened only once
//! every page of the one before is finished.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use tokio::sync::watch;
use tokio::time::Instant;

use super::PgPool;
use super::options::Options;
use super::outcome::{
    CLAIM_PLAN, Claimed, MessageColumns, OUTCOME_DEAD, OUTCOME_MOVE, OUTCOME_RELEASE,
    OUTCOME_RETRY, OUTCOME_SENT, Outcome,
};
use crate::error::Result;
use crate::outbox::Outbox;
use crate::publisher::Record;
use crate::shutdown::retry_until;
use crate::sql::{Sql, TableName, micros, statement};

/// How long a relay that found no cursor it could take (the table is on the per-row
/// engine, or another relay holds it) waits before it looks again.
const TAKE_RETRY: Duration = Duration::from_secs(1);

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

/// The cursor as this relay last wrote or read it.
#[derive(QueryableByName, Debug, Clone)]
struct CursorRow {
    #[diesel(sql_type = Text)]
    lo: String,
    #[diesel(sql_type = Text)]
    hi: String,
    #[diesel(sql_type = BigInt)]
    ceiling: i64,
    #[diesel(sql_type = BigInt)]
    after: i64,
    #[diesel(sql_type = BigInt)]
    tick: i64,
    #[diesel(sql_type = Integer)]
    page_attempts: i32,
    #[diesel(sql_type = BigInt)]
    token: i64,
}

#[derive(QueryableByName)]
struct PageRow {
    #[diesel(embed)]
    message: MessageColumns,
    #[diesel(sql_type = Bool)]
    delayed: bool,
    #[diesel(sql_type = BigInt)]
    read: i64,
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

/// The cursor this relay holds, as it knows it.
#[derive(Debug, Clone)]
struct Held {
    row: CursorRow,
    /// When the lease should be renewed: half of it gone.
    renew_at: Instant,
}

/// What the relay knows of the log between its pages.
#[derive(Debug, Default)]
struct State {
    held: Option<Held>,
    /// No cursor could be taken: do not try again before then.
    retry_at: Option<Instant>,
    /// The last id read into a page of the open tick.
    read_to: i64,
    /// The open tick's last page was read.
    tick_read: bool,
    /// Bumped whenever the read position goes back (a page finished short, or a finish
    /// failed): pages of an older generation finish nothing.
    generation: u64,
    next_seq: u64,
    /// Pages read and not yet finished, by sequence number, with their aggregates.
    in_flight: HashMap<u64, HashSet<String>>,
}

/// The log engine's state of one relay: shared by its batches.
pub(crate) struct Log {
    outbox: Outbox,
    pool: PgPool,
    owner: String,
    state: Mutex<State>,
    /// Serialises page reads (a relay's clones running at once share one `Log`).
    reader: tokio::sync::Mutex<()>,
    /// Signals every finish.
    finished: watch::Sender<()>,
}

/// What a page read gives the batch.
pub(crate) struct PageRead {
    pub(crate) page: Page,
    /// Records to publish, in id order.
    pub(crate) ready: Vec<Claimed>,
    /// Rows that cannot be turned into a record: they die on their own.
    pub(crate) undecodable: Vec<(Record, Outcome)>,
}

/// A page of the log in a batch: what its finish needs.
#[derive(Debug)]
pub(crate) struct Page {
    shared: Arc<Log>,
    seq: u64,
    generation: u64,
    token: i64,
    tick: i64,
    page_attempts: i32,
    /// The cursor's lease, renewed by the finish.
    lease: Duration,
    /// Read past max_attempts: every row handed over.
    exhausted: bool,
    /// The cursor's position the page was read from.
    from: i64,
    /// Where the cursor goes once every message of the page is done.
    to: i64,
    /// Every row of the page in id order, with its aggregate.
    rows: Vec<(i64, Option<String>)>,
    /// Rows handed over without being published (delayed, behind the per-row side, a
    /// page past its attempts), and undecodable ones, with their outcomes.
    pub(crate) handed: Vec<Outcome>,
    done: bool,
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("owner", &self.owner).finish()
    }
}

/// What the relay does with a row of a finished page.
#[derive(Debug, PartialEq, Eq)]
enum Fate {
    Done,
    HandOver,
    Unfinished,
}

impl Log {
    pub(crate) fn new(outbox: Outbox, pool: PgPool, owner: String) -> Arc<Self> {
        Arc::new(Log {
            outbox,
            pool,
            owner,
            state: Mutex::new(State::default()),
            reader: tokio::sync::Mutex::new(()),
            finished: watch::Sender::new(()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cursor's lease, taken or renewed when half of it is gone; `None` when the table
    /// has no cursor or another relay holds it.
    async fn lease(&self, conn: &mut AsyncPgConnection, options: &Options) -> Result<Option<Held>> {
        {
            let state = self.state();
            if let Some(held) = &state.held
                && Instant::now() < held.renew_at
            {
                return Ok(Some(held.clone()));
            }
            if state.retry_at.is_some_and(|at| Instant::now() < at) {
                return Ok(None);
            }
        }
        let asked = Instant::now();
        let rows: Vec<CursorRow> = self
            .outbox
            .statements()
            .log
            .take
            .bind(Take {
                owner: self.owner.clone(),
                lease_us: micros(options.lease),
            })
            .load(conn)
            .await
            .map_err(|e| self.outbox.db_error(e))?;
        let mut state = self.state();
        let Some(row) = rows.into_iter().next() else {
            state.held = None;
            state.retry_at = Some(Instant::now() + TAKE_RETRY.min(options.lease / 2));
            return Ok(None);
        };
        state.retry_at = None;
        let same = state
            .held
            .as_ref()
            .is_some_and(|h| h.row.token == row.token && h.row.tick == row.tick);
        if !same {
            // Taken anew (or first): read from the committed position.
            tracing::info!(table = %self.outbox.table(), token = row.token, tick = row.tick, "took the log's cursor");
            state.generation += 1;
            state.read_to = row.after;
            state.tick_read = row.after >= row.ceiling;
        }
        let held = Held {
            renew_at: asked + options.lease / 2,
            row: if same {
                // Keep what this relay's own finishes wrote since.
                state.held.take().map(|h| h.row).unwrap_or(row)
            } else {
                row
            },
        };
        state.held = Some(held.clone());
        Ok(Some(held))
    }

    /// Reads the next page of at most `room` rows, opening a tick when the last one is done;
    /// `None` when there is nothing to read now.
    pub(crate) async fn next_page(
        self: &Arc<Self>,
        options: &Options,
        room: usize,
    ) -> Result<Option<PageRead>> {
        let _reader = self.reader.lock().await;
        let mut conn = crate::checkout(&self.pool).await?;
        let Some(mut held) = self.lease(&mut conn, options).await? else {
            return Ok(None);
        };
        let (tick_read, pages_out) = {
            let state = self.state();
            (state.tick_read, !state.in_flight.is_empty())
        };
        if tick_read {
            if pages_out {
                // A tick opens only once every page of the one before is finished.
                return Ok(None);
            }
            if held.row.after >= held.row.ceiling {
                match self.open_tick(&mut conn, &held, options).await? {
                    Some(opened) => held = opened,
                    None => return Ok(None),
                }
            } else {
                // Every page is finished, yet the cursor is short of the tick's end: read
                // again from where it is.
                let mut state = self.state();
                state.read_to = held.row.after;
                state.tick_read = false;
            }
        }
        let (from, generation) = {
            let state = self.state();
            (state.read_to, state.generation)
        };
        // After a page that never finished, pages shrink by half per attempt, down to one
        // row: a row that crashes or wedges every relay ends up alone in its page.
        let shrunk = (room >> held.row.page_attempts.clamp(0, 16)).max(1);
        let rows: Vec<PageRow> = {
            let query = self.outbox.statements().log.read_page.bind(ReadPage {
                from,
                ceiling: held.row.ceiling,
                lo: held.row.lo.clone(),
                hi: held.row.hi.clone(),
                // One row more than the page takes, to tell a page that ends the tick.
                limit: i64::try_from(shrunk).unwrap_or(i64::MAX - 1) + 1,
                max_bytes: i64::try_from(options.max_batch_bytes).unwrap_or(i64::MAX),
            });
            conn.transaction(async move |c| {
                c.batch_execute(CLAIM_PLAN).await?;
                query.load(c).await
            })
            .await
            .map_err(|e| self.outbox.db_error(e))?
        };
        let read = rows.as_slice().first().map_or(0, |r| r.read);
        let tick_end = read <= i64::try_from(shrunk).unwrap_or(i64::MAX - 1)
            && i64::try_from(rows.len()).unwrap_or(i64::MAX) == read;
        if rows.is_empty() {
            // Nothing left in the tick past the read position: once no page is out, the
            // cursor goes to the tick's end, and the next look opens a tick.
            if pages_out || from >= held.row.ceiling {
                let mut state = self.state();
                if state.generation == generation {
                    state.tick_read = true;
                }
                return Ok(None);
            }
            let advance = self.outbox.statements().log.advance.bind(Advance {
                token: held.row.token,
                tick: held.row.tick,
                from,
                to: held.row.ceiling,
                page_attempts: held.row.page_attempts,
                lease_us: micros(options.lease),
            });
            let moved = advance
                .execute(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            let mut state = self.state();
            if moved == 0 {
                state.held = None;
                state.generation += 1;
            } else if let Some(h) = &mut state.held
                && h.row.token == held.row.token
            {
                h.row.after = h.row.ceiling;
                state.read_to = h.row.ceiling;
                state.tick_read = true;
            }
            return Ok(None);
        }
        let to = if tick_end {
            held.row.ceiling
        } else {
            rows.last().map_or(from, |r| r.message.id)
        };
        let aggregates: HashSet<String> = rows
            .iter()
            .filter_map(|r| r.message.aggregate_key.clone())
            .collect();
        // Earlier pages still in flight with messages of these aggregates: their outcomes
        // (a hand-over, say) decide what happens to this page's.
        let (seq, earlier) = {
            let mut state = self.state();
            if state.generation != generation {
                return Ok(None);
            }
            state.read_to = to;
            state.tick_read = tick_end;
            let seq = state.next_seq;
            state.next_seq += 1;
            let earlier: Vec<u64> = state
                .in_flight
                .iter()
                .filter(|(_, a)| !a.is_disjoint(&aggregates))
                .map(|(s, _)| *s)
                .collect();
            state.in_flight.insert(seq, aggregates.clone());
            (seq, earlier)
        };
        let mut page = Page {
            shared: self.clone(),
            seq,
            generation,
            token: held.row.token,
            tick: held.row.tick,
            page_attempts: held.row.page_attempts,
            lease: options.lease,
            exhausted: false,
            from,
            to,
            rows: rows
                .iter()
                .map(|r| (r.message.id, r.message.aggregate_key.clone()))
                .collect(),
            handed: Vec::new(),
            done: false,
        };
        drop(conn);
        if !earlier.is_empty() {
            self.wait_finished(|s| earlier.iter().all(|e| !s.in_flight.contains_key(e)))
                .await;
            if self.state().generation != generation {
                // An earlier page was cut short (an outage): its unfinished messages are
                // read again, and this page's of their aggregates must not go first.
                page.done = true;
                self.mark_finished(seq, false);
                return Ok(None);
            }
        }
        let mut conn = crate::checkout(&self.pool).await?;
        let behind: HashSet<String> = if aggregates.is_empty() {
            HashSet::new()
        } else {
            let keys: Vec<KeyRow> = self
                .outbox
                .statements()
                .log
                .pending_aggregates
                .bind(PendingAggregates {
                    keys: aggregates.into_iter().collect(),
                })
                .load(&mut conn)
                .await
                .map_err(|e| self.outbox.db_error(e))?;
            keys.into_iter().map(|k| k.key).collect()
        };
        let exhausted = u32::try_from(held.row.page_attempts).unwrap_or(0) >= options.max_attempts;
        page.exhausted = exhausted;
        if exhausted {
            tracing::error!(
                table = %self.outbox.table(), rows = rows.len(), attempts = held.row.page_attempts,
                "a page of the log was read again and again without finishing (a relay crashing or \
                 hanging on it): its messages go to the per-row side, whose max_attempts ends such a row dead"
            );
        }
        let attempt = u32::try_from(held.row.page_attempts).unwrap_or(0) + 1;
        let mut moved_aggregates: HashSet<String> = behind;
        let mut ready = Vec::with_capacity(rows.len());
        let mut bad = Vec::new();
        for row in rows {
            let moved_behind = row
                .message
                .aggregate_key
                .as_ref()
                .is_some_and(|a| moved_aggregates.contains(a));
            let delayed = row.delayed;
            let (record, undecodable) = row.message.record(attempt);
            if exhausted || delayed || moved_behind {
                if let Some(a) = &record.aggregate_key {
                    moved_aggregates.insert(a.clone());
                }
                let mut moved = Outcome::moved(record.id);
                if exhausted {
                    // The attempts it has spent already: the per-row side's next claim
                    // of a row past max_attempts ends it dead.
                    moved.attempt = u32::try_from(held.row.page_attempts).unwrap_or(0);
                }
                page.handed.push(moved);
            } else if let Some(why) = undecodable {
                if let Some(a) = &record.aggregate_key {
                    moved_aggregates.insert(a.clone());
                }
                let outcome = Outcome::dead(&record, held.row.token, &why);
                bad.push((record, outcome));
            } else {
                ready.push(Claimed {
                    record,
                    token: held.row.token,
                });
            }
        }
        Ok(Some(PageRead {
            page,
            ready,
            undecodable: bad,
        }))
    }

    /// Opens the next tick: `None` when nothing committed since the last.
    async fn open_tick(
        &self,
        conn: &mut AsyncPgConnection,
        held: &Held,
        options: &Options,
    ) -> Result<Option<Held>> {
        let query = self.outbox.statements().log.open_tick.bind(OpenTick {
            token: held.row.token,
            tick: held.row.tick,
            hi: held.row.hi.clone(),
            lease_us: micros(options.lease),
        });
        let asked = Instant::now();
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
        let Some(row) = rows.into_iter().next() else {
            return Ok(None);
        };
        let held = Held {
            row,
            renew_at: asked + options.lease / 2,
        };
        let mut state = self.state();
        state.read_to = held.row.after;
        state.tick_read = held.row.after >= held.row.ceiling;
        state.held = Some(held.clone());
        tracing::trace!(table = %self.outbox.table(), tick = held.row.tick, "opened a tick");
        Ok(Some(held))
    }

    /// Waits until `ready` holds of the state (checked after every finish).
    async fn wait_finished(&self, ready: impl Fn(&State) -> bool) {
        let mut changes = self.finished.subscribe();
        loop {
            if ready(&self.state()) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// Whether the log may have work: pages of the open tick left, or commits since it.
    pub(crate) async fn has_work(&self, conn: &mut AsyncPgConnection) -> Result<bool> {
        let hi = {
            let state = self.state();
            let Some(held) = &state.held else {
                // Not held: the next claim tries to take it (at most every TAKE_RETRY).
                return Ok(state.retry_at.is_none_or(|at| Instant::now() >= at));
            };
            if !state.tick_read {
                return Ok(true);
            }
            if !state.in_flight.is_empty() {
                return Ok(false);
            }
            held.row.hi.clone()
        };
        let found: Found = self
            .outbox
            .statements()
            .log
            .committed
            .bind(Committed { hi })
            .get_result(conn)
            .await
            .map_err(|e| self.outbox.db_error(e))?;
        Ok(found.found)
    }

    /// Gives the cursor's lease back at shutdown, so another relay takes over at once.
    pub(crate) async fn give_back(&self) {
        let Some(token) = self.state().held.as_ref().map(|h| h.row.token) else {
            return;
        };
        let Ok(mut conn) = crate::checkout(&self.pool).await else {
            return;
        };
        let given = self
            .outbox
            .statements()
            .log
            .give_back
            .bind(GiveBack {
                owner: self.owner.clone(),
                token,
            })
            .execute(&mut conn)
            .await;
        if given.is_ok() {
            let mut state = self.state();
            state.held = None;
            state.generation += 1;
        }
    }

    /// Marks `seq` finished (or given up) and wakes whoever waits on it.
    fn mark_finished(&self, seq: u64, reset: bool) {
        let mut state = self.state();
        state.in_flight.remove(&seq);
        if reset {
            state.generation += 1;
            if let Some((after, ceiling)) =
                state.held.as_ref().map(|h| (h.row.after, h.row.ceiling))
            {
                state.read_to = after;
                state.tick_read = after >= ceiling;
            }
        }
        drop(state);
        self.finished.send_replace(());
    }
}

impl Page {
    /// Whether `id` is one of this page's rows.
    pub(crate) fn holds(&self, id: i64) -> bool {
        self.rows.binary_search_by_key(&id, |(r, _)| *r).is_ok()
    }

    /// Finishes the page after the one before it: moves the cursor past the longest
    /// prefix whose every message is confirmed or handed over, and hands those over, in one
    /// transaction. `outage` says the broker was out of reach (a page cut short by an
    /// outage costs no attempt). Retries until `by`; a finish that cannot be made leaves
    /// the cursor where it is, and the page is read again. Returns how many outcomes were
    /// discarded because another relay took the cursor over.
    pub(crate) async fn finish(
        mut self,
        outcomes: Vec<Outcome>,
        outage: bool,
        by: Instant,
        stop: watch::Receiver<bool>,
    ) -> usize {
        let log = self.shared.clone();
        let seq = self.seq;
        log.wait_finished(|s| s.in_flight.keys().all(|k| *k >= seq))
            .await;
        let current = log.state().generation == self.generation;
        if !current {
            self.done = true;
            log.mark_finished(seq, false);
            return 0;
        }
        let mut by_id: HashMap<i64, Outcome> = outcomes.into_iter().map(|o| (o.id, o)).collect();
        for handed in std::mem::take(&mut self.handed) {
            by_id.insert(handed.id, handed);
        }
        // Confirmed: done. Failed, or not to be published from the log: handed over. Not
        // published (shutdown, too late, or the relay lost the result): handed over too,
        // without an attempt charged, unless the broker is out of reach; then the page is
        // cut before it and read again after the outage.
        let mut handed_aggregates: HashSet<String> = HashSet::new();
        let mut hand_over: Vec<Outcome> = Vec::new();
        let mut last_done = self.from;
        let mut cut = false;
        for (id, aggregate) in &self.rows {
            let outcome = by_id.remove(id);
            let behind_hand_over = aggregate
                .as_ref()
                .is_some_and(|a| handed_aggregates.contains(a));
            let fate = match &outcome {
                Some(o) if o.kind == OUTCOME_SENT => Fate::Done,
                Some(o) if [OUTCOME_RETRY, OUTCOME_DEAD, OUTCOME_MOVE].contains(&o.kind) => {
                    Fate::HandOver
                }
                _ if outage && !behind_hand_over => Fate::Unfinished,
                _ => Fate::HandOver,
            };
            match fate {
                Fate::Unfinished => {
                    cut = true;
                    break;
                }
                Fate::HandOver => {
                    if let Some(a) = aggregate {
                        handed_aggregates.insert(a.clone());
                    }
                    hand_over.push(match outcome {
                        Some(o) if o.kind != OUTCOME_RELEASE => o,
                        _ => Outcome::moved(*id),
                    });
                }
                Fate::Done => {}
            }
            last_done = *id;
        }
        let to = if cut { last_done } else { self.to };
        // Attempts at the page's part of the tick count until the tick ends, or until the
        // page that used them up is handed over.
        let page_attempts = if self.exhausted {
            0
        } else {
            self.page_attempts
        };
        let unchanged =
            to == self.from && hand_over.is_empty() && page_attempts == self.page_attempts;
        let moved = if unchanged {
            Some(true)
        } else {
            self.advance(to, page_attempts, &hand_over, by, stop).await
        };
        self.done = true;
        match moved {
            Some(true) => {
                {
                    let mut state = log.state();
                    if let Some(held) = &mut state.held
                        && held.row.token == self.token
                        && held.row.tick == self.tick
                    {
                        held.row.after = to;
                        held.row.page_attempts = page_attempts;
                    }
                }
                log.mark_finished(seq, cut);
                0
            }
            Some(false) => {
                log.state().held = None;
                log.mark_finished(seq, true);
                self.rows.len()
            }
            None => {
                tracing::error!(
                    table = %log.outbox.table(), rows = self.rows.len(),
                    "finishing a page of the log failed; it will be read and published again"
                );
                log.state().held = None;
                log.mark_finished(seq, true);
                0
            }
        }
    }

    /// The compare-and-set and the hand-over in one transaction, retried until `by`:
    /// `Some(false)` when the cursor moved on without this relay, `None` when it failed.
    async fn advance(
        &self,
        to: i64,
        page_attempts: i32,
        hand_over: &[Outcome],
        by: Instant,
        stop: watch::Receiver<bool>,
    ) -> Option<bool> {
        let log = &self.shared;
        retry_until(
            by,
            super::limits::RECORD_GRACE,
            Some(stop),
            || async {
                let mut conn = crate::checkout(&log.pool).await?;
                self.advance_once(&mut conn, to, page_attempts, hand_over)
                    .await
            },
            |e: &crate::Error, _| {
                tracing::warn!(table = %log.outbox.table(), error = %e, "finishing a page failed; retrying");
            },
        )
        .await
    }

    async fn advance_once(
        &self,
        conn: &mut AsyncPgConnection,
        to: i64,
        page_attempts: i32,
        hand_over: &[Outcome],
    ) -> Result<bool> {
        let log = &self.shared;
        let sql = &log.outbox.statements().log;
        let lease_us = micros(self.lease);
        let advance = sql.advance.bind(Advance {
            token: self.token,
            tick: self.tick,
            from: self.from,
            to,
            page_attempts,
            lease_us,
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
        .map_err(|e: diesel::result::Error| log.outbox.db_error(e))
    }
}

impl Drop for Page {
    /// A page dropped unfinished (its batch's task ended early, or the relay was dropped
    /// mid-publish) finishes nothing: the read position goes back, and the page is read
    /// again with one more attempt counted against it.
    fn drop(&mut self) {
        if !self.done {
            {
                let mut state = self.shared.state();
                if let Some(held) = &mut state.held
                    && held.row.token == self.token
                    && held.row.tick == self.tick
                {
                    held.row.page_attempts = held.row.page_attempts.max(self.page_attempts + 1);
                }
            }
            self.shared.mark_finished(self.seq, true);
        }
    }
}
