//! Fault injection: the crate's guarantees under crashes, pauses, cuts and outages.
//!
//! Writers enqueue in transactions that also write a business row with a per-aggregate
//! sequence taken under a row lock; about 20% roll back (half of those to a savepoint).
//! Three relays run as separate processes (the `diesel-outbox relay` binary) and publish
//! through a TCP fault proxy; a consumer records every delivery and applies its effect with
//! `dedupe` in its own transaction. Meanwhile relays are SIGKILLed and restarted, SIGSTOPped
//! for longer than their lease, their PostgreSQL backends (LISTEN included) terminated, their
//! broker connections cut, the broker restarted, the broker stopped for longer than
//! `max_attempts × backoff max`, and PostgreSQL restarted (a writer whose commit outcome is
//! then unknown is resolved against the business rows); poison rows are written by SQL
//! (headers serde cannot read, an `infinity` enqueue time, headers too large for the
//! broker's frame, a `CC` header). Then the faults stop, everything drains, and a checker
//! reads ground truth from the database and the delivery log: nothing lost, no phantom, order
//! kept per aggregate, one effect per message, stale relays fenced, and no dead letter but
//! the poison rows.
//!
//! The suite runs against each publisher: RabbitMQ (restarted with `rabbitmqctl`) and NATS
//! JetStream (nats-server restarted; its JetStream store on disk survives), with the
//! consumer runner's source for that broker.
//!
//! The tests in this binary restart shared services, so they run one at a time (and cargo
//! runs test binaries one after another).
//!
//! ```sh
//! cargo test --all-features --test faults                                    # CI tier
//! cargo test --release --all-features --test faults -- --ignored --nocapture # long tiers
//! ```
#![cfg(feature = "cli")]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::ToSocketAddrs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::TestSchema;
use common::broker::{amqp_authority, amqp_url, amqp_url_via, rabbitmqctl};
use common::nats::nats_url;
use common::proxy::FaultProxy;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{self, Consumer, HandleError, handler_fn};
use diesel_outbox::{Error, Message, Outbox};
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;

/// The broker a run of the suite publishes to and consumes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    RabbitMq,
    Nats,
}

const RELAYS: usize = 3;
const BATCH: usize = 50;
const LEASE: Duration = Duration::from_secs(2);
const MAX_ATTEMPTS: u32 = 10;
const BACKOFF_MAX: Duration = Duration::from_millis(500);
/// Longer than `MAX_ATTEMPTS × BACKOFF_MAX`: were an outage charged to the messages, every
/// one of them would be dead by the end of it.
const BROKER_DOWN: Duration = Duration::from_secs(8);

/// Tests here restart PostgreSQL and the broker: one at a time (a test that panics releases
/// it as it unwinds).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

