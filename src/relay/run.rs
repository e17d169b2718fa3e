//! The relay loop of one run ([`Relay::run_until`]): a [`Loop`] whose moves have names.
//!
//! Each turn, in this order: start the waiting batch if a publishing slot is free
//! ([`Loop::start_waiting`]); claim the next batch when there is room and a look is due
//! ([`Loop::claim`]; when looks are due is the [`Pace`]'s to say); then wait, in the
//! first state that applies:
//! - batches under way or the broker out of reach: [`Loop::wait_busy`], looking for new
//!   work at the pace, so that a slow batch does not hold up fresh messages;
//! - work found a moment ago: [`Loop::linger`], looking at the pace, so that under steady
//!   traffic writers need not notify;
//! - no LISTEN connection: [`Loop::poll`];
//! - idle: [`Loop::sleep_idle`], holding the wake lock (see `listener`).
//!
//! Up to [`PIPELINE`] claimed batches publish at once, each on a task of its own that then
//! records the outcomes, and one more waits claimed, ready to go the moment a slot frees: a
//! broker that confirms in bursts is fed again at once instead of waiting for a claim. A
//! batch that waits only on a slow publish gives its slot back (up to [`MAX_STALLED`] such
//! batches). While the broker is unavailable the relay claims only after its outage
//! backoff. On shutdown ([`Loop::shut_down`]) the waiting batch is released untried and
//! the batches in flight drain.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::limits::{MAX_STALLED, PIPELINE, RECORD_GRACE};
use super::listener::{self, WATCH_RETRY, Wake, Watch};
use super::pace::Pace;
use super::presence::{IDLE_REFRESH, RunName};
use super::publish::Slot;
use super::store::Batch;
use super::{Relay, gauges, heartbeat, janitor};
use crate::error::{Error, Result};
use crate::publisher::Publisher;
use crate::shutdown::{AbortOnDrop, or_stop, until_stopped};
use crate::streak::{Loudness, Streak};

/// One run of a relay ([`Relay::run_until`]): what it shares with its listener and its
/// batches.
pub(super) struct Run {
    /// Names this run in `<table>_relays`.
    pub(super) id: String,
    /// True once shutdown was asked for.
    pub(super) stop: watch::Receiver<bool>,
    pub(super) wake: Arc<Wake>,
    /// Batches that gave their publishing slot back while a slow publish finishes.
    pub(super) stalled: Arc<AtomicUsize>,
}

impl Run {
    /// How this run is named in `<table>_relays`.
    fn name(&self) -> RunName<'_> {
        RunName {
            id: &self.id,
            stop: &self.stop,
        }
    }
}

/// What a move leads to.
enum Turn {
    /// Go round again.
    Next,
    /// Shutdown was asked for.
    Stop,
    /// The relay cannot go on.
    Fail(Error),
}

/// The relay loop's state between turns.
struct Loop<'a, P> {
    relay: &'a Relay<P>,
    run: &'a Run,
    stopper: &'a watch::Sender<bool>,
    /// `run.stop`, to wait on.
    stopped: watch::Receiver<bool>,
    /// Batches publishing or recording; each says, once over, whether it held messages of
    /// aggregates.
    in_flight: JoinSet<bool>,
    slots: Arc<Semaphore>,
    /// A claimed batch waiting for a publishing slot.
    waiting: Option<Batch>,
    /// When to look for work.
    pace: Pace,
    /// Claims that failed in a row.
    failures: u32,
    /// Those failures, for the logs.
    claim_streak: Streak,
    /// What this run last wrote of its outage into `<table>_relays`, and when.
    blocked_written: (Option<Instant>, Instant),
    /// Whether `<table>_relays` says this run is idle, and since when.
    marked_idle: bool,
    idle_written: Instant,
    /// Whether the look that follows taking the wake lock was made.
    watched_look: bool,
    /// When the relay last looked for the commits of writers holding the wake lock.
    contended_look: Instant,
}

