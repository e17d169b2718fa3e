//! A record as a Kafka message (topic, key, headers), once it is known that Kafka takes it,
//! and what a Kafka error says: a message's failure, or an outage.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};

use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER, PublishError, Record};

/// The header that carries the idempotency key (consumers dedupe on it).
pub const MESSAGE_ID_HEADER: &str = "x-outbox-message-id";
/// The header that carries the content type.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
/// The header that carries the message's topic where the Kafka topic is not made of it
/// ([`Layout::ByAggregateType`]); the consumer source takes the delivery's topic from it.
pub const TOPIC_HEADER: &str = "x-outbox-topic";

/// Which Kafka topic a message goes to. Its key is its aggregate key either way (the
/// idempotency key when it has none), so the messages of one aggregate in one Kafka topic
/// land in one partition, in the order they were published; which messages share a Kafka
/// topic decides which of them a consumer sees in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Layout {
    /// The prefix + the message's topic: `order.created` and `order.paid` go to two Kafka
    /// topics, each in order per aggregate, but not in order with each other. The default.
    #[default]
    ByTopic,
    /// The prefix + the message's *aggregate type*, its topic up to the last `.`
    /// (`order.created` and `order.paid` both go to `order`; a topic without a `.` is its
    /// own type), with the message's topic in the `x-outbox-topic` header: every event of
    /// one aggregate, whatever its type, lands in one partition in the order published.
    /// Debezium's outbox event router lays topics out so (`outbox.event.<aggregate type>`
    /// with the prefix `outbox.event.`), and the consumer source reads the topic back from
    /// the header.
    ByAggregateType,
}

impl Layout {
    /// The Kafka topic of a message whose topic is `topic`, under `prefix`.
    pub(crate) fn kafka_topic(self, prefix: &str, topic: &str) -> String {
        match self {
            Layout::ByTopic => format!("{prefix}{topic}"),
            Layout::ByAggregateType => {
                let aggregate_type = topic.rsplit_once('.').map_or(topic, |(t, _)| t);
                format!("{prefix}{aggregate_type}")
            }
        }
    }
}
/// The longest topic name Kafka takes.
const MAX_TOPIC: usize = 249;

/// One record, ready to produce.
pub(super) struct Outgoing {
    pub(super) topic: String,
    pub(super) key: String,
    pub(super) headers: OwnedHeaders,
}

/// Why Kafka refuses `topic` as a topic name, or `Ok`: not empty, at most 249 bytes, only
/// ASCII letters, digits, `.`, `_` and `-`, and not `.` or `..`.
pub(crate) fn check_topic(topic: &str) -> Result<(), String> {
    if topic.is_empty() {
        return Err("the topic is empty".into());
    }
    if topic.len() > MAX_TOPIC {
        return Err(format!(
            "the topic is {} bytes, Kafka's limit is {MAX_TOPIC}",
            topic.len()
        ));
    }
    if topic == "." || topic == ".." {
        return Err(format!("{topic:?} is not a topic name Kafka takes"));
    }
    if let Some(c) = topic
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic {:?} holds {c:?}: Kafka takes only ASCII letters, digits, `.`, `_` and `-`",
            topic.escape_debug().to_string()
        ));
    }
    Ok(())
}

