//! The consuming half: a runner that gives each delivery exactly one effect.
//!
//! For each delivery the runner opens a transaction on a pooled connection, records the
//! message's idempotency key with [`Outbox::dedupe`] under the consumer's name, runs your
//! handler on that same connection only if the key is new, commits, and **acknowledges the
//! broker only after the commit**. A duplicate is acknowledged without running the handler.
//! A crash between the commit and the acknowledgement therefore redelivers a message whose
//! key is found, and its effect happens once.
//!
//! ```no_run
//! # #[cfg(feature = "rabbitmq")]
//! # async fn run(pool: diesel_outbox::PgPool) -> Result<(), diesel_outbox::Error> {
//! use diesel::sql_types::{BigInt, Text};
//! use diesel_async::RunQueryDsl;
//! use diesel_outbox::Outbox;
//! use diesel_outbox::consumer::{Consumer, HandleError, handler_fn, rabbitmq};
//!
//! #[derive(serde::Deserialize)]
//! struct OrderCreated {
//!     id: i64,
//! }
//!
//! let consumer = Consumer::builder(Outbox::new(), pool, "invoicing")
//!     .source(rabbitmq::Source::queue("amqp://guest:guest@127.0.0.1:5672/%2f", "orders"))
//!     .handler(handler_fn(|delivery, conn| {
//!         Box::pin(async move {
//!             let order: OrderCreated = delivery.json().map_err(HandleError::reject)?;
//!             diesel::sql_query("INSERT INTO invoices (order_id, key) VALUES ($1, $2)")
//!                 .bind::<BigInt, _>(order.id)
//!                 .bind::<Text, _>(&delivery.key)
//!                 .execute(conn)
//!                 .await
//!                 .map_err(HandleError::retry)?;
//!             Ok(())
//!         })
//!     }))
//!     .concurrency(8)
//!     .build()?;
//! consumer.run_until(async { tokio::signal::ctrl_c().await.ok(); }).await?;
//! # Ok(()) }
//! ```
//!
//! - **Failures.** [`HandleError::retry`] rolls the transaction back and runs the delivery
//!   again after a capped exponential backoff; after `max_deliveries` runs it is rejected
//!   without requeue (to the queue's dead-letter exchange, if it has one) and logged at
//!   error with its key and topic. [`HandleError::reject`] rejects at once.
//! - **Order.** Up to `concurrency` deliveries are handled at once, each on a connection of
//!   its own, and the broker is asked for no more than that at a time. Deliveries that share
//!   an aggregate key are handled one after another, in delivery order: within one runner,
//!   and as the broker delivers them (a delivery it hands out again after a lost connection
//!   comes after the later ones it had already delivered).
//! - **Hung handlers, panics, aborted transactions.** A run longer than `handler_timeout`
//!   is abandoned and counts as a retry, and so does a panicking handler, or one that
//!   swallowed an error of its own statement (its transaction could only roll back).
//! - **Database trouble.** No connection, or a failed begin, dedupe or commit, costs a
//!   delivery none of its runs: it waits with a backoff of its own and tries again.
//! - **Outages.** A lost broker connection is reopened with backoff; deliveries whose
//!   acknowledgement it took with it are redelivered, found by `dedupe`, and acknowledged.
//! - **Shutdown.** [`Consumer::run_until`] stops taking deliveries, lets the handlers under
//!   way finish within the drain timeout, acknowledges what committed, and leaves the rest
//!   unacknowledged, for the broker to deliver again.
//!
//! Hazard: `dedupe` records live in `<table>_inbox` until the relay's `inbox_retention`
//! purges them; a redelivery later than that runs the handler again.

