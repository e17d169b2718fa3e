//! The Kafka publisher and consumer source against Tansu (a Kafka-compatible broker) and
//! PostgreSQL: the whole path with its order and dedupe, the outage rule with the broker
//! paused, a message Kafka cannot take, librdkafka properties passed through, where a new
//! group starts, and topic configs.
#![cfg(feature = "kafka")]

mod common;

use std::time::Duration;

use common::kafka::{Tansu, brokers, read, read_until};
use common::{DEADLINE, Effects, eventually, fixture, spawn_relay, stop_relay, unique};
use diesel_outbox::Message;
use diesel_outbox::consumer::{Consumer, kafka};
use diesel_outbox::kafka::{KafkaPublisher, Topology};

fn skipped(test: &str) -> bool {
    !common::services::needs(test, common::kafka::missing().or_else(Tansu::missing))
}

/// A unique topic prefix, and under it topic `name` with `partitions`, on `brokers`.
async fn topic(brokers: &str, name: &str, partitions: u32) -> (String, String) {
    let prefix = format!("{}.", unique("outbox_kafka"));
    let topic = format!("{prefix}{name}");
    Topology::new()
        .topic(&topic, partitions)
        .replication(1)
        .declare(brokers)
        .await
        .unwrap();
    (prefix, topic)
}

async fn publisher(brokers: &str, prefix: &str, timeout: Duration) -> KafkaPublisher {
    KafkaPublisher::builder(brokers)
        .topic_prefix(prefix)
        .delivery_timeout(timeout)
        .max_message_bytes(64 * 1024)
        .connect()
        .await
        .unwrap()
}

/// Committed messages go out through Kafka and the consumer runner applies each once, in
/// order per aggregate across three partitions; a rolled-back one never goes out;
/// everything published again (as after a crash before the outcomes were recorded) is
/// stored again by Kafka and absorbed by the dedupe.
#[tokio::test]
async fn committed_messages_reach_the_consumer_once_in_order_per_aggregate() {
    if skipped("committed_messages_reach_the_consumer_once_in_order_per_aggregate") {
        return;
    }
    let mut f = fixture().await;
    let (prefix, topic) = topic(&brokers(), "order.updated", 3).await;
    let effects = Effects::create(&mut f).await;
    Effects::enqueue_orders(&mut f, 4, 5).await;

    let publisher = publisher(&brokers(), &prefix, Duration::from_secs(10)).await;
    let (stop, task) = spawn_relay(f.quick_relay(publisher));

    let group = unique("invoicing");
    let source = kafka::Source::group(brokers(), &group, [&topic]).topic_prefix(&prefix);
    let (stop_consumer, consuming) = effects.consume(&f, source).await;
    effects.expect_orders(&mut f, 4, 5).await;
    // One aggregate, one partition: the key is the aggregate key.
    let stored = read(&brokers(), std::slice::from_ref(&topic), 3, 20).await;
    for agg in 0..4 {
        let partitions: std::collections::BTreeSet<i32> = stored
            .iter()
            .filter(|m| m.key.as_deref() == Some(&format!("a{agg}")))
            .map(|m| m.partition)
            .collect();
        assert_eq!(partitions.len(), 1, "aggregate a{agg} in one partition");
    }

    // Everything published again: Kafka keeps both copies, the dedupe applies none twice.
    f.republish_all().await;
    f.wait_rows("status = 'sent' AND attempts = 2", 20).await;
    read(&brokers(), std::slice::from_ref(&topic), 3, 40).await;
    // All 40 are stored: the runner has read the second copies once its group's commits
    // reach the end of every partition.
    eventually(DEADLINE, "the second copies consumed", || {
        let (group, topic) = (group.clone(), topic.clone());
        async move {
            // Off the runtime, which the runner shares: the look blocks.
            let lag = tokio::task::spawn_blocking(move || {
                common::kafka::lag(&brokers(), &group, &topic, 3)
            })
            .await
            .unwrap();
            (lag.ok() == Some(0)).then_some(())
        }
    })
    .await;
    stop_relay(stop, task).await;
    stop_relay(stop_consumer, consuming).await;
    let again = effects.wait(20).await;
    assert_eq!(again.len(), 20, "no effect applied twice");
}

