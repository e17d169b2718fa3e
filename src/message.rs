//! The message builder and its validation.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};

/// Header names reserved by the crate (compared case-insensitively, by prefix).
pub(crate) const RESERVED_HEADER_PREFIX: &str = "x-outbox-";
/// Header names RabbitMQ interprets as sender-selected distribution (extra routing).
const DANGEROUS_HEADERS: &[&str] = &["cc", "bcc"];
/// At most this many user headers per message.
pub(crate) const MAX_HEADERS: usize = 64;
/// AMQP short strings (message id, routing key, header names, content type) end here.
pub(crate) const MAX_SHORT: usize = 255;
/// The longest delay accepted: anything longer is almost certainly a unit mistake.
pub(crate) const MAX_DELAY: Duration = Duration::from_secs(366 * 24 * 60 * 60);

/// A message to enqueue.
///
/// ```
/// use diesel_outbox::Message;
/// use std::time::Duration;
///
/// let msg = Message::json("order.created", &serde_json::json!({ "id": 42 }))?
///     .key("order-42-created")
///     .aggregate_key("order-42")
///     .header("tenant", "acme")
///     .delay(Duration::from_secs(5));
/// assert_eq!(msg.topic_str(), "order.created");
/// # Ok::<(), diesel_outbox::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[must_use]
pub struct Message {
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) key: Option<String>,
    pub(crate) aggregate_key: Option<String>,
    pub(crate) content_type: Option<String>,
    pub(crate) headers: BTreeMap<String, String>,
    pub(crate) delay: Duration,
}

impl std::fmt::Debug for Message {
    // The payload is never printed: it may hold personal data.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("topic", &self.topic)
            .field("key", &self.key)
            .field("aggregate_key", &self.aggregate_key)
            .field("content_type", &self.content_type)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("payload_len", &self.payload.len())
            .field("delay", &self.delay)
            .finish()
    }
}

impl Message {
    /// A message with raw bytes for `topic` (the routing key at the broker).
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            key: None,
            aggregate_key: None,
            content_type: None,
            headers: BTreeMap::new(),
            delay: Duration::ZERO,
        }
    }

    /// A message whose payload is `value` serialised as JSON, with content type
    /// `application/json`.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] when `value` cannot be serialised.
    pub fn json<T: Serialize + ?Sized>(topic: impl Into<String>, value: &T) -> Result<Self> {
        let payload = serde_json::to_vec(value).map_err(|e| {
            Error::invalid_message(format!("payload is not serialisable as JSON: {e}"))
        })?;
        Ok(Message::new(topic, payload).content_type("application/json"))
    }

    /// Sets the idempotency key, carried by every delivery of the message (AMQP message id).
    /// At most 255 bytes. Defaults to a random lowercase UUID v4.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Sets the aggregate key: messages that share one are published one at a time, in
    /// enqueue order. Defaults to none (no ordering).
    pub fn aggregate_key(mut self, key: impl Into<String>) -> Self {
        self.aggregate_key = Some(key.into());
        self
    }

    /// Sets the content type. Defaults to none (`application/json` for [`Message::json`]).
    pub fn content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Adds a header (replacing one of the same name). At enqueue, names starting with
    /// `x-outbox-` and the names `CC` and `BCC` are rejected, as are more than 64 headers or
    /// more than `max_headers_bytes` (64 KiB by default) of names and values in all.
    /// Defaults to no headers.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Delays the first publish by `delay` after the enqueuing transaction's clock
    /// (PostgreSQL's `now()`). At most 366 days. Defaults to zero.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The topic.
    pub fn topic_str(&self) -> &str {
        &self.topic
    }

    /// The idempotency key, if one was set.
    pub fn key_str(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// Checks every limit; nothing is written when this fails.
    pub(crate) fn validate(&self, limits: &Limits) -> Result<()> {
        let max_payload_bytes = limits.max_payload_bytes;
        let short = |what: &str, value: &str| -> Result<()> {
            if value.is_empty() {
                return Err(Error::invalid_message(format!("{what} is empty")));
            }
            if value.len() > MAX_SHORT {
                return Err(Error::invalid_message(format!(
                    "{what} is {} bytes, the limit is {MAX_SHORT}",
                    value.len()
                )));
            }
            no_nul(what, value)
        };
        short("topic", &self.topic)?;
        if let Some(key) = &self.key {
            short("idempotency key", key)?;
        }
        if let Some(agg) = &self.aggregate_key {
            short("aggregate key", agg)?;
        }
        if let Some(ct) = &self.content_type {
            short("content type", ct)?;
        }
        if self.payload.len() > max_payload_bytes {
            return Err(Error::invalid_message(format!(
                "payload of topic {:?} is {} bytes, the limit (max_payload_bytes) is {max_payload_bytes}",
                self.topic,
                self.payload.len()
            )));
        }
        if self.delay > MAX_DELAY {
            return Err(Error::invalid_message(format!(
                "delay of {:?} is absurd; the limit is 366 days",
                self.delay
            )));
        }
        if self.headers.len() > MAX_HEADERS {
            return Err(Error::invalid_message(format!(
                "{} headers, the limit is {MAX_HEADERS}",
                self.headers.len()
            )));
        }
        let header_bytes: usize = self.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        if header_bytes > limits.max_headers_bytes {
            return Err(Error::invalid_message(format!(
                "headers of topic {:?} are {header_bytes} bytes (names and values), the limit \
                 (max_headers_bytes) is {}",
                self.topic, limits.max_headers_bytes
            )));
        }
        for (name, value) in &self.headers {
            short("header name", name)?;
            let lower = name.to_ascii_lowercase();
            if lower.starts_with(RESERVED_HEADER_PREFIX) {
                return Err(Error::invalid_message(format!(
                    "header {name:?} is reserved: names starting with `x-outbox-` are set by the relay"
                )));
            }
            if crate::trace::TRACE_HEADERS.contains(&lower.as_str()) {
                return Err(Error::invalid_message(format!(
                    "header {name:?} is reserved: the trace context is captured at enqueue \
                     (feature `opentelemetry`)"
                )));
            }
            if DANGEROUS_HEADERS.contains(&lower.as_str()) {
                return Err(Error::invalid_message(format!(
                    "header {name:?} is refused: RabbitMQ routes on CC and BCC"
                )));
            }
            no_nul("header value", value)?;
        }
        Ok(())
    }

    /// The delay in whole microseconds, as bound into SQL.
    pub(crate) fn delay_micros(&self) -> i64 {
        crate::sql::micros(self.delay)
    }
}

