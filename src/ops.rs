//! Operations: stats, dead letters, redrive and purge, with their statements.
//!
//! Each statement runs in a transaction of its own (a savepoint inside the caller's), so
//! that a pooler in transaction mode prepares and runs it on one server connection.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::plan::{self, planned};
use crate::sql::{Sql, TableName, from_micros, micros, statement};

/// Rows deleted per statement by the purge operations, so no statement holds long locks.
pub(crate) const PURGE_BATCH: i64 = 1_000;

/// A row `o` of the log that the cursor has passed: its transaction is in a tick before the
/// open one, or in the open tick at or before the cursor's position. The cursor's values
/// come as scalar subqueries (computed once), not a join, so that they bound index scans.
fn behind(cursor: &str) -> String {
    format!(
        "(pg_visible_in_snapshot(o.xid, (SELECT lo FROM {cursor} WHERE part = 0)) \
         OR (pg_visible_in_snapshot(o.xid, (SELECT hi FROM {cursor} WHERE part = 0)) \
         AND o.id <= (SELECT after FROM {cursor} WHERE part = 0)))"
    )
}

/// Planner settings for a purge: walk its indexes in their order and stop at the batch.
/// Without them, statistics that predate the rows make a bitmap scan and a sort of every
/// retained row look cheaper, and that reads the whole retention on every round.
const PURGE_PLAN: &str = plan::INDEX_SCANS;

/// Planner settings for `stats`, the dead letters and a redrive: index scans only, which
/// stop at their limits, whatever plan a connection cached while the table was small.
const INDEXED_PLAN: &str = plan::INDEX_SCANS;

/// Beyond this many sent rows `stats` reports the planner's estimate instead of counting.
const SENT_EXACT_LIMIT: i64 = 100_000;

statement! {
    /// Gauges of the table; the sent-rows index is named for its size estimate.
    pub(crate) struct StatsQuery {
        sent_index: Text = String,
        logged_index: Text = String,
    }
}

statement! {
    /// Makes the dead letters among `keys` (all of them when empty) pending again.
    pub(crate) struct Redrive {
        keys: Array<Text> = Vec<String>,
    }
}

statement! {
    /// The oldest dead letters, of one topic when `topic` is not null, with their payloads
    /// when `payloads`.
    pub(crate) struct DeadLetters {
        topic: Nullable<Text> = Option<String>,
        payloads: Bool = bool,
        limit: BigInt = i64,
    }
}

statement! {
    /// Deletes the dead letters among `keys`.
    pub(crate) struct Discard {
        keys: Array<Text> = Vec<String>,
    }
}

statement! {
    /// Deletes up to `batch` dead letters, oldest first.
    pub(crate) struct DiscardAll {
        batch: BigInt = i64,
    }
}

statement! {
    /// Deletes up to `batch` rows older than `age_us`.
    pub(crate) struct Purge {
        age_us: BigInt = i64,
        batch: BigInt = i64,
    }
}

/// The operations' statements of one table.
#[derive(Debug, Clone)]
pub(crate) struct OpsStatements {
    pub(crate) stats: Sql<StatsQuery>,
    pub(crate) redrive: Sql<Redrive>,
    pub(crate) dead_letters: Sql<DeadLetters>,
    pub(crate) discard: Sql<Discard>,
    pub(crate) discard_all: Sql<DiscardAll>,
    pub(crate) purge_sent: Sql<Purge>,
    pub(crate) purge_inbox: Sql<Purge>,
}

