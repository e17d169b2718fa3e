//! Where lapin is touched: the RabbitMQ publisher (feature `rabbitmq`).
//!
//! Each record goes to one exchange with its topic as routing key, as a persistent message
//! (delivery mode 2) whose message id is the idempotency key, with the record's content type
//! and headers, the enqueue time as timestamp, and the headers `x-outbox-attempt` (integer)
//! and, when set, `x-outbox-aggregate-key`. Publisher confirms are always on: a record
//! counts as published only after the broker's ack. With `mandatory` (the default) an
//! unroutable message comes back and is a transient failure, so it is retried and finally
//! dead-lettered, never silently dropped; a returned message is matched by message id
//! whichever confirm (ack or nack) carries it. A nack and a confirm timeout on a healthy
//! connection are transient failures too. A claimed batch is pipelined: every record is
//! published, then every confirm awaited, the whole batch within the confirm timeout.
//!
//! The broker being out of reach is not a message's fault: connection refused or lost
//! before a record was written, a failed login, the exchange missing, or the connection
//! blocked by a resource alarm are reported as [`PublishError::unavailable`], and the relay
//! releases such records without spending their attempts. When the channel or connection
//! goes down under records already written, the first of them is charged a transient
//! failure (it may be the one that brought it down, and must not be retried forever) and
//! the others are released.
//!
//! Before anything is written, each record is checked against what RabbitMQ itself accepts,
//! and fails permanently and alone if it breaks a rule: names and values over 255 bytes
//! where AMQP needs a short string, a `CC` or `BCC` header (RabbitMQ would route on it), or
//! a header frame larger than the connection's negotiated `frame_max` (the broker would
//! close the connection, failing every batch on it). Enqueue refuses all of these already;
//! the check covers rows written by other means.
//!
//! The publisher reconnects by itself: after the channel or the connection dies, the next
//! batch opens new ones (with backoff between failed attempts). URLs and passwords never
//! appear in its `Debug` output, its errors or its logs. Each batch publishes on a channel
//! of its own, so a returned message is always matched to its own batch.
//!
//! Hazard: lapin itself logs a returned message, payload included, at `warn` level, and at
//! `trace` level every frame, the login's password included, under the `lapin` target.
//! Filter that target (`lapin=error`, as the `diesel-outbox` binary does) wherever payloads
//! and passwords must not reach the logs.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{self, FuturesUnordered};
use futures_util::{FutureExt, StreamExt};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ConnectionStatus,
    ErrorKind,
};
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
/// Header names RabbitMQ treats as extra routing keys (sender-selected distribution).
const ROUTING_HEADERS: &[&str] = &["cc", "bcc"];

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
    link: Arc<Mutex<Link>>,
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

/// A confirm channel lent to one batch, with what it needs to know of its connection.
struct Lent {
    channel: Channel,
    status: ConnectionStatus,
    frame_max: u32,
}

