//! Every statement the crate runs keeps a plan fit for its work whatever the planner's
//! statistics say: each statement of `tests/snapshots/statements.sql` (the pinned list of
//! them all, with the planner settings each runs under) is planned as a generic plan (what
//! a prepared statement settles on after five calls) and run under `EXPLAIN ANALYZE` in a
//! transaction that is rolled back, on an empty table whose statistics say so and again
//! once the table holds 100,000 rows the statistics know nothing of (a plan cached while
//! the table was small). It fails on a plan the JIT would compile, a sequential scan of
//! the outbox or the inbox, more rows read than the statement returns can explain, or a
//! filter that casts a parameter to a snapshot on every row; the statements still known
//! to scan with a plan cached while the table was empty are listed in `CACHED_SCANS`.

mod common;

use std::fmt::Write as _;

use common::TestSchema;
use diesel::QueryableByName;
use diesel::sql_types::Text;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::{Engine, Outbox};
use serde_json::Value;

/// The table the snapshot is rendered for.
const SNAPSHOT_TABLE: &str = "sales.orders_outbox";

/// Rows a statement may read beyond ten per row it returns and the backlog: an index
/// descent, the cursor and relay rows.
const SLACK: f64 = 1_000.0;

/// Rows of the grown outbox that are not sent (pending, dead, in the log): what a claim, a
/// page read or a count of the backlog may have to look through.
const BACKLOG: f64 = 6_000.0;

/// What `stats` may read whatever it returns: it counts sent rows, and rows the log's
/// cursor has passed, up to 100,000 each before it estimates instead.
const STATS_COUNTS: f64 = 200_000.0;

/// Statements whose plan, cached by a connection while the table was empty, still scans
/// the whole outbox once it has grown: each runs on its own, outside a transaction the
/// crate could give planner settings to (the enqueue runs in the caller's). A relay's
/// connection that cached them on a new table keeps those plans until the table is
/// analysed (autovacuum does so once 50 rows and a tenth of the table have changed). The
/// test fails when one of them no longer scans, so that it leaves this list.
const CACHED_SCANS: [&str; 4] = ["enqueue", "enqueue_notify", "due", "log committed"];

/// One statement of the snapshot.
struct Statement {
    name: String,
    /// The planner settings it runs under in its transaction, if any.
    under: Option<String>,
    /// The PostgreSQL types its parameters are bound as.
    params: Vec<String>,
    text: String,
}