impl OpsStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        let inbox = table.quoted_with("_inbox");
        let relays = table.quoted_with("_relays");
        let cursor = table.quoted_with("_cursor");
        OpsStatements {
            // On the log engine, the log's rows the cursor has not passed are pending too,
            // and count toward the lag: those committed after the open tick (by their
            // transaction ids), and the open tick's after the cursor's position (late ones
            // by their transaction ids, the rest along the primary key), so that the read
            // is in proportion to the backlog, not to what the cursor passed.
            stats: Sql::new(format!(
                "WITH c AS MATERIALIZED (SELECT lo, hi, after, ceiling, walk_from FROM {cursor} WHERE part = 0),\n\
                 backlog AS MATERIALIZED (\n\
                 \x20   SELECT o.created_at FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid = ANY(ARRAY(SELECT pg_snapshot_xip(hi) FROM c))\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT o.created_at FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid >= (SELECT pg_snapshot_xmax(hi) FROM c)\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT o.created_at FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid = ANY(ARRAY(SELECT x FROM c, pg_snapshot_xip(c.lo) AS x \
                 WHERE pg_visible_in_snapshot(x, c.hi))) \
                 AND o.id > (SELECT after FROM c) AND o.id <= (SELECT walk_from FROM c)\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT o.created_at FROM {t} o \
                 WHERE o.id > (SELECT greatest(after, walk_from) FROM c) AND o.id <= (SELECT ceiling FROM c) \
                 AND (o.status || '') = 'logged' AND pg_visible_in_snapshot(o.xid, (SELECT hi FROM c)) \
                 AND NOT pg_visible_in_snapshot(o.xid, (SELECT lo FROM c))\n\
                 )\n\
                 SELECT\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'pending' \
                 AND (lease_until IS NULL OR lease_until <= now())) \
                 + (SELECT count(*) FROM backlog) AS pending,\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'pending' \
                 AND lease_until > now()) AS in_flight,\n\
                 \x20   (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'sent' \
                 LIMIT {SENT_EXACT_LIMIT}) AS s) AS sent_counted,\n\
                 \x20   (SELECT greatest(reltuples, 0)::bigint FROM pg_class \
                 WHERE oid = to_regclass({sent_index})) AS sent_estimate,\n\
                 \x20   (SELECT count(*) FROM (SELECT 1 FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid < (SELECT pg_snapshot_xmax(hi) FROM {cursor} WHERE part = 0) AND {behind} \
                 LIMIT {SENT_EXACT_LIMIT}) AS l) AS logged_counted,\n\
                 \x20   (SELECT greatest(reltuples, 0)::bigint FROM pg_class \
                 WHERE oid = to_regclass({logged_index})) - (SELECT count(*) FROM backlog) AS logged_estimate,\n\
                 \x20   (SELECT count(*) FROM {t} WHERE status = 'dead') AS dead,\n\
                 \x20   (SELECT (extract(epoch FROM now() - least(min(created_at), \
                 (SELECT min(created_at) FROM backlog))) * 1000000)::bigint \
                 FROM {t} WHERE status = 'pending' AND available_at <= now()) AS lag_us,\n\
                 \x20   (SELECT (extract(epoch FROM now() - min(blocked_since)) * 1000000)::bigint \
                 FROM {relays} WHERE expires_at > now()) AS blocked_us",
                sent_index = StatsQuery::sent_index,
                logged_index = StatsQuery::logged_index,
                behind = behind(&cursor),
            )),
            redrive: Sql::new(format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now(), \
                 lease_until = NULL, dead_at = NULL \
                 WHERE status = 'dead' AND (cardinality({keys}::text[]) = 0 OR idempotency_key = ANY({keys})) \
                 RETURNING idempotency_key AS key",
                keys = Redrive::keys,
            )),
            // The topic is a filter on the dead letters' own index (they are few), never a
            // way into the table's history.
            dead_letters: Sql::new(format!(
                "SELECT id, idempotency_key AS key, topic, aggregate_key, attempts, last_error, \
                 created_at, dead_at, CASE WHEN {payloads} THEN payload END AS payload \
                 FROM {t} WHERE status = 'dead' AND ({topic}::text IS NULL OR topic = {topic}) \
                 ORDER BY id LIMIT {limit}",
                payloads = DeadLetters::payloads,
                topic = DeadLetters::topic,
                limit = DeadLetters::limit,
            )),
            discard: Sql::new(format!(
                "DELETE FROM {t} WHERE status = 'dead' AND idempotency_key = ANY({keys}::text[]) \
                 RETURNING idempotency_key AS key",
                keys = Discard::keys,
            )),
            discard_all: Sql::new(format!(
                "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE status = 'dead' \
                 ORDER BY id LIMIT {batch} FOR UPDATE SKIP LOCKED) RETURNING idempotency_key AS key",
                batch = DiscardAll::batch,
            )),
            // Sent rows by the time they were sent; on the log engine also the log's rows
            // the cursor has passed, by the time they were enqueued: the oldest transactions'
            // rows, in the `(xid, id)` index's order, of which those old enough go. So each
            // statement reads at most a batch of the log, whatever the retention keeps; a
            // row enqueued long before a younger one of an older transaction waits for it.
            purge_sent: Sql::new(format!(
                "WITH sent AS MATERIALIZED (\n\
                 \x20   SELECT id FROM {t} WHERE status = 'sent' \
                 AND sent_at < now() - {age} * interval '1 microsecond'\n\
                 \x20   ORDER BY sent_at LIMIT {batch} FOR UPDATE SKIP LOCKED\n\
                 ), logged AS MATERIALIZED (\n\
                 \x20   SELECT l.id FROM (SELECT o.id, o.created_at FROM {t} o WHERE o.status = 'logged' \
                 AND o.xid < (SELECT pg_snapshot_xmax(hi) FROM {cursor} WHERE part = 0) AND {behind}\n\
                 \x20   ORDER BY o.xid, o.id LIMIT {batch} FOR UPDATE OF o SKIP LOCKED) AS l\n\
                 \x20   WHERE l.created_at < now() - {age} * interval '1 microsecond'\n\
                 )\n\
                 DELETE FROM {t} WHERE id IN (SELECT id FROM sent UNION ALL SELECT id FROM logged)",
                age = Purge::age_us,
                batch = Purge::batch,
                behind = behind(&cursor),
            )),
            purge_inbox: Sql::new(format!(
                "WITH doomed AS MATERIALIZED (\n\
                 \x20   SELECT consumer, idempotency_key FROM {inbox} \
                 WHERE processed_at < now() - {age} * interval '1 microsecond'\n\
                 \x20   ORDER BY processed_at LIMIT {batch} FOR UPDATE SKIP LOCKED\n\
                 )\n\
                 DELETE FROM {inbox} WHERE (consumer, idempotency_key) IN \
                 (SELECT consumer, idempotency_key FROM doomed)",
                age = Purge::age_us,
                batch = Purge::batch,
            )),
        }
    }
}

