//! The contract between the consumer runner and a broker: a [`Source`] hands out
//! deliveries, each with a [`Settle`] that acknowledges or rejects it.

use std::future::Future;

use futures_util::future::BoxFuture;

use super::Delivery;
use crate::error::BoxError;

/// Where a consumer's deliveries come from: a subscription to one queue (or stream) of a
/// broker, which reconnects by itself.
pub trait Source: Send + 'static {
    /// The next delivery, connecting (again) first if needed, with at most `prefetch`
    /// deliveries unacknowledged at once. An error (the broker out of reach) is logged by
    /// the runner, which calls again after a backoff. Must be cancel safe: the runner may
    /// drop the future, and a delivery it had not returned yet must not be lost.
    fn next(&mut self, prefetch: u16) -> impl Future<Output = Result<Incoming, BoxError>> + Send;

    /// Whether the source's settings can work (a well-formed URL, say), checked by
    /// `build()`. Defaults to yes.
    fn check(&self) -> Result<(), BoxError> {
        Ok(())
    }

    /// Whether what the source consumes exists on the broker (the queue, the durable
    /// consumer), looked at once when the runner starts: `Err`, naming it, when it does
    /// not; the runner then fails at once ([`Error::NotDeclared`](crate::Error::NotDeclared)),
    /// as no retry would mend it. A broker out of reach is no error here: the runner
    /// retries it. Defaults to `Ok`.
    fn verify(&mut self) -> impl Future<Output = Result<(), String>> + Send {
        std::future::ready(Ok(()))
    }

    /// The broker's consumer group this source consumes as, where the broker has such
    /// groups (Kafka's `group.id`): the runner's `process` spans carry it as
    /// `messaging.consumer.group.name`. Defaults to `None`, and a source without a group
    /// gives its spans no such attribute.
    fn consumer_group(&self) -> Option<&str> {
        None
    }

    /// Stops the subscription: deliveries not settled by now go back to the broker, to be
    /// delivered again. Called once the runner has drained.
    fn close(&mut self) -> impl Future<Output = ()> + Send;
}

/// A delivery, and how to settle it with the broker.
pub struct Incoming {
    /// The message.
    pub delivery: Delivery,
    /// Acknowledges or rejects it.
    pub settle: Box<dyn Settle>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("delivery", &self.delivery)
            .finish_non_exhaustive()
    }
}

/// Settles one delivery with the broker.
pub trait Settle: Send + Sync {
    /// The delivery is done with: the broker forgets it.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>>;
    /// The delivery can never be applied: the broker drops it without requeueing it (to the
    /// queue's dead-letter exchange, if it has one).
    fn reject(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>>;
    /// As [`reject`](Self::reject), saying why (the handler's error, or that it ran
    /// `max_deliveries` times), for a source that keeps the reason with its dead letter
    /// (Kafka's dead-letter topic). Defaults to `reject`.
    fn reject_for(self: Box<Self>, reason: String) -> BoxFuture<'static, Result<(), BoxError>> {
        let _ = reason;
        self.reject()
    }
}

/// A source's connection: the live one, or the connect under way, which is kept across
/// calls of `next` that the runner drops while they wait (so a connect is not restarted
/// each time).
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) struct Reconnecting<L> {
    live: Option<L>,
    connecting: Option<BoxFuture<'static, Result<L, String>>>,
}

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
impl<L> Default for Reconnecting<L> {
    fn default() -> Self {
        Reconnecting {
            live: None,
            connecting: None,
        }
    }
}

#[cfg(any(feature = "rabbitmq", feature = "nats"))]
impl<L> Reconnecting<L> {
    /// The live connection, opened with `connect` first if there is none (or the connect
    /// under way resumed).
    pub(crate) async fn get(
        &mut self,
        connect: impl FnOnce() -> BoxFuture<'static, Result<L, String>>,
    ) -> Result<&mut L, String> {
        if self.live.is_none() {
            let opened = self.connecting.get_or_insert_with(connect).await;
            self.connecting = None;
            self.live = Some(opened?);
        }
        Ok(self.live.as_mut().expect("connected above"))
    }

    /// The connection is gone: the next `get` opens a new one.
    pub(crate) fn lost(&mut self) {
        self.live = None;
    }

    /// Ends the link, giving back the live connection to close.
    pub(crate) fn take(&mut self) -> Option<L> {
        self.connecting = None;
        self.live.take()
    }

    pub(crate) fn is_live(&self) -> bool {
        self.live.is_some()
    }
}