impl<P: Publisher> Relay<P> {
    /// [`Relay::run_until`]: starts the listener and the janitor, runs the loop until
    /// `shutdown`, and stops them.
    pub(super) async fn run_until_shutdown(
        &self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<()> {
        let inner = &self.inner;
        let table = inner.outbox.table().to_owned();
        let (stopper, stop) = watch::channel(false);
        let run = Run {
            id: uuid::Uuid::new_v4().to_string(),
            stop: stop.clone(),
            wake: Arc::new(Wake::new(inner.listening.clone())),
            stalled: Arc::new(AtomicUsize::new(0)),
        };
        inner.options.log_started(&table, &run.id);
        let _running = inner.vitals.running();
        inner.store.join();
        let pool = inner.store.pool();
        let listener = pool.filter(|_| inner.options.listen).map(|pool| {
            AbortOnDrop::new(tokio::spawn(listener::run(
                pool.clone(),
                inner.outbox.statements().listener.clone(),
                table.clone(),
                run.wake.clone(),
                inner.vitals.clone(),
            )))
        });
        let retains = inner.options.retention.is_some() || inner.options.inbox_retention.is_some();
        let _janitor = pool.filter(|_| retains).map(|pool| {
            AbortOnDrop::new(tokio::spawn(janitor::run(
                inner.outbox.clone(),
                pool.clone(),
                inner.options.retention,
                inner.options.inbox_retention,
            )))
        });

        let _gauges = inner.metrics.stats_interval().map(|interval| {
            AbortOnDrop::new(tokio::spawn(gauges::run(
                inner.outbox.table().to_owned(),
                inner.store.clone(),
                inner.metrics.clone(),
                interval.max(Duration::from_millis(100)),
            )))
        });

        let heartbeat = inner.store.beats().then(|| {
            AbortOnDrop::new(tokio::spawn(heartbeat::run(
                table.clone(),
                inner.store.clone(),
                inner.options.clone(),
                inner.vitals.clone(),
                run.wake.clone(),
                stop.clone(),
            )))
        });

        let running = Loop::new(self, &run, &stopper).run();
        let mut running = pin!(running);
        let mut shutdown = pin!(shutdown.fuse());
        let result = loop {
            tokio::select! {
                result = &mut running => break result,
                () = &mut shutdown => {
                    let _ = stopper.send(true);
                }
            }
        };
        if let Some(listener) = listener {
            listener.stop().await;
        }
        run.wake.set_listening(false);
        drop(heartbeat);
        inner.vitals.cursor_held_by(None);
        tracing::info!(table = %table, relay = %run.id, "relay stopped");
        result
    }

    /// Claims up to `batch_size` due rows, never rows this relay's own batches still hold,
    /// and holds the new batch's rows until its outcomes are recorded.
    ///
    /// A claim under way when `stop` turns true is still awaited, for at most the drain
    /// timeout: the database may have made it already, and its rows must be released, not
    /// left leased. Only a claim the database does not answer within the drain timeout is
    /// given up; what it may have claimed then waits for its lease.
    pub(super) async fn claim(&self, stop: Option<&watch::Receiver<bool>>) -> Result<Batch> {
        let inner = &self.inner;
        let started = Instant::now();
        let claiming = inner
            .store
            .take(&inner.options, inner.held.aged(inner.options.lease));
        let mut batch = match stop {
            None => claiming.await?,
            Some(stop) => {
                let mut stop = stop.clone();
                let mut claiming = pin!(claiming);
                tokio::select! {
                    batch = &mut claiming => batch?,
                    () = until_stopped(&mut stop) => {
                        match tokio::time::timeout(inner.options.drain_timeout, claiming).await {
                            Ok(batch) => batch?,
                            Err(_) => {
                                tracing::warn!(
                                    table = %inner.outbox.table(),
                                    "shutdown: the database did not answer a claim within the drain timeout; \
                                     whatever it claimed waits for its lease"
                                );
                                Batch::default()
                            }
                        }
                    }
                }
            }
        };
        let mut trouble = inner.take_trouble.lock().unwrap_or_else(|e| e.into_inner());
        match batch.trouble.take() {
            None => {
                inner.vitals.database(None);
                if let Some(failed_for) = trouble.ended() {
                    tracing::info!(table = %inner.outbox.table(), failed_for = ?failed_for, "reading the log works again");
                }
            }
            Some(e) => {
                inner.vitals.database(Some(e.to_string()));
                let table = inner.outbox.table();
                match trouble.failed() {
                    Loudness::First => tracing::warn!(
                        table = %table, error = %e,
                        "reading the log failed; what the per-row side claimed goes out (logged again each minute while it fails)"
                    ),
                    Loudness::Again(failing_for) => tracing::error!(
                        table = %table, error = %e, failing_for = ?failing_for, "reading the log still fails"
                    ),
                    Loudness::Quiet => {}
                }
            }
        }
        drop(trouble);
        let claimed = batch.claimed();
        if claimed > 0 {
            batch.hold = Some(inner.held.hold(batch.claimed_at, batch.unrecorded()));
            inner.metrics.claimed(claimed);
            tracing::debug!(table = %inner.outbox.table(), claimed, took = ?started.elapsed(), "claimed");
        }
        Ok(batch)
    }

    /// One cheap look for due work; true on an error too, to let the claim report it.
    async fn due(&self) -> bool {
        self.inner.store.due().await.unwrap_or(true)
    }

    /// [`Relay::due`], giving up (false) once `stop` turns true.
    async fn probe(&self, stop: &watch::Receiver<bool>) -> bool {
        or_stop(stop, self.due()).await.unwrap_or(false)
    }

    /// Reports a batch task that panicked (a bug of the relay: publisher panics are caught
    /// per record). Its rows stay leased: they are claimed again after the lease, and die
    /// if that keeps happening.
    /// Returns whether the batch held messages of aggregates (a panicked one counts as
    /// such: look again).
    fn finished(&self, done: std::result::Result<bool, tokio::task::JoinError>) -> bool {
        match done {
            Ok(aggregates) => aggregates,
            Err(e) => {
                tracing::error!(table = %self.inner.outbox.table(), error = %e, "publishing a batch panicked");
                true
            }
        }
    }
}

impl<'a, P: Publisher> Loop<'a, P> {
    fn new(relay: &'a Relay<P>, run: &'a Run, stopper: &'a watch::Sender<bool>) -> Self {
        let now = Instant::now();
        Loop {
            relay,
            run,
            stopper,
            stopped: run.stop.clone(),
            in_flight: JoinSet::new(),
            slots: Arc::new(Semaphore::new(PIPELINE)),
            waiting: None,
            pace: Pace::new(now),
            failures: 0,
            claim_streak: Streak::default(),
            blocked_written: (None, now),
            marked_idle: false,
            idle_written: now,
            watched_look: false,
            contended_look: now - WATCH_RETRY,
        }
    }

    /// Turns until shutdown (or a failure the relay cannot go past), then shuts down.
    async fn run(mut self) -> Result<()> {
        let result = loop {
            self.relay.inner.vitals.turned();
            if *self.run.stop.borrow() {
                break Ok(());
            }
            self.relay
                .sync_blocked(&self.run.name(), &mut self.blocked_written)
                .await;
            let backing_off = self.relay.inner.outage.retry_at();
            self.start_waiting(backing_off);
            let room = self.room();
            if self.pace.due(Instant::now())
                && self.waiting.is_none()
                && room
                && backing_off.is_none()
            {
                match self.claim().await {
                    Some(Turn::Next) => continue,
                    Some(Turn::Stop) => break Ok(()),
                    Some(Turn::Fail(e)) => break Err(e),
                    None => {}
                }
            }
            let turn =
                if self.waiting.is_some() || !self.in_flight.is_empty() || backing_off.is_some() {
                    self.wait_busy(backing_off, room).await
                } else if self.pace.lingering(Instant::now()) {
                    self.linger().await
                } else {
                    // Idle: whatever ends the wait but shutdown leads to a look.
                    let turn = if self.run.wake.listening() {
                        self.sleep_idle().await
                    } else {
                        self.poll().await
                    };
                    self.pace.woken(Instant::now());
                    turn
                };
            match turn {
                Turn::Next => {}
                Turn::Stop => break Ok(()),
                Turn::Fail(e) => break Err(e),
            }
        };
        self.shut_down(result).await
    }

