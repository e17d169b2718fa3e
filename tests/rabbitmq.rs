//! The RabbitMQ publisher against the real broker and PostgreSQL.
#![cfg(feature = "rabbitmq")]

mod common;

use common::Alone;

use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::broker::{TestBroker, amqp_authority, amqp_url, amqp_url_via, message_id, next};
use common::proxy::FaultProxy;
use common::{DEADLINE, eventually, fixture, spawn_relay, stop_relay};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Timestamptz};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Message, PublishError, Publisher, Record};
use lapin::types::{AMQPValue, FieldTable, LongString};

const QUIET: Duration = Duration::from_millis(500);

/// A fault proxy in front of the broker, and a publisher to `exchange` through it.
async fn proxied(exchange: &str) -> (FaultProxy, RabbitMqPublisher) {
    let upstream = amqp_authority().to_socket_addrs().unwrap().next().unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let publisher = RabbitMqPublisher::builder(amqp_url_via(proxy.addr), exchange)
        .confirm_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    (proxy, publisher)
}

async fn publisher(exchange: &str) -> RabbitMqPublisher {
    RabbitMqPublisher::builder(amqp_url(), exchange)
        .confirm_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap()
}

fn header<'a>(delivery: &'a lapin::message::Delivery, name: &str) -> Option<&'a AMQPValue> {
    delivery.properties.headers().as_ref()?.inner().get(name)
}

#[tokio::test]
async fn every_property_and_header_arrives_as_specified() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    f.outbox
        .enqueue_alone(
            &mut f.conn,
            Message::new("order.created", "the body")
                .key("order-1-created")
                .aggregate_key("order-1")
                .content_type("text/plain")
                .header("tenant", "acme"),
        )
        .await
        .unwrap();
    #[derive(QueryableByName)]
    struct Created {
        #[diesel(sql_type = Timestamptz)]
        created_at: DateTime<Utc>,
    }
    let created: Created =
        diesel::sql_query(format!("SELECT created_at FROM {}", f.outbox.table()))
            .get_result(&mut f.conn)
            .await
            .unwrap();

    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1);
    assert_eq!(f.count("status = 'sent'").await, 1);

    let d = next(&mut consumer, DEADLINE).await.expect("delivered");
    assert_eq!(message_id(&d), "order-1-created");
    assert_eq!(d.routing_key.as_str(), "order.created");
    assert_eq!(d.exchange.as_str(), broker.exchange);
    assert_eq!(d.data, b"the body");
    assert_eq!(
        d.properties.content_type().as_ref().map(|c| c.as_str()),
        Some("text/plain")
    );
    assert_eq!(*d.properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        *d.properties.timestamp(),
        Some(created.created_at.timestamp() as u64)
    );
    assert_eq!(
        header(&d, "x-outbox-attempt"),
        Some(&AMQPValue::LongLongInt(1))
    );
    assert_eq!(
        header(&d, "x-outbox-aggregate-key"),
        Some(&AMQPValue::LongString(LongString::from(
            "order-1".as_bytes()
        )))
    );
    assert_eq!(
        header(&d, "tenant"),
        Some(&AMQPValue::LongString(LongString::from("acme".as_bytes())))
    );
}

#[tokio::test]
async fn unroutable_with_mandatory_is_retried_then_dead_never_sent() {
    let mut f = fixture().await;
    let broker = TestBroker::new("bound.only").await;
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("nowhere", "x").key("lost"))
        .await
        .unwrap();
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("bound.only", "y").key("routed"))
        .await
        .unwrap();
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .max_attempts(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(20))
        .poll_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while f.count("status = 'dead'").await == 0 {
        assert!(tokio::time::Instant::now() < deadline);
        relay.run_once().await.unwrap();
        assert_eq!(
            f.count("idempotency_key = 'lost' AND status = 'sent'")
                .await,
            0,
            "an unroutable message is never marked sent"
        );
    }
    assert_eq!(
        f.count("idempotency_key = 'lost' AND status = 'dead' AND attempts = 3 AND last_error LIKE '%unroutable%'")
            .await,
        1
    );
    assert_eq!(
        f.count("idempotency_key = 'routed' AND status = 'sent'")
            .await,
        1,
        "the routable neighbour is sent"
    );
}

