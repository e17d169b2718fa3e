//! The per-row engine ([`Engine::PerRow`](crate::Engine::PerRow)): a take claims due rows
//! with one statement, leasing each and stamping it with a fencing token one higher, and
//! each outcome is recorded on its row, fenced by that token. Its statements are here;
//! the log engine runs it beside itself for the messages it hands over.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{Array, BigInt, Bool, Integer, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::options::Options;
use super::outcome::{
    CLAIM_PLAN, Claimed, MessageColumns, OUTCOME_DEAD, OUTCOME_RELEASE, OUTCOME_RETRY,
    OUTCOME_SENT, Outcome,
};
use super::store::{Batch, Store};
use crate::connect::PgPool;
use crate::error::Result;
use crate::ops::Stats;
use crate::outbox::Outbox;
use crate::sql::plan::planned;
use crate::sql::{NoParams, Sql, TableName, micros, statement};

pub(crate) const MAX_RUN: usize = 1_000;

statement! {
    /// Claims a batch: see [`PerRowStatements::render`] for how.
    pub(crate) struct Claim {
        batch_size: BigInt = i64,
        lease_us: BigInt = i64,
        max_attempts: Integer = i32,
        /// The longest run taken behind one head.
        max_run: BigInt = i64,
        /// The batch's byte budget (payloads and headers).
        max_bytes: BigInt = i64,
        /// Rows this relay's own batches still hold (see `relay::held`): never taken.
        held: Array<BigInt> = Vec<i64>,
    }
}

statement! {
    /// Records a batch's outcomes, as parallel arrays.
    pub(crate) struct RecordOutcomes {
        ids: Array<BigInt> = Vec<i64>,
        tokens: Array<BigInt> = Vec<i64>,
        kinds: Array<Text> = Vec<&'static str>,
        delays_us: Array<BigInt> = Vec<i64>,
        errors: Array<Nullable<Text>> = Vec<Option<String>>,
        attempts: Array<Integer> = Vec<i32>,
    }
}

/// A claim reads at least this many successors of an aggregate head, to see whether another
/// relay holds leases further down that aggregate.
const CHECK_WINDOW: usize = 8;

/// The claim's statements for one table.
#[derive(Debug, Clone)]
pub(crate) struct PerRowStatements {
    pub(crate) claim: Sql<Claim>,
    pub(crate) due: Sql<NoParams>,
    pub(crate) record_outcomes: Sql<RecordOutcomes>,
}

