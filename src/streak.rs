//! How a run of failures of one kind is logged: once when it begins (warn), again each
//! minute while it lasts (error, saying for how long), once when it ends (info), and at
//! debug in between, so a database or broker that stays away fills no log. The relay's
//! broker outage follows the same rule in `relay/outage.rs`.

use std::time::Duration;

use tokio::time::Instant;

/// While failures go on, they are logged again this often.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

/// How loud the latest of a run of failures should be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loudness {
    /// The first: warn.
    First,
    /// [`LOG_EVERY`] or more since the last line: error, saying for how long.
    Again(Duration),
    /// Otherwise: debug.
    Quiet,
}

/// A run of failures of one kind.
#[derive(Debug, Default)]
pub(crate) struct Streak {
    since: Option<Instant>,
    logged_at: Option<Instant>,
}

impl Streak {
    /// One more failure.
    pub(crate) fn failed(&mut self) -> Loudness {
        let now = Instant::now();
        match self.since {
            None => {
                self.since = Some(now);
                self.logged_at = Some(now);
                Loudness::First
            }
            Some(since) if self.logged_at.is_none_or(|at| now - at >= LOG_EVERY) => {
                self.logged_at = Some(now);
                Loudness::Again(now - since)
            }
            Some(_) => Loudness::Quiet,
        }
    }

    /// A success: how long the failures lasted, if there were any.
    pub(crate) fn ended(&mut self) -> Option<Duration> {
        let since = self.since.take()?;
        self.logged_at = None;
        Some(since.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_streak_is_loud_when_it_begins_each_minute_and_quiet_between() {
        let mut streak = Streak::default();
        assert_eq!(streak.ended(), None);
        assert_eq!(streak.failed(), Loudness::First);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(streak.failed(), Loudness::Quiet);
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(streak.failed(), Loudness::Again(Duration::from_secs(60)));
        assert_eq!(streak.failed(), Loudness::Quiet);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(streak.ended(), Some(Duration::from_secs(65)));
        assert_eq!(streak.ended(), None);
        assert_eq!(streak.failed(), Loudness::First);
    }
}