/// Gauges of one outbox table, from [`Outbox::stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Pending rows not leased by a relay (due now, delayed, or waiting for a retry); on
    /// the log engine ([`Engine::Log`](crate::Engine::Log)) also the log's rows its cursor
    /// has not passed.
    pub pending: u64,
    /// Pending rows leased by a relay right now.
    pub in_flight: u64,
    /// Sent rows still in the table (until purged). Exact up to 100,000; beyond that
    /// PostgreSQL's estimate for the sent-rows index (refreshed by autovacuum and ANALYZE),
    /// flagged by [`Stats::sent_is_estimate`]. On the log engine the log's rows its cursor
    /// has passed count too (the same way, the log's index standing for the sent-rows one).
    pub sent: u64,
    /// True when [`Stats::sent`] is an estimate.
    pub sent_is_estimate: bool,
    /// Dead letters awaiting inspection or redrive.
    pub dead: u64,
    /// Lag: how long ago the oldest due pending message was enqueued (`None` when nothing
    /// is due).
    pub oldest_pending: Option<Duration>,
    /// How long a running relay has been unable to reach its broker (the longest such
    /// outage among live relays); `None` when every relay reaches its broker. While it
    /// lasts, relays publish nothing and spend no attempts.
    pub blocked_for: Option<Duration>,
}

/// A dead letter, from [`Outbox::dead_letters`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Row id (enqueue order).
    pub id: i64,
    /// Idempotency key.
    pub key: String,
    /// Topic.
    pub topic: String,
    /// Aggregate key, if any.
    pub aggregate_key: Option<String>,
    /// Attempts used.
    pub attempts: i32,
    /// Why it died (the last publish error, cut at 2,000 bytes).
    pub last_error: Option<String>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When it died.
    pub dead_at: Option<DateTime<Utc>>,
    /// Its payload, when asked for with [`DeadLetterFilter::with_payloads`] (else `None`).
    /// Payloads may hold personal data: show them only to those who may see it.
    pub payload: Option<Vec<u8>>,
}

