//! (n) Steady streams: four writers at a fixed rate, open loop (each keeps its schedule,
//! however late a commit was), each message in a transaction of its own, the relay as its
//! own process, a consumer timing each delivery. The relay's CPU per message, its process
//! and its PostgreSQL sessions (found by their `application_name`), against a drain of a
//! committed backlog by the same relay measured the same way in this run. Where the writers
//! fell short of the offered rate, the same writers write once more with no relay running,
//! so the rate they keep alone tells whether the relay is what holds them back.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use diesel_outbox::{Message, Outbox};
use serde_json::json;

use crate::fixture::{Env, Keys, messages, stop_process};
use crate::measure::{percentile, process_seconds};
use crate::{BoxResult, Figure, KIB, round};

/// Writers of each stream.
const WRITERS: usize = 4;

pub(crate) async fn steady(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let secs = env.scale(60, 10) as f64;
    let (exchange, queue) = env.queue("steady").await?;
    let drain = drain(env, &exchange, env.scale(20_000, 5_000)).await?;
    env.purge(&queue).await?;
    let mut figures = Vec::new();
    for (rate, target) in [
        (200.0, "<= 5 x"),
        (1_000.0, "<= 2 x"),
        (5_000.0, "<= 1.3 x"),
    ] {
        let s = stream(env, &exchange, &queue, rate, secs).await?;
        env.purge(&queue).await?;
        let alone = if s.written_rate < 0.95 * rate {
            Some(writers_alone(env, rate, secs).await?)
        } else {
            None
        };
        let params = json!({
            "offered_msg_per_s": rate,
            "written_msg_per_s": round(s.written_rate),
            "written_alone_msg_per_s": alone.map(round),
            "seconds": secs,
            "writers": WRITERS,
            "messages": s.messages,
            "relay_process_us": round(s.cost.process_us),
            "relay_sessions_us": round(s.cost.sessions_us),
            "drain_process_us": round(drain.process_us),
            "drain_sessions_us": round(drain.sessions_us),
            "index_scans_per_msg": round(s.cost.index_scans),
            "drain_index_scans_per_msg": round(drain.index_scans),
            "p50_ms": round(s.p50),
            "p99_ms": round(s.p99),
        });
        let (cpu_name, p99_name, kept_name): (&'static str, &'static str, &'static str) =
            match rate as u32 {
                200 => (
                    "n. steady 200 msg/s, relay CPU per message",
                    "n. steady 200 msg/s, commit→consumer p99",
                    "n. steady 200 msg/s, rate the writers kept",
                ),
                1_000 => (
                    "n. steady 1,000 msg/s, relay CPU per message",
                    "n. steady 1,000 msg/s, commit→consumer p99",
                    "n. steady 1,000 msg/s, rate the writers kept",
                ),
                _ => (
                    "n. steady 5,000 msg/s, relay CPU per message",
                    "n. steady 5,000 msg/s, commit→consumer p99",
                    "n. steady 5,000 msg/s, rate the writers kept",
                ),
            };
        let mut measured = vec![
            Figure {
                name: cpu_name,
                value: s.cost.total(),
                unit: "µs/msg",
                baseline: Some(("the same relay draining a backlog", drain.total())),
                target,
                params: params.clone(),
            },
            Figure {
                name: p99_name,
                value: s.p99,
                unit: "ms",
                baseline: None,
                target: "<= 25 ms",
                params: params.clone(),
            },
        ];
        if let Some(alone) = alone {
            measured.push(Figure {
                name: kept_name,
                value: s.written_rate,
                unit: "msg/s",
                baseline: Some(("the same writers with no relay running", alone)),
                target: ">= 0.95 x",
                params,
            });
        }
        for f in measured {
            f.emit();
            figures.push(f);
        }
    }
    env.drop_queue(&queue).await?;
    Ok(figures)
}

/// What the relay cost per message: its process, its PostgreSQL sessions, and the index
/// scans of the outbox's tables (the writers' inserts check the key's index once each).
#[derive(Clone, Copy, Default)]
struct Cost {
    process_us: f64,
    sessions_us: f64,
    index_scans: f64,
}

impl Cost {
    fn total(&self) -> f64 {
        self.process_us + self.sessions_us
    }
}

/// One stream's outcome.
struct Stream {
    messages: usize,
    written_rate: f64,
    cost: Cost,
    p50: f64,
    p99: f64,
}

/// A relay process on a fresh table, its database sessions named `app`.
pub(crate) async fn start_relay(
    env: &mut Env,
    name: &str,
    exchange: &str,
) -> BoxResult<(Outbox, std::process::Child, String)> {
    let outbox = env.outbox(name).await?;
    let app = format!("bench_{name}");
    let url = crate::common::with_application_name(&env.database_url, &app);
    let amqp = env.amqp_url.clone();
    let child = env
        .relay_process(
            &outbox,
            &["--exchange", exchange],
            &[("AMQP_URL", amqp.as_str()), ("DATABASE_URL", url.as_str())],
        )
        .await?;
    Ok((outbox, child, app))
}

/// A window over the relay's process, its sessions and the table's index scans.
struct Window {
    process: u32,
    app: String,
    table: String,
    process_at: f64,
    sessions_at: HashMap<u32, f64>,
    scans_at: i64,
}

impl Window {
    async fn start(
        conn: &mut AsyncPgConnection,
        process: u32,
        app: &str,
        table: &str,
    ) -> BoxResult<Window> {
        let sessions_at = sessions(conn, app)
            .await?
            .into_iter()
            .map(|pid| (pid, process_seconds(&pid.to_string())))
            .collect();
        Ok(Window {
            process,
            app: app.to_owned(),
            table: table.to_owned(),
            process_at: process_seconds(&process.to_string()),
            sessions_at,
            scans_at: index_scans(conn, table).await?,
        })
    }

    /// Per message of `n`, from the start until now. A session opened in the window counts
    /// from zero; one closed in it is lost (the pool keeps its connections).
    async fn used(&self, conn: &mut AsyncPgConnection, n: usize) -> BoxResult<Cost> {
        let process = process_seconds(&self.process.to_string()) - self.process_at;
        let mut sessions_s = 0.0;
        for pid in sessions(conn, &self.app).await? {
            let before = self.sessions_at.get(&pid).copied().unwrap_or(0.0);
            sessions_s += process_seconds(&pid.to_string()) - before;
        }
        // The statistics reach the shared counters within a second of a transaction's end.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let scans = index_scans(conn, &self.table).await? - self.scans_at;
        let n = n.max(1) as f64;
        Ok(Cost {
            process_us: process * 1e6 / n,
            sessions_us: sessions_s * 1e6 / n,
            index_scans: scans as f64 / n,
        })
    }
}

/// The backends of the sessions named `app`.
async fn sessions(conn: &mut AsyncPgConnection, app: &str) -> BoxResult<Vec<u32>> {
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = Integer)]
        pid: i32,
    }
    let rows: Vec<Pid> =
        diesel::sql_query("SELECT pid FROM pg_stat_activity WHERE application_name = $1")
            .bind::<Text, _>(app)
            .load(conn)
            .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| u32::try_from(r.pid).ok())
        .collect())
}