#[cfg(feature = "kafka")]
pub mod kafka {
    //! The Kafka source (feature `kafka`): topics consumed by a consumer group.
    //!
    //! A message becomes a [`Delivery`](super::Delivery): its `x-outbox-message-id` header
    //! is the key, its topic (without the [`Source::topic_prefix`], when it starts with it)
    //! the topic, `x-outbox-attempt` the attempt, `x-outbox-aggregate-key` the aggregate key
    //! and `content-type` the content type; other headers are the delivery's headers. Kafka
    //! does not say whether it delivered a message before: `redelivered` is always false.
    //!
    //! Offsets are committed only once a delivery is settled, that is after the handler's
    //! transaction committed: per partition, the position moves past a message only once
    //! every message before it is settled too, so a crash or a rebalance redelivers what
    //! was not done (and the dedupe absorbs what was). Order is kept per partition, and so
    //! per aggregate (the relay keys each message by its aggregate). A partition taken away
    //! by a rebalance commits nothing more from this member. Commits are asynchronous: one
    //! that fails is logged and made again when the partition's next message settles;
    //! until then (for the last messages of a partition, until a restart) the group's lag
    //! counts them and a restart or rebalance delivers them again.
    //!
    //! Dead letters: Kafka keeps none of its own, so the source sends a message the handler
    //! rejects (or ran `max_deliveries` times), or one without `x-outbox-message-id` (which
    //! cannot be deduplicated), to a dead-letter topic (`<topic>.dlt` by default; see
    //! [`Source::dead_letter_topic`]) with where it was consumed and why, and commits its
    //! offset only once Kafka confirmed it. [`Topology::dead_letter_topics`](crate::kafka::Topology::dead_letter_topics)
    //! declares them.
    //!
    //! The topics must exist: when the runner starts, a topic missing from the cluster's
    //! list of topics fails it at once with [`Error::NotDeclared`](crate::Error::NotDeclared),
    //! naming it (the source asks for the whole list, and subscribes with
    //! `allow.auto.create.topics=false`, so a cluster that creates topics on first use does
    //! not create it). A cluster out of reach at start is waited for, as later.
    //!
    //! A new group starts at each partition's beginning; [`Source::start_from`] with
    //! [`StartFrom::Latest`] starts it at the end instead (messages produced before it
    //! joined are never delivered to it). librdkafka properties the source has no method
    //! for (an OAUTHBEARER login, `client.id`, fetch sizes) pass through
    //! [`Source::property`], but for the keys the crate owns, which are refused by name.

    pub use crate::broker::kafka::source::{Source, StartFrom};
}
#[cfg(feature = "nats")]
pub mod nats {
    //! The NATS JetStream source (feature `nats`): one durable pull consumer, with explicit
    //! acknowledgements, pulled in batches of the consumer's concurrency.
    //!
    //! A message becomes a [`Delivery`](super::Delivery): its `Nats-Msg-Id` header is the key, its subject
    //! (without the [`Source::subject_prefix`], when it starts with it) the topic,
    //! `x-outbox-attempt` the attempt, `x-outbox-aggregate-key` the aggregate key and
    //! `Content-Type` the content type; other headers are the delivery's headers. A delivery
    //! counts as redelivered when JetStream delivered it before. A message without
    //! `Nats-Msg-Id` cannot be deduplicated: it is terminated (JetStream stops redelivering it
    //! and publishes a `MSG_TERMINATED` advisory) and logged.
    //!
    //! The acknowledgement is a double ack: the runner learns whether the server took it. A
    //! rejection terminates the message (JetStream has no dead-letter stream of its own: keep
    //! terminated messages by consuming the advisory, or give the consumer a `max_deliver`).
    //! Messages handed out and not settled when the source closes are redelivered once the
    //! JetStream consumer's `ack_wait` passes. The durable consumer must exist, as a pull
    //! consumer with explicit acks: create it in your deployment or at start-up.
    //!
    //! Hazards: the client pulls ahead (a new batch of the runner's concurrency once half the
    //! last one is handed out), so up to about one and a half times the concurrency waits in
    //! the client beyond what the runner handles; their `ack_wait` runs meanwhile. Give the
    //! durable consumer an `ack_wait` longer than the runner's `handler_timeout` plus that
    //! wait, and a `max_ack_pending` of the runner's concurrency to bound it; with a
    //! `max_deliver`, a message redelivered that often is dropped by JetStream. The
    //! connection is reopened by itself after a loss; credentials never appear in its `Debug`
    //! output, its errors or its logs.

