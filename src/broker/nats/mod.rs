//! The NATS JetStream publisher (feature `nats`), on async-nats.
//!
//! Each record is published to the subject *prefix + topic*, which a JetStream stream must
//! capture, with its payload and these NATS headers: `Nats-Msg-Id` (the idempotency key),
//! `x-outbox-attempt`, `x-outbox-aggregate-key` when set, `Content-Type` when set, and the
//! record's own headers (library headers win). A record counts as published only once the
//! stream acknowledged it. Because `Nats-Msg-Id` is the idempotency key, JetStream itself
//! drops a record published again inside the stream's duplicate window (2 minutes unless
//! the stream says otherwise); such an acknowledgement says `duplicate` and counts as sent.
//! A redelivery later than the window is stored again: the consumer's dedupe covers it.
//!
//! A claimed batch is pipelined: every record is sent, then every acknowledgement awaited,
//! the whole batch within the ack timeout. An error the stream gives about one message is a
//! transient failure (retried, then dead-lettered); no acknowledgement in time on a healthy
//! connection is one too. A message over the stream's own size limits fails permanently.
//!
//! The server being out of reach is not a message's fault: no stream for the subject, no
//! responders, the client not connected, the connection lost while acknowledgements were
//! awaited, or a stream that takes nothing now (full with discard-new, out of storage,
//! JetStream disabled) are reported as [`PublishError::unavailable`], and the relay releases those
//! records without spending their attempts. The client reconnects by itself, for ever.
//!
//! Hazard: a topic that no stream captures is held the same way, never dead-lettered:
//! while such a row is due the relay keeps backing off as a whole. Give the stream the
//! subjects `<prefix>>` so that it captures every topic.
//!
//! Before anything is sent, each record is checked against what NATS takes, and fails
//! permanently and alone if it breaks a rule: a subject that is empty, over 1 KiB, with
//! whitespace, a control character, a wildcard (`*`, `>`) or an empty token, or starting
//! with `$` (the server's own APIs); a header name NATS refuses, or starting with `Nats-`
//! (JetStream acts on those: `Nats-Rollup` would purge the stream); a header value, key or
//! aggregate key with a line break; a message larger, with its headers, than the server's
//! `max_payload`. None of these can reach the server, so no record can take the connection
//! down.
//!
//! Credentials in the URL (`nats://user:password@host` or `nats://token@host`) are handed
//! to async-nats as options, never inside the server addresses it logs; they never appear
//! in the publisher's `Debug` output, its errors or its logs. The same holds for the
//! [`Credentials`] of the builder: a `.creds` file (a user JWT and its NKey seed, as NGS and
//! Synadia Cloud issue), an NKey seed, a token, or a user and password; give them one way.
//!
//! TLS: with [`JetStreamPublisherBuilder::tls`] the connection is always over TLS (rustls),
//! the server's certificate and name verified against the platform's roots and the given
//! CA file, with the given client certificate; a `tls://` URL, or a server that requires
//! TLS, without it verifies against the platform's roots alone. The consumer runner's
//! source (`consumer::nats::Source`) takes the same credentials and TLS settings.
//!
//! ```no_run
//! use diesel_outbox::Tls;
//! use diesel_outbox::nats::{Credentials, JetStreamPublisher};
//!
//! # async fn run() -> Result<(), diesel_outbox::Error> {
//! let publisher = JetStreamPublisher::builder("tls://connect.ngs.global")
//!     .subject_prefix("outbox.")
//!     .credentials(Credentials::file("/run/secrets/outbox.creds"))
//!     .tls(Tls::new())
//!     .connect()
//!     .await?;
//! # let _ = publisher; Ok(()) }
//! ```
//!
//! Hazard: async-nats itself logs the connection handshake, credentials included, at
//! `trace` level under the `async_nats` target. Filter that target (`async_nats=debug`, as
//! the `diesel-outbox` binary does) wherever credentials must not reach the logs.
//!
//! Inside: `connection` (the URL, credentials and TLS, connecting, lost connections),
//! `properties` (a record as a NATS message, and the checks of what NATS takes),
//! `pipeline` (a batch sent at once, its acknowledgements matched to records).

mod connection;
mod pipeline;
mod properties;
pub(crate) mod source;
mod topology;

use std::fmt;
use std::time::Duration;

use async_nats::Client;
use async_nats::jetstream;
use tokio::sync::watch;

pub use self::connection::Credentials;
pub(crate) use self::connection::{Servers, connected};
pub(crate) use self::properties::{CONTENT_TYPE_HEADER, MESSAGE_ID_HEADER};
pub use self::topology::Topology;
use crate::error::{Error, Result};
use crate::publisher::PublishError;
use crate::tls::Tls;

/// Far above what the relay ever has in flight (pipelined batches of at most 10,000).
const MAX_ACK_INFLIGHT: usize = 1 << 20;

