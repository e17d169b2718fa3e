//! The broker side of a run: durable destinations, starting and stopping the local broker,
//! and the consumer (the crate's runner) that logs every delivery.

use std::net::ToSocketAddrs;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use diesel::sql_types::Text;
use diesel_async::RunQueryDsl;
use diesel_outbox::consumer::{self, Consumer, HandleError, handler_fn};
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;

use crate::Kind;
use crate::common;
use crate::common::broker::{amqp_authority, amqp_url, amqp_url_via, rabbitmqctl};
use crate::common::kafka::Tansu;
use crate::common::nats::nats_url;
use crate::common::proxy::FaultProxy;
use crate::harness::{Db, Delivery, Log, TOPIC};

/// The consumer: the crate's runner, so the checker's count of effects proves it applies
/// each message once through every fault. Every delivery (duplicates too) is logged as the
/// source hands it over, in delivery order.
pub(crate) async fn consume(broker: Broker, db: Db, log: Arc<Log>, running: Arc<AtomicBool>) {
    match broker {
        Broker::RabbitMq { queue, .. } => {
            let source = consumer::rabbitmq::Source::queue(amqp_url(), &queue);
            consume_from(source, db, log, running).await;
        }
        Broker::Nats { stream, prefix } => {
            let source = consumer::nats::Source::durable(nats_url(), &stream, CONSUMER)
                .subject_prefix(prefix);
            consume_from(source, db, log, running).await;
        }
        Broker::Kafka {
            brokers,
            prefix,
            topic,
            ..
        } => {
            let source =
                consumer::kafka::Source::group(brokers, CONSUMER, [topic]).topic_prefix(prefix);
            consume_from(source, db, log, running).await;
        }
    }
}