    pub use crate::broker::nats::source::Source;
}
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq {
    //! The RabbitMQ source (feature `rabbitmq`): one queue, consumed with manual
    //! acknowledgements and a prefetch of the consumer's concurrency.
    //!
    //! A message becomes a [`Delivery`](super::Delivery): its message id is the key, its routing key the topic,
    //! `x-outbox-attempt` the attempt and `x-outbox-aggregate-key` the aggregate key; string
    //! headers are the delivery's headers. A message without a message id cannot be
    //! deduplicated: it is rejected (to the queue's dead-letter exchange, if it has one) and
    //! logged. The connection is reopened by itself after a loss; URLs and passwords never
    //! appear in its `Debug` output, its errors or its logs.

    pub use crate::broker::rabbitmq::source::Source;
}
mod run;
mod source;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use futures_util::future::BoxFuture;

use crate::connect::PgPool;
use crate::error::{BoxError, Error, Result};
use crate::metrics::{Metrics, NoMetrics};
use crate::outbox::Outbox;

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) use self::source::Reconnecting;
pub use self::source::{Incoming, Settle, Source};

/// One message as the consumer received it.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Delivery {
    /// The idempotency key (the broker message id), the same on every delivery.
    pub key: String,
    /// The topic the message was enqueued with (for RabbitMQ, the routing key; for Kafka,
    /// the topic without the relay's prefix, or the `x-outbox-topic` header).
    pub topic: String,
    /// The message body.
    pub payload: Vec<u8>,
    /// The content type, if any.
    pub content_type: Option<String>,
    /// The message's own headers (string values; the crate's `x-outbox-` headers are in
    /// [`Delivery::attempt`] and [`Delivery::aggregate_key`]).
    pub headers: BTreeMap<String, String>,
    /// The relay's publish attempt that produced this delivery, from 1 (`x-outbox-attempt`).
    pub attempt: u32,
    /// The aggregate key, if the message has one (`x-outbox-aggregate-key`).
    pub aggregate_key: Option<String>,
    /// Whether the broker says it delivered this message before.
    pub redelivered: bool,
}

impl Delivery {
    /// A delivery of one message on its first attempt, for handlers' own tests; set the
    /// other fields directly.
    pub fn new(
        key: impl Into<String>,
        topic: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Self {
        Delivery {
            key: key.into(),
            topic: topic.into(),
            payload: payload.into(),
            content_type: None,
            headers: BTreeMap::new(),
            attempt: 1,
            aggregate_key: None,
            redelivered: false,
        }
    }

    /// The payload decoded from JSON.
    ///
    /// # Errors
    /// [`JsonError`], which says where the payload went wrong but never quotes it (serde's
    /// own messages do, and they would reach the logs).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> std::result::Result<T, JsonError> {
        serde_json::from_slice(&self.payload).map_err(|e| JsonError {
            kind: match e.classify() {
                serde_json::error::Category::Io => "unreadable",
                serde_json::error::Category::Syntax => "not JSON",
                serde_json::error::Category::Data => "JSON of another shape",
                serde_json::error::Category::Eof => "cut short",
            },
            target: std::any::type_name::<T>(),
            line: e.line(),
            column: e.column(),
        })
    }
}

impl fmt::Debug for Delivery {
    // Payloads and header values may hold personal data: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery")
            .field("key", &self.key)
            .field("topic", &self.topic)
            .field("payload_len", &self.payload.len())
            .field("content_type", &self.content_type)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("attempt", &self.attempt)
            .field("aggregate_key", &self.aggregate_key)
            .field("redelivered", &self.redelivered)
            .finish()
    }
}

