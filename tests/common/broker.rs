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

pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.to_owned())
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
