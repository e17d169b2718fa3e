//! The performance figures of BENCHMARKS.md, each beside a baseline measured in the same run.
//!
//! ```sh
//! cargo bench --bench outbox --features cli              # everything
//! cargo bench --bench outbox --features cli -- --quick   # smaller, under 2 minutes
//! cargo bench --bench outbox --features cli -- --only a,c
//! ```
//!
//! Uses `DATABASE_URL` and `AMQP_URL` (local defaults). Prints one JSON line per figure as it
//! is measured, then a table.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use diesel::sql_types::{BigInt, Bytea, Text};
use diesel::{IntoSql, QueryableByName};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::ATTEMPT_HEADER;
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Message, Outbox, PgPool, PublishError, Publisher, Record};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;

type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser)]
struct Args {
    /// Smaller counts and shorter runs (under 2 minutes in all).
    #[arg(long)]
    quick: bool,
    /// Scenarios to run, by letter: a (throughput, RSS), b (enqueue cost), c (writers),
    /// d (end-to-end latency), e (one aggregate), f (history).
    #[arg(long, value_delimiter = ',')]
    only: Vec<char>,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

/// One measured figure beside its same-run baseline.
struct Figure {
    name: &'static str,
    value: f64,
    unit: &'static str,
    baseline: Option<(&'static str, f64)>,
    target: &'static str,
    params: serde_json::Value,
}

impl Figure {
    fn ratio(&self) -> Option<f64> {
        self.baseline.map(|(_, b)| self.value / b)
    }

