//! The consumer runner's NATS JetStream source, public as `consumer::nats::Source` (its
//! docs are there).

use std::fmt;
use std::time::Duration;

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::message::{AckKind, Acker};
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;

use super::{CONTENT_TYPE_HEADER, Credentials, MESSAGE_ID_HEADER, Servers, secured};
use crate::consumer::{Delivery, Incoming, Reconnecting, Settle};
use crate::error::BoxError;
use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER};
use crate::tls::Tls;

/// The longest a connection and its subscription may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A durable JetStream pull consumer as the source of a [`Consumer`](crate::consumer::Consumer).
pub struct Source {
    url: String,
    credentials: Option<Credentials>,
    tls: Option<Tls>,
    /// The servers with the credentials and TLS set (or why not, which the consumer's
    /// `build()` reports).
    servers: Result<Servers, String>,
    stream: String,
    durable: String,
    prefix: String,
    link: Reconnecting<Live>,
}

struct Live {
    // Kept so the connection lives as long as the subscription.
    _client: async_nats::Client,
    messages: pull::Stream,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let endpoint = self
            .servers
            .as_ref()
            .map_or("(malformed URL)", |s| s.endpoint.as_str());
        f.debug_struct("Source")
            .field("endpoint", &endpoint)
            .field("stream", &self.stream)
            .field("durable", &self.durable)
            .field("connected", &self.link.is_live())
            .finish_non_exhaustive()
    }
}

impl Source {
    /// Consumes the durable pull consumer `durable` of `stream` on the NATS server(s) at
    /// `url` (`nats://[user:password@|token@]host:port`, `tls://` for TLS, or several,
    /// comma-separated).
    pub fn durable(
        url: impl AsRef<str>,
        stream: impl Into<String>,
        durable: impl Into<String>,
    ) -> Self {
        Source {
            url: url.as_ref().to_owned(),
            credentials: None,
            tls: None,
            servers: Servers::parse(url.as_ref()),
            stream: stream.into(),
            durable: durable.into(),
            prefix: String::new(),
            link: Reconnecting::default(),
        }
    }

    /// How to log in: a credentials file, an NKey seed, a token, or a user and password.
    /// A file is read, a seed checked, here; a problem is reported by the consumer's
    /// `build()`. Defaults to the URL's user info, if any (give credentials one way only).
    #[must_use]
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self.secure()
    }

    /// Connects over TLS, verifying the server's certificate and name against the
    /// platform's roots and the CA file of `tls`, and showing its client certificate. The
    /// files are read here; a problem is reported by the consumer's `build()`. Defaults to
    /// TLS only when the URL says `tls://` or the server requires it.
    #[must_use]
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = Some(tls);
        self.secure()
    }

    fn secure(mut self) -> Self {
        self.servers = secured(&self.url, self.credentials.as_ref(), self.tls.as_ref());
        self
    }

    /// The relay's subject prefix, taken off the subject to give the delivery's topic
    /// (`outbox.order.created` → `order.created` for `"outbox."`). Defaults to none: the
    /// topic is the subject.
    #[must_use]
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }
}

/// Opens a connection and pulls from the durable consumer in batches of `prefetch`.
async fn connect(
    servers: Result<Servers, String>,
    stream: String,
    durable: String,
    prefetch: u16,
) -> Result<Live, String> {
    let servers = servers?;
    let endpoint = servers.endpoint.clone();
    let (client, _lost) = servers
        .connect("diesel-outbox consumer", CONNECT_TIMEOUT)
        .await?;
    let jetstream = jetstream::new(client.clone());
    let opening = async {
        let consumer: PullConsumer = jetstream
            .get_consumer_from_stream(&durable, &stream)
            .await
            .map_err(|e| e.to_string())?;
        consumer
            .stream()
            .max_messages_per_batch(usize::from(prefetch.max(1)))
            .messages()
            .await
            .map_err(|e| e.to_string())
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, opening).await {
        Ok(Ok(messages)) => {
            tracing::info!(endpoint = %endpoint, stream = %stream, durable = %durable, "consuming from NATS JetStream");
            Ok(Live {
                _client: client,
                messages,
            })
        }
        Ok(Err(e)) => Err(format!(
            "consuming {stream}/{durable} on NATS at {endpoint} failed: {e}"
        )),
        Err(_) => Err(format!(
            "consuming {stream}/{durable} on NATS at {endpoint}: no answer within {CONNECT_TIMEOUT:?}"
        )),
    }
}

impl crate::consumer::Source for Source {
    fn check(&self) -> Result<(), BoxError> {
        self.servers.as_ref().map_err(|e| e.clone())?;
        if self.stream.is_empty() || self.durable.is_empty() {
            return Err("the stream and the durable consumer need names".into());
        }
        Ok(())
    }

