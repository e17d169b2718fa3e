//! The consumer runner's RabbitMQ source, public as `consumer::rabbitmq::Source` (its
//! docs are there).

use std::fmt;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::Acker;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, Connection};

use super::Endpoint;
use crate::consumer::{Delivery, Incoming, Reconnecting, Settle};
use crate::error::BoxError;
use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER};
use crate::tls::Tls;

/// The longest a connection and its subscription may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// While waiting for a delivery, how often the connection is looked at: one that died
/// without the subscription saying so is reopened.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// A RabbitMQ queue as the source of a [`Consumer`](crate::consumer::Consumer).
pub struct Source {
    url: String,
    /// The broker: the URL parsed and the TLS files read (or why that failed, which the
    /// consumer's `build()` reports).
    endpoint: Result<Endpoint, String>,
    queue: String,
    tag: String,
    link: Reconnecting<Live>,
}

struct Live {
    connection: Connection,
    channel: Channel,
    consumer: lapin::Consumer,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Source")
            .field("endpoint", &self.endpoint_name())
            .field("queue", &self.queue)
            .field("connected", &self.link.is_live())
            .finish_non_exhaustive()
    }
}

impl Source {
    /// Consumes `queue` on the broker at `url` (`amqp://user:pass@host:port/vhost`, or
    /// `amqps://` for TLS; `?auth_mechanism=external` logs in with the client certificate
    /// of [`Source::tls`]). The queue must exist; give it a dead-letter exchange to keep
    /// rejected messages.
    pub fn queue(url: impl AsRef<str>, queue: impl Into<String>) -> Self {
        Source {
            url: url.as_ref().to_owned(),
            endpoint: Endpoint::new(url.as_ref(), None),
            queue: queue.into(),
            tag: format!("diesel-outbox-{}", uuid::Uuid::new_v4().simple()),
            link: Reconnecting::default(),
        }
    }

    /// TLS settings for an `amqps://` URL: a CA file to trust besides the platform's roots,
    /// and a client certificate (which `?auth_mechanism=external` in the URL logs in with).
    /// The files are read here; a problem with them is reported by the consumer's
    /// `build()`. The server's certificate and name are always verified. Defaults to the
    /// platform's roots and no client certificate.
    #[must_use]
    pub fn tls(mut self, tls: Tls) -> Self {
        self.endpoint = Endpoint::new(&self.url, Some(&tls));
        self
    }

    /// How the broker is named in errors and logs (never the URL).
    fn endpoint_name(&self) -> &str {
        self.endpoint
            .as_ref()
            .map_or("(malformed URL)", |e| e.name.as_str())
    }
}

