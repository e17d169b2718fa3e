//! The consumer runner against the real RabbitMQ and PostgreSQL.
#![cfg(feature = "rabbitmq")]

mod common;

use common::Alone;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::broker::{SharedQueue, amqp_url};
use common::{DEADLINE, TestSchema, eventually, spawn_consumer, stop_relay};
use diesel::QueryableByName;
use diesel::sql_types::{Integer, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{
    Consumer, Delivery, HandleError, Handler, Incoming, Settle, Source, handler_fn, rabbitmq,
};
use diesel_outbox::{BoxError, Consumed, Error, Metrics, Outbox, PgPool};
use futures_util::future::BoxFuture;
use tokio::time::Instant;

/// A schema with a migrated outbox (for its inbox) and an `effects` table.
struct Setup {
    schema: TestSchema,
    outbox: Outbox,
    pool: PgPool,
    broker: SharedQueue,
}

impl Setup {
    async fn new() -> Setup {
        let schema = TestSchema::new().await;
        let outbox = Outbox::builder()
            .table(schema.table("outbox"))
            .build()
            .unwrap();
        let mut conn = common::connect().await;
        outbox.migrate(&mut conn).await.unwrap();
        conn.batch_execute(&format!(
            "CREATE TABLE {}.effects (id bigserial PRIMARY KEY, key text NOT NULL, \
             aggregate text, seq integer)",
            schema.name
        ))
        .await
        .unwrap();
        Setup {
            schema,
            outbox,
            pool: common::pool(10).await,
            broker: SharedQueue::new().await,
        }
    }

    fn source(&self) -> rabbitmq::Source {
        rabbitmq::Source::queue(amqp_url(), &self.broker.queue)
    }

    /// Effects as (key, aggregate, seq), in the order they were written.
    async fn effects(&self) -> Vec<(String, Option<String>, Option<i32>)> {
        #[derive(QueryableByName)]
        struct Effect {
            #[diesel(sql_type = Text)]
            key: String,
            #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
            aggregate: Option<String>,
            #[diesel(sql_type = diesel::sql_types::Nullable<Integer>)]
            seq: Option<i32>,
        }
        let mut conn = self.pool.get().await.unwrap();
        diesel::sql_query(format!(
            "SELECT key, aggregate, seq FROM {}.effects ORDER BY id",
            self.schema.name
        ))
        .load::<Effect>(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.key, e.aggregate, e.seq))
        .collect()
    }

    /// Waits until no delivery is left ready in the queue (the consumer took them all;
    /// the ones it has not acked are counted after it stops).
    async fn wait_queue_empty(&self) {
        eventually(DEADLINE, "the queue emptied", || async {
            (self.broker.ready(&self.broker.queue).await == 0).then_some(())
        })
        .await;
    }

    async fn wait_effects(&self, n: usize) {
        eventually(DEADLINE, &format!("{n} effects"), || async {
            (self.effects().await.len() >= n).then_some(())
        })
        .await;
    }

    /// A handler that writes one effect per delivery (`seq` from the payload, if numeric)
    /// and counts its runs.
    fn writer(&self, runs: Arc<AtomicUsize>) -> impl Handler {
        let effects = format!("{}.effects", self.schema.name);
        handler_fn(move |delivery, conn| {
            let (effects, runs) = (effects.clone(), runs.clone());
            Box::pin(async move {
                runs.fetch_add(1, Ordering::SeqCst);
                let seq: Option<i32> = std::str::from_utf8(&delivery.payload)
                    .ok()
                    .and_then(|p| p.parse().ok());
                diesel::sql_query(format!(
                    "INSERT INTO {effects} (key, aggregate, seq) VALUES ($1, $2, $3)"
                ))
                .bind::<Text, _>(&delivery.key)
                .bind::<diesel::sql_types::Nullable<Text>, _>(&delivery.aggregate_key)
                .bind::<diesel::sql_types::Nullable<Integer>, _>(seq)
                .execute(conn)
                .await
                .map_err(HandleError::retry)?;
                Ok(())
            })
        })
    }
}