#[tokio::test]
async fn a_nack_is_not_marked_sent() {
    let mut f = fixture().await;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongInt(1));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from("reject-publish".as_bytes())),
    );
    let broker = TestBroker::with_queue_args("#", args).await;
    let msgs = (0..3)
        .map(|i| Message::new("t", "x").key(format!("k{i}")))
        .collect();
    f.outbox
        .enqueue_many_alone(&mut f.conn, msgs)
        .await
        .unwrap();
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 3);
    assert_eq!(f.count("status = 'sent'").await, 1, "the queue holds one");
    assert_eq!(
        f.count("status = 'pending' AND last_error LIKE '%nacked%'")
            .await,
        2
    );
}

#[tokio::test]
async fn the_relay_recovers_after_the_broker_connection_is_cut() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let (proxy, publisher) = proxied(&broker.exchange).await;
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .backoff(Duration::from_millis(20), Duration::from_millis(100))
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);

    let mut expected = Vec::new();
    for round in 0..3 {
        for i in 0..20 {
            let key = format!("r{round}-{i:02}");
            f.outbox
                .enqueue_alone(&mut f.conn, Message::new("t", "x").key(key.clone()))
                .await
                .unwrap();
            expected.push(key);
        }
        assert!(
            proxy.cut() > 0 || round > 0,
            "the publisher's connection was cut"
        );
    }
    f.wait_rows("status = 'sent'", 60).await;
    stop_relay(stop, task).await;

    let mut received = Vec::new();
    while let Some(d) = next(&mut consumer, QUIET).await {
        received.push(message_id(&d));
    }
    received.sort();
    received.dedup();
    assert_eq!(received, expected, "every message arrived");
}

#[tokio::test]
async fn end_to_end_committed_arrives_and_rolled_back_never() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let outbox = f.outbox.clone();
    f.conn
        .transaction(async |c| {
            outbox
                .enqueue(c, Message::new("t", "1").key("committed"))
                .await
        })
        .await
        .unwrap();
    let rolled_back = f
        .conn
        .transaction(async |c| {
            outbox
                .enqueue(c, Message::new("t", "2").key("rolled-back"))
                .await?;
            Err::<(), _>(Error::InvalidMessage("rollback".into()))
        })
        .await;
    assert!(rolled_back.is_err());
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("t", "3").key("marker"))
        .await
        .unwrap();

    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    relay.run_once().await.unwrap();
    let mut received = Vec::new();
    while let Some(d) = next(&mut consumer, QUIET).await {
        received.push(message_id(&d));
    }
    assert_eq!(received, vec!["committed", "marker"]);
}

/// Publishes through RabbitMQ, then never returns: the relay "crashes" between the
/// broker's confirm and marking the row sent.
struct CrashAfterPublish {
    inner: RabbitMqPublisher,
    published: Arc<AtomicUsize>,
}

impl Publisher for CrashAfterPublish {
    async fn publish(&self, record: &Record) -> Result<(), PublishError> {
        self.inner.publish(record).await?;
        self.published.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
}

#[tokio::test]
async fn a_crash_between_publish_and_mark_delivers_twice_and_dedupe_applies_once() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    f.outbox
        .enqueue_alone(
            &mut f.conn,
            Message::new("invoice.due", "42").key("invoice-42"),
        )
        .await
        .unwrap();
    f.conn
        .batch_execute(&format!(
            "CREATE TABLE {}_effects (n int NOT NULL)",
            f.outbox.table()
        ))
        .await
        .unwrap();

    let published = Arc::new(AtomicUsize::new(0));
    let crashing = f
        .outbox
        .relay(
            f.pool.clone(),
            CrashAfterPublish {
                inner: publisher(&broker.exchange).await,
                published: published.clone(),
            },
        )
        .lease(Duration::from_secs(2))
        .drain_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    // The relay "crashes" (its future is dropped) the moment the broker has confirmed.
    let confirmed = published.clone();
    let waiter = eventually(DEADLINE, "the first publish", || async {
        (AtomicUsize::load(&confirmed, Ordering::SeqCst) == 1).then_some(())
    });
    tokio::select! {
        _ = crashing.run_once() => panic!("the first relay marked the row"),
        () = waiter => {}
    }

    let healthy = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    eventually(DEADLINE, "the lease to end", || async {
        (healthy.run_once().await.unwrap() == 1).then_some(())
    })
    .await;