async fn consume_from<S: consumer::Source>(
    source: S,
    db: Db,
    log: Arc<Log>,
    running: Arc<AtomicBool>,
) {
    let effects = format!("{}.effects", db.schema);
    let pool = common::pool_for(8, db.url.clone()).await;
    let consumer = Consumer::builder(db.outbox.clone(), pool, "faults")
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

/// The durable JetStream consumer's name, and the Kafka consumer group's.
pub(crate) const CONSUMER: &str = "faults";

/// The Kafka topic's partitions.
const PARTITIONS: i32 = 4;

/// The broker side of one run: durable destinations that survive the broker's restart.
#[derive(Clone)]
pub(crate) enum Broker {
    RabbitMq {
        exchange: String,
        queue: String,
    },
    Nats {
        stream: String,
        prefix: String,
    },
    /// A Tansu of the run's own (its storage is memory: it is paused, never restarted),
    /// which names the fault proxy as its address, so that every client's every
    /// connection goes through the proxy.
    Kafka {
        tansu: Arc<Tansu>,
        /// The fault proxy's address.
        brokers: String,
        prefix: String,
        /// The topic (with the prefix) the relays produce to.
        topic: String,
    },
}

impl Broker {
    /// The broker's destinations, and the fault proxy in front of it that the relays
    /// connect through.
    pub(crate) async fn new(kind: Kind) -> (Broker, FaultProxy) {
        if kind == Kind::Kafka {
            return Broker::kafka().await;
        }
        let broker = Broker::declared(kind).await;
        let proxy = FaultProxy::start(broker.upstream()).await;
        (broker, proxy)
    }

    async fn kafka() -> (Broker, FaultProxy) {
        let [port] = common::cluster::free_ports();
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await;
        let tansu = Tansu::start_at(port, Some(proxy.addr), &[]);
        let name = common::unique("faults");
        let prefix = format!("{name}.");
        let topic = format!("{prefix}{TOPIC}");
        let partitions = u32::try_from(PARTITIONS).unwrap();
        diesel_outbox::kafka::Topology::new()
            .topic(&topic, partitions)
            .declare(&proxy.addr.to_string())
            .await
            .unwrap();
        let broker = Broker::Kafka {
            tansu: Arc::new(tansu),
            brokers: proxy.addr.to_string(),
            prefix,
            topic,
        };
        (broker, proxy)
    }

    async fn declared(kind: Kind) -> Broker {
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
                let config = stream::Config {
                    name: stream_name.clone(),
                    subjects: vec![format!("{prefix}>")],
                    storage: stream::StorageType::File,
                    ..Default::default()
                };
                common::nats::create_stream(&js, config).await;
                js.get_stream(&stream_name)
                    .await
                    .unwrap()
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
            Kind::Kafka => unreachable!("made by Broker::kafka"),
        }
    }

    /// Where the fault proxy forwards to.
    pub(crate) fn upstream(&self) -> std::net::SocketAddr {
        let authority = match self {
            Broker::RabbitMq { .. } => amqp_authority(),
            Broker::Nats { .. } => nats_url().trim_start_matches("nats://").to_owned(),
            Broker::Kafka { tansu, .. } => tansu.brokers.clone(),
        };
        authority.to_socket_addrs().unwrap().next().unwrap()
    }

    pub(crate) fn relay_args(&self) -> Vec<String> {
        let args: Vec<&str> = match self {
            Broker::RabbitMq { exchange, .. } => vec!["--exchange", exchange],
            Broker::Nats { prefix, .. } => vec!["--broker", "nats", "--subject-prefix", prefix],
            Broker::Kafka { prefix, .. } => vec!["--broker", "kafka", "--topic-prefix", prefix],
        };
        args.into_iter().map(str::to_owned).collect()
    }

    /// The broker URL the relays get: through the fault proxy.
    pub(crate) fn relay_env(&self, proxy: std::net::SocketAddr) -> (String, String) {
        match self {
            Broker::RabbitMq { .. } => ("AMQP_URL".into(), amqp_url_via(proxy)),
            Broker::Nats { .. } => ("NATS_URL".into(), format!("nats://{proxy}")),
            Broker::Kafka { .. } => ("KAFKA_BROKERS".into(), proxy.to_string()),
        }
    }

    /// What [`Broker::stop`] and [`Broker::start`] do, and what [`Broker::bounce`] does, as
    /// the run's summary names the faults.
    pub(crate) fn outage_faults(&self) -> (&'static str, &'static str) {
        match self {
            Broker::Kafka { .. } => (
                "broker paused beyond max_attempts × backoff max",
                "broker paused for less than a lease",
            ),
            _ => (
                "broker stopped beyond max_attempts × backoff max",
                "broker restart",
            ),
        }
    }

    /// Stops the broker (Kafka: pauses it, connections open and silent).
    pub(crate) fn stop(&self) {
        match self {
            Broker::RabbitMq { .. } => rabbitmqctl(&["stop_app"]),
            Broker::Nats { .. } => nats_server("--stop", &["--retry", "TERM/10/KILL/5"]),
            Broker::Kafka { tansu, .. } => tansu.pause(),
        }
    }

    /// Restarts the broker at once (Kafka, whose storage a restart would empty: pauses it
    /// for a second).
    pub(crate) async fn bounce(&self) {
        self.stop();
        if matches!(self, Broker::Kafka { .. }) {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.start();
    }

    pub(crate) fn start(&self) {
        match self {
            Broker::Kafka { tansu, .. } => tansu.resume(),
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

    /// Waits until the consumer has taken every message: the queue holds nothing, ready
    /// or unacknowledged.
    pub(crate) async fn wait_consumed(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.depth().await > 0 {
            if Instant::now() >= deadline {
                let positions = self.locate(&[]).await;
                panic!("the consumer never emptied the queue; at the broker: {positions}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Messages not yet consumed: ready, or delivered and not acknowledged.
    async fn depth(&self) -> u64 {
        match self {
            Broker::Kafka { brokers, topic, .. } => {
                let (brokers, topic) = (brokers.clone(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    common::kafka::lag(&brokers, CONSUMER, &topic, PARTITIONS).unwrap()
                })
                .await
                .unwrap()
            }
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

    /// Where the broker holds the messages with idempotency keys `keys`, as far as it can
    /// tell (a RabbitMQ queue or a JetStream stream is not searched).
    pub(crate) async fn locate(&self, keys: &[String]) -> String {
        match self {
            Broker::Kafka { brokers, topic, .. } => {
                let (brokers, topic, keys) = (brokers.clone(), topic.clone(), keys.to_vec());
                tokio::task::spawn_blocking(move || {
                    common::kafka::locate(&brokers, CONSUMER, &topic, PARTITIONS, &keys)
                        .unwrap_or_else(|e| format!("not read: {e}"))
                })
                .await
                .unwrap()
            }
            _ => "not searched on this broker".to_owned(),
        }
    }

    pub(crate) async fn delete(&self) {
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
            // The run's own Tansu goes with the last clone of it.
            Broker::Kafka { .. } => {}
        }
    }
}

/// Runs `start-stop-daemon` on the local nats-server; panics if it fails.
pub(crate) fn nats_server(action: &str, args: &[&str]) {
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
