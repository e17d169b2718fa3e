//! A record as a Kafka message (topic, key, headers), once it is known that Kafka takes it,
//! and what a Kafka error says: a message's failure, or an outage.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};

use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER, PublishError, Record};

/// The header that carries the idempotency key (consumers dedupe on it).
pub const MESSAGE_ID_HEADER: &str = "x-outbox-message-id";
/// The header that carries the content type.
pub const CONTENT_TYPE_HEADER: &str = "content-type";
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

/// The record as a Kafka message for `prefix` + topic, if Kafka takes it (a topic it
/// refuses is a permanent failure of this record alone). The key is the aggregate key, so
/// one aggregate's messages land in one partition, in order; without one, the idempotency
/// key.
pub(super) fn outgoing(record: &Record, prefix: &str) -> Result<Outgoing, PublishError> {
    let topic = format!("{prefix}{}", record.topic);
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
    // Library headers win over user headers of the same name (Kafka would keep both).
    let reserved = [
        MESSAGE_ID_HEADER,
        ATTEMPT_HEADER,
        AGGREGATE_HEADER,
        CONTENT_TYPE_HEADER,
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
        let err = outgoing(&record, "outbox.").err().expect("refused");
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
        let message = outgoing(&record, "outbox.").expect("taken");
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
        assert_eq!(outgoing(&record, "").unwrap().key, "order-1");
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