#[tokio::test]
async fn every_statement_keeps_its_plan_on_an_empty_table_and_a_grown_one() {
    let schema = TestSchema::new().await;
    let mut conn = schema.connect().await;
    let table = format!("{}.orders_outbox", schema.name);
    let outbox = Outbox::builder()
        .table(&table)
        .engine(Engine::Log)
        .build()
        .unwrap();
    outbox.migrate(&mut conn).await.unwrap();
    let statements = snapshot(&schema.name);
    assert!(
        statements.len() > 25,
        "the snapshot lists every statement: {}",
        statements.len()
    );
    // Statistics of the empty tables, which no autovacuum refreshes while the test runs.
    for t in ["", "_inbox", "_relays", "_cursor"] {
        conn.batch_execute(&format!(
            "ALTER TABLE {table}{t} SET (autovacuum_enabled = false); ANALYZE {table}{t}"
        ))
        .await
        .unwrap();
    }
    // Each statement prepared and planned on the empty tables: the generic plan it keeps
    // is the one a relay's connection caches in its first minute.
    let mut failures = Vec::new();
    for (i, s) in statements.iter().enumerate() {
        conn.batch_execute(&format!("PREPARE cached_{i}{} AS {}", s.types(), s.text))
            .await
            .unwrap_or_else(|e| panic!("{}: cannot prepare: {e}", s.name));
        check(
            &mut conn,
            s,
            &format!("cached_{i}"),
            "on the empty table",
            &table,
            &mut failures,
        )
        .await;
    }
    // 100,000 rows in the outbox (most sent, some pending, dead and in the log) and in the
    // inbox, which the statistics (taken on the empty tables) know nothing of.
    conn.batch_execute(&format!(
        "INSERT INTO {table} (idempotency_key, topic, aggregate_key, payload, status, sent_at, dead_at, attempts) \
         SELECT 'k' || g, 'order.created', 'a' || (g % 100), '\\x00', \
         CASE WHEN g % 50 = 0 THEN 'pending' WHEN g % 50 = 1 THEN 'dead' WHEN g % 50 = 2 THEN 'logged' ELSE 'sent' END, \
         CASE WHEN g % 50 > 2 THEN now() - interval '1 day' END, CASE WHEN g % 50 = 1 THEN now() END, \
         CASE WHEN g % 50 = 1 THEN 10 ELSE 0 END \
         FROM generate_series(1, 100000) AS g; \
         INSERT INTO {table}_inbox (consumer, idempotency_key, processed_at) \
         SELECT 'invoicing', 'k' || g, now() - interval '1 day' FROM generate_series(1, 100000) AS g"
    ))
    .await
    .unwrap();
    // The plans cached on the empty tables, then plans made now (from statistics that
    // still say the tables are empty). The statements kept as text (the moves') run
    // unprepared, planned afresh on each call: only their fresh plan counts.
    let mut ran = 0;
    let mut cached_scans = Vec::new();
    for (i, s) in statements.iter().enumerate() {
        let cached = format!("cached_{i}");
        let mut found = Vec::new();
        let on_grown = "cached while empty, on 100,000 rows";
        ran += usize::from(check(&mut conn, s, &cached, on_grown, &table, &mut found).await);
        if !found.is_empty() && CACHED_SCANS.contains(&s.name.as_str()) {
            cached_scans.push(s.name.clone());
        } else if !s.name.starts_with("engine ") {
            failures.extend(found);
        }
        conn.batch_execute(&format!(
            "DEALLOCATE {cached}; PREPARE fresh{} AS {}",
            s.types(),
            s.text
        ))
        .await
        .unwrap();
        check(
            &mut conn,
            s,
            "fresh",
            "planned on 100,000 rows",
            &table,
            &mut failures,
        )
        .await;
        conn.batch_execute("DEALLOCATE fresh").await.unwrap();
    }
    assert_eq!(
        cached_scans, CACHED_SCANS,
        "the statements whose cached plan scans the outbox (a mended one leaves CACHED_SCANS)"
    );
    // Most run with the arguments `argument` makes up (the rest are planned only).
    assert!(ran * 4 > statements.len() * 3, "only {ran} ran");
    assert!(
        failures.is_empty(),
        "{} plans unfit:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The snapshot's statements that read or write rows, for the tables of `schema` (the DDL
/// of the migrations and the session commands are left out).
fn snapshot(schema: &str) -> Vec<Statement> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/snapshots/statements.sql"
    );
    let (snapshot_schema, name) = SNAPSHOT_TABLE.split_once('.').unwrap();
    let text = std::fs::read_to_string(path)
        .expect("the snapshot")
        .replace(
            &format!("\"{snapshot_schema}\".\"{name}"),
            &format!("\"{schema}\".\"{name}"),
        )
        .replace(&format!("'{SNAPSHOT_TABLE}"), &format!("'{schema}.{name}"));
    text.split("\n\n")
        .filter_map(|entry| {
            let mut lines = entry.trim().lines();
            let name = lines.next()?.strip_prefix("-- ")?.to_owned();
            let (mut params, mut under) = (Vec::new(), None);
            let mut text = String::new();
            for line in lines {
                if let Some(types) = line.strip_prefix("-- params: ") {
                    params = types.split(", ").map(str::to_owned).collect();
                } else if let Some(plan) = line.strip_prefix("-- under: ") {
                    under = Some(plan.to_owned());
                } else {
                    text.push_str(line);
                    text.push('\n');
                }
            }
            let text = text.trim().trim_end_matches(';').to_owned();
            let verb = text.split_whitespace().next()?.to_ascii_uppercase();
            let rows = ["SELECT", "WITH", "INSERT", "UPDATE", "DELETE"].contains(&verb.as_str());
            (rows && !name.starts_with("migration")).then_some(Statement {
                name,
                under,
                params,
                text,
            })
        })
        .collect()
}

impl Statement {
    /// Its parameters' types as `PREPARE` takes them: `(bigint, text)`, or nothing.
    fn types(&self) -> String {
        if self.params.is_empty() {
            String::new()
        } else {
            format!("({})", self.params.join(", "))
        }
    }
}

#[derive(QueryableByName)]
struct Line {
    #[diesel(sql_type = Text)]
    #[diesel(column_name = "QUERY PLAN")]
    line: String,
}

