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
}