/// The record as a Kafka message to its topic in `layout` under `prefix`, if Kafka takes
/// it (a topic it refuses is a permanent failure of this record alone). The key is the
/// aggregate key, so one aggregate's messages land in one partition, in order; without
/// one, the idempotency key.
pub(super) fn outgoing(
    record: &Record,
    prefix: &str,
    layout: Layout,
) -> Result<Outgoing, PublishError> {
    let topic = layout.kafka_topic(prefix, &record.topic);
    check_topic(&topic).map_err(PublishError::permanent)?;
    let attempt = record.attempt.to_string();
    let mut library = vec![
        (MESSAGE_ID_HEADER, record.key.as_str()),
        (ATTEMPT_HEADER, attempt.as_str()),
    ];
    if let Some(aggregate) = &record.aggregate_key {
        library.push((AGGREGATE_HEADER, aggregate));
    }
    if let Some(content_type) = &record.content_type {
        library.push((CONTENT_TYPE_HEADER, content_type));
    }
    if layout != Layout::ByTopic {
        library.push((TOPIC_HEADER, &record.topic));
    }
    // Library headers win over user headers of the same name (Kafka would keep both).
    let reserved = [
        MESSAGE_ID_HEADER,
        ATTEMPT_HEADER,
        AGGREGATE_HEADER,
        CONTENT_TYPE_HEADER,
        TOPIC_HEADER,
    ];
    let user = record
        .headers
        .iter()
        .filter(|(name, _)| !reserved.iter().any(|r| r.eq_ignore_ascii_case(name)))
        .map(|(name, value)| (name.as_str(), value.as_str()));
    let headers = user.chain(library).fold(
        OwnedHeaders::new_with_capacity(record.headers.len() + reserved.len()),
        |headers, (key, value)| {
            headers.insert(Header {
                key,
                value: Some(value.as_bytes()),
            })
        },
    );
    Ok(Outgoing {
        topic,
        key: record
            .aggregate_key
            .clone()
            .unwrap_or_else(|| record.key.clone()),
        headers,
    })
}

/// Whether `err` says the producer lost its standing with the cluster (fenced after an
/// outage, its epoch or sequence refused, or failed for good): it never sends again, and a
/// new one must be made.
pub(super) fn producer_spent(err: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        err.rdkafka_error_code(),
        Some(
            C::Fatal
                | C::Fenced
                | C::ProducerFenced
                | C::InvalidProducerEpoch
                | C::OutOfOrderSequenceNumber
                | C::UnknownProducerId
                | C::InvalidProducerIdMapping
        )
    )
}