    fn emit(&self) {
        let line = json!({
            "name": self.name,
            "value": round(self.value),
            "unit": self.unit,
            "baseline_name": self.baseline.map(|b| b.0),
            "baseline_value": self.baseline.map(|b| round(b.1)),
            "ratio": self.ratio().map(|r| (r * 1000.0).round() / 1000.0),
            "target": self.target,
            "params": self.params,
        });
        println!("{line}");
    }
}

fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

struct Env {
    database_url: String,
    amqp_url: String,
    schema: String,
    conn: AsyncPgConnection,
    pool: PgPool,
    amqp: Connection,
    channel: Channel,
    quick: bool,
}

const KIB: usize = 1024;

#[tokio::main]
async fn main() -> BoxResult<()> {
    let args = Args::parse();
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let schema = format!("bench_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let mut conn = AsyncPgConnection::establish(&database_url).await?;
    conn.batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await?;
    let pool = PgPool::builder()
        .max_size(8)
        .test_on_check_out(false)
        .build(AsyncDieselConnectionManager::new(&database_url))
        .await?;
    let amqp = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    let mut env = Env {
        database_url,
        amqp_url,
        schema,
        conn,
        pool,
        amqp,
        channel,
        quick: args.quick,
    };
    let run = |c: char| args.only.is_empty() || args.only.contains(&c);
    let started = Instant::now();
    let mut figures = Vec::new();
    let result = async {
        if run('a') {
            figures.extend(throughput(&mut env).await?);
        }
        if run('b') {
            figures.extend(enqueue_cost(&mut env).await?);
        }
        if run('c') {
            figures.push(writers(&mut env).await?);
        }
        if run('d') {
            figures.extend(latency(&mut env).await?);
        }
        if run('e') {
            figures.extend(one_aggregate(&mut env).await?);
        }
        if run('f') {
            figures.push(history(&mut env).await?);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    env.conn
        .batch_execute(&format!("DROP SCHEMA {} CASCADE", env.schema))
        .await?;
    result?;

    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(["figure", "value", "baseline", "ratio", "target"]);
    for f in &figures {
        table.add_row([
            f.name.to_owned(),
            format!("{:.2} {}", f.value, f.unit),
            f.baseline
                .map_or("-".into(), |(n, v)| format!("{v:.2} {} ({n})", f.unit)),
            f.ratio().map_or("-".into(), |r| format!("{r:.2} ×")),
            f.target.to_owned(),
        ]);
    }
    println!("{table}");
    println!(
        "total {:.0} s{}",
        started.elapsed().as_secs_f64(),
        if env.quick { " (quick)" } else { "" }
    );
    Ok(())
}

impl Env {
    fn scale(&self, full: usize, quick: usize) -> usize {
        if self.quick { quick } else { full }
    }

    async fn outbox(&mut self, name: &str) -> BoxResult<Outbox> {
        let outbox = Outbox::builder()
            .table(format!("{}.{name}", self.schema))
            .build()?;
        outbox.migrate(&mut self.conn).await?;
        Ok(outbox)
    }

    /// A durable exchange and queue of this run; the queue is deleted by `drop_queue`.
    async fn queue(&self, name: &str) -> BoxResult<(String, String)> {
        let exchange = format!("{}.{name}", self.schema);
        let queue = exchange.clone();
        self.channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    auto_delete: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        self.channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        self.channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((exchange, queue))
    }

    async fn purge(&self, queue: &str) -> BoxResult<()> {
        self.channel
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await?;
        Ok(())
    }

    async fn drop_queue(&self, queue: &str) -> BoxResult<()> {
        self.channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await?;
        Ok(())
    }

    async fn publisher(&self, exchange: &str) -> BoxResult<RabbitMqPublisher> {
        Ok(RabbitMqPublisher::builder(&self.amqp_url, exchange)
            .connect()
            .await?)
    }

    /// Waits until the relay on `outbox` has finished lingering after start-up and recorded
    /// itself idle.
    async fn wait_idle(&mut self, outbox: &Outbox) -> BoxResult<()> {
        #[derive(QueryableByName)]
        struct Idle {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            idle: bool,
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}_relays WHERE idle) AS idle",
            outbox.table()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while !diesel::sql_query(&sql)
            .get_result::<Idle>(&mut self.conn)
            .await?
            .idle
        {
            if Instant::now() > deadline {
                return Err("the relay never went idle".into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// A fresh outbox table and a relay to `exchange` running on it, both with wake-on-commit
    /// or both without.
    async fn with_relay(
        &mut self,
        name: &str,
        exchange: &str,
        notify: bool,
    ) -> BoxResult<(Outbox, RunningRelay)> {
        let base = self.outbox(name).await?;
        let mut outbox = Outbox::builder().table(base.table());
        if !notify {
            outbox = outbox.without_notify();
        }
        let outbox = outbox.build()?;
        let mut relay = outbox.relay(self.pool.clone(), self.publisher(exchange).await?);
        if !notify {
            relay = relay.without_listen();
        }
        Ok((outbox, RunningRelay::start(relay.build()?)))
    }

    /// Enqueues `n` 1 KiB messages (without waking anyone), `aggregate` on each if given.
    async fn fill(&mut self, outbox: &Outbox, n: usize, aggregate: Option<&str>) -> BoxResult<()> {
        let quiet = Outbox::builder()
            .table(outbox.table())
            .without_notify()
            .build()?;
        self.enqueue_backlog(&quiet, n, aggregate).await
    }

    /// Enqueues `n` 1 KiB messages through `outbox` in chunks of 1,000.
    async fn enqueue_backlog(
        &mut self,
        outbox: &Outbox,
        n: usize,
        aggregate: Option<&str>,
    ) -> BoxResult<()> {
        let payload = vec![b'x'; KIB];
        for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
            let msgs = chunk
                .iter()
                .map(|i| {
                    let m = Message::new("bench.event", payload.clone()).key(format!("m{i}"));
                    match aggregate {
                        Some(a) => m.aggregate_key(a),
                        None => m,
                    }
                })
                .collect();
            outbox.enqueue_many(&mut self.conn, msgs).await?;
        }
        Ok(())
    }

    /// Polls (cheaply, so the poll does not load the database) until no row is pending,
    /// then checks that `n` were sent; returns when the last one was.
    async fn wait_sent(&mut self, outbox: &Outbox, n: u64, limit: Duration) -> BoxResult<Instant> {
        #[derive(QueryableByName)]
        struct Pending {
            #[diesel(sql_type = diesel::sql_types::Bool)]
            pending: bool,
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE status = 'pending') AS pending",
            outbox.table()
        );
        let deadline = Instant::now() + limit;
        loop {
            let row: Pending = diesel::sql_query(&sql).get_result(&mut self.conn).await?;
            if !row.pending {
                let done = Instant::now();
                let stats = outbox.stats(&mut self.conn).await?;
                if (stats.sent < n && !stats.sent_is_estimate) || stats.dead > 0 {
                    return Err(format!("expected {n} sent, found {stats:?}").into());
                }
                return Ok(done);
            }
            if Instant::now() > deadline {
                return Err(format!("{n} messages not sent within {limit:?}").into());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Runs an in-process relay until dropped.
struct RunningRelay {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<diesel_outbox::Result<()>>,
}

impl RunningRelay {
    fn start<P: Publisher>(relay: diesel_outbox::Relay<P>) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            relay
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
        });
        RunningRelay {
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) -> BoxResult<()> {
        let _ = self.stop.take().map(|s| s.send(()));
        (&mut self.task).await??;
        Ok(())
    }
}

// ---------------------------------------------------------------------------- (a) and (g)

async fn throughput(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(50_000, 10_000);
    let naive_n = env.scale(3_000, 1_000);
    let batch: usize = std::env::var("BENCH_BATCH")
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(512);
    let (exchange, queue) = env.queue("throughput").await?;
    let payload = vec![b'x'; KIB];

    // Each arm starts right after a checkpoint, so none pays for earlier writes.
    env.conn.batch_execute("CHECKPOINT").await?;
    // Baseline: raw lapin, confirms, up to `window` in flight.
    let window = 512;
    let raw_channel = env.amqp.create_channel().await?;
    raw_channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let started = Instant::now();
    let cpu_before = cpu_seconds(None);
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        if in_flight.len() >= window {
            in_flight.next().await.expect("a confirm")?;
        }
        in_flight.push(raw_publish(&raw_channel, &exchange, &payload, format!("raw{i}")).await?);
    }
    while let Some(confirm) = in_flight.next().await {
        confirm?;
    }
    let raw_rate = n as f64 / started.elapsed().as_secs_f64();
    let raw_cpu = cpu_share(
        cpu_before,
        cpu_seconds(None),
        started.elapsed().as_secs_f64(),
    );
    env.purge(&queue).await?;

    // The relay, as its own process (the operator binary), so its memory can be read. It
    // starts on an empty table and goes idle; the backlog then arrives in one transaction,
    // whose commit wakes it, so the figure leaves out the process's start-up.
    let outbox = env.outbox("throughput").await?;
    let mut child = Command::new(env!("CARGO_BIN_EXE_diesel-outbox"))
        .args(["--table", outbox.table(), "relay", "--exchange", &exchange])
        .args(["--batch-size", &batch.to_string()])
        .env("DATABASE_URL", &env.database_url)
        .env("AMQP_URL", &env.amqp_url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    let pid = child.id();
    env.wait_idle(&outbox).await?;
    env.conn.batch_execute("BEGIN").await?;
    env.enqueue_backlog(&outbox, n, None).await?;
    // The checkpoint (from another connection, while the backlog is uncommitted) flushes
    // the backlog's pages too.
    env.pool.get().await?.batch_execute("CHECKPOINT").await?;
    env.conn.batch_execute("COMMIT").await?;
    let started = Instant::now();
    let cpu_before = cpu_seconds(Some(pid));
    let rss_peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let peak = rss_peak.clone();
        tokio::spawn(async move {
            loop {
                if let Some(kib) = status_kib(pid, "VmHWM:") {
                    peak.store(kib, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let done = env
        .wait_sent(&outbox, n as u64, Duration::from_secs(600))
        .await?;
    let relay_rate = n as f64 / (done - started).as_secs_f64();
    let relay_cpu = cpu_share(
        cpu_before,
        cpu_seconds(Some(pid)),
        (done - started).as_secs_f64(),
    );
    if let Some(kib) = status_kib(pid, "VmHWM:") {
        rss_peak.store(kib, Ordering::SeqCst);
    }
    sampler.abort();
    Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    child.wait()?;
    env.purge(&queue).await?;

    // The naive relay: claim one row, publish, await the confirm, mark it sent.
    let naive = env.outbox("naive").await?;
    env.fill(&naive, naive_n, None).await?;
    let naive_channel = env.amqp.create_channel().await?;
    naive_channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let mut conn = AsyncPgConnection::establish(&env.database_url).await?;
    let claim = format!(
        "UPDATE {t} SET lease_until = now() + interval '30 seconds', attempts = attempts + 1 \
         WHERE id = (SELECT id FROM {t} WHERE status = 'pending' \
         AND (lease_until IS NULL OR lease_until < now()) ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) \
         RETURNING id, idempotency_key AS key, payload",
        t = naive.table()
    );
    let mark = format!(
        "UPDATE {} SET status = 'sent', sent_at = now() WHERE id = $1",
        naive.table()
    );
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Bytea)]
        payload: Vec<u8>,
    }
    let started = Instant::now();
    let mut sent = 0;
    while let Some(row) = diesel::sql_query(&claim)
        .get_result::<Row>(&mut conn)
        .await
        .map(Some)
        .or_else(|e| match e {
            diesel::result::Error::NotFound => Ok(None),
            e => Err(e),
        })?
    {
        raw_publish(&naive_channel, &exchange, &row.payload, row.key)
            .await?
            .await?;
        diesel::sql_query(&mark)
            .bind::<BigInt, _>(row.id)
            .execute(&mut conn)
            .await?;
        sent += 1;
    }
    assert_eq!(sent, naive_n);
    let naive_rate = naive_n as f64 / started.elapsed().as_secs_f64();
    env.drop_queue(&queue).await?;

    let params = json!({ "messages": n, "payload_bytes": KIB, "batch_size": batch, "raw_window": window, "naive_messages": naive_n, "relay": "diesel-outbox relay process", "cpu_raw": raw_cpu, "cpu_relay": relay_cpu });
    let figures = vec![
        Figure {
            name: "a. relay vs raw lapin",
            value: relay_rate,
            unit: "msg/s",
            baseline: Some(("raw lapin, pipelined confirms", raw_rate)),
            target: ">= 0.90 x",
            params: params.clone(),
        },
        Figure {
            name: "a. relay vs naive relay",
            value: relay_rate,
            unit: "msg/s",
            baseline: Some(("naive relay", naive_rate)),
            target: ">= 10 x",
            params: params.clone(),
        },
        Figure {
            name: "g. relay peak RSS",
            value: AtomicU64::load(&rss_peak, Ordering::SeqCst) as f64 / 1024.0,
            unit: "MiB",
            baseline: None,
            target: "<= 64 MiB",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}

/// CPU seconds used so far by the broker, the database server and this process (and one
/// more process, if given), to show what limits a figure.
fn cpu_seconds(extra: Option<u32>) -> [f64; 4] {
    let ticks = |pid: &str| -> f64 {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let after = s.rsplit_once(')')?.1;
                let f: Vec<&str> = after.split_whitespace().collect();
                Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
            })
            .unwrap_or(0.0)
            / 100.0
    };
    let mut by_name = [0.0; 2];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let pid = entry.file_name().to_string_lossy().into_owned();
            if !pid.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            match comm.trim() {
                "beam.smp" => by_name[0] += ticks(&pid),
                "postgres" => by_name[1] += ticks(&pid),
                _ => {}
            }
        }
    }
    [
        by_name[0],
        by_name[1],
        ticks("self"),
        extra.map_or(0.0, |p| ticks(&p.to_string())),
    ]
}

fn cpu_share(before: [f64; 4], after: [f64; 4], wall: f64) -> serde_json::Value {
    let share = |i: usize| round((after[i] - before[i]) / wall);
    json!({ "broker_cores": share(0), "postgres_cores": share(1), "bench_cores": share(2), "relay_cores": share(3) })
}

/// What the baselines publish: the relay's messages, persistent and mandatory, with a message
/// id, a timestamp and the attempt header.
async fn raw_publish(
    channel: &Channel,
    exchange: &str,
    payload: &[u8],
    id: String,
) -> lapin::Result<lapin::PublisherConfirm> {
    channel
        .basic_publish(
            exchange.into(),
            "bench.event".into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            payload,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.into())
                .with_timestamp(
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                )
                .with_headers(FieldTable::from(std::collections::BTreeMap::from([(
                    ATTEMPT_HEADER.into(),
                    AMQPValue::LongLongInt(1),
                )]))),
        )
        .await
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

// ---------------------------------------------------------------------------------- (b)

diesel::table! {
    /// The business table of (b): found through the search path, so Diesel's query builder
    /// (and its statement cache) serves the insert as an application's would.
    orders_b (id) {
        /// Identity.
        id -> BigInt,
        /// Who ordered.
        customer -> Text,
        /// How much.
        total -> Integer,
    }
}

async fn enqueue_cost(env: &mut Env) -> BoxResult<Vec<Figure>> {
    use diesel::ExpressionMethods;

    let rounds = env.scale(10, 4);
    let per_round = env.scale(300, 150);
    let outbox = env.outbox("enqueue_cost").await?;
    env.conn
        .batch_execute(&format!(
            "CREATE TABLE {schema}.orders_b (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             customer text NOT NULL, total int NOT NULL); SET search_path TO {schema}",
            schema = env.schema
        ))
        .await?;
    let insert = || {
        diesel::insert_into(orders_b::table)
            .values((orders_b::customer.eq("ada"), orders_b::total.eq(42)))
    };
    let message = || Message::new("order.created", vec![b'x'; KIB]);
    // What the transaction holds besides the business insert.
    #[derive(Clone, Copy)]
    enum Extra {
        Nothing,
        Enqueue,
        /// The enqueue pipelined with the business insert.
        Pipelined,
        /// One more statement that does nothing: the floor of any extra statement.
        Select,
    }
    let arms = [
        Extra::Nothing,
        Extra::Enqueue,
        Extra::Pipelined,
        Extra::Select,
    ];
    let mut took: Vec<Vec<f64>> = vec![Vec::new(); arms.len()];
    // Interleaved rounds, so drift on a noisy machine hits every arm alike.
    for round in 0..rounds {
        for k in 0..arms.len() {
            let arm = (round + k) % arms.len();
            let extra = arms[arm];
            for _ in 0..per_round {
                let started = Instant::now();
                let outbox = outbox.clone();
                env.conn
                    .transaction(async |c| {
                        match extra {
                            Extra::Nothing => {
                                insert().execute(c).await?;
                            }
                            Extra::Enqueue => {
                                insert().execute(c).await?;
                                outbox.enqueue(c, message()).await?;
                            }
                            Extra::Pipelined => {
                                let c: &AsyncPgConnection = c;
                                tokio::try_join!(
                                    async {
                                        Ok::<_, diesel_outbox::Error>(
                                            insert().execute(&mut &*c).await?,
                                        )
                                    },
                                    outbox.enqueue_pipelined(c, message()),
                                )?;
                            }
                            Extra::Select => {
                                insert().execute(c).await?;
                                diesel::select(1.into_sql::<diesel::sql_types::Integer>())
                                    .get_result::<i32>(c)
                                    .await?;
                            }
                        }
                        Ok::<_, diesel_outbox::Error>(())
                    })
                    .await?;
                took[arm].push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    env.conn.batch_execute("RESET search_path").await?;
    let [without, with, pipelined, select] = &mut took[..] else {
        unreachable!("four arms")
    };
    let without_p50 = percentile(without, 50.0);
    let params = json!({
        "transactions_each": rounds * per_round,
        "mean_without_us": round(mean(without)),
        "mean_with_us": round(mean(with)),
        "mean_pipelined_us": round(mean(pipelined)),
        "mean_with_select_1_us": round(mean(select)),
        "payload_bytes": KIB,
    });
    let baseline = Some(("same transaction without enqueue", without_p50));
    let figures = vec![
        Figure {
            name: "b. enqueue cost (p50 latency)",
            value: percentile(with, 50.0),
            unit: "µs",
            baseline,
            target: "<= 1.30 x",
            params: params.clone(),
        },
        Figure {
            name: "b. enqueue pipelined with the insert",
            value: percentile(pipelined, 50.0),
            unit: "µs",
            baseline,
            target: "<= 1.30 x",
            params: params.clone(),
        },
        Figure {
            name: "b. one more statement (SELECT 1)",
            value: percentile(select, 50.0),
            unit: "µs",
            baseline,
            target: "(floor)",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    values[idx]
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

// ---------------------------------------------------------------------------------- (c)

async fn writers(env: &mut Env) -> BoxResult<Figure> {
    let clients = 8;
    let secs = env.scale(8, 3) as u64;
    let rounds = env.scale(2, 1);
    let (exchange, queue) = env.queue("writers").await?;
    let orders = format!("{}.orders_c", env.schema);
    env.conn
        .batch_execute(&format!(
            "CREATE TABLE {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer text NOT NULL, total int NOT NULL)"
        ))
        .await?;
    let mut rates: HashMap<bool, Vec<f64>> = HashMap::new();
    for round in 0..rounds * 2 {
        let notify = round % 2 == 1;
        let (outbox, relay) = env
            .with_relay(&format!("writers_{round}"), &exchange, notify)
            .await?;
        let commits = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let mut conn = AsyncPgConnection::establish(&env.database_url).await?;
            let outbox = outbox.clone();
            let commits = commits.clone();
            let insert = format!("INSERT INTO {orders} (customer, total) VALUES ('ada', 42)");
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let outbox = outbox.clone();
                    let insert = insert.as_str();
                    conn.transaction(async |c| {
                        diesel::sql_query(insert).execute(c).await?;
                        outbox
                            .enqueue(c, Message::new("order.created", "{}"))
                            .await?;
                        Ok::<_, diesel_outbox::Error>(())
                    })
                    .await?;
                    commits.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, diesel_outbox::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        rates
            .entry(notify)
            .or_default()
            .push(AtomicU64::load(&commits, Ordering::SeqCst) as f64 / secs as f64);
        relay.stop().await?;
        env.purge(&queue).await?;
    }
    env.drop_queue(&queue).await?;
    let on = mean(&rates[&true]);
    let off = mean(&rates[&false]);
    let f = Figure {
        name: "c. 8 writers, wake-on-commit",
        value: on,
        unit: "commits/s",
        baseline: Some(("same writers, notify off", off)),
        target: ">= 0.95 x",
        params: json!({ "clients": clients, "seconds_per_round": secs, "rounds_each": rounds, "relay": "running, RabbitMQ publisher" }),
    };
    f.emit();
    Ok(f)
}

// ---------------------------------------------------------------------------------- (d)

async fn latency(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let rate = 500.0;
    let n = env.scale(5_000, 1_500);
    let mut figures = Vec::new();
    for notify in [true, false] {
        let name = if notify {
            "latency_notify"
        } else {
            "latency_poll"
        };
        let (exchange, queue) = env.queue(name).await?;
        let (outbox, relay) = env.with_relay(name, &exchange, notify).await?;
        // Start from a quiet relay: idle and, with notify, recorded as such for writers.
        env.wait_idle(&outbox).await?;

        // Both sides keyed by message: a delivery may reach the consumer before the writer
        // has noted its commit (the commit's reply and the delivery race), so latencies are
        // matched up afterwards, and one that arrived first counts as zero.
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let received: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let consumer_channel = env.amqp.create_channel().await?;
        let mut consumer = consumer_channel
            .basic_consume(
                queue.as_str().into(),
                "latency".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let consume = {
            let received = received.clone();
            tokio::spawn(async move {
                while let Some(Ok(delivery)) = consumer.next().await {
                    let at = Instant::now();
                    let key = delivery
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|k| k.to_string())
                        .unwrap_or_default();
                    let _ = delivery.ack(BasicAckOptions::default()).await;
                    received.lock().unwrap().entry(key).or_insert(at);
                }
            })
        };
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut writer = AsyncPgConnection::establish(&env.database_url).await?;
        for i in 0..n {
            ticker.tick().await;
            let key = format!("l{i}");
            outbox
                .enqueue(
                    &mut writer,
                    Message::new("bench.latency", "{}").key(key.clone()),
                )
                .await?;
            committed.lock().unwrap().insert(key, Instant::now());
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        while received.lock().unwrap().len() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        consume.abort();
        relay.stop().await?;
        env.drop_queue(&queue).await?;
        let received = received.lock().unwrap().clone();
        let committed = committed.lock().unwrap().clone();
        let mut lat: Vec<f64> = committed
            .iter()
            .filter_map(|(key, t0)| {
                received
                    .get(key)
                    .map(|at| at.saturating_duration_since(*t0).as_secs_f64() * 1e3)
            })
            .collect();
        if lat.len() < n {
            return Err(format!("only {} of {n} messages arrived", lat.len()).into());
        }
        let (p50, p95, p99) = (
            percentile(&mut lat, 50.0),
            percentile(&mut lat, 95.0),
            percentile(&mut lat, 99.0),
        );
        let params = json!({ "offered_msg_per_s": rate, "messages": n, "p50_ms": round(p50), "p95_ms": round(p95), "p99_ms": round(p99), "notify": notify });
        for (label, value, target) in [
            ("p50", p50, if notify { "<= 5 ms" } else { "-" }),
            ("p99", p99, if notify { "<= 25 ms" } else { "-" }),
        ] {
            let name: &'static str = match (notify, label) {
                (true, "p50") => "d. commit→consumer p50, notify",
                (true, _) => "d. commit→consumer p99, notify",
                (false, "p50") => "d. commit→consumer p50, polling only",
                (false, _) => "d. commit→consumer p99, polling only",
            };
            let f = Figure {
                name,
                value,
                unit: "ms",
                baseline: None,
                target,
                params: params.clone(),
            };
            f.emit();
            figures.push(f);
        }
        let _ = p95;
    }
    Ok(figures)
}

// ---------------------------------------------------------------------------------- (e)

async fn one_aggregate(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = 2_000;
    let (exchange, queue) = env.queue("aggregate").await?;
    let mut rates = Vec::new();
    for aggregate in [Some("order-1"), None] {
        let outbox = env
            .outbox(if aggregate.is_some() {
                "one_aggregate"
            } else {
                "unordered"
            })
            .await?;
        env.fill(&outbox, n, aggregate).await?;
        let started = Instant::now();
        let relay = RunningRelay::start(
            outbox
                .relay(env.pool.clone(), env.publisher(&exchange).await?)
                .batch_size(256)
                .build()?,
        );
        let done = env
            .wait_sent(&outbox, n as u64, Duration::from_secs(300))
            .await?;
        rates.push(n as f64 / (done - started).as_secs_f64());
        relay.stop().await?;
        env.purge(&queue).await?;
    }

    // The ceiling of "one at a time": raw lapin, each publish awaiting its confirm.
    let channel = env.amqp.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let payload = vec![b'x'; KIB];
    let started = Instant::now();
    for i in 0..n {
        raw_publish(&channel, &exchange, &payload, format!("one{i}"))
            .await?
            .await?;
    }
    let one_at_a_time = n as f64 / started.elapsed().as_secs_f64();
    env.drop_queue(&queue).await?;
    let params =
        json!({ "messages": n, "payload_bytes": KIB, "publisher": "RabbitMQ", "batch_size": 256 });
    let figures = vec![
        Figure {
            name: "e. one aggregate, 2,000 queued",
            value: rates[0],
            unit: "msg/s",
            baseline: Some(("2,000 unordered", rates[1])),
            target: ">= 0.25 x",
            params: params.clone(),
        },
        Figure {
            name: "e. one aggregate vs raw lapin one at a time",
            value: rates[0],
            unit: "msg/s",
            baseline: Some(("raw lapin, each publish awaits its confirm", one_at_a_time)),
            target: "(ceiling)",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}

// ---------------------------------------------------------------------------------- (f)

/// Acks at once: isolates the database side of claim and mark.
struct Ack;

impl Publisher for Ack {
    async fn publish(&self, _: &Record) -> Result<(), PublishError> {
        Ok(())
    }
}

async fn history(env: &mut Env) -> BoxResult<Figure> {
    let history_rows = env.scale(1_000_000, 200_000);
    let n = env.scale(20_000, 10_000);
    let mut rates = Vec::new();
    for with_history in [true, false] {
        let outbox = env
            .outbox(if with_history { "history" } else { "fresh" })
            .await?;
        if with_history {
            env.conn
                .batch_execute(&format!(
                    "INSERT INTO {t} (idempotency_key, topic, payload, status, attempts, fencing_token, sent_at, created_at) \
                     SELECT 'h' || g, 'bench.event', '\\x00'::bytea, 'sent', 1, 1, now() - interval '1 hour', now() - interval '1 hour' \
                     FROM generate_series(1, {history_rows}) g",
                    t = outbox.table()
                ))
                .await?;
            // History that has been there a while: vacuumed and analysed, as autovacuum
            // would leave it, rather than vacuumed in the middle of the measurement.
            env.conn
                .batch_execute(&format!("VACUUM (ANALYZE) {}", outbox.table()))
                .await?;
        }
        env.fill(&outbox, n, None).await?;
        // Both runs start from a fresh checkpoint, so neither pays for the other's writes.
        env.conn.batch_execute("CHECKPOINT").await?;
        let started = Instant::now();
        let relay = RunningRelay::start(
            outbox
                .relay(env.pool.clone(), Ack)
                .batch_size(256)
                .retention(None)
                .inbox_retention(None)
                .build()?,
        );
        let total = n as u64 + if with_history { history_rows as u64 } else { 0 };
        let done = env
            .wait_sent(&outbox, total, Duration::from_secs(300))
            .await?;
        rates.push(n as f64 / (done - started).as_secs_f64());
        relay.stop().await?;
    }
    let f = Figure {
        name: "f. claim+mark with sent-row history",
        value: rates[0],
        unit: "msg/s",
        baseline: Some(("empty history", rates[1])),
        target: ">= 0.80 x",
        params: json!({ "history_rows": history_rows, "messages": n, "publisher": "acks at once (database side only)" }),
    };
    f.emit();
    Ok(f)
}