/// Publishes records to NATS JetStream, awaiting each stream acknowledgement; see the
/// [module docs](self).
///
/// ```no_run
/// use diesel_outbox::nats::JetStreamPublisher;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// // A stream capturing `outbox.>` must exist.
/// let publisher = JetStreamPublisher::builder("nats://127.0.0.1:4222")
///     .subject_prefix("outbox.")
///     .connect()
///     .await?;
/// # let _ = publisher; Ok(()) }
/// ```
pub struct JetStreamPublisher {
    /// `host:port[,…]`: how the servers are named in errors and logs (never the URL).
    endpoint: String,
    prefix: String,
    ack_timeout: Duration,
    /// Whether the user set `ack_timeout` (otherwise a relay fits it to its lease).
    ack_timeout_set: bool,
    client: Client,
    jetstream: jetstream::Context,
    /// Bumped on every lost connection.
    lost: watch::Receiver<u64>,
}

impl fmt::Debug for JetStreamPublisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamPublisher")
            .field("endpoint", &self.endpoint)
            .field("subject_prefix", &self.prefix)
            .field("ack_timeout", &self.ack_timeout)
            .field("connected", &connected(&self.client))
            .finish_non_exhaustive()
    }
}

/// Configures a [`JetStreamPublisher`]; from [`JetStreamPublisher::builder`].
#[must_use]
pub struct JetStreamPublisherBuilder {
    url: String,
    prefix: String,
    ack_timeout: Duration,
    ack_timeout_set: bool,
    credentials: Option<Credentials>,
    tls: Option<Tls>,
}

impl fmt::Debug for JetStreamPublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JetStreamPublisherBuilder")
            .field("subject_prefix", &self.prefix)
            .field("ack_timeout", &self.ack_timeout)
            .field("credentials", &self.credentials)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl JetStreamPublisher {
    /// A publisher to the NATS server(s) at `url`: `nats://[user:password@|token@]host:port`
    /// (`tls://` for TLS), or several such URLs separated by commas.
    pub fn builder(url: impl Into<String>) -> JetStreamPublisherBuilder {
        JetStreamPublisherBuilder {
            url: url.into(),
            prefix: String::new(),
            ack_timeout: crate::defaults::ACK_TIMEOUT,
            ack_timeout_set: false,
            credentials: None,
            tls: None,
        }
    }

    /// What subjects start with: the subject of a record is this prefix + its topic.
    pub fn subject_prefix(&self) -> &str {
        &self.prefix
    }
}

impl JetStreamPublisherBuilder {
    /// Put in front of every topic to make its subject (`"outbox."` makes topic
    /// `order.created` go to `outbox.order.created`). Defaults to none: the subject is the
    /// topic.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The longest a batch may take; acknowledgements missing then count as transient
    /// failures (or as an outage, when the connection was lost). The relay checks at
    /// `build()` that it fits in half its lease. Defaults to 10 s.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self.ack_timeout_set = true;
        self
    }

    /// How to log in: a credentials file, an NKey seed, a token, or a user and password.
    /// Defaults to the URL's user info, if any (give credentials one way only).
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Connects over TLS, verifying the server's certificate and name against the
    /// platform's roots and the CA file of `tls`, and showing its client certificate.
    /// Defaults to TLS only when the URL says `tls://` or the server requires it.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Validates the settings and connects (failing fast on a wrong URL or an unreachable
    /// server). Later connection losses are repaired by the client itself.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a malformed URL (not echoed: it may hold credentials),
    /// credentials given both in the URL and with [`credentials`](Self::credentials), a
    /// credentials, CA, certificate or key file that is missing, unreadable or malformed
    /// (naming the file), an NKey seed that is not one (not echoed), a subject prefix
    /// that cannot start a valid subject, or a zero ack timeout; [`Error::NotDeclared`] when
    /// no stream captures the subject prefix; [`Error::Publish`] when no server answers
    /// (naming the cause, such as a certificate that does not verify).
    pub async fn connect(self) -> Result<JetStreamPublisher> {
        let servers = self.validated()?;
        let (client, lost) = servers
            .connect("diesel-outbox relay", self.ack_timeout)
            .await
            .map_err(|why| Error::Publish(PublishError::unavailable(why).into()))?;
        tracing::info!(endpoint = %servers.endpoint, "connected to NATS");
        if let Ok(false) = captured(&jetstream::new(client.clone()), &self.prefix).await {
            return Err(Error::NotDeclared(format!(
                "no JetStream stream on NATS at {} captures subjects `{}>`: declare one \
                 (nats::Topology, or diesel-outbox declare --broker nats) or fix the prefix",
                servers.endpoint, self.prefix
            )));
        }
        Ok(self.publisher(servers, client, lost))
    }

    /// Validates the settings and starts without a server: the client connects in the
    /// background, now or once a server answers, and while it is not connected the relay
    /// counts an outage (no attempt spent, [`Health`](crate::Health) not ready, saying
    /// why). For a service that must take requests while NATS is down, at deploy time too.
    ///
    /// Only what can be checked without a server is checked here: a refused login or no
    /// stream for the subjects shows as an outage naming it, not as an error at start. Use
    /// [`connect`](Self::connect) where NATS should be up at start.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] as for [`connect`](Self::connect); [`Error::Publish`] when
    /// the client itself cannot be started.
    pub async fn connect_lazy(self) -> Result<JetStreamPublisher> {
        let servers = self.validated()?;
        let (client, lost) = servers
            .connect_lazy("diesel-outbox relay", self.ack_timeout)
            .await
            .map_err(|why| Error::Publish(PublishError::unavailable(why).into()))?;
        tracing::info!(
            endpoint = %servers.endpoint,
            "NATS publisher started; its client connects in the background"
        );
        Ok(self.publisher(servers, client, lost))
    }

    /// The servers, credentials and TLS the settings make, checked without a server.
    fn validated(&self) -> Result<Servers> {
        let servers = secured(&self.url, self.credentials.as_ref(), self.tls.as_ref())
            .map_err(Error::InvalidOption)?;
        if !self.prefix.is_empty() {
            properties::check_subject(&format!("{}x", self.prefix)).map_err(|why| {
                Error::InvalidOption(format!("subject_prefix cannot start a subject: {why}"))
            })?;
        }
        if self.ack_timeout.is_zero() {
            return Err(Error::InvalidOption(
                "ack_timeout must be above zero".into(),
            ));
        }
        Ok(servers)
    }

    fn publisher(
        self,
        servers: Servers,
        client: Client,
        lost: watch::Receiver<u64>,
    ) -> JetStreamPublisher {
        JetStreamPublisher {
            endpoint: servers.endpoint,
            prefix: self.prefix,
            jetstream: context(&client, self.ack_timeout),
            ack_timeout: self.ack_timeout,
            ack_timeout_set: self.ack_timeout_set,
            client,
            lost,
        }
    }
}