/// What a Kafka error says of the message it came with. Kafka out of reach (no broker,
/// the transport, a missing topic or partition, no leader, a login or permission refused,
/// the local queue full because nothing drains it, no delivery report within the message
/// timeout, the producer spent) is an outage; a message over a size limit or to a topic name Kafka refuses is
/// permanent; anything else fails this message's attempt.
pub(super) fn classify(err: &KafkaError, endpoint: &str) -> PublishError {
    use RDKafkaErrorCode as C;
    let Some(code) = err.rdkafka_error_code() else {
        return PublishError::transient(format!("Kafka at {endpoint}: {err}"));
    };
    if producer_spent(err) {
        // The producer is made anew; the message is not at fault.
        return PublishError::unavailable(format!(
            "the producer for Kafka at {endpoint} lost its standing: {err}"
        ));
    }
    match code {
        C::MessageSizeTooLarge
        | C::InvalidMessageSize
        | C::MessageBatchTooLarge
        | C::InvalidTopic
        | C::InvalidMessage => PublishError::permanent(format!("Kafka at {endpoint}: {err}")),
        C::AllBrokersDown
        | C::BrokerTransportFailure
        | C::Resolve
        | C::MessageTimedOut
        | C::QueueFull
        | C::UnknownTopic
        | C::UnknownTopicOrPartition
        | C::UnknownPartition
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::BrokerNotAvailable
        | C::NetworkException
        | C::RequestTimedOut
        | C::NotEnoughReplicas
        | C::NotEnoughReplicasAfterAppend
        | C::SSL
        | C::Authentication
        | C::SaslAuthenticationFailed
        | C::TopicAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::DestroyBroker
        | C::BrokerDestroy
        // librdkafka dropped the message from its queues.
        | C::PurgeQueue
        | C::PurgeInflight => {
            PublishError::unavailable(format!("Kafka at {endpoint} took no message: {err}"))
        }
        _ => PublishError::transient(format!("Kafka at {endpoint}: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::message::Headers;

    use super::*;

    #[test]
    fn topics_kafka_refuses_fail_permanently() {
        assert!(check_topic("outbox.order-created_v1").is_ok());
        for bad in ["", ".", "..", "order created", "order/created", "ordér"] {
            assert!(check_topic(bad).is_err(), "{bad:?}");
        }
        assert!(check_topic(&"x".repeat(250)).is_err());
        let record = Record::new("k", "order created", "x");
        let err = outgoing(&record, "outbox.", Layout::ByTopic)
            .err()
            .expect("refused");
        assert!(err.is_permanent(), "{err}");
    }

    #[test]
    fn a_record_becomes_key_topic_and_headers() {
        let mut record = Record::new("k1", "order.created", "x");
        record.attempt = 3;
        record.headers.insert("tenant".into(), "acme".into());
        record
            .headers
            .insert("Content-Type".into(), "text/plain".into());
        record.content_type = Some("application/json".into());
        let message = outgoing(&record, "outbox.", Layout::ByTopic).expect("taken");
        assert_eq!(message.topic, "outbox.order.created");
        assert_eq!(message.key, "k1", "no aggregate: the idempotency key");
        let headers: Vec<(String, String)> = message
            .headers
            .iter()
            .map(|h| {
                let value = String::from_utf8(h.value.unwrap().to_vec()).unwrap();
                (h.key.to_owned(), value)
            })
            .collect();
        assert_eq!(
            headers,
            [
                ("tenant".to_owned(), "acme".to_owned()),
                (MESSAGE_ID_HEADER.into(), "k1".into()),
                (ATTEMPT_HEADER.into(), "3".into()),
                (CONTENT_TYPE_HEADER.into(), "application/json".into()),
            ]
        );
        record.aggregate_key = Some("order-1".into());
        assert_eq!(
            outgoing(&record, "", Layout::ByTopic).unwrap().key,
            "order-1"
        );
    }

    #[test]
    fn by_aggregate_type_every_event_of_an_aggregate_shares_a_topic_and_a_key() {
        let mut created = Record::new("k1", "order.created", "x");
        created.aggregate_key = Some("order-1".into());
        let mut paid = Record::new("k2", "order.paid", "x");
        paid.aggregate_key = Some("order-1".into());
        let layout = Layout::ByAggregateType;
        let (created, paid) = (
            outgoing(&created, "outbox.event.", layout).unwrap(),
            outgoing(&paid, "outbox.event.", layout).unwrap(),
        );
        assert_eq!(
            (created.topic.as_str(), created.key.as_str()),
            ("outbox.event.order", "order-1")
        );
        assert_eq!(
            (paid.topic.as_str(), paid.key.as_str()),
            ("outbox.event.order", "order-1")
        );
        let topic = |m: &Outgoing| {
            m.headers
                .iter()
                .find(|h| h.key == TOPIC_HEADER)
                .map(|h| String::from_utf8(h.value.unwrap().to_vec()).unwrap())
        };
        assert_eq!(topic(&created).as_deref(), Some("order.created"));
        assert_eq!(topic(&paid).as_deref(), Some("order.paid"));
        assert_eq!(
            layout.kafka_topic("", "billing.invoice.paid"),
            "billing.invoice"
        );
        assert_eq!(
            layout.kafka_topic("p.", "audit"),
            "p.audit",
            "no `.`: its own type"
        );
        let by_topic =
            outgoing(&Record::new("k3", "order.paid", "x"), "", Layout::ByTopic).unwrap();
        assert_eq!(topic(&by_topic), None, "by topic, no topic header");
    }

    #[test]
    fn errors_about_kafka_are_outages_and_size_is_permanent() {
        let production = |code| KafkaError::MessageProduction(code);
        for code in [
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::MessageTimedOut,
            RDKafkaErrorCode::UnknownTopicOrPartition,
            RDKafkaErrorCode::QueueFull,
            RDKafkaErrorCode::ProducerFenced,
            RDKafkaErrorCode::Fatal,
        ] {
            assert!(
                classify(&production(code), "k:9092").is_unavailable(),
                "{code:?}"
            );
        }
        let size = classify(&production(RDKafkaErrorCode::MessageSizeTooLarge), "k:9092");
        assert!(size.is_permanent(), "{size}");
        let other = classify(&production(RDKafkaErrorCode::BadCompression), "k:9092");
        assert!(!other.is_permanent() && !other.is_unavailable(), "{other}");
    }
}