impl Lent {
    fn new(channel: Channel, connection: &Connection) -> Self {
        Lent {
            channel,
            status: connection.status().clone(),
            frame_max: connection.configuration().frame_max(),
        }
    }
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
    /// when needed. Give it back with [`RabbitMqPublisher::give_back`]. Every failure here
    /// is an outage: nothing was written.
    async fn channel(&self) -> std::result::Result<Lent, String> {
        let mut link = self.link.lock().await;
        let connected = link
            .connection
            .as_ref()
            .is_some_and(|c| c.status().connected());
        if connected {
            while let Some(channel) = link.idle.pop() {
                if channel.status().connected() {
                    let connection = link.connection.as_ref().expect("connected above");
                    return Ok(Lent::new(channel, connection));
                }
            }
        } else {
            link.idle.clear();
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
                    // The relay reports the outage; this is the detail.
                    tracing::debug!(endpoint = %self.endpoint, error = %e, retry_in = ?delay, "connecting to RabbitMQ failed");
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
        let lent = Lent::new(channel, connection);
        link.backoff = None;
        link.retry_at = None;
        Ok(lent)
    }

    /// Returns a channel after a batch whose confirms all arrived, without waiting for the
    /// link (another batch may hold it while it connects: then on a task of its own).
    fn give_back(&self, channel: Channel) {
        if !channel.status().connected() {
            return;
        }
        match self.link.try_lock() {
            Ok(mut link) => link.idle.push(channel),
            Err(_) => {
                let link = self.link.clone();
                tokio::spawn(async move {
                    link.lock().await.idle.push(channel);
                });
            }
        }
    }

    /// Publishes every record, then awaits every confirm; the whole batch, connecting
    /// included, within the confirm timeout.
    async fn publish_pipelined(
        &self,
        records: &[Record],
    ) -> Vec<std::result::Result<(), PublishError>> {
        let deadline = Instant::now() + self.confirm_timeout;
        let all = |err: &dyn Fn() -> PublishError| records.iter().map(|_| Err(err())).collect();
        let lent = match tokio::time::timeout_at(deadline, self.channel()).await {
            Ok(Ok(lent)) => lent,
            Ok(Err(why)) => return all(&|| PublishError::unavailable(why.clone())),
            Err(_) => {
                return all(&|| {
                    PublishError::unavailable(format!(
                        "no channel on RabbitMQ at {} within {:?}",
                        self.endpoint, self.confirm_timeout
                    ))
                });
            }
        };
        let Lent {
            channel,
            status,
            frame_max,
        } = lent;
        let blocked = || {
            PublishError::unavailable(format!(
                "RabbitMQ at {} blocked the connection (a resource alarm is on)",
                self.endpoint
            ))
        };
        if status.blocked() {
            return all(&blocked);
        }
        let mut confirms = Confirms::new(records);
        let options = BasicPublishOptions {
            mandatory: self.mandatory,
            immediate: false,
        };
        let pending = FuturesUnordered::new();
        let mut unwritten: Option<PublishError> = None;
        for (i, record) in records.iter().enumerate() {
            if let Some(why) = &unwritten {
                confirms.fail(i, PublishError::unavailable(why.to_string()));
                continue;
            }
            let (routing_key, properties) = match properties(record, frame_max) {
                Ok(p) => p,
                Err(e) => {
                    confirms.fail(i, e);
                    continue;
                }
            };
            let publish = channel.basic_publish(
                self.exchange.clone(),
                routing_key,
                options,
                &record.payload,
                properties,
            );
            match tokio::time::timeout_at(deadline, publish).await {
                Ok(Ok(confirm)) => pending.push(async move { (i, settled(confirm.await)) }),
                Ok(Err(e)) => {
                    // Not written: the channel or the connection is gone.
                    let err = classify(&e, format!("publish failed: {e}"));
                    if err.is_unavailable() {
                        unwritten = Some(PublishError::unavailable(format!("publish failed: {e}")));
                    }
                    confirms.fail(i, err);
                }
                Err(_) => {
                    // The writer is stuck: a blocked connection stops lapin writing (an
                    // outage); on a healthy one this record could not be written in time
                    // (charged, so a record that never goes through ends dead), and the
                    // rest is released.
                    let why = if status.blocked() {
                        blocked()
                    } else {
                        PublishError::transient(format!(
                            "RabbitMQ at {} took not all of this message's frames within {:?}",
                            self.endpoint, self.confirm_timeout
                        ))
                    };
                    unwritten = Some(PublishError::unavailable(format!(
                        "not written: an earlier message of the batch could not be written \
                         within {:?}",
                        self.confirm_timeout
                    )));
                    confirms.fail(i, why);
                }
            }
        }
        let complete = gather(pending, deadline, &mut confirms).await;
        if !complete {
            tracing::warn!(endpoint = %self.endpoint, timeout = ?self.confirm_timeout, "RabbitMQ confirm timeout");
        }
        let exchange = self.exchange.as_str();
        let timed_out = || {
            if status.blocked() {
                blocked()
            } else {
                PublishError::transient(format!(
                    "no confirm within the confirm timeout ({:?})",
                    self.confirm_timeout
                ))
            }
        };
        let results = confirms.finish(exchange, &timed_out);
        // A channel whose confirms did not all come may be stuck, and late returns would
        // land on the next batch: it is not reused.
        if complete && unwritten.is_none() {
            self.give_back(channel);
        }
        results
    }
}

/// What one confirm said, reduced to what the outcome needs.
#[derive(Debug)]
enum Settled {
    Ack,
    Nack,
    Failed(PublishError),
    /// The channel or connection went down after the record was written. lapin fails every
    /// confirm still awaited on it alike, so whose fault it was is not known: see
    /// [`Confirms::finish`].
    Lost {
        broker_side: bool,
        text: String,
    },
}

/// A message the broker returned (unroutable with `mandatory`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Returned {
    message_id: Option<String>,
    code: u16,
    text: String,
}