    // The consumer: dedupe and the effect in one transaction, ack after commit.
    let mut applied = 0;
    let mut deliveries = Vec::new();
    while let Some(d) = next(&mut consumer, QUIET).await {
        let key = message_id(&d);
        let attempt = header(&d, "x-outbox-attempt").cloned();
        deliveries.push((key.clone(), attempt));
        let outbox = f.outbox.clone();
        let first = f
            .conn
            .transaction(async |c| {
                let first = outbox.dedupe(c, "invoicing", &key).await?;
                if first {
                    diesel::sql_query(format!("INSERT INTO {}_effects VALUES (1)", outbox.table()))
                        .execute(c)
                        .await?;
                }
                Ok::<_, Error>(first)
            })
            .await
            .unwrap();
        applied += usize::from(first);
    }
    assert_eq!(
        deliveries,
        vec![
            ("invoice-42".to_owned(), Some(AMQPValue::LongLongInt(1))),
            ("invoice-42".to_owned(), Some(AMQPValue::LongLongInt(2))),
        ],
        "the same key twice"
    );
    assert_eq!(applied, 1);
    #[derive(QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let effects: N = diesel::sql_query(format!(
        "SELECT count(*) AS n FROM {}_effects",
        f.outbox.table()
    ))
    .get_result(&mut f.conn)
    .await
    .unwrap();
    assert_eq!(effects.n, 1, "the effect happened once");
}

#[tokio::test]
async fn no_url_or_password_in_debug_errors_or_display() {
    let secret = "s3cret-pw";
    let err = RabbitMqPublisher::builder(format!("amqp://guest:{secret}@127.0.0.1:1/%2f"), "x")
        .connect()
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains(secret), "{shown}");
    assert!(!shown.contains("guest:"), "{shown}");

    let err = RabbitMqPublisher::builder(format!("not a url {secret}"), "x")
        .connect()
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(matches!(err, Error::InvalidOption(_)));
    assert!(!shown.contains(secret), "{shown}");

    let broker = TestBroker::new("#").await;
    let publisher = publisher(&broker.exchange).await;
    let builder = RabbitMqPublisher::builder(amqp_url(), "x");
    for shown in [format!("{publisher:?}"), format!("{builder:?}")] {
        assert!(!shown.contains("guest:guest"), "{shown}");
        assert!(!shown.contains("amqp://"), "{shown}");
    }
}

/// A missing exchange is an outage, not the message's fault: the record is released with
/// its attempt given back, and goes out on its first attempt once the exchange exists.
#[tokio::test]
async fn a_missing_exchange_spends_no_attempt_and_the_channel_recovers() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    // At start a missing exchange is refused at once, naming it: no retry would mend it.
    let name = common::unique("gone");
    let err = RabbitMqPublisher::builder(amqp_url(), &name)
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::NotDeclared(m) if m.contains(&format!("exchange `{name}` does not exist"))),
        "{err:?}"
    );
    // Once running, an exchange that disappears is an outage: the broker closes the
    // channel of each publish to it.
    diesel_outbox::rabbitmq::Topology::exchange(&name)
        .declare(&amqp_url())
        .await
        .unwrap();
    let missing = RabbitMqPublisher::builder(amqp_url(), &name)
        .connect()
        .await
        .unwrap();
    broker
        .channel
        .exchange_delete(name.as_str().into(), Default::default())
        .await
        .unwrap();
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("t", "x").key("k"))
        .await
        .unwrap();
    let relay = f.outbox.relay(f.pool.clone(), missing).build().unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1);
    assert_eq!(
        f.count(
            "status = 'pending' AND attempts = 0 AND last_error IS NULL AND lease_until IS NULL"
        )
        .await,
        1,
        "released, its attempt given back"
    );

    // The same key goes out through a working publisher afterwards, on its first attempt.
    let good = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    assert_eq!(good.run_once().await.unwrap(), 1);
    let d = next(&mut consumer, DEADLINE).await.expect("delivered");
    assert_eq!(message_id(&d), "k");
    assert_eq!(
        header(&d, "x-outbox-attempt"),
        Some(&AMQPValue::LongLongInt(1))
    );
}

#[tokio::test]
async fn a_broker_that_never_answers_the_handshake_fails_the_connect_in_time() {
    // Accepts connections and holds them open without a word of AMQP.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let connecting = RabbitMqPublisher::builder(amqp_url_via(addr), "events")
        .confirm_timeout(Duration::from_millis(300))
        .connect();
    let result = tokio::time::timeout(DEADLINE, connecting)
        .await
        .expect("connect gave up within the confirm timeout");
    let err = result.unwrap_err();
    assert!(matches!(err, Error::Publish(_)), "{err:?}");
    assert!(!err.to_string().contains("guest:"), "{err}");
    holder.abort();
}

