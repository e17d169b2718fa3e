//! The consumer source's dead-letter topic: where a message goes that the handler rejected
//! (or that has no idempotency key), produced and confirmed before its offset is committed.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use super::{Observed, Properties, Security};

/// The header of a dead letter that names the topic it was consumed from.
pub const DLT_TOPIC_HEADER: &str = "x-outbox-dlt-topic";
/// The header of a dead letter that gives the partition it was consumed from.
pub const DLT_PARTITION_HEADER: &str = "x-outbox-dlt-partition";
/// The header of a dead letter that gives the offset it was consumed at.
pub const DLT_OFFSET_HEADER: &str = "x-outbox-dlt-offset";
/// The header of a dead letter that says why it is one.
pub const DLT_REASON_HEADER: &str = "x-outbox-dlt-reason";

/// What a dead letter's produce waits for at most: within the runner's settle timeout.
const PRODUCE_TIMEOUT: Duration = Duration::from_secs(8);

/// Where the source's dead letters go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum DeadLetterTopic {
    /// `<topic>.dlt`, for the topic each was consumed from.
    #[default]
    PerTopic,
    /// This one topic, for every topic.
    Named(String),
    /// Nowhere: a rejected message is skipped, and only logged.
    Off,
}

impl DeadLetterTopic {
    /// The dead-letter topic of a message consumed from `topic`.
    pub(crate) fn of(&self, topic: &str) -> Option<String> {
        match self {
            DeadLetterTopic::PerTopic => Some(format!("{topic}.dlt")),
            DeadLetterTopic::Named(name) => Some(name.clone()),
            DeadLetterTopic::Off => None,
        }
    }
}

/// The idempotent producer of the dead letters, on the source's brokers, TLS, login and
/// properties.
pub(crate) type DeadLetterProducer = Arc<FutureProducer<Observed>>;

/// Makes the producer of the dead letters.
pub(crate) fn producer(
    endpoint: &str,
    security: &Security,
    properties: &Properties,
) -> Result<DeadLetterProducer, String> {
    let mut config = ClientConfig::new();
    properties.apply(&mut config);
    config
        .set("bootstrap.servers", endpoint)
        .set("client.id", "diesel-outbox consumer dead letters")
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "message.timeout.ms",
            (PRODUCE_TIMEOUT - Duration::from_secs(1))
                .as_millis()
                .to_string(),
        );
    security.apply(&mut config)?;
    config
        .create_with_context(Observed::default())
        .map(Arc::new)
        .map_err(|e| {
            format!(
                "the Kafka producer of dead letters: {}",
                super::passthrough::refused(&e, &config)
            )
        })
}

/// A consumed message as its dead letter would be: kept until it is settled.
pub(crate) struct Letter {
    producer: DeadLetterProducer,
    /// Where it goes, named only when it is sent (most messages never are).
    to: Arc<DeadLetterTopic>,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Vec<(String, Option<Vec<u8>>)>,
    from: (String, i32, i64),
}

impl Letter {
    /// `message` as a dead letter, to go where `to` says.
    pub(crate) fn of(
        producer: DeadLetterProducer,
        to: Arc<DeadLetterTopic>,
        message: &BorrowedMessage<'_>,
    ) -> Letter {
        let headers = message.headers().map_or_else(Vec::new, |all| {
            all.iter()
                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                .collect()
        });
        Letter {
            producer,
            to,
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().unwrap_or_default().to_vec(),
            headers,
            from: (
                message.topic().to_owned(),
                message.partition(),
                message.offset(),
            ),
        }
    }

    /// Produces the dead letter with the message's key, value and headers, and where it
    /// was consumed and why (`reason`), and waits for the broker's report.
    pub(crate) async fn send(&self, reason: &str) -> Result<(), String> {
        let (topic, partition, offset) = (&self.from.0, self.from.1, self.from.2);
        // A source that sends no dead letters makes no letters: this is not reached, and
        // if it were, the message would stay uncommitted rather than be skipped unsaid.
        let Some(to) = self.to.of(topic) else {
            return Err(format!(
                "the dead letter of {topic} partition {partition} offset {offset} has no \
                 dead-letter topic: the source sends none"
            ));
        };
        let (partition_text, offset_text) = (partition.to_string(), offset.to_string());
        let ours = [
            (DLT_TOPIC_HEADER, topic.as_bytes()),
            (DLT_PARTITION_HEADER, partition_text.as_bytes()),
            (DLT_OFFSET_HEADER, offset_text.as_bytes()),
            (DLT_REASON_HEADER, reason.as_bytes()),
        ];
        let mut headers = OwnedHeaders::new_with_capacity(self.headers.len() + ours.len());
        for (key, value) in &self.headers {
            headers = headers.insert(Header {
                key,
                value: value.as_deref(),
            });
        }
        for (key, value) in ours {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record = FutureRecord::to(&to)
            .payload(&self.payload)
            .headers(headers);
        if let Some(key) = &self.key {
            record = record.key(key);
        }
        self.producer
            .send(record, PRODUCE_TIMEOUT)
            .await
            .map(|_| ())
            .map_err(|(e, _)| {
                format!(
                    "producing the dead letter of {topic} partition {partition} offset {offset} \
                     to {to}: {e}"
                )
            })
    }
}
