//! Where lapin is touched: the RabbitMQ publisher (feature `rabbitmq`).
//!
//! Each record goes to one exchange with its topic as routing key, as a persistent message
//! (delivery mode 2) whose message id is the idempotency key, with the record's content type
//! and headers, the enqueue time as timestamp, and the headers `x-outbox-attempt` (integer)
//! and, when set, `x-outbox-aggregate-key`. Publisher confirms are always on: a record
//! counts as published only after the broker's ack. With `mandatory` (the default) an
//! unroutable message comes back and is a transient failure, so it is retried and finally
//! dead-lettered, never silently dropped. A nack, a confirm timeout and a lost channel or
//! connection are transient failures too. A claimed batch is pipelined: every record is
//! published, then every confirm awaited.
//!
//! The publisher reconnects by itself: after the channel or the connection dies, the next
//! batch opens new ones (with backoff between failed attempts). URLs and passwords never
//! appear in its `Debug` output, its errors or its logs. Each batch publishes on a channel
//! of its own, so a returned message is always matched to its own batch.
//!
//! Hazard: lapin itself logs a returned message, payload included, at `warn` level under
//! the `lapin` target. Filter it out (`lapin=error`, as the `diesel-outbox` binary does)
//! wherever payloads must not reach the logs.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::{self, FuturesUnordered};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::publisher::{BatchResults, PublishError, Publisher, Record};

/// The header carrying the attempt number (1 for the first delivery).
pub const ATTEMPT_HEADER: &str = "x-outbox-attempt";
/// The header carrying the aggregate key, when the message has one.
pub const AGGREGATE_HEADER: &str = "x-outbox-aggregate-key";

const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(10);

/// Publishes records to a RabbitMQ exchange with publisher confirms; see the
/// [module docs](self).
///
/// ```no_run
/// use diesel_outbox::rabbitmq::RabbitMqPublisher;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// let publisher = RabbitMqPublisher::builder("amqp://guest:guest@127.0.0.1:5672/%2f", "events")
///     .connect()
///     .await?;
/// # let _ = publisher; Ok(()) }
/// ```
pub struct RabbitMqPublisher {
    uri: AMQPUri,
    endpoint: String,
    exchange: ShortString,
    mandatory: bool,
    confirm_timeout: Duration,
    link: Mutex<Link>,
}

impl fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqPublisher")
            .field("endpoint", &self.endpoint)
            .field("exchange", &self.exchange.as_str())
            .field("mandatory", &self.mandatory)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

/// The current connection, its idle confirm channels, and when a failed reconnect may be
/// tried again.
///
/// Each batch publishes on a channel of its own: the broker's returns (unroutable messages)
/// arrive on the channel they were published on, and lapin hands them out with whichever
/// confirm of that channel resolves next, so a channel shared by two batches could give one
/// batch's return to the other and let an unroutable message count as sent.
#[derive(Default)]
struct Link {
    connection: Option<Connection>,
    idle: Vec<Channel>,
    backoff: Option<Duration>,
    retry_at: Option<Instant>,
}

/// Configures a [`RabbitMqPublisher`]; from [`RabbitMqPublisher::builder`].
#[must_use]
pub struct RabbitMqPublisherBuilder {
    url: String,
    exchange: String,
    mandatory: bool,
    confirm_timeout: Duration,
}

impl fmt::Debug for RabbitMqPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqPublisherBuilder")
            .field("exchange", &self.exchange)
            .field("mandatory", &self.mandatory)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

impl RabbitMqPublisher {
    /// A publisher to `exchange` on the broker at `url` (`amqp://user:pass@host:port/vhost`).
    /// The exchange must exist: declare it in your deployment or at start-up.
    pub fn builder(
        url: impl Into<String>,
        exchange: impl Into<String>,
    ) -> RabbitMqPublisherBuilder {
        RabbitMqPublisherBuilder {
            url: url.into(),
            exchange: exchange.into(),
            mandatory: true,
            confirm_timeout: Duration::from_secs(10),
        }
    }

    /// The exchange records are published to.
    pub fn exchange(&self) -> &str {
        self.exchange.as_str()
    }

