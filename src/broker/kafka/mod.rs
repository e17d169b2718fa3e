//! The Kafka publisher (feature `kafka`), on rdkafka with the librdkafka it bundles.
//!
//! Each record is produced to the topic *prefix + topic* with its payload as the value and
//! its aggregate key as the message key (the idempotency key when it has none), so one
//! aggregate's messages land in one partition, in order. (With
//! [`Layout::ByAggregateType`] the topic is *prefix + the topic up to its last `.`*, so that
//! an aggregate's events of every type share one topic and keep their order.) Its headers: `x-outbox-message-id`
//! (the idempotency key, which consumers dedupe on), `x-outbox-attempt`,
//! `x-outbox-aggregate-key` when set, `content-type` when set, and the record's own headers
//! (trace context included; library headers win). The producer is idempotent
//! (`enable.idempotence=true`, `acks=all`): a message counts as published only once every
//! in-sync replica has it, and librdkafka's own retries never write it twice. A record
//! published again by the relay (after a crash between the broker's report and the
//! outcome's commit) is stored again: the consumer's dedupe covers it.
//!
//! A claimed batch is pipelined: every record is produced, then every delivery report
//! awaited, the whole batch within the delivery timeout. A failure the broker reports about
//! one message fails its attempt (retried, then dead-lettered); a message over a size limit
//! (the producer's `message.max.bytes`, see [`KafkaPublisherBuilder::max_message_bytes`], or
//! the broker's) or to a topic name Kafka refuses fails permanently and alone.
//!
//! Kafka out of reach is not a message's fault: no broker answering, a transport failure,
//! a topic or partition that does not exist, no leader, a refused login or permission, no
//! delivery report within the timeout (librdkafka reports a message's own failure by
//! itself; a broker that stops answering leaves its messages without one), are reported as [`PublishError::unavailable`], and the
//! relay releases those records without spending their attempts. librdkafka reconnects by
//! itself, for ever.
//!
//! Hazard: a topic that does not exist (on a cluster that does not create topics on first
//! use) is held the same way, never dead-lettered: while such a row is due the relay keeps
//! backing off as a whole. Create the topics first ([`Topology`], or
//! `diesel-outbox declare --broker kafka`).
//!
//! TLS ([`KafkaPublisherBuilder::tls`]: `SSL`) and SASL logins ([`Sasl`]: PLAIN,
//! SCRAM-SHA-256, SCRAM-SHA-512; with TLS, `SASL_SSL`) are librdkafka's, on OpenSSL. The
//! brokers' certificates and names are verified, against the platform's roots and the CA
//! file if given. An OAUTHBEARER login with librdkafka's OIDC method (Amazon MSK, Confluent
//! Cloud) is given through [`KafkaPublisherBuilder::property`] (an example is there), but
//! needs a librdkafka built with libcurl, which the bundled one is not yet: it is refused at
//! connect, saying so. Kerberos (GSSAPI) is not built in. A connect that fails says why, as librdkafka reported it
//! ("certificate verify failed", "SASL authentication error").
//!
//! Any other librdkafka property passes through `property` too (on the consumer source and
//! [`Topology`] as well), but for the keys the crate sets for its guarantees, which are
//! refused by name (see [`KafkaPublisherBuilder::property`]). Values never appear in logs
//! or errors.
//!
//! The tests run against Tansu, a Kafka-compatible broker, on its memory storage: producing
//! with the idempotent producer, keys, headers and delivery reports, topics created with
//! their partitions, consuming by a consumer group with committed offsets, a SCRAM login
//! refused. TLS is tested through a TLS listener of the tests' own in front of Tansu; a
//! SCRAM login that succeeds is not tested (Tansu keeps its users in its storage, which
//! starts empty and refuses to add one while logins are required).
//!
//! ```no_run
//! use diesel_outbox::kafka::KafkaPublisher;
//!
//! # async fn run() -> Result<(), diesel_outbox::Error> {
//! let publisher = KafkaPublisher::builder("kafka-1:9092,kafka-2:9092")
//!     .topic_prefix("outbox.")
//!     .connect()
//!     .await?;
//! # let _ = publisher; Ok(()) }
//! ```
//!
//! Inside: `passthrough` (the properties given with `property`, the keys the crate owns,
//! librdkafka's refusals told without values), `properties` (a record as a Kafka message,
//! and what a Kafka error says),
//! `pipeline` (a batch produced at once, its delivery reports matched to records),
//! `topology` (topics created with their partitions, or found with theirs).

