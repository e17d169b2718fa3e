//! One batch published at once: every record sent, then every acknowledgement awaited, and
//! each outcome told apart as a message's failure or an outage.

use std::future::Future;

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{
    PublishAckFuture, PublishError as NatsPublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use tokio::sync::watch;
use tokio::time::Instant;

use super::connection::connected;
use super::properties::outgoing;
use super::{JetStreamPublisher, context};
use crate::broker::pipeline::{Ended, Pipelined, Results, Unsent};
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
fn server_error_code(err: &NatsPublishError) -> Option<ErrorCode> {
    std::error::Error::source(err)?
        .downcast_ref::<async_nats::jetstream::Error>()
        .map(|e| e.error_code())
}

/// One batch on its way: the connection-lost signal as it stood when the batch began, and
/// the results so far.
pub(crate) struct Batch {
    lost: watch::Receiver<u64>,
    results: Vec<Option<std::result::Result<(), PublishError>>>,
}

/// Every record sent, then every acknowledgement awaited; the whole batch within the ack
/// timeout. A connection lost meanwhile ends the wait at once: what was not acknowledged is
/// released as an outage (JetStream drops what it stored already when it comes again, by
/// its message id).
impl Pipelined for JetStreamPublisher {
    type Batch = Batch;
    type Ack = PublishAckFuture;
    type Acked = std::result::Result<PublishAck, NatsPublishError>;

    fn timeout(&self) -> std::time::Duration {
        self.ack_timeout
    }

    fn fit_timeout(&mut self, max: std::time::Duration) {
        if !self.ack_timeout_set && self.ack_timeout > max {
            self.ack_timeout = max;
            self.jetstream = context(&self.client, max);
        }
    }

    async fn open(&self, n: usize, _deadline: Instant) -> Result<Batch, String> {
        let mut lost = self.lost.clone();
        lost.mark_unchanged();
        if !connected(&self.client) {
            return Err(format!(
                "NATS at {} is not connected (reconnecting)",
                self.endpoint
            ));
        }
        Ok(Batch {
            lost,
            results: (0..n).map(|_| None).collect(),
        })
    }

    async fn send(&self, _batch: &Batch, record: &Record) -> Result<PublishAckFuture, Unsent> {
        let message =
            outgoing(record, &self.prefix, self.client.max_payload()).map_err(Unsent::alone)?;
        let publish = PublishMessage::build()
            .payload(message.payload)
            .headers(message.headers);
        self.jetstream
            .send_publish(message.subject, publish)
            .await
            .map_err(|e| {
                let error = self.failed(&e, record);
                let rest = error
                    .is_unavailable()
                    .then(|| "not sent: an earlier message of the batch could not be sent".into());
                Unsent { error, rest }
            })
    }

    fn send_timed_out(&self, _batch: &Batch) -> Unsent {
        Unsent {
            error: PublishError::unavailable(format!(
                "NATS at {} took no message within {:?}",
                self.endpoint, self.ack_timeout
            )),
            rest: Some("not sent: an earlier message of the batch could not be sent".into()),
        }
    }

    fn connection_lost(&self, batch: &Batch) -> impl Future<Output = ()> + Send + 'static {
        let mut lost = batch.lost.clone();
        async move {
            if lost.changed().await.is_err() {
                // The client is gone without a word: the deadline ends the wait.
                std::future::pending::<()>().await;
            }
        }
    }

    fn fail(&self, batch: &mut Batch, i: usize, err: PublishError) {
        batch.results[i] = Some(Err(err));
    }

    fn settle(&self, batch: &mut Batch, i: usize, record: &Record, acked: Self::Acked) {
        // A duplicate was stored before: it counts as sent.
        batch.results[i] = Some(acked.map(|_| ()).map_err(|e| self.failed(&e, record)));
    }

    fn finish(&self, batch: Batch, _records: &[Record], ended: Ended) -> Results {
        let lost_now = batch.lost.has_changed().unwrap_or(true);
        if !ended.complete && !lost_now {
            tracing::warn!(endpoint = %self.endpoint, timeout = ?self.ack_timeout, "NATS ack timeout");
        }
        batch
            .results
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
}

impl JetStreamPublisher {
    /// What a failed publish says: an outage (no stream, no responders, the connection
    /// gone, a stream that takes nothing now), a message the stream can never take, or a
    /// per-message error.
    fn failed(&self, err: &NatsPublishError, record: &Record) -> PublishError {
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
