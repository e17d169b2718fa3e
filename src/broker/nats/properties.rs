//! A record as a NATS message (subject, headers, payload), once it is known that NATS and
//! JetStream take it.

use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER, PublishError, Record};

/// The header JetStream dedupes on: the idempotency key.
pub(crate) const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";
/// The content type's header.
pub(crate) const CONTENT_TYPE_HEADER: &str = "Content-Type";
/// The longest subject taken: far below the server's control line limit (4 KiB), which
/// would close the connection.
const MAX_SUBJECT: usize = 1024;

/// One record, ready to send.
pub(super) struct Outgoing {
    pub(super) subject: String,
    pub(super) headers: HeaderMap,
    pub(super) payload: Bytes,
}

/// Why a subject cannot be published to, or `Ok`. Subjects are dot-separated tokens: not
/// empty, no empty token, no whitespace or control character, no wildcard (`*`, `>`), and
/// not under `$`, the server's own APIs (`$JS`, `$SYS`, `$KV`).
pub(crate) fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("the subject is empty".into());
    }
    if subject.len() > MAX_SUBJECT {
        return Err(format!(
            "the subject is {} bytes, the limit is {MAX_SUBJECT}",
            subject.len()
        ));
    }
    if subject.starts_with('$') {
        return Err(format!(
            "subject {subject:?} is refused: subjects starting with `$` are the server's own APIs"
        ));
    }
    if let Some(c) = subject
        .chars()
        .find(|c| c.is_whitespace() || c.is_control() || *c == '*' || *c == '>')
    {
        return Err(format!(
            "subject {:?} holds {c:?}, which NATS does not allow in a published subject",
            subject.escape_debug().to_string()
        ));
    }
    if subject.split('.').any(str::is_empty) {
        return Err(format!(
            "subject {subject:?} has an empty token (a leading, trailing or doubled `.`)"
        ));
    }
    Ok(())
}

/// The record as a NATS message for `prefix` + topic, if NATS takes it: each rule broken is
/// a permanent failure of this record alone, found before anything is written.
pub(super) fn outgoing(
    record: &Record,
    prefix: &str,
    max_payload: usize,
) -> std::result::Result<Outgoing, PublishError> {
    let subject = format!("{prefix}{}", record.topic);
    check_subject(&subject).map_err(PublishError::permanent)?;
    let mut headers = HeaderMap::new();
    for (name, value) in &record.headers {
        if name
            .as_bytes()
            .get(..5)
            .is_some_and(|p| p.eq_ignore_ascii_case(b"nats-"))
        {
            return Err(PublishError::permanent(format!(
                "header {name:?} is refused: JetStream acts on headers starting with `Nats-`"
            )));
        }
        let header = HeaderName::from_str(name).map_err(|_| {
            PublishError::permanent(format!("header name {name:?} is not allowed by NATS"))
        })?;
        headers.insert(header, value_of(&format!("header {name:?}"), value)?);
    }
    // Library headers win over user headers of the same name.
    headers.insert(
        MESSAGE_ID_HEADER,
        value_of("the idempotency key", &record.key)?,
    );
    headers.insert(
        ATTEMPT_HEADER,
        value_of("the attempt", &record.attempt.to_string())?,
    );
    if let Some(aggregate) = &record.aggregate_key {
        headers.insert(AGGREGATE_HEADER, value_of("the aggregate key", aggregate)?);
    }
    if let Some(content_type) = &record.content_type {
        headers.insert(
            CONTENT_TYPE_HEADER,
            value_of("the content type", content_type)?,
        );
    }
    let size = record.payload.len() + header_size(&headers);
    if size > max_payload {
        return Err(PublishError::permanent(format!(
            "the message is {size} bytes with its headers, over the server's max_payload of \
             {max_payload}"
        )));
    }
    Ok(Outgoing {
        subject,
        headers,
        payload: Bytes::copy_from_slice(&record.payload),
    })
}

/// A header value, refused (without quoting it) when it holds a line break.
fn value_of(what: &str, value: &str) -> std::result::Result<HeaderValue, PublishError> {
    HeaderValue::from_str(value).map_err(|_| {
        PublishError::permanent(format!(
            "{what} holds a line break, which a NATS header value cannot"
        ))
    })
}