mod connection;
mod dead_letters;
mod passthrough;
mod pipeline;
mod properties;
pub(crate) mod source;
mod topology;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};

pub use self::connection::Sasl;
pub(crate) use self::connection::{Observed, Security};
pub use self::dead_letters::{
    DLT_OFFSET_HEADER, DLT_PARTITION_HEADER, DLT_REASON_HEADER, DLT_TOPIC_HEADER,
};
pub use self::passthrough::is_secret_property;
pub(crate) use self::passthrough::{Client, Properties};
pub use self::properties::{CONTENT_TYPE_HEADER, Layout, MESSAGE_ID_HEADER, TOPIC_HEADER};
pub use self::topology::{DeclaredTopic, Topology};
use crate::error::{Error, Result};
use crate::publisher::PublishError;
use crate::tls::Tls;

/// The producer, with the context that keeps librdkafka's last connection error.
type KafkaProducer = FutureProducer<Observed>;

/// Produces records to Kafka with an idempotent producer, awaiting each delivery report;
/// see the [module docs](self).
///
/// ```no_run
/// use diesel_outbox::kafka::KafkaPublisher;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// let publisher = KafkaPublisher::builder("127.0.0.1:9092")
///     .topic_prefix("outbox.")
///     .connect()
///     .await?;
/// # let _ = publisher; Ok(()) }
/// ```
pub struct KafkaPublisher {
    /// `host:port[,…]`: how the brokers are named in errors and logs.
    endpoint: String,
    prefix: String,
    layout: Layout,
    delivery_timeout: Duration,
    /// Whether the user set `delivery_timeout` (otherwise a relay fits it to its lease).
    delivery_timeout_set: bool,
    /// Everything but the message timeout, to make the producer again (with another
    /// timeout, or after a fatal error).
    config: ClientConfig,
    /// Replaced when it lost its standing with the cluster (fenced after an outage, say):
    /// such a producer never sends again.
    producer: RwLock<(u64, KafkaProducer)>,
    /// The number of the producer a report said lost its standing (the producers are
    /// numbered from 1; 0 is none): only that one is replaced, not its successor.
    spent: AtomicU64,
    /// librdkafka's last connection error, shared by every producer made.
    observed: Observed,
}

impl fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("endpoint", &self.endpoint)
            .field("topic_prefix", &self.prefix)
            .field("delivery_timeout", &self.delivery_timeout)
            .finish_non_exhaustive()
    }
}

/// Configures a [`KafkaPublisher`]; from [`KafkaPublisher::builder`].
#[must_use]
pub struct KafkaPublisherBuilder {
    brokers: String,
    prefix: String,
    layout: Layout,
    delivery_timeout: Duration,
    delivery_timeout_set: bool,
    max_message_bytes: Option<usize>,
    security: Security,
    properties: Properties,
}

impl fmt::Debug for KafkaPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The list is shown only once it is known to hold nothing but hosts and ports.
        let shown = brokers(&self.brokers).unwrap_or_else(|_| "(not host:port)".into());
        f.debug_struct("KafkaPublisherBuilder")
            .field("brokers", &shown)
            .field("topic_prefix", &self.prefix)
            .field("layout", &self.layout)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("tls", &self.security.tls)
            .field("sasl", &self.security.sasl)
            .field("properties", &self.properties)
            .finish()
    }
}

impl KafkaPublisher {
    /// A publisher to the Kafka cluster reached through `brokers`: `host:port`, or several
    /// separated by commas (the bootstrap servers).
    pub fn builder(brokers: impl Into<String>) -> KafkaPublisherBuilder {
        KafkaPublisherBuilder {
            brokers: brokers.into(),
            prefix: String::new(),
            layout: Layout::default(),
            delivery_timeout: crate::defaults::DELIVERY_TIMEOUT,
            delivery_timeout_set: false,
            max_message_bytes: None,
            security: Security::default(),
            properties: Properties::default(),
        }
    }

    /// What topics start with: the topic of a record is this prefix + its topic.
    pub fn topic_prefix(&self) -> &str {
        &self.prefix
    }
}

