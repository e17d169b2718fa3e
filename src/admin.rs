//! Operations: stats, dead letters, redrive and purge.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::SENT_EXACT_LIMIT;
use crate::statement::Statement;

/// Rows deleted per statement by the purge operations, so no statement holds long locks.
pub(crate) const PURGE_BATCH: i64 = 1_000;

/// Gauges of one outbox table, from [`Outbox::stats`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Pending rows not leased by a relay (due now, delayed, or waiting for a retry).
    pub pending: u64,
    /// Pending rows leased by a relay right now.
    pub in_flight: u64,
    /// Sent rows still in the table (until purged). Exact up to 100,000; beyond that
    /// PostgreSQL's estimate for the sent-rows index (refreshed by autovacuum and ANALYZE),
    /// flagged by [`Stats::sent_is_estimate`].
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
#[derive(Debug, Clone, PartialEq, Eq, QueryableByName)]
#[non_exhaustive]
pub struct DeadLetter {
    /// Row id (enqueue order).
    #[diesel(sql_type = BigInt)]
    pub id: i64,
    /// Idempotency key.
    #[diesel(sql_type = Text)]
    pub key: String,
    /// Topic.
    #[diesel(sql_type = Text)]
    pub topic: String,
    /// Aggregate key, if any.
    #[diesel(sql_type = Nullable<Text>)]
    pub aggregate_key: Option<String>,
    /// Attempts used.
    #[diesel(sql_type = Integer)]
    pub attempts: i32,
    /// Why it died (the last publish error, cut at 2,000 bytes).
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// When it was enqueued.
    #[diesel(sql_type = Timestamptz)]
    pub created_at: DateTime<Utc>,
    /// When it died.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub dead_at: Option<DateTime<Utc>>,
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
    /// the planner's statistics say: it runs with sequential scans off, in a transaction (a
    /// savepoint inside yours) that is rolled back, so the setting does not outlive it.
    ///
    /// # Errors
    /// [`Error::NotMigrated`] or a database error.
    pub async fn stats(&self, conn: &mut AsyncPgConnection) -> Result<Stats> {
        use diesel_async::{AnsiTransactionManager, SimpleAsyncConnection, TransactionManager};
        let query = self
            .statements()
            .stats
            .query()
            .bind::<Text, _>(self.inner.table.quoted_with("_sent_idx"));
        AnsiTransactionManager::begin_transaction(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        let row = match conn.batch_execute("SET LOCAL enable_seqscan = off").await {
            Ok(()) => query.get_result::<StatsRow>(conn).await,
            Err(e) => Err(e),
        };
        let rolled_back = AnsiTransactionManager::rollback_transaction(conn).await;
        let row = row.map_err(|e| self.db_error(e))?;
        rolled_back.map_err(|e| self.db_error(e))?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        let (sent, sent_is_estimate) = if row.sent_counted < SENT_EXACT_LIMIT {
            (count(row.sent_counted), false)
        } else {
            (
                count(row.sent_counted.max(row.sent_estimate.unwrap_or(0))),
                true,
            )
        };
        Ok(Stats {
            pending: count(row.pending),
            in_flight: count(row.in_flight),
            sent,
            sent_is_estimate,
            dead: count(row.dead),
            oldest_pending: row.lag_us.map(micros_to_duration),
            blocked_for: row.blocked_us.map(micros_to_duration),
        })
    }

    /// Makes dead letters pending again with a fresh attempt budget; `keys` empty means
    /// every dead letter. Returns the keys that were redriven (keys that are not dead
    /// letters are ignored). The fencing token is kept, so a relay still holding an old
    /// claim of such a row cannot overwrite it.
    ///
    /// A redriven message with an aggregate key is published after the messages of its
    /// aggregate that overtook it while it was dead: redrive restores delivery, not order.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for an empty key; [`Error::NotMigrated`] or a database
    /// error.
    pub async fn redrive(
        &self,
        conn: &mut AsyncPgConnection,
        keys: &[&str],
    ) -> Result<Vec<String>> {
        if keys.iter().any(|k| k.is_empty()) {
            return Err(Error::invalid("redrive: an idempotency key is empty"));
        }
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let rows = self
            .statements()
            .redrive
            .query()
            .bind::<Array<Text>, _>(keys)
            .load::<KeyRow>(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        let mut keys: Vec<String> = rows.into_iter().map(|r| r.key).collect();
        keys.sort();
        Ok(keys)
    }

    /// The oldest `limit` dead letters, in id order.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a zero limit; [`Error::NotMigrated`] or a database
    /// error.
    pub async fn dead_letters(
        &self,
        conn: &mut AsyncPgConnection,
        limit: u32,
    ) -> Result<Vec<DeadLetter>> {
        if limit == 0 {
            return Err(Error::invalid("dead_letters: limit must be at least 1"));
        }
        self.statements()
            .dead_letters
            .query()
            .bind::<BigInt, _>(i64::from(limit))
            .load::<DeadLetter>(conn)
            .await
            .map_err(|e| self.db_error(e))
    }

    /// Deletes sent rows whose `sent_at` is older than `older_than`, in batches of 1,000,
    /// and returns how many went. Once a row is gone, enqueueing its key again is no
    /// longer reported as a duplicate.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for an age that does not fit PostgreSQL's interval;
    /// [`Error::NotMigrated`] or a database error.
    pub async fn purge_sent(
        &self,
        conn: &mut AsyncPgConnection,
        older_than: Duration,
    ) -> Result<u64> {
        self.purge(conn, &self.statements().purge_sent, older_than)
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
        self.purge(conn, &self.statements().purge_inbox, older_than)
            .await
    }

    async fn purge(
        &self,
        conn: &mut AsyncPgConnection,
        sql: &Statement,
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
        sql: &Statement,
        age_us: i64,
        batch: i64,
    ) -> Result<u64> {
        let n = sql
            .query()
            .bind::<BigInt, _>(age_us)
            .bind::<BigInt, _>(batch)
            .execute(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(n as u64)
    }
}

fn micros_to_duration(us: i64) -> Duration {
    Duration::from_micros(u64::try_from(us).unwrap_or(0))
}

/// An age in microseconds, as bound into SQL.
///
/// `Duration` cannot be negative; this rejects ages PostgreSQL cannot represent.
pub(crate) fn purge_age(age: Duration) -> Result<i64> {
    // 100 years: far beyond any retention, well inside PostgreSQL's interval range.
    const MAX_AGE: Duration = Duration::from_secs(100 * 366 * 24 * 60 * 60);
    if age > MAX_AGE {
        return Err(Error::invalid(format!(
            "purge age of {age:?} is out of range; the limit is 100 years"
        )));
    }
    Ok(i64::try_from(age.as_micros()).unwrap_or(i64::MAX))
}