/// Index scans so far of the outbox table and its cursor.
async fn index_scans(conn: &mut AsyncPgConnection, table: &str) -> BoxResult<i64> {
    #[derive(QueryableByName)]
    struct Scans {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let row: Scans = diesel::sql_query(
        "SELECT coalesce(sum(idx_scan), 0)::bigint AS n FROM pg_stat_user_tables \
         WHERE relid IN (to_regclass($1), to_regclass($1 || '_cursor'))",
    )
    .bind::<Text, _>(table)
    .get_result(conn)
    .await?;
    Ok(row.n)
}

/// The baseline: the relay draining `n` 1 KiB messages committed at once.
async fn drain(env: &mut Env, exchange: &str, n: usize) -> BoxResult<Cost> {
    let (outbox, child, app) = start_relay(env, "steady_drain", exchange).await?;
    let measured = async {
        diesel_async::AsyncConnection::transaction(&mut env.conn, async |c| {
            for msgs in messages(0..n, Keys::Unordered) {
                outbox.enqueue_many(c, msgs).await?;
            }
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        })
        .await?;
        let window = Window::start(&mut env.conn, child.id(), &app, outbox.table()).await?;
        env.wait_drained(&outbox, Duration::from_secs(600)).await?;
        window.used(&mut env.conn, n).await
    }
    .await;
    stop_process(child)?;
    measured
}

/// A stream of `rate` messages a second for `secs` seconds from [`WRITERS`] writers.
async fn stream(
    env: &mut Env,
    exchange: &str,
    queue: &str,
    rate: f64,
    secs: f64,
) -> BoxResult<Stream> {
    let name = format!("steady_{}", rate as u32);
    let (outbox, child, app) = start_relay(env, &name, exchange).await?;
    let measured = async {
        let arrivals = env.arrivals(queue, "steady", false).await?;
        let total = (rate * secs) as usize;
        let writers = connect_writers(env).await?;
        let window = Window::start(&mut env.conn, child.id(), &app, outbox.table()).await?;
        let (committed, written) = write(writers, &outbox, rate, total).await?;
        arrivals.wait(total, Duration::from_secs(60)).await;
        let cost = window.used(&mut env.conn, total).await?;
        let mut lat = arrivals.stop(&committed)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Stream {
            messages: total,
            written_rate: total as f64 / written.as_secs_f64(),
            cost,
            p50: percentile(&mut lat, 50.0),
            p99: percentile(&mut lat, 99.0),
        })
    }
    .await;
    stop_process(child)?;
    measured
}