impl PerRowStatements {
    pub(crate) fn render(table: &TableName) -> Self {
        let t = table.quoted();
        PerRowStatements {
            // Heads are pending rows with no older pending row in their aggregate. Behind
            // each aggregate head on its first attempt the claim also takes the run of its
            // due successors; the relay publishes such a run one message at a time. The
            // batch's room after the heads is shared out equally among the heads that may
            // take a run, so the rows read stay proportional to the batch, not to the
            // backlog of each aggregate.
            //
            // Another relay may hold (or be taking) leases on later rows of a head's
            // aggregate: after a redrive or a late commit put a row in front of rows already
            // in flight. So each head's next successors (its run, and at least 8) are read,
            // the run's members locked with SKIP LOCKED and checked again, and a head whose
            // window shows a live lease or a row someone else has locked is left alone. So
            // two relays never hold leases on rows of one aggregate, short of more than 7
            // rows redriven (or committed late) at once in front of rows in flight. A run is
            // cut at its first member that is not available.
            //
            // Heads are charged an attempt; run members are charged when published (their
            // outcome says so), so a crash mid-run costs only the head, and the head's next
            // claim comes without a run. A head claimed again after it has used up its
            // attempts without an outcome (a crash loop) goes dead here. Rows are cut, in id
            // order, at the byte budget (always at least one row); each run keeps a prefix.
            //
            // Rows whose outcomes this relay's own batches are still to record are never
            // taken, even once their leases have run out (see `relay::held`).
            //
            // Nothing in a row's content can make this statement fail: counters saturate,
            // headers come back as text and the enqueue time only when chrono can hold it,
            // so an undecodable row dies alone in the relay (see `decode`).
            claim: Sql::new(format!(
                "WITH heads AS MATERIALIZED (\n\
                 \x20   SELECT id, aggregate_key, attempts, {bytes} AS bytes FROM {t} o\n\
                 \x20   WHERE status = 'pending' AND available_at <= now()\n\
                 \x20     AND (lease_until IS NULL OR lease_until <= now())\n\
                 \x20     AND id <> ALL({held}::bigint[])\n\
                 \x20     AND (aggregate_key IS NULL OR NOT EXISTS (\n\
                 \x20         SELECT 1 FROM {t} p WHERE p.status = 'pending'\n\
                 \x20         AND p.aggregate_key = o.aggregate_key AND p.id < o.id))\n\
                 \x20   ORDER BY id LIMIT {batch_size}\n\
                 \x20   FOR UPDATE SKIP LOCKED\n\
                 ), share AS MATERIALIZED (\n\
                 \x20   SELECT least({max_run}, ({batch_size} - count(*)) / greatest(count(*) FILTER \
                 (WHERE aggregate_key IS NOT NULL AND attempts = 0), 1)) AS per_run FROM heads\n\
                 ), succ AS MATERIALIZED (\n\
                 \x20   SELECT h.id AS head, n.id, n.pos, n.ready, n.leased, n.bytes,\n\
                 \x20          h.attempts = 0 AND n.pos <= (SELECT per_run FROM share) AS in_run\n\
                 \x20   FROM heads h CROSS JOIN LATERAL (\n\
                 \x20       SELECT s.id, row_number() OVER (ORDER BY s.id) AS pos,\n\
                 \x20              s.available_at <= now() \
                 AND (s.lease_until IS NULL OR s.lease_until <= now()) AS ready,\n\
                 \x20              coalesce(s.lease_until > now(), false) AS leased,\n\
                 \x20              {s_bytes} AS bytes\n\
                 \x20       FROM {t} s WHERE s.status = 'pending'\n\
                 \x20       AND s.aggregate_key = h.aggregate_key AND s.id > h.id\n\
                 \x20       ORDER BY s.id LIMIT greatest((SELECT per_run FROM share), {CHECK_WINDOW} - 1) + 1\n\
                 \x20   ) AS n\n\
                 \x20   WHERE h.aggregate_key IS NOT NULL\n\
                 ), locked AS MATERIALIZED (\n\
                 \x20   SELECT id FROM {t}\n\
                 \x20   WHERE id = ANY (ARRAY(SELECT id FROM succ WHERE in_run AND ready))\n\
                 \x20     AND status = 'pending' AND available_at <= now()\n\
                 \x20     AND (lease_until IS NULL OR lease_until <= now())\n\
                 \x20     AND id <> ALL({held}::bigint[])\n\
                 \x20   FOR UPDATE SKIP LOCKED\n\
                 ), cut AS MATERIALIZED (\n\
                 \x20   SELECT s.head,\n\
                 \x20          min(s.pos) FILTER (WHERE NOT (s.in_run AND s.ready AND l.id IS NOT NULL)) AS stop,\n\
                 \x20          bool_or(s.leased OR (s.in_run AND s.ready AND l.id IS NULL)) AS held\n\
                 \x20   FROM succ s LEFT JOIN locked l ON l.id = s.id\n\
                 \x20   GROUP BY s.head\n\
                 ), chosen AS (\n\
                 \x20   SELECT h.id, true AS head, h.bytes FROM heads h LEFT JOIN cut c ON c.head = h.id\n\
                 \x20   WHERE c.held IS NOT TRUE\n\
                 \x20   UNION ALL\n\
                 \x20   SELECT s.id, false, s.bytes FROM succ s JOIN cut c ON c.head = s.head\n\
                 \x20   WHERE NOT c.held AND s.in_run AND (c.stop IS NULL OR s.pos < c.stop)\n\
                 ), due AS MATERIALIZED (\n\
                 \x20   SELECT array_agg(id) AS ids, \
                 coalesce(array_agg(id) FILTER (WHERE NOT head), '{{}}') AS runs FROM (\n\
                 \x20       SELECT id, head, sum(bytes) OVER (ORDER BY id) AS total, \
                 row_number() OVER (ORDER BY id) AS n FROM chosen\n\
                 \x20   ) AS b WHERE n = 1 OR total <= {max_bytes}\n\
                 )\n\
                 UPDATE {t} t SET\n\
                 \x20   attempts = CASE WHEN {run_member} THEN t.attempts ELSE {next_attempt} END,\n\
                 \x20   fencing_token = least(t.fencing_token, 9223372036854775806) + 1,\n\
                 \x20   lease_until = CASE WHEN {crash_loop} THEN NULL \
                 ELSE now() + {lease_us} * interval '1 microsecond' END,\n\
                 \x20   status = CASE WHEN {crash_loop} THEN 'dead' ELSE 'pending' END,\n\
                 \x20   dead_at = CASE WHEN {crash_loop} THEN now() END,\n\
                 \x20   last_error = CASE WHEN {crash_loop} \
                 THEN 'claimed ' || ({next_attempt}) || ' times without an outcome \
                 (relay crashed or lease expired); max_attempts is ' || {max_attempts} \
                 ELSE t.last_error END\n\
                 WHERE t.id = ANY((SELECT ids FROM due)::bigint[]) AND t.status = 'pending'\n\
                 RETURNING t.id, t.idempotency_key AS key, t.topic, t.aggregate_key, t.payload, \
                 t.content_type, t.headers::text AS headers, t.attempts, t.fencing_token, \
                 CASE WHEN t.created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59+00' \
                 THEN t.created_at END AS created_at, t.status, NOT {run_member} AS head",
                bytes = "octet_length(payload) + octet_length(headers::text)",
                s_bytes = "octet_length(s.payload) + octet_length(s.headers::text)",
                run_member = "t.id = ANY((SELECT runs FROM due)::bigint[])",
                next_attempt = "least(t.attempts, 2147483646) + 1",
                crash_loop = format_args!(
                    "t.attempts >= {} AND NOT t.id = ANY((SELECT runs FROM due)::bigint[])",
                    Claim::max_attempts
                ),
                batch_size = Claim::batch_size,
                lease_us = Claim::lease_us,
                max_attempts = Claim::max_attempts,
                max_run = Claim::max_run,
                max_bytes = Claim::max_bytes,
                held = Claim::held,
            )),
            // A cheap look for work, used while lingering between claims. As the first due
            // row in id order (not `EXISTS`, whose ORDER BY the planner drops), so the only
            // sensible plan walks the pending index and stops at the first match, whatever
            // the statistics say: a sequential scan would read the table's whole history.
            due: Sql::new(format!(
                "SELECT (SELECT o.id FROM {t} o WHERE o.status = 'pending' \
                 AND o.available_at <= now() AND (o.lease_until IS NULL OR o.lease_until <= now()) \
                 AND (o.aggregate_key IS NULL OR NOT EXISTS (SELECT 1 FROM {t} p \
                 WHERE p.status = 'pending' AND p.aggregate_key = o.aggregate_key AND p.id < o.id)) \
                 ORDER BY o.id LIMIT 1) IS NOT NULL AS due"
            )),
            // One statement for every outcome of a batch, fenced by token and status: a
            // relay whose lease was taken over updates nothing. `t.id = ANY(ids)` bounds the
            // rows read to the batch whatever the planner estimates; it runs as a hash join
            // (see `RECORD_PLAN`), never as a nested loop rescanning the arrays.
            record_outcomes: Sql::new(format!(
                "UPDATE {t} t SET\n\
                 \x20   status = CASE o.kind WHEN '{OUTCOME_SENT}' THEN 'sent' \
                 WHEN '{OUTCOME_DEAD}' THEN 'dead' ELSE 'pending' END,\n\
                 \x20   sent_at = CASE WHEN o.kind = '{OUTCOME_SENT}' THEN now() ELSE t.sent_at END,\n\
                 \x20   dead_at = CASE WHEN o.kind = '{OUTCOME_DEAD}' THEN now() ELSE t.dead_at END,\n\
                 \x20   available_at = CASE WHEN o.kind = '{OUTCOME_RETRY}' \
                 THEN now() + o.delay_us * interval '1 microsecond' ELSE t.available_at END,\n\
                 \x20   attempts = CASE WHEN o.kind = '{OUTCOME_RELEASE}' \
                 THEN greatest(o.attempt - 1, 0) ELSE o.attempt END,\n\
                 \x20   last_error = CASE WHEN o.kind IN ('{OUTCOME_RETRY}', '{OUTCOME_DEAD}') \
                 THEN o.err ELSE t.last_error END,\n\
                 \x20   lease_until = NULL\n\
                 FROM unnest({ids}::bigint[], {tokens}::bigint[], {kinds}::text[], {delays}::bigint[], {errors}::text[], \
                 {attempts}::integer[]) AS o(id, token, kind, delay_us, err, attempt)\n\
                 WHERE t.id = ANY({ids}::bigint[]) AND t.id = o.id AND t.fencing_token = o.token \
                 AND t.status = 'pending'\n\
                 RETURNING t.id",
                ids = RecordOutcomes::ids,
                tokens = RecordOutcomes::tokens,
                kinds = RecordOutcomes::kinds,
                delays = RecordOutcomes::delays_us,
                errors = RecordOutcomes::errors,
                attempts = RecordOutcomes::attempts,
            )),
        }
    }
}

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(embed)]
    message: MessageColumns,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = BigInt)]
    fencing_token: i64,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Bool)]
    head: bool,
}

