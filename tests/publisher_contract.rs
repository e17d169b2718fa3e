//! The contract every publisher keeps, run against each one alike: RabbitMQ and NATS
//! JetStream (each in the clear and over TLS), Kafka and the closure adapter. Each publisher gets a
//! harness (how to make one, how to make its broker refuse a message, how to read what
//! arrived); the tests are written once.
#![allow(async_fn_in_trait)]

mod common;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use common::{DEADLINE, eventually, unique};
use diesel_outbox::{PublishError, Publisher, Record};
use futures_util::StreamExt;

/// A message as it arrived, in every broker's terms alike.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    key: String,
    topic: String,
    payload: Vec<u8>,
    content_type: Option<String>,
    attempt: u32,
    aggregate_key: Option<String>,
    headers: BTreeMap<String, String>,
}

trait Harness: Sized {
    type P: Publisher + Debug;
    /// What this machine lacks for the harness, if anything (see `services::needs`).
    fn missing() -> Option<String> {
        None
    }
    /// What a harness of this broker keeps of a key published twice: RabbitMQ delivers
    /// both (at least once), JetStream stores one (its duplicate window), the closure gets
    /// both calls.
    const DUPLICATES_KEPT: usize;
    async fn new() -> Self;
    /// A publisher to this harness's own destination.
    async fn publisher(&self) -> Self::P;
    /// A publisher whose destination went out of reach after it connected (the exchange
    /// deleted, the stream deleted): at start a missing one is refused.
    async fn out_of_reach(&self) -> Self::P;
    /// A record the broker refuses for itself, with `key`.
    fn refused(&self, key: &str) -> Record;
    /// The messages that arrived, once at least `n` have.
    async fn received(&mut self, n: usize) -> Vec<Got>;
    /// What the publisher shows of a URL holding the password `s3cret`: its builder's and
    /// its own `Debug`, and the error of a connect that failed.
    async fn shown_with_secret(&self) -> Vec<String>;
}

fn record(key: &str, topic: &str) -> Record {
    Record::new(key, topic, format!("payload of {key}"))
}

/// Publishes `records` as the relay does: as a batch if the publisher pipelines, else one
/// by one. Checks that every record gets exactly one result.
async fn publish<P: Publisher>(publisher: &P, records: &[Record]) -> Vec<Result<(), PublishError>> {
    let Some(mut stream) = publisher.publish_batch(records) else {
        let mut results = Vec::new();
        for r in records {
            results.push(publisher.publish(r).await);
        }
        return results;
    };
    let mut results: Vec<Option<Result<(), PublishError>>> = records.iter().map(|_| None).collect();
    while let Some((i, result)) = tokio::time::timeout(DEADLINE, stream.next())
        .await
        .expect("results in time")
    {
        assert!(results[i].is_none(), "two results for record {i}");
        results[i] = Some(result);
    }
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| panic!("no result for record {i}")))
        .collect()
}

async fn properties_and_headers_arrive<H: Harness>() {
    let mut h = H::new().await;
    let mut r = record("order-1-created", "ok.order.created");
    r.aggregate_key = Some("order-1".into());
    r.content_type = Some("application/json".into());
    r.headers.insert("tenant".into(), "acme".into());
    r.attempt = 2;
    let publisher = h.publisher().await;
    publish(&publisher, std::slice::from_ref(&r))
        .await
        .pop()
        .unwrap()
        .unwrap();
    let got = h.received(1).await;
    assert_eq!(
        got,
        [Got {
            key: "order-1-created".into(),
            topic: "ok.order.created".into(),
            payload: b"payload of order-1-created".to_vec(),
            content_type: Some("application/json".into()),
            attempt: 2,
            aggregate_key: Some("order-1".into()),
            headers: BTreeMap::from([("tenant".into(), "acme".into())]),
        }]
    );
}

