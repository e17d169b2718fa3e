//! The NATS JetStream publisher and consumer source against the local nats-server and
//! PostgreSQL. (Restarting and stopping the server is the fault suite's NATS tier.)
#![cfg(feature = "nats")]

mod common;

use std::net::ToSocketAddrs;
use std::time::Duration;

use common::nats::{TestStream, header, nats_url};
use common::proxy::FaultProxy;
use common::{DEADLINE, Effects, eventually, fixture, spawn_relay, stop_relay};
use diesel_outbox::consumer::{Consumer, handler_fn, nats};
use diesel_outbox::nats::JetStreamPublisher;
use diesel_outbox::{Error, Message};

async fn publisher(url: String, prefix: &str) -> JetStreamPublisher {
    JetStreamPublisher::builder(url)
        .subject_prefix(prefix)
        .ack_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap()
}

/// Committed messages go out through JetStream and the consumer runner applies each once,
/// in order per aggregate; a rolled-back one never goes out; publishing every key again
/// (as after a crash before the outcome was recorded) stores nothing new.
#[tokio::test]
async fn committed_messages_reach_the_consumer_once_and_a_republish_is_stored_once() {
    let mut f = fixture().await;
    let stream = TestStream::new().await;
    stream.durable("invoicing", Duration::from_secs(5)).await;
    let effects = Effects::create(&mut f).await;
    Effects::enqueue_orders(&mut f, 4, 5).await;

    let publisher = publisher(nats_url(), &stream.prefix).await;
    let (stop, task) = spawn_relay(f.quick_relay(publisher));

    let source =
        nats::Source::durable(nats_url(), &stream.name, "invoicing").subject_prefix(&stream.prefix);
    let (stop_consumer, consuming) = effects.consume(&f, source).await;
    effects.expect_orders(&mut f, 4, 5).await;
    assert_eq!(stream.stored().await, 20);

    // Everything published again, within the stream's duplicate window.
    f.republish_all().await;
    f.wait_rows("status = 'sent' AND attempts = 2", 20).await;
    assert_eq!(
        stream.stored().await,
        20,
        "JetStream dropped every duplicate"
    );
    stop_relay(stop, task).await;
    stop_relay(stop_consumer, consuming).await;
    let again = effects.wait(20).await;
    assert_eq!(again.len(), 20, "no effect applied twice");
}

/// The server out of reach for ten times `max_attempts × backoff max`: nothing becomes a
/// dead letter, no attempt is spent, `stats` shows the relay blocked, and the backlog goes
/// out once the server is back, every message on its first attempt.
#[tokio::test]
async fn an_outage_spends_no_attempts_and_the_backlog_drains_when_the_server_is_back() {
    let mut f = fixture().await;
    let stream = TestStream::new().await;
    let upstream = nats_url()
        .trim_start_matches("nats://")
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let publisher = publisher(format!("nats://{}", proxy.addr), &stream.prefix).await;
    let (stop, task) = spawn_relay(f.outage_relay(publisher));

    proxy.set_down(true);
    for i in 0..30 {
        f.enqueue(Message::new("t", "x").key(format!("k{i:02}")))
            .await;
    }
    f.ride_out_outage().await;

    proxy.set_down(false);
    f.wait_rows("status = 'sent' AND attempts = 1", 30).await;
    stop_relay(stop, task).await;
    assert_eq!(stream.stored().await, 30);
    for m in stream.messages().await {
        assert_eq!(header(&m, "x-outbox-attempt"), Some("1"));
    }
}

/// No stream captures the subjects: an outage, not the messages' fault. Once the stream
/// exists, everything goes out on its first attempt.
#[tokio::test]
async fn no_stream_is_an_outage_until_one_exists() {
    let mut f = fixture().await;
    let prefix = format!("{}.", common::unique("later"));
    // At start no stream is refused at once, naming the prefix.
    let err = JetStreamPublisher::builder(nats_url())
        .subject_prefix(&prefix)
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, diesel_outbox::Error::NotDeclared(m) if m.contains(&format!("captures subjects `{prefix}>`"))),
        "{err:?}"
    );
    // Once running, a stream that goes away is an outage.
    let stream = TestStream::for_prefix(&prefix).await;
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher(nats_url(), &prefix).await)
        .max_attempts(1)
        .build()
        .unwrap();
    stream.jetstream.delete_stream(&stream.name).await.unwrap();
    drop(stream);
    for i in 0..5 {
        f.enqueue(Message::new("t", "x").key(format!("k{i}"))).await;
    }
    for _ in 0..3 {
        relay.run_once().await.unwrap();
    }
    assert_eq!(f.count("status = 'pending' AND attempts = 0").await, 5);

    // The stream, created now, for the subjects the relay has been publishing to.
    let stream = TestStream::for_prefix(&prefix).await;
    let sent = eventually(DEADLINE, "the backlog to go out", || async {
        let _ = relay.run_once().await;
        let mut conn = f.schema.connect().await;
        let stats = f.outbox.stats(&mut conn).await.unwrap();
        (stats.sent == 5).then_some(stats)
    })
    .await;
    drop(stream);
    assert_eq!(sent.dead, 0);
    assert_eq!(f.count("status = 'sent' AND attempts = 1").await, 5);
}