fn settled(confirmation: lapin::Result<Confirmation>) -> (Settled, Option<Returned>) {
    let returned = |message: lapin::message::BasicReturnMessage| Returned {
        message_id: message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        code: message.reply_code,
        text: message.reply_text.to_string(),
    };
    match confirmation {
        Ok(Confirmation::Ack(message)) => (Settled::Ack, message.map(returned)),
        // A nack can carry a return too: harvest it like one on an ack.
        Ok(Confirmation::Nack(message)) => (Settled::Nack, message.map(returned)),
        Ok(Confirmation::NotRequested) => (
            Settled::Failed(PublishError::transient(
                "the channel is not in confirm mode",
            )),
            None,
        ),
        Err(e) => {
            let broker_side = closed_by_broker_side(&e);
            (
                Settled::Lost {
                    broker_side,
                    text: format!("confirm failed: {e}"),
                },
                None,
            )
        }
    }
}

/// Whether a lapin error from writing a record says the broker is out of reach (an outage:
/// the record was not written) or something about the record failed. A channel or
/// connection the broker closed with an error about what was sent (a refused routing key,
/// say) spends attempts; only a missing exchange and a forced close (a broker shutting
/// down) are outages.
fn classify(err: &lapin::Error, text: String) -> PublishError {
    match err.kind() {
        ErrorKind::IOError(_)
        | ErrorKind::MissingHeartbeatError
        | ErrorKind::InvalidConnectionState(_)
        | ErrorKind::InvalidChannelState(..)
        | ErrorKind::ChannelsLimitReached => PublishError::unavailable(text),
        _ if closed_by_broker_side(err) => PublishError::unavailable(text),
        _ => PublishError::transient(text),
    }
}

/// A channel or connection the broker closed for a reason of its own, not of a message's: a
/// missing exchange, or a forced close as the broker shuts down.
fn closed_by_broker_side(err: &lapin::Error) -> bool {
    matches!(
        err.kind(),
        ErrorKind::ProtocolError(amqp)
            if matches!(
                amqp.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)
                    | AMQPErrorKind::Hard(AMQPHardError::CONNECTIONFORCED)
            )
    )
}

/// Awaits confirms until all are in or the deadline passes, then reads those that are in
/// already (they may carry a return). Returns whether every confirm came.
async fn gather<F>(
    mut pending: FuturesUnordered<F>,
    deadline: Instant,
    confirms: &mut Confirms<'_>,
) -> bool
where
    F: Future<Output = (usize, (Settled, Option<Returned>))>,
{
    let timer = tokio::time::sleep_until(deadline);
    tokio::pin!(timer);
    while !pending.is_empty() {
        tokio::select! {
            biased;
            Some((i, (settled, returned))) = pending.next() => confirms.settle(i, settled, returned),
            () = &mut timer => break,
        }
    }
    while let Some(Some((i, (settled, returned)))) = pending.next().now_or_never() {
        confirms.settle(i, settled, returned);
    }
    pending.is_empty()
}

