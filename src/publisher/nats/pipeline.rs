//! One batch published at once: every record sent, then every acknowledgement awaited, and
//! each outcome told apart as a message's failure or an outage.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::time::Instant;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;

use super::JetStreamPublisher;
use super::connection::connected;
use super::properties::outgoing;
use crate::publisher::{PublishError, Record};

/// Errors after which the stream takes no message at all, whichever it is.
const STREAM_TAKES_NOTHING: &[ErrorCode] = &[
    ErrorCode::STREAM_STORE_FAILED,
    ErrorCode::STORAGE_RESOURCES_EXCEEDED,
    ErrorCode::MEMORY_RESOURCES_EXCEEDED,
    ErrorCode::INSUFFICIENT_RESOURCES,
    ErrorCode::ACCOUNT_RESOURCES_EXCEEDED,
    ErrorCode::JETSTREAM_NOT_ENABLED,
    ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
];

/// Errors about a message the stream can never take (its size limits).
const NEVER_TAKES_THIS: &[ErrorCode] = &[
    ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM,
    ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM,
];

/// The JetStream error code the server answered with, if it answered with one.
fn server_error_code(err: &async_nats::jetstream::context::PublishError) -> Option<ErrorCode> {
    std::error::Error::source(err)?
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(|e| e.error_code())
}

impl JetStreamPublisher {
    /// Sends every record, then awaits every acknowledgement; the whole batch within the
    /// ack timeout. A connection lost meanwhile ends the wait at once: what was not
    /// acknowledged is released as an outage (JetStream drops what it stored already
    /// when it comes again, by its message id).
    pub(super) async fn publish_pipelined(
        &self,
        records: &[Record],
    ) -> Vec<std::result::Result<(), PublishError>> {
        let deadline = Instant::now() + self.ack_timeout;
        let mut lost = self.lost.clone();
        lost.mark_unchanged();
        if !connected(&self.client) {
            return records
                .iter()
                .map(|_| {
                    Err(PublishError::unavailable(format!(
                        "NATS at {} is not connected (reconnecting)",
                        self.endpoint
                    )))
                })
                .collect();
        }
        let max_payload = self.client.max_payload();
        let mut results: Vec<Option<std::result::Result<(), PublishError>>> =
            records.iter().map(|_| None).collect();
        let mut pending = FuturesUnordered::new();
        let mut unsent = false;
        for (i, record) in records.iter().enumerate() {
            if unsent {
                results[i] = Some(Err(PublishError::unavailable(
                    "not sent: an earlier message of the batch could not be sent",
                )));
                continue;
            }
            let message = match outgoing(record, &self.prefix, max_payload) {
                Ok(message) => message,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            let publish = PublishMessage::build()
                .payload(message.payload)
                .headers(message.headers);
            let subject = message.subject;
            match tokio::time::timeout_at(deadline, self.jetstream.send_publish(subject, publish))
                .await
            {
                Ok(Ok(ack)) => pending.push(async move { (i, ack.await) }),
                Ok(Err(e)) => {
                    let err = self.failed(&e, record);
                    unsent |= err.is_unavailable();
                    results[i] = Some(Err(err));
                }
                Err(_) => {
                    unsent = true;
                    results[i] = Some(Err(PublishError::unavailable(format!(
                        "NATS at {} took no message within {:?}",
                        self.endpoint, self.ack_timeout
                    ))));
                }
            }
        }
        let timer = tokio::time::sleep_until(deadline);
        tokio::pin!(timer);
        let mut connection_lost = false;
        while !pending.is_empty() {
            tokio::select! {
                biased;
                Some((i, acked)) = pending.next() => {
                    results[i] = Some(match acked {
                        // A duplicate was stored before: it counts as sent.
                        Ok(_) => Ok(()),
                        Err(e) => Err(self.failed(&e, &records[i])),
                    });
                }
                changed = lost.changed(), if !connection_lost => {
                    connection_lost = true;
                    if changed.is_ok() {
                        break;
                    }
                }
                () = &mut timer => break,
            }
        }
        let lost_now = connection_lost || lost.has_changed().unwrap_or(true);
        if !pending.is_empty() && !lost_now {
            tracing::warn!(endpoint = %self.endpoint, timeout = ?self.ack_timeout, "NATS ack timeout");
        }
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(if lost_now || !connected(&self.client) {
                        PublishError::unavailable(format!(
                            "lost the connection to NATS at {} before the acknowledgement",
                            self.endpoint
                        ))
                    } else {
                        PublishError::transient(format!(
                            "no acknowledgement within the ack timeout ({:?})",
                            self.ack_timeout
                        ))
                    })
                })
            })
            .collect()
    }

    /// What a failed publish says: an outage (no stream, no responders, the connection
    /// gone, a stream that takes nothing now), a message the stream can never take, or a
    /// per-message error.
    fn failed(
        &self,
        err: &async_nats::jetstream::context::PublishError,
        record: &Record,
    ) -> PublishError {
        let subject = format!("{}{}", self.prefix, record.topic);
        match err.kind() {
            PublishErrorKind::StreamNotFound => PublishError::unavailable(format!(
                "no JetStream stream takes subject {subject:?} on NATS at {}",
                self.endpoint
            )),
            PublishErrorKind::BrokenPipe => PublishError::unavailable(format!(
                "lost the connection to NATS at {}",
                self.endpoint
            )),
            PublishErrorKind::TimedOut if !connected(&self.client) => PublishError::unavailable(
                format!("NATS at {} is not connected (reconnecting)", self.endpoint),
            ),
            PublishErrorKind::MaxPayloadExceeded => {
                PublishError::permanent(format!("subject {subject:?}: {err}"))
            }
            PublishErrorKind::Other => match server_error_code(err) {
                // The stream takes nothing now (full with discard-new, out of storage,
                // JetStream off): not about this message.
                Some(code) if STREAM_TAKES_NOTHING.contains(&code) => {
                    PublishError::unavailable(format!(
                        "the stream for subject {subject:?} on NATS at {} takes no message: \
                         {err}",
                        self.endpoint
                    ))
                }
                // Over the stream's own size limits: it can never take this one.
                Some(code) if NEVER_TAKES_THIS.contains(&code) => {
                    PublishError::permanent(format!("subject {subject:?}: {err}"))
                }
                // A closed client (its sender gone) is nobody's message's fault either.
                _ if !connected(&self.client) => PublishError::unavailable(format!(
                    "NATS at {} is not connected: {err}",
                    self.endpoint
                )),
                _ => PublishError::transient(format!("subject {subject:?}: {err}")),
            },
            _ => PublishError::transient(format!("subject {subject:?}: {err}")),
        }
    }
}