/// What the stream answers decides the kind: a full stream (discard-new) takes nothing, an
/// outage; a message over the stream's size limit can never go, a permanent failure.
#[tokio::test]
async fn a_full_stream_is_an_outage_and_a_message_over_its_size_is_permanent() {
    use diesel_outbox::{Publisher, Record};
    let stream = TestStream::with(|mut config| {
        config.max_messages = 1;
        config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
        config.max_message_size = 2048;
        config
    })
    .await;
    let publisher = publisher(nats_url(), &stream.prefix).await;
    publisher
        .publish(&Record::new("k1", "t", "x"))
        .await
        .unwrap();
    let full = publisher
        .publish(&Record::new("k2", "t", "x"))
        .await
        .unwrap_err();
    assert!(full.is_unavailable(), "{full}");
    let big = publisher
        .publish(&Record::new("k3", "t", vec![b'x'; 4096]))
        .await
        .unwrap_err();
    assert!(big.is_permanent(), "{big}");
    assert_eq!(stream.stored().await, 1);
}

/// `nats::Topology`: a stream capturing the prefix and a durable consumer; declaring again
/// changes nothing, and the relay's publisher finds the stream; a stream of that name that
/// captures something else is refused, naming it. A runner on a durable consumer that does
/// not exist fails at once, naming it.
#[tokio::test]
async fn the_topology_declares_a_stream_and_a_durable_and_a_missing_durable_fails_the_runner() {
    use diesel_outbox::nats::Topology;
    let f = fixture().await;
    let prefix = format!("{}.", common::unique("topo"));
    let name = prefix.trim_end_matches('.').to_uppercase();
    let topology = Topology::stream(&name, &prefix).durable("invoicing");
    topology.declare(&nats_url()).await.unwrap();
    topology.declare(&nats_url()).await.unwrap();
    JetStreamPublisher::builder(nats_url())
        .subject_prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let misfit = Topology::stream(&name, "elsewhere.")
        .declare(&nats_url())
        .await
        .unwrap_err();
    assert!(
        matches!(&misfit, Error::InvalidOption(m) if m.contains(&format!("stream `{name}` exists"))),
        "{misfit:?}"
    );
    let consumer = Consumer::builder(f.outbox.clone(), f.pool.clone(), "invoicing")
        .source(nats::Source::durable(nats_url(), &name, "nobody").subject_prefix(&prefix))
        .handler(handler_fn(|_, _| Box::pin(async { Ok(()) })))
        .build()
        .unwrap();
    let err = common::start_error(consumer).await;
    assert!(
        matches!(&err, Error::NotDeclared(m) if m.contains("durable consumer `nobody`")),
        "{err:?}"
    );
    let js = async_nats::jetstream::new(common::nats::connect().await);
    js.delete_stream(&name).await.unwrap();
}

/// A publisher started without a server (`connect_lazy`, the server down): the relay is
/// not ready and says why, spends no attempt, and publishes everything on its first
/// attempt once the server is up.
#[tokio::test]
async fn a_lazy_publisher_starts_while_the_server_is_down() {
    let mut f = fixture().await;
    let stream = TestStream::new().await;
    let proxy = FaultProxy::down_before(nats_url().trim_start_matches("nats://")).await;
    let publisher = JetStreamPublisher::builder(format!("nats://{}", proxy.addr))
        .subject_prefix(&stream.prefix)
        .ack_timeout(Duration::from_secs(2))
        .connect_lazy()
        .await
        .unwrap();
    f.starts_without_the_broker(&proxy, publisher).await;
    assert_eq!(stream.stored().await, 10);
}