struct Tier {
    messages: usize,
    writers: usize,
    aggregates: usize,
    /// Pause between fault events.
    fault_every: Duration,
    /// How long writing should take, so the faults spread over it.
    writing: Duration,
    /// How often PostgreSQL is restarted.
    postgres_restarts: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_ci_tier() {
    if !local_tools("fault_suite_ci_tier", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    run(Kind::RabbitMq, ci_tier()).await;
}

/// The NATS tier: nats-server is cut off, restarted mid-run and stopped for longer than
/// `max_attempts × backoff max`; nothing is lost and nothing but the poison dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fault_suite_ci_tier_nats() {
    if !local_tools("fault_suite_ci_tier_nats", Kind::Nats) {
        return;
    }
    let _serial = SERIAL.lock().await;
    run(Kind::Nats, ci_tier()).await;
}

/// Whether the servers this test restarts are the local ones (not containers, which their
/// tools cannot drive); says why it is skipped if not.
fn local_tools(test: &str, kind: Kind) -> bool {
    use common::services::Service;
    let broker = match kind {
        Kind::RabbitMq => Service::RabbitMq,
        Kind::Nats => Service::Nats,
    };
    common::services::local_tools_for(test, &[Service::Postgres, broker])
}

fn ci_tier() -> Tier {
    Tier {
        messages: 5_000,
        writers: 4,
        aggregates: 40,
        fault_every: Duration::from_millis(1_500),
        writing: Duration::from_secs(50),
        postgres_restarts: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 20 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier() {
    if !local_tools("fault_suite_long_tier", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    run(Kind::RabbitMq, long_tier()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "long tier (about 20 minutes): cargo test --release --all-features --test faults -- --ignored"]
async fn fault_suite_long_tier_nats() {
    if !local_tools("fault_suite_long_tier_nats", Kind::Nats) {
        return;
    }
    let _serial = SERIAL.lock().await;
    run(Kind::Nats, long_tier()).await;
}

fn long_tier() -> Tier {
    Tier {
        messages: 100_000,
        writers: 8,
        aggregates: 400,
        fault_every: Duration::from_secs(4),
        writing: Duration::from_secs(15 * 60),
        postgres_restarts: 3,
    }
}

/// What the harness saw, for the checker and the report.
#[derive(Default)]
struct Log {
    rolled_back: Mutex<HashSet<String>>,
    deliveries: Mutex<Vec<Delivery>>,
    faults: Mutex<BTreeMap<&'static str, usize>>,
}

impl Log {
    fn fault(&self, kind: &'static str) {
        *self.faults.lock().unwrap().entry(kind).or_default() += 1;
    }
}

#[derive(Clone, Debug)]
struct Delivery {
    key: String,
    aggregate: String,
    seq: i64,
    attempt: i64,
    redelivered: bool,
}

struct Relays {
    args: Vec<String>,
    env: Vec<(String, String)>,
    logs: PathBuf,
    slots: Vec<Option<Child>>,
    started: usize,
}

impl Relays {
    fn spawn(&mut self, slot: usize) {
        self.started += 1;
        let log = std::fs::File::create(self.logs.join(format!("relay-{}.log", self.started)))
            .expect("relay log");
        let child = Command::new(env!("CARGO_BIN_EXE_diesel-outbox"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start relay");
        self.slots[slot] = Some(child);
    }

    fn signal(&self, slot: usize, signal: &str) {
        if let Some(child) = &self.slots[slot] {
            let _ = Command::new("kill")
                .args([signal, &child.id().to_string()])
                .status();
        }
    }

    fn kill(&mut self, slot: usize) {
        if let Some(mut child) = self.slots[slot].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM every relay and wait for clean exits.
    fn stop_all(&mut self) {
        for slot in 0..self.slots.len() {
            self.signal(slot, "-CONT");
            self.signal(slot, "-TERM");
        }
        for slot in 0..self.slots.len() {
            if let Some(mut child) = self.slots[slot].take() {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    match child.try_wait().unwrap() {
                        Some(status) => {
                            assert!(status.success(), "relay exited with {status}");
                            break;
                        }
                        None if Instant::now() > deadline => {
                            let _ = child.kill();
                            panic!("relay did not stop on SIGTERM");
                        }
                        None => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            }
        }
    }

    /// Outcomes discarded by fencing, as the relays logged them.
    fn fenced(&self) -> usize {
        let mut total = 0;
        for entry in std::fs::read_dir(&self.logs).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            for line in text.lines().filter(|l| l.contains("outcomes discarded")) {
                if let Some(n) = line
                    .split("fenced=")
                    .nth(1)
                    .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|n| n.parse::<usize>().ok())
                {
                    total += n;
                }
            }
        }
        total
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        for slot in 0..self.slots.len() {
            self.signal(slot, "-CONT");
            self.kill(slot);
        }
    }
}

async fn run(kind: Kind, tier: Tier) {
    let started = Instant::now();
    let schema = TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    conn.batch_execute(&format!(
        "CREATE TABLE {s}.aggregates (name text PRIMARY KEY, next_seq bigint NOT NULL);
         CREATE TABLE {s}.orders (key text PRIMARY KEY, aggregate text NOT NULL, seq bigint NOT NULL);
         CREATE TABLE {s}.effects (key text NOT NULL);
         INSERT INTO {s}.aggregates SELECT 'agg' || g, 0 FROM generate_series(1, {n}) g;",
        s = schema.name,
        n = tier.aggregates
    ))
    .await
    .unwrap();

    let broker = Broker::new(kind).await;
    let proxy = FaultProxy::start(broker.upstream()).await;
    let app_name = format!("outbox_fault_relay_{}", schema.name);
    let logs = std::env::temp_dir().join(&schema.name);
    std::fs::create_dir_all(&logs).unwrap();
    let mut relays = Relays {
        args: ["--table", &table, "relay"]
            .into_iter()
            .map(str::to_owned)
            .chain(broker.relay_args())
            .chain(
                [
                    "--batch-size",
                    &BATCH.to_string(),
                    "--lease",
                    &format!("{}ms", LEASE.as_millis()),
                    "--poll-interval",
                    "200ms",
                    "--backoff-min",
                    "50ms",
                    "--backoff-max",
                    &format!("{}ms", BACKOFF_MAX.as_millis()),
                    "--max-attempts",
                    &MAX_ATTEMPTS.to_string(),
                    "--drain-timeout",
                    "1s",
                    "--confirm-timeout",
                    "1s",
                    "--retention",
                    "off",
                    "--inbox-retention",
                    "off",
                ]
                .iter()
                .map(|s| s.to_string()),
            )
            .collect(),
        env: vec![
            (
                "DATABASE_URL".into(),
                common::with_application_name(&common::database_url(), &app_name),
            ),
            broker.relay_env(proxy.addr),
            (
                "RUST_LOG".into(),
                "warn,lapin=error,diesel_outbox=info".into(),
            ),
        ],
        logs: logs.clone(),
        // One spare slot for the relay that takes over from paused ones.
        slots: (0..=RELAYS).map(|_| None).collect(),
        started: 0,
    };
    for slot in 0..RELAYS {
        relays.spawn(slot);
    }

    let log = Arc::new(Log::default());
    let consuming = Arc::new(AtomicBool::new(true));
    let consumer = tokio::spawn(consume(
        broker.clone(),
        outbox.clone(),
        schema.name.clone(),
        log.clone(),
        consuming.clone(),
    ));

    // Writers, paced so the writing spans the fault period.
    let written = Arc::new(AtomicUsize::new(0));
    let per_writer = tier.messages / tier.writers;
    let pace = tier.writing.div_f64(per_writer as f64);
    let mut writers = Vec::new();
    for w in 0..tier.writers {
        let mut conn = schema.connect().await;
        let outbox = outbox.clone();
        let log = log.clone();
        let written = written.clone();
        let schema_name = schema.name.clone();
        let aggregates = tier.aggregates;
        writers.push(tokio::spawn(async move {
            let mut committed = 0;
            let mut attempt = 0u64;
            let mut ticker = tokio::time::interval(pace);
            while committed < per_writer {
                ticker.tick().await;
                attempt += 1;
                let key = format!("w{w}-{attempt}");
                let aggregate = format!("agg{}", fastrand::usize(1..=aggregates));
                let roll = fastrand::u8(0..10);
                let outcome = write(&mut conn, &outbox, &schema_name, &key, &aggregate, roll).await;
                let ok = match outcome {
                    Written::Committed => true,
                    Written::RolledBack => false,
                    Written::Unknown => {
                        // The connection died (PostgreSQL restarted, or the backend was
                        // terminated) around the commit: ask the business rows.
                        conn = reconnect(&schema_name).await;
                        log.fault("writer commit outcome resolved");
                        committed_order(&mut conn, &schema_name, &key).await
                    }
                };
                if ok {
                    committed += 1;
                    written.fetch_add(1, Ordering::SeqCst);
                } else {
                    log.rolled_back.lock().unwrap().insert(key);
                }
            }
        }));
    }

    // Faults, round-robin over the kinds, until the writers are done.
    let fault_kinds = [
        "relay SIGKILL",
        "poison rows",
        "relay SIGSTOP beyond lease",
        "relay backends terminated",
        "broker connections cut",
        "broker restart",
        "broker stopped beyond max_attempts × backoff max",
        "PostgreSQL restart",
    ];
    let mut round = 0usize;
    let mut admin = common::connect().await;
    let mut poison: Vec<String> = Vec::new();
    while writers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(tier.fault_every).await;
        let fault = fault_kinds[round % fault_kinds.len()];
        round += 1;
        let fired = log.faults.lock().unwrap().get(fault).copied().unwrap_or(0);
        match fault {
            "poison rows" => {
                for _ in 0..POISON_KINDS {
                    let key =
                        write_poison(&mut admin, &table, kind, poison.len(), tier.aggregates).await;
                    poison.push(key);
                }
                log.fault(fault);
            }
            "broker stopped beyond max_attempts × backoff max" => {
                if fired > 0 {
                    continue; // once per run
                }
                broker.stop();
                tokio::time::sleep(BROKER_DOWN).await;
                broker.start();
                log.fault(fault);
            }
            "PostgreSQL restart" => {
                if fired >= tier.postgres_restarts {
                    continue;
                }
                restart_postgres();
                admin = reconnect(&schema.name).await;
                log.fault(fault);
            }
            "relay SIGKILL" => {
                let slot = fastrand::usize(0..RELAYS);
                relays.kill(slot);
                relays.spawn(slot);
                log.fault(fault);
            }
            "relay SIGSTOP beyond lease" => {
                pause_beyond_lease(&mut relays, &mut admin, &table).await;
                log.fault(fault);
            }
            "relay backends terminated" => {
                #[derive(QueryableByName)]
                struct Killed {
                    #[diesel(sql_type = BigInt)]
                    n: i64,
                }
                let killed: Killed = diesel::sql_query(
                    "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
                     WHERE application_name = $1",
                )
                .bind::<Text, _>(&app_name)
                .get_result(&mut admin)
                .await
                .unwrap();
                if killed.n > 0 {
                    log.fault(fault);
                }
            }
            "broker connections cut" => {
                if proxy.cut() > 0 {
                    log.fault(fault);
                }
            }
            "broker restart" => {
                if log.faults.lock().unwrap().contains_key(fault) {
                    continue; // once per run
                }
                broker.stop();
                broker.start();
                log.fault(fault);
            }
            _ => unreachable!(),
        }
    }
    for w in writers {
        w.await.unwrap();
    }
    let written = AtomicUsize::load(&written, Ordering::SeqCst);

    // Faults stop; everything must drain.
    let faults_stopped = Instant::now();
    for slot in 0..RELAYS {
        relays.signal(slot, "-CONT");
        let dead = relays.slots[slot]
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some());
        if dead {
            relays.spawn(slot);
        }
    }
    // PostgreSQL was restarted meanwhile.
    let mut conn = reconnect(&schema.name).await;
    let drain_deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let stats = outbox.stats(&mut conn).await.unwrap();
        let delivered: HashSet<String> = log
            .deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|d| d.key.clone())
            .collect();
        if stats.pending == 0 && stats.in_flight == 0 && delivered.len() >= written {
            break;
        }
        assert!(
            Instant::now() < drain_deadline,
            "not drained: {stats:?}, {} of {written} delivered",
            delivered.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drained_in = faults_stopped.elapsed();
    relays.stop_all();
    // Every publish is confirmed by now, late duplicates of stale relays included: consume
    // until the queue holds nothing, ready or unacknowledged.
    let deadline = Instant::now() + Duration::from_secs(60);
    while broker.depth().await > 0 {
        assert!(
            Instant::now() < deadline,
            "the consumer never emptied the queue"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    consuming.store(false, Ordering::SeqCst);
    consumer.await.unwrap();

    // The checker: ground truth from the database and the delivery log.
    #[derive(QueryableByName)]
    struct Order {
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Text)]
        aggregate: String,
        #[diesel(sql_type = BigInt)]
        seq: i64,
    }
    let orders: Vec<Order> = diesel::sql_query(format!(
        "SELECT key, aggregate, seq FROM {}.orders",
        schema.name
    ))
    .load(&mut conn)
    .await
    .unwrap();
    let committed: HashMap<&str, &Order> = orders.iter().map(|o| (o.key.as_str(), o)).collect();
    assert_eq!(
        committed.len(),
        written,
        "the writers' count matches the business rows"
    );
    let deliveries = log.deliveries.lock().unwrap().clone();
    let rolled_back = log.rolled_back.lock().unwrap().clone();

    let mut first: HashMap<&str, &Delivery> = HashMap::new();
    let mut order_violations = 0;
    let mut next_seq: HashMap<&str, i64> = HashMap::new();
    for d in &deliveries {
        if first.contains_key(d.key.as_str()) {
            continue;
        }
        first.insert(&d.key, d);
        let expected = next_seq.entry(&d.aggregate).or_insert(1);
        if d.seq != *expected {
            order_violations += 1;
        }
        *expected = d.seq + 1;
    }
    let lost: Vec<&&str> = committed
        .keys()
        .filter(|k| !first.contains_key(**k))
        .collect();
    let phantoms: Vec<&str> = first
        .keys()
        .filter(|k| !committed.contains_key(**k))
        .copied()
        .collect();
    let rolled_back_delivered = first.keys().filter(|k| rolled_back.contains(**k)).count();
    let duplicates = deliveries.len() - first.len();
    let redelivered = deliveries.iter().filter(|d| d.redelivered).count();
    let retried = deliveries.iter().filter(|d| d.attempt > 1).count();
    for d in first.values() {
        let order = committed.get(d.key.as_str());
        assert!(
            order.is_none_or(|o| o.aggregate == d.aggregate && o.seq == d.seq),
            "delivery {d:?} does not match its business row"
        );
    }

    #[derive(QueryableByName)]
    struct Effects {
        #[diesel(sql_type = BigInt)]
        keys: i64,
        #[diesel(sql_type = BigInt)]
        total: i64,
    }
    let effects: Effects = diesel::sql_query(format!(
        "SELECT count(DISTINCT key) AS keys, count(*) AS total FROM {}.effects",
        schema.name
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    #[derive(QueryableByName)]
    struct Rows {
        #[diesel(sql_type = BigInt)]
        sent: i64,
        #[diesel(sql_type = BigInt)]
        other: i64,
        #[diesel(sql_type = BigInt)]
        leased: i64,
        #[diesel(sql_type = Integer)]
        max_attempts: i32,
    }
    let rows: Rows = diesel::sql_query(format!(
        "SELECT count(*) FILTER (WHERE status = 'sent') AS sent, \
         count(*) FILTER (WHERE status <> 'sent') AS other, \
         count(*) FILTER (WHERE lease_until > now()) AS leased, \
         coalesce(max(attempts), 0) AS max_attempts FROM {table}"
    ))
    .get_result(&mut conn)
    .await
    .unwrap();

    let faults = log.faults.lock().unwrap().clone();
    let fault_events: usize = faults.values().sum();
    let fenced = relays.fenced();
    // Each fault can cost at most what the relays hold claimed, as the relay states it
    // for the options the relay processes run with.
    let held = outbox
        .relay(
            common::pool(1).await,
            diesel_outbox::publisher_fn(|_| async { Ok(()) }),
        )
        .batch_size(BATCH)
        .build()
        .unwrap()
        .max_claimed_rows();
    let duplicate_bound = fault_events.max(1) * RELAYS * held;
    println!(
        "fault suite ({kind:?}): {written} committed messages ({} rolled back attempts), {} deliveries, \
         {duplicates} duplicate deliveries (bound {duplicate_bound}), {redelivered} flagged \
         redelivered, {retried} with attempt > 1, {fenced} fenced outcomes, faults {faults:?}, \
         {} relay processes started, drained {:.1} s after the faults stopped, total {:.0} s; \
         lost {}, phantom {}, order violations {order_violations}, effects {} for {} keys, \
         max attempts {}, dead letters {} (all poison: {})",
        rolled_back.len(),
        deliveries.len(),
        relays.started,
        drained_in.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        lost.len(),
        phantoms.len(),
        effects.total,
        effects.keys,
        rows.max_attempts,
        rows.other,
        poison.len(),
    );
    assert!(lost.is_empty(), "lost: {:?}", &lost[..lost.len().min(10)]);
    assert!(phantoms.is_empty(), "phantoms: {phantoms:?}");
    assert_eq!(rolled_back_delivered, 0, "a rolled-back key was delivered");
    assert_eq!(
        order_violations, 0,
        "per-aggregate order among first deliveries"
    );
    assert_eq!(effects.total, written as i64, "one effect per message");
    assert_eq!(effects.keys, written as i64);
    assert!(
        duplicates <= duplicate_bound,
        "{duplicates} duplicates over the bound"
    );
    assert_eq!(rows.sent, written as i64, "every row sent");
    #[derive(QueryableByName)]
    struct Unsent {
        #[diesel(sql_type = Text)]
        key: String,
        #[diesel(sql_type = Text)]
        status: String,
    }
    let unsent: Vec<Unsent> = diesel::sql_query(format!(
        "SELECT idempotency_key AS key, status FROM {table} WHERE status <> 'sent'"
    ))
    .load(&mut conn)
    .await
    .unwrap();
    let mut dead: Vec<&str> = unsent
        .iter()
        .filter(|u| u.status == "dead")
        .map(|u| u.key.as_str())
        .collect();
    dead.sort();
    let mut expected_dead: Vec<&str> = poison.iter().map(String::as_str).collect();
    expected_dead.sort();
    assert_eq!(
        unsent.len(),
        dead.len(),
        "no pending rows left: {:?}",
        unsent.iter().map(|u| &u.key).collect::<Vec<_>>()
    );
    assert_eq!(dead, expected_dead, "no dead letter but the poison rows");
    assert_eq!(rows.other, poison.len() as i64);
    assert_eq!(rows.leased, 0, "no row left leased");
    for fault in fault_kinds {
        assert!(
            faults.get(fault).copied().unwrap_or(0) > 0,
            "fault never fired: {fault}"
        );
    }
    assert!(fenced > 0, "pauses ran but no stale relay was fenced");

    broker.delete().await;
    let _ = std::fs::remove_dir_all(logs);
}

/// Pauses every relay while some rows are leased, lets a fresh relay take those rows over
/// once the lease ran out, then resumes the paused ones: whoever held the rows now comes
/// back with stale claims, and fencing must discard its outcomes.
async fn pause_beyond_lease(relays: &mut Relays, admin: &mut AsyncPgConnection, table: &str) {
    #[derive(QueryableByName, PartialEq, Eq, Hash)]
    struct Claim {
        #[diesel(sql_type = BigInt)]
        id: i64,
        #[diesel(sql_type = BigInt)]
        fencing_token: i64,
    }
    let leased_sql = format!("SELECT id, fencing_token FROM {table} WHERE lease_until > now()");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut held: Vec<Claim> = Vec::new();
    while held.is_empty() && Instant::now() < deadline {
        for slot in 0..RELAYS {
            relays.signal(slot, "-STOP");
        }
        held = diesel::sql_query(&leased_sql).load(admin).await.unwrap();
        if held.is_empty() {
            for slot in 0..RELAYS {
                relays.signal(slot, "-CONT");
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }
    if held.is_empty() {
        // Nothing in flight this time: an ordinary pause.
        for slot in 0..RELAYS {
            relays.signal(slot, "-STOP");
        }
    }
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    relays.spawn(RELAYS);
    let ids: Vec<i64> = held.iter().map(|c| c.id).collect();
    let taken_over = format!(
        "SELECT id, fencing_token FROM {table} WHERE id = ANY($1) AND status = 'pending' \
         AND (lease_until IS NULL OR lease_until <= now())"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: Vec<Claim> = diesel::sql_query(&taken_over)
            .bind::<diesel::sql_types::Array<BigInt>, _>(&ids)
            .load(admin)
            .await
            .unwrap();
        // Rows still pending with an expired lease and their old token: not yet taken over.
        let old: HashSet<&Claim> = held.iter().collect();
        if !waiting.iter().any(|c| old.contains(c)) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for slot in 0..RELAYS {
        relays.signal(slot, "-CONT");
    }
    relays.signal(RELAYS, "-TERM");
    if let Some(mut spare) = relays.slots[RELAYS].take() {
        let _ = spare.wait();
    }
}

/// How a writer transaction ended.
enum Written {
    Committed,
    RolledBack,
    /// The connection failed on the way: it may or may not have committed.
    Unknown,
}

/// One writer transaction. `roll` 0 rolls back the whole transaction, 1 rolls back to a
/// savepoint (the message and its business row), others commit.
async fn write(
    conn: &mut AsyncPgConnection,
    outbox: &Outbox,
    schema: &str,
    key: &str,
    aggregate: &str,
    roll: u8,
) -> Written {
    let result = conn
        .transaction(async |c| {
            let unit = async |c: &mut AsyncPgConnection| {
                #[derive(QueryableByName)]
                struct Seq {
                    #[diesel(sql_type = BigInt)]
                    next_seq: i64,
                }
                // The row lock serialises the writers of one aggregate until commit.
                let seq: Seq = diesel::sql_query(format!(
                    "UPDATE {schema}.aggregates SET next_seq = next_seq + 1 WHERE name = $1 \
                     RETURNING next_seq"
                ))
                .bind::<Text, _>(aggregate)
                .get_result(c)
                .await?;
                diesel::sql_query(format!(
                    "INSERT INTO {schema}.orders (key, aggregate, seq) VALUES ($1, $2, $3)"
                ))
                .bind::<Text, _>(key)
                .bind::<Text, _>(aggregate)
                .bind::<BigInt, _>(seq.next_seq)
                .execute(c)
                .await?;
                let payload = serde_json::json!({ "aggregate": aggregate, "seq": seq.next_seq });
                outbox
                    .enqueue(
                        c,
                        Message::json("fault.order", &payload)?
                            .key(key)
                            .aggregate_key(aggregate),
                    )
                    .await?;
                Ok::<_, Error>(())
            };
            if roll == 1 {
                // The unit inside a savepoint that is rolled back; the outer commit is empty.
                let inner = c
                    .transaction(async |s| {
                        unit(s).await?;
                        Err::<(), _>(Error::InvalidMessage("roll back to savepoint".into()))
                    })
                    .await;
                assert!(inner.is_err());
                return Err(Error::InvalidMessage("savepoint rolled back".into()));
            }
            unit(c).await?;
            if roll == 0 {
                return Err(Error::InvalidMessage("business rule failed".into()));
            }
            Ok(())
        })
        .await;
    match result {
        Ok(()) => Written::Committed,
        Err(Error::InvalidMessage(_)) => Written::RolledBack,
        Err(_) => Written::Unknown,
    }
}

/// Whether the business row of `key` exists: ground truth for a commit whose outcome the
/// writer could not see.
async fn committed_order(conn: &mut AsyncPgConnection, schema: &str, key: &str) -> bool {
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let n: N = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM {schema}.orders WHERE key = $1"
    ))
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .expect("PostgreSQL answers after reconnecting");
    n.n == 1
}

/// A connection whose `search_path` is `schema`, once PostgreSQL answers again.
async fn reconnect(schema: &str) -> AsyncPgConnection {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(mut conn) = AsyncPgConnection::establish(&common::database_url()).await
            && conn
                .batch_execute(&format!("SET search_path TO \"{schema}\""))
                .await
                .is_ok()
        {
            return conn;
        }
        assert!(Instant::now() < deadline, "PostgreSQL did not come back");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn restart_postgres() {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("a local PostgreSQL cluster")
        .flatten()
        .next()
        .expect("a cluster version")
        .file_name();
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect"])
        .arg(&version)
        .args(["main", "restart"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster restart failed");
}

/// The kinds of poison row [`write_poison`] writes, in turn.
const POISON_KINDS: usize = 4;

/// Writes the `n`-th poison row by SQL, into one of the business aggregates (so it blocks
/// that aggregate until it dies): headers serde cannot read, an `infinity` enqueue time,
/// headers too large for the broker, or a header the broker refuses. Returns its key.
async fn write_poison(
    conn: &mut AsyncPgConnection,
    table: &str,
    broker: Kind,
    n: usize,
    aggregates: usize,
) -> String {
    // What the broker refuses of a header: RabbitMQ routes on `CC`, JetStream acts on
    // `Nats-` headers (`Nats-Rollup` would purge the stream).
    let refused_header = match broker {
        Kind::RabbitMq => "'{\"CC\": \"elsewhere\"}'::jsonb",
        Kind::Nats => "'{\"Nats-Rollup\": \"all\"}'::jsonb",
    };
    let kinds: [(&str, &str, &str); POISON_KINDS] = [
        ("huge-number", "'{\"n\": 1e400}'::jsonb", "now()"),
        ("infinite", "'{}'::jsonb", "'infinity'"),
        // Over RabbitMQ's frame_max (128 KiB) and NATS's max_payload (1 MiB).
        (
            "oversized-headers",
            "jsonb_build_object('h', repeat('x', 1100000))",
            "now()",
        ),
        ("refused-header", refused_header, "now()"),
    ];
    let (kind, headers, created_at) = kinds[n % kinds.len()];
    let key = format!("poison-{kind}-{n}");
    let aggregate = format!("agg{}", fastrand::usize(1..=aggregates));
    diesel::sql_query(format!(
        "INSERT INTO {table} (idempotency_key, topic, aggregate_key, payload, headers, created_at) \
         VALUES ($1, 'fault.order', $2, '\\x00'::bytea, {headers}, {created_at})"
    ))
    .bind::<Text, _>(&key)
    .bind::<Text, _>(&aggregate)
    .execute(conn)
    .await
    .unwrap();
    key
}

/// The consumer: the crate's runner, so the checker's count of effects proves it applies
/// each message once through every fault. Every delivery (duplicates too) is logged as the
/// source hands it over, in delivery order.
async fn consume(
    broker: Broker,
    outbox: Outbox,
    schema: String,
    log: Arc<Log>,
    running: Arc<AtomicBool>,
) {
    match broker {
        Broker::RabbitMq { queue, .. } => {
            let source = consumer::rabbitmq::Source::queue(amqp_url(), &queue);
            consume_from(source, outbox, schema, log, running).await;
        }
        Broker::Nats { stream, prefix } => {
            let source = consumer::nats::Source::durable(nats_url(), &stream, CONSUMER)
                .subject_prefix(prefix);
            consume_from(source, outbox, schema, log, running).await;
        }
    }
}

async fn consume_from<S: consumer::Source>(
    source: S,
    outbox: Outbox,
    schema: String,
    log: Arc<Log>,
    running: Arc<AtomicBool>,
) {
    let effects = format!("{schema}.effects");
    let consumer = Consumer::builder(outbox, common::pool(8).await, "faults")
        .source(Logged { inner: source, log })
        .handler(handler_fn(move |delivery, conn| {
            let effects = effects.clone();
            Box::pin(async move {
                diesel::sql_query(format!("INSERT INTO {effects} VALUES ($1)"))
                    .bind::<Text, _>(&delivery.key)
                    .execute(conn)
                    .await
                    .map_err(HandleError::retry)?;
                Ok(())
            })
        }))
        .concurrency(8)
        .max_deliveries(100)
        .backoff(Duration::from_millis(50), Duration::from_secs(1))
        .build()
        .unwrap();
    consumer
        .run_until(async {
            while AtomicBool::load(&running, Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .unwrap();
}

/// Logs every delivery the runner takes.
struct Logged<S> {
    inner: S,
    log: Arc<Log>,
}

impl<S: consumer::Source> consumer::Source for Logged<S> {
    async fn next(&mut self, prefetch: u16) -> Result<consumer::Incoming, diesel_outbox::BoxError> {
        let incoming = self.inner.next(prefetch).await?;
        let d = &incoming.delivery;
        let body: serde_json::Value = serde_json::from_slice(&d.payload).unwrap_or_default();
        self.log.deliveries.lock().unwrap().push(Delivery {
            key: d.key.clone(),
            aggregate: body["aggregate"].as_str().unwrap_or_default().to_owned(),
            seq: body["seq"].as_i64().unwrap_or_default(),
            attempt: i64::from(d.attempt),
            redelivered: d.redelivered,
        });
        Ok(incoming)
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

/// The durable JetStream consumer's name.
const CONSUMER: &str = "faults";

/// The broker side of one run: durable destinations that survive the broker's restart.
#[derive(Clone)]
enum Broker {
    RabbitMq { exchange: String, queue: String },
    Nats { stream: String, prefix: String },
}

impl Broker {
    async fn new(kind: Kind) -> Broker {
        let name = common::unique("faults");
        match kind {
            Kind::RabbitMq => {
                let amqp = common::broker::connect().await;
                let channel = amqp.create_channel().await.unwrap();
                common::broker::declare(&channel, &name, &name, true, "#", FieldTable::default())
                    .await;
                let _ = amqp.close(200, "declared".into()).await;
                Broker::RabbitMq {
                    exchange: name.clone(),
                    queue: name,
                }
            }
            Kind::Nats => {
                use async_nats::jetstream::{self, consumer, stream};
                let js = jetstream::new(common::nats::connect().await);
                let stream_name = name.to_uppercase();
                let prefix = format!("{name}.");
                let created = js
                    .create_stream(stream::Config {
                        name: stream_name.clone(),
                        subjects: vec![format!("{prefix}>")],
                        storage: stream::StorageType::File,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                created
                    .create_consumer(consumer::pull::Config {
                        durable_name: Some(CONSUMER.into()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        ack_wait: Duration::from_secs(5),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                Broker::Nats {
                    stream: stream_name,
                    prefix,
                }
            }
        }
    }

    /// Where the fault proxy forwards to.
    fn upstream(&self) -> std::net::SocketAddr {
        let authority = match self {
            Broker::RabbitMq { .. } => amqp_authority(),
            Broker::Nats { .. } => nats_url().trim_start_matches("nats://").to_owned(),
        };
        authority.to_socket_addrs().unwrap().next().unwrap()
    }

    fn relay_args(&self) -> Vec<String> {
        let args: Vec<&str> = match self {
            Broker::RabbitMq { exchange, .. } => vec!["--exchange", exchange],
            Broker::Nats { prefix, .. } => vec!["--broker", "nats", "--subject-prefix", prefix],
        };
        args.into_iter().map(str::to_owned).collect()
    }

    /// The broker URL the relays get: through the fault proxy.
    fn relay_env(&self, proxy: std::net::SocketAddr) -> (String, String) {
        match self {
            Broker::RabbitMq { .. } => ("AMQP_URL".into(), amqp_url_via(proxy)),
            Broker::Nats { .. } => ("NATS_URL".into(), format!("nats://{proxy}")),
        }
    }

    fn stop(&self) {
        match self {
            Broker::RabbitMq { .. } => rabbitmqctl(&["stop_app"]),
            Broker::Nats { .. } => nats_server("--stop", &["--retry", "TERM/10/KILL/5"]),
        }
    }

    fn start(&self) {
        match self {
            Broker::RabbitMq { .. } => rabbitmqctl(&["start_app"]),
            Broker::Nats { .. } => {
                nats_server(
                    "--start",
                    &[
                        "--oknodo",
                        "--background",
                        "--",
                        "-a",
                        "127.0.0.1",
                        "-p",
                        "4222",
                        "-js",
                        "-sd",
                        "/var/lib/nats-server",
                        "-l",
                        "/var/log/nats-server.log",
                    ],
                );
                let deadline = Instant::now() + Duration::from_secs(30);
                while std::net::TcpStream::connect(self.upstream()).is_err() {
                    assert!(Instant::now() < deadline, "nats-server did not come back");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// Messages not yet consumed: ready, or delivered and not acknowledged.
    async fn depth(&self) -> u64 {
        match self {
            Broker::RabbitMq { queue, .. } => queue_depth(queue),
            Broker::Nats { stream, .. } => {
                let js = async_nats::jetstream::new(common::nats::connect().await);
                let mut consumer: async_nats::jetstream::consumer::PullConsumer =
                    js.get_consumer_from_stream(CONSUMER, stream).await.unwrap();
                let info = consumer.info().await.unwrap();
                info.num_pending + info.num_ack_pending as u64
            }
        }
    }

    async fn delete(&self) {
        match self {
            Broker::RabbitMq { exchange, queue } => {
                let amqp = common::broker::connect().await;
                let channel = amqp.create_channel().await.unwrap();
                let _ = channel
                    .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel
                    .exchange_delete(exchange.as_str().into(), Default::default())
                    .await;
            }
            Broker::Nats { stream, .. } => {
                let js = async_nats::jetstream::new(common::nats::connect().await);
                let _ = js.delete_stream(stream).await;
            }
        }
    }
}

/// Runs `start-stop-daemon` on the local nats-server; panics if it fails.
fn nats_server(action: &str, args: &[&str]) {
    let status = Command::new("start-stop-daemon")
        .arg(action)
        .args(["--exec", "/usr/sbin/nats-server"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start-stop-daemon");
    assert!(
        status.success(),
        "start-stop-daemon {action} nats-server failed"
    );
}

/// Messages in `queue`, ready or delivered but not yet acknowledged.
fn queue_depth(queue: &str) -> u64 {
    let out = Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages",
        ])
        .output()
        .expect("rabbitmqctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .and_then(|(_, n)| n.trim().parse().ok())
        .expect("the queue is listed")
}

/// Restores the broker's memory watermark when dropped, so a failing test cannot leave the
/// broker blocking every publisher.
struct Watermark(String);

impl Watermark {
    /// Sets the memory high watermark to 0, which raises the memory alarm at once: the
    /// broker blocks every connection that publishes.
    fn raise_alarm() -> Watermark {
        let status = Command::new("rabbitmqctl")
            .arg("status")
            .output()
            .expect("rabbitmqctl");
        let text = String::from_utf8_lossy(&status.stdout);
        // "Memory high watermark setting: 0.4 of available memory, computed to: ..."
        let current = text
            .lines()
            .find_map(|l| l.strip_prefix("Memory high watermark setting: "))
            .and_then(|rest| rest.split(' ').next())
            .filter(|v| v.parse::<f64>().is_ok_and(|v| v > 0.0))
            .unwrap_or("0.4")
            .to_owned();
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]);
        Watermark(current)
    }
}

impl Drop for Watermark {
    fn drop(&mut self) {
        rabbitmqctl(&["set_vm_memory_high_watermark", &self.0]);
    }
}

/// A broker that blocks its publishers (a resource alarm) is an outage like a broker that
/// is down: nothing is charged an attempt, `stats` shows the relay blocked, and everything
/// goes out once the alarm clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_blocked_by_a_resource_alarm_spends_no_attempts() {
    use diesel_outbox::rabbitmq::RabbitMqPublisher;
    if !local_tools("a_connection_blocked_by_a_resource_alarm", Kind::RabbitMq) {
        return;
    }
    let _serial = SERIAL.lock().await;
    let schema = TestSchema::new().await;
    let outbox = Outbox::builder()
        .table(schema.table("outbox"))
        .build()
        .unwrap();
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    let broker = common::broker::TestBroker::new("#").await;
    let publisher = RabbitMqPublisher::builder(amqp_url(), &broker.exchange)
        .confirm_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let relay = outbox
        .relay(common::pool(3).await, publisher)
        .max_attempts(2)
        .backoff(Duration::from_millis(20), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let (stop, task) = common::spawn_relay(relay);

    let alarm = Watermark::raise_alarm();
    for i in 0..20 {
        outbox
            .enqueue(&mut conn, Message::new("t", "x").key(format!("k{i:02}")))
            .await
            .unwrap();
    }
    // Ten times max_attempts × backoff max, and then some.
    let blocked_until = Instant::now() + Duration::from_secs(4);
    let mut blocked_seen = false;
    while Instant::now() < blocked_until {
        let stats = outbox.stats(&mut conn).await.unwrap();
        assert_eq!(
            stats.dead, 0,
            "a dead letter while the broker blocks publishers"
        );
        blocked_seen |= stats.blocked_for.is_some();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(blocked_seen, "stats never showed the relay blocked");
    drop(alarm);

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = outbox.stats(&mut conn).await.unwrap();
        if stats.sent == 20 {
            assert_eq!(stats.dead, 0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not drained after the alarm: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let charged: N = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM {} WHERE attempts <> 1",
        outbox.table()
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(charged.n, 0, "every message sent on its first attempt");
    common::stop_relay(stop, task).await;
}