async fn a_batch_gives_each_record_its_own_result<H: Harness>() {
    let mut h = H::new().await;
    let records: Vec<Record> = (0..20)
        .map(|i| {
            if i == 7 {
                h.refused("k07")
            } else {
                record(&format!("k{i:02}"), "ok.batch")
            }
        })
        .collect();
    let publisher = h.publisher().await;
    let results = publish(&publisher, &records).await;
    assert_eq!(results.len(), 20);
    for (i, result) in results.iter().enumerate() {
        if i == 7 {
            let err = result.as_ref().expect_err("the refused record fails");
            assert!(
                !err.is_unavailable(),
                "a refused message is its own failure, not an outage: {err}"
            );
        } else {
            assert!(result.is_ok(), "record {i}: {result:?}");
        }
    }
    let keys: Vec<String> = h.received(19).await.into_iter().map(|g| g.key).collect();
    let expected: Vec<String> = (0..20)
        .filter(|&i| i != 7)
        .map(|i| format!("k{i:02}"))
        .collect();
    assert_eq!(keys, expected, "the others arrive, in publish order");
}

async fn an_outage_is_reported_as_one<H: Harness>() {
    let h = H::new().await;
    let publisher = h.out_of_reach().await;
    let records: Vec<Record> = (0..3).map(|i| record(&format!("o{i}"), "ok.x")).collect();
    for result in publish(&publisher, &records).await {
        let err = result.expect_err("nothing is published");
        assert!(err.is_unavailable(), "an outage: {err}");
    }
}

async fn a_duplicate_is_handled_as_the_broker_promises<H: Harness>() {
    let mut h = H::new().await;
    let publisher = h.publisher().await;
    let first = record("twice", "ok.dup");
    let mut again = first.clone();
    again.attempt = 2;
    let sentinel = record("after", "ok.dup");
    for r in [&first, &again, &sentinel] {
        publish(&publisher, std::slice::from_ref(r))
            .await
            .pop()
            .unwrap()
            .expect("a duplicate publish counts as sent");
    }
    let got = h.received(H::DUPLICATES_KEPT + 1).await;
    assert_eq!(got.last().map(|g| g.key.as_str()), Some("after"));
    assert_eq!(
        got.iter().filter(|g| g.key == "twice").count(),
        H::DUPLICATES_KEPT
    );
}

async fn no_secret_is_shown<H: Harness>() {
    let h = H::new().await;
    for shown in h.shown_with_secret().await {
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}

macro_rules! contract {
    ($name:ident, $harness:ty) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn properties_and_headers_arrive() {
                if !common::services::needs(
                    stringify!(properties_and_headers_arrive),
                    <$harness as Harness>::missing(),
                ) {
                    return;
                }
                super::properties_and_headers_arrive::<$harness>().await;
            }

            #[tokio::test]
            async fn a_batch_gives_each_record_its_own_result() {
                if !common::services::needs(
                    stringify!(a_batch_gives_each_record_its_own_result),
                    <$harness as Harness>::missing(),
                ) {
                    return;
                }
                super::a_batch_gives_each_record_its_own_result::<$harness>().await;
            }

            #[tokio::test]
            async fn an_outage_is_reported_as_one() {
                if !common::services::needs(
                    stringify!(an_outage_is_reported_as_one),
                    <$harness as Harness>::missing(),
                ) {
                    return;
                }
                super::an_outage_is_reported_as_one::<$harness>().await;
            }

            #[tokio::test]
            async fn a_duplicate_is_handled_as_the_broker_promises() {
                if !common::services::needs(
                    stringify!(a_duplicate_is_handled_as_the_broker_promises),
                    <$harness as Harness>::missing(),
                ) {
                    return;
                }
                super::a_duplicate_is_handled_as_the_broker_promises::<$harness>().await;
            }

            #[tokio::test]
            async fn no_secret_is_shown() {
                if !common::services::needs(
                    stringify!(no_secret_is_shown),
                    <$harness as Harness>::missing(),
                ) {
                    return;
                }
                super::no_secret_is_shown::<$harness>().await;
            }
        }
    };
}

contract!(closure, ClosureHarness);
#[cfg(feature = "rabbitmq")]
contract!(rabbitmq, rabbit::RabbitHarness<rabbit::Plain>);
#[cfg(feature = "rabbitmq")]
contract!(rabbitmq_tls, rabbit::RabbitHarness<rabbit::OverTls>);
#[cfg(feature = "nats")]
contract!(nats, jetstream::NatsHarness<jetstream::Plain>);
#[cfg(feature = "nats")]
contract!(nats_tls, jetstream::NatsHarness<jetstream::OverTls>);
#[cfg(feature = "kafka")]
contract!(kafka, kafka_harness::KafkaHarness);

