//! The heartbeat of a run on the log engine: it keeps the log cursor's lease while the
//! relay works or idles (or takes it once it is free), and tells the relay's health
//! whom a standby waits for.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::listener::Wake;
use super::options::Options;
use super::store::{Beat, Store};
use crate::health::Vitals;
use crate::shutdown::or_stop;
use crate::streak::{Loudness, Streak};

/// Beats every [`Options::heartbeat`] until `stop` (every poll interval while the table has
/// no cursor, which a move to the log engine may give it). The beats of a run that ended
/// take nothing (see `Log::keep`).
pub(super) async fn run(
    table: String,
    store: Arc<dyn Store>,
    options: Options,
    vitals: Arc<Vitals>,
    wake: Arc<Wake>,
    stop: watch::Receiver<bool>,
) {
    let every = options.heartbeat();
    let mut failing = false;
    let mut slow = Streak::default();
    loop {
        // A beat is not cut short by the stop: the give-back at the run's end waits for it
        // (a take cut short could still reach the database after the give-back).
        let asked = tokio::time::Instant::now();
        let beat = store.heartbeat(&options).await;
        let took = asked.elapsed();
        if took <= options.cursor_lease / 2 {
            if let Some(slow_for) = slow.ended() {
                tracing::info!(table = %table, slow_for = ?slow_for, "the log cursor's heartbeat is quick again");
            }
        } else {
            // Said once, then once a minute while it lasts.
            match slow.failed() {
                Loudness::First => tracing::warn!(
                    table = %table, took = ?took, cursor_lease = ?options.cursor_lease,
                    "the log cursor's heartbeat took over half the cursor lease (no connection \
                     free in the pool, or a slow database): a relay whose renewals take a \
                     lease loses the cursor, and stops publishing from it"
                ),
                Loudness::Again(slow_for) => tracing::error!(
                    table = %table, took = ?took, slow_for = ?slow_for,
                    "the log cursor's heartbeat is still slow"
                ),
                Loudness::Quiet => {}
            }
        }
        let pause = match beat {
            Ok(beat) => {
                if failing {
                    failing = false;
                    tracing::info!(table = %table, "the log cursor's heartbeat works again");
                }
                vitals.cursor_held_by(match &beat {
                    Beat::Waiting(holder) => Some((holder.name.clone(), holder.lease_left)),
                    Beat::Off | Beat::Held | Beat::Took => None,
                });
                match beat {
                    Beat::Took => {
                        wake.notify.notify_one();
                        every
                    }
                    Beat::Off => options.poll_interval.max(every),
                    Beat::Held | Beat::Waiting(_) => every,
                }
            }
            Err(e) => {
                // Whom a standby waited for is no longer known.
                vitals.cursor_held_by(None);
                // The loop's own statements report the database's trouble; this says only
                // what it means for the cursor.
                if !failing {
                    failing = true;
                    tracing::warn!(
                        table = %table, error = %e,
                        "the log cursor's heartbeat failed: if this lasts a cursor lease, \
                         another relay may take the cursor over"
                    );
                }
                every
            }
        };
        if or_stop(
            &stop,
            tokio::time::sleep(pause.max(Duration::from_millis(10))),
        )
        .await
        .is_none()
        {
            return;
        }
    }
}
