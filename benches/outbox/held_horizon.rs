//! (m) A held xmin horizon: a steady stream of 800 msg/s from four writers (the writing of
//! figure n), a consumer timing each delivery, and a REPEATABLE READ transaction opened after
//! the first minute and held for three (`BENCH_HOLD_SECS` sets the hold, 1800 for the long
//! run), then a minute more; autovacuum on for the run (it is off on this machine's server,
//! and reset after). Per 15 s window of commit time: the rate delivered in it, end-to-end p50
//! and p99 of the messages committed in it, and the dead tuples of the outbox and of its
//! cursor table at its end. A
//! message still undelivered when the run ends counts as delivered then (so its window's
//! p99 is a floor), and the run ends at most a minute after the last write.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use serde_json::json;

use crate::fixture::{Env, stop_process};
use crate::measure::percentile;
use crate::steady::{connect_writers, start_relay, write};
use crate::{BoxResult, Figure, round};

/// Messages offered a second.
const RATE: f64 = 800.0;

/// The windows the run is cut into, by commit time.
const WINDOW: Duration = Duration::from_secs(15);

/// How the run is timed: a stream before the hold, the hold, and a stream after it.
struct Phases {
    before: Duration,
    hold: Duration,
    after: Duration,
}

pub(crate) async fn held_horizon(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let hold_secs: u64 = match std::env::var("BENCH_HOLD_SECS") {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("BENCH_HOLD_SECS must be a number of seconds, not {v:?}"))?,
        Err(_) => env.scale(180, 30) as u64,
    };
    let phases = Phases {
        before: Duration::from_secs(env.scale(60, 15) as u64),
        hold: Duration::from_secs(hold_secs),
        after: Duration::from_secs(env.scale(60, 15) as u64),
    };
    // ALTER SYSTEM runs on its own, not in a string of statements.
    env.conn
        .batch_execute("ALTER SYSTEM SET autovacuum = on")
        .await?;
    env.conn.batch_execute("SELECT pg_reload_conf()").await?;
    let measured = run(env, &phases).await;
    // Put back whatever the run's end was.
    env.conn
        .batch_execute("ALTER SYSTEM RESET autovacuum")
        .await?;
    env.conn.batch_execute("SELECT pg_reload_conf()").await?;
    measured
}

async fn run(env: &mut Env, phases: &Phases) -> BoxResult<Vec<Figure>> {
    let (exchange, queue) = env.queue("held").await?;
    let (outbox, child, _app) = start_relay(env, "held", &exchange).await?;
    let measured = async {
        let arrivals = env.arrivals(&queue, "held", false).await?;
        let total_time = phases.before + phases.hold + phases.after;
        let total = (RATE * total_time.as_secs_f64()) as usize;
        let writers = connect_writers(env).await?;
        let started = Instant::now();
        let holder = tokio::spawn(hold(
            env.database_url.clone(),
            started + phases.before,
            started + phases.before + phases.hold,
        ));
        let sampler = tokio::spawn(sample_dead_tuples(
            env.database_url.clone(),
            outbox.table().to_owned(),
            started,
            total_time,
        ));
        let (committed, _) = write(writers, &outbox, RATE, total).await?;
        holder.await??;
        arrivals.wait(total, Duration::from_secs(60)).await;
        let ended = Instant::now();
        let dead = sampler.await??;
        let at = arrivals.times();
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(windows(
            &committed, &at, started, ended, total_time, &dead,
        ))
    }
    .await;
    stop_process(child)?;
    env.drop_queue(&queue).await?;
    let windows = measured?;
    report(&windows, phases)
}

/// Opens a REPEATABLE READ transaction at `from` (its snapshot taken by a first read) and
/// ends it at `until`: the xmin horizon held that long.
async fn hold(database_url: String, from: Instant, until: Instant) -> BoxResult<()> {
    let mut conn = diesel_outbox::establish(&database_url).await?;
    tokio::time::sleep_until(from.into()).await;
    conn.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class")
        .await?;
    tokio::time::sleep_until(until.into()).await;
    conn.batch_execute("COMMIT").await?;
    Ok(())
}

/// The dead tuples of the outbox table and of its cursor table at the end of each window
/// of `total`.
async fn sample_dead_tuples(
    database_url: String,
    table: String,
    started: Instant,
    total: Duration,
) -> BoxResult<Vec<(i64, i64)>> {
    let mut conn = diesel_outbox::establish(&database_url).await?;
    let cursor = format!("{table}_cursor");
    let mut dead = Vec::new();
    let mut end = started + WINDOW;
    while end <= started + total {
        tokio::time::sleep_until(end.into()).await;
        dead.push((
            dead_tuples(&mut conn, &table).await?,
            dead_tuples(&mut conn, &cursor).await?,
        ));
        end += WINDOW;
    }
    Ok(dead)
}