/// The results of one pipelined batch, as its confirms and returns come in, in any order.
struct Confirms<'a> {
    records: &'a [Record],
    results: Vec<Option<std::result::Result<(), PublishError>>>,
    returned: Vec<Returned>,
    /// Records whose confirm failed because the channel went down: `(index, closed by the
    /// broker's side, error)`.
    lost: Vec<(usize, bool, String)>,
}

impl<'a> Confirms<'a> {
    fn new(records: &'a [Record]) -> Self {
        Confirms {
            records,
            results: records.iter().map(|_| None).collect(),
            returned: Vec::new(),
            lost: Vec::new(),
        }
    }

    /// Record `i` failed before anything was written.
    fn fail(&mut self, i: usize, err: PublishError) {
        self.results[i] = Some(Err(err));
    }

    /// Record `i`'s confirm arrived, perhaps with another record's return attached.
    fn settle(&mut self, i: usize, settled: Settled, returned: Option<Returned>) {
        self.returned.extend(returned);
        self.results[i] = Some(match settled {
            Settled::Ack => Ok(()),
            Settled::Nack => Err(PublishError::transient("the broker nacked the message")),
            Settled::Failed(err) => Err(err),
            Settled::Lost { broker_side, text } => {
                self.lost.push((i, broker_side, text));
                return;
            }
        });
    }

    /// One result per record: a returned record failed whatever its own confirm said; a
    /// record without a confirm failed with `unconfirmed()`. Of the records whose channel
    /// went down under them, the first written is charged a transient failure (it may be the
    /// one that brought the channel down; a message that does so every time must end dead,
    /// not be retried forever) and the others are released as an outage; a close on the
    /// broker's side (a missing exchange, a broker shutting down) is an outage for all.
    fn finish(
        mut self,
        exchange: &str,
        unconfirmed: &dyn Fn() -> PublishError,
    ) -> Vec<std::result::Result<(), PublishError>> {
        self.lost.sort_by_key(|(i, _, _)| *i);
        let mut charged = false;
        for (i, broker_side, text) in std::mem::take(&mut self.lost) {
            let err = if broker_side || charged {
                PublishError::unavailable(text)
            } else {
                charged = true;
                PublishError::transient(text)
            };
            self.results[i] = Some(Err(err));
        }
        let index: HashMap<&str, usize> = self
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.key.as_str(), i))
            .collect();
        for returned in &self.returned {
            if let Some(&i) = returned.message_id.as_deref().and_then(|id| index.get(id)) {
                self.results[i] = Some(Err(PublishError::transient(format!(
                    "unroutable: exchange {exchange:?} returned topic {:?} ({} {})",
                    self.records[i].topic, returned.code, returned.text
                ))));
            }
        }
        self.results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(unconfirmed())))
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

    /// The longest a batch may take, connecting and opening a channel included; confirms
    /// missing then count as transient failures (or as an outage, when the broker has
    /// blocked the connection). The relay checks at `build()` that it fits in half its
    /// lease. Defaults to 10 s.
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
            link: Arc::new(Mutex::new(Link::default())),
        };
        let lent = publisher
            .channel()
            .await
            .map_err(|why| Error::Publish(why.into()))?;
        publisher.give_back(lent.channel);
        Ok(publisher)
    }
}

/// The routing key and AMQP properties of a record, once it is known that RabbitMQ takes
/// them: each rule broken is a permanent failure of this record alone.
fn properties(
    record: &Record,
    frame_max: u32,
) -> std::result::Result<(ShortString, BasicProperties), PublishError> {
    // Enqueue validates these limits; rows written by other means may not respect them.
    let short = |what: &str, value: &str| {
        ShortString::try_new(value)
            .map_err(|_| PublishError::permanent(format!("{what} is over 255 bytes")))
    };
    let mut headers: BTreeMap<ShortString, AMQPValue> = BTreeMap::new();
    for (name, value) in &record.headers {
        if ROUTING_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(PublishError::permanent(format!(
                "header {name:?} is refused: RabbitMQ routes on CC and BCC"
            )));
        }
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
    let message_id = short("the idempotency key", &record.key)?;
    let content_type = record
        .content_type
        .as_deref()
        .map(|ct| short("the content type", ct))
        .transpose()?;
    let frame = header_frame_size(&message_id, content_type.as_ref(), &headers);
    if frame > u64::from(frame_max) {
        return Err(PublishError::permanent(format!(
            "the message's header frame is {frame} bytes, over the connection's frame_max of \
             {frame_max} (its headers are too large for RabbitMQ)"
        )));
    }
    let mut properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(record.created_at.timestamp()).unwrap_or(0))
        .with_headers(FieldTable::from(headers));
    if let Some(content_type) = content_type {
        properties = properties.with_content_type(content_type);
    }
    Ok((short("the topic", &record.topic)?, properties))
}

