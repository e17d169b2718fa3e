//! The broker being out of reach: a relay-level state, not a message's failure.
//!
//! While it lasts the relay releases what it claimed without spending attempts, claims
//! again only after a capped exponential backoff, one step per try (reset by the first
//! publish that started after the outage began and went through),
//! logs the outage once at warn and then every minute at error, and reports it through
//! `Metrics` and its record in `<table>_relays` (which `stats` reads).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::options::Options;
use crate::metrics::Metrics;
use crate::publisher::PublishError;

/// The longest wait between two tries while the broker is unavailable: a try costs a
/// connection attempt and the claim and release of one batch, and a backlog starts to
/// drain about this long after the broker is back, at the most.
pub(super) const OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// While an outage lasts, it is logged again this often.
const LOG_EVERY: Duration = crate::streak::LOG_EVERY;

#[derive(Debug, Default)]
pub(super) struct Outage {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    since: Option<Instant>,
    /// What the last failed try said.
    why: Option<String>,
    failures: u32,
    retry_at: Option<Instant>,
    logged_at: Option<Instant>,
    /// When the last outage ended: a wave that started before then says nothing new.
    recovered_at: Option<Instant>,
}

impl Outage {
    /// A wave of publishes that started at `started` found the broker unavailable. Batches
    /// failing together while the relay already backs off count once, so the backoff grows
    /// per try, not per batch; a wave that started before the last outage ended is old news.
    pub(super) fn report(
        &self,
        table: &str,
        started: Instant,
        err: &PublishError,
        options: &Options,
        metrics: &dyn Metrics,
    ) {
        let now = Instant::now();
        let mut state = self.state.lock().expect("outage state");
        if state.retry_at.is_some_and(|at| at > now)
            || state.recovered_at.is_some_and(|at| started < at)
        {
            return;
        }
        state.failures = state.failures.saturating_add(1);
        let delay = options.backoff(state.failures).min(OUTAGE_BACKOFF_MAX);
        state.retry_at = Some(now + delay);
        state.why = Some(err.to_string());
        match state.since {
            None => {
                state.since = Some(now);
                state.logged_at = Some(now);
                tracing::warn!(
                    table = %table, error = %err, retry_in = ?delay,
                    "broker unavailable: holding off publishing; no attempts are spent meanwhile"
                );
                metrics.blocked(err);
            }
            Some(since) => {
                if state.logged_at.is_none_or(|at| now - at >= LOG_EVERY) {
                    state.logged_at = Some(now);
                    tracing::error!(
                        table = %table, error = %err, down_for = ?(now - since), retry_in = ?delay,
                        "broker still unavailable"
                    );
                }
            }
        }
    }

    /// A publish that started at `started` went through: the outage, if any, is over
    /// (unless that publish began before the outage did, and says nothing about it).
    pub(super) fn recovered(&self, table: &str, started: Instant, metrics: &dyn Metrics) {
        let mut state = self.state.lock().expect("outage state");
        if let Some(since) = state.since.filter(|since| started >= *since) {
            let outage = since.elapsed();
            *state = State {
                recovered_at: Some(Instant::now()),
                ..State::default()
            };
            drop(state);
            tracing::info!(table = %table, outage = ?outage, "broker reachable again; publishing resumes");
            metrics.unblocked(outage);
        }
    }

    /// While backing off: when to try the broker again.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        let state = self.state.lock().expect("outage state");
        state.retry_at.filter(|at| *at > Instant::now())
    }

    /// When the current outage began, if there is one.
    pub(super) fn since(&self) -> Option<Instant> {
        self.state.lock().expect("outage state").since
    }

    /// The current outage, if any: what the last try said, and since when.
    pub(super) fn down(&self) -> Option<(String, Instant)> {
        let state = self.state.lock().expect("outage state");
        let since = state.since?;
        Some((state.why.clone().unwrap_or_default(), since))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Default)]
    struct Counted {
        blocked: AtomicUsize,
        unblocked: AtomicUsize,
    }

    impl Metrics for Counted {
        fn blocked(&self, _: &PublishError) {
            self.blocked.fetch_add(1, Ordering::SeqCst);
        }
        fn unblocked(&self, _: Duration) {
            self.unblocked.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn batches_failing_together_count_as_one_try_and_old_successes_end_nothing() {
        let (outage, metrics, options) =
            (Outage::default(), Counted::default(), Options::default());
        let err = PublishError::unavailable("connection refused");
        let before = Instant::now();
        tokio::time::advance(Duration::from_millis(1)).await;
        for _ in 0..100 {
            outage.report("t", Instant::now(), &err, &options, &metrics);
        }
        // One try: the first step of the backoff (1 s, with jitter), not the hundredth.
        let first = outage.retry_at().unwrap() - Instant::now();
        assert!(first <= Duration::from_secs(1), "{first:?}");
        assert_eq!(metrics.blocked.load(Ordering::SeqCst), 1);
        // A publish that began before the outage says nothing about it.
        outage.recovered("t", before, &metrics);
        assert!(outage.since().is_some());
        tokio::time::advance(first).await;
        assert_eq!(outage.retry_at(), None, "time to try again");
        outage.report("t", Instant::now(), &err, &options, &metrics);
        let second = outage.retry_at().unwrap() - Instant::now();
        assert!(second >= Duration::from_secs(1) && second <= Duration::from_secs(2));
        outage.recovered("t", Instant::now(), &metrics);
        assert_eq!(outage.since(), None);
        assert_eq!(metrics.unblocked.load(Ordering::SeqCst), 1);
        // A wave that began before the recovery and failed after it starts no new outage.
        outage.report("t", before, &err, &options, &metrics);
        assert_eq!(outage.since(), None);
        assert_eq!(metrics.blocked.load(Ordering::SeqCst), 1);
    }

    /// However long the outage, the relay tries again at least every `OUTAGE_BACKOFF_MAX`,
    /// so the backlog starts to drain soon after the broker is back.
    #[tokio::test(start_paused = true)]
    async fn a_long_outage_is_tried_at_least_every_five_seconds() {
        let (outage, metrics, options) =
            (Outage::default(), Counted::default(), Options::default());
        let err = PublishError::unavailable("connection refused");
        let mut longest = Duration::ZERO;
        for _ in 0..40 {
            outage.report("t", Instant::now(), &err, &options, &metrics);
            let wait = outage.retry_at().unwrap() - Instant::now();
            longest = longest.max(wait);
            tokio::time::advance(wait).await;
        }
        assert!(longest <= Duration::from_secs(5), "{longest:?}");
        assert!(
            longest >= Duration::from_secs(4),
            "the cap is reached: {longest:?}"
        );
    }
}
