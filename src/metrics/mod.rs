//! Hooks for your metrics system. Every method defaults to doing nothing; with the
//! `metrics` feature, [`FacadeMetrics`] implements them through the `metrics` facade.

#[cfg(feature = "metrics")]
mod facade;

use std::time::Duration;

use crate::ops::Stats;
use crate::publisher::PublishError;

#[cfg(feature = "metrics")]
pub use self::facade::FacadeMetrics;

/// Relay and consumer events, for counters and histograms. Implement the ones you need; the
/// others do nothing. Called on the relay's (or consumer's) tasks: keep them cheap and
/// non-blocking.
pub trait Metrics: Send + Sync + 'static {
    /// `n` rows were claimed in one cycle.
    fn claimed(&self, n: usize) {
        let _ = n;
    }

    /// A message was confirmed by the broker; `took` is the publish time.
    fn published(&self, topic: &str, attempt: u32, took: Duration) {
        let _ = (topic, attempt, took);
    }

    /// A message was confirmed `lag` after it was enqueued (by this host's clock against
    /// the database's enqueue time, so clock skew between them shows in it).
    fn delivered(&self, topic: &str, lag: Duration) {
        let _ = (topic, lag);
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

    /// The consumer runner ended one run of a delivery of `topic`.
    fn consumed(&self, topic: &str, result: Consumed) {
        let _ = (topic, result);
    }

    /// How often a running relay should read the table's [`Stats`] and pass them to
    /// [`Metrics::stats`], for gauges; `None` (the default) reads nothing.
    fn stats_interval(&self) -> Option<Duration> {
        None
    }

    /// The table's gauges, read every [`Metrics::stats_interval`] by a running relay.
    fn stats(&self, stats: &Stats) {
        let _ = stats;
    }
}

/// How the consumer runner ended one run of a delivery, for [`Metrics::consumed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Consumed {
    /// Its handler applied it and the transaction committed (it is acknowledged next).
    Applied,
    /// Its key was known already: it is acknowledged without running the handler.
    Duplicate,
    /// The run failed and rolled back; the delivery runs again after a backoff.
    Retried,
    /// To be rejected: by its handler, or after `max_deliveries` runs.
    Rejected,
}

impl Consumed {
    /// `applied`, `duplicate`, `retried` or `rejected`.
    pub fn as_str(self) -> &'static str {
        match self {
            Consumed::Applied => "applied",
            Consumed::Duplicate => "duplicate",
            Consumed::Retried => "retried",
            Consumed::Rejected => "rejected",
        }
    }
}

/// The default: records nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoMetrics;

impl Metrics for NoMetrics {}
