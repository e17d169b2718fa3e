//! Planner settings the crate's statements run under, and running a statement under them
//! ([`planned`]).
//!
//! PostgreSQL plans from statistics, and a prepared statement settles on one generic plan
//! after five calls: statistics taken before a burst, or a plan cached while the table was
//! small, can then read a whole index or the whole table on every call. The statements
//! whose best plan is an ordered walk of an index that stops at a limit run with sequential
//! and bitmap scans off. JIT is off with them always: with sequential scans off, a scan no
//! index fits is costed in the billions, far past `jit_above_cost`, and PostgreSQL would
//! compile the statement on every call (`stats` took 1.6 s so, where it runs in under a
//! millisecond). `tests/plans.rs` plans every statement under the settings it runs with.

use diesel::QueryableByName;
use diesel::pg::Pg;
use diesel::sql_types::{Array, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};

use super::Bound;

/// The text of [`INDEX_SCANS`], for the settings built on it.
macro_rules! index_scans {
    () => {
        "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL jit = off"
    };
}

/// Index scans only, which stop at their limits (a bitmap scan reads every entry it matches
/// before a limit applies), and no JIT.
pub(crate) const INDEX_SCANS: &str = index_scans!();

macro_rules! no_nested_loop {
    () => {
        concat!(index_scans!(), "; SET LOCAL enable_nestloop = off")
    };
}

macro_rules! custom_plans {
    () => {
        concat!(
            index_scans!(),
            "; SET LOCAL plan_cache_mode = force_custom_plan"
        )
    };
}

/// [`INDEX_SCANS`] and no nested loop, for a join of the table with arrays of the batch.
pub(crate) const NO_NESTED_LOOP: &str = no_nested_loop!();

/// [`INDEX_SCANS`] and a plan made for the parameters of each call, for a statement whose
/// best plan depends on them.
pub(crate) const CUSTOM_PLANS: &str = custom_plans!();

/// Runs `query` after the planner settings `plan` (`SET LOCAL`s) in a transaction of its
/// own. Inside the caller's transaction that is a savepoint, and a `SET LOCAL` in a
/// savepoint that is released lasts until the caller's transaction ends: there the
/// caller's own values of those settings are put back after the query.
///
/// On a connection of its own (no transaction open) the transaction takes three round
/// trips ([`in_three_round_trips`]): its `BEGIN` and the settings go as one.
pub(crate) async fn planned<R>(
    conn: &mut AsyncPgConnection,
    plan: &'static str,
    query: Bound<'_>,
) -> diesel::QueryResult<Vec<R>>
where
    R: QueryableByName<Pg> + Send + 'static,
{
    use diesel_async::{AnsiTransactionManager, TransactionManager};
    #[derive(QueryableByName)]
    struct Saved {
        #[diesel(sql_type = Array<Text>)]
        values: Vec<String>,
    }
    let nested = AnsiTransactionManager::transaction_manager_status_mut(conn)
        .transaction_depth()?
        .is_some();
    if !nested {
        return in_three_round_trips(conn, plan, query).await;
    }
    let names = settings(plan);
    conn.transaction(async move |c| {
        let saved = diesel::sql_query(
            "SELECT array_agg(current_setting(n) ORDER BY i) AS values \
             FROM unnest($1::text[]) WITH ORDINALITY AS s (n, i)",
        )
        .bind::<Array<Text>, _>(&names)
        .get_result::<Saved>(c)
        .await?;
        c.batch_execute(plan).await?;
        let rows = query.load::<R>(c).await?;
        diesel::sql_query(
            "SELECT set_config(n, v, true) FROM unnest($1::text[], $2::text[]) AS s (n, v)",
        )
        .bind::<Array<Text>, _>(&names)
        .bind::<Array<Text>, _>(saved.values)
        .execute(c)
        .await?;
        Ok(rows)
    })
    .await
}

/// The transaction of [`planned`] on a connection of its own, in three round trips:
/// `BEGIN` with the settings as one simple query, the query, and the `COMMIT` (or the
/// `ROLLBACK` after a failed query).
async fn in_three_round_trips<R>(
    conn: &mut AsyncPgConnection,
    plan: &'static str,
    query: Bound<'_>,
) -> diesel::QueryResult<Vec<R>>
where
    R: QueryableByName<Pg> + Send + 'static,
{
    use diesel_async::{AnsiTransactionManager, TransactionManager};
    AnsiTransactionManager::begin_transaction_sql(conn, begin(plan)).await?;
    match query.load::<R>(conn).await {
        Ok(rows) => {
            AnsiTransactionManager::commit_transaction(conn).await?;
            Ok(rows)
        }
        Err(e) => {
            AnsiTransactionManager::rollback_transaction(conn).await?;
            Err(e)
        }
    }
}

/// `BEGIN` and a plan's `SET LOCAL`s as one simple query.
fn begin(plan: &'static str) -> &'static str {
    match plan {
        INDEX_SCANS => concat!("BEGIN; ", index_scans!()),
        NO_NESTED_LOOP => concat!("BEGIN; ", no_nested_loop!()),
        CUSTOM_PLANS => concat!("BEGIN; ", custom_plans!()),
        _ => unreachable!("a plan of this module"),
    }
}

/// The names of the settings a plan's `SET LOCAL`s set.
fn settings(plan: &str) -> Vec<String> {
    plan.split(';')
        .filter_map(|s| s.trim().strip_prefix("SET LOCAL ")?.split_once(" = "))
        .map(|(name, _)| name.to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_plans_settings_are_named() {
        assert_eq!(
            settings(INDEX_SCANS),
            ["enable_seqscan", "enable_bitmapscan", "jit"]
        );
        assert_eq!(
            settings(CUSTOM_PLANS),
            [
                "enable_seqscan",
                "enable_bitmapscan",
                "jit",
                "plan_cache_mode"
            ]
        );
        assert_eq!(settings(NO_NESTED_LOOP).len(), 4);
    }

    #[test]
    fn each_plan_has_its_begin() {
        for plan in [INDEX_SCANS, NO_NESTED_LOOP, CUSTOM_PLANS] {
            assert_eq!(begin(plan), format!("BEGIN; {plan}"));
        }
    }
}