/// The broker paused for ten times `max_attempts × backoff max`: nothing becomes a dead
/// letter, no attempt is spent, and the backlog goes out once it resumes.
#[tokio::test]
async fn a_paused_broker_spends_no_attempts_and_the_backlog_drains_when_it_resumes() {
    if skipped("a_paused_broker_spends_no_attempts_and_the_backlog_drains_when_it_resumes") {
        return;
    }
    let mut f = fixture().await;
    // A broker of the test's own: pausing it touches no other test.
    let tansu = Tansu::start();
    let (prefix, topic) = topic(&tansu.brokers, "t", 1).await;
    let publisher = publisher(&tansu.brokers, &prefix, Duration::from_secs(1)).await;
    let (stop, task) = spawn_relay(f.outage_relay(publisher));
    tansu.pause();
    for i in 0..30 {
        f.enqueue(Message::new("t", "x").key(format!("k{i:02}")))
            .await;
    }
    f.ride_out_outage().await;
    tansu.resume();
    f.wait_rows("status = 'sent'", 30).await;
    stop_relay(stop, task).await;
    assert_eq!(f.count("status = 'dead'").await, 0);
    // Each message at least once (a batch given up on during the pause may have gone out
    // as well as its retry).
    let distinct = |read: &[common::kafka::Read]| {
        let keys: std::collections::BTreeSet<&str> = read
            .iter()
            .map(|m| m.headers["x-outbox-message-id"].as_str())
            .collect();
        keys.len()
    };
    let stored = read_until(
        &tansu.brokers,
        &[topic],
        1,
        "30 distinct messages",
        |read| distinct(read) >= 30,
    )
    .await;
    assert_eq!(distinct(&stored), 30, "every message arrived");
}

/// A message over the producer's size limit ends dead alone; the rest of its batch goes out
/// on its first attempt.
#[tokio::test]
async fn a_message_over_the_size_limit_dies_alone() {
    if skipped("a_message_over_the_size_limit_dies_alone") {
        return;
    }
    let mut f = fixture().await;
    let (prefix, _) = topic(&brokers(), "t", 1).await;
    for i in 0..5 {
        let payload = if i == 2 {
            vec![b'x'; 128 * 1024]
        } else {
            b"small".to_vec()
        };
        f.enqueue(Message::new("t", payload).key(format!("k{i}")))
            .await;
    }
    let publisher = publisher(&brokers(), &prefix, Duration::from_secs(10)).await;
    let (stop, task) = spawn_relay(f.quick_relay(publisher));
    f.wait_rows("status = 'sent' AND attempts = 1", 4).await;
    f.wait_rows("status = 'dead' AND idempotency_key = 'k2'", 1)
        .await;
    stop_relay(stop, task).await;
    let dead = f.outbox.dead_letters(&mut f.conn, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("permanent"),
        "{:?}",
        dead[0].last_error
    );
}