/// The servers of `url` with the credentials and TLS the builder set.
pub(crate) fn secured(
    url: &str,
    credentials: Option<&Credentials>,
    tls: Option<&Tls>,
) -> std::result::Result<Servers, String> {
    let mut servers = Servers::parse(url)?;
    if let Some(credentials) = credentials {
        servers = servers.with_credentials(credentials)?;
    }
    if let Some(tls) = tls {
        servers = servers.with_tls(tls)?;
    }
    Ok(servers)
}

crate::broker::pipeline::pipelined_publisher!(JetStreamPublisher);

/// Whether some stream captures subjects under `prefix` (one of its subject filters starts
/// with the prefix, or matches a subject under it); an error when the streams cannot be
/// listed (no JetStream, or no permission to list), which is left to the outage rules.
pub(crate) async fn captured(
    js: &jetstream::Context,
    prefix: &str,
) -> std::result::Result<bool, String> {
    use futures_util::StreamExt;
    let sample = format!("{prefix}x");
    let mut streams = js.streams();
    while let Some(info) = streams.next().await {
        let info = info.map_err(|e| e.to_string())?;
        let covers =
            |filter: &String| filter.starts_with(prefix) || subject_matches(filter, &sample);
        if info.config.subjects.iter().any(covers) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// NATS's subject matching: `*` takes one token, `>` the rest (one token or more).
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject = subject.split('.');
    for token in filter.split('.') {
        match (token, subject.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (token, Some(s)) if token == s => {}
            _ => return false,
        }
    }
    subject.next().is_none()
}

/// The JetStream context: acknowledgements awaited for at most `timeout`, and no limit of
/// the client's on how many (a batch sends all its records before it awaits any, and the
/// relay bounds what is in flight).
fn context(client: &Client, timeout: Duration) -> jetstream::Context {
    jetstream::ContextBuilder::new()
        .timeout(timeout)
        .max_ack_inflight(MAX_ACK_INFLIGHT)
        .build(client.clone())
}

#[cfg(test)]
mod tests {
    use super::subject_matches;

    #[test]
    fn subjects_match_as_nats_matches_them() {
        assert!(subject_matches(">", "outbox.x"));
        assert!(subject_matches("outbox.>", "outbox.x"));
        assert!(subject_matches("outbox.*", "outbox.x"));
        assert!(subject_matches("*.x", "outbox.x"));
        assert!(!subject_matches("outbox.>", "outbox"));
        assert!(!subject_matches("other.>", "outbox.x"));
        assert!(!subject_matches("outbox.*.y", "outbox.x"));
        assert!(!subject_matches("outbox", "outbox.x"));
    }
}