impl KafkaPublisherBuilder {
    /// Put in front of every record's topic (`"outbox."` makes topic `order.created` go to
    /// `outbox.order.created`). Defaults to none.
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Which Kafka topic each message goes to, and so which messages a consumer sees in
    /// order: one Kafka topic per message topic ([`Layout::ByTopic`], the default), or one
    /// per aggregate type ([`Layout::ByAggregateType`], Debezium's outbox event router's
    /// layout), where every event of one aggregate is in order.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The longest a batch may take; librdkafka gives up on a message a little before
    /// (its `message.timeout.ms`), which counts as an outage. The relay checks at `build()`
    /// that it fits in half its lease. Defaults to 10 s.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.delivery_timeout = timeout;
        self.delivery_timeout_set = true;
        self
    }

    /// The largest message the producer sends (librdkafka's `message.max.bytes`, value,
    /// key and headers together); a larger one fails permanently without being sent.
    /// Defaults to librdkafka's 1,000,000. Keep it at or below the broker's own limit.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = Some(bytes);
        self
    }

    /// Connects over TLS (`SSL`, or `SASL_SSL` with [`sasl`](Self::sasl)): the brokers'
    /// certificates are verified against the platform's roots and the CA file if given,
    /// their names included, and the client certificate if given is shown. Defaults to
    /// plain TCP.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.security.tls = Some(tls);
        self
    }

    /// Logs in with SASL (PLAIN or SCRAM); see [`Sasl`] for the hazard of a login
    /// without [`tls`](Self::tls). Defaults to none.
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.security.sasl = Some(sasl);
        self
    }

    /// Sets the librdkafka property `key` to `value` on the producer, for what the builder
    /// has no method for: a login it does not offer (OAUTHBEARER, below), `client.id`,
    /// `compression.type`, `linger.ms`, socket and metadata settings, a key-hashing
    /// `partitioner` that matches Java clients (`murmur2_random`). Later calls win for the
    /// same key; they override the crate's defaults (`client.id` "diesel-outbox relay",
    /// `linger.ms` 2). librdkafka checks the key and the value at [`connect`](Self::connect).
    ///
    /// The keys the crate sets for its guarantees are refused at `connect` with
    /// [`Error::InvalidOption`] naming the key and why, before anything connects:
    /// `enable.idempotence`, `acks`, `max.in.flight.requests.per.connection`, `retries`
    /// (the idempotent producer: no message written twice, each partition in order),
    /// `transactional.id`, `message.timeout.ms`, `delivery.timeout.ms` and
    /// `request.timeout.ms` (they follow [`delivery_timeout`](Self::delivery_timeout)),
    /// `message.max.bytes` (use [`max_message_bytes`](Self::max_message_bytes)),
    /// `bootstrap.servers`, `ssl.endpoint.identification.algorithm` and
    /// `enable.ssl.certificate.verification` (the brokers' names and certificates are
    /// always verified), `partitioner=random` (it would scatter an aggregate over
    /// partitions), and, once [`tls`](Self::tls) or [`sasl`](Self::sasl) is given, what they
    /// set (`security.protocol`, `sasl.*` of the login, `ssl.ca.*`, `ssl.certificate.*`,
    /// `ssl.key.*`); librdkafka's aliases of these too.
    ///
    /// The value may be a secret (`sasl.password`, `sasl.oauthbearer.client.secret`): it
    /// never appears in the builder's `Debug`, in logs or in errors, which name the key
    /// only.
    ///
    /// Hazard: a property changes what librdkafka does, and the crate's tests cover its
    /// own settings, not yours (`linger.ms` trades latency for batching, say).
    ///
    /// **OAUTHBEARER with OIDC** (Amazon MSK with IAM through an OIDC provider, Confluent
    /// Cloud with OAuth): librdkafka fetches a token from the token endpoint with the client
    /// credentials, and again before it expires.
    ///
    /// Hazard: librdkafka's OIDC method needs libcurl, and the librdkafka this crate
    /// bundles is built without it: `connect` fails with [`Error::InvalidOption`] naming
    /// the property ("not supported in this build: OAuth/OIDC depends on libcurl"), never
    /// its value. The properties below are those that a librdkafka with libcurl takes.
    ///
    /// `security.protocol=SASL_SSL` gives TLS, with the brokers' certificates and names
    /// verified against OpenSSL's default roots (the system's); or, for a private CA, give
    /// [`tls`](Self::tls) instead of `security.protocol`: with a `sasl.mechanism` property
    /// its `SSL` becomes `SASL_SSL`. Without either, the token would go over plain TCP.
    ///
    /// ```
    /// use diesel_outbox::kafka::KafkaPublisher;
    ///
    /// let secret = std::env::var("KAFKA_CLIENT_SECRET").unwrap_or_default();
    /// let builder = KafkaPublisher::builder("broker-1.example.com:9093")
    ///     .topic_prefix("outbox.")
    ///     .property("security.protocol", "SASL_SSL")
    ///     .property("sasl.mechanism", "OAUTHBEARER")
    ///     .property("sasl.oauthbearer.method", "oidc")
    ///     .property("sasl.oauthbearer.client.id", "outbox-relay")
    ///     .property("sasl.oauthbearer.client.secret", secret)
    ///     .property(
    ///         "sasl.oauthbearer.token.endpoint.url",
    ///         "https://login.example.com/oauth2/v2.0/token",
    ///     )
    ///     .property("sasl.oauthbearer.scope", "kafka");
    /// // `builder.connect().await?` makes the producer and logs in.
    /// assert!(!format!("{builder:?}").contains("oauth2/v2.0"), "values are not shown");
    /// ```
    pub fn property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push(key, value);
        self
    }

    /// Validates the settings, makes the producer and waits for a broker's answer (failing
    /// fast on an unreachable cluster). Later losses are repaired by librdkafka itself.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a broker list that is not `host:port[,…]`, a topic
    /// prefix that cannot start a topic name, a zero delivery timeout, a message size
    /// librdkafka refuses, a TLS file that cannot be read, an empty SASL user, a
    /// [`property`](Self::property) the crate owns or librdkafka refuses (named, its value
    /// not shown);
    /// [`Error::Publish`] when no broker answers (naming them and the cause librdkafka
    /// gave: a refused connection, a certificate that failed verification, a refused
    /// login).
    pub async fn connect(self) -> Result<KafkaPublisher> {
        let publisher = self.validated()?;
        let producer = publisher.live_producer().map_err(Error::InvalidOption)?.1;
        reachable(
            &producer,
            &publisher.observed,
            &publisher.endpoint,
            publisher.delivery_timeout,
        )
        .await?;
        tracing::info!(endpoint = %publisher.endpoint, "connected to Kafka");
        Ok(publisher)
    }

    /// Validates the settings and makes the producer without waiting for a broker: it
    /// connects by itself, now or once a broker answers, and while none does the relay
    /// counts an outage (no attempt spent, [`Health`](crate::Health) not ready, saying
    /// why). For a service that must take requests while Kafka is down, at deploy time
    /// too.
    ///
    /// Only what can be checked without a broker is checked here: a refused login or a
    /// certificate that does not verify shows as an outage naming it, not as an error at
    /// start. Use [`connect`](Self::connect) where Kafka should be up at start.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] as for [`connect`](Self::connect).
    pub async fn connect_lazy(self) -> Result<KafkaPublisher> {
        let publisher = self.validated()?;
        tracing::info!(
            endpoint = %publisher.endpoint,
            "Kafka publisher started; it connects in the background"
        );
        Ok(publisher)
    }

    /// The publisher the settings make, with its producer, checked without a broker.
    fn validated(self) -> Result<KafkaPublisher> {
        let endpoint = brokers(&self.brokers).map_err(Error::InvalidOption)?;
        if !self.prefix.is_empty() {
            properties::check_topic(&format!("{}x", self.prefix)).map_err(|why| {
                Error::InvalidOption(format!("topic_prefix cannot start a topic: {why}"))
            })?;
        }
        if self.delivery_timeout.is_zero() {
            return Err(Error::InvalidOption(
                "delivery_timeout must be above zero".into(),
            ));
        }
        self.properties
            .check(Client::Producer, &self.security)
            .map_err(Error::InvalidOption)?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &endpoint)
            .set("client.id", "diesel-outbox relay")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "2");
        if let Some(bytes) = self.max_message_bytes {
            config.set("message.max.bytes", bytes.to_string());
        }
        self.security
            .apply(&mut config)
            .map_err(Error::InvalidOption)?;
        self.properties.apply(&mut config);
        let observed = Observed::default();
        let producer =
            producer(&config, self.delivery_timeout, &observed).map_err(Error::InvalidOption)?;
        Ok(KafkaPublisher {
            endpoint,
            prefix: self.prefix,
            layout: self.layout,
            delivery_timeout: self.delivery_timeout,
            delivery_timeout_set: self.delivery_timeout_set,
            config,
            producer: RwLock::new((1, producer)),
            spent: AtomicU64::new(0),
            observed,
        })
    }
}

