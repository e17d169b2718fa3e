//! Declaring on NATS JetStream what a relay publishes to and a consumer consumes from.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};

use super::{Credentials, secured};
use crate::error::{Error, Result};
use crate::tls::Tls;

/// How long declaring may take.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a relay and its consumers need on JetStream, declared in one call: a stream that
/// captures every subject under the relay's subject prefix (`<prefix>>`, on disk), and for
/// each consumer a durable pull consumer of it with explicit acknowledgements.
///
/// Declaring is idempotent: what exists is left as it is, when it fits (a stream that does
/// not capture the prefix is an error that names it, and nothing is changed).
///
/// ```no_run
/// use diesel_outbox::nats::Topology;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// Topology::stream("OUTBOX", "outbox.")
///     .durable("invoicing")
///     .declare("nats://127.0.0.1:4222")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Topology {
    stream: String,
    prefix: String,
    durables: Vec<String>,
    credentials: Option<Credentials>,
    tls: Option<Tls>,
}

impl Topology {
    /// A stream named `stream` capturing `<subject_prefix>>`: the relay's subject prefix,
    /// ending with a dot (`"outbox."`).
    pub fn stream(stream: impl Into<String>, subject_prefix: impl Into<String>) -> Self {
        Topology {
            stream: stream.into(),
            prefix: subject_prefix.into(),
            durables: Vec::new(),
            credentials: None,
            tls: None,
        }
    }

    /// A durable pull consumer `name` of the stream, with explicit acknowledgements (what
    /// the consumer runner's source consumes). Defaults to none.
    pub fn durable(mut self, name: impl Into<String>) -> Self {
        self.durables.push(name.into());
        self
    }

    /// How to log in. Defaults to the URL's user info, if any.
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// TLS settings. Defaults to TLS only for a `tls://` URL or a server that requires it.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Declares everything on the server(s) at `url`.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a malformed URL, a prefix that does not end with a dot,
    /// bad credentials or TLS files, or a stream of that name that does not capture the
    /// prefix; [`Error::Publish`] when no server answers, or JetStream refuses.
    pub async fn declare(&self, url: &str) -> Result<()> {
        if !self.prefix.ends_with('.') || self.prefix.len() < 2 {
            return Err(Error::InvalidOption(format!(
                "the subject prefix `{}` must end with a dot, as `outbox.`",
                self.prefix
            )));
        }
        let servers = secured(url, self.credentials.as_ref(), self.tls.as_ref())
            .map_err(Error::InvalidOption)?;
        let failed =
            |e: String| Error::Publish(format!("NATS at {}: {e}", servers.endpoint).into());
        let (client, _lost) = servers
            .connect("diesel-outbox declare", DECLARE_TIMEOUT)
            .await
            .map_err(|e| Error::Publish(e.into()))?;
        let js = jetstream::new(client);
        let subjects = format!("{}>", self.prefix);
        let declaring = async {
            let stream = js
                .get_or_create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![subjects.clone()],
                    storage: stream::StorageType::File,
                    ..Default::default()
                })
                .await
                .map_err(|e| failed(e.to_string()))?;
            let info = stream.cached_info();
            if !info.config.subjects.contains(&subjects) {
                return Err(Error::InvalidOption(format!(
                    "stream `{}` exists and captures {:?}, not `{subjects}`: use another name, \
                     or change its subjects",
                    self.stream, info.config.subjects
                )));
            }
            for durable in &self.durables {
                stream
                    .get_or_create_consumer(
                        durable,
                        consumer::pull::Config {
                            durable_name: Some(durable.clone()),
                            ack_policy: consumer::AckPolicy::Explicit,
                            ..Default::default()
                        },
                    )
                    .await
                    .map_err(|e| failed(format!("durable consumer `{durable}`: {e}")))?;
            }
            Ok(())
        };
        tokio::time::timeout(DECLARE_TIMEOUT, declaring)
            .await
            .map_err(|_| failed(format!("no answer within {DECLARE_TIMEOUT:?}")))?
    }
}