#[tokio::test]
async fn each_message_has_one_effect_and_duplicates_are_acked_without_the_handler() {
    let s = Setup::new().await;
    for i in 0..10 {
        s.broker
            .publish(&format!("k{i}"), "order.created", b"x", None)
            .await;
    }
    // The relay publishes again after a crash: the same keys, delivered twice.
    for i in 0..3 {
        s.broker
            .publish(&format!("k{i}"), "order.created", b"x", None)
            .await;
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(s.writer(runs.clone()))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    s.wait_effects(10).await;
    s.wait_queue_empty().await;
    stop_relay(tx, task).await;

    let mut keys: Vec<String> = s.effects().await.into_iter().map(|e| e.0).collect();
    keys.sort();
    let want: Vec<String> = {
        let mut w: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
        w.sort();
        w
    };
    assert_eq!(keys, want, "one effect per key");
    assert_eq!(
        AtomicUsize::load(&runs, Ordering::SeqCst),
        10,
        "duplicates never reach the handler"
    );
    assert_eq!(
        s.broker.ready(&s.broker.queue).await,
        0,
        "nothing left after the stop"
    );
    assert_eq!(s.broker.ready(&s.broker.dead_letters).await, 0);
}

/// A source that commits but "crashes" before the acknowledgement: it never acks, and
/// says when it would have.
struct CrashBeforeAck {
    inner: rabbitmq::Source,
    crashed: Arc<AtomicBool>,
}

struct NeverAck(Arc<AtomicBool>, Box<dyn Settle>);

impl Settle for NeverAck {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        self.0.store(true, Ordering::SeqCst);
        // The acker is dropped unused: the message stays unacknowledged until the channel
        // closes, as after a crash.
        drop(self.1);
        Box::pin(async { Ok(()) })
    }

    fn reject(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        self.1.reject()
    }
}