    /// A confirm channel for one batch's exclusive use, opening a new connection or channel
    /// when needed. Give it back with [`RabbitMqPublisher::give_back`].
    async fn channel(&self) -> std::result::Result<Channel, String> {
        let mut link = self.link.lock().await;
        while let Some(channel) = link.idle.pop() {
            if channel.status().connected() {
                return Ok(channel);
            }
        }
        let connected = link
            .connection
            .as_ref()
            .is_some_and(|c| c.status().connected());
        if !connected {
            if let Some(at) = link.retry_at
                && Instant::now() < at
            {
                return Err(format!(
                    "RabbitMQ at {} is unreachable; reconnecting in {:?}",
                    self.endpoint,
                    at - Instant::now()
                ));
            }
            // A broker that accepts the socket but never finishes the handshake must not
            // hold the publisher (and this lock) forever.
            let connecting = tokio::time::timeout(
                self.confirm_timeout,
                Connection::connect_uri(self.uri.clone(), ConnectionProperties::default()),
            )
            .await
            .map_err(|_| format!("no handshake within {:?}", self.confirm_timeout))
            .and_then(|connected| connected.map_err(|e| e.to_string()));
            match connecting {
                Ok(connection) => {
                    tracing::info!(endpoint = %self.endpoint, "connected to RabbitMQ");
                    link.connection = Some(connection);
                }
                Err(e) => {
                    let delay = link
                        .backoff
                        .map_or(RECONNECT_MIN, |d| (d * 2).min(RECONNECT_MAX));
                    link.backoff = Some(delay);
                    link.retry_at = Some(Instant::now() + delay);
                    tracing::warn!(endpoint = %self.endpoint, error = %e, retry_in = ?delay, "connecting to RabbitMQ failed");
                    return Err(format!(
                        "connecting to RabbitMQ at {} failed: {e}",
                        self.endpoint
                    ));
                }
            }
        }
        let connection = link.connection.as_ref().expect("connected above");
        let opening = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            Ok::<_, lapin::Error>(channel)
        };
        let channel = match tokio::time::timeout(self.confirm_timeout, opening).await {
            Ok(opened) => opened.map_err(|e| {
                format!(
                    "opening a confirm channel on RabbitMQ at {} failed: {e}",
                    self.endpoint
                )
            })?,
            Err(_) => {
                return Err(format!(
                    "opening a confirm channel on RabbitMQ at {} took over {:?}",
                    self.endpoint, self.confirm_timeout
                ));
            }
        };
        link.backoff = None;
        link.retry_at = None;
        Ok(channel)
    }

    /// Returns a channel after a batch whose confirms all arrived.
    async fn give_back(&self, channel: Channel) {
        if channel.status().connected() {
            self.link.lock().await.idle.push(channel);
        }
    }

    /// Publishes every record, then awaits every confirm (up to the confirm timeout).
    async fn publish_pipelined(
        &self,
        records: &[Record],
    ) -> Vec<std::result::Result<(), PublishError>> {
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(why) => {
                return records
                    .iter()
                    .map(|_| Err(PublishError::transient(why.clone())))
                    .collect();
            }
        };
        let mut results: Vec<Option<std::result::Result<(), PublishError>>> =
            records.iter().map(|_| None).collect();
        let options = BasicPublishOptions {
            mandatory: self.mandatory,
            immediate: false,
        };
        let mut confirms = FuturesUnordered::new();
        for (i, record) in records.iter().enumerate() {
            let (routing_key, properties) = match properties(record) {
                Ok(p) => p,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            match channel
                .basic_publish(
                    self.exchange.clone(),
                    routing_key,
                    options,
                    &record.payload,
                    properties,
                )
                .await
            {
                Ok(confirm) => confirms.push(async move { (i, confirm.await) }),
                Err(e) => {
                    results[i] = Some(Err(PublishError::transient(format!("publish failed: {e}"))));
                }
            }
        }

        let mut returned_keys = Vec::new();
        let mut complete = true;
        let deadline = tokio::time::sleep(self.confirm_timeout);
        tokio::pin!(deadline);
        while !confirms.is_empty() {
            tokio::select! {
                Some((i, confirmation)) = confirms.next() => {
                    results[i] = Some(match confirmation {
                        Ok(Confirmation::Ack(returned)) => {
                            // A returned message may ride on another record's ack: match by id.
                            if let Some(message) = returned {
                                returned_keys.push((
                                    message.delivery.properties.message_id().clone(),
                                    message.reply_code,
                                    message.reply_text.to_string(),
                                ));
                            }
                            Ok(())
                        }
                        Ok(Confirmation::Nack(_)) => {
                            Err(PublishError::transient("the broker nacked the message"))
                        }
                        Ok(Confirmation::NotRequested) => Err(PublishError::transient("the channel is not in confirm mode")),
                        Err(e) => Err(PublishError::transient(format!("confirm failed: {e}"))),
                    });
                }
                () = &mut deadline => {
                    tracing::warn!(endpoint = %self.endpoint, unconfirmed = confirms.len(), timeout = ?self.confirm_timeout, "RabbitMQ confirm timeout");
                    // The channel may be stuck, and late returns would land on the next
                    // batch: it is not reused.
                    complete = false;
                    break;
                }
            }
        }
        if !returned_keys.is_empty() {
            let index: HashMap<&str, usize> = records
                .iter()
                .enumerate()
                .map(|(i, r)| (r.key.as_str(), i))
                .collect();
            for (message_id, code, text) in returned_keys {
                if let Some(i) = message_id.as_ref().and_then(|id| index.get(id.as_str())) {
                    results[*i] = Some(Err(PublishError::transient(format!(
                        "unroutable: exchange {:?} returned topic {:?} ({code} {text})",
                        self.exchange.as_str(),
                        records[*i].topic
                    ))));
                }
            }
        }
        if complete {
            self.give_back(channel).await;
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(PublishError::transient(
                        "no confirm within the confirm timeout",
                    ))
                })
            })
            .collect()
    }
}