/// Rows written by other means can hold what RabbitMQ refuses: a header frame over the
/// connection's `frame_max` (which made the broker close the connection, failing the whole
/// batch; above about 4 MiB lapin's writer wedged), or a `CC` header (extra routing). Each
/// fails permanently and alone, before anything is written; its batch goes out.
#[tokio::test]
async fn a_record_rabbitmq_cannot_take_dies_alone_and_its_batch_goes_out() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let spoilt = [
        (
            "big-header",
            "jsonb_build_object('h', repeat('x', 300000))",
            "frame_max",
        ),
        (
            "huge-header",
            "jsonb_build_object('h', repeat('x', 5000000))",
            "frame_max",
        ),
        ("cc-header", "'{\"CC\": \"elsewhere\"}'", "CC and BCC"),
    ];
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("t", "a").key("a"))
        .await
        .unwrap();
    for (key, _, _) in &spoilt {
        f.outbox
            .enqueue_alone(&mut f.conn, Message::new("t", "x").key(*key))
            .await
            .unwrap();
    }
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("t", "c").key("c"))
        .await
        .unwrap();
    let t = f.outbox.table().to_owned();
    for (key, headers, _) in &spoilt {
        f.conn
            .batch_execute(&format!(
                "UPDATE {t} SET headers = {headers} WHERE idempotency_key = '{key}'"
            ))
            .await
            .unwrap();
    }
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .build()
        .unwrap();
    let claimed = tokio::time::timeout(DEADLINE, relay.run_once())
        .await
        .expect("the batch finished")
        .unwrap();
    assert_eq!(claimed, 5);
    assert_eq!(
        f.count("idempotency_key IN ('a', 'c') AND status = 'sent' AND attempts = 1")
            .await,
        2,
        "the neighbours went out on their first attempt"
    );
    for (key, _, reason) in &spoilt {
        assert_eq!(
            f.count(&format!(
                "idempotency_key = '{key}' AND status = 'dead' AND attempts = 1 \
                 AND last_error LIKE '%permanent%{reason}%'"
            ))
            .await,
            1,
            "{key} died alone"
        );
    }
    let mut received = Vec::new();
    while let Some(d) = next(&mut consumer, QUIET).await {
        received.push(message_id(&d));
    }
    assert_eq!(received, ["a", "c"]);

    // The connection survived: the next batch goes out on it.
    f.outbox
        .enqueue_alone(&mut f.conn, Message::new("t", "d").key("d"))
        .await
        .unwrap();
    assert_eq!(relay.run_once().await.unwrap(), 1);
    assert_eq!(
        message_id(&next(&mut consumer, DEADLINE).await.unwrap()),
        "d"
    );
}

/// The broker stopped for ten times `max_attempts × backoff max`: nothing becomes a dead
/// letter, no attempt is spent, `stats` shows the relay blocked, and the backlog drains once
/// the broker is back, every message on its first attempt.
#[tokio::test]
async fn a_broker_outage_spends_no_attempts_and_the_backlog_drains_when_it_is_back() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let (proxy, publisher) = proxied(&broker.exchange).await;
    let (stop, task) = spawn_relay(f.outage_relay(publisher));

    proxy.set_down(true);
    let mut expected = Vec::new();
    for i in 0..30 {
        let key = format!("k{i:02}");
        f.outbox
            .enqueue_alone(&mut f.conn, Message::new("t", "x").key(key.clone()))
            .await
            .unwrap();
        expected.push(key);
    }
    let outage = f.ride_out_outage().await;
    assert_eq!(f.count("status = 'pending'").await, 30);
    let blocked = f.outbox.stats(&mut f.conn).await.unwrap().blocked_for;
    assert!(
        blocked.is_some_and(|b| b >= outage / 2),
        "blocked for {blocked:?} after {outage:?} down"
    );

    proxy.set_down(false);
    f.wait_rows("status = 'sent' AND attempts = 1", 30).await;
    eventually(DEADLINE, "stats to clear the outage", || async {
        let mut conn = f.schema.connect().await;
        let stats = f.outbox.stats(&mut conn).await.unwrap();
        stats.blocked_for.is_none().then_some(())
    })
    .await;
    stop_relay(stop, task).await;
    let mut received = Vec::new();
    while let Some(d) = next(&mut consumer, QUIET).await {
        assert_eq!(
            header(&d, "x-outbox-attempt"),
            Some(&AMQPValue::LongLongInt(1))
        );
        received.push(message_id(&d));
    }
    received.sort();
    assert_eq!(received, expected);
}

