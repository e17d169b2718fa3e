//! Declaring on RabbitMQ what a relay publishes to and a consumer consumes from.

use std::collections::BTreeMap;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use super::Endpoint;
use super::connection::classify;
use crate::error::{Error, Result};
use crate::publisher::PublishError;
use crate::tls::Tls;

/// How long a declaration waits for the broker: to connect, and then for its answers.
const DECLARE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a relay and its consumers need on RabbitMQ, declared in one call: a durable topic
/// exchange for the relay, and for each consumer a durable queue bound to it, whose
/// rejected messages go to a dead-letter exchange and queue of their own (both named
/// `<queue>.dead`).
///
/// Declaring is idempotent: what exists with the same settings is left as it is; what
/// exists with other settings (a queue declared without its dead-letter exchange, say) is
/// an error that names it, and nothing is changed.
///
/// ```no_run
/// use diesel_outbox::rabbitmq::Topology;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// Topology::exchange("events")
///     .queue("invoicing", "order.*")
///     .declare("amqp://guest:guest@127.0.0.1:5672/%2f")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Topology {
    exchange: String,
    queues: Vec<(String, String)>,
    dead_letters: bool,
    tls: Option<Tls>,
}

impl Topology {
    /// A durable topic exchange named `exchange`, which the relay publishes to.
    pub fn exchange(exchange: impl Into<String>) -> Self {
        Topology {
            exchange: exchange.into(),
            queues: Vec::new(),
            dead_letters: true,
            tls: None,
        }
    }

    /// A durable queue `queue`, bound to the exchange with `binding` (a routing key
    /// pattern: `#` takes every topic, `order.*` the topics `order.<anything>`). Defaults
    /// to no queue.
    pub fn queue(mut self, queue: impl Into<String>, binding: impl Into<String>) -> Self {
        self.queues.push((queue.into(), binding.into()));
        self
    }

    /// Queues without a dead-letter exchange and queue: a rejected message is dropped.
    /// Defaults to each queue's rejected messages going to `<queue>.dead`.
    pub fn without_dead_letters(mut self) -> Self {
        self.dead_letters = false;
        self
    }

    /// TLS settings for an `amqps://` URL. Defaults to the platform's roots.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Declares everything on the broker at `url`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a malformed URL, a name over 255 bytes, or something that
    /// exists with other settings (named); [`Error::Publish`] when the broker cannot be
    /// reached or does not answer within 10 s.
    pub async fn declare(&self, url: &str) -> Result<()> {
        let endpoint = Endpoint::new(url, self.tls.as_ref()).map_err(Error::InvalidOption)?;
        let unreachable = |e: lapin::Error| {
            Error::Publish(classify(&e, format!("RabbitMQ at {}: {e}", endpoint.name)).into())
        };
        // A broker that takes the connection and never answers must not hold the caller
        // for ever.
        let connection =
            tokio::time::timeout(DECLARE_TIMEOUT, endpoint.connect("diesel-outbox declare"))
                .await
                .map_err(|_| {
                    Error::Publish(
                        PublishError::unavailable(format!(
                            "RabbitMQ at {}: no answer within {DECLARE_TIMEOUT:?}",
                            endpoint.name
                        ))
                        .into(),
                    )
                })?
                .map_err(unreachable)?;
        let declared = tokio::time::timeout(
            DECLARE_TIMEOUT,
            self.declare_on(&connection, &endpoint.name),
        )
        .await
        .unwrap_or_else(|_| {
            Err(Error::Publish(
                PublishError::unavailable(format!(
                    "RabbitMQ at {}: the declarations had no answer within {DECLARE_TIMEOUT:?}",
                    endpoint.name
                ))
                .into(),
            ))
        });
        let _ = connection.close(200, "declared".into()).await;
        declared
    }

    async fn declare_on(&self, connection: &lapin::Connection, endpoint: &str) -> Result<()> {
        // One channel: a declaration the broker refuses closes it, and ends the declaring.
        let on = connection
            .create_channel()
            .await
            .map_err(|e| Error::Publish(format!("RabbitMQ at {endpoint}: {e}").into()))?;
        let declared = self.declare_with(&on).await;
        if declared.is_ok() {
            let _ = on.close(200, "declared".into()).await;
        }
        declared
    }

    async fn declare_with(&self, on: &Channel) -> Result<()> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let exchange = name(&self.exchange)?;
        refused(
            on.exchange_declare(
                exchange.clone(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await,
            &format!("exchange `{}`", self.exchange),
        )?;
        for (queue, binding) in &self.queues {
            let mut args = FieldTable::default();
            if self.dead_letters {
                let dead = format!("{queue}.dead");
                refused(
                    on.exchange_declare(
                        name(&dead)?,
                        ExchangeKind::Fanout,
                        durable,
                        FieldTable::default(),
                    )
                    .await,
                    &format!("exchange `{dead}`"),
                )?;
                declare_queue(on, &dead, FieldTable::default()).await?;
                bind(on, &dead, &dead, "").await?;
                args = FieldTable::from(BTreeMap::from([(
                    ShortString::from("x-dead-letter-exchange"),
                    AMQPValue::LongString(dead.as_str().into()),
                )]));
            }
            declare_queue(on, queue, args).await?;
            bind(on, queue, &self.exchange, binding).await?;
        }
        Ok(())
    }
}

async fn declare_queue(channel: &Channel, queue: &str, args: FieldTable) -> Result<()> {
    let options = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    refused(
        channel
            .queue_declare(name(queue)?, options, args)
            .await
            .map(|_| ()),
        &format!("queue `{queue}`"),
    )
}

async fn bind(channel: &Channel, queue: &str, exchange: &str, binding: &str) -> Result<()> {
    refused(
        channel
            .queue_bind(
                name(queue)?,
                name(exchange)?,
                name(binding)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await,
        &format!("the binding of `{queue}` to `{exchange}` with `{binding}`"),
    )
}

/// A declaration the broker refused: something of that name exists with other settings.
fn refused(result: lapin::Result<()>, what: &str) -> Result<()> {
    result.map_err(|e| {
        Error::InvalidOption(format!(
            "{what} cannot be declared: {e} (it may exist with other settings: delete it, \
             or use it as it is)"
        ))
    })
}

fn name(text: &str) -> Result<ShortString> {
    ShortString::try_new(text.to_owned())
        .map_err(|_| Error::InvalidOption(format!("`{text}` is over 255 bytes")))
}
