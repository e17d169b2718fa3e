//! A record as AMQP properties, once it is known that RabbitMQ takes it.

use std::collections::BTreeMap;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER, PublishError, Record};

/// Header names RabbitMQ treats as extra routing keys (sender-selected distribution).
const ROUTING_HEADERS: &[&str] = &["cc", "bcc"];

/// The routing key and AMQP properties of a record, once it is known that RabbitMQ takes
/// them: each rule broken is a permanent failure of this record alone.
pub(super) fn properties(
    record: &Record,
    frame_max: u32,
) -> std::result::Result<(ShortString, BasicProperties), PublishError> {
    // Enqueue validates these limits; rows written by other means may not respect them.
    let short = |what: &str, value: &str| {
        ShortString::try_new(value)
            .map_err(|_| PublishError::permanent(format!("{what} is over 255 bytes")))
    };
    let mut headers: BTreeMap<ShortString, AMQPValue> = BTreeMap::new();
    for (name, value) in &record.headers {
        if ROUTING_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(PublishError::permanent(format!(
                "header {name:?} is refused: RabbitMQ routes on CC and BCC"
            )));
        }
        headers.insert(
            short("a header name", name)?,
            AMQPValue::LongString(LongString::from(value.as_bytes())),
        );
    }
    // Library headers win over user headers of the same name.
    headers.insert(
        ShortString::from(ATTEMPT_HEADER),
        AMQPValue::LongLongInt(i64::from(record.attempt)),
    );
    if let Some(aggregate) = &record.aggregate_key {
        headers.insert(
            ShortString::from(AGGREGATE_HEADER),
            AMQPValue::LongString(LongString::from(aggregate.as_bytes())),
        );
    }
    let message_id = short("the idempotency key", &record.key)?;
    let content_type = record
        .content_type
        .as_deref()
        .map(|ct| short("the content type", ct))
        .transpose()?;
    let frame = header_frame_size(&message_id, content_type.as_ref(), &headers);
    if frame > u64::from(frame_max) {
        return Err(PublishError::permanent(format!(
            "the message's header frame is {frame} bytes, over the connection's frame_max of \
             {frame_max} (its headers are too large for RabbitMQ)"
        )));
    }
    let mut properties = BasicProperties::default()
        .with_message_id(message_id)
        .with_delivery_mode(2)
        .with_timestamp(u64::try_from(record.created_at.timestamp()).unwrap_or(0))
        .with_headers(FieldTable::from(headers));
    if let Some(content_type) = content_type {
        properties = properties.with_content_type(content_type);
    }
    Ok((short("the topic", &record.topic)?, properties))
}

/// The size of the content header frame of a message with these properties (as set by
/// [`properties`]), by AMQP 0-9-1's encoding: frame header (7 bytes) and end (1), class,
/// weight and body size (12), property flags (2), then each property present.
fn header_frame_size(
    message_id: &ShortString,
    content_type: Option<&ShortString>,
    headers: &BTreeMap<ShortString, AMQPValue>,
) -> u64 {
    let short = |s: &ShortString| 1 + s.as_str().len() as u64;
    let table: u64 = headers
        .iter()
        .map(|(name, value)| {
            short(name)
                + 1
                + match value {
                    AMQPValue::LongString(s) => 4 + s.as_bytes().len() as u64,
                    AMQPValue::LongLongInt(_) => 8,
                    // Not produced by `properties`; sized generously.
                    _ => 1 << 20,
                }
        })
        .sum();
    let properties = 2 // flags
        + content_type.map_or(0, short)
        + 4 + table // headers
        + 1 // delivery mode
        + short(message_id)
        + 8; // timestamp
    7 + 12 + properties + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str) -> Record {
        Record::new(key, "t", Vec::new())
    }

    #[test]
    fn the_header_frame_size_matches_the_encoder() {
        let mut r = record("order-42-created");
        r.aggregate_key = Some("order-42".into());
        r.content_type = Some("application/json".into());
        r.headers.insert("tenant".into(), "acme".into());
        r.headers.insert("h".into(), "x".repeat(70_000));
        let (_, properties) = properties(&r, u32::MAX).unwrap();
        let (body, _) = cookie_factory::r#gen(
            lapin::protocol::basic::gen_properties(&properties),
            Vec::new(),
        )
        .unwrap();
        let message_id = properties.message_id().clone().unwrap();
        let headers: BTreeMap<ShortString, AMQPValue> = properties
            .headers()
            .clone()
            .unwrap()
            .inner()
            .clone()
            .into_iter()
            .collect();
        let computed = header_frame_size(&message_id, properties.content_type().as_ref(), &headers);
        assert_eq!(computed, 7 + 12 + body.len() as u64 + 1);
    }

    #[test]
    fn records_rabbitmq_cannot_take_fail_permanently_before_anything_is_written() {
        let mut cc = record("k");
        cc.headers.insert("Cc".into(), "other.queue".into());
        let err = properties(&cc, 131_072).unwrap_err();
        assert!(
            err.is_permanent() && err.to_string().contains("CC and BCC"),
            "{err}"
        );

        let mut big = record("k");
        big.headers.insert("h".into(), "x".repeat(300_000));
        let err = properties(&big, 131_072).unwrap_err();
        assert!(
            err.is_permanent() && err.to_string().contains("frame_max"),
            "{err}"
        );
        properties(&big, 1 << 20).unwrap();

        let long_key = record(&"k".repeat(256));
        assert!(properties(&long_key, 131_072).unwrap_err().is_permanent());
    }
}
