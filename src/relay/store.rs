//! The relay's side of the table: claim a batch, record its outcomes.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::QueryResult;
use diesel::QueryableByName;
use diesel::pg::Pg;
use diesel::sql_types::{Array, BigInt, Bool, Bytea, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use tokio::time::Instant;

use super::options::Options;
use crate::error::Result;
use crate::outbox::Outbox;
use crate::publisher::Record;
use crate::sql::{OUTCOME_DEAD, OUTCOME_RELEASE, OUTCOME_RETRY, OUTCOME_SENT};
use crate::statement::Prepared;

/// The longest run of one aggregate's messages a claim takes behind its head.
pub(crate) const MAX_RUN: usize = 1_000;

/// `last_error` is cut to at most this many bytes.
pub(crate) const MAX_ERROR_BYTES: usize = 2_000;

#[derive(QueryableByName)]
struct ClaimRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = Text)]
    key: String,
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Nullable<Text>)]
    aggregate_key: Option<String>,
    #[diesel(sql_type = Bytea)]
    payload: Vec<u8>,
    #[diesel(sql_type = Nullable<Text>)]
    content_type: Option<String>,
    /// As text: a jsonb value serde cannot hold (`1e400`, deep nesting) must fail this row
    /// alone, not the whole claim.
    #[diesel(sql_type = Text)]
    headers: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = BigInt)]
    fencing_token: i64,
    /// `NULL` when chrono cannot hold it (`infinity`, or beyond the year 9999).
    #[diesel(sql_type = Nullable<Timestamptz>)]
    created_at: Option<DateTime<Utc>>,
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

/// A claimed record with the fencing token its outcome must carry.
#[derive(Debug)]
pub(crate) struct Claimed {
    pub(crate) record: Record,
    pub(crate) token: i64,
}

/// What one claim statement returned.
#[derive(Debug)]
pub(crate) struct Batch {
    /// Taken just before the claim ran: the leases end no earlier than `lease` after this.
    pub(crate) claimed_at: Instant,
    /// Records to publish, in id order.
    pub(crate) ready: Vec<Claimed>,
    /// Rows the claim itself turned dead: claimed too often without an outcome.
    pub(crate) crash_looped: Vec<Record>,
    /// Rows that cannot be turned into a record; they die on their own.
    pub(crate) undecodable: Vec<(Record, Outcome)>,
}

impl Default for Batch {
    fn default() -> Self {
        Batch {
            claimed_at: Instant::now(),
            ready: Vec::new(),
            crash_looped: Vec::new(),
            undecodable: Vec::new(),
        }
    }
}

impl Batch {
    pub(crate) fn claimed(&self) -> usize {
        self.ready.len() + self.crash_looped.len() + self.undecodable.len()
    }
}

/// The outcome of one claimed row, fenced by its token.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) id: i64,
    pub(crate) token: i64,
    /// The attempt this outcome closes (the row's `attempts` afterwards, less one for a
    /// release, which gives the attempt back).
    pub(crate) attempt: u32,
    pub(crate) kind: &'static str,
    pub(crate) delay: Duration,
    pub(crate) error: Option<String>,
}

impl Outcome {
    pub(crate) fn sent(r: &Record, token: i64) -> Self {
        Self::new(r, token, OUTCOME_SENT, Duration::ZERO, None)
    }

    pub(crate) fn retry(
        r: &Record,
        token: i64,
        delay: Duration,
        error: &dyn std::fmt::Display,
    ) -> Self {
        Self::new(r, token, OUTCOME_RETRY, delay, Some(error_text(error)))
    }

    pub(crate) fn dead(r: &Record, token: i64, error: &dyn std::fmt::Display) -> Self {
        Self::new(
            r,
            token,
            OUTCOME_DEAD,
            Duration::ZERO,
            Some(error_text(error)),
        )
    }

    pub(crate) fn release(r: &Record, token: i64) -> Self {
        Self::new(r, token, OUTCOME_RELEASE, Duration::ZERO, None)
    }

