//! What the relay publishes to: the `Publisher` contract (the trait, its errors, the
//! `Record` it gets, the headers every publisher sends) and the closure adapter. The
//! brokers' publishers live in `broker/`.

mod closure;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use futures_util::Stream;

use crate::error::BoxError;

pub use self::closure::{FnPublisher, publisher_fn};

/// The header carrying the attempt number (1 for the first delivery), which every
/// publisher of the crate sends.
pub const ATTEMPT_HEADER: &str = "x-outbox-attempt";
/// The header carrying the aggregate key, when the message has one, which every publisher
/// of the crate sends.
pub const AGGREGATE_HEADER: &str = "x-outbox-aggregate-key";

/// One claimed message, as handed to a [`Publisher`].
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Record {
    /// Row id: enqueue order.
    pub id: i64,
    /// The idempotency key, the same on every attempt.
    pub key: String,
    /// The topic (routing key).
    pub topic: String,
    /// The aggregate key, if any.
    pub aggregate_key: Option<String>,
    /// The message body.
    pub payload: Vec<u8>,
    /// The content type, if any.
    pub content_type: Option<String>,
    /// User headers.
    pub headers: BTreeMap<String, String>,
    /// This attempt's number, from 1.
    pub attempt: u32,
    /// Enqueue time (database clock).
    pub created_at: DateTime<Utc>,
}

impl Record {
    /// A record of one message on its first attempt, enqueued now, with no aggregate key,
    /// content type or headers; set those through the public fields. For publishers' own
    /// tests: the relay builds the records it publishes from the claimed rows.
    ///
    /// ```
    /// use diesel_outbox::Record;
    ///
    /// let mut record = Record::new("order-42-created", "order.created", r#"{"id":42}"#);
    /// record.aggregate_key = Some("order-42".into());
    /// record.attempt = 2;
    /// # assert_eq!(record.topic, "order.created");
    /// ```
    pub fn new(
        key: impl Into<String>,
        topic: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Record {
            id: 0,
            key: key.into(),
            topic: topic.into(),
            aggregate_key: None,
            payload: payload.into(),
            content_type: None,
            headers: BTreeMap::new(),
            attempt: 1,
            created_at: Utc::now(),
        }
    }
}

impl fmt::Debug for Record {
    // Payloads and header values may hold personal data: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("id", &self.id)
            .field("key", &self.key)
            .field("topic", &self.topic)
            .field("aggregate_key", &self.aggregate_key)
            .field("payload_len", &self.payload.len())
            .field("content_type", &self.content_type)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("attempt", &self.attempt)
            .field("created_at", &self.created_at)
            .finish()
    }
}

/// Why a publish failed, and whether trying again can help.
///
/// Three kinds, which the relay treats differently:
/// - [`PublishError::transient`]: something about this message failed (a nack, an unroutable
///   topic, no confirm in time on a healthy connection). It is retried with backoff and
///   spends one of its `max_attempts`.
/// - [`PublishError::permanent`]: retrying cannot help (the broker can never take this
///   message). It becomes a dead letter at once.
/// - [`PublishError::unavailable`]: the broker could not be reached at all (refused,
///   unreachable, login failed, the connection lost before the message was written, the
///   exchange missing, the connection blocked by a resource alarm). Not the message's fault:
///   it is released without spending an attempt, and the relay backs off as a whole until
///   the broker answers again. A broker down for an hour dead-letters nothing.
#[derive(Debug)]
pub struct PublishError {
    kind: Kind,
    source: BoxError,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Transient,
    Permanent,
    Unavailable,
}

impl PublishError {
    /// A failure that may pass: the message is retried with backoff, and becomes a dead
    /// letter once `max_attempts` are used.
    pub fn transient(err: impl Into<BoxError>) -> Self {
        Self::new(Kind::Transient, err)
    }

    /// A failure that retrying cannot fix: the message becomes a dead letter at once.
    pub fn permanent(err: impl Into<BoxError>) -> Self {
        Self::new(Kind::Permanent, err)
    }

    /// The broker could not be reached: the message is released without spending an
    /// attempt and the relay backs off until the broker answers again. Return it only for
    /// failures that are not about this message; a message that itself makes the broker
    /// fail must be [`PublishError::transient`] or [`PublishError::permanent`], or it would
    /// be retried forever.
    pub fn unavailable(err: impl Into<BoxError>) -> Self {
        Self::new(Kind::Unavailable, err)
    }

    fn new(kind: Kind, err: impl Into<BoxError>) -> Self {
        PublishError {
            kind,
            source: err.into(),
        }
    }

