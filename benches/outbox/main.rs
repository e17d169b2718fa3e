//! The performance figures of BENCHMARKS.md, each beside a baseline measured in the same run.
//!
//! ```sh
//! cargo bench --bench outbox --features cli              # everything
//! cargo bench --bench outbox --features cli -- --quick   # smaller, under a minute
//! cargo bench --bench outbox --features cli -- --only throughput,writers   # or a,c
//! cargo bench --bench outbox --features cli -- --only a --sslmode require  # over TLS
//! cargo bench --bench outbox --features cli -- --engine per-row,log   # both engines
//! BENCH_RELAY_LOG=info,lapin=off cargo bench --bench outbox --features cli -- --only i
//! ```
//!
//! The relay processes log to the run's stderr at `warn` (`BENCH_RELAY_LOG` sets their
//! `RUST_LOG` instead).
//!
//! One file per scenario, named by what it measures; `fixture` holds what they run on and
//! `measure` how CPU, memory and percentiles are taken. Finds PostgreSQL, RabbitMQ and NATS
//! as the tests do (`tests/common/services.rs`: `DATABASE_URL`, `AMQP_URL` and `NATS_URL`,
//! else the local servers, else containers in Docker, removed when the run ends), and Kafka
//! as the tests do too (`tests/common/kafka.rs`: `KAFKA_BROKERS`, else Tansu on
//! 127.0.0.1:9092), and uses the tests' own fixtures. Prints one JSON line per figure as it is measured, then a table.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod after_outage;
#[path = "../../tests/common/mod.rs"]
mod common;
mod consumer;
mod enqueue_cost;
mod fixture;
mod held_horizon;
mod history;
mod jetstream;
mod kafka;
mod latency;
mod many_aggregates;
mod measure;
mod one_aggregate;
mod steady;
mod throughput;
mod writers;

use std::time::Instant;

use clap::Parser;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde_json::json;

use crate::fixture::Env;

pub(crate) type BoxResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser)]
struct Args {
    /// Smaller counts and shorter runs (under a minute in all).
    #[arg(long)]
    quick: bool,
    /// Scenarios to run (all by default), by name or by the letter of their figures in
    /// BENCHMARKS.md.
    #[arg(long, value_delimiter = ',')]
    only: Vec<Scenario>,
    /// libpq's `sslmode` for every PostgreSQL connection of the run, the relay's and the
    /// baselines' alike (default: the URL's own, else `disable`); `require` measures over TLS.
    #[arg(long, value_parser = ["disable", "prefer", "require"])]
    sslmode: Option<String>,
    /// The engines to measure, one after the other in this run, every scenario on each
    /// (`per-row`, `log`; default `per-row`).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(diesel_outbox::Engine))]
    engine: Vec<diesel_outbox::Engine>,
    /// Ignored (cargo bench passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

/// The scenarios, in the order they run.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    /// (a) relay throughput against raw lapin, with CPU per process; (g) its memory.
    #[value(alias = "a", alias = "g")]
    Throughput,
    /// (b) what an enqueue adds to a transaction.
    #[value(alias = "b")]
    EnqueueCost,
    /// (c) concurrent writers with and without the outbox.
    #[value(alias = "c")]
    Writers,
    /// (d) commit-to-consumer latency.
    #[value(alias = "d")]
    Latency,
    /// (e) one aggregate in strict order.
    #[value(alias = "e")]
    OneAggregate,
    /// (f) the claim on a long history.
    #[value(alias = "f")]
    History,
    /// (h) many short aggregates against no aggregate keys.
    #[value(alias = "h")]
    ManyAggregates,
    /// (i) the backlog of a broker outage, drained once the broker is back.
    #[value(alias = "i")]
    AfterOutage,
    /// (j) the consumer runner against a hand-written consumer.
    #[value(alias = "j")]
    Consumer,
    /// (k) the relay to NATS JetStream against raw async-nats.
    #[value(alias = "k")]
    Jetstream,
    /// (l) the relay to Kafka against raw rdkafka.
    #[value(alias = "l")]
    Kafka,
    /// (n) steady streams of 200, 1,000 and 5,000 msg/s against a backlog's drain.
    #[value(alias = "n")]
    Steady,
    /// (m) a steady stream of 800 msg/s while a transaction holds the xmin horizon.
    #[value(alias = "m")]
    HeldHorizon,
}

/// One measured figure beside its same-run baseline.
/// The engine the scenario being measured runs on, for the figures' lines.
static ENGINE: std::sync::Mutex<diesel_outbox::Engine> =
    std::sync::Mutex::new(diesel_outbox::Engine::PerRow);

