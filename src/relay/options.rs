//! Relay options, their defaults and validation, and the retry backoff.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::{backoff, defaults};

/// Relay settings; every field is set through [`RelayBuilder`](super::RelayBuilder).
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) batch_size: usize,
    pub(crate) concurrency: usize,
    pub(crate) lease: Duration,
    /// The log cursor's lease, renewed by a heartbeat every fifth of it.
    pub(crate) cursor_lease: Duration,
    /// Whether the user set `cursor_lease` (otherwise it is at most the lease).
    pub(crate) cursor_lease_set: bool,
    pub(crate) poll_interval: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) backoff_min: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) drain_timeout: Duration,
    /// Whether the user set `drain_timeout` (otherwise it follows the lease).
    pub(crate) drain_timeout_set: bool,
    pub(crate) listen: bool,
    pub(crate) retention: Option<Duration>,
    pub(crate) inbox_retention: Option<Duration>,
    pub(crate) max_batch_bytes: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            batch_size: defaults::BATCH_SIZE,
            concurrency: defaults::CONCURRENCY,
            lease: defaults::LEASE,
            cursor_lease: defaults::CURSOR_LEASE,
            cursor_lease_set: false,
            poll_interval: defaults::POLL_INTERVAL,
            max_attempts: defaults::MAX_ATTEMPTS,
            backoff_min: defaults::BACKOFF_MIN,
            backoff_max: defaults::BACKOFF_MAX,
            drain_timeout: defaults::DRAIN_TIMEOUT,
            drain_timeout_set: false,
            listen: true,
            retention: Some(defaults::RETENTION),
            inbox_retention: Some(defaults::INBOX_RETENTION),
            max_batch_bytes: defaults::MAX_BATCH_BYTES,
        }
    }
}

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// A retention as a log field: its duration, or `off`.
struct Kept(Option<Duration>);

impl std::fmt::Display for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(age) => write!(f, "{age:?}"),
            None => f.write_str("off"),
        }
    }
}

impl Options {
    /// Logs the start of relay `relay` on `table` with each option as a field of its own
    /// (`batch_size=100 lease=30s …`, or keys of their own in JSON logs).
    pub(crate) fn log_started(&self, table: &str, relay: &str) {
        tracing::info!(
            table = %table,
            relay = %relay,
            batch_size = self.batch_size,
            concurrency = self.concurrency,
            lease = ?self.lease,
            cursor_lease = ?self.cursor_lease,
            poll_interval = ?self.poll_interval,
            max_attempts = self.max_attempts,
            backoff_min = ?self.backoff_min,
            backoff_max = ?self.backoff_max,
            drain_timeout = ?self.drain_timeout,
            listen = self.listen,
            retention = %Kept(self.retention),
            inbox_retention = %Kept(self.inbox_retention),
            max_batch_bytes = self.max_batch_bytes,
            "relay started"
        );
    }

    /// The longest a publish may take: half the lease.
    pub(crate) fn publish_bound(&self) -> Duration {
        self.lease / 2
    }

    /// How often a heartbeat renews the log cursor's lease: five times per lease, so that
    /// a renewal or two lost on the way does not lose it.
    pub(crate) fn heartbeat(&self) -> Duration {
        self.cursor_lease / 5
    }

    /// Fits what the user did not set to the lease: the drain timeout is at most
    /// [`Options::publish_bound`], the cursor's lease at most the lease.
    pub(crate) fn fit_to_lease(&mut self) {
        if !self.drain_timeout_set {
            self.drain_timeout = defaults::DRAIN_TIMEOUT.min(self.publish_bound());
        }
        if !self.cursor_lease_set {
            self.cursor_lease = defaults::CURSOR_LEASE.min(self.lease);
        }
    }