/// The size of the content header frame of a message with these properties (as set by
/// [`properties`]), by AMQP 0-9-1's encoding: frame header (7 bytes) and end (1), class,
/// weight and body size (12), property flags (2), then each property present.
fn header_frame_size(
    message_id: &ShortString,
    content_type: Option<&ShortString>,
    headers: &BTreeMap<ShortString, AMQPValue>,
) -> u64 {
    let short = |s: &ShortString| 1 + s.as_str().len() as u64;
    let table: u64 = headers
        .iter()
        .map(|(name, value)| {
            short(name)
                + 1
                + match value {
                    AMQPValue::LongString(s) => 4 + s.as_bytes().len() as u64,
                    AMQPValue::LongLongInt(_) => 8,
                    // Not produced by `properties`; sized generously.
                    _ => 1 << 20,
                }
        })
        .sum();
    let properties = 2 // flags
        + content_type.map_or(0, short)
        + 4 + table // headers
        + 1 // delivery mode
        + short(message_id)
        + 8; // timestamp
    7 + 12 + properties + 1
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

    fn timeout(&self) -> Option<Duration> {
        Some(self.confirm_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str) -> Record {
        Record {
            id: 1,
            key: key.into(),
            topic: "t".into(),
            aggregate_key: None,
            payload: Vec::new(),
            content_type: None,
            headers: BTreeMap::new(),
            attempt: 1,
            created_at: chrono::Utc::now(),
        }
    }

    fn returned(key: &str) -> Option<Returned> {
        Some(Returned {
            message_id: Some(key.into()),
            code: 312,
            text: "NO_ROUTE".into(),
        })
    }

    fn outcome(results: &[std::result::Result<(), PublishError>]) -> Vec<String> {
        results
            .iter()
            .map(|r| match r {
                Ok(()) => "sent".into(),
                Err(e) if e.to_string().contains("unroutable") => "returned".into(),
                Err(e) => e.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_return_fails_its_own_record_whichever_confirm_carries_it_and_in_any_order() {
        let records = [record("a"), record("b"), record("c")];
        let unconfirmed = || PublishError::transient("no confirm");
        // b's return rides on a's ack, which comes before b's own ack...
        let mut early = Confirms::new(&records);
        early.settle(0, Settled::Ack, returned("b"));
        early.settle(1, Settled::Ack, None);
        early.settle(2, Settled::Ack, None);
        assert_eq!(
            outcome(&early.finish("x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // ...or after it, on c's ack.
        let mut late = Confirms::new(&records);
        late.settle(1, Settled::Ack, None);
        late.settle(0, Settled::Ack, None);
        late.settle(2, Settled::Ack, returned("b"));
        assert_eq!(
            outcome(&late.finish("x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // A return attached to a nack is not lost.
        let mut nacked = Confirms::new(&records);
        nacked.settle(0, Settled::Ack, None);
        nacked.settle(2, Settled::Nack, returned("b"));
        nacked.settle(1, Settled::Ack, None);
        let results = nacked.finish("x", &unconfirmed);
        assert_eq!(outcome(&results)[..2], ["sent", "returned"]);
        assert!(
            results[2]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("nacked")
        );
    }

    #[test]
    fn a_channel_lost_under_a_batch_charges_only_its_first_written_record() {
        let records = [record("a"), record("b"), record("c"), record("d")];
        let lost = |broker_side| Settled::Lost {
            broker_side,
            text: "confirm failed: channel closed".into(),
        };
        let mut closed = Confirms::new(&records);
        closed.settle(0, Settled::Ack, None);
        closed.settle(3, lost(false), None);
        closed.settle(1, lost(false), None);
        closed.settle(2, lost(false), None);
        let results = closed.finish("x", &|| PublishError::transient("no confirm"));
        assert!(results[0].is_ok());
        let b = results[1].as_ref().unwrap_err();
        assert!(!b.is_unavailable() && !b.is_permanent(), "{b}");
        assert!(results[2].as_ref().unwrap_err().is_unavailable());
        assert!(results[3].as_ref().unwrap_err().is_unavailable());

        let mut missing = Confirms::new(&records);
        for i in 0..4 {
            missing.settle(i, lost(true), None);
        }
        let results = missing.finish("x", &|| PublishError::transient("no confirm"));
        assert!(
            results
                .iter()
                .all(|r| r.as_ref().unwrap_err().is_unavailable())
        );
    }

    #[tokio::test]
    async fn confirms_already_in_at_the_deadline_are_still_read() {
        let records = [record("a"), record("b"), record("c")];
        let mut confirms = Confirms::new(&records);
        type Confirm =
            futures_util::future::BoxFuture<'static, (usize, (Settled, Option<Returned>))>;
        let pending: FuturesUnordered<Confirm> = FuturesUnordered::new();
        // c's confirm carries b's return and is ready; b's own confirm never comes.
        pending.push(Box::pin(async { (0, (Settled::Ack, None)) }));
        pending.push(Box::pin(std::future::pending()));
        pending.push(Box::pin(async { (2, (Settled::Ack, returned("b"))) }));
        // The deadline has passed before anything was awaited.
        let complete = gather(pending, Instant::now(), &mut confirms).await;
        assert!(!complete);
        let results = confirms.finish("x", &|| PublishError::transient("no confirm"));
        assert_eq!(outcome(&results), ["sent", "returned", "sent"]);
    }

    #[test]
    fn the_header_frame_size_matches_the_encoder() {
        let mut r = record("order-42-created");
        r.aggregate_key = Some("order-42".into());
        r.content_type = Some("application/json".into());
        r.headers.insert("tenant".into(), "acme".into());
        r.headers.insert("h".into(), "x".repeat(70_000));
        let (_, properties) = properties(&r, u32::MAX).unwrap();
        let (body, _) = cookie_factory::r#gen(
            lapin::protocol::basic::gen_properties(&properties),
            Vec::new(),
        )
        .unwrap();
        let message_id = properties.message_id().clone().unwrap();
        let headers: BTreeMap<ShortString, AMQPValue> = properties
            .headers()
            .clone()
            .unwrap()
            .inner()
            .clone()
            .into_iter()
            .collect();
        let computed = header_frame_size(&message_id, properties.content_type().as_ref(), &headers);
        assert_eq!(computed, 7 + 12 + body.len() as u64 + 1);
    }

    #[test]
    fn records_rabbitmq_cannot_take_fail_permanently_before_anything_is_written() {
        let mut cc = record("k");
        cc.headers.insert("Cc".into(), "other.queue".into());
        let err = properties(&cc, 131_072).unwrap_err();
        assert!(
            err.is_permanent() && err.to_string().contains("CC and BCC"),
            "{err}"
        );

        let mut big = record("k");
        big.headers.insert("h".into(), "x".repeat(300_000));
        let err = properties(&big, 131_072).unwrap_err();
        assert!(
            err.is_permanent() && err.to_string().contains("frame_max"),
            "{err}"
        );
        properties(&big, 1 << 20).unwrap();

        let long_key = record(&"k".repeat(256));
        assert!(properties(&long_key, 131_072).unwrap_err().is_permanent());
    }
}