/// The closure adapter over an in-memory "broker" that refuses topic `nowhere` and can be
/// out of reach.
struct ClosureHarness {
    sink: std::sync::Arc<std::sync::Mutex<Vec<Record>>>,
}

fn got_from_record(r: &Record) -> Got {
    Got {
        key: r.key.clone(),
        topic: r.topic.clone(),
        payload: r.payload.clone(),
        content_type: r.content_type.clone(),
        attempt: r.attempt,
        aggregate_key: r.aggregate_key.clone(),
        headers: r.headers.clone(),
    }
}

impl Harness for ClosureHarness {
    type P = Box<dyn DynPublisher>;
    const DUPLICATES_KEPT: usize = 2;

    async fn new() -> Self {
        ClosureHarness {
            sink: Default::default(),
        }
    }

    async fn publisher(&self) -> Self::P {
        let sink = self.sink.clone();
        Box::new(diesel_outbox::publisher_fn(move |r: Record| {
            let sink = sink.clone();
            async move {
                if r.topic == "nowhere" {
                    return Err(PublishError::transient("unroutable"));
                }
                sink.lock().unwrap().push(r);
                Ok(())
            }
        }))
    }

    async fn out_of_reach(&self) -> Self::P {
        Box::new(diesel_outbox::publisher_fn(|_r: Record| async {
            Err(PublishError::unavailable("connection refused"))
        }))
    }

    fn refused(&self, key: &str) -> Record {
        record(key, "nowhere")
    }

    async fn received(&mut self, n: usize) -> Vec<Got> {
        let sink = self.sink.clone();
        eventually(DEADLINE, "closure calls", || {
            let got = sink.lock().unwrap().clone();
            async move { (got.len() >= n).then(|| got.iter().map(got_from_record).collect()) }
        })
        .await
    }

    async fn shown_with_secret(&self) -> Vec<String> {
        vec![format!("{:?}", self.publisher().await)]
    }
}

/// A boxed publisher of either closure, so one harness type can hand out both.
trait DynPublisher: Send + Sync + Debug {
    fn publish_boxed<'a>(
        &'a self,
        record: &'a Record,
    ) -> futures_util::future::BoxFuture<'a, Result<(), PublishError>>;
}

impl<P: Publisher + Debug> DynPublisher for P {
    fn publish_boxed<'a>(
        &'a self,
        record: &'a Record,
    ) -> futures_util::future::BoxFuture<'a, Result<(), PublishError>> {
        Box::pin(self.publish(record))
    }
}

impl Publisher for Box<dyn DynPublisher> {
    async fn publish(&self, record: &Record) -> Result<(), PublishError> {
        (**self).publish_boxed(record).await
    }
}

#[cfg(feature = "rabbitmq")]
mod rabbit {
    use super::*;
    use common::broker::{Amqps, TestBroker, amqp_url, message_id, next};
    use diesel_outbox::rabbitmq::{RabbitMqPublisher, RabbitMqPublisherBuilder};
    use lapin::types::AMQPValue;