    /// Checks each option's range, and that the timeouts fit the lease: a publish may take
    /// half the lease, so `publisher_timeout` (the publisher's own bound, if any) and the
    /// drain timeout must not exceed that.
    pub(crate) fn validate(&self, publisher_timeout: Option<Duration>) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidOption(msg));
        if !(1..=10_000).contains(&self.batch_size) {
            return bad(format!("batch_size {} must be 1..=10000", self.batch_size));
        }
        if !(1..=1_024).contains(&self.concurrency) {
            return bad(format!("concurrency {} must be 1..=1024", self.concurrency));
        }
        if self.lease < Duration::from_millis(100) || self.lease > DAY {
            return bad(format!(
                "lease {:?} must be between 100ms and 1 day",
                self.lease
            ));
        }
        if self.cursor_lease < Duration::from_millis(100) || self.cursor_lease > DAY {
            return bad(format!(
                "cursor_lease {:?} must be between 100ms and 1 day",
                self.cursor_lease
            ));
        }
        if self.poll_interval < Duration::from_millis(10) || self.poll_interval > DAY {
            return bad(format!(
                "poll_interval {:?} must be between 10ms and 1 day",
                self.poll_interval
            ));
        }
        if !(1..=1_000).contains(&self.max_attempts) {
            return bad(format!(
                "max_attempts {} must be 1..=1000",
                self.max_attempts
            ));
        }
        backoff::check(self.backoff_min, self.backoff_max).map_err(Error::InvalidOption)?;
        if self.drain_timeout > Duration::from_secs(60 * 60) {
            return bad(format!(
                "drain_timeout {:?} must be at most 1 hour",
                self.drain_timeout
            ));
        }
        let half = self.publish_bound();
        if self.drain_timeout > half {
            return bad(format!(
                "drain_timeout {:?} exceeds half the lease ({:?}), the longest a publish may \
                 take: lower drain_timeout or raise the lease",
                self.drain_timeout, half
            ));
        }
        if let Some(timeout) = publisher_timeout
            && timeout > half
        {
            return bad(format!(
                "the publisher's timeout {timeout:?} (for RabbitMQ its confirm_timeout) exceeds \
                 half the lease ({half:?}), the longest a publish may take: lower it or \
                 raise the lease"
            ));
        }
        if !(1..=1 << 30).contains(&self.max_batch_bytes) {
            return bad(format!(
                "max_batch_bytes {} must be 1..=1073741824",
                self.max_batch_bytes
            ));
        }
        for (name, value) in [
            ("retention", self.retention),
            ("inbox_retention", self.inbox_retention),
        ] {
            if let Some(age) = value
                && (age < Duration::from_secs(1) || age > 3_650 * DAY)
            {
                return bad(format!(
                    "{name} {age:?} must be between 1s and 10 years (or None to disable)"
                ));
            }
        }
        Ok(())
    }

    /// Delay before attempt `attempt + 1`: exponential from `backoff_min`, capped at
    /// `backoff_max`, with equal jitter (half fixed, half random) so failing relays spread.
    pub(crate) fn backoff(&self, attempt: u32) -> Duration {
        backoff::jittered(backoff::capped(
            self.backoff_min,
            self.backoff_max,
            attempt.max(1),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped() {
        let o = Options::default();
        for _ in 0..100 {
            let first = o.backoff(1);
            assert!(first >= Duration::from_millis(500) && first <= Duration::from_secs(1));
            let third = o.backoff(3);
            assert!(third >= Duration::from_secs(2) && third <= Duration::from_secs(4));
            let late = o.backoff(40);
            assert!(late >= Duration::from_secs(150) && late <= Duration::from_secs(300));
        }
    }

    #[test]
    fn defaults_are_valid() {
        Options::default()
            .validate(Some(Duration::from_secs(10)))
            .unwrap();
    }

    #[test]
    fn what_the_user_did_not_set_follows_the_lease_and_what_they_set_is_checked() {
        let mut short = Options {
            lease: Duration::from_secs(1),
            ..Options::default()
        };
        short.fit_to_lease();
        assert_eq!(short.drain_timeout, Duration::from_millis(500));
        assert_eq!(short.cursor_lease, Duration::from_secs(1));
        assert_eq!(short.heartbeat(), Duration::from_millis(200));
        short.validate(Some(Duration::from_millis(500))).unwrap();
        let mut long = Options::default();
        long.fit_to_lease();
        assert_eq!(long.drain_timeout, defaults::DRAIN_TIMEOUT);
        assert_eq!(long.cursor_lease, defaults::CURSOR_LEASE);
        let tiny = Options {
            cursor_lease: Duration::from_millis(50),
            cursor_lease_set: true,
            ..Options::default()
        };
        let err = tiny.validate(None).unwrap_err().to_string();
        assert!(
            err.contains("cursor_lease 50ms must be between 100ms and 1 day"),
            "{err}"
        );
        let mut explicit = Options {
            lease: Duration::from_secs(4),
            drain_timeout: Duration::from_secs(3),
            drain_timeout_set: true,
            ..Options::default()
        };
        explicit.fit_to_lease();
        let err = explicit.validate(None).unwrap_err().to_string();
        assert!(
            err.contains("drain_timeout 3s exceeds half the lease (2s)"),
            "{err}"
        );
    }
}