#[derive(QueryableByName)]
struct OutcomeRow {
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)] // returned to count the rows that were updated
    id: i64,
}

impl PerRow {
    /// Claims up to `batch_size` due rows with one statement (see `PerRowStatements::render`),
    /// leaving the `held` rows alone.
    pub(crate) async fn claim(
        &self,
        conn: &mut AsyncPgConnection,
        limits: &Options,
        held: Vec<i64>,
    ) -> Result<Batch> {
        let claimed_at = Instant::now();
        let rows = self.outbox.statements().per_row.claim.bind(Claim {
            batch_size: i64::try_from(limits.batch_size).unwrap_or(i64::MAX),
            lease_us: micros(limits.lease),
            max_attempts: i32::try_from(limits.max_attempts).unwrap_or(i32::MAX),
            max_run: i64::try_from(limits.batch_size.min(MAX_RUN)).unwrap_or(1),
            max_bytes: i64::try_from(limits.max_batch_bytes).unwrap_or(i64::MAX),
            held,
        });
        let rows: Vec<ClaimRow> = planned(conn, CLAIM_PLAN, rows)
            .await
            .map_err(|e| self.outbox.db_error(e))?;
        let mut batch = Batch {
            claimed_at,
            ..Batch::default()
        };
        for row in rows {
            let token = row.fencing_token;
            let status_dead = row.status == "dead";
            // A head was charged by the claim; a run member is charged when published.
            let attempt = u32::try_from(row.attempts).unwrap_or(0) + u32::from(!row.head);
            let (record, undecodable) = row.message.record(attempt);
            match undecodable {
                _ if status_dead => batch.crash_looped.push(record),
                Some(why) => {
                    let outcome = Outcome::dead(&record, token, &why);
                    batch.undecodable.push((record, outcome));
                }
                None => batch.ready.push(Claimed { record, token }),
            }
        }
        batch.ready.sort_by_key(|c| c.record.id);
        Ok(batch)
    }