fn engine() -> diesel_outbox::Engine {
    *ENGINE.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) struct Figure {
    pub(crate) name: &'static str,
    pub(crate) value: f64,
    pub(crate) unit: &'static str,
    pub(crate) baseline: Option<(&'static str, f64)>,
    pub(crate) target: &'static str,
    pub(crate) params: serde_json::Value,
}

impl Figure {
    pub(crate) fn ratio(&self) -> Option<f64> {
        self.baseline.map(|(_, b)| self.value / b)
    }

    pub(crate) fn emit(&self) {
        let line = json!({
            "name": self.name,
            "engine": engine().name(),
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

pub(crate) fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

pub(crate) const KIB: usize = 1024;

#[tokio::main]
async fn main() -> BoxResult<()> {
    let args = Args::parse();
    // Containers started for want of a server are removed when `_containers` drops.
    let (_containers, [database_url, amqp_url, nats_url]) = common::services::urls([
        common::services::Service::Postgres,
        common::services::Service::RabbitMq,
        common::services::Service::Nats,
    ])?;
    let (database_url, sslmode) = with_sslmode(&database_url, args.sslmode.as_deref());
    println!("{}", json!({ "postgres_sslmode": sslmode }));
    // Dropped (with every table in it) when the run ends, however it ends.
    let schema = common::TestSchema::new().await;
    let amqp = common::broker::connect().await;
    let channel = amqp.create_channel().await?;
    // The benchmark's own connection fills tables and polls for progress: not the work of
    // what is measured, so its backend is left out of PostgreSQL's CPU.
    let mut conn = diesel_outbox::establish(&database_url).await?;
    #[derive(diesel::QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let pid: Pid = diesel_async::RunQueryDsl::get_result(
        diesel::sql_query("SELECT pg_backend_pid() AS pid"),
        &mut conn,
    )
    .await?;
    let mut env = Env {
        database_url: database_url.clone(),
        amqp_url,
        nats_url,
        schema: schema.name.clone(),
        conn,
        conn_backend: u32::try_from(pid.pid)?,
        pool: diesel_outbox::PgPool::builder()
            .max_size(8)
            .test_on_check_out(false)
            .build(diesel_outbox::connection_manager(&database_url))
            .await?,
        amqp,
        channel,
        quick: args.quick,
        engine: diesel_outbox::Engine::PerRow,
    };
    let engines = if args.engine.is_empty() {
        vec![diesel_outbox::Engine::PerRow]
    } else {
        args.engine.clone()
    };
    let run = |s: Scenario| args.only.is_empty() || args.only.contains(&s);
    let started = Instant::now();
    let mut figures = Vec::new();
    let result = async {
        for engine in &engines {
            *ENGINE.lock().unwrap_or_else(|e| e.into_inner()) = *engine;
            env.engine = *engine;
            let mut found: Vec<Figure> = Vec::new();
            if run(Scenario::Throughput) {
                found.extend(throughput::throughput(&mut env).await?);
            }
            if run(Scenario::EnqueueCost) {
                found.extend(enqueue_cost::enqueue_cost(&mut env).await?);
            }
            if run(Scenario::Writers) {
                found.push(writers::writers(&mut env).await?);
            }
            if run(Scenario::Latency) {
                found.extend(latency::latency(&mut env).await?);
            }
            if run(Scenario::OneAggregate) {
                found.extend(one_aggregate::one_aggregate(&mut env).await?);
            }
            if run(Scenario::History) {
                found.push(history::history(&mut env).await?);
            }
            if run(Scenario::ManyAggregates) {
                found.extend(many_aggregates::many_aggregates(&mut env).await?);
            }
            if run(Scenario::AfterOutage) {
                found.extend(after_outage::after_outage(&mut env).await?);
            }
            if run(Scenario::Consumer) {
                found.extend(consumer::consumer(&mut env).await?);
            }
            if run(Scenario::Jetstream) {
                found.extend(jetstream::jetstream(&mut env).await?);
            }
            if run(Scenario::Kafka) {
                found.extend(kafka::kafka(&mut env).await?);
            }
            if run(Scenario::Steady) {
                found.extend(steady::steady(&mut env).await?);
            }
            if run(Scenario::HeldHorizon) {
                found.extend(held_horizon::held_horizon(&mut env).await?);
            }
            figures.extend(found.into_iter().map(|f| (*engine, f)));
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    }
    .await;
    drop(schema);
    result?;

    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_header(["figure", "engine", "value", "baseline", "ratio", "target"]);
    for (engine, f) in &figures {
        table.add_row([
            f.name.to_owned(),
            engine.name().to_owned(),
            format!("{:.2} {}", f.value, f.unit),
            f.baseline
                .map_or("-".into(), |(n, v)| format!("{v:.2} {} ({n})", f.unit)),
            f.ratio().map_or("-".into(), |r| format!("{r:.2} ×")),
            f.target.to_owned(),
        ]);
    }
    println!("{table}");
    println!(
        "total {:.0} s{}, PostgreSQL sslmode={sslmode} for the relays and the baselines alike",
        started.elapsed().as_secs_f64(),
        if env.quick { " (quick)" } else { "" }
    );
    Ok(())
}

/// `url` with `sslmode` set (replacing the URL's own), or kept as the URL says (`disable`
/// when it says nothing): the URL every connection of the run uses, and its mode.
fn with_sslmode(url: &str, sslmode: Option<&str>) -> (String, String) {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    let own = params
        .iter()
        .find_map(|p| p.strip_prefix("sslmode="))
        .map(str::to_owned);
    let mode = sslmode
        .map(str::to_owned)
        .or(own)
        .unwrap_or_else(|| "disable".to_owned());
    params.retain(|p| !p.starts_with("sslmode="));
    let setting = format!("sslmode={mode}");
    params.push(&setting);
    (format!("{base}?{}", params.join("&")), mode)
}