/// A runner on a topic that does not exist fails at once, naming it, and the topic is not
/// created by the look (Tansu creates topics on first use).
#[tokio::test]
async fn a_missing_topic_fails_the_runner_at_start_and_stays_missing() {
    if skipped("a_missing_topic_fails_the_runner_at_start_and_stays_missing") {
        return;
    }
    use diesel_outbox::Error;
    use diesel_outbox::consumer::handler_fn;
    let f = fixture().await;
    let (_, present) = topic(&brokers(), "present", 1).await;
    let missing = format!("{}.missing", unique("outbox_kafka"));
    let consumer = Consumer::builder(f.outbox.clone(), f.pool.clone(), "invoicing")
        .source(kafka::Source::group(
            brokers(),
            unique("missing"),
            [present, missing.clone()],
        ))
        .handler(handler_fn(|_, _| Box::pin(async { Ok(()) })))
        .build()
        .unwrap();
    let err = common::start_error(consumer).await;
    assert!(
        matches!(&err, Error::NotDeclared(m) if m.contains(&format!("no topic `{missing}`"))),
        "{err:?}"
    );
    let listed = tokio::task::spawn_blocking(|| {
        use rdkafka::consumer::{BaseConsumer, Consumer as _};
        let reader: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .unwrap();
        let metadata = reader.fetch_metadata(None, DEADLINE).unwrap();
        metadata
            .topics()
            .iter()
            .map(|t| t.name().to_owned())
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert!(!listed.contains(&missing), "the look created {missing}");
}

/// `Topology::declare` says what it did with each topic, in the order given: a new one is
/// created with the partitions asked for, one that exists is left as it is and reported
/// with the partitions it has, also when they are not those asked for.
#[tokio::test]
async fn declare_reports_each_topic_as_created_or_found_with_its_partitions() {
    if skipped("declare_reports_each_topic_as_created_or_found_with_its_partitions") {
        return;
    }
    use diesel_outbox::kafka::DeclaredTopic;
    let (_, existing) = topic(&brokers(), "existing", 3).await;
    let fresh = format!("{}.fresh", unique("outbox_kafka"));
    let declared = Topology::new()
        .topic(&fresh, 2)
        .topic(&existing, 6)
        .replication(1)
        .declare(&brokers())
        .await
        .unwrap();
    let seen: Vec<(&str, u32, u32, bool)> = declared
        .iter()
        .map(|t: &DeclaredTopic| (t.name.as_str(), t.partitions, t.asked, t.created))
        .collect();
    assert_eq!(
        seen,
        [
            (fresh.as_str(), 2, 2, true),
            (existing.as_str(), 3, 6, false)
        ]
    );
    assert!(declared[0].as_asked() && !declared[1].as_asked());
    // Again: both found, each with the partitions it has.
    let again = Topology::new()
        .topic(&fresh, 2)
        .topic(&existing, 3)
        .declare(&brokers())
        .await
        .unwrap();
    assert!(
        again.iter().all(|t| !t.created && t.as_asked()),
        "{again:?}"
    );
    assert_eq!(again[1].partitions, 3);
}

/// Produces one record with idempotency key `key` to `topic` (the publisher has no prefix).
async fn produce(publisher: &KafkaPublisher, topic: &str, key: &str) {
    let record = diesel_outbox::Record::new(key, topic, "x");
    diesel_outbox::Publisher::publish(publisher, &record)
        .await
        .unwrap();
}

/// The idempotency key of the source's next delivery (left unsettled).
async fn next_key(source: &mut kafka::Source) -> String {
    use diesel_outbox::consumer::Source as _;
    source.next(1).await.expect("a delivery").delivery.key
}

/// librdkafka properties reach librdkafka: `security.protocol=SSL` and `ssl.ca.location`
/// given as properties (not `tls()`) make the topology's clients and the producer speak TLS
/// to a listener that counts handshakes (and `client.id` overrides the crate's default);
/// the broker's certificate is still verified (without the CA it is refused).
#[tokio::test]
async fn properties_pass_through_to_librdkafka() {
    if !common::services::needs("properties_pass_through_to_librdkafka", Tansu::missing()) {
        return;
    }
    let kafka = common::kafka::TlsTansu::start(&[]);
    let ca = kafka.ca.to_str().unwrap().to_owned();
    let topic = unique("props");
    Topology::new()
        .topic(&topic, 1)
        .property("security.protocol", "SSL")
        .property("ssl.ca.location", &ca)
        .declare(&kafka.brokers)
        .await
        .unwrap();
    let publisher = KafkaPublisher::builder(&kafka.brokers)
        .property("security.protocol", "SSL")
        .property("ssl.ca.location", &ca)
        .property("client.id", "billing-relay")
        .connect()
        .await
        .unwrap();
    produce(&publisher, &topic, "over-properties").await;
    assert!(
        kafka.handshakes() >= 2,
        "{} TLS handshakes",
        kafka.handshakes()
    );
    assert_eq!(kafka.plaintext(), 0, "a client did not speak TLS");
    let refused = KafkaPublisher::builder(&kafka.brokers)
        .property("security.protocol", "SSL")
        .delivery_timeout(Duration::from_secs(3))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("certificate verify failed"), "{refused}");
}

/// A new group starts where `start_from` says: at the beginning by default (and with
/// `Earliest`), so it gets a message produced before it existed; with `Latest` at the end,
/// so the first message it gets is one produced after it joined.
#[tokio::test]
async fn a_new_group_starts_where_start_from_says() {
    if skipped("a_new_group_starts_where_start_from_says") {
        return;
    }
    use diesel_outbox::consumer::Source as _;
    use diesel_outbox::consumer::kafka::StartFrom;
    let (_, topic) = topic(&brokers(), "t", 1).await;
    let publisher = publisher(&brokers(), "", Duration::from_secs(10)).await;
    produce(&publisher, &topic, "before").await;
    for mut earliest in [
        kafka::Source::group(brokers(), unique("earliest"), [&topic]),
        kafka::Source::group(brokers(), unique("earliest"), [&topic])
            .start_from(StartFrom::Earliest),
    ] {
        let first = tokio::time::timeout(DEADLINE, next_key(&mut earliest))
            .await
            .expect("a delivery within the deadline");
        assert_eq!(first, "before");
        earliest.close().await;
    }
    let mut latest =
        kafka::Source::group(brokers(), unique("latest"), [&topic]).start_from(StartFrom::Latest);
    // The group's start is not observable from here: messages are produced until one
    // arrives (one produced before the group found the partition's end is skipped too).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut produced = 0;
    let first = loop {
        produced += 1;
        produce(&publisher, &topic, &format!("after-{produced}")).await;
        match tokio::time::timeout(Duration::from_millis(500), next_key(&mut latest)).await {
            Ok(key) => break key,
            Err(_) => assert!(
                tokio::time::Instant::now() < deadline,
                "nothing came after {produced} messages"
            ),
        }
    };
    latest.close().await;
    assert!(first.starts_with("after-"), "{first}");
}

/// Topic configs go with the topics `declare` creates, as the cluster reports them; a
/// topic that exists is not altered.
#[tokio::test]
async fn topic_configs_go_with_the_topics_declare_creates() {
    if skipped("topic_configs_go_with_the_topics_declare_creates") {
        return;
    }
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let name = format!("{}.configured", unique("outbox_kafka"));
    let declare = |retention: &'static str| {
        Topology::new()
            .topic(&name, 1)
            .replication(1)
            .topic_config("retention.ms", retention)
    };
    declare("604800000").declare(&brokers()).await.unwrap();
    let retention = async || {
        let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", brokers())
            .create()
            .unwrap();
        let options = AdminOptions::new().request_timeout(Some(DEADLINE));
        let described = admin
            .describe_configs([&ResourceSpecifier::Topic(&name)], &options)
            .await
            .unwrap();
        let resource = described[0].as_ref().expect("the topic's configs");
        resource
            .get("retention.ms")
            .and_then(|entry| entry.value.clone())
    };
    assert_eq!(retention().await.as_deref(), Some("604800000"));
    let again = declare("3600000").declare(&brokers()).await.unwrap();
    assert!(!again[0].created);
    assert_eq!(
        retention().await.as_deref(),
        Some("604800000"),
        "left as it was"
    );
}