    /// How the harness's publishers reach the broker.
    pub(super) trait Transport: Send + Sync + 'static {
        /// What this machine lacks for it, if anything.
        fn missing() -> Option<String> {
            None
        }
        /// The broker's URL, with `s3cret` as the password when `secret`.
        fn url(secret: bool) -> String;
        fn builder(url: String, exchange: &str) -> RabbitMqPublisherBuilder;
    }

    /// `amqp://`.
    pub(super) struct Plain;

    impl Transport for Plain {
        fn url(secret: bool) -> String {
            if secret {
                "amqp://guest:s3cret@127.0.0.1:1/%2f".into()
            } else {
                amqp_url()
            }
        }

        fn builder(url: String, exchange: &str) -> RabbitMqPublisherBuilder {
            RabbitMqPublisher::builder(url, exchange)
        }
    }

    /// `amqps://` to the broker's TLS listener, trusting its CA.
    pub(super) struct OverTls;

    impl Transport for OverTls {
        fn missing() -> Option<String> {
            Amqps::missing()
        }

        fn url(secret: bool) -> String {
            let url = Amqps::local().url;
            if secret {
                url.replacen("guest:guest@", "guest:s3cret@", 1)
                    .replacen(":5671", ":1", 1)
            } else {
                url
            }
        }

        fn builder(url: String, exchange: &str) -> RabbitMqPublisherBuilder {
            RabbitMqPublisher::builder(url, exchange).tls(Amqps::local().tls())
        }
    }

    pub(super) struct RabbitHarness<T> {
        broker: TestBroker,
        consumer: lapin::Consumer,
        got: Vec<Got>,
        transport: std::marker::PhantomData<T>,
    }

    fn got(d: &lapin::message::Delivery) -> Got {
        let mut headers = BTreeMap::new();
        let mut attempt = 0;
        let mut aggregate_key = None;
        for (name, value) in d.properties.headers().clone().unwrap_or_default().inner() {
            match (name.as_str(), value) {
                ("x-outbox-attempt", AMQPValue::LongLongInt(n)) => attempt = *n as u32,
                ("x-outbox-aggregate-key", AMQPValue::LongString(s)) => {
                    aggregate_key = Some(s.to_string())
                }
                (name, AMQPValue::LongString(s)) => {
                    headers.insert(name.to_owned(), s.to_string());
                }
                (name, other) => panic!("header {name} is {other:?}"),
            }
        }
        Got {
            key: message_id(d),
            topic: d.routing_key.to_string(),
            payload: d.data.clone(),
            content_type: d.properties.content_type().as_ref().map(|c| c.to_string()),
            attempt,
            aggregate_key,
            headers,
        }
    }

    impl<T: Transport> Harness for RabbitHarness<T> {
        type P = RabbitMqPublisher;
        const DUPLICATES_KEPT: usize = 2;

        fn missing() -> Option<String> {
            T::missing()
        }

        async fn new() -> Self {
            let broker = TestBroker::new("ok.#").await;
            let consumer = broker.consumer().await;
            RabbitHarness {
                broker,
                consumer,
                got: Vec::new(),
                transport: std::marker::PhantomData,
            }
        }

        async fn publisher(&self) -> RabbitMqPublisher {
            T::builder(T::url(false), &self.broker.exchange)
                .confirm_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap()
        }

        async fn out_of_reach(&self) -> RabbitMqPublisher {
            let name = unique("gone");
            diesel_outbox::rabbitmq::Topology::exchange(&name)
                .declare(&amqp_url())
                .await
                .unwrap();
            let publisher = T::builder(T::url(false), &name)
                .confirm_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap();
            self.broker
                .channel
                .exchange_delete(name.as_str().into(), Default::default())
                .await
                .unwrap();
            publisher
        }

        fn refused(&self, key: &str) -> Record {
            // Unroutable: the queue is bound to `ok.#` only, and `mandatory` is on.
            record(key, "nowhere")
        }

        async fn received(&mut self, n: usize) -> Vec<Got> {
            while self.got.len() < n {
                let d = next(&mut self.consumer, DEADLINE)
                    .await
                    .unwrap_or_else(|| panic!("{n} deliveries, got {}", self.got.len()));
                self.got.push(got(&d));
            }
            self.got.clone()
        }

        async fn shown_with_secret(&self) -> Vec<String> {
            let builder = T::builder(T::url(true), "x");
            let mut shown = vec![format!("{builder:?}")];
            shown.push(builder.connect().await.unwrap_err().to_string());
            shown.push(format!("{:?}", self.publisher().await));
            shown
        }
    }
}

#[cfg(feature = "nats")]
mod jetstream {
    use super::*;
    use common::nats::{TestStream, TlsNats, header, nats_url};
    use diesel_outbox::nats::{Credentials, JetStreamPublisher, JetStreamPublisherBuilder};

    /// The largest message the harness's stream takes: the refused record is larger.
    const MAX_MESSAGE: i32 = 4096;