/// A payload that does not decode as the type asked for; from [`Delivery::json`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    kind: &'static str,
    target: &'static str,
    line: usize,
    column: usize,
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the payload is {} for {} (line {}, column {})",
            self.kind, self.target, self.line, self.column
        )
    }
}

impl std::error::Error for JsonError {}

/// Why a handler did not apply a delivery, and what the runner should do.
#[derive(Debug)]
pub struct HandleError {
    reject: bool,
    source: BoxError,
}

impl HandleError {
    /// Roll back and run the delivery again after a backoff (a database error, a service
    /// that is down); after `max_deliveries` runs it is rejected.
    pub fn retry(err: impl Into<BoxError>) -> Self {
        HandleError {
            reject: false,
            source: err.into(),
        }
    }

    /// Roll back and reject the delivery at once: it can never be applied (a payload that
    /// does not decode, say).
    pub fn reject(err: impl Into<BoxError>) -> Self {
        HandleError {
            reject: true,
            source: err.into(),
        }
    }

    /// Whether this error rejects the delivery at once.
    pub fn is_reject(&self) -> bool {
        self.reject
    }
}

impl fmt::Display for HandleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.reject { "rejected" } else { "retry" };
        write!(f, "{kind}: {}", self.source)
    }
}

impl std::error::Error for HandleError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Applies a delivery's effect on the runner's connection, inside the transaction that also
/// records the delivery's key.
///
/// Write only through `conn`: that is what makes the effect and the dedupe record commit
/// together. Do not open or commit transactions on it (savepoints through
/// `conn.transaction` are fine).
pub trait Handler: Send + Sync + 'static {
    /// Applies `delivery`.
    fn handle<'a>(
        &'a self,
        delivery: &'a Delivery,
        conn: &'a mut AsyncPgConnection,
    ) -> impl Future<Output = std::result::Result<(), HandleError>> + Send + 'a;
}

/// A [`Handler`] made from a closure; see [`handler_fn`].
pub struct FnHandler<F> {
    f: F,
}

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

/// Adapts a closure returning a boxed future into a [`Handler`]:
/// `handler_fn(|delivery, conn| Box::pin(async move { .. }))`. (The box lets the future
/// borrow both arguments.)
pub fn handler_fn<F>(f: F) -> FnHandler<F>
where
    F: for<'a> Fn(
            &'a Delivery,
            &'a mut AsyncPgConnection,
        ) -> BoxFuture<'a, std::result::Result<(), HandleError>>
        + Send
        + Sync
        + 'static,
{
    FnHandler { f }
}

impl<F> Handler for FnHandler<F>
where
    F: for<'a> Fn(
            &'a Delivery,
            &'a mut AsyncPgConnection,
        ) -> BoxFuture<'a, std::result::Result<(), HandleError>>
        + Send
        + Sync
        + 'static,
{
    fn handle<'a>(
        &'a self,
        delivery: &'a Delivery,
        conn: &'a mut AsyncPgConnection,
    ) -> impl Future<Output = std::result::Result<(), HandleError>> + Send + 'a {
        (self.f)(delivery, conn)
    }
}

/// Configures a [`Consumer`]; from [`Consumer::builder`].
#[must_use]
pub struct ConsumerBuilder<S, H> {
    outbox: Outbox,
    pool: PgPool,
    name: String,
    source: Option<S>,
    handler: Option<H>,
    options: Options,
    metrics: Arc<dyn Metrics>,
}

impl<S, H> fmt::Debug for ConsumerBuilder<S, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("outbox", &self.outbox)
            .field("name", &self.name)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// The runner's settings.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) concurrency: usize,
    pub(crate) max_deliveries: u32,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) drain_timeout: Duration,
    pub(crate) handler_timeout: Duration,
    pub(crate) connect_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            concurrency: crate::defaults::CONSUMER_CONCURRENCY,
            max_deliveries: crate::defaults::MAX_DELIVERIES,
            backoff_min: crate::defaults::CONSUMER_BACKOFF_MIN,
            backoff_max: crate::defaults::CONSUMER_BACKOFF_MAX,
            drain_timeout: crate::defaults::DRAIN_TIMEOUT,
            handler_timeout: crate::defaults::HANDLER_TIMEOUT,
            connect_timeout: crate::defaults::CONNECT_TIMEOUT,
        }
    }
}