crate::broker::pipeline::pipelined_publisher!(KafkaPublisher);

impl KafkaPublisher {
    /// The producer to send a batch with: the current one, or a new one when the current
    /// one lost its standing with the cluster (an idempotent producer fenced after an
    /// outage never sends again, and librdkafka may or may not call that fatal). `Err`
    /// when a new one cannot be made.
    fn live_producer(&self) -> std::result::Result<(u64, KafkaProducer), String> {
        let spent = |slot: &(u64, KafkaProducer)| {
            self.spent.load(Ordering::SeqCst) == slot.0 || slot.1.client().fatal_error().is_some()
        };
        {
            let current = self.producer.read().unwrap_or_else(PoisonError::into_inner);
            if !spent(&current) {
                return Ok(current.clone());
            }
        }
        let mut slot = self
            .producer
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if spent(&slot) {
            let why = slot.1.client().fatal_error().map_or_else(
                || "fenced".to_owned(),
                |(code, why)| format!("{code:?}: {why}"),
            );
            tracing::warn!(endpoint = %self.endpoint, error = %why, "the Kafka producer lost its standing: making a new one");
            *slot = (
                slot.0 + 1,
                producer(&self.config, self.delivery_timeout, &self.observed)?,
            );
        }
        Ok(slot.clone())
    }