    /// True for [`PublishError::permanent`].
    pub fn is_permanent(&self) -> bool {
        self.kind == Kind::Permanent
    }

    /// True for [`PublishError::unavailable`].
    pub fn is_unavailable(&self) -> bool {
        self.kind == Kind::Unavailable
    }
}

impl fmt::Display for PublishError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            Kind::Transient => "transient publish failure",
            Kind::Permanent => "permanent publish failure",
            Kind::Unavailable => "broker unavailable",
        };
        // The causes below the source, each said once: a source's message often repeats
        // its own source's already.
        write!(f, "{kind}: {}", crate::connect::chain(&*self.source))
    }
}

/// No [`source`](std::error::Error::source): the message says the causes itself, each
/// once, so a reporter that walks sources does not print them again.
impl std::error::Error for PublishError {}

/// Results of a pipelined batch: `(index into the batch, result)`, in any order.
pub type BatchResults<'a> =
    Pin<Box<dyn Stream<Item = (usize, Result<(), PublishError>)> + Send + 'a>>;

/// Where the relay ships messages: a broker adapter, or your own code.
///
/// `publish` must return `Ok` only once the broker has taken responsibility for the message
/// (for RabbitMQ: the publisher confirm). The relay publishes outside any transaction and
/// holds no database connection meanwhile. Each publish has a deadline of half the lease,
/// after which the relay drops its future and records a transient failure; a panicking
/// publish fails only its own record. Return [`PublishError::unavailable`] when the broker
/// cannot be reached at all, so the relay holds off instead of spending attempts. Delivery
/// is at least once: after a crash, a lost connection, an abandoned publish or an expired
/// lease the same record (same key) is published again.
///
/// ```
/// use diesel_outbox::{PublishError, Publisher, Record};
///
/// struct Stdout;
///
/// impl Publisher for Stdout {
///     async fn publish(&self, record: &Record) -> Result<(), PublishError> {
///         if record.topic.is_empty() {
///             return Err(PublishError::permanent("no topic"));
///         }
///         eprintln!("{} {}", record.topic, record.key);
///         Ok(())
///     }
/// }
/// ```
pub trait Publisher: Send + Sync + 'static {
    /// Publishes one record; `Ok` once the broker confirmed it.
    fn publish(&self, record: &Record) -> impl Future<Output = Result<(), PublishError>> + Send;

    /// Publishes a whole claimed batch at once, for brokers that pipeline (send everything,
    /// then await every confirm). Yields one result per record, in any order; results may
    /// arrive together once every confirm is in (the RabbitMQ publisher does that, so its
    /// returns can be matched). The relay waits for the stream at most half its lease, then
    /// fails the records without a result ("publish timed out"); a panic in the stream fails
    /// the records without a result ("publisher panicked").
    ///
    /// The default returns `None`: the relay then calls [`Publisher::publish`] per record,
    /// up to its `concurrency` at a time, and on shutdown does not start the records it has
    /// not started yet. A pipelined batch counts as started as a whole.
    ///
    /// A batch never holds two records of the same aggregate, so all of them may go out at
    /// once without breaking per-aggregate order.
    fn publish_batch<'a>(&'a self, records: &'a [Record]) -> Option<BatchResults<'a>> {
        let _ = records;
        None
    }

    /// The longest a publish (or a pipelined batch) of this publisher can take before it
    /// gives up by itself, if it has such a bound (the RabbitMQ publisher: its confirm
    /// timeout). The relay checks at `build()` that it fits in half the lease, the time the
    /// relay itself allows a publish. Defaults to `None`.
    fn timeout(&self) -> Option<std::time::Duration> {
        None
    }

    /// Called by the relay's `build()` with the longest a publish may take there (half the
    /// lease): a publisher whose own [`timeout`](Publisher::timeout) the user left at its
    /// default lowers it to at most `max`, so a short lease needs no other setting. One set
    /// explicitly stays as it is (and `build()` fails if it does not fit). Defaults to
    /// nothing.
    fn fit_timeout(&mut self, max: std::time::Duration) {
        let _ = max;
    }
}

impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(&self, record: &Record) -> impl Future<Output = Result<(), PublishError>> + Send {
        (**self).publish(record)
    }

    fn publish_batch<'a>(&'a self, records: &'a [Record]) -> Option<BatchResults<'a>> {
        (**self).publish_batch(records)
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        (**self).timeout()
    }

    /// Fits the publisher's timeout when this is its only handle (a shared publisher is
    /// left as it is).
    fn fit_timeout(&mut self, max: std::time::Duration) {
        if let Some(publisher) = std::sync::Arc::get_mut(self) {
            publisher.fit_timeout(max);
        }
    }
}