/// Which dead letters [`Outbox::dead_letters_matching`] lists: the oldest first, up to a
/// limit (50 unless set), of every topic unless one is given, without their payloads
/// unless asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterFilter {
    topic: Option<String>,
    payloads: bool,
    limit: u32,
}

impl Default for DeadLetterFilter {
    fn default() -> Self {
        DeadLetterFilter {
            topic: None,
            payloads: false,
            limit: 50,
        }
    }
}

impl DeadLetterFilter {
    /// Every topic, no payloads, at most 50.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only the dead letters of this topic (compared exactly).
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// With each dead letter's payload ([`DeadLetter::payload`]).
    pub fn with_payloads(mut self) -> Self {
        self.payloads = true;
        self
    }

    /// At most this many (at least 1).
    pub fn limit(mut self, limit: u32) -> Self {
        self.limit = limit;
        self
    }
}

#[derive(QueryableByName)]
struct DeadLetterRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Nullable<Text>)]
    aggregate_key: Option<String>,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    dead_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<diesel::sql_types::Bytea>)]
    payload: Option<Vec<u8>>,
}

impl From<DeadLetterRow> for DeadLetter {
    fn from(row: DeadLetterRow) -> Self {
        DeadLetter {
            id: row.id,
            key: row.key,
            topic: row.topic,
            aggregate_key: row.aggregate_key,
            attempts: row.attempts,
            last_error: row.last_error,
            created_at: row.created_at,
            dead_at: row.dead_at,
            payload: row.payload,
        }
    }
}

#[derive(QueryableByName)]
struct StatsRow {
    #[diesel(sql_type = BigInt)]
    pending: i64,
    #[diesel(sql_type = BigInt)]
    in_flight: i64,
    #[diesel(sql_type = BigInt)]
    sent_counted: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    sent_estimate: Option<i64>,
    #[diesel(sql_type = BigInt)]
    logged_counted: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    logged_estimate: Option<i64>,
    #[diesel(sql_type = BigInt)]
    dead: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    lag_us: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    blocked_us: Option<i64>,
}

#[derive(QueryableByName)]
struct KeyRow {
    #[diesel(sql_type = Text)]
    key: String,
}