/// A short lease alone is enough: what the user left at its default (the confirm timeout,
/// the drain timeout) follows the lease, and the relay publishes; a value set explicitly
/// that does not fit is still refused, naming the option.
#[tokio::test]
async fn a_short_lease_alone_is_enough_and_an_explicit_misfit_is_refused() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let defaults = RabbitMqPublisher::builder(amqp_url(), &broker.exchange)
        .connect()
        .await
        .unwrap();
    let relay = f
        .outbox
        .relay(f.pool.clone(), defaults)
        .lease(Duration::from_secs(1))
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);
    f.enqueue(Message::new("t", "x").key("short-lease")).await;
    let delivery = next(&mut consumer, DEADLINE).await.expect("published");
    assert_eq!(message_id(&delivery), "short-lease");
    stop_relay(stop, task).await;

    let explicit = RabbitMqPublisher::builder(amqp_url(), &broker.exchange)
        .confirm_timeout(Duration::from_secs(1))
        .connect()
        .await
        .unwrap();
    let err = f
        .outbox
        .relay(f.pool.clone(), explicit)
        .lease(Duration::from_secs(1))
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("confirm_timeout") && err.contains("half the lease"),
        "{err}"
    );
    let err = f
        .outbox
        .relay(f.pool.clone(), publisher(&broker.exchange).await)
        .lease(Duration::from_secs(20))
        .drain_timeout(Duration::from_secs(11))
        .build()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("drain_timeout 11s exceeds half the lease"),
        "{err}"
    );
}

/// `rabbitmq::Topology`: the exchange, a queue bound to it, and the queue's dead letters;
/// declaring again changes nothing; the same queue asked for without dead letters is
/// refused, naming it. A message published to a bound topic reaches the queue, and one
/// rejected there reaches `<queue>.dead`.
#[tokio::test]
async fn the_topology_declares_what_the_relay_and_consumers_need() {
    use diesel_outbox::rabbitmq::Topology;
    use lapin::options::{BasicGetOptions, BasicRejectOptions, QueueDeclareOptions};
    let exchange = common::unique("x");
    let queue = common::unique("q");
    let topology = Topology::exchange(&exchange).queue(&queue, "order.*");
    topology.declare(&amqp_url()).await.unwrap();
    topology.declare(&amqp_url()).await.unwrap();
    let publisher = publisher(&exchange).await;
    publisher
        .publish(&Record::new("k", "order.created", "x"))
        .await
        .unwrap();
    let amqp = common::broker::connect().await;
    let channel = amqp.create_channel().await.unwrap();
    let got = eventually(DEADLINE, "the message in the queue", || async {
        channel
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
    })
    .await;
    got.delivery
        .acker
        .reject(BasicRejectOptions { requeue: false })
        .await
        .unwrap();
    let dead = format!("{queue}.dead");
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    eventually(DEADLINE, "the rejected message dead-lettered", || async {
        let q = channel
            .queue_declare(dead.as_str().into(), passive, FieldTable::default())
            .await
            .unwrap();
        (q.message_count() == 1).then_some(())
    })
    .await;
    let misfit = Topology::exchange(&exchange)
        .queue(&queue, "order.*")
        .without_dead_letters()
        .declare(&amqp_url())
        .await
        .unwrap_err();
    assert!(
        matches!(&misfit, Error::InvalidOption(m) if m.contains(&format!("queue `{queue}` cannot be declared"))),
        "{misfit:?}"
    );
    common::broker::delete(&[&queue, &dead], &[&exchange, &dead]).await;
}

/// A publisher started without its broker (`connect_lazy`, the broker down): the relay is
/// not ready and says why, spends no attempt, and publishes everything on its first
/// attempt once the broker is up. A malformed URL is still refused at start.
#[tokio::test]
async fn a_lazy_publisher_starts_while_the_broker_is_down() {
    let mut f = fixture().await;
    let broker = TestBroker::new("#").await;
    let proxy = FaultProxy::down_before(&amqp_authority()).await;
    let publisher = RabbitMqPublisher::builder(amqp_url_via(proxy.addr), &broker.exchange)
        .confirm_timeout(Duration::from_secs(2))
        .connect_lazy()
        .await
        .unwrap();
    f.starts_without_the_broker(&proxy, publisher).await;
    let mut consumer = broker.consumer().await;
    let mut delivered = 0;
    while common::broker::next(&mut consumer, QUIET).await.is_some() {
        delivered += 1;
    }
    assert_eq!(delivered, 10);
    let bad = RabbitMqPublisher::builder("amqp://guest:s3cret@[bad", &broker.exchange)
        .connect_lazy()
        .await
        .unwrap_err();
    assert!(matches!(bad, Error::InvalidOption(_)), "{bad:?}");
    assert!(!bad.to_string().contains("s3cret"), "{bad}");
}