    fn new(
        r: &Record,
        token: i64,
        kind: &'static str,
        delay: Duration,
        error: Option<String>,
    ) -> Self {
        Outcome {
            id: r.id,
            token,
            attempt: r.attempt,
            kind,
            delay,
            error,
        }
    }
}

impl Outbox {
    /// Claims up to `batch_size` due rows with one statement (see `Statements::claim`).
    pub(crate) async fn claim(
        &self,
        conn: &mut AsyncPgConnection,
        limits: &Options,
    ) -> Result<Batch> {
        let claimed_at = Instant::now();
        let rows = self
            .statements()
            .claim
            .query()
            .bind::<BigInt, _>(i64::try_from(limits.batch_size).unwrap_or(i64::MAX))
            .bind::<BigInt, _>(micros(limits.lease))
            .bind::<Integer, _>(i32::try_from(limits.max_attempts).unwrap_or(i32::MAX))
            .bind::<BigInt, _>(i64::try_from(limits.batch_size.min(MAX_RUN)).unwrap_or(1))
            .bind::<BigInt, _>(i64::try_from(limits.max_batch_bytes).unwrap_or(i64::MAX));
        let rows: Vec<ClaimRow> = planned(conn, CLAIM_PLAN, rows)
            .await
            .map_err(|e| self.db_error(e))?;
        let mut batch = Batch {
            claimed_at,
            ready: Vec::new(),
            crash_looped: Vec::new(),
            undecodable: Vec::new(),
        };
        for row in rows {
            let token = row.fencing_token;
            let status_dead = row.status == "dead";
            // A row that cannot be decoded is still named by key and topic as it dies.
            let (headers, created_at, undecodable) = match decode(&row) {
                Ok((headers, created_at)) => (headers, created_at, None),
                Err(why) => (BTreeMap::new(), DateTime::UNIX_EPOCH, Some(why)),
            };
            let record = Record {
                id: row.id,
                key: row.key,
                topic: row.topic,
                aggregate_key: row.aggregate_key,
                payload: row.payload,
                content_type: row.content_type,
                headers,
                // A head was charged by the claim; a run member is charged when published.
                attempt: u32::try_from(row.attempts).unwrap_or(0) + u32::from(!row.head),
                created_at,
            };
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
        let kinds: Vec<&str> = outcomes.iter().map(|o| o.kind).collect();
        let delays: Vec<i64> = outcomes.iter().map(|o| micros(o.delay)).collect();
        let errors: Vec<Option<&str>> = outcomes.iter().map(|o| o.error.as_deref()).collect();
        let attempts: Vec<i32> = outcomes
            .iter()
            .map(|o| i32::try_from(o.attempt).unwrap_or(i32::MAX))
            .collect();
        let rows = self
            .statements()
            .record_outcomes
            .query()
            .bind::<Array<BigInt>, _>(ids)
            .bind::<Array<BigInt>, _>(tokens)
            .bind::<Array<Text>, _>(kinds)
            .bind::<Array<BigInt>, _>(delays)
            .bind::<Array<Nullable<Text>>, _>(errors)
            .bind::<Array<Integer>, _>(attempts);
        let rows: Vec<OutcomeRow> = planned(conn, RECORD_PLAN, rows)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(outcomes.len().saturating_sub(rows.len()))
    }
}

impl Outbox {
    /// Upserts a relay's record: idle or not, and how long its broker has been unreachable.
    pub(crate) async fn set_relay_state(
        &self,
        conn: &mut AsyncPgConnection,
        relay_id: &str,
        idle: bool,
        ttl: Duration,
        blocked_for: Option<Duration>,
    ) -> Result<()> {
        self.statements()
            .relay_state
            .query()
            .bind::<Text, _>(relay_id)
            .bind::<Bool, _>(idle)
            .bind::<BigInt, _>(micros(ttl))
            .bind::<Nullable<BigInt>, _>(blocked_for.map(micros))
            .execute(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(())
    }

    /// Whether any pending row is due and unleased (it may still be blocked by its aggregate).
    pub(crate) async fn anything_due(&self, conn: &mut AsyncPgConnection) -> Result<bool> {
        #[derive(QueryableByName)]
        struct Due {
            #[diesel(sql_type = Bool)]
            due: bool,
        }
        let row: Due = self
            .statements()
            .due
            .query()
            .get_result(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(row.due)
    }

    /// Deletes a relay's idle record, and every expired one.
    pub(crate) async fn remove_relay(
        &self,
        conn: &mut AsyncPgConnection,
        relay_id: &str,
    ) -> Result<()> {
        self.statements()
            .relay_gone
            .query()
            .bind::<Text, _>(relay_id)
            .execute(conn)
            .await
            .map_err(|e| self.db_error(e))?;
        Ok(())
    }
}

/// Planner settings for the claim. It must walk the partial indexes in id order and stop at
/// the batch size; right after a bulk load, stale statistics can make a bitmap scan and sort
/// look cheaper, and that costs time in proportion to the whole backlog on every claim.
const CLAIM_PLAN: &str = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off";

/// Planner settings for recording outcomes: index scans as for the claim, and no nested
/// loop. When the statistics say few rows are pending (say, analysed before a burst), the
/// planner would otherwise rescan the outcome arrays once per row, or read every pending row
/// into a hash: both cost in proportion to more than the batch.
const RECORD_PLAN: &str = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; \
                           SET LOCAL enable_nestloop = off";

/// Runs one of the relay's statements in a transaction with the given planner settings.
async fn planned<R>(
    conn: &mut AsyncPgConnection,
    settings: &'static str,
    query: Prepared<'_>,
) -> QueryResult<Vec<R>>
where
    R: QueryableByName<Pg> + Send + 'static,
{
    conn.transaction(async move |c| {
        c.batch_execute(settings).await?;
        query.load::<R>(c).await
    })
    .await
}

/// The columns of a claimed row that rows written by other means can spoil.
fn decode(
    row: &ClaimRow,
) -> std::result::Result<(BTreeMap<String, String>, DateTime<Utc>), String> {
    let created_at = row.created_at.ok_or_else(|| {
        "undecodable row: created_at is not a time between the years 1 and 9999".to_owned()
    })?;
    Ok((decode_headers(&row.headers)?, created_at))
}

fn decode_headers(text: &str) -> std::result::Result<BTreeMap<String, String>, String> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| format!("undecodable row: headers are not a JSON object of strings ({e})"))?;
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            _ => Err(format!("undecodable row: header {k:?} is not a string")),
        })
        .collect()
}

