//! The RabbitMQ publisher (feature `rabbitmq`), on lapin.
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
//! blocked by a resource alarm are reported as [`PublishError::unavailable`](crate::PublishError::unavailable), and the relay
//! releases such records without spending their attempts. A batch that times out counts as
//! held up by an alarm, not as the records' failure, when the broker blocked the connection
//! at any time after the batch began, even if the alarm cleared just before its deadline, or
//! unblocked it less than one confirm timeout before the batch began (while blocked, nothing
//! is written; once unblocked, everything held back goes at once). When the channel or
//! connection goes down under records already written, the first of them is charged a
//! transient failure (it may be the one that brought it down, and must not be retried
//! forever) and the others are released.
//!
//! Before anything is written, each record is checked against what RabbitMQ itself accepts,
//! and fails permanently and alone if it breaks a rule: names and values over 255 bytes
//! where AMQP needs a short string, a `CC` or `BCC` header (RabbitMQ would route on it), or
//! a header frame larger than the connection's negotiated `frame_max` (the broker would
//! close the connection, failing every batch on it). Enqueue refuses all of these already;
//! the check covers rows written by other means.
//!
//! TLS: an `amqps://` URL connects over TLS (rustls), the broker's certificate and name
//! verified against the platform's roots and the CA file of
//! [`RabbitMqPublisherBuilder::tls`], with its client certificate if given; add
//! `?auth_mechanism=external` to the URL to log in with that certificate (Amazon MQ and
//! RabbitMQ's `rabbitmq_auth_mechanism_ssl` map certificates to users). The consumer
//! runner's source (`consumer::rabbitmq::Source`) takes the same settings.
//!
//! ```no_run
//! use diesel_outbox::Tls;
//! use diesel_outbox::rabbitmq::RabbitMqPublisher;
//!
//! # async fn run() -> Result<(), diesel_outbox::Error> {
//! let publisher = RabbitMqPublisher::builder("amqps://relay:secret@mq.example.com/%2f", "events")
//!     .tls(Tls::new().ca_file("/etc/outbox/mq-ca.pem"))
//!     .connect()
//!     .await?;
//! # let _ = publisher; Ok(()) }
//! ```
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

//!
//! Inside: `endpoint` (the URL and the TLS files, connecting with both), `connection` (the
//! link, its channels and reconnecting), `properties` (a record
//! as AMQP properties, and the checks of what RabbitMQ accepts), `pipeline` (a batch
//! published at once, its confirms and returns matched to records).

mod connection;
mod endpoint;
mod pipeline;
mod properties;
pub(crate) mod source;
mod topology;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::ShortString;
use tokio::sync::Mutex;

pub(crate) use self::connection::not_found;
use self::connection::{Blocks, Link};
pub(crate) use self::endpoint::Endpoint;
pub use self::topology::Topology;
use crate::error::{Error, Result};
use crate::tls::Tls;

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
    endpoint: Endpoint,
    /// How the publisher's connection is named on the broker.
    connection_name: String,
    exchange: ShortString,
    mandatory: bool,
    confirm_timeout: Duration,
    /// Whether the user set `confirm_timeout` (otherwise a relay fits it to its lease).
    confirm_timeout_set: bool,
    link: Arc<Mutex<Link>>,
    blocks: Blocks,
}

impl fmt::Debug for RabbitMqPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqPublisher")
            .field("endpoint", &self.endpoint.name)
            .field("exchange", &self.exchange.as_str())
            .field("mandatory", &self.mandatory)
            .field("confirm_timeout", &self.confirm_timeout)
            .finish_non_exhaustive()
    }
}

/// Configures a [`RabbitMqPublisher`]; from [`RabbitMqPublisher::builder`].
#[must_use]
pub struct RabbitMqPublisherBuilder {
    url: String,
    exchange: String,
    mandatory: bool,
    confirm_timeout: Duration,
    confirm_timeout_set: bool,
    tls: Option<Tls>,
}