impl Outbox {
    /// Gauges and lag in one statement; cost proportional to pending and dead rows, not to
    /// the table's history (sent rows are counted up to 100,000, then estimated), whatever
    /// the planner's statistics say: it runs with sequential and bitmap scans off, in a
    /// transaction (a savepoint inside yours) that is rolled back, so the settings do not
    /// outlive it.
    ///
    /// # Errors
    /// [`Error::NotMigrated`] or a database error.
    pub async fn stats(&self, conn: &mut AsyncPgConnection) -> Result<Stats> {
        use diesel_async::{AnsiTransactionManager, TransactionManager};
        let query = self.statements().ops.stats.bind(StatsQuery {
            sent_index: self.inner.table.quoted_with("_sent_idx"),
            logged_index: self.inner.table.quoted_with("_logged_idx"),
        });
        AnsiTransactionManager::begin_transaction(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        let row = match conn.batch_execute(INDEXED_PLAN).await {
            Ok(()) => query.get_result::<StatsRow>(conn).await,
            Err(e) => Err(e),
        };
        let rolled_back = AnsiTransactionManager::rollback_transaction(conn).await;
        let row = row.map_err(|e| self.db_error(e))?;
        rolled_back.map_err(|e| self.db_error(e))?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        // Each part exact below the limit, else the larger of the limit and the estimate.
        let part = |counted: i64, estimate: Option<i64>| {
            if counted < SENT_EXACT_LIMIT {
                (count(counted), false)
            } else {
                (count(counted.max(estimate.unwrap_or(0))), true)
            }
        };
        let (sent_rows, sent_rows_estimated) = part(row.sent_counted, row.sent_estimate);
        let (passed, passed_estimated) = part(row.logged_counted, row.logged_estimate);
        let (sent, sent_is_estimate) = (
            sent_rows.saturating_add(passed),
            sent_rows_estimated || passed_estimated,
        );
        Ok(Stats {
            pending: count(row.pending),
            in_flight: count(row.in_flight),
            sent,
            sent_is_estimate,
            dead: count(row.dead),
            oldest_pending: row.lag_us.map(from_micros),
            blocked_for: row.blocked_us.map(from_micros),
        })
    }

    /// Makes dead letters pending again with a fresh attempt budget; `keys` empty means
    /// every dead letter. Returns the keys that were redriven (keys that are not dead
    /// letters are ignored). The fencing token is kept, so a relay still holding an old
    /// claim of such a row cannot overwrite it.
    ///
    /// A redriven message with an aggregate key is published after the messages of its
    /// aggregate that overtook it while it was dead: redrive restores delivery, not order.
    /// On the log engine it may even be published beside a later message of its aggregate
    /// that is being published from the log at that moment.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for an empty key; [`Error::NotMigrated`] or a database
    /// error.
    pub async fn redrive(
        &self,
        conn: &mut AsyncPgConnection,
        keys: &[&str],
    ) -> Result<Vec<String>> {
        if keys.iter().any(|k| k.is_empty()) {
            return Err(Error::invalid_option(
                "redrive: an idempotency key is empty",
            ));
        }
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let query = self.statements().ops.redrive.bind(Redrive { keys });
        let rows: Vec<KeyRow> = planned(conn, INDEXED_PLAN, query)
            .await
            .map_err(|e| self.db_error(e))?;
        let mut keys: Vec<String> = rows.into_iter().map(|r| r.key).collect();
        keys.sort();
        Ok(keys)
    }

    /// The oldest `limit` dead letters, in id order, without their payloads: as
    /// [`Outbox::dead_letters_matching`] with `DeadLetterFilter::new().limit(limit)`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a zero limit; [`Error::NotMigrated`] or a database
    /// error.
    pub async fn dead_letters(
        &self,
        conn: &mut AsyncPgConnection,
        limit: u32,
    ) -> Result<Vec<DeadLetter>> {
        self.dead_letters_matching(conn, &DeadLetterFilter::new().limit(limit))
            .await
    }

    /// The oldest dead letters that `filter` selects, in id order.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a zero limit or an empty topic; [`Error::NotMigrated`]
    /// or a database error.
    pub async fn dead_letters_matching(
        &self,
        conn: &mut AsyncPgConnection,
        filter: &DeadLetterFilter,
    ) -> Result<Vec<DeadLetter>> {
        if filter.limit == 0 {
            return Err(Error::invalid_option(
                "dead_letters: limit must be at least 1",
            ));
        }
        if filter.topic.as_deref() == Some("") {
            return Err(Error::invalid_option("dead_letters: the topic is empty"));
        }
        let query = self.statements().ops.dead_letters.bind(DeadLetters {
            topic: filter.topic.clone(),
            payloads: filter.payloads,
            limit: i64::from(filter.limit),
        });
        let rows: Vec<DeadLetterRow> = planned(conn, INDEXED_PLAN, query)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(rows.into_iter().map(DeadLetter::from).collect())
    }

    /// Deletes the dead letters among `keys` for good, and returns the keys that went
    /// (keys that are not dead letters are left alone and not returned; no keys, nothing
    /// goes: [`Outbox::discard_all`] empties the dead letters). For a message that will
    /// never be deliverable, such as one to a topic that does not exist, which a redrive
    /// would only kill again.
    ///
    /// Its row is gone, so enqueueing its idempotency key again is no longer reported as
    /// a duplicate, and nothing of it remains to inspect.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for an empty key; [`Error::NotMigrated`] or a database
    /// error.
    pub async fn discard(
        &self,
        conn: &mut AsyncPgConnection,
        keys: &[&str],
    ) -> Result<Vec<String>> {
        if keys.iter().any(|k| k.is_empty()) {
            return Err(Error::invalid_option(
                "discard: an idempotency key is empty",
            ));
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let query = self.statements().ops.discard.bind(Discard { keys });
        let rows: Vec<KeyRow> = planned(conn, INDEXED_PLAN, query)
            .await
            .map_err(|e| self.db_error(e))?;
        let mut keys: Vec<String> = rows.into_iter().map(|r| r.key).collect();
        keys.sort();
        Ok(keys)
    }

    /// Deletes every dead letter for good, in batches of 1,000, and returns how many went.
    /// As [`Outbox::discard`], for all of them.
    ///
    /// # Errors
    /// [`Error::NotMigrated`] or a database error.
    pub async fn discard_all(&self, conn: &mut AsyncPgConnection) -> Result<u64> {
        let mut total = 0u64;
        loop {
            let query = self
                .statements()
                .ops
                .discard_all
                .bind(DiscardAll { batch: PURGE_BATCH });
            let rows: Vec<KeyRow> = planned(conn, INDEXED_PLAN, query)
                .await
                .map_err(|e| self.db_error(e))?;
            let n = rows.len() as u64;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// Deletes sent rows whose `sent_at` is older than `older_than`, in batches of 1,000,
    /// and returns how many went; on the log engine also the log's rows its cursor has
    /// passed that were enqueued longer ago than `older_than` (oldest transactions first, a
    /// batch at a time, so a row waits for the older transactions' rows before it). Once a
    /// row is gone, enqueueing its key again is no longer reported as a duplicate: on the
    /// log engine that window counts from the enqueue, so a message published late (after
    /// an outage longer than `older_than`) keeps its key for less after its publish.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for an age that does not fit PostgreSQL's interval;
    /// [`Error::NotMigrated`] or a database error.
    pub async fn purge_sent(
        &self,
        conn: &mut AsyncPgConnection,
        older_than: Duration,
    ) -> Result<u64> {
        self.purge(conn, &self.statements().ops.purge_sent, older_than)
            .await
    }

    /// Deletes inbox (dedupe) records older than `older_than`, in batches of 1,000, and
    /// returns how many went. A duplicate delivery of a purged key is no longer detected, so
    /// keep records longer than any redelivery can take.
    ///
    /// # Errors
    /// As [`Outbox::purge_sent`].
    pub async fn purge_inbox(
        &self,
        conn: &mut AsyncPgConnection,
        older_than: Duration,
    ) -> Result<u64> {
        self.purge(conn, &self.statements().ops.purge_inbox, older_than)
            .await
    }

    async fn purge(
        &self,
        conn: &mut AsyncPgConnection,
        sql: &Sql<Purge>,
        older_than: Duration,
    ) -> Result<u64> {
        let age = purge_age(older_than)?;
        let mut total = 0u64;
        loop {
            let n = self.purge_batch(conn, sql, age, PURGE_BATCH).await?;
            total += n;
            if n < PURGE_BATCH as u64 {
                return Ok(total);
            }
        }
    }

    /// One purge statement; used by [`Outbox::purge_sent`] and the relay's janitor.
    pub(crate) async fn purge_batch(
        &self,
        conn: &mut AsyncPgConnection,
        sql: &Sql<Purge>,
        age_us: i64,
        batch: i64,
    ) -> Result<u64> {
        let query = sql.bind(Purge { age_us, batch });
        let n = conn
            .transaction(async |c| {
                c.batch_execute(PURGE_PLAN).await?;
                query.execute(c).await
            })
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(n as u64)
    }
}

/// An age in microseconds, as bound into SQL.
///
/// `Duration` cannot be negative; this rejects ages PostgreSQL cannot represent.
pub(crate) fn purge_age(age: Duration) -> Result<i64> {
    // 100 years: far beyond any retention, well inside PostgreSQL's interval range.
    const MAX_AGE: Duration = Duration::from_secs(100 * 366 * 24 * 60 * 60);
    if age > MAX_AGE {
        return Err(Error::invalid_option(format!(
            "purge age of {age:?} is out of range; the limit is 100 years"
        )));
    }
    Ok(micros(age))
}

#[cfg(test)]
impl crate::sql::Listed for OpsStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let OpsStatements {
            stats,
            redrive,
            dead_letters,
            discard,
            discard_all,
            purge_sent,
            purge_inbox,
        } = self;
        vec![
            stats.named_under("stats", INDEXED_PLAN),
            redrive.named_under("redrive", INDEXED_PLAN),
            dead_letters.named_under("dead_letters", INDEXED_PLAN),
            discard.named_under("discard", INDEXED_PLAN),
            discard_all.named_under("discard_all", INDEXED_PLAN),
            purge_sent.named_under("purge_sent", PURGE_PLAN),
            purge_inbox.named_under("purge_inbox", PURGE_PLAN),
        ]
    }
}