    /// Whether another batch may be claimed: fewer than two pipelines of batches are
    /// publishing or recording (the recording ones no longer hold a slot), and fewer than
    /// [`MAX_STALLED`] are stalled.
    fn room(&self) -> bool {
        let stalled = self.run.stalled.load(Ordering::SeqCst);
        self.in_flight.len().saturating_sub(stalled) < 2 * PIPELINE && stalled < MAX_STALLED
    }

    /// Starts the waiting batch if a publishing slot is free. While the broker is
    /// unavailable the waiting batch waits too: it is the next try.
    fn start_waiting(&mut self, backing_off: Option<Instant>) {
        if self.waiting.is_some()
            && backing_off.is_none()
            && let Ok(slot) = self.slots.clone().try_acquire_owned()
        {
            let batch = self.waiting.take().expect("checked above");
            self.start(batch, Some(slot));
        }
    }

    /// Publishes a claimed batch and records its outcomes on a task of its own. The
    /// publishing slot is given back as soon as the publishes are over (or stall).
    fn start(&mut self, batch: Batch, permit: Option<OwnedSemaphorePermit>) {
        let relay = self.relay.clone();
        let stop = self.run.stop.clone();
        let slot = Slot::new(permit, Some(self.slots.clone()), self.run.stalled.clone());
        let aggregates = batch.ready.iter().any(|c| c.record.aggregate_key.is_some());
        self.in_flight.spawn(async move {
            relay.run_batch(batch, stop, slot).await;
            aggregates
        });
    }

    /// Claims the next batch, to wait for a slot; `None` when nothing was due.
    async fn claim(&mut self) -> Option<Turn> {
        let options = &self.relay.inner.options;
        match self.relay.claim(Some(&self.run.stop)).await {
            Ok(batch) if batch.claimed() > 0 => {
                self.claims_work_again();
                self.pace
                    .found(Instant::now(), batch.claimed(), options.batch_size);
                // Busy: writers need not notify; let the wake lock go.
                self.run.wake.want_idle(false);
                if self.marked_idle {
                    self.marked_idle = !self.relay.mark_idle(&self.run.name(), false).await;
                }
                self.waiting = Some(batch);
                Some(Turn::Next)
            }
            Ok(_) => {
                self.claims_work_again();
                self.pace.found(Instant::now(), 0, options.batch_size);
                None
            }
            Err(e @ Error::NotMigrated { .. }) => Some(Turn::Fail(e)),
            Err(e) => {
                self.relay.inner.vitals.database(Some(e.to_string()));
                self.failures += 1;
                let delay = options.backoff(self.failures).min(options.poll_interval);
                let table = self.relay.inner.outbox.table();
                match self.claim_streak.failed() {
                    Loudness::First => tracing::warn!(
                        table = %table, error = %e, retry_in = ?delay,
                        "claiming failed; retrying (logged again each minute while it fails)"
                    ),
                    Loudness::Again(failing_for) => tracing::error!(
                        table = %table, error = %e, failing_for = ?failing_for, retry_in = ?delay,
                        "claiming still fails"
                    ),
                    Loudness::Quiet => tracing::debug!(
                        table = %table, error = %e, retry_in = ?delay, "claiming failed again"
                    ),
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => Some(Turn::Next),
                    () = until_stopped(&mut self.stopped) => Some(Turn::Stop),
                }
            }
        }
    }

    /// A claim went through: a run of failed claims, if any, is over.
    fn claims_work_again(&mut self) {
        self.failures = 0;
        if let Some(failed_for) = self.claim_streak.ended() {
            tracing::info!(table = %self.relay.inner.outbox.table(), failed_for = ?failed_for, "claiming works again");
        }
    }

    /// Batches are under way (or the broker is out of reach): start the waiting one when a
    /// slot frees, and look for new work at the pace, so a slow batch does not hold up
    /// fresh messages. A finished batch may have unblocked its aggregates' successors (the
    /// pace then looks at once). While the broker is unavailable, wait for the next try.
    async fn wait_busy(&mut self, backing_off: Option<Instant>, room: bool) -> Turn {
        let options = &self.relay.inner.options;
        let next_look = backing_off
            .unwrap_or_else(|| self.pace.next().min(Instant::now() + options.poll_interval));
        let looks = self.waiting.is_none() || backing_off.is_some();
        let refresh_at = self.blocked_written.1 + IDLE_REFRESH;
        let waiting = self.waiting.is_some();
        tokio::select! {
            done = self.in_flight.join_next(), if !self.in_flight.is_empty() => {
                if let Some(done) = done {
                    let aggregates = self.relay.finished(done);
                    self.pace.finished(Instant::now(), aggregates);
                }
                Turn::Next
            }
            // A slot is free: the waiting batch starts at the top of the loop.
            _ = self.slots.acquire(), if waiting && backing_off.is_none() => Turn::Next,
            // Without room to claim, only a finishing batch makes room.
            () = tokio::time::sleep_until(next_look), if looks && room => {
                // Past the outage's backoff, the next try is due.
                self.pace.now(Instant::now());
                Turn::Next
            }
            // Blocked time is kept current in `<table>_relays`.
            () = tokio::time::sleep_until(refresh_at), if backing_off.is_some() => Turn::Next,
            () = until_stopped(&mut self.stopped) => Turn::Stop,
        }
    }