/// Consumes deliveries from a [`Source`] and applies each once through a [`Handler`]; see
/// the [module docs](self).
pub struct Consumer<S, H> {
    inner: Arc<ConsumerShared<H>>,
    source: tokio::sync::Mutex<S>,
}

pub(crate) struct ConsumerShared<H> {
    pub(crate) outbox: Outbox,
    pub(crate) pool: PgPool,
    pub(crate) name: String,
    pub(crate) handler: H,
    pub(crate) options: Options,
    pub(crate) metrics: Arc<dyn Metrics>,
    /// What [`Consumer::health`] reports.
    pub(crate) vitals: crate::health::Vitals,
    /// The database's failures, across deliveries, for the logs.
    pub(crate) database_failures: std::sync::Mutex<crate::streak::Streak>,
}

impl<S, H> fmt::Debug for Consumer<S, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("outbox", &self.inner.outbox)
            .field("name", &self.inner.name)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl Consumer<(), ()> {
    /// A consumer named `name` (its dedupe records are kept under that name, so two
    /// consumers of one message each apply it once), writing through `pool` and recording
    /// keys in `outbox`'s inbox table.
    pub fn builder(
        outbox: Outbox,
        pool: PgPool,
        name: impl Into<String>,
    ) -> ConsumerBuilder<(), ()> {
        ConsumerBuilder {
            outbox,
            pool,
            name: name.into(),
            source: None,
            handler: None,
            options: Options::default(),
            metrics: Arc::new(NoMetrics),
        }
    }
}

impl<S, H> ConsumerBuilder<S, H> {
    /// Where deliveries come from, such as [`rabbitmq::Source::queue`] (feature
    /// `rabbitmq`). Required.
    pub fn source<S2: Source>(self, source: S2) -> ConsumerBuilder<S2, H> {
        ConsumerBuilder {
            outbox: self.outbox,
            pool: self.pool,
            name: self.name,
            source: Some(source),
            handler: self.handler,
            options: self.options,
            metrics: self.metrics,
        }
    }

    /// What applies each delivery. Required.
    pub fn handler<H2: Handler>(self, handler: H2) -> ConsumerBuilder<S, H2> {
        ConsumerBuilder {
            outbox: self.outbox,
            pool: self.pool,
            name: self.name,
            source: self.source,
            handler: Some(handler),
            options: self.options,
            metrics: self.metrics,
        }
    }

    /// Deliveries handled at once (1 to 1,000), each on a connection of its own; the broker
    /// is asked for no more unacknowledged deliveries than this. Defaults to 4.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = n;
        self
    }

    /// Runs of one delivery before a retrying handler gets it rejected (1 to 1,000).
    /// Defaults to 10.
    pub fn max_deliveries(mut self, n: u32) -> Self {
        self.options.max_deliveries = n;
        self
    }

    /// The wait before running a delivery again after a retry: exponential from `min`,
    /// capped at `max`. Defaults to 100 ms and 10 s.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.options.backoff_min = min;
        self.options.backoff_max = max;
        self
    }

    /// How long handlers under way may finish on shutdown (at most 1 hour). Defaults to
    /// 10 s.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.options.drain_timeout = timeout;
        self
    }

    /// The longest one run of the handler may take (1 ms to 1 hour); after it the run is
    /// abandoned, rolled back, and counted as a retry. Defaults to 60 s.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.options.handler_timeout = timeout;
        self
    }

    /// How long [`Consumer::run_until`]'s start waits for a database it cannot reach (a
    /// restart, an outage, a server not up yet), trying again with the attempts logged
    /// (see [`until_reachable`](crate::until_reachable)), before it fails (at most 1
    /// hour; zero tries once). Defaults to 30 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.options.connect_timeout = timeout;
        self
    }

    /// Hooks for your metrics system ([`Metrics::consumed`]). Defaults to none.
    pub fn metrics(mut self, metrics: impl Metrics) -> Self {
        self.metrics = Arc::new(metrics);
        self
    }
}

