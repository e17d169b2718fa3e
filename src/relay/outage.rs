//! The broker being out of reach: a relay-level state, not a message's failure.
//!
//! While it lasts the relay releases what it claimed without spending attempts, claims
//! again only after a capped exponential backoff (reset by the first publish that works),
//! logs the outage once at warn and then every minute at error, and reports it through
//! `Metrics` and its record in `<table>_relays` (which `stats` reads).

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::options::Options;
use crate::metrics::Metrics;
use crate::publisher::PublishError;

/// The longest wait between two tries while the broker is unavailable.
pub(super) const OUTAGE_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// While an outage lasts, it is logged again this often.
const LOG_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub(super) struct Outage {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    since: Option<Instant>,
    failures: u32,
    retry_at: Option<Instant>,
    logged_at: Option<Instant>,
}

impl Outage {
    /// A publish found the broker unavailable.
    pub(super) fn report(
        &self,
        table: &str,
        err: &PublishError,
        options: &Options,
        metrics: &dyn Metrics,
    ) {
        let now = Instant::now();
        let mut state = self.state.lock().expect("outage state");
        state.failures = state.failures.saturating_add(1);
        let delay = options.backoff(state.failures).min(OUTAGE_BACKOFF_MAX);
        // Several batches may fail at once: the latest retry time wins.
        state.retry_at = Some(state.retry_at.map_or(now + delay, |at| at.max(now + delay)));
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

    /// A publish went through: the outage, if any, is over.
    pub(super) fn recovered(&self, table: &str, metrics: &dyn Metrics) {
        let mut state = self.state.lock().expect("outage state");
        if let Some(since) = state.since.take() {
            let outage = since.elapsed();
            *state = State::default();
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
}