    /// Right after work, keep looking at the pace for a while: under steady traffic the
    /// relay stays awake and writers need not NOTIFY.
    async fn linger(&mut self) -> Turn {
        tokio::select! {
            () = self.run.wake.notify.notified() => {
                self.pace.now(Instant::now());
                Turn::Next
            }
            () = tokio::time::sleep_until(self.pace.next()) => Turn::Next,
            () = until_stopped(&mut self.stopped) => Turn::Stop,
        }
    }

    /// Idle without a LISTEN connection: nothing wakes the relay but the poll interval.
    async fn poll(&mut self) -> Turn {
        self.record_idle().await;
        tokio::select! {
            () = self.run.wake.notify.notified() => Turn::Next,
            () = tokio::time::sleep(self.relay.inner.options.poll_interval) => Turn::Next,
            () = until_stopped(&mut self.stopped) => Turn::Stop,
        }
    }

    /// Idle: ask for the wake lock (see `listener`), and wait for a wake-up, a change of
    /// the lock's state, or the poll interval; every way out but shutdown leads to a claim.
    async fn sleep_idle(&mut self) -> Turn {
        let (relay, run) = (self.relay, self.run);
        self.record_idle().await;
        run.wake.want_idle(true);
        let poll_at = Instant::now() + relay.inner.options.poll_interval;
        loop {
            let watch = run.wake.watch();
            if watch != Watch::Watching {
                self.watched_look = false;
            }
            match watch {
                // Every writer that saw no idle relay has committed by now: look once.
                Watch::Watching if !self.watched_look => {
                    self.watched_look = true;
                    return Turn::Next;
                }
                // Writers hold the lock, so their commits will not notify: look for them,
                // every `WATCH_RETRY` (a due row the claim cannot take must not spin).
                Watch::Contended if self.contended_look.elapsed() >= WATCH_RETRY => {
                    self.contended_look = Instant::now();
                    if relay.probe(&run.stop).await {
                        return Turn::Next;
                    }
                }
                _ if !run.wake.listening() => return Turn::Next,
                _ => {}
            }
            let refresh = (self.idle_written + IDLE_REFRESH).min(poll_at);
            let next = match watch {
                Watch::Contended | Watch::Off => (Instant::now() + WATCH_RETRY).min(refresh),
                Watch::Watching | Watch::Covered => refresh,
            };
            tokio::select! {
                () = run.wake.notify.notified() => {
                    if run.wake.watch() == watch {
                        return Turn::Next; // a NOTIFY, or a reconnect: look
                    }
                    // The wake lock changed hands: think again.
                }
                () = tokio::time::sleep_until(next) => {
                    if Instant::now() >= poll_at {
                        return Turn::Next;
                    }
                    if Instant::now() >= self.idle_written + IDLE_REFRESH {
                        // Keep the record from lapsing.
                        relay.mark_idle(&run.name(), true).await;
                        self.idle_written = Instant::now();
                    }
                }
                () = until_stopped(&mut self.stopped) => return Turn::Stop,
            }
        }
    }

    /// Records this run as idle in `<table>_relays`, unless that is on record already and
    /// recent (the record lapses unless renewed).
    async fn record_idle(&mut self) {
        if !self.marked_idle || Instant::now() >= self.idle_written + IDLE_REFRESH {
            self.marked_idle = self.relay.mark_idle(&self.run.name(), true).await;
            self.idle_written = Instant::now();
        }
    }

    /// Shutdown: the waiting batch is released; batches in flight drain (their tasks saw
    /// `stop`), then are recorded, all within the drain timeout and a grace. On an error
    /// the relay stops the same way.
    async fn shut_down(mut self, result: Result<()>) -> Result<()> {
        if result.is_err() {
            let _ = self.stopper.send(true);
        }
        if let Some(batch) = self.waiting.take() {
            if result.is_ok() {
                // Started after `stop`, it releases its records untried.
                self.start(batch, None);
            } else {
                // The relay stops on an error: give the waiting batch back untried.
                self.relay
                    .record(&batch.untried(), Instant::now() + RECORD_GRACE, None)
                    .await;
            }
        }
        while let Some(done) = self.in_flight.join_next().await {
            self.relay.finished(done);
        }
        // Every batch is over: what the engine holds for the run goes back at once.
        let _ =
            tokio::time::timeout(Duration::from_millis(500), self.relay.inner.store.leave()).await;
        // Housekeeping only: the record lapses by itself.
        let _ = tokio::time::timeout(
            Duration::from_millis(200),
            self.relay.forget(&self.run.name()),
        )
        .await;
        result
    }
}

/// The scheduling rules, on a table in memory and a publisher that holds records back, in
/// paused time: no database, no broker.
#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use diesel_async::pooled_connection::AsyncDieselConnectionManager;
    use futures_util::future::BoxFuture;

    use super::*;
    use crate::connect::PgPool;
    use crate::outbox::Outbox;
    use crate::publisher::{PublishError, Record};
    use crate::relay::RelayBuilder;
    use crate::relay::options::Options;
    use crate::relay::outcome::{Claimed, OUTCOME_RELEASE, OUTCOME_SENT, Outcome};
    use crate::relay::pace::{EMPTY_MAX, LINGER};
    use crate::relay::publish::STALL;
    use crate::relay::store::{End, Finish, LeaseEnd, Store};

    #[derive(Debug)]
    struct Row {
        id: i64,
        key: String,
        leased: bool,
        done: bool,
    }