    /// Records every outcome of a batch with one statement, fenced by token and status.
    /// Returns how many outcomes were discarded because another relay holds a newer claim.
    pub(crate) async fn record_outcomes(
        &self,
        conn: &mut AsyncPgConnection,
        outcomes: &[Outcome],
    ) -> Result<usize> {
        if outcomes.is_empty() {
            return Ok(0);
        }
        // In id order, as claims lock rows, so the two never wait on each other in a cycle.
        let mut outcomes: Vec<&Outcome> = outcomes.iter().collect();
        outcomes.sort_by_key(|o| o.id);
        let ids: Vec<i64> = outcomes.iter().map(|o| o.id).collect();
        let tokens: Vec<i64> = outcomes.iter().map(|o| o.token).collect();
        let kinds: Vec<&'static str> = outcomes.iter().map(|o| o.kind).collect();
        let delays: Vec<i64> = outcomes.iter().map(|o| micros(o.delay)).collect();
        let errors: Vec<Option<String>> = outcomes.iter().map(|o| o.error.clone()).collect();
        let attempts: Vec<i32> = outcomes
            .iter()
            .map(|o| i32::try_from(o.attempt).unwrap_or(i32::MAX))
            .collect();
        let rows = self
            .outbox
            .statements()
            .per_row
            .record_outcomes
            .bind(RecordOutcomes {
                ids,
                tokens,
                kinds,
                delays_us: delays,
                errors,
                attempts,
            });
        let rows: Vec<OutcomeRow> = planned(conn, RECORD_PLAN, rows)
            .await
            .map_err(|e| self.outbox.db_error(e))?;
        Ok(outcomes.len().saturating_sub(rows.len()))
    }