/// A publisher started without a broker (`connect_lazy`, the cluster out of reach): the
/// relay is not ready and says why, spends no attempt, and publishes everything on its
/// first attempt once the cluster answers.
#[tokio::test]
async fn a_lazy_publisher_starts_while_the_cluster_is_down() {
    if skipped("a_lazy_publisher_starts_while_the_cluster_is_down") {
        return;
    }
    let mut f = fixture().await;
    let (prefix, topic) = topic(&brokers(), "t", 1).await;
    let proxy = common::proxy::FaultProxy::down_before(&brokers()).await;
    let publisher = KafkaPublisher::builder(proxy.addr.to_string())
        .topic_prefix(&prefix)
        .delivery_timeout(Duration::from_secs(2))
        .connect_lazy()
        .await
        .unwrap();
    f.starts_without_the_broker(&proxy, publisher).await;
    assert_eq!(read(&brokers(), &[topic], 1, 10).await.len(), 10);
}

/// Published by aggregate type (Debezium's outbox router layout), the events of one
/// aggregate of every type share one Kafka topic and partition, and the consumer source
/// reads them in the order they were enqueued, each with its own topic.
#[tokio::test]
async fn by_aggregate_type_an_aggregates_events_of_every_type_arrive_in_order() {
    use diesel_outbox::consumer::Source as _;
    use diesel_outbox::kafka::Layout;
    if skipped("by_aggregate_type_an_aggregates_events_of_every_type_arrive_in_order") {
        return;
    }
    let mut f = fixture().await;
    let (prefix, topic) = topic(&brokers(), "order", 3).await;
    let types = ["order.created", "order.paid", "order.shipped"];
    for event in types {
        for order in ["o1", "o2", "o3"] {
            f.enqueue(
                Message::new(event, "x")
                    .key(format!("{order}-{event}"))
                    .aggregate_key(order),
            )
            .await;
        }
    }
    let publisher = KafkaPublisher::builder(brokers())
        .topic_prefix(&prefix)
        .layout(Layout::ByAggregateType)
        .connect()
        .await
        .unwrap();
    let (stop, task) = spawn_relay(f.quick_relay(publisher));
    let mut source =
        kafka::Source::group(brokers(), unique("router"), [&topic]).topic_prefix(&prefix);
    let mut seen: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for _ in 0..9 {
        let incoming = tokio::time::timeout(DEADLINE, source.next(16))
            .await
            .expect("a delivery in time")
            .unwrap();
        let delivery = &incoming.delivery;
        seen.entry(delivery.aggregate_key.clone().unwrap())
            .or_default()
            .push(delivery.topic.clone());
        incoming.settle.ack().await.unwrap();
    }
    source.close().await;
    stop_relay(stop, task).await;
    for order in ["o1", "o2", "o3"] {
        assert_eq!(seen[order], types, "{order}'s events in the order enqueued");
    }
}