    async fn verify(&mut self) -> Result<(), String> {
        use async_nats::jetstream::ErrorCode;
        use async_nats::jetstream::stream::ConsumerErrorKind;
        let Ok(servers) = &self.servers else {
            return Ok(());
        };
        let check = async {
            let (client, _lost) = servers
                .connect("diesel-outbox consumer", CONNECT_TIMEOUT)
                .await
                .ok()?;
            let found = jetstream::new(client)
                .get_consumer_from_stream::<pull::Config, _, _>(&self.durable, &self.stream)
                .await;
            match found {
                Err(e) => match e.kind() {
                    ConsumerErrorKind::JetStream(js)
                        if [ErrorCode::CONSUMER_NOT_FOUND, ErrorCode::STREAM_NOT_FOUND]
                            .contains(&js.error_code()) =>
                    {
                        Some(js.to_string())
                    }
                    _ => None,
                },
                Ok(_) => None,
            }
        };
        match tokio::time::timeout(CONNECT_TIMEOUT, check).await {
            Ok(Some(why)) => Err(format!(
                "durable consumer `{}` of stream `{}` does not exist on NATS at {} ({why}): \
                 declare it (nats::Topology, or diesel-outbox declare --broker nats) or fix \
                 the names",
                self.durable, self.stream, servers.endpoint
            )),
            // Out of reach: the runner's loop waits for the server.
            _ => Ok(()),
        }
    }

    async fn next(&mut self, prefetch: u16) -> Result<Incoming, BoxError> {
        loop {
            let live = self
                .link
                .get(|| {
                    Box::pin(connect(
                        self.servers.clone(),
                        self.stream.clone(),
                        self.durable.clone(),
                        prefetch,
                    ))
                })
                .await?;
            match live.messages.next().await {
                Some(Ok(message)) => {
                    let redelivered = message.info().is_ok_and(|info| info.delivered > 1);
                    let (message, acker) = message.split();
                    match delivery(&message, &self.prefix, redelivered) {
                        Some(delivery) => {
                            return Ok(Incoming {
                                delivery,
                                settle: Box::new(NatsSettle(acker)),
                            });
                        }
                        None => {
                            tracing::error!(
                                stream = %self.stream, subject = %message.subject,
                                "a message without Nats-Msg-Id cannot be deduplicated: terminated"
                            );
                            let _ = acker.ack_with(AckKind::Term).await;
                        }
                    }
                }
                Some(Err(e)) => {
                    self.link.lost();
                    return Err(
                        format!("NATS JetStream {}/{}: {e}", self.stream, self.durable).into(),
                    );
                }
                None => {
                    self.link.lost();
                    return Err(format!(
                        "NATS JetStream ended the subscription to {}/{}",
                        self.stream, self.durable
                    )
                    .into());
                }
            }
        }
    }

    async fn close(&mut self) {
        self.link.take();
    }
}

/// A message as a [`Delivery`]; `None` without `Nats-Msg-Id`.
fn delivery(message: &async_nats::Message, prefix: &str, redelivered: bool) -> Option<Delivery> {
    let headers = message.headers.as_ref()?;
    let key = headers.get(MESSAGE_ID_HEADER)?.as_str().to_owned();
    let subject = message.subject.as_str();
    let topic = subject.strip_prefix(prefix).unwrap_or(subject);
    let mut delivery = Delivery::new(key, topic, message.payload.to_vec());
    delivery.redelivered = redelivered;
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        let Some(value) = values.first().map(|v| v.as_str().to_owned()) else {
            continue;
        };
        if name == MESSAGE_ID_HEADER {
            continue;
        } else if name == ATTEMPT_HEADER {
            delivery.attempt = value.parse().unwrap_or(1);
        } else if name == AGGREGATE_HEADER {
            delivery.aggregate_key = Some(value);
        } else if name == CONTENT_TYPE_HEADER {
            delivery.content_type = Some(value);
        } else {
            delivery.headers.insert(name.to_owned(), value);
        }
    }
    Some(delivery)
}

struct NatsSettle(Acker);

impl Settle for NatsSettle {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { self.0.double_ack().await.map_err(|e| e as BoxError) })
    }

    fn reject(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move {
            self.0
                .double_ack_with(AckKind::Term)
                .await
                .map_err(|e| e as BoxError)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_the_endpoint_and_never_the_url() {
        let source = Source::durable(
            "nats://relay:s3cret@mq.internal:4222",
            "OUTBOX",
            "invoicing",
        );
        let shown = format!("{source:?}");
        assert!(shown.contains("mq.internal:4222"), "{shown}");
        assert!(!shown.contains("s3cret"), "{shown}");
        let bad = Source::durable("nats://relay:s3cret@[bad", "OUTBOX", "invoicing");
        assert!(!format!("{bad:?}").contains("s3cret"));
        assert!(crate::consumer::Source::check(&bad).is_err());
    }

    #[test]
    fn a_message_becomes_a_delivery() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(MESSAGE_ID_HEADER, "k1");
        headers.insert(ATTEMPT_HEADER, "2");
        headers.insert(AGGREGATE_HEADER, "order-1");
        headers.insert(CONTENT_TYPE_HEADER, "application/json");
        headers.insert("tenant", "acme");
        let message = async_nats::Message {
            subject: "outbox.order.created".into(),
            reply: None,
            payload: "{}".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        let d = delivery(&message, "outbox.", true).unwrap();
        assert_eq!((d.key.as_str(), d.topic.as_str()), ("k1", "order.created"));
        assert_eq!(d.attempt, 2);
        assert_eq!(d.aggregate_key.as_deref(), Some("order-1"));
        assert_eq!(d.content_type.as_deref(), Some("application/json"));
        assert_eq!(d.headers.len(), 1);
        assert!(d.redelivered);
        let mut bare = message.clone();
        bare.headers = None;
        assert!(delivery(&bare, "", false).is_none());
    }
}