impl fmt::Debug for RabbitMqPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMqPublisherBuilder")
            .field("exchange", &self.exchange)
            .field("mandatory", &self.mandatory)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl RabbitMqPublisher {
    /// A publisher to `exchange` on the broker at `url` (`amqp://user:pass@host:port/vhost`,
    /// or `amqps://` for TLS; `?auth_mechanism=external` logs in with the client
    /// certificate of [`RabbitMqPublisherBuilder::tls`]). The exchange must exist: declare
    /// it in your deployment or at start-up.
    pub fn builder(
        url: impl Into<String>,
        exchange: impl Into<String>,
    ) -> RabbitMqPublisherBuilder {
        RabbitMqPublisherBuilder {
            url: url.into(),
            exchange: exchange.into(),
            mandatory: true,
            confirm_timeout: crate::defaults::CONFIRM_TIMEOUT,
            confirm_timeout_set: false,
            tls: None,
        }
    }

    /// The exchange records are published to.
    pub fn exchange(&self) -> &str {
        self.exchange.as_str()
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
    /// lease. Defaults to 10 s, lowered by the relay to half its lease when that is
    /// shorter.
    pub fn confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self.confirm_timeout_set = true;
        self
    }

    /// TLS settings for an `amqps://` URL: a CA file to trust besides the platform's roots,
    /// and a client certificate (which `?auth_mechanism=external` in the URL logs in with).
    /// The server's certificate and name are always verified. Defaults to the platform's
    /// roots and no client certificate.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Validates the settings and connects (failing fast on a wrong URL or an unreachable
    /// broker). Later connection losses are repaired by the publisher itself.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a malformed URL (not echoed: it may hold a password), TLS
    /// settings with an `amqp://` URL, a TLS file that is missing, unreadable or not PEM
    /// (naming the file), an exchange name over 255 bytes or a zero confirm timeout;
    /// [`Error::NotDeclared`] when the exchange does not exist; [`Error::Publish`] when the
    /// broker cannot be reached (naming the cause, such as a certificate that does not
    /// verify).
    pub async fn connect(self) -> Result<RabbitMqPublisher> {
        let publisher = self.validated()?;
        let lent = publisher
            .channel()
            .await
            .map_err(|why| Error::Publish(why.into()))?;
        // The exchange must exist now: a name that is wrong is no outage to wait out.
        // (A passive declare that fails closes its channel, which is then not given back.)
        let exists = lent
            .channel
            .exchange_declare(
                publisher.exchange.clone(),
                lapin::ExchangeKind::Topic,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await;
        match exists {
            Ok(()) => publisher.give_back(lent.channel),
            Err(e) if connection::not_found(&e) => {
                return Err(Error::NotDeclared(format!(
                    "exchange `{}` does not exist on RabbitMQ at {}: declare it \
                     (rabbitmq::Topology, or diesel-outbox declare) or fix the name",
                    publisher.exchange.as_str(),
                    publisher.endpoint.name
                )));
            }
            Err(e) => {
                return Err(Error::Publish(
                    format!("RabbitMQ at {}: {e}", publisher.endpoint.name).into(),
                ));
            }
        }
        Ok(publisher)
    }

    /// Validates the settings and starts without the broker: the publisher connects at its
    /// first publish, and while it cannot, the relay counts an outage (no attempt spent,
    /// [`Health`](crate::Health) not ready, saying why). For a service that must take
    /// requests while its broker is down, at deploy time too.
    ///
    /// Only what can be checked without the broker is checked here: a refused login or a
    /// missing exchange shows as an outage naming it, not as an error at start. Use
    /// [`connect`](Self::connect) where the broker should be up at start.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] as for [`connect`](Self::connect).
    pub async fn connect_lazy(self) -> Result<RabbitMqPublisher> {
        let publisher = self.validated()?;
        tracing::info!(
            endpoint = %publisher.endpoint.name,
            "RabbitMQ publisher started; it connects at its first publish"
        );
        Ok(publisher)
    }

    /// The publisher the settings make, checked without the broker.
    fn validated(self) -> Result<RabbitMqPublisher> {
        let endpoint = Endpoint::new(&self.url, self.tls.as_ref()).map_err(Error::InvalidOption)?;
        let exchange = ShortString::try_new(self.exchange)
            .map_err(|_| Error::InvalidOption("exchange name is over 255 bytes".into()))?;
        if self.confirm_timeout.is_zero() {
            return Err(Error::InvalidOption(
                "confirm_timeout must be above zero".into(),
            ));
        }
        Ok(RabbitMqPublisher {
            connection_name: format!("diesel-outbox publisher to {}", exchange.as_str()),
            endpoint,
            exchange,
            mandatory: self.mandatory,
            confirm_timeout: self.confirm_timeout,
            confirm_timeout_set: self.confirm_timeout_set,
            link: Arc::new(Mutex::new(Link::default())),
            blocks: Blocks::default(),
        })
    }
}

crate::broker::pipeline::pipelined_publisher!(RabbitMqPublisher);
