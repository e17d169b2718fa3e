//! NATS fixtures: a JetStream stream of the test's own, capturing a subject prefix of its
//! own, deleted when it drops.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;

pub use super::nats_url;

pub async fn connect() -> async_nats::Client {
    match async_nats::connect(nats_url()).await {
        Ok(client) => client,
        Err(e) => panic!(
            "NATS is not reachable ({e}). Start it with `start-stop-daemon --start --oknodo \
             --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd \
             /var/lib/nats-server -l /var/log/nats-server.log` or point NATS_URL at one."
        ),
    }
}

/// A stream named `name`, capturing `prefix` + `>`, with file storage (it survives a
/// server restart).
pub struct TestStream {
    pub name: String,
    /// Ends with a dot: the publishers' subject prefix.
    pub prefix: String,
    pub client: async_nats::Client,
    pub jetstream: jetstream::Context,
}

impl TestStream {
    pub async fn new() -> TestStream {
        Self::with(|config| config).await
    }

    /// A stream whose configuration `tune` adjusts (limits, say).
    pub async fn with(tune: impl FnOnce(stream::Config) -> stream::Config) -> TestStream {
        let id = super::unique("s");
        Self::create(format!("{id}."), tune).await
    }

    /// A stream capturing `prefix` (which ends with a dot) + `>`.
    pub async fn for_prefix(prefix: &str) -> TestStream {
        Self::create(prefix.to_owned(), |config| config).await
    }

    async fn create(
        prefix: String,
        tune: impl FnOnce(stream::Config) -> stream::Config,
    ) -> TestStream {
        let client = connect().await;
        let jetstream = jetstream::new(client.clone());
        let name = prefix.trim_end_matches('.').to_uppercase();
        let config = tune(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}>")],
            storage: stream::StorageType::File,
            ..Default::default()
        });
        jetstream
            .create_stream(config)
            .await
            .expect("create stream");
        TestStream {
            name,
            prefix,
            client,
            jetstream,
        }
    }

    /// How many messages the stream holds.
    pub async fn stored(&self) -> u64 {
        let mut stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// A durable pull consumer with explicit acks, `ack_wait` as given.
    pub async fn durable(&self, name: &str, ack_wait: Duration) {
        let stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        stream
            .create_consumer(jetstream::consumer::pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .expect("create consumer");
    }

    /// Every message stored, in stream order: `(subject, headers, payload)`.
    pub async fn messages(&self) -> Vec<async_nats::Message> {
        let stream = self.jetstream.get_stream(&self.name).await.expect("stream");
        let total = self.stored().await as usize;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
            .await
            .expect("ordered consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut out = Vec::with_capacity(total);
        while out.len() < total {
            let next = tokio::time::timeout(super::DEADLINE, messages.next())
                .await
                .expect("stored messages arrive")
                .expect("stream open")
                .expect("message");
            out.push(next.message);
        }
        out
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let name = self.name.clone();
        super::block_on_aside(async move {
            if let Ok(client) = async_nats::connect(nats_url()).await {
                let _ = jetstream::new(client).delete_stream(&name).await;
            }
        });
    }
}

/// The first value of header `name`.
pub fn header<'a>(message: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    message.headers.as_ref()?.get(name).map(|v| v.as_str())
}