/// Opens a connection, a channel with `prefetch`, and the subscription to `queue`.
async fn connect(
    endpoint: Result<Endpoint, String>,
    queue: String,
    tag: String,
    prefetch: u16,
) -> Result<Live, String> {
    let endpoint = endpoint?;
    let name = ShortString::try_new(queue.clone())
        .map_err(|_| "the queue name is over 255 bytes".to_owned())?;
    let opening = async {
        let connection = endpoint
            .connect(&format!("diesel-outbox consumer of {queue}"))
            .await?;
        let channel = connection.create_channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await?;
        let consumer = channel
            .basic_consume(
                name,
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok::<_, lapin::Error>(Live {
            connection,
            channel,
            consumer,
        })
    };
    let endpoint = &endpoint.name;
    match tokio::time::timeout(CONNECT_TIMEOUT, opening).await {
        Ok(Ok(live)) => {
            tracing::info!(endpoint = %endpoint, queue = %queue, "consuming from RabbitMQ");
            Ok(live)
        }
        Ok(Err(e)) => Err(format!(
            "consuming {queue} on RabbitMQ at {endpoint} failed: {e}"
        )),
        Err(_) => Err(format!(
            "consuming {queue} on RabbitMQ at {endpoint}: no answer within {CONNECT_TIMEOUT:?}"
        )),
    }
}

impl crate::consumer::Source for Source {
    fn check(&self) -> Result<(), BoxError> {
        self.endpoint.as_ref().map_err(|e| e.clone())?;
        if self.queue.len() > 255 {
            return Err("the queue name is over 255 bytes".into());
        }
        Ok(())
    }

    async fn verify(&mut self) -> Result<(), String> {
        let Ok(endpoint) = &self.endpoint else {
            return Ok(());
        };
        let check = async {
            let connection = endpoint
                .connect(&format!("diesel-outbox consumer of {}", self.queue))
                .await?;
            let exists = async {
                let channel = connection.create_channel().await?;
                channel
                    .queue_declare(
                        self.queue.as_str().into(),
                        QueueDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                // Closed before the connection, which lapin would otherwise log as an error.
                channel.close(200, "checked".into()).await
            }
            .await;
            let _ = connection.close(200, "checked".into()).await;
            exists
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, check).await {
            Ok(Err(e)) if super::not_found(&e) => Err(format!(
                "queue `{}` does not exist on RabbitMQ at {}: declare it (rabbitmq::Topology, \
                 or diesel-outbox declare) or fix the name",
                self.queue, endpoint.name
            )),
            // Out of reach: the runner's loop waits for the broker.
            _ => Ok(()),
        }
    }

    async fn next(&mut self, prefetch: u16) -> Result<Incoming, BoxError> {
        loop {
            let live = self
                .link
                .get(|| {
                    Box::pin(connect(
                        self.endpoint.clone(),
                        self.queue.clone(),
                        self.tag.clone(),
                        prefetch,
                    ))
                })
                .await?;
            let next = tokio::time::timeout(LIVENESS_CHECK, live.consumer.next()).await;
            let Ok(next) = next else {
                if live.connection.status().connected() {
                    continue;
                }
                self.link.lost();
                return Err(format!(
                    "lost the connection to RabbitMQ at {}",
                    self.endpoint_name()
                )
                .into());
            };
            match next {
                Some(Ok(message)) => match delivery(&message) {
                    Some(delivery) => {
                        return Ok(Incoming {
                            delivery,
                            settle: Box::new(RabbitSettle(message.acker)),
                        });
                    }
                    None => {
                        tracing::error!(
                            queue = %self.queue, topic = %message.routing_key,
                            "a message without a message id cannot be deduplicated: rejected"
                        );
                        let _ = message
                            .acker
                            .reject(BasicRejectOptions { requeue: false })
                            .await;
                    }
                },
                Some(Err(e)) => {
                    self.link.lost();
                    return Err(format!("RabbitMQ at {}: {e}", self.endpoint_name()).into());
                }
                None => {
                    self.link.lost();
                    return Err(format!(
                        "RabbitMQ at {} ended the subscription to {}",
                        self.endpoint_name(),
                        self.queue
                    )
                    .into());
                }
            }
        }
    }

    async fn close(&mut self) {
        if let Some(live) = self.link.take() {
            let _ = live
                .channel
                .basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default())
                .await;
            let _ = live.channel.close(200, "consumer stopped".into()).await;
            let _ = live.connection.close(200, "consumer stopped".into()).await;
        }
    }
}

/// A message as a [`Delivery`]; `None` without a message id.
fn delivery(message: &lapin::message::Delivery) -> Option<Delivery> {
    let properties = &message.properties;
    let key = properties.message_id().as_ref()?.to_string();
    let mut delivery = Delivery::new(key, message.routing_key.to_string(), message.data.clone());
    delivery.content_type = properties.content_type().as_ref().map(|c| c.to_string());
    delivery.redelivered = message.redelivered;
    if let Some(headers) = properties.headers() {
        for (name, value) in headers.inner() {
            let name = name.as_str();
            if name == ATTEMPT_HEADER {
                delivery.attempt = integer(value).unwrap_or(1);
            } else if name == AGGREGATE_HEADER {
                delivery.aggregate_key = text(value);
            } else if let Some(value) = text(value) {
                delivery.headers.insert(name.to_owned(), value);
            }
        }
    }
    Some(delivery)
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    }
}

fn integer(value: &AMQPValue) -> Option<u32> {
    let n: i64 = match value {
        AMQPValue::LongLongInt(n) => *n,
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        _ => return None,
    };
    u32::try_from(n).ok()
}

struct RabbitSettle(Acker);

impl Settle for RabbitSettle {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { settled(self.0.ack(BasicAckOptions::default()).await) })
    }

    fn reject(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { settled(self.0.reject(BasicRejectOptions { requeue: false }).await) })
    }
}

/// lapin answers `false` when it could not settle (the channel is gone, or the delivery was
/// settled already).
fn settled(answer: lapin::Result<bool>) -> Result<(), BoxError> {
    match answer {
        Ok(true) => Ok(()),
        Ok(false) => Err("the channel that delivered it is gone".into()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_endpoint_and_never_the_url() {
        let source = Source::queue("amqp://relay:s3cret@mq.internal:5672/%2f", "orders");
        let shown = format!("{source:?}");
        assert!(shown.contains("mq.internal:5672"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        let bad = Source::queue("amqp://relay:s3cret@[bad", "orders");
        assert!(!format!("{bad:?}").contains("s3cret"));
    }
}