    /// Where the harness's stream lives and how its publishers reach it.
    pub(super) trait Transport: Send + Sync + 'static {
        /// What this machine lacks for it, if anything.
        fn missing() -> Option<String> {
            None
        }
        /// A server of the harness's own, if it needs one.
        fn server() -> Option<TlsNats>;
        /// A builder for `server`'s URL (or the shared server's), with `s3cret` as a
        /// credential when `secret`, and the port closed then.
        fn builder(server: Option<&TlsNats>, secret: bool) -> JetStreamPublisherBuilder;
    }

    /// The shared server, in the clear.
    pub(super) struct Plain;

    impl Transport for Plain {
        fn server() -> Option<TlsNats> {
            None
        }

        fn builder(_: Option<&TlsNats>, secret: bool) -> JetStreamPublisherBuilder {
            if secret {
                JetStreamPublisher::builder("nats://relay:s3cret@127.0.0.1:1")
            } else {
                JetStreamPublisher::builder(nats_url())
            }
        }
    }

    /// A server of the harness's own over TLS, with NKey authentication.
    pub(super) struct OverTls;

    impl Transport for OverTls {
        fn missing() -> Option<String> {
            TlsNats::missing()
        }

        fn server() -> Option<TlsNats> {
            Some(TlsNats::start())
        }

        fn builder(server: Option<&TlsNats>, secret: bool) -> JetStreamPublisherBuilder {
            let server = server.expect("a server of the harness's own");
            let tls = diesel_outbox::Tls::new().ca_file(&server.ca);
            if secret {
                JetStreamPublisher::builder("tls://localhost:1")
                    .tls(tls)
                    .credentials(Credentials::token("s3cret"))
            } else {
                JetStreamPublisher::builder(&server.url)
                    .tls(tls)
                    .credentials(Credentials::nkey_seed(&server.seed))
            }
        }
    }

    pub(super) struct NatsHarness<T> {
        stream: TestStream,
        server: Option<TlsNats>,
        transport: std::marker::PhantomData<T>,
    }

    fn got(prefix: &str, m: &async_nats::Message) -> Got {
        let mut headers = BTreeMap::new();
        for (name, values) in m.headers.iter().flat_map(|h| h.iter()) {
            let name: &str = name.as_ref();
            if !matches!(
                name,
                "Nats-Msg-Id" | "Content-Type" | "x-outbox-attempt" | "x-outbox-aggregate-key"
            ) {
                headers.insert(name.to_owned(), values[0].as_str().to_owned());
            }
        }
        Got {
            key: header(m, "Nats-Msg-Id").expect("Nats-Msg-Id").to_owned(),
            topic: m
                .subject
                .as_str()
                .strip_prefix(prefix)
                .expect("prefix")
                .to_owned(),
            payload: m.payload.to_vec(),
            content_type: header(m, "Content-Type").map(str::to_owned),
            attempt: header(m, "x-outbox-attempt")
                .expect("attempt")
                .parse()
                .unwrap(),
            aggregate_key: header(m, "x-outbox-aggregate-key").map(str::to_owned),
            headers,
        }
    }

    impl<T: Transport> Harness for NatsHarness<T> {
        type P = JetStreamPublisher;
        const DUPLICATES_KEPT: usize = 1;

        fn missing() -> Option<String> {
            T::missing()
        }

        async fn new() -> Self {
            let tune = |mut config: async_nats::jetstream::stream::Config| {
                config.max_message_size = MAX_MESSAGE;
                config
            };
            let server = T::server();
            let stream = match &server {
                Some(server) => TestStream::on(server.client().await, tune).await,
                None => TestStream::with(tune).await,
            };
            NatsHarness {
                stream,
                server,
                transport: std::marker::PhantomData,
            }
        }

        async fn publisher(&self) -> JetStreamPublisher {
            T::builder(self.server.as_ref(), false)
                .subject_prefix(&self.stream.prefix)
                .ack_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap()
        }

        async fn out_of_reach(&self) -> JetStreamPublisher {
            let stream = match &self.server {
                Some(server) => TestStream::on(server.client().await, |c| c).await,
                None => TestStream::new().await,
            };
            let publisher = T::builder(self.server.as_ref(), false)
                .subject_prefix(&stream.prefix)
                .ack_timeout(Duration::from_secs(5))
                .connect()
                .await
                .unwrap();
            stream.jetstream.delete_stream(&stream.name).await.unwrap();
            publisher
        }

        fn refused(&self, key: &str) -> Record {
            // Over the stream's max_message_size: the stream answers with an error.
            let mut r = record(key, "ok.batch");
            r.payload = vec![b'x'; 2 * MAX_MESSAGE as usize];
            r
        }

        async fn received(&mut self, n: usize) -> Vec<Got> {
            let stream = &self.stream;
            eventually(DEADLINE, "stored messages", || async move {
                (stream.stored().await >= n as u64).then_some(())
            })
            .await;
            let prefix = self.stream.prefix.clone();
            self.stream
                .messages()
                .await
                .iter()
                .map(|m| got(&prefix, m))
                .collect()
        }

        async fn shown_with_secret(&self) -> Vec<String> {
            let builder = T::builder(self.server.as_ref(), true);
            let mut shown = vec![format!("{builder:?}")];
            shown.push(builder.connect().await.unwrap_err().to_string());
            if self.server.is_none() {
                // The shared server has no authentication and ignores credentials.
                let url = nats_url().replacen("nats://", "nats://relay:s3cret@", 1);
                let connected = JetStreamPublisher::builder(url)
                    .subject_prefix(&self.stream.prefix)
                    .connect()
                    .await
                    .unwrap();
                shown.push(format!("{connected:?}"));
            }
            shown.push(format!("{:?}", self.publisher().await));
            shown
        }
    }
}