/// The rate [`WRITERS`] writers keep at `rate` offered for `secs` seconds on a fresh table
/// with no relay running.
async fn writers_alone(env: &mut Env, rate: f64, secs: f64) -> BoxResult<f64> {
    let outbox = env.outbox(&format!("steady_alone_{}", rate as u32)).await?;
    let total = (rate * secs) as usize;
    let writers = connect_writers(env).await?;
    let (_, written) = write(writers, &outbox, rate, total).await?;
    Ok(total as f64 / written.as_secs_f64())
}

/// A connection for each of [`WRITERS`] writers.
pub(crate) async fn connect_writers(env: &Env) -> BoxResult<Vec<AsyncPgConnection>> {
    let mut writers = Vec::new();
    for _ in 0..WRITERS {
        writers.push(diesel_outbox::establish(&env.database_url).await?);
    }
    Ok(writers)
}

/// Writes `total` 1 KiB messages at `rate` a second, open loop: message `i` is due at
/// `i / rate`, and writer `w` writes every [`WRITERS`]-th, on time or as soon as it can,
/// each in a transaction of its own. Each message's key and commit time, and how long
/// the writing took.
pub(crate) async fn write(
    writers: Vec<AsyncPgConnection>,
    outbox: &Outbox,
    rate: f64,
    total: usize,
) -> BoxResult<(Vec<(String, Instant)>, Duration)> {
    let started = tokio::time::Instant::now();
    let payload = vec![b'x'; KIB];
    let mut tasks = Vec::new();
    for (w, mut conn) in writers.into_iter().enumerate() {
        let outbox = outbox.clone();
        let payload = payload.clone();
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            for i in (w..total).step_by(WRITERS) {
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(due).await;
                let key = format!("s{i}");
                let msg = Message::new("bench.event", payload.clone()).key(key.clone());
                conn.transaction(async |c| outbox.enqueue(c, msg).await)
                    .await?;
                committed.push((key, Instant::now()));
            }
            Ok::<_, diesel_outbox::Error>(committed)
        }));
    }
    let mut committed = Vec::with_capacity(total);
    for task in tasks {
        committed.extend(task.await??);
    }
    Ok((committed, started.elapsed()))
}