    /// Whether any pending row is due and unleased (it may still be blocked by its aggregate).
    pub(crate) async fn anything_due(&self, conn: &mut AsyncPgConnection) -> Result<bool> {
        #[derive(QueryableByName)]
        struct Due {
            #[diesel(sql_type = Bool)]
            due: bool,
        }
        let row: Due = self
            .outbox
            .statements()
            .per_row
            .due
            .bind(NoParams {})
            .get_result(conn)
            .await
            .map_err(|e| self.outbox.db_error(e))?;
        Ok(row.due)
    }
}

/// The per-row engine on a table: each call checks a connection out of the pool.
#[derive(Clone)]
pub(crate) struct PerRow {
    pub(crate) outbox: Outbox,
    pub(crate) pool: PgPool,
}

impl Store for PerRow {
    fn take<'a>(&'a self, options: &'a Options, held: Vec<i64>) -> BoxFuture<'a, Result<Batch>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.claim(&mut conn, options, held).await
        })
    }

    fn record<'a>(&'a self, outcomes: &'a [Outcome]) -> BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.record_outcomes(&mut conn, outcomes).await
        })
    }

    fn due(&self) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.anything_due(&mut conn).await
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<Stats>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.outbox.stats(&mut conn).await
        })
    }

    fn set_state<'a>(
        &'a self,
        relay_id: &'a str,
        idle: bool,
        ttl: Duration,
        blocked_for: Option<Duration>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.outbox
                .set_relay_state(&mut conn, relay_id, idle, ttl, blocked_for)
                .await
        })
    }

    fn forget<'a>(&'a self, relay_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut conn = crate::checkout(&self.pool).await?;
            self.outbox.remove_relay(&mut conn, relay_id).await
        })
    }

    fn pool(&self) -> Option<&PgPool> {
        Some(&self.pool)
    }
}

/// Planner settings for recording outcomes: index scans as for the claim, and no nested
/// loop. When the statistics say few rows are pending (say, analysed before a burst), the
/// planner would otherwise rescan the outcome arrays once per row, or read every pending row
/// into a hash: both cost in proportion to more than the batch.
const RECORD_PLAN: &str = crate::sql::plan::NO_NESTED_LOOP;

#[cfg(test)]
impl crate::sql::Listed for PerRowStatements {
    fn listed(&self) -> Vec<(String, &str)> {
        let PerRowStatements {
            claim,
            due,
            record_outcomes,
        } = self;
        vec![
            claim.named_under("claim", CLAIM_PLAN),
            due.named("due"),
            record_outcomes.named_under("record_outcomes", RECORD_PLAN),
        ]
    }
}
