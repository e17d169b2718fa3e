//! The mixed run: writers, three relay processes and the consumer runner on one broker,
//! while relays are killed, paused beyond their lease and cut off from PostgreSQL, the
//! broker's connections are cut, the broker is restarted and stopped for longer than
//! `max_attempts × backoff max`, PostgreSQL is restarted, and poison rows are written by SQL.

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use diesel_outbox::{Message, Outbox};

use crate::broker::{Broker, consume};
use crate::common::broker::{amqp_url, rabbitmqctl};
use crate::common::{self, Alone, TestSchema};
use crate::harness::{self, Db, LEASE, Log, RELAYS, Relays, Run, TOPIC, Tier};
use crate::{Kind, SERIAL, local_tools};

/// Longer than `MAX_ATTEMPTS × BACKOFF_MAX`: were an outage charged to the messages, every
/// one of them would be dead by the end of it.
const BROKER_DOWN: Duration = Duration::from_secs(8);

pub(crate) async fn run(kind: Kind, tier: Tier) {
    let started = Instant::now();
    let schema = TestSchema::new().await;
    let db = Db::create(common::database_url(), &schema.name, tier.aggregates).await;
    let table = db.table().to_owned();

    let (broker, proxy) = Broker::new(kind).await;
    let app_name = format!("outbox_fault_relay_{}", schema.name);
    let logs = std::env::temp_dir().join(&schema.name);
    let mut relays = Relays::start(
        &db,
        common::with_application_name(&common::database_url(), &app_name),
        &broker,
        proxy.addr,
        Duration::from_millis(200),
        LEASE,
        logs.clone(),
    );

    let log = Arc::new(Log::default());
    let consuming = Arc::new(AtomicBool::new(true));
    let consumer = tokio::spawn(consume(
        broker.clone(),
        db.clone(),
        log.clone(),
        consuming.clone(),
    ));
    let writers = harness::spawn_writers(&db, &log, &tier);

    // Faults, round-robin over the kinds, until the writers are done.
    let (broker_down, broker_bounced) = broker.outage_faults();
    let fault_kinds = [
        "relay SIGKILL",
        "poison rows",
        "relay SIGSTOP beyond lease",
        "relay backends terminated",
        "broker connections cut",
        broker_bounced,
        broker_down,
        "PostgreSQL restart",
    ];
    let mut round = 0usize;
    let mut admin = db.connect().await;
    let mut poison: Vec<String> = Vec::new();
    while writers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(tier.fault_every).await;
        let fault = fault_kinds[round % fault_kinds.len()];
        round += 1;
        let fired = log.fired(fault);
        match fault {
            "poison rows" => {
                for _ in 0..POISON_KINDS {
                    let key =
                        write_poison(&mut admin, &table, kind, poison.len(), tier.aggregates).await;
                    poison.push(key);
                }
                log.fault(fault);
            }
            _ if fault == broker_down => {
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
                admin = db.connect().await;
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
            _ if fault == broker_bounced => {
                if fired > 0 {
                    continue; // once per run
                }
                broker.bounce().await;
                log.fault(fault);
            }
            _ => unreachable!(),
        }
    }
    for w in writers {
        w.await.unwrap();
    }

    // Faults stop; everything must drain.
    relays.revive();
    let drained_in = harness::wait_drained(&db, &log, &broker, harness::Durability::Every).await;
    relays.stop_all();
    // Every publish is confirmed by now, late duplicates of stale relays included.
    broker.wait_consumed().await;
    consuming.store(false, Ordering::SeqCst);
    consumer.await.unwrap();

    let fenced = harness::check(Run {
        label: format!("{kind:?}"),
        durability: harness::Durability::Every,
        db: &db,
        log: &log,
        relays: &relays,
        poison: &poison,
        started,
        drained_in,
    })
    .await;
    let faults = log.faults.lock().unwrap().clone();
    for fault in fault_kinds {
        assert!(
            faults.get(fault).copied().unwrap_or(0) > 0,
            "fault never fired: {fault}"
        );
    }
    // On the log engine a paused relay may have had nothing to discard (its pages cut
    // short by the broker's outage): the cursor taken from it is its fencing.
    let takeovers = relays.cursor_takeovers();
    assert!(
        fenced > 0 || (common::engine() == diesel_outbox::Engine::Log && takeovers > 0),
        "pauses ran but no stale relay was fenced ({takeovers} cursor takeovers)"
    );

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
    let takeovers = relays.cursor_takeovers();
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
    // On the log engine the cursor is what a paused relay holds (its rows carry no lease):
    // it must be taken over too before the paused ones resume, or the one that held it
    // simply carries on.
    if common::engine() == diesel_outbox::Engine::Log {
        while relays.cursor_takeovers() == takeovers && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for slot in 0..RELAYS {
        relays.signal(slot, "-CONT");
    }
    relays.signal(RELAYS, "-TERM");
    if let Some(mut spare) = relays.slots[RELAYS].take() {
        let _ = spare.wait();
    }
}

fn restart_postgres() {
    pg_ctlcluster("restart");
}

/// Runs `pg_ctlcluster <version> main <action>` on the local cluster (`start`, `stop`,
/// `restart`), panicking if it fails.
pub(crate) fn pg_ctlcluster(action: &str) {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("a local PostgreSQL cluster")
        .flatten()
        .next()
        .expect("a cluster version")
        .file_name();
    let status = Command::new("pg_ctlcluster")
        .args(["--skip-systemctl-redirect"])
        .arg(&version)
        .args(["main", action])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster {action} failed");
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
    // What the broker refuses of a message: RabbitMQ routes on a `CC` header, JetStream
    // acts on `Nats-` headers (`Nats-Rollup` would purge the stream), Kafka refuses a
    // topic name with a `/`.
    let (refused, refused_headers, refused_topic) = match broker {
        Kind::RabbitMq => ("refused-header", "'{\"CC\": \"elsewhere\"}'::jsonb", TOPIC),
        Kind::Nats => (
            "refused-header",
            "'{\"Nats-Rollup\": \"all\"}'::jsonb",
            TOPIC,
        ),
        Kind::Kafka => ("refused-topic", "'{}'::jsonb", "fault/order"),
    };
    let kinds: [(&str, &str, &str, &str); POISON_KINDS] = [
        ("huge-number", "'{\"n\": 1e400}'::jsonb", "now()", TOPIC),
        ("infinite", "'{}'::jsonb", "'infinity'", TOPIC),
        // Over RabbitMQ's frame_max (128 KiB), NATS's max_payload (1 MiB) and librdkafka's
        // message.max.bytes (1,000,000).
        (
            "oversized-headers",
            "jsonb_build_object('h', repeat('x', 1100000))",
            "now()",
            TOPIC,
        ),
        (refused, refused_headers, "now()", refused_topic),
    ];
    let (kind, headers, created_at, topic) = kinds[n % kinds.len()];
    let key = format!("poison-{kind}-{n}");
    let aggregate = format!("agg{}", fastrand::usize(1..=aggregates));
    diesel::sql_query(format!(
        "INSERT INTO {table} (idempotency_key, topic, aggregate_key, payload, headers, created_at) \
         VALUES ($1, $3, $2, '\\x00'::bytea, {headers}, {created_at})"
    ))
    .bind::<Text, _>(&key)
    .bind::<Text, _>(&aggregate)
    .bind::<Text, _>(topic)
    .execute(conn)
    .await
    .unwrap();
    key
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
    // The short confirm timeout also bounds the handshake, which a loaded machine can
    // overrun: connecting is not what this test is about.
    let publisher =
        common::eventually(Duration::from_secs(30), "a connected publisher", || async {
            RabbitMqPublisher::builder(amqp_url(), &broker.exchange)
                .confirm_timeout(Duration::from_secs(1))
                .connect()
                .await
                .ok()
        })
        .await;
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
            .enqueue_alone(&mut conn, Message::new("t", "x").key(format!("k{i:02}")))
            .await
            .unwrap();
    }
    // Ten times max_attempts × backoff max, and then some; and on until the relay is seen
    // blocked (on a loaded machine its report can take seconds to reach the table).
    let blocked_until = Instant::now() + Duration::from_secs(4);
    let give_up = Instant::now() + Duration::from_secs(60);
    let mut blocked_seen = false;
    while Instant::now() < blocked_until || !blocked_seen {
        assert!(
            Instant::now() < give_up,
            "stats never showed the relay blocked"
        );
        let stats = outbox.stats(&mut conn).await.unwrap();
        assert_eq!(
            stats.dead, 0,
            "a dead letter while the broker blocks publishers"
        );
        blocked_seen |= stats.blocked_for.is_some();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
