//! When the relay looks for work next: paced by what its looks found, so that a steady
//! stream costs a look per few messages, not a few looks per message.
//!
//! Every look is a take (a claim, or a page of the log), and each costs about the same
//! whatever it finds: a round trip to the database and the wake-ups around it. So:
//! - a look that filled its batch is followed by another at once (a backlog drains at
//!   full speed);
//! - a look that found some, but less than a batch, is followed by one after
//!   [`STEADY`]: the stream is thinner than a batch per look, and what arrives meanwhile
//!   waits at most that long (within figure (d)'s latency budget) and goes out together;
//! - a look that found nothing waits twice as long before the next, up to [`EMPTY_MAX`],
//!   until [`LINGER`] has passed since the last find: then the relay is idle, and writers
//!   wake it (see `listener`);
//! - a batch that finishes with messages of aggregates is followed by a look at once: it
//!   may have unblocked their successors, and one aggregate's backlog must drain at the
//!   broker's pace, not at one message per look.
//!
//! A plain value, unit-tested without a clock of its own: each call is given `now`.

use std::time::Duration;

use tokio::time::Instant;

/// After a look that found less than a batch, the wait before the next.
pub(super) const STEADY: Duration = Duration::from_millis(4);
/// After a look that found nothing, the first wait before the next; doubled after each
/// such look, up to [`EMPTY_MAX`].
const EMPTY_FIRST: Duration = Duration::from_millis(2);
/// The longest wait between looks while lingering.
pub(super) const EMPTY_MAX: Duration = Duration::from_millis(16);
/// The longest wait between looks once lingering is over but batches are still under way
/// (a slow publish): fresh messages are not held up behind it for longer.
pub(super) const BUSY_MAX: Duration = Duration::from_millis(160);
/// After the last look that found work, the relay keeps looking for this long before it
/// calls itself idle.
pub(super) const LINGER: Duration = Duration::from_millis(50);

/// The relay's schedule of looks.
#[derive(Debug, Clone)]
pub(super) struct Pace {
    /// When the next look is due.
    next: Instant,
    /// The wait after the last look, for the next empty one to double.
    wait: Duration,
    /// Until when the relay keeps looking after its last find.
    linger_until: Instant,
}

impl Pace {
    /// A relay that starts: it looks at once.
    pub(super) fn new(now: Instant) -> Self {
        Pace {
            next: now,
            wait: Duration::ZERO,
            linger_until: now + LINGER,
        }
    }

    /// A look at `now` found `found` messages, of a batch of at most `batch`.
    pub(super) fn found(&mut self, now: Instant, found: usize, batch: usize) {
        if found >= batch {
            self.wait = Duration::ZERO;
            self.linger_until = now + LINGER;
        } else if found > 0 {
            self.wait = STEADY;
            self.linger_until = now + LINGER;
        } else {
            let most = if self.lingering(now) {
                EMPTY_MAX
            } else {
                BUSY_MAX
            };
            self.wait = (self.wait * 2).clamp(EMPTY_FIRST, most);
        }
        self.next = now + self.wait;
    }

    /// A batch finished at `now`: the relay lingers after it as after a find, and looks at
    /// once if the batch held messages of aggregates (it may have unblocked their
    /// successors).
    pub(super) fn finished(&mut self, now: Instant, aggregates: bool) {
        self.linger_until = self.linger_until.max(now + LINGER);
        if aggregates {
            self.next = self.next.min(now);
            self.wait = Duration::ZERO;
        }
    }

    /// Look at once: a writer's notification came.
    pub(super) fn now(&mut self, now: Instant) {
        self.next = self.next.min(now);
    }

    /// When the next look is due.
    pub(super) fn next(&self) -> Instant {
        self.next
    }

    /// Whether a look is due at `now`.
    pub(super) fn due(&self, now: Instant) -> bool {
        self.next <= now
    }

    /// Whether the relay still lingers at `now` (found work a moment ago); past it, the
    /// relay is idle.
    pub(super) fn lingering(&self, now: Instant) -> bool {
        now < self.linger_until
    }

    /// The relay is idle and woken: it looks now, and lingers after it as after a find.
    pub(super) fn woken(&mut self, now: Instant) {
        self.next = now;
        self.wait = Duration::ZERO;
        self.linger_until = now + LINGER;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_full_batch_is_followed_by_a_look_at_once() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        assert!(pace.due(t));
        pace.found(t, 100, 100);
        assert!(pace.due(t));
        assert!(pace.lingering(t + LINGER - MS));
    }

    #[test]
    fn a_partial_batch_is_followed_by_a_look_after_the_steady_wait() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        pace.found(t, 3, 100);
        assert!(!pace.due(t + STEADY - MS));
        assert!(pace.due(t + STEADY));
        // A steady stream keeps the relay lingering from find to find.
        pace.found(t + STEADY, 2, 100);
        assert_eq!(pace.next(), t + 2 * STEADY);
        assert!(pace.lingering(t + STEADY + LINGER - MS));
    }

    #[test]
    fn empty_looks_thin_out_then_the_relay_is_idle() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        pace.found(t, 1, 100);
        let mut now = pace.next();
        let mut waits = Vec::new();
        let mut looks = 0;
        while pace.lingering(now) {
            let before = now;
            pace.found(now, 0, 100);
            now = pace.next();
            waits.push((now - before).as_millis());
            looks += 1;
        }
        assert_eq!(
            waits[..3],
            [8, 16, 16],
            "after a steady wait, twice as long"
        );
        assert!(waits.iter().all(|w| *w <= EMPTY_MAX.as_millis()));
        assert!((3..=6).contains(&looks), "{looks} looks in one linger");
    }

    #[test]
    fn a_wake_up_looks_at_once_and_lingers_again() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        pace.found(t, 0, 100);
        let later = t + LINGER * 10;
        assert!(!pace.lingering(later));
        pace.woken(later);
        assert!(pace.due(later));
        assert!(pace.lingering(later + LINGER - MS));
        pace.found(later, 0, 100);
        assert_eq!(pace.next(), later + EMPTY_FIRST, "the waits start over");
    }

    #[test]
    fn a_finished_batch_of_aggregates_brings_the_next_look_forward_never_back() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        pace.found(t, 1, 100);
        pace.finished(t + MS, false);
        assert_eq!(pace.next(), t + STEADY, "no aggregates: the pace holds");
        pace.finished(t + MS, true);
        assert!(pace.due(t + MS));
        pace.found(t + MS, 100, 100);
        pace.finished(t + 2 * MS, true);
        assert_eq!(pace.next(), t + MS);
    }

    #[test]
    fn a_batch_under_way_long_after_the_last_find_thins_the_looks_further() {
        let t = Instant::now();
        let mut pace = Pace::new(t);
        pace.found(t, 1, 100);
        let mut now = t + LINGER;
        for _ in 0..10 {
            pace.found(now, 0, 100);
            now = pace.next();
        }
        assert_eq!(pace.wait, BUSY_MAX);
        // A batch that finishes keeps the relay lingering, at its current pace.
        pace.finished(now, false);
        assert!(pace.lingering(now + LINGER - MS));
    }
}