/// The size of the headers as sent: `NATS/1.0\r\n`, `name: value\r\n` each, `\r\n`.
fn header_size(headers: &HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            values
                .iter()
                .map(|v| AsRef::<str>::as_ref(name).len() + 2 + v.as_str().len() + 2)
                .sum::<usize>()
        })
        .sum();
    10 + lines + 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(topic: &str) -> Record {
        let mut r = Record::new("order-42-created", topic, r#"{"id":42}"#);
        r.aggregate_key = Some("order-42".into());
        r.content_type = Some("application/json".into());
        r.headers.insert("tenant".into(), "acme".into());
        r.attempt = 3;
        r
    }

    #[test]
    fn a_record_becomes_subject_and_headers() {
        let out = outgoing(&record("order.created"), "outbox.", 1 << 20).unwrap();
        assert_eq!(out.subject, "outbox.order.created");
        let get = |name: &str| out.headers.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(get("Nats-Msg-Id").as_deref(), Some("order-42-created"));
        assert_eq!(get(ATTEMPT_HEADER).as_deref(), Some("3"));
        assert_eq!(get(AGGREGATE_HEADER).as_deref(), Some("order-42"));
        assert_eq!(get("Content-Type").as_deref(), Some("application/json"));
        assert_eq!(get("tenant").as_deref(), Some("acme"));
        assert_eq!(&out.payload[..], br#"{"id":42}"#);
    }

    #[test]
    fn subjects_nats_refuses_fail_permanently() {
        for (topic, why) in [
            ("order created", "does not allow"),
            ("order.*", "does not allow"),
            ("order.>", "does not allow"),
            ("order..created", "empty token"),
            ("order.", "empty token"),
            ("$JS.API.STREAM.DELETE.orders", "server's own APIs"),
        ] {
            let err = outgoing(&record(topic), "", 1 << 20).err().expect(topic);
            assert!(err.is_permanent(), "{topic}: {err}");
            assert!(err.to_string().contains(why), "{topic}: {err}");
        }
        assert!(check_subject(&"a".repeat(MAX_SUBJECT + 1)).is_err());
        check_subject("orders.v1.created-ok_1").unwrap();
    }

    #[test]
    fn headers_nats_refuses_fail_permanently_without_quoting_values() {
        let mut rollup = record("t");
        rollup.headers.insert("nats-rollup".into(), "all".into());
        let err = outgoing(&rollup, "", 1 << 20).err().unwrap();
        assert!(
            err.is_permanent() && err.to_string().contains("Nats-"),
            "{err}"
        );

        // A name whose fifth byte is inside a character is checked, not sliced (and NATS
        // takes only ASCII names).
        let mut wide = record("t");
        wide.headers.insert("abcdé".into(), "v".into());
        let err = outgoing(&wide, "", 1 << 20).err().unwrap();
        assert!(
            err.is_permanent() && err.to_string().contains("not allowed"),
            "{err}"
        );
        let mut wide_nats = record("t");
        wide_nats.headers.insert("NATS-é".into(), "v".into());
        assert!(
            outgoing(&wide_nats, "", 1 << 20)
                .err()
                .unwrap()
                .is_permanent()
        );

        let mut colon = record("t");
        colon.headers.insert("a:b".into(), "v".into());
        assert!(outgoing(&colon, "", 1 << 20).err().unwrap().is_permanent());

        let mut broken = record("t");
        broken
            .headers
            .insert("h".into(), "secret\r\nNats-Rollup: all".into());
        let err = outgoing(&broken, "", 1 << 20).err().unwrap();
        assert!(
            err.is_permanent() && err.to_string().contains("line break"),
            "{err}"
        );
        assert!(!err.to_string().contains("secret"), "{err}");

        let mut key = record("t");
        key.key = "k\n".into();
        assert!(outgoing(&key, "", 1 << 20).err().unwrap().is_permanent());
    }

    #[test]
    fn a_message_over_max_payload_fails_permanently() {
        let mut big = record("t");
        big.payload = vec![b'x'; 1000];
        let err = outgoing(&big, "", 1000).err().unwrap();
        assert!(
            err.is_permanent() && err.to_string().contains("max_payload"),
            "{err}"
        );
        outgoing(&big, "", 2000).unwrap();
    }
}
