//! RabbitMQ fixtures: a unique exchange and an exclusive queue per test.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};

/// RabbitMQ's URL ([`super::services`]; panics, saying what to start or set, if there is
/// none).
pub fn amqp_url() -> String {
    super::services::url(super::services::Service::RabbitMq)
}

/// `amqp_url()` with its host and port replaced (to go through a proxy).
pub fn amqp_url_via(addr: std::net::SocketAddr) -> String {
    let url = amqp_url();
    let (scheme, rest) = url.split_once("://").expect("scheme");
    let (userinfo, rest) = rest.rsplit_once('@').map_or(("", rest), |(u, r)| (u, r));
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    let at = if userinfo.is_empty() { "" } else { "@" };
    format!("{scheme}://{userinfo}{at}{addr}{path}")
}

/// `host:port` of `amqp_url()`.
pub fn amqp_authority() -> String {
    let url = amqp_url();
    let rest = url.split_once("://").expect("scheme").1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split('/').next().expect("authority").to_owned()
}

/// Runs `rabbitmqctl` on the local broker, quietly; panics if it fails.
pub fn rabbitmqctl(args: &[&str]) {
    let status = std::process::Command::new("rabbitmqctl")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

pub async fn connect() -> Connection {
    match Connection::connect(&amqp_url(), ConnectionProperties::default()).await {
        Ok(conn) => conn,
        Err(e) => panic!(
            "RabbitMQ is not reachable ({e}). Start it with `rabbitmq-server -detached` \
             or point AMQP_URL at one."
        ),
    }
}

/// A topic exchange of the test's own and an exclusive queue bound to `binding`.
pub struct TestBroker {
    pub exchange: String,
    pub queue: String,
    pub channel: Channel,
    _connection: Connection,
}

impl TestBroker {
    pub async fn new(binding: &str) -> TestBroker {
        Self::with_queue_args(binding, FieldTable::default()).await
    }

    pub async fn with_queue_args(binding: &str, args: FieldTable) -> TestBroker {
        let connection = connect().await;
        let channel = connection.create_channel().await.unwrap();
        let exchange = super::unique("x");
        let queue = super::unique("q");
        declare(&channel, &exchange, &queue, false, binding, args).await;
        TestBroker {
            exchange,
            queue,
            channel,
            _connection: connection,
        }
    }

    pub async fn consumer(&self) -> Consumer {
        self.channel
            .basic_consume(
                self.queue.as_str().into(),
                super::unique("c").as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap()
    }
}

/// Declares a topic exchange and a queue bound to it with `binding`: durable ones (which
/// survive a broker restart, and must be deleted by the caller), or an auto-deleted exchange
/// and an exclusive queue.
pub async fn declare(
    channel: &Channel,
    exchange: &str,
    queue: &str,
    durable: bool,
    binding: &str,
    args: FieldTable,
) {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable,
                auto_delete: !durable,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                durable,
                exclusive: !durable,
                auto_delete: !durable,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// The next delivery, acked, or `None` if none arrives within `wait`.
pub async fn next(consumer: &mut Consumer, wait: Duration) -> Option<Delivery> {
    let delivery = tokio::time::timeout(wait, consumer.next())
        .await
        .ok()??
        .expect("delivery");
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    Some(delivery)
}

pub fn message_id(delivery: &Delivery) -> String {
    delivery
        .properties
        .message_id()
        .as_ref()
        .expect("message id")
        .to_string()
}

/// A queue that other connections can consume (the consumer runner opens its own), bound
/// to a topic exchange with `#`, whose rejected messages go to a dead-letter queue. All of
/// it is deleted when this is dropped.
pub struct SharedQueue {
    pub exchange: String,
    pub queue: String,
    pub dead_letters: String,
    pub channel: Channel,
    _connection: Connection,
}

impl SharedQueue {
    pub async fn new() -> SharedQueue {
        let connection = connect().await;
        let channel = connection.create_channel().await.unwrap();
        let exchange = super::unique("x");
        let queue = super::unique("q");
        let dead_exchange = format!("{exchange}.dead");
        let dead_letters = format!("{queue}.dead");
        let shared = |durable| QueueDeclareOptions {
            durable,
            ..Default::default()
        };
        for (name, kind) in [
            (&exchange, ExchangeKind::Topic),
            (&dead_exchange, ExchangeKind::Fanout),
        ] {
            channel
                .exchange_declare(
                    name.as_str().into(),
                    kind,
                    ExchangeDeclareOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        channel
            .queue_declare(
                dead_letters.as_str().into(),
                shared(false),
                FieldTable::default(),
            )
            .await
            .unwrap();
        let args = FieldTable::from(std::collections::BTreeMap::from([(
            "x-dead-letter-exchange".into(),
            lapin::types::AMQPValue::LongString(dead_exchange.as_str().into()),
        )]));
        channel
            .queue_declare(queue.as_str().into(), shared(false), args)
            .await
            .unwrap();
        for (q, x, binding) in [
            (&queue, &exchange, "#"),
            (&dead_letters, &dead_exchange, ""),
        ] {
            channel
                .queue_bind(
                    q.as_str().into(),
                    x.as_str().into(),
                    binding.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
        }
        SharedQueue {
            exchange,
            queue,
            dead_letters,
            channel,
            _connection: connection,
        }
    }

    /// Publishes as a relay would: message id = `key`, the attempt header, and the
    /// aggregate header when given; waits for the broker's confirm.
    pub async fn publish(&self, key: &str, topic: &str, payload: &[u8], aggregate: Option<&str>) {
        let mut headers = std::collections::BTreeMap::from([(
            diesel_outbox::ATTEMPT_HEADER.into(),
            lapin::types::AMQPValue::LongLongInt(1),
        )]);
        if let Some(aggregate) = aggregate {
            headers.insert(
                diesel_outbox::AGGREGATE_HEADER.into(),
                lapin::types::AMQPValue::LongString(aggregate.into()),
            );
        }
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                topic.into(),
                lapin::options::BasicPublishOptions::default(),
                payload,
                lapin::BasicProperties::default()
                    .with_message_id(key.into())
                    .with_headers(FieldTable::from(headers)),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Messages ready in `queue` (unacknowledged ones are not counted).
    pub async fn ready(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }
}

impl Drop for SharedQueue {
    fn drop(&mut self) {
        let queues = [self.queue.clone(), self.dead_letters.clone()];
        let exchanges = [self.exchange.clone(), format!("{}.dead", self.exchange)];
        super::block_on_aside(async move {
            let Ok(conn) = Connection::connect(&amqp_url(), ConnectionProperties::default()).await
            else {
                return;
            };
            let Ok(channel) = conn.create_channel().await else {
                return;
            };
            for q in &queues {
                let _ = channel
                    .queue_delete(
                        q.as_str().into(),
                        lapin::options::QueueDeleteOptions::default(),
                    )
                    .await;
            }
            for x in &exchanges {
                let _ = channel
                    .exchange_delete(
                        x.as_str().into(),
                        lapin::options::ExchangeDeleteOptions::default(),
                    )
                    .await;
            }
        });
    }
}

/// The local RabbitMQ's TLS listener and the certificates `.ci/rabbitmq-tls` made for it:
/// `AMQPS_URL` (default `amqps://guest:guest@localhost:5671/%2f`) and `AMQPS_TLS_DIR`
/// (default `/etc/rabbitmq/outbox-tls`, holding `ca.pem`, and `client.pem` and `client.key`
/// for the user `outbox-tls-client`).
pub struct Amqps {
    pub url: String,
    pub ca: std::path::PathBuf,
    pub client_cert: std::path::PathBuf,
    pub client_key: std::path::PathBuf,
}

impl Amqps {
    /// What this machine lacks for the TLS tests of RabbitMQ, if anything.
    pub fn missing() -> Option<String> {
        let dir =
            std::env::var("AMQPS_TLS_DIR").unwrap_or_else(|_| "/etc/rabbitmq/outbox-tls".into());
        let on = std::path::Path::new(&dir).join("ca.pem").exists()
            && std::net::TcpStream::connect("127.0.0.1:5671").is_ok();
        (!on).then(|| {
            format!(
                "RabbitMQ's TLS listener is not on 127.0.0.1:5671 with its certificates in \
                 {dir}: run .ci/rabbitmq-tls (as .ci/run does), or set AMQPS_URL and \
                 AMQPS_TLS_DIR"
            )
        })
    }

    pub fn local() -> Amqps {
        let url = std::env::var("AMQPS_URL")
            .unwrap_or_else(|_| "amqps://guest:guest@localhost:5671/%2f".to_owned());
        let dir = std::path::PathBuf::from(
            std::env::var("AMQPS_TLS_DIR").unwrap_or_else(|_| "/etc/rabbitmq/outbox-tls".into()),
        );
        let amqps = Amqps {
            url,
            ca: dir.join("ca.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        };
        assert!(
            amqps.ca.exists() && std::net::TcpStream::connect("127.0.0.1:5671").is_ok(),
            "RabbitMQ's TLS listener is not on 127.0.0.1:5671 with its certificates in {}: \
             run .ci/rabbitmq-tls (as .ci/run does), or set AMQPS_URL and AMQPS_TLS_DIR",
            dir.display()
        );
        amqps
    }

    /// The TLS settings that trust the listener's CA.
    pub fn tls(&self) -> diesel_outbox::Tls {
        diesel_outbox::Tls::new().ca_file(&self.ca)
    }

    /// The URL without user info, logging in with the client certificate (EXTERNAL).
    pub fn external_url(&self) -> String {
        let rest = self.url.split_once("://").expect("scheme").1;
        let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
        format!("amqps://{rest}?auth_mechanism=external")
    }
}

/// `rabbitmqctl list_connections ssl client_properties`: whether each connection whose
/// client properties mention `name` is over TLS.
pub fn connections_named(name: &str) -> Vec<bool> {
    let out = std::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "-q",
            "--no-table-headers",
            "ssl",
            "client_properties",
        ])
        .output()
        .expect("rabbitmqctl");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.contains(name))
        .map(|line| line.starts_with("true"))
        .collect()
}

/// Deletes `queues` and `exchanges` (what a test declared), ignoring what is gone already.
pub async fn delete(queues: &[&str], exchanges: &[&str]) {
    let amqp = connect().await;
    let channel = amqp.create_channel().await.unwrap();
    for q in queues {
        let _ = channel.queue_delete((*q).into(), Default::default()).await;
    }
    for x in exchanges {
        let _ = channel
            .exchange_delete((*x).into(), Default::default())
            .await;
    }
}