    /// A report said producer number `number` lost its standing: the next batch makes a
    /// new one (unless that happened already).
    fn mark_spent(&self, number: u64) {
        self.spent.store(number, Ordering::SeqCst);
    }
}

/// The broker list `brokers` as `host:port,…`, or why it is not one. It is echoed only
/// when it holds nothing but host names and ports.
pub(crate) fn brokers(brokers: &str) -> std::result::Result<String, String> {
    let mut named = Vec::new();
    for broker in brokers.split(',').map(str::trim) {
        let valid = broker.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && host.chars().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '[' | ']' | ':')
                })
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        });
        if !valid {
            return Err(format!(
                "the Kafka brokers must be `host:port` separated by commas (got {} entr{} \
                 of which one is not)",
                brokers.split(',').count(),
                if brokers.split(',').count() == 1 {
                    "y"
                } else {
                    "ies"
                }
            ));
        }
        named.push(broker);
    }
    Ok(named.join(","))
}

/// A producer with `config` and a message timeout a little under `timeout`, so that
/// librdkafka's report of a message it gave up on arrives before the batch's deadline.
pub(crate) fn producer(
    config: &ClientConfig,
    timeout: Duration,
    observed: &Observed,
) -> std::result::Result<KafkaProducer, String> {
    let margin = (timeout / 10).min(Duration::from_secs(1));
    let message_timeout = (timeout - margin).max(Duration::from_millis(1));
    let millis = message_timeout.as_millis().max(1).to_string();
    let mut config = config.clone();
    // A request to a broker that stopped answering ends by then too, so its messages are
    // reported (as timed out) rather than kept in flight.
    config
        .set("message.timeout.ms", &millis)
        .set("request.timeout.ms", &millis);
    config.create_with_context(observed.clone()).map_err(|e| {
        format!(
            "the Kafka producer refused its settings: {}",
            passthrough::refused(&e, &config)
        )
    })
}

/// Waits up to `timeout` for a broker to answer a metadata request.
pub(crate) async fn reachable(
    producer: &KafkaProducer,
    observed: &Observed,
    endpoint: &str,
    timeout: Duration,
) -> Result<()> {
    let asking = producer.clone();
    let asked = tokio::task::spawn_blocking(move || {
        asking
            .client()
            .fetch_metadata(None, timeout)
            .map(|m| m.brokers().len())
    })
    .await
    .map_err(|e| Error::Publish(PublishError::unavailable(e.to_string()).into()))?;
    match asked {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err(Error::Publish(
            PublishError::unavailable(format!("Kafka at {endpoint} named no broker")).into(),
        )),
        Err(e) => Err(Error::Publish(
            PublishError::unavailable(format!(
                "no Kafka broker at {endpoint} answered within {timeout:?}: {}",
                observed.explain(e)
            ))
            .into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_list_is_host_and_port_each() {
        assert_eq!(
            brokers("k1:9092, k2.internal:9093").unwrap(),
            "k1:9092,k2.internal:9093"
        );
        for bad in [
            "",
            "k1",
            "k1:0",
            "k1:x",
            "kafka://k1:9092",
            "user:s3cret@k1:9092",
        ] {
            let err = brokers(bad).expect_err(bad);
            assert!(!err.contains("s3cret"), "{err}");
        }
    }
}