    /// The outbox table in memory: a claim leases the first unleased rows; an outcome
    /// finishes a row or gives it back.
    #[derive(Default)]
    struct Memory {
        rows: Mutex<Vec<Row>>,
        /// Claims that took at least one row.
        claims: AtomicUsize,
        /// Every take, whatever it found.
        looks: AtomicUsize,
        /// Looks for due work.
        dues: AtomicUsize,
        /// Every outcome recorded: (key, kind).
        outcomes: Mutex<Vec<(String, &'static str)>>,
        /// Every state the relay recorded in `<table>_relays`: idle or not.
        states: Mutex<Vec<bool>>,
        /// While true, a claim takes its rows at once (the database made it) but answers
        /// only once this turns false.
        slow_claims: watch::Sender<bool>,
        /// While true, recording outcomes waits.
        slow_records: watch::Sender<bool>,
        /// When set, every batch is published under a lease that ends then, as a page of
        /// the log is under the cursor's (`None` inside: the relay lost it).
        cursor: Mutex<Option<CursorEnd>>,
    }

    type CursorEnd = Arc<Mutex<Option<Instant>>>;

    /// A batch's part under the lease of [`Memory::cursor`]; its outcomes are recorded
    /// one by one, like the rest.
    #[derive(Debug)]
    struct UnderCursor(CursorEnd);

    impl Finish for UnderCursor {
        fn holds(&self, _: i64) -> bool {
            false
        }

        fn settled(&self) -> usize {
            0
        }

        fn lease_end(&self) -> Option<LeaseEnd> {
            let end = self.0.clone();
            Some(Arc::new(move || *end.lock().unwrap()))
        }

        fn finish(self: Box<Self>, _: Vec<Outcome>, _: End) -> BoxFuture<'static, usize> {
            Box::pin(async { 0 })
        }
    }

    impl Memory {
        fn add(&self, key: &str) {
            let mut rows = self.rows.lock().unwrap();
            let id = i64::try_from(rows.len()).unwrap() + 1;
            rows.push(Row {
                id,
                key: key.to_owned(),
                leased: false,
                done: false,
            });
        }

        fn outcomes(&self) -> Vec<(String, &'static str)> {
            self.outcomes.lock().unwrap().clone()
        }