#[cfg(feature = "kafka")]
mod kafka_harness {
    use super::*;
    use common::kafka::{Tansu, brokers, read};
    use diesel_outbox::kafka::{KafkaPublisher, Topology};

    /// The largest message the harness's publishers send: the refused record is larger.
    const MAX_MESSAGE: usize = 64 * 1024;
    /// The topics the contract publishes to.
    const TOPICS: [&str; 4] = ["ok.order.created", "ok.batch", "ok.x", "ok.dup"];

    /// Topics of its own (one partition each, so that one topic's order is the publish
    /// order) under a unique prefix, on the shared brokers.
    pub(super) struct KafkaHarness {
        prefix: String,
    }

    impl KafkaHarness {
        fn topics(&self) -> Vec<String> {
            TOPICS
                .iter()
                .map(|t| format!("{}{t}", self.prefix))
                .collect()
        }
    }

    fn got(prefix: &str, m: common::kafka::Read) -> Got {
        let mut headers = m.headers;
        let mut take = |name: &str| headers.remove(name);
        Got {
            key: take("x-outbox-message-id").expect("the idempotency key"),
            topic: m.topic.strip_prefix(prefix).expect("prefix").to_owned(),
            payload: m.payload,
            content_type: take("content-type"),
            attempt: take("x-outbox-attempt").expect("attempt").parse().unwrap(),
            aggregate_key: take("x-outbox-aggregate-key"),
            headers,
        }
    }

    impl Harness for KafkaHarness {
        type P = KafkaPublisher;
        /// Kafka stores a message each time it is produced.
        const DUPLICATES_KEPT: usize = 2;

        fn missing() -> Option<String> {
            common::kafka::missing().or_else(Tansu::missing)
        }

        async fn new() -> Self {
            let harness = KafkaHarness {
                prefix: format!("{}.", unique("outbox_contract")),
            };
            let mut topology = Topology::new().replication(1);
            for topic in harness.topics() {
                topology = topology.topic(topic, 1);
            }
            topology
                .declare(&brokers())
                .await
                .expect("declare the topics");
            harness
        }

        async fn publisher(&self) -> KafkaPublisher {
            KafkaPublisher::builder(brokers())
                .topic_prefix(&self.prefix)
                .delivery_timeout(Duration::from_secs(10))
                .max_message_bytes(MAX_MESSAGE)
                .connect()
                .await
                .unwrap()
        }

        async fn out_of_reach(&self) -> KafkaPublisher {
            // Brokers of its own that go away once the publisher is connected.
            let mut tansu = Tansu::start();
            let publisher = KafkaPublisher::builder(&tansu.brokers)
                .topic_prefix(&self.prefix)
                .delivery_timeout(Duration::from_secs(3))
                .connect()
                .await
                .unwrap();
            tansu.stop();
            publisher
        }

        fn refused(&self, key: &str) -> Record {
            // Over the producer's message.max.bytes: refused before it is sent.
            let mut r = record(key, "ok.batch");
            r.payload = vec![b'x'; 2 * MAX_MESSAGE];
            r
        }

        async fn received(&mut self, n: usize) -> Vec<Got> {
            read(&brokers(), &self.topics(), 1, n)
                .await
                .into_iter()
                .map(|m| got(&self.prefix, m))
                .collect()
        }

        async fn shown_with_secret(&self) -> Vec<String> {
            let builder = KafkaPublisher::builder("relay:s3cret@127.0.0.1:1");
            let mut shown = vec![format!("{builder:?}")];
            shown.push(builder.connect().await.unwrap_err().to_string());
            shown.push(format!("{:?}", self.publisher().await));
            shown
        }
    }
}