/// A duration in whole microseconds, as bound into SQL.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// An error as stored in `last_error`: NUL bytes removed, cut at a char boundary to at most
/// [`MAX_ERROR_BYTES`].
pub(crate) fn error_text(err: &dyn std::fmt::Display) -> String {
    let mut text = err.to_string().replace('\0', "");
    if text.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_is_cut_at_a_char_boundary_without_nul() {
        let long = format!("a\0{}", "é".repeat(2_000));
        let text = error_text(&long);
        assert!(text.len() <= MAX_ERROR_BYTES);
        assert!(text.len() >= MAX_ERROR_BYTES - 1);
        assert!(!text.contains('\0'));
        assert!(text.starts_with("aé"));
    }

    #[test]
    fn headers_must_be_a_string_map_serde_can_hold() {
        assert_eq!(
            decode_headers(r#"{"a": "b"}"#).unwrap(),
            BTreeMap::from([("a".to_owned(), "b".to_owned())])
        );
        let not_string = decode_headers(r#"{"a": 1}"#).unwrap_err();
        assert!(
            not_string.contains(r#"header "a" is not a string"#),
            "{not_string}"
        );
        assert!(decode_headers(r#"["a"]"#).is_err());
        let huge = decode_headers(r#"{"n": 1e400}"#).unwrap_err();
        assert!(huge.contains("out of range"), "{huge}");
        let deep = format!(r#"{{"a": {}{}}}"#, "[".repeat(200), "]".repeat(200));
        assert!(decode_headers(&deep).unwrap_err().contains("recursion"));
    }
}
