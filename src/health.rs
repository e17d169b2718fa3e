//! What a relay or a consumer runner says of itself to a probe: live (its loop turns) and
//! ready (the database answers, the broker can be reached), with the reasons in words.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// A relay's or a consumer runner's state, as liveness and readiness probes want it
/// ([`Relay::health`](crate::Relay::health),
/// [`Consumer::health`](crate::consumer::Consumer::health)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// It runs, and its loop has turned recently: the process is not stuck. A liveness
    /// probe that sees `false` should restart it.
    pub live: bool,
    /// Live, and able to do its work now: its last look at the database succeeded and its
    /// broker is reachable. A readiness probe that sees `false` reports an outage (nothing
    /// is lost meanwhile: the relay holds its messages back, the broker keeps the
    /// consumer's).
    pub ready: bool,
    /// Why it is not live or not ready, in words (never a URL or a password); empty when
    /// it is both.
    pub reasons: Vec<String>,
    /// What a ready relay waits for before it publishes from the log, in words: another
    /// relay's lease on the log's cursor (naming that relay, and when its lease ends
    /// unless it renews it). Such a standby is ready: it publishes what is handed to the
    /// per-row side, and takes the cursor over once the holder's lease ends.
    pub waiting_for: Option<String>,
}

/// What a loop records as it turns, and the last failures of its database and broker.
#[derive(Debug)]
pub(crate) struct Vitals {
    /// How long a loop may go without turning and still be live.
    window: Duration,
    runs: AtomicUsize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last_turn: Option<Instant>,
    database: Option<(String, Instant)>,
    broker: Option<(String, Instant)>,
    /// The relay holding the log's cursor, and when its lease ends.
    cursor_holder: Option<(String, Instant)>,
}

impl Vitals {
    /// A loop that turns at least every `window` while it is healthy.
    pub(crate) fn new(window: Duration) -> Self {
        Vitals {
            window,
            runs: AtomicUsize::new(0),
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A run started; it ends when the returned guard drops.
    pub(crate) fn running(&self) -> Running<'_> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.turned();
        Running(self)
    }

    /// The loop turned.
    pub(crate) fn turned(&self) {
        self.state().last_turn = Some(Instant::now());
    }

    /// The database answered (`None`) or failed, and how.
    pub(crate) fn database(&self, failure: Option<String>) {
        let mut state = self.state();
        state.database = failure.map(|why| {
            let since = state.database.as_ref().map_or_else(Instant::now, |d| d.1);
            (why, since)
        });
    }

    /// The broker was reached (`None`) or could not be, and how.
    pub(crate) fn broker(&self, failure: Option<String>) {
        let mut state = self.state();
        state.broker = failure.map(|why| {
            let since = state.broker.as_ref().map_or_else(Instant::now, |b| b.1);
            (why, since)
        });
    }

    /// Another relay holds the log's cursor (its name, and how long its lease has left), or
    /// none.
    pub(crate) fn cursor_held_by(&self, holder: Option<(String, Duration)>) {
        self.state().cursor_holder = holder.map(|(name, left)| (name, Instant::now() + left));
    }

    /// The health of `what` ("the relay", "the consumer"), `broker_down` adding a broker
    /// outage known elsewhere.
    pub(crate) fn health(&self, what: &str, broker_down: Option<(String, Instant)>) -> Health {
        let state = self.state();
        let mut reasons = Vec::new();
        let running = self.runs.load(Ordering::SeqCst) > 0;
        let live = running
            && state
                .last_turn
                .is_some_and(|at| at.elapsed() <= self.window);
        if !running {
            reasons.push(format!("{what} is not running"));
        } else if !live {
            let quiet = state.last_turn.map_or(Duration::ZERO, |at| at.elapsed());
            reasons.push(format!(
                "{what}'s loop has not turned for {}s",
                quiet.as_secs()
            ));
        }
        if let Some((why, since)) = &state.database {
            reasons.push(format!(
                "database unreachable for {}s: {why}",
                since.elapsed().as_secs()
            ));
        }
        if let Some((why, since)) = broker_down.as_ref().or(state.broker.as_ref()) {
            reasons.push(format!(
                "broker unavailable for {}s: {why}",
                since.elapsed().as_secs()
            ));
        }
        let ready = live && reasons.is_empty();
        let waiting_for = state.cursor_holder.as_ref().map(|(name, ends)| {
            let left = ends.saturating_duration_since(Instant::now());
            format!(
                "the log's cursor, held by relay {name} (its lease ends in {:.1}s unless \
                 that relay renews it)",
                left.as_secs_f64()
            )
        });
        Health {
            live,
            ready,
            reasons,
            waiting_for,
        }
    }
}

/// A run of a loop, counted in [`Vitals`] until dropped.
pub(crate) struct Running<'a>(&'a Vitals);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.runs.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn live_while_running_and_turning_ready_unless_something_failed() {
        let vitals = Vitals::new(Duration::from_secs(10));
        let idle = vitals.health("the relay", None);
        assert!(!idle.live && !idle.ready);
        assert_eq!(idle.reasons, ["the relay is not running"]);

        let run = vitals.running();
        assert_eq!(
            vitals.health("the relay", None),
            Health {
                live: true,
                ready: true,
                reasons: Vec::new(),
                waiting_for: None,
            }
        );
        vitals.cursor_held_by(Some(("host:7:ab".into(), Duration::from_millis(2_500))));
        let standby = vitals.health("the relay", None);
        assert!(standby.ready);
        assert_eq!(
            standby.waiting_for.as_deref(),
            Some(
                "the log's cursor, held by relay host:7:ab (its lease ends in 2.5s unless \
                 that relay renews it)"
            )
        );
        vitals.cursor_held_by(None);
        assert_eq!(vitals.health("the relay", None).waiting_for, None);
        vitals.database(Some("cannot connect to db:5432: connection refused".into()));
        tokio::time::sleep(Duration::from_secs(3)).await;
        vitals.database(Some("still refused".into()));
        let down = vitals.health("the relay", None);
        assert!(down.live && !down.ready);
        assert_eq!(down.reasons, ["database unreachable for 3s: still refused"]);
        vitals.database(None);
        let broker = vitals.health("the relay", Some(("refused".into(), Instant::now())));
        assert_eq!(broker.reasons, ["broker unavailable for 0s: refused"]);

        tokio::time::sleep(Duration::from_secs(11)).await;
        let stuck = vitals.health("the relay", None);
        assert!(!stuck.live && !stuck.ready);
        assert_eq!(stuck.reasons, ["the relay's loop has not turned for 14s"]);
        drop(run);
        assert!(!vitals.health("the relay", None).live);
    }
}