impl RabbitMqPublisherBuilder {
    /// Publish with `mandatory`, so an unroutable message comes back and fails (to be
    /// retried, then dead-lettered) instead of vanishing. Defaults to `true`.
    pub fn mandatory(mut self, mandatory: bool) -> Self {
        self.mandatory = mandatory;
        self
    }

    /// How long to wait for the broker's confirms of a batch before counting the missing
    /// ones as transient failures; it also bounds connecting and opening a channel.
    /// Defaults to 10 s.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Validates the settings and connects (failing fast on a wrong URL or an unreachable
    /// broker). Later connection losses are repaired by the publisher itself.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a malformed URL (not echoed: it may hold a password), an
    /// exchange name over 255 bytes or a zero confirm timeout; [`Error::Publish`] when the
    /// broker cannot be reached.
    pub async fn connect(self) -> Result<RabbitMqPublisher> {
        let uri: AMQPUri = self.url.parse().map_err(|_| {
            Error::InvalidOption(
                "the AMQP URL is malformed (not shown: it may hold a password)".into(),
            )
        })?;
        let exchange = ShortString::try_new(self.exchange)
            .map_err(|_| Error::InvalidOption("exchange name is over 255 bytes".into()))?;
        if self.confirm_timeout.is_zero() {
            return Err(Error::InvalidOption(
                "confirm_timeout must be above zero".into(),
            ));
        }
        let endpoint = format!(
            "{}:{}/{}",
            uri.authority.host, uri.authority.port, uri.vhost
        );
        let publisher = RabbitMqPublisher {
            uri,
            endpoint,
            exchange,
            mandatory: self.mandatory,
            confirm_timeout: self.confirm_timeout,
            link: Mutex::new(Link::default()),
        };
        publisher
            .channel()
            .await
            .map_err(|why| Error::Publish(why.into()))?;
        Ok(publisher)
    }
}

/// The routing key and AMQP properties of a record.
fn properties(
    record: &Record,
) -> std::result::Result<(ShortString, BasicProperties), PublishError> {
    // Enqueue validates these limits; rows written by other means may not respect them.
    let short = |what: &str, value: &str| {
        ShortString::try_new(value)
            .map_err(|_| PublishError::permanent(format!("{what} is over 255 bytes")))
    };
    let mut headers: std::collections::BTreeMap<ShortString, AMQPValue> =
        std::collections::BTreeMap::new();
    for (name, value) in &record.headers {
        headers.insert(
            short("a header name", name)?,
            AMQPValue::LongString(LongString::from(value.as_bytes())),
        );
    }
    // Library headers win over user headers of the same name.
    headers.insert(
        ShortString::from(ATTEMPT_HEADER),
        AMQPValue::LongLongInt(i64::from(record.attempt)),
    );
    if let Some(aggregate) = &record.aggregate_key {
        headers.insert(
            ShortString::from(AGGREGATE_HEADER),
            AMQPValue::LongString(LongString::from(aggregate.as_bytes())),
        );
    }
    let mut properties = BasicProperties::default()
        .with_message_id(short("the idempotency key", &record.key)?)
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(record.created_at.timestamp()).unwrap_or(0))
        .with_headers(FieldTable::from(headers));
    if let Some(content_type) = &record.content_type {
        properties = properties.with_content_type(short("the content type", content_type)?);
    }
    Ok((short("the topic", &record.topic)?, properties))
}

impl Publisher for RabbitMqPublisher {
    async fn publish(&self, record: &Record) -> std::result::Result<(), PublishError> {
        self.publish_pipelined(std::slice::from_ref(record))
            .await
            .pop()
            .expect("one result per record")
    }

    fn publish_batch<'a>(&'a self, records: &'a [Record]) -> Option<BatchResults<'a>> {
        let results = async move {
            stream::iter(
                self.publish_pipelined(records)
                    .await
                    .into_iter()
                    .enumerate(),
            )
        };
        Some(Box::pin(stream::once(results).flatten()))
    }
}