/// A message the handler rejects, and one without an idempotency key, go to the topic's
/// dead-letter topic (`<topic>.dlt`, declared with it) with their headers, where they were
/// consumed and why; the group's offsets then move past them, and every other message is
/// applied.
#[tokio::test]
async fn rejected_messages_go_to_the_dead_letter_topic_before_the_offset_moves() {
    use diesel_outbox::consumer::{HandleError, handler_fn};
    use diesel_outbox::kafka::{
        DLT_OFFSET_HEADER, DLT_PARTITION_HEADER, DLT_REASON_HEADER, DLT_TOPIC_HEADER,
    };
    use rdkafka::producer::{FutureProducer, FutureRecord};
    if skipped("rejected_messages_go_to_the_dead_letter_topic_before_the_offset_moves") {
        return;
    }
    let mut f = fixture().await;
    let prefix = format!("{}.", unique("outbox_kafka"));
    let topic = format!("{prefix}t");
    let dead = format!("{topic}.dlt");
    let declared = Topology::new()
        .topic(&topic, 1)
        .dead_letter_topics()
        .replication(1)
        .declare(&brokers())
        .await
        .unwrap();
    assert_eq!(
        declared.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        [topic.as_str(), dead.as_str()]
    );
    for key in ["k0", "bad", "k2"] {
        f.enqueue(Message::new("t", "x").key(key).header("tenant", "acme"))
            .await;
    }
    let publisher = publisher(&brokers(), &prefix, Duration::from_secs(10)).await;
    let (stop, task) = spawn_relay(f.quick_relay(publisher));
    read(&brokers(), std::slice::from_ref(&topic), 1, 3).await;
    stop_relay(stop, task).await;
    // A message without an idempotency key, produced by someone else.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    producer
        .send(
            FutureRecord::<str, str>::to(&topic).payload("anonymous"),
            DEADLINE,
        )
        .await
        .unwrap();

    let group = unique("dlt");
    let consumer = Consumer::builder(f.outbox.clone(), f.pool.clone(), unique("invoicing"))
        .source(kafka::Source::group(brokers(), &group, [&topic]).topic_prefix(&prefix))
        .handler(handler_fn(|delivery, _| {
            let bad = delivery.key == "bad";
            Box::pin(async move {
                if bad {
                    Err(HandleError::reject("no such customer"))
                } else {
                    Ok(())
                }
            })
        }))
        .build()
        .unwrap();
    let (stop, consuming) = common::spawn_consumer(consumer);
    let letters = read(&brokers(), std::slice::from_ref(&dead), 1, 2).await;
    assert_eq!(
        letters.len(),
        2,
        "{:?}",
        letters.iter().map(|l| &l.headers).collect::<Vec<_>>()
    );
    // In the order produced: the keyless one may go first (it never reaches the handler).
    let letter = |payload: &[u8]| {
        letters
            .iter()
            .find(|l| l.payload == payload)
            .unwrap_or_else(|| panic!("no dead letter of {payload:?}"))
    };
    let rejected = letter(b"x");
    assert_eq!(rejected.headers["x-outbox-message-id"], "bad");
    assert_eq!(
        rejected.headers["tenant"], "acme",
        "the message's own headers"
    );
    assert_eq!(rejected.headers[DLT_TOPIC_HEADER], topic);
    assert_eq!(rejected.headers[DLT_PARTITION_HEADER], "0");
    assert_eq!(rejected.headers[DLT_OFFSET_HEADER], "1");
    assert!(
        rejected.headers[DLT_REASON_HEADER].contains("rejected by its handler"),
        "{:?}",
        rejected.headers
    );
    assert_eq!(rejected.payload, b"x");
    let anonymous = letter(b"anonymous");
    assert_eq!(anonymous.payload, b"anonymous");
    assert_eq!(anonymous.headers[DLT_OFFSET_HEADER], "3");
    assert!(anonymous.headers[DLT_REASON_HEADER].contains("x-outbox-message-id"));
    // Every offset is committed: the dead letters' too.
    eventually(DEADLINE, "the group's offsets at the end", || {
        let (group, topic) = (group.clone(), topic.clone());
        async move {
            let lag = tokio::task::spawn_blocking(move || {
                common::kafka::lag(&brokers(), &group, &topic, 1)
            })
            .await
            .unwrap();
            (lag.ok() == Some(0)).then_some(())
        }
    })
    .await;
    stop_relay(stop, consuming).await;
}