        fn outcome_of(&self, key: &str) -> Option<&'static str> {
            self.outcomes()
                .into_iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, kind)| kind)
        }

        fn leased(&self) -> Vec<String> {
            let rows = self.rows.lock().unwrap();
            rows.iter()
                .filter(|r| r.leased)
                .map(|r| r.key.clone())
                .collect()
        }
    }

    impl Store for Memory {
        fn take<'a>(
            &'a self,
            options: &'a Options,
            held: Vec<i64>,
        ) -> BoxFuture<'a, Result<Batch>> {
            self.looks.fetch_add(1, Ordering::SeqCst);
            let mut rows = self.rows.lock().unwrap();
            let ready: Vec<Claimed> = rows
                .iter_mut()
                .filter(|r| !r.leased && !r.done && !held.contains(&r.id))
                .take(options.batch_size)
                .map(|r| {
                    r.leased = true;
                    let mut record = Record::new(r.key.clone(), "t", Vec::new());
                    record.id = r.id;
                    Claimed { record, token: 1 }
                })
                .collect();
            if !ready.is_empty() {
                self.claims.fetch_add(1, Ordering::SeqCst);
            }
            let finish = self
                .cursor
                .lock()
                .unwrap()
                .clone()
                .filter(|_| !ready.is_empty())
                .map(|end| Box::new(UnderCursor(end)) as Box<dyn Finish>);
            let batch = Batch {
                ready,
                finish,
                ..Batch::default()
            };
            let mut answers = self.slow_claims.subscribe();
            Box::pin(async move {
                let _ = answers.wait_for(|slow| !*slow).await;
                Ok(batch)
            })
        }

        fn record<'a>(&'a self, outcomes: &'a [Outcome]) -> BoxFuture<'a, Result<usize>> {
            let mut answers = self.slow_records.subscribe();
            Box::pin(async move {
                let _ = answers.wait_for(|slow| !*slow).await;
                let mut rows = self.rows.lock().unwrap();
                for outcome in outcomes {
                    let row = rows.iter_mut().find(|r| r.id == outcome.id).unwrap();
                    row.leased = false;
                    row.done = outcome.kind != OUTCOME_RELEASE;
                    self.outcomes
                        .lock()
                        .unwrap()
                        .push((row.key.clone(), outcome.kind));
                }
                Ok(0)
            })
        }

        fn due(&self) -> BoxFuture<'_, Result<bool>> {
            self.dues.fetch_add(1, Ordering::SeqCst);
            let due = self
                .rows
                .lock()
                .unwrap()
                .iter()
                .any(|r| !r.leased && !r.done);
            Box::pin(async move { Ok(due) })
        }

        fn set_state<'a>(
            &'a self,
            _: &'a str,
            idle: bool,
            _: Duration,
            _: Option<Duration>,
        ) -> BoxFuture<'a, Result<()>> {
            self.states.lock().unwrap().push(idle);
            Box::pin(async { Ok(()) })
        }

        fn forget<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<()>> {
            Box::pin(async { Ok(()) })
        }

        fn stats(&self) -> BoxFuture<'_, Result<crate::ops::Stats>> {
            Box::pin(async { Err(crate::Error::invalid_option("no stats in memory")) })
        }

        fn pool(&self) -> Option<&crate::connect::PgPool> {
            None
        }
    }

    /// Confirms at once, except the records it holds until [`Gate::open`].
    #[derive(Clone)]
    struct Gate {
        /// Keys held back; `None` holds every record.
        held: Option<Vec<String>>,
        open: Arc<watch::Sender<bool>>,
        started: Arc<Mutex<Vec<String>>>,
        /// Publishes a wave as one pipelined batch, one record after another.
        pipelined: bool,
    }

    impl Gate {
        fn holding(held: Option<&[&str]>) -> Self {
            Gate {
                held: held.map(|keys| keys.iter().map(|k| (*k).to_owned()).collect()),
                open: Arc::new(watch::channel(false).0),
                started: Arc::default(),
                pipelined: false,
            }
        }

        fn pipelined(mut self) -> Self {
            self.pipelined = true;
            self
        }

        fn open(&self) {
            self.open.send_replace(true);
        }

        fn started(&self) -> Vec<String> {
            self.started.lock().unwrap().clone()
        }
    }

    impl Publisher for Gate {
        async fn publish(&self, record: &Record) -> std::result::Result<(), PublishError> {
            self.started.lock().unwrap().push(record.key.clone());
            let holds = self
                .held
                .as_ref()
                .is_none_or(|keys| keys.contains(&record.key));
            if holds {
                let _ = self.open.subscribe().wait_for(|open| *open).await;
            }
            Ok(())
        }

        fn publish_batch<'a>(
            &'a self,
            records: &'a [Record],
        ) -> Option<crate::publisher::BatchResults<'a>> {
            use futures_util::StreamExt;
            self.pipelined.then(|| {
                futures_util::stream::iter(records.iter().enumerate())
                    .then(move |(i, record)| async move { (i, self.publish(record).await) })
                    .boxed()
            })
        }
    }

    /// A relay on `memory`; the pool is never used (no LISTEN, no janitor).
    fn relay(
        memory: &Arc<Memory>,
        gate: &Gate,
        configure: impl FnOnce(RelayBuilder<Gate>) -> RelayBuilder<Gate>,
    ) -> Relay<Gate> {
        let pool = PgPool::builder().build_unchecked(AsyncDieselConnectionManager::new(
            "postgres://unused.invalid",
        ));
        let builder = Outbox::new()
            .relay(pool, gate.clone())
            .without_listen()
            .retention(None)
            .inbox_retention(None)
            .lease(Duration::from_secs(3600));
        configure(builder).build_on(memory.clone()).unwrap()
    }

    /// Runs `relay` until the returned sender fires (or is dropped).
    fn spawn(
        relay: &Relay<Gate>,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<()>>,
    ) {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let relay = relay.clone();
        let task = tokio::spawn(async move {
            relay
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
        });
        (stop, task)
    }

    /// Waits (in paused time) until `check` holds, for at most a minute.
    async fn until(what: &str, check: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !check() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn three_batches_publish_at_once_and_one_waits_claimed() {
        let memory = Arc::new(Memory::default());
        for i in 0..20 {
            memory.add(&format!("m{i}"));
        }
        let gate = Gate::holding(None);
        let relay = relay(&memory, &gate, |b| b.batch_size(1).concurrency(1));
        let (stop, task) = spawn(&relay);

        until("three publishes", || gate.started().len() == PIPELINE).await;
        // Short of the stall time, after which a slow batch gives its slot back.
        tokio::time::sleep(STALL / 2).await;
        assert_eq!(gate.started().len(), PIPELINE, "no fourth batch publishes");
        assert_eq!(
            memory.claims.load(Ordering::SeqCst),
            PIPELINE + 1,
            "one more batch waits claimed"
        );
        assert_eq!(memory.leased(), ["m0", "m1", "m2", "m3"]);

        // Stalled batches free their slots, but only so many of them: once nine have
        // stalled the relay claims no more; the batch that was waiting then has started.
        tokio::time::sleep(60 * STALL).await;
        assert_eq!(
            gate.started().len(),
            MAX_STALLED + 1,
            "stalled batches are bounded"
        );
        assert_eq!(memory.claims.load(Ordering::SeqCst), MAX_STALLED + 1);

        gate.open();
        until("every message sent", || {
            (0..20).all(|i| memory.outcome_of(&format!("m{i}")) == Some(OUTCOME_SENT))
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_fresh_message_is_claimed_and_sent_while_a_slow_one_publishes() {
        let memory = Arc::new(Memory::default());
        memory.add("slow");
        let gate = Gate::holding(Some(&["slow"]));
        let relay = relay(&memory, &gate, |b| b);
        let (stop, task) = spawn(&relay);

        until("the slow publish", || gate.started() == ["slow"]).await;
        memory.add("fresh");
        let added = Instant::now();
        until("the fresh message sent", || {
            memory.outcome_of("fresh") == Some(OUTCOME_SENT)
        })
        .await;
        assert!(
            added.elapsed() <= crate::relay::pace::BUSY_MAX,
            "found within one busy look: {:?}",
            added.elapsed()
        );
        assert_eq!(memory.outcome_of("slow"), None, "still publishing");

        gate.open();
        until("the slow message sent", || {
            memory.outcome_of("slow") == Some(OUTCOME_SENT)
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
    }

    /// A linger that finds nothing looks a few times (the waits doubling from 2 ms to
    /// 16 ms), not once each millisecond.
    #[tokio::test(start_paused = true)]
    async fn a_linger_thins_its_looks_out() {
        let memory = Arc::new(Memory::default());
        memory.add("first");
        let gate = Gate::holding(Some(&[]));
        let relay = relay(&memory, &gate, |b| b.poll_interval(Duration::from_secs(2)));
        let (stop, task) = spawn(&relay);
        until("the first message sent", || {
            memory.outcome_of("first") == Some(OUTCOME_SENT)
        })
        .await;
        let before = memory.looks.load(Ordering::SeqCst);
        tokio::time::sleep(LINGER * 2).await;
        let looks = memory.looks.load(Ordering::SeqCst) - before;
        assert!((4..=8).contains(&looks), "{looks} looks in one linger");
        let _ = stop.send(());
        task.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn after_work_the_relay_lingers_then_only_polls() {
        let memory = Arc::new(Memory::default());
        memory.add("first");
        let gate = Gate::holding(Some(&[]));
        let poll = Duration::from_secs(2);
        let relay = relay(&memory, &gate, |b| b.poll_interval(poll));
        let (stop, task) = spawn(&relay);
        until("the first message sent", || {
            memory.outcome_of("first") == Some(OUTCOME_SENT)
        })
        .await;

        // Within the linger time a new message is found by the next look.
        tokio::time::sleep(LINGER / 5).await;
        memory.add("lingering");
        let added = Instant::now();
        until("the message found while lingering", || {
            memory.outcome_of("lingering") == Some(OUTCOME_SENT)
        })
        .await;
        assert!(added.elapsed() <= EMPTY_MAX, "took {:?}", added.elapsed());

        // Once idle, nothing looks until the poll interval is up.
        tokio::time::sleep(LINGER * 4).await;
        let looks = memory.looks.load(Ordering::SeqCst);
        memory.add("idle");
        let added = Instant::now();
        until("the message found by polling", || {
            memory.outcome_of("idle") == Some(OUTCOME_SENT)
        })
        .await;
        assert!(
            added.elapsed() >= poll / 2 && added.elapsed() <= poll,
            "took {:?}",
            added.elapsed()
        );
        assert_eq!(
            memory.looks.load(Ordering::SeqCst),
            looks + 1,
            "an idle relay without LISTEN looks only when the poll interval is up"
        );
        // Idle, then busy, then idle again: each recorded once.
        tokio::time::sleep(LINGER * 4).await;
        assert_eq!(*memory.states.lock().unwrap(), [true, false, true]);
        let _ = stop.send(());
        task.await.unwrap().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_releases_the_waiting_batch_untried_and_cuts_the_drain_at_its_timeout() {
        let memory = Arc::new(Memory::default());
        for i in 0..10 {
            memory.add(&format!("m{i}"));
        }
        let gate = Gate::holding(None);
        let drain = Duration::from_secs(2);
        let relay = relay(&memory, &gate, |b| {
            b.batch_size(1).concurrency(1).drain_timeout(drain)
        });
        let (stop, task) = spawn(&relay);
        until("a full pipeline and a waiting batch", || {
            gate.started().len() == PIPELINE && memory.claims.load(Ordering::SeqCst) == PIPELINE + 1
        })
        .await;

        let stopped = Instant::now();
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert!(
            stopped.elapsed() <= drain + RECORD_GRACE,
            "returned after {:?}",
            stopped.elapsed()
        );
        assert_eq!(
            gate.started(),
            ["m0", "m1", "m2"],
            "the waiting batch never started"
        );
        let mut released: Vec<String> = memory
            .outcomes()
            .into_iter()
            .filter(|(_, kind)| *kind == OUTCOME_RELEASE)
            .map(|(key, _)| key)
            .collect();
        released.sort();
        assert_eq!(released, ["m0", "m1", "m2", "m3"]);
        assert!(memory.leased().is_empty(), "nothing stays leased");
    }

    /// Shutdown while a claim is under way: the database has made the claim (its rows are
    /// leased) but not yet answered. The relay waits for the answer and releases the rows
    /// untried, rather than leave them leased until their lease ends.
    #[tokio::test(start_paused = true)]
    async fn a_claim_under_way_at_shutdown_is_released_not_left_leased() {
        let memory = Arc::new(Memory::default());
        for i in 0..10 {
            memory.add(&format!("m{i}"));
        }
        memory.slow_claims.send_replace(true);
        let gate = Gate::holding(Some(&[]));
        let drain = Duration::from_secs(2);
        let relay = relay(&memory, &gate, |b| b.batch_size(5).drain_timeout(drain));
        let (stop, task) = spawn(&relay);
        until("a claim made", || memory.claims.load(Ordering::SeqCst) == 1).await;

        let _ = stop.send(());
        tokio::time::sleep(drain / 4).await;
        memory.slow_claims.send_replace(false);
        task.await.unwrap().unwrap();
        assert!(
            gate.started().is_empty(),
            "nothing published after shutdown"
        );
        assert!(
            memory.leased().is_empty(),
            "nothing stays leased: {:?}",
            memory.leased()
        );
        let released: Vec<String> = memory.outcomes().into_iter().map(|(key, _)| key).collect();
        assert_eq!(released, ["m0", "m1", "m2", "m3", "m4"]);
        assert!(
            memory
                .outcomes()
                .iter()
                .all(|(_, kind)| *kind == OUTCOME_RELEASE)
        );
    }

    /// A claim the database never answers does not hold up a shutdown beyond the drain
    /// timeout (and the grace for recording).
    #[tokio::test(start_paused = true)]
    async fn a_claim_never_answered_gives_way_at_the_drain_timeout() {
        let memory = Arc::new(Memory::default());
        memory.add("m0");
        memory.slow_claims.send_replace(true);
        let gate = Gate::holding(Some(&[]));
        let drain = Duration::from_secs(2);
        let relay = relay(&memory, &gate, |b| b.drain_timeout(drain));
        let (stop, task) = spawn(&relay);
        until("a claim made", || memory.claims.load(Ordering::SeqCst) == 1).await;
        let stopped = Instant::now();
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert!(
            stopped.elapsed() <= drain + RECORD_GRACE,
            "returned after {:?}",
            stopped.elapsed()
        );
        assert!(gate.started().is_empty());
    }

    /// A batch whose outcome is recorded only after its lease has run out (the database
    /// slow to answer; or its task stalled, as by a publisher blocking its thread) keeps its
    /// rows from the relay's own next claims until the outcome is in: a message confirmed
    /// once is not claimed back and published again.
    #[tokio::test(start_paused = true)]
    async fn the_relay_never_claims_back_rows_its_own_batch_still_holds() {
        let memory = Arc::new(Memory::default());
        memory.add("m0");
        let gate = Gate::holding(Some(&[]));
        let lease = Duration::from_secs(1);
        let relay = relay(&memory, &gate, |b| b.lease(lease).drain_timeout(lease / 4));
        memory.slow_records.send_replace(true);
        let (stop, task) = spawn(&relay);
        until("the publish", || gate.started() == ["m0"]).await;
        // Its outcome is not recorded yet, and its lease runs out: in the table the row is
        // due again.
        tokio::time::sleep(lease).await;
        memory.rows.lock().unwrap()[0].leased = false;
        tokio::time::sleep(lease / 4).await;
        assert_eq!(
            memory.claims.load(Ordering::SeqCst),
            1,
            "no claim took it back"
        );
        memory.slow_records.send_replace(false);
        until("the outcome recorded", || {
            memory.outcome_of("m0") == Some(OUTCOME_SENT)
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert_eq!(gate.started(), ["m0"], "published once");
    }

    /// A batch whose relay stalls past twice its lease (a process paused, say) still tries
    /// once to record its outcomes when it resumes: no relay took the row over, so its
    /// confirmed message is recorded sent rather than published again after the lease.
    #[tokio::test(start_paused = true)]
    async fn a_batch_resumed_past_its_record_deadline_still_records() {
        struct Stalls(Duration);
        impl Publisher for Stalls {
            async fn publish(&self, _: &Record) -> std::result::Result<(), PublishError> {
                tokio::time::advance(self.0).await;
                Ok(())
            }
        }
        let memory = Arc::new(Memory::default());
        memory.add("m0");
        let lease = Duration::from_secs(1);
        let pool = PgPool::builder().build_unchecked(AsyncDieselConnectionManager::new(
            "postgres://unused.invalid",
        ));
        let relay = Outbox::new()
            .relay(pool, Stalls(3 * lease))
            .without_listen()
            .retention(None)
            .inbox_retention(None)
            .lease(lease)
            .drain_timeout(lease / 4)
            .build_on(memory.clone())
            .unwrap();
        // The database answers recording a moment later, not at once.
        memory.slow_records.send_replace(true);
        let running = tokio::spawn(async move { relay.run_once().await });
        // Half a second after the stall: past the batch's deadline, within its one try.
        tokio::time::sleep(3 * lease + lease / 2).await;
        memory.slow_records.send_replace(false);
        running.await.unwrap().unwrap();
        assert_eq!(memory.outcome_of("m0"), Some(OUTCOME_SENT));
    }

    /// A relay whose renewals of the cursor's lease stop reaching the database (it lost
    /// the lease, or may have) cuts off the publish under way before the lease ends and
    /// starts none after it: past it another relay may publish the same messages, and two
    /// publishes of one aggregate would overlap.
    #[tokio::test(start_paused = true)]
    async fn publishes_under_the_cursors_lease_stop_before_it_ends() {
        publishes_stop_before_the_cursors_lease_ends(Gate::holding(Some(&["m0"]))).await;
        publishes_stop_before_the_cursors_lease_ends(Gate::holding(Some(&["m0"])).pipelined())
            .await;
    }

    async fn publishes_stop_before_the_cursors_lease_ends(gate: Gate) {
        let memory = Arc::new(Memory::default());
        for i in 0..4 {
            memory.add(&format!("m{i}"));
        }
        let cursor_lease = Duration::from_secs(5);
        let end: CursorEnd = Arc::new(Mutex::new(Some(Instant::now() + cursor_lease)));
        *memory.cursor.lock().unwrap() = Some(end.clone());
        let relay = relay(&memory, &gate, |b| {
            b.batch_size(4).concurrency(1).cursor_lease(cursor_lease)
        });
        let (stop, task) = spawn(&relay);
        until("m0's publish started", || gate.started() == ["m0"]).await;
        let started = Instant::now();
        until("m0 released", || {
            memory.outcome_of("m0") == Some(OUTCOME_RELEASE)
        })
        .await;
        let cut_after = started.elapsed();
        assert!(
            cut_after < cursor_lease,
            "cut off only after {cut_after:?}, past the lease"
        );
        // Whatever the relay claims again is under the same lease, which ran out.
        tokio::time::sleep(cursor_lease).await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert_eq!(gate.started(), ["m0"], "nothing started after the lease");
        for key in ["m1", "m2", "m3"] {
            assert_eq!(memory.outcome_of(key), Some(OUTCOME_RELEASE), "{key}");
        }
    }

    /// While the cursor's lease is renewed, a publish may outlast many leases.
    #[tokio::test(start_paused = true)]
    async fn a_renewed_cursor_lease_keeps_a_long_publish() {
        let memory = Arc::new(Memory::default());
        memory.add("m0");
        memory.add("m1");
        let cursor_lease = Duration::from_secs(5);
        let end: CursorEnd = Arc::new(Mutex::new(Some(Instant::now() + cursor_lease)));
        *memory.cursor.lock().unwrap() = Some(end.clone());
        let renewals = tokio::spawn({
            let end = end.clone();
            async move {
                loop {
                    tokio::time::sleep(cursor_lease / 5).await;
                    *end.lock().unwrap() = Some(Instant::now() + cursor_lease);
                }
            }
        });
        let gate = Gate::holding(Some(&["m0"]));
        let relay = relay(&memory, &gate, |b| {
            b.batch_size(2).concurrency(1).cursor_lease(cursor_lease)
        });
        let (stop, task) = spawn(&relay);
        until("m0's publish started", || gate.started() == ["m0"]).await;
        tokio::time::sleep(4 * cursor_lease).await;
        assert_eq!(memory.outcome_of("m0"), None, "m0 still publishing");
        gate.open();
        until("both sent", || {
            memory.outcome_of("m0") == Some(OUTCOME_SENT)
                && memory.outcome_of("m1") == Some(OUTCOME_SENT)
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        renewals.abort();
        assert_eq!(gate.started(), ["m0", "m1"]);
    }
}
