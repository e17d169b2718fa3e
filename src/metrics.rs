//! Hooks for your metrics system. Every method defaults to doing nothing.

use std::time::Duration;

use crate::publisher::PublishError;

/// Relay events, for counters and histograms. Implement the ones you need; the others do
/// nothing. Called on the relay's task: keep them cheap and non-blocking.
pub trait Metrics: Send + Sync + 'static {
    /// `n` rows were claimed in one cycle.
    fn claimed(&self, n: usize) {
        let _ = n;
    }

    /// A message was confirmed by the broker; `took` is the publish time.
    fn published(&self, topic: &str, attempt: u32, took: Duration) {
        let _ = (topic, attempt, took);
    }

    /// A publish failed (it will be retried, or dead-lettered if `err` is permanent or the
    /// attempts are used up).
    fn failed(&self, topic: &str, attempt: u32, err: &PublishError) {
        let _ = (topic, attempt, err);
    }

    /// A message became a dead letter after `attempts` attempts.
    fn dead_lettered(&self, topic: &str, attempts: u32) {
        let _ = (topic, attempts);
    }

    /// `n` claimed rows were given back unpublished, their attempts untouched: at shutdown,
    /// cut off by the drain timeout, behind a failed message of their aggregate's run, or
    /// because the broker was unavailable.
    fn released(&self, n: usize) {
        let _ = n;
    }

    /// The broker became unavailable ([`PublishError::unavailable`]): the relay holds off
    /// publishing, spending no attempts, until it answers again.
    fn blocked(&self, err: &PublishError) {
        let _ = err;
    }

    /// The broker answered again after being unavailable for `outage`.
    fn unblocked(&self, outage: Duration) {
        let _ = outage;
    }

    /// `n` outcomes were discarded because another relay had taken the rows over after this
    /// relay's lease ran out: fencing at work.
    fn fenced(&self, n: usize) {
        let _ = n;
    }
}

/// The default: records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMetrics;

impl Metrics for NoMetrics {}