impl Source for CrashBeforeAck {
    async fn next(&mut self, prefetch: u16) -> Result<Incoming, BoxError> {
        let incoming = self.inner.next(prefetch).await?;
        Ok(Incoming {
            delivery: incoming.delivery,
            settle: Box::new(NeverAck(self.crashed.clone(), incoming.settle)),
        })
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_is_redelivered_and_applied_once() {
    let s = Setup::new().await;
    s.broker
        .publish("order-1", "order.created", b"1", None)
        .await;
    let runs = Arc::new(AtomicUsize::new(0));
    let crashed = Arc::new(AtomicBool::new(false));
    let first = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(CrashBeforeAck {
            inner: s.source(),
            crashed: crashed.clone(),
        })
        .handler(s.writer(runs.clone()))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(first);
    eventually(DEADLINE, "the commit, then the crash", || async {
        AtomicBool::load(&crashed, Ordering::SeqCst).then_some(())
    })
    .await;
    // The crashed runner's connection goes: the broker delivers the message again.
    stop_relay(tx, task).await;
    assert_eq!(s.effects().await.len(), 1, "committed before the crash");

    let redelivered = Arc::new(Mutex::new(Vec::new()));
    let seen = redelivered.clone();
    let second = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(Recording {
            inner: s.source(),
            seen,
        })
        .handler(s.writer(runs.clone()))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(second);
    eventually(DEADLINE, "the redelivery, acked", || async {
        let got = !redelivered.lock().unwrap().is_empty();
        (got && s.broker.ready(&s.broker.queue).await == 0).then_some(())
    })
    .await;
    stop_relay(tx, task).await;
    assert_eq!(
        *redelivered.lock().unwrap(),
        [true],
        "it came again, flagged"
    );
    assert_eq!(s.effects().await.len(), 1, "and changed nothing");
    assert_eq!(
        AtomicUsize::load(&runs, Ordering::SeqCst),
        1,
        "the handler ran once"
    );
    assert_eq!(s.broker.ready(&s.broker.queue).await, 0);
}

/// Notes each delivery's redelivered flag.
struct Recording {
    inner: rabbitmq::Source,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Source for Recording {
    async fn next(&mut self, prefetch: u16) -> Result<Incoming, BoxError> {
        let incoming = self.inner.next(prefetch).await?;
        self.seen
            .lock()
            .unwrap()
            .push(incoming.delivery.redelivered);
        Ok(incoming)
    }

    async fn close(&mut self) {
        self.inner.close().await;
    }
}

#[tokio::test]
async fn a_handler_failing_twice_then_succeeding_applies_once_after_its_backoff() {
    let s = Setup::new().await;
    s.broker.publish("flaky", "t", b"x", None).await;
    let runs = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let effects = format!("{}.effects", s.schema.name);
    let log = runs.clone();
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(handler_fn(move |delivery, conn| {
            let (log, effects) = (log.clone(), effects.clone());
            Box::pin(async move {
                let run = {
                    let mut log = log.lock().unwrap();
                    log.push(Instant::now());
                    log.len()
                };
                // The effect is written every time; the failure rolls it back.
                diesel::sql_query(format!("INSERT INTO {effects} (key) VALUES ($1)"))
                    .bind::<Text, _>(&delivery.key)
                    .execute(conn)
                    .await
                    .map_err(HandleError::retry)?;
                if run < 3 {
                    return Err(HandleError::retry("the invoicing service is down"));
                }
                Ok(())
            })
        }))
        .backoff(Duration::from_millis(200), Duration::from_secs(5))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    s.wait_effects(1).await;
    s.wait_queue_empty().await;
    stop_relay(tx, task).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 3, "three runs");
    assert_eq!(
        s.effects().await.len(),
        1,
        "one effect: the failed runs rolled back"
    );
    assert!(
        runs[1] - runs[0] >= Duration::from_millis(200)
            && runs[2] - runs[1] >= Duration::from_millis(400),
        "capped exponential backoff between runs: {:?}",
        runs.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn poison_goes_to_the_dead_letter_queue_after_max_deliveries_and_a_reject_at_once() {
    let s = Setup::new().await;
    s.broker.publish("poison", "t", b"retry", None).await;
    s.broker.publish("garbage", "t", b"reject", None).await;
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let counted = runs.clone();
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(handler_fn(move |delivery, _conn| {
            let counted = counted.clone();
            Box::pin(async move {
                *counted
                    .lock()
                    .unwrap()
                    .entry(delivery.key.clone())
                    .or_default() += 1;
                if delivery.payload == b"reject" {
                    Err(HandleError::reject("not an order"))
                } else {
                    Err(HandleError::retry("always fails"))
                }
            })
        }))
        .max_deliveries(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    eventually(DEADLINE, "both in the dead-letter queue", || async {
        (s.broker.ready(&s.broker.dead_letters).await == 2).then_some(())
    })
    .await;
    stop_relay(tx, task).await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs["poison"], 3, "max_deliveries runs");
    assert_eq!(runs["garbage"], 1, "a reject is final");
    assert_eq!(s.broker.ready(&s.broker.queue).await, 0);
    assert!(s.effects().await.is_empty());

    // Rejected means not recorded: a redrive of the message would be applied.
    let mut conn = s.pool.get().await.unwrap();
    assert!(
        s.outbox
            .dedupe_alone(&mut conn, "invoicing", "poison")
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn one_aggregate_is_handled_in_order_while_eight_run_at_once() {
    let s = Setup::new().await;
    // Each aggregate's messages come in runs of four, so the eight deliveries the broker
    // hands out at once hold several of one aggregate (which must wait for each other)
    // and of two or three aggregates (which need not).
    let (aggregates, per, run) = (20, 12, 4);
    for first in (0..per).step_by(run) {
        for a in 0..aggregates {
            for seq in first..first + run {
                s.broker
                    .publish(
                        &format!("a{a}-{seq}"),
                        "t",
                        seq.to_string().as_bytes(),
                        Some(&format!("a{a}")),
                    )
                    .await;
            }
        }
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let effects = format!("{}.effects", s.schema.name);
    let (now, peak) = (running.clone(), most.clone());
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(handler_fn(move |delivery, conn| {
            let (now, peak, effects) = (now.clone(), peak.clone(), effects.clone());
            Box::pin(async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                // Uneven work, so that a later delivery could overtake an earlier one.
                tokio::time::sleep(Duration::from_millis(fastrand::u64(1..15))).await;
                let seq: i32 = std::str::from_utf8(&delivery.payload)
                    .unwrap()
                    .parse()
                    .unwrap();
                let result = diesel::sql_query(format!(
                    "INSERT INTO {effects} (key, aggregate, seq) VALUES ($1, $2, $3)"
                ))
                .bind::<Text, _>(&delivery.key)
                .bind::<diesel::sql_types::Nullable<Text>, _>(&delivery.aggregate_key)
                .bind::<Integer, _>(seq)
                .execute(conn)
                .await;
                now.fetch_sub(1, Ordering::SeqCst);
                result.map(|_| ()).map_err(HandleError::retry)
            })
        }))
        .concurrency(8)
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    s.wait_effects(aggregates * per).await;
    stop_relay(tx, task).await;

    let mut by_aggregate: HashMap<String, Vec<i32>> = HashMap::new();
    for (_, aggregate, seq) in s.effects().await {
        by_aggregate
            .entry(aggregate.unwrap())
            .or_default()
            .push(seq.unwrap());
    }
    assert_eq!(by_aggregate.len(), aggregates);
    for (aggregate, seqs) in &by_aggregate {
        let want: Vec<i32> = (0..i32::try_from(per).unwrap()).collect();
        assert_eq!(seqs, &want, "{aggregate} handled in delivery order");
    }
    let peak = AtomicUsize::load(&most, Ordering::SeqCst);
    assert!((2..=8).contains(&peak), "{peak} handlers at once");
}

#[tokio::test]
async fn a_shutdown_mid_stream_loses_nothing_and_applies_nothing_twice() {
    let s = Setup::new().await;
    let n = 200;
    for i in 0..n {
        s.broker.publish(&format!("m{i}"), "t", b"x", None).await;
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let slow = {
        let effects = format!("{}.effects", s.schema.name);
        let runs = runs.clone();
        move || {
            let (effects, runs) = (effects.clone(), runs.clone());
            handler_fn(move |delivery: &Delivery, conn| {
                let (effects, runs) = (effects.clone(), runs.clone());
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    diesel::sql_query(format!("INSERT INTO {effects} (key) VALUES ($1)"))
                        .bind::<Text, _>(&delivery.key)
                        .execute(conn)
                        .await
                        .map_err(HandleError::retry)?;
                    Ok(())
                })
            })
        }
    };
    let first = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(slow())
        .concurrency(8)
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(first);
    s.wait_effects(n / 4).await;
    stop_relay(tx, task).await;
    let after_first = s.effects().await.len();
    assert!(after_first < n, "stopped mid-stream ({after_first} of {n})");

    let tally = Tally::default();
    let second = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(slow())
        .concurrency(8)
        .metrics(tally.clone())
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(second);
    s.wait_effects(n).await;
    s.wait_queue_empty().await;
    stop_relay(tx, task).await;
    let mut keys: Vec<String> = s.effects().await.into_iter().map(|e| e.0).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), n, "every message applied");
    assert_eq!(s.effects().await.len(), n, "none applied twice");
    // What the first runner committed it acknowledged too: only deliveries cut between
    // the commit and the ack come again (at most one per handler at once).
    let duplicates = tally.get(Consumed::Duplicate);
    assert!(
        duplicates <= 8,
        "{duplicates} committed deliveries came again"
    );
}

/// Counts the runner's results.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<HashMap<Consumed, u64>>>);

impl Tally {
    fn get(&self, result: Consumed) -> u64 {
        self.0.lock().unwrap().get(&result).copied().unwrap_or(0)
    }
}

impl Metrics for Tally {
    fn consumed(&self, _: &str, result: Consumed) {
        *self.0.lock().unwrap().entry(result).or_default() += 1;
    }
}

#[tokio::test]
async fn a_panicking_a_hung_or_an_error_swallowing_handler_costs_a_run_not_the_consumer() {
    let s = Setup::new().await;
    // Three of one aggregate, so that a wedged aggregate would show, and one on its own.
    for key in ["panics", "hangs", "swallows"] {
        s.broker.publish(key, "t", b"x", Some("one")).await;
    }
    s.broker.publish("plain", "t", b"x", None).await;
    let runs: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let effects = format!("{}.effects", s.schema.name);
    let counted = runs.clone();
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(handler_fn(move |delivery, conn| {
            let (counted, effects) = (counted.clone(), effects.clone());
            Box::pin(async move {
                let run = {
                    let mut runs = counted.lock().unwrap();
                    let run = runs.entry(delivery.key.clone()).or_default();
                    *run += 1;
                    *run
                };
                diesel::sql_query(format!("INSERT INTO {effects} (key) VALUES ($1)"))
                    .bind::<Text, _>(&delivery.key)
                    .execute(conn)
                    .await
                    .map_err(HandleError::retry)?;
                if run == 1 {
                    match delivery.key.as_str() {
                        "panics" => panic!("a bug in the handler"),
                        "hangs" => tokio::time::sleep(Duration::from_secs(3600)).await,
                        "swallows" => {
                            // A failing statement whose error the handler ignores.
                            let _ = diesel::sql_query("SELECT 1/0").execute(conn).await;
                        }
                        _ => {}
                    }
                }
                Ok(())
            })
        }))
        .handler_timeout(Duration::from_secs(1))
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    s.wait_effects(4).await;
    s.wait_queue_empty().await;
    stop_relay(tx, task).await;
    let mut keys: Vec<String> = s.effects().await.into_iter().map(|e| e.0).collect();
    keys.sort();
    assert_eq!(
        keys,
        ["hangs", "panics", "plain", "swallows"],
        "one effect each"
    );
    let runs = runs.lock().unwrap().clone();
    for key in ["panics", "hangs", "swallows"] {
        assert_eq!(runs[key], 2, "{key}: its first run failed and rolled back");
    }
    // "plain" runs beside "panics", and a panic hook runs on the thread it panicked on:
    // with RUST_BACKTRACE set, the first one resolves the backtrace's symbols, which on a
    // loaded machine takes longer than the handler timeout. Then "plain" is cut off too
    // and runs again: a second run, never a second effect (checked above), never a reject.
    assert!(runs["plain"] >= 1);
    assert_eq!(s.broker.ready(&s.broker.dead_letters).await, 0);
}

#[tokio::test]
async fn bad_settings_are_rejected_at_build_without_the_password() {
    let s = Setup::new().await;
    let build = |configure: fn(
        diesel_outbox::consumer::ConsumerBuilder<rabbitmq::Source, _>,
    )
        -> diesel_outbox::consumer::ConsumerBuilder<rabbitmq::Source, _>| {
        configure(
            Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
                .source(s.source())
                .handler(s.writer(Arc::default())),
        )
        .build()
        .map(|_| ())
    };
    for (what, result) in [
        ("concurrency 0", build(|b| b.concurrency(0))),
        ("max_deliveries 0", build(|b| b.max_deliveries(0))),
        (
            "backoff min > max",
            build(|b| b.backoff(Duration::from_secs(2), Duration::from_secs(1))),
        ),
    ] {
        assert!(
            matches!(result, Err(Error::InvalidOption(_))),
            "{what}: {result:?}"
        );
    }
    let err = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(rabbitmq::Source::queue("amqp://u:hunter2@[bad", "q"))
        .handler(s.writer(Arc::default()))
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOption(_)), "{err:?}");
    assert!(!err.to_string().contains("hunter2"), "{err}");
    let unnamed = Consumer::builder(s.outbox.clone(), s.pool.clone(), "")
        .source(s.source())
        .handler(s.writer(Arc::default()))
        .build();
    assert!(matches!(unnamed, Err(Error::InvalidOption(_))));
}

#[tokio::test]
async fn a_missing_inbox_table_stops_the_consumer_at_start() {
    let s = Setup::new().await;
    let missing = Outbox::builder()
        .table(s.schema.table("never_migrated"))
        .build()
        .unwrap();
    let consumer = Consumer::builder(missing, s.pool.clone(), "invoicing")
        .source(s.source())
        .handler(s.writer(Arc::default()))
        .build()
        .unwrap();
    let err = tokio::time::timeout(DEADLINE, consumer.run_until(std::future::pending()))
        .await
        .expect("returned at once")
        .unwrap_err();
    assert!(matches!(err, Error::NotMigrated { .. }), "{err:?}");
}

#[test]
fn a_delivery_decodes_json_and_hides_its_payload() {
    #[derive(Debug, serde::Deserialize)]
    struct Order {
        id: i64,
    }
    let delivery = Delivery::new("k", "order.created", r#"{"id":42}"#);
    assert_eq!(delivery.json::<Order>().unwrap().id, 42);
    assert!(!format!("{delivery:?}").contains("42"));
    let personal = Delivery::new("k", "order.created", r#"{"id":"ada@example.com"}"#);
    let err = personal.json::<Order>().unwrap_err().to_string();
    assert!(
        err.contains("another shape") && err.contains("Order"),
        "{err}"
    );
    assert!(
        !err.contains("ada@example.com"),
        "the error quotes no payload: {err}"
    );
}

/// A queue that does not exist fails the runner at once, naming it: no retry would mend it.
#[tokio::test]
async fn a_missing_queue_fails_the_runner_at_once() {
    let s = Setup::new().await;
    let missing = common::unique("missing");
    let consumer = Consumer::builder(s.outbox.clone(), s.pool.clone(), "invoicing")
        .source(rabbitmq::Source::queue(
            common::broker::amqp_url(),
            &missing,
        ))
        .handler(s.writer(Arc::default()))
        .build()
        .unwrap();
    let err = common::start_error(consumer).await;
    assert!(
        matches!(&err, Error::NotDeclared(m) if m.contains(&format!("queue `{missing}` does not exist"))),
        "{err:?}"
    );
}