async fn dead_tuples(conn: &mut AsyncPgConnection, table: &str) -> BoxResult<i64> {
    #[derive(QueryableByName)]
    struct Dead {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let row: Dead = diesel::sql_query(
        "SELECT coalesce((SELECT n_dead_tup FROM pg_stat_user_tables \
         WHERE relid = to_regclass($1)), 0)::bigint AS n",
    )
    .bind::<Text, _>(table)
    .get_result(conn)
    .await?;
    Ok(row.n)
}

/// One window of the run.
struct Window {
    /// Its start, from the run's.
    from: Duration,
    /// Messages delivered a second, by arrival time.
    delivered: f64,
    p50: f64,
    p99: f64,
    /// Messages committed in it and not delivered by the run's end.
    undelivered: usize,
    dead_tuples: i64,
    /// The cursor table's, which the per-row engine leaves alone.
    cursor_dead_tuples: i64,
}

/// The run cut into windows by commit time (deliveries by arrival time).
fn windows(
    committed: &[(String, Instant)],
    at: &HashMap<String, Instant>,
    started: Instant,
    ended: Instant,
    total: Duration,
    dead: &[(i64, i64)],
) -> Vec<Window> {
    let n = (total.as_secs_f64() / WINDOW.as_secs_f64()).ceil() as usize;
    let index = |t: Instant| {
        (t.saturating_duration_since(started).as_secs_f64() / WINDOW.as_secs_f64()) as usize
    };
    let mut latencies = vec![Vec::new(); n];
    let mut undelivered = vec![0; n];
    let mut arrived = vec![0usize; n];
    for (key, commit) in committed {
        let w = index(*commit).min(n - 1);
        let arrival = at.get(key).copied();
        if let Some(a) = arrival
            && let Some(slot) = arrived.get_mut(index(a))
        {
            *slot += 1;
        }
        if arrival.is_none() {
            undelivered[w] += 1;
        }
        let until = arrival.unwrap_or(ended);
        latencies[w].push(until.saturating_duration_since(*commit).as_secs_f64() * 1e3);
    }
    (0..n)
        .map(|w| Window {
            from: WINDOW * w as u32,
            delivered: arrived[w] as f64 / WINDOW.as_secs_f64(),
            p50: quantile(&mut latencies[w], 50.0),
            p99: quantile(&mut latencies[w], 99.0),
            undelivered: undelivered[w],
            dead_tuples: dead.get(w).map_or(-1, |d| d.0),
            cursor_dead_tuples: dead.get(w).map_or(-1, |d| d.1),
        })
        .collect()
}

/// The `p`th percentile of `values`, 0 for none.
fn quantile(values: &mut [f64], p: f64) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        percentile(values, p)
    }
}

/// The windows printed and as figures: the worst window's delivered rate, its p99, and
/// the most dead tuples.
fn report(windows: &[Window], phases: &Phases) -> BoxResult<Vec<Figure>> {
    let hold_from = phases.before;
    let hold_until = phases.before + phases.hold;
    let phase = |w: &Window| {
        if w.from < hold_from {
            "before"
        } else if w.from < hold_until {
            "held"
        } else {
            "after"
        }
    };
    eprintln!(
        "m. held xmin horizon, {} engine, by 15 s window:",
        crate::engine().name()
    );
    eprintln!(
        "  from s | phase  | delivered msg/s | p50 ms | p99 ms | undelivered | dead tuples | cursor's"
    );
    for w in windows {
        eprintln!(
            "  {:>6} | {:<6} | {:>15.1} | {:>6.1} | {:>6.1} | {:>11} | {:>11} | {:>8}",
            w.from.as_secs(),
            phase(w),
            w.delivered,
            w.p50,
            w.p99,
            w.undelivered,
            w.dead_tuples,
            w.cursor_dead_tuples
        );
    }
    if windows.is_empty() {
        return Err("the run had no window".into());
    }
    let rows: Vec<_> = windows
        .iter()
        .map(|w| {
            json!({
                "from_s": w.from.as_secs(),
                "phase": phase(w),
                "delivered_msg_per_s": round(w.delivered),
                "p50_ms": round(w.p50),
                "p99_ms": round(w.p99),
                "undelivered": w.undelivered,
                "dead_tuples": w.dead_tuples,
                "cursor_dead_tuples": w.cursor_dead_tuples,
            })
        })
        .collect();
    let params = json!({
        "offered_msg_per_s": RATE,
        "hold_from_s": hold_from.as_secs(),
        "hold_s": phases.hold.as_secs(),
        "window_s": WINDOW.as_secs(),
        "windows": rows,
    });
    let worst_rate = windows
        .iter()
        .map(|w| w.delivered)
        .fold(f64::INFINITY, f64::min);
    let worst_p99 = windows.iter().map(|w| w.p99).fold(0.0, f64::max);
    let most_dead = windows.iter().map(|w| w.dead_tuples).max().unwrap_or(0);
    let figures = vec![
        Figure {
            name: "m. held xmin horizon, worst window's delivered rate",
            value: if worst_rate.is_finite() {
                worst_rate
            } else {
                0.0
            },
            unit: "msg/s",
            baseline: Some(("offered", RATE)),
            target: ">= 0.95 x (log engine)",
            params: params.clone(),
        },
        Figure {
            name: "m. held xmin horizon, worst window's p99",
            value: worst_p99,
            unit: "ms",
            baseline: None,
            target: "<= 100 ms (log engine)",
            params: params.clone(),
        },
        Figure {
            name: "m. held xmin horizon, most dead tuples in the outbox",
            value: most_dead as f64,
            unit: "tuples",
            baseline: None,
            target: "0 (log engine)",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}
