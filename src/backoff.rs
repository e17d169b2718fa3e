//! Capped exponential backoff, the one rule behind every wait after a failure: a retried
//! message, the relay holding off during an outage, and the reconnects of the LISTEN
//! connection and of the RabbitMQ publisher.

use std::time::Duration;

/// The bounds every configurable backoff must keep: `0 < min <= max <= 7 days`.
pub(crate) fn check(min: Duration, max: Duration) -> Result<(), String> {
    if min.is_zero() || min > max {
        return Err(format!("backoff({min:?}, {max:?}) needs 0 < min <= max"));
    }
    if max > Duration::from_secs(7 * 24 * 60 * 60) {
        return Err(format!("backoff max {max:?} must be at most 7 days"));
    }
    Ok(())
}

/// The delay after `failures` consecutive failures: `min` after the first, doubling with
/// each one after it, never above `max` (no delay before any failure).
pub(crate) fn capped(min: Duration, max: Duration, failures: u32) -> Duration {
    let Some(doublings) = failures.checked_sub(1) else {
        return Duration::ZERO;
    };
    min.saturating_mul(1u32 << doublings.min(31)).min(max)
}

/// `delay` with equal jitter: half of it fixed, half random, so failing peers spread out.
pub(crate) fn jittered(delay: Duration) -> Duration {
    let half = delay / 2;
    half + half.mul_f64(fastrand::f64())
}

/// Consecutive failures of one thing that is retried (a reconnect), and the delay each
/// earns; reset by a success.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub(crate) const fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            failures: 0,
        }
    }

    /// Counts a failure and returns how long to wait before the next try.
    pub(crate) fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        capped(self.min, self.max, self.failures)
    }

    /// A success: the next failure waits `min` again.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_minimum_up_to_the_cap() {
        let s = Duration::from_secs;
        let delays: Vec<Duration> = (0..6).map(|n| capped(s(1), s(10), n)).collect();
        assert_eq!(delays, [s(0), s(1), s(2), s(4), s(8), s(10)]);
        assert_eq!(capped(s(1), s(10), u32::MAX), s(10), "no overflow");
    }

    #[test]
    fn a_success_starts_over() {
        let ms = Duration::from_millis;
        let mut backoff = Backoff::new(ms(100), ms(300));
        assert_eq!(
            [backoff.failed(), backoff.failed(), backoff.failed()],
            [ms(100), ms(200), ms(300)]
        );
        backoff.reset();
        assert_eq!(backoff.failed(), ms(100));
    }

    #[test]
    fn jitter_keeps_at_least_half() {
        let d = Duration::from_secs(2);
        for _ in 0..100 {
            let j = jittered(d);
            assert!(j >= d / 2 && j <= d, "{j:?}");
        }
    }
}