/// The limits enqueue checks, from the [`Outbox`](crate::Outbox) configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_payload_bytes: usize,
    pub(crate) max_headers_bytes: usize,
}

fn no_nul(what: &str, value: &str) -> Result<()> {
    if value.contains('\0') {
        return Err(Error::invalid_message(format!(
            "{what} contains a NUL byte"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Limits = Limits {
        max_payload_bytes: 16 * 1024 * 1024,
        max_headers_bytes: crate::defaults::MAX_HEADERS_BYTES,
    };

    fn rejected(msg: Message) -> String {
        msg.validate(&MAX).unwrap_err().to_string()
    }

    #[test]
    fn json_sets_content_type() {
        let m = Message::json("t", &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(m.content_type.as_deref(), Some("application/json"));
        assert_eq!(m.payload, br#"{"a":1}"#);
        m.validate(&MAX).unwrap();
    }

    #[test]
    fn rejects_each_bad_input() {
        assert!(rejected(Message::new("", "x")).contains("topic is empty"));
        assert!(rejected(Message::new("t", "x").key("")).contains("key is empty"));
        assert!(rejected(Message::new("t", "x").key("k".repeat(256))).contains("limit is 255"));
        assert!(rejected(Message::new("t", "x").aggregate_key("")).contains("aggregate key"));
        assert!(rejected(Message::new("t\0", "x")).contains("NUL"));
        let big = Message::new("t", vec![0u8; 11]);
        assert!(
            big.validate(&Limits {
                max_payload_bytes: 10,
                ..MAX
            })
            .unwrap_err()
            .to_string()
            .contains("max_payload_bytes")
        );
        assert!(rejected(Message::new("t", "x").delay(MAX_DELAY * 2)).contains("absurd"));
        let mut many = Message::new("t", "x");
        for i in 0..=MAX_HEADERS {
            many = many.header(format!("h{i}"), "v");
        }
        assert!(rejected(many).contains("65 headers"));
        assert!(rejected(Message::new("t", "x").header("h".repeat(256), "v")).contains("255"));
        assert!(
            rejected(Message::new("t", "x").header("X-Outbox-Attempt", "1")).contains("reserved")
        );
        assert!(rejected(Message::new("t", "x").header("CC", "a")).contains("CC and BCC"));
        assert!(rejected(Message::new("t", "x").header("bcc", "a")).contains("CC and BCC"));
        let huge = rejected(Message::new("t", "x").header("h", "x".repeat(300_000)));
        assert!(huge.contains("max_headers_bytes"), "{huge}");
        let mut many_small = Message::new("t", "x");
        for i in 0..40 {
            many_small = many_small.header(format!("h{i}"), "v".repeat(2_000));
        }
        assert!(rejected(many_small).contains("max_headers_bytes"));
        Message::new("t", "x")
            .header("h", "x".repeat(60_000))
            .validate(&MAX)
            .unwrap();
    }

    #[test]
    fn debug_hides_the_payload() {
        let m = Message::new("t", "secret-payload").header("h", "secret-value");
        let shown = format!("{m:?}");
        assert!(!shown.contains("secret"), "{shown}");
    }
}