/// Runs the prepared statement `prepared` (rolled back) with its generic plan under the
/// planner settings the crate runs it with, adding what is wrong with the plan to
/// `failures`: JIT anywhere; on the grown tables, a sequential scan of the outbox or the
/// inbox, or more rows read than its result and the backlog explain. Whether it ran (else
/// only its plan was looked at, the made-up arguments being refused).
async fn check(
    conn: &mut AsyncPgConnection,
    s: &Statement,
    prepared: &str,
    tables: &str,
    table: &str,
    failures: &mut Vec<String>,
) -> bool {
    let settings = s.under.as_deref().unwrap_or("");
    let args: Vec<String> = s.params.iter().map(|t| argument(t)).collect();
    let execute = if args.is_empty() {
        format!("EXECUTE {prepared}")
    } else {
        format!("EXECUTE {prepared}({})", args.join(", "))
    };
    conn.batch_execute(&format!(
        "BEGIN; {settings}; SET LOCAL plan_cache_mode = force_generic_plan"
    ))
    .await
    .unwrap();
    // Run it when the arguments make sense to it; plan it only when they do not (a key
    // that is taken, a snapshot it refuses).
    conn.batch_execute("SAVEPOINT run").await.unwrap();
    let analyzed = diesel::sql_query(format!("EXPLAIN (ANALYZE, FORMAT JSON) {execute}"))
        .load::<Line>(conn)
        .await;
    let (plan, ran) = match analyzed {
        Ok(lines) => (lines, true),
        Err(_) => {
            conn.batch_execute("ROLLBACK TO SAVEPOINT run")
                .await
                .unwrap();
            let lines = diesel::sql_query(format!("EXPLAIN (FORMAT JSON) {execute}"))
                .load::<Line>(conn)
                .await
                .unwrap_or_else(|e| panic!("{} ({tables}): cannot explain: {e}", s.name));
            (lines, false)
        }
    };
    conn.batch_execute("ROLLBACK").await.unwrap();
    let text: String = plan.into_iter().map(|l| l.line).collect();
    let json: Value = serde_json::from_str(&text).unwrap();
    let top = &json[0];
    let mut wrong = String::new();
    if top.get("JIT").is_some() {
        let _ = write!(wrong, " compiled by the JIT;");
    }
    let grown = !tables.contains("empty table");
    let (_, name) = table.split_once('.').unwrap();
    let mut read = 0.0;
    walk(&top["Plan"], &mut |node| {
        let relation = node["Relation Name"].as_str().unwrap_or("");
        let kind = node["Node Type"].as_str().unwrap_or("");
        if grown && kind == "Seq Scan" && (relation == name || relation == format!("{name}_inbox"))
        {
            let _ = write!(wrong, " a sequential scan of {relation};");
        }
        for key in ["Filter", "Join Filter"] {
            if let Some(cast) = node[key].as_str().and_then(parameter_cast) {
                let _ = write!(
                    wrong,
                    " casts the parameter {cast} again for every row its filter tests;"
                );
            }
        }
        if kind.ends_with("Scan") && !relation.is_empty() || kind == "Bitmap Index Scan" {
            let n = |k: &str| node[k].as_f64().unwrap_or(0.0);
            read += (n("Actual Rows")
                + n("Rows Removed by Filter")
                + n("Rows Removed by Index Recheck"))
                * n("Actual Loops").max(1.0);
        }
    });
    let returned = top["Plan"]["Actual Rows"].as_f64().unwrap_or(0.0);
    let allowed = if s.name == "stats" {
        STATS_COUNTS + BACKLOG + SLACK
    } else {
        BACKLOG + SLACK + 10.0 * returned
    };
    if ran && read > allowed {
        let _ = write!(
            wrong,
            " read {read} rows to return {returned} (at most {allowed});"
        );
    }
    if !wrong.is_empty() {
        failures.push(format!("{} ({tables}):{wrong}\n{text}", s.name));
    }
    ran
}

/// The first parameter a filter casts to a snapshot (`($3)::pg_snapshot`), if any: a
/// generic plan casts it on every row it filters, which costs in proportion to every
/// transaction the snapshot lists. Cast once in a scalar subquery, it is an init plan's
/// value (`$2`), which no cast follows.
fn parameter_cast(filter: &str) -> Option<&str> {
    filter.match_indices(")::pg_snapshot").find_map(|(end, _)| {
        let start = filter[..end].rfind("($")?;
        let number = &filter[start + 2..end];
        (!number.is_empty() && number.bytes().all(|b| b.is_ascii_digit()))
            .then(|| &filter[start + 1..end])
    })
}

/// An argument of the given type that the statements take as a plausible value: a batch
/// of 100, ids and limits of 100, now, the current snapshot.
fn argument(pg_type: &str) -> String {
    match pg_type {
        "bigint" | "integer" => format!("100::{pg_type}"),
        "text" => "'k1'::text".to_owned(),
        "boolean" => "false".to_owned(),
        "bytea" => "'\\x00'::bytea".to_owned(),
        "jsonb" => "'{}'::jsonb".to_owned(),
        array if array.ends_with("[]") => format!("'{{}}'::{array}"),
        other => format!("NULL::{other}"),
    }
}

/// Calls `visit` on `node` and every node under it.
fn walk(node: &Value, visit: &mut impl FnMut(&Value)) {
    visit(node);
    if let Some(children) = node["Plans"].as_array() {
        for child in children {
            walk(child, visit);
        }
    }
}