impl<S: Source, H: Handler> ConsumerBuilder<S, H> {
    /// Validates the settings.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a missing source or handler, an empty or over-long name,
    /// or an option out of its range.
    pub fn build(self) -> Result<Consumer<S, H>> {
        let bad = |msg: String| Err(Error::InvalidOption(msg));
        let o = &self.options;
        if self.name.is_empty() || self.name.len() > crate::message::MAX_SHORT {
            return bad(format!(
                "consumer name must be 1 to {} bytes",
                crate::message::MAX_SHORT
            ));
        }
        if !(1..=1_000).contains(&o.concurrency) {
            return bad(format!("concurrency {} must be 1..=1000", o.concurrency));
        }
        if !(1..=1_000).contains(&o.max_deliveries) {
            return bad(format!(
                "max_deliveries {} must be 1..=1000",
                o.max_deliveries
            ));
        }
        crate::backoff::check(o.backoff_min, o.backoff_max).map_err(Error::InvalidOption)?;
        if o.handler_timeout < Duration::from_millis(1)
            || o.handler_timeout > Duration::from_secs(3600)
        {
            return bad(format!(
                "handler_timeout {:?} must be between 1ms and 1 hour",
                o.handler_timeout
            ));
        }
        if o.drain_timeout > Duration::from_secs(3600) {
            return bad(format!(
                "drain_timeout {:?} must be at most 1 hour",
                o.drain_timeout
            ));
        }
        if o.connect_timeout > Duration::from_secs(3600) {
            return bad(format!(
                "connect_timeout {:?} must be at most 1 hour",
                o.connect_timeout
            ));
        }
        let (Some(source), Some(handler)) = (self.source, self.handler) else {
            return bad("a consumer needs a source and a handler".to_owned());
        };
        source
            .check()
            .map_err(|e| Error::InvalidOption(e.to_string()))?;
        Ok(Consumer {
            inner: Arc::new(ConsumerShared {
                outbox: self.outbox,
                pool: self.pool,
                name: self.name,
                handler,
                options: self.options,
                metrics: self.metrics,
                vitals: crate::health::Vitals::new(run::HEARTBEAT * 10),
                database_failures: std::sync::Mutex::default(),
            }),
            source: tokio::sync::Mutex::new(source),
        })
    }
}

impl<S: Source, H: Handler> Consumer<S, H> {
    /// Consumes until `shutdown` completes, then drains and returns: no delivery is taken
    /// after `shutdown`, handlers under way get the drain timeout, what committed is
    /// acknowledged, and what did not stays unacknowledged for the broker to deliver again.
    ///
    /// Broker and database failures are logged and retried. One consumer runs once at a
    /// time (a second call waits for the first).
    ///
    /// At start it checks the inbox table, waiting up to the
    /// [connect timeout](ConsumerBuilder::connect_timeout) for a database it cannot reach.
    ///
    /// # Errors
    /// [`Error::NotMigrated`] when the inbox table does not exist; [`Error::Pool`] when the
    /// database could not be reached within the connect timeout, or refused the login.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let mut source = self.source.lock().await;
        run::run(self.inner.clone(), &mut *source, shutdown).await
    }

    /// Whether the runner is live (`run_until` is going and its loop answers) and ready
    /// (its source reaches the broker, and its last transaction did not find the database
    /// out of reach), with the reasons when it is not: what a container's liveness and
    /// readiness probes want. The database is looked at only as deliveries are handled.
    pub fn health(&self) -> crate::Health {
        self.inner.vitals.health("the consumer", None)
    }
}
