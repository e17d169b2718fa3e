//! The relay loop: claim a batch, publish it outside any transaction, record the outcomes.

mod janitor;
pub(crate) mod listener;
mod options;
mod outage;
pub(crate) mod presence;
mod publish;
pub(crate) mod store;

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use futures_util::FutureExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::metrics::{Metrics, NoMetrics};
use crate::outbox::Outbox;
use crate::publisher::Publisher;

use self::listener::{WATCH_RETRY, Wake, Watch};
use self::options::Options;
use self::outage::Outage;
use self::presence::IDLE_REFRESH;
use self::publish::Slot;
use self::store::{Batch, Outcome};

/// The connection pool a relay takes its connections from.
///
/// bb8 tests each checkout with a round trip by default; for the relay's hot path build it
/// with `.test_on_check_out(false)` (broken connections are still detected and replaced).
pub type PgPool = diesel_async::pooled_connection::bb8::Pool<AsyncPgConnection>;

impl Outbox {
    /// A relay for this table, publishing through `publisher`, with connections from
    /// `pool`. See [`RelayBuilder`] for the options.
    pub fn relay<P: Publisher>(&self, pool: PgPool, publisher: P) -> RelayBuilder<P> {
        RelayBuilder {
            outbox: self.clone(),
            pool,
            publisher,
            options: Options::default(),
            metrics: Arc::new(NoMetrics),
        }
    }
}

/// Configures a [`Relay`]; from [`Outbox::relay`].
#[must_use]
pub struct RelayBuilder<P> {
    outbox: Outbox,
    pool: PgPool,
    publisher: P,
    options: Options,
    metrics: Arc<dyn Metrics>,
}

impl<P> std::fmt::Debug for RelayBuilder<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("outbox", &self.outbox)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<P: Publisher> RelayBuilder<P> {
    /// Rows claimed per cycle (1 to 10,000). A full batch starts the next cycle at once.
    /// Defaults to 100.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.options.batch_size = n;
        self
    }

    /// Records of one batch published at once when the publisher publishes one by one
    /// (1 to 1,024); a pipelining publisher gets the whole batch instead. Up to three
    /// batches publish at once (and more may be recording their outcomes) while the relay
    /// claims the next, so a relay runs up to three times this many publishes, besides the
    /// stragglers of batches that wait only on slow publishes (over a second, or an eighth
    /// of the lease): such a batch gives its slot back while they finish (up to nine such
    /// batches) and takes one again before it publishes more. Defaults to 4.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = n;
        self
    }

    /// How long a claim is exclusive (100 ms to 1 day). After it another relay may claim
    /// the row again, and this relay's late outcome is discarded (fencing). A publish may
    /// take half of it: then the relay abandons it and records a transient failure
    /// ("publish timed out"). Defaults to 30 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// How often the relay looks for work without being woken (10 ms to 1 day): backoff
    /// expiries, delayed messages, expired leases, and anything committed while it was not
    /// listening. Defaults to 2 s.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.options.poll_interval = interval;
        self
    }

    /// Attempts before a message becomes a dead letter (1 to 1,000). A row claimed this many
    /// times without any outcome (the relay crashed or hung each time) also goes dead on
    /// its next claim. Defaults to 10.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.options.max_attempts = n;
        self
    }

    /// Retry delay after a transient failure: `min` doubled per attempt, capped at `max`,
    /// with jitter between half and all of it. Defaults to 1 s and 5 min.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        self.options.backoff_min = min;
        self.options.backoff_max = max;
        self
    }

    /// On shutdown, how long publishes under way may take to finish (at most half the
    /// lease, and 1 hour); the rest are released without spending an attempt. Defaults to
    /// 10 s.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.options.drain_timeout = timeout;
        self
    }

    /// Do not LISTEN for wake-ups: find work by polling only. Use it behind a pooler in
    /// transaction mode. Defaults to listening on a dedicated connection.
    pub fn without_listen(mut self) -> Self {
        self.options.listen = false;
        self
    }

    /// Hooks for your metrics system. Defaults to none.
    pub fn metrics(mut self, metrics: impl Metrics) -> Self {
        self.metrics = Arc::new(metrics);
        self
    }

    /// Sent rows older than this are purged by the relay, in small batches; `None` keeps
    /// them. While a sent row exists, enqueueing its key again is reported as a duplicate.
    /// Defaults to 7 days.
    pub fn retention(mut self, retention: impl Into<Option<Duration>>) -> Self {
        self.options.retention = retention.into();
        self
    }

    /// Inbox (dedupe) records older than this are purged by the relay; `None` keeps them.
    /// A redelivery older than this is no longer detected as a duplicate, so keep it longer
    /// than the broker can hold a message. Defaults to 30 days.
    pub fn inbox_retention(mut self, retention: impl Into<Option<Duration>>) -> Self {
        self.options.inbox_retention = retention.into();
        self
    }

    /// The most payload and header bytes one claim takes (1 byte to 1 GiB), so a relay's
    /// memory stays bounded whatever the message sizes; a claim always takes at least one
    /// row, however large. Defaults to 16 MiB.
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.options.max_batch_bytes = bytes;
        self
    }

    /// Checks the options and builds the relay.
    ///
    /// Besides each option's own range, the options must fit together: a publish may take
    /// half the lease (then the relay abandons it and records a "publish timed out"
    /// failure), so the publisher's own timeout ([`Publisher::timeout`], for RabbitMQ its
    /// confirm timeout) and the `drain_timeout` must each be at most half the lease.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] naming the option and its valid range.
    pub fn build(self) -> Result<Relay<P>> {
        self.options.validate(self.publisher.timeout())?;
        Ok(Relay {
            inner: Arc::new(Inner {
                outbox: self.outbox,
                pool: self.pool,
                publisher: self.publisher,
                options: self.options,
                metrics: self.metrics,
                outage: Outage::default(),
                listening: Arc::new(AtomicUsize::new(0)),
            }),
        })
    }
}

/// Ships committed outbox rows to a [`Publisher`], at least once.
///
/// Cheap to clone: clones share the configuration, the publisher and the metrics. Each call
/// of [`Relay::run_until`] is a relay of its own (its own id, LISTEN connection and lease
/// holder), so running two clones at once gives two relays. Run one or many relays (in one
/// process or many) on the same table; leases and fencing keep them from publishing a row
/// twice except after a lease expiry or a crash.
pub struct Relay<P> {
    inner: Arc<Inner<P>>,
}

impl<P> Clone for Relay<P> {
    fn clone(&self) -> Self {
        Relay {
            inner: self.inner.clone(),
        }
    }
}

impl<P> std::fmt::Debug for Relay<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("outbox", &self.inner.outbox)
            .field("options", &self.inner.options)
            .field("listening", &self.listening())
            .finish_non_exhaustive()
    }
}

struct Inner<P> {
    outbox: Outbox,
    pool: PgPool,
    publisher: P,
    options: Options,
    metrics: Arc<dyn Metrics>,
    /// Whether the broker is reachable; shared by every run, as the publisher is.
    outage: Outage,
    /// Runs holding their LISTEN connection.
    listening: Arc<AtomicUsize>,
}

/// One run of a relay ([`Relay::run_until`]): what it shares with its listener.
struct Run {
    /// Names this run in `<table>_relays`.
    id: String,
    /// True once shutdown was asked for.
    stop: watch::Receiver<bool>,
    wake: Arc<Wake>,
    /// Batches that gave their publishing slot back while a slow publish finishes.
    stalled: Arc<AtomicUsize>,
}

/// Claimed batches publishing at once.
const PIPELINE: usize = 3;
/// Stalled batches (waiting only on slow publishes) the relay keeps beside its pipeline
/// before it waits for their deadlines.
const MAX_STALLED: usize = 3 * PIPELINE;
/// At shutdown, recording outcomes may take this long after the drain timeout.
const RECORD_GRACE: Duration = Duration::from_secs(1);
/// While batches are in flight, the relay looks for new work this often, and half as often
/// after each look that found nothing, down to once per [`BUSY_POLL_MAX`] (and never less
/// often than the poll interval).
const BUSY_POLL: Duration = Duration::from_millis(1);
/// The longest wait between looks for new work while batches are in flight.
const BUSY_POLL_MAX: Duration = Duration::from_millis(160);
/// After work, the relay keeps looking for this long before it calls itself idle.
const LINGER: Duration = Duration::from_millis(50);
/// How often it looks while lingering.
const LINGER_POLL: Duration = Duration::from_millis(1);

/// Completes once `stop` turns true (or its sender is gone).
pub(crate) async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: drop it here, not across an await.
    let _ = stop.wait_for(|stopping| *stopping).await.map(|_| ());
}

/// `work`'s output, or `None` if `stop` turns true first (then `work` is dropped): the
/// relay's own database work never holds up a shutdown.
async fn or_stop<T>(stop: &watch::Receiver<bool>, work: impl Future<Output = T>) -> Option<T> {
    let mut stop = stop.clone();
    tokio::select! {
        out = work => Some(out),
        () = until_stopped(&mut stop) => None,
    }
}

/// Aborts a background task when dropped, so a dropped relay leaks nothing.
struct AbortOnDrop(Option<JoinHandle<()>>);

impl AbortOnDrop {
    fn new(task: JoinHandle<()>) -> Self {
        AbortOnDrop(Some(task))
    }

    /// Aborts the task and waits until it is gone (so it changes no state afterwards).
    async fn stop(mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = &self.0 {
            task.abort();
        }
    }
}

impl<P> Relay<P> {
    /// True while a run of this relay holds its LISTEN connection (so a commit wakes it at
    /// once).
    pub fn listening(&self) -> bool {
        self.inner.listening.load(Ordering::SeqCst) > 0
    }
}

impl<P: Publisher> Relay<P> {
    /// Runs until `shutdown` completes, then drains and returns.
    ///
    /// After `shutdown` the relay claims nothing more. Publishes under way get the
    /// `drain_timeout` and their outcomes are recorded; claimed records not yet started,
    /// and publishes cut off by the timeout, are released at once with their attempt
    /// restored. It returns within the drain timeout and about a second more, whether or
    /// not the database answers. Also runs the LISTEN connection (unless `without_listen`)
    /// and the retention janitor (unless both retentions are `None`) while it runs.
    ///
    /// Database and publish failures are logged and retried; a broker that cannot be
    /// reached makes the relay hold off (see [`PublishError::unavailable`]). Dropping the
    /// future stops the relay without draining (its claims then wait for their lease to
    /// end).
    ///
    /// [`PublishError::unavailable`]: crate::PublishError::unavailable
    ///
    /// # Errors
    /// [`Error::NotMigrated`] when the table does not exist.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let inner = &self.inner;
        let table = inner.outbox.table().to_owned();
        let (stop, stopping) = watch::channel(false);
        let run = Run {
            id: uuid::Uuid::new_v4().to_string(),
            stop: stopping.clone(),
            wake: Arc::new(Wake::new(inner.listening.clone())),
            stalled: Arc::new(AtomicUsize::new(0)),
        };
        tracing::info!(table = %table, relay = %run.id, options = ?inner.options, "relay started");
        let listener = inner.options.listen.then(|| {
            AbortOnDrop::new(tokio::spawn(listener::run(
                inner.pool.clone(),
                inner.outbox.statements().listener.clone(),
                table.clone(),
                run.wake.clone(),
            )))
        });
        let _janitor = (inner.options.retention.is_some()
            || inner.options.inbox_retention.is_some())
        .then(|| {
            AbortOnDrop::new(tokio::spawn(janitor::run(
                inner.outbox.clone(),
                inner.pool.clone(),
                inner.options.retention,
                inner.options.inbox_retention,
            )))
        });

        let running = self.run(&run, stopping, &stop);
        let mut running = pin!(running);
        let mut shutdown = pin!(shutdown.fuse());
        let result = loop {
            tokio::select! {
                result = &mut running => break result,
                () = &mut shutdown => {
                    let _ = stop.send(true);
                }
            }
        };
        if let Some(listener) = listener {
            listener.stop().await;
        }
        run.wake.set_listening(false);
        tracing::info!(table = %table, relay = %run.id, "relay stopped");
        result
    }

    /// The relay loop. Up to [`PIPELINE`] claimed batches publish at once, each on a task of
    /// its own that then records the outcomes, and one more batch waits claimed, ready to
    /// go the moment a publishing slot frees: a broker that confirms in bursts is fed again
    /// at once instead of waiting for a claim. A batch that waits only on a slow publish
    /// gives its slot back (up to [`MAX_STALLED`] such batches). While the broker is
    /// unavailable the relay claims only after its outage backoff. Returns once `stop` is
    /// true and every batch in flight was drained (a batch still waiting is released).
    async fn run(
        &self,
        run: &Run,
        stop: watch::Receiver<bool>,
        stopper: &watch::Sender<bool>,
    ) -> Result<()> {
        let inner = &self.inner;
        let table = inner.outbox.table();
        let mut stopped = stop.clone();
        let mut in_flight: JoinSet<()> = JoinSet::new();
        let slots = Arc::new(Semaphore::new(PIPELINE));
        let mut ready: Option<Batch> = None;
        let mut failures = 0u32;
        let mut linger_until = Instant::now() + LINGER;
        let mut claim_more = true;
        // Fruitless looks for new work while batches are under way; each one waits longer.
        let mut fruitless = 0u32;
        // What this run last wrote of its outage into `<table>_relays`, and when.
        let mut blocked_written: (Option<Instant>, Instant) = (None, Instant::now());
        // Whether `<table>_relays` says this run is idle, and since when.
        let mut marked_idle = false;
        let mut idle_written = Instant::now();
        // Whether the look that follows taking the wake lock was made.
        let mut watched_look = false;
        // When the relay last looked for the commits of writers holding the wake lock.
        let mut contended_look = Instant::now() - WATCH_RETRY;
        let result = 'run: loop {
            let stopping = *stop.borrow();
            if stopping {
                break Ok(());
            }
            self.sync_blocked(run, &mut blocked_written).await;
            let backing_off = inner.outage.retry_at();
            // While the broker is unavailable the waiting batch waits too: it is the next try.
            if ready.is_some()
                && backing_off.is_none()
                && let Ok(slot) = slots.clone().try_acquire_owned()
            {
                let batch = ready.take().expect("checked above");
                self.start(&mut in_flight, batch, (Some(slot), &slots), run, &stop);
            }
            let stalled = run.stalled.load(Ordering::SeqCst);
            // Leave room for the batches that are recording, which no longer hold a slot.
            let room =
                in_flight.len().saturating_sub(stalled) < 2 * PIPELINE && stalled < MAX_STALLED;
            if claim_more && ready.is_none() && room && backing_off.is_none() {
                match self.claim(Some(&run.stop)).await {
                    Ok(batch) if batch.claimed() > 0 => {
                        failures = 0;
                        fruitless = 0;
                        // Busy: writers need not notify; let the wake lock go.
                        run.wake.want_idle(false);
                        if marked_idle {
                            marked_idle = !self.mark_idle(run, false).await;
                        }
                        // A batch that was not full says the backlog is drained for now.
                        claim_more = batch.claimed() >= inner.options.batch_size;
                        ready = Some(batch);
                        continue;
                    }
                    Ok(_) => fruitless = fruitless.saturating_add(1),
                    Err(e @ Error::NotMigrated { .. }) => break Err(e),
                    Err(e) => {
                        failures += 1;
                        let delay = inner
                            .options
                            .backoff(failures)
                            .min(inner.options.poll_interval);
                        tracing::warn!(table = %table, error = %e, retry_in = ?delay, "relay cycle failed");
                        tokio::select! {
                            () = tokio::time::sleep(delay) => continue,
                            () = until_stopped(&mut stopped) => break Ok(()),
                        }
                    }
                }
            }
            if ready.is_some() || !in_flight.is_empty() || backing_off.is_some() {
                // Batches are under way: start the waiting one when a slot frees, and look
                // for new work now and then, so a slow batch does not hold up fresh messages.
                // A finished batch may have unblocked its aggregates' successors: look again
                // at once. While the broker is unavailable, wait for the next try.
                let busy_poll = (BUSY_POLL * 2u32.saturating_pow(fruitless.min(8)))
                    .min(BUSY_POLL_MAX)
                    .min(inner.options.poll_interval);
                let next_look = backing_off.unwrap_or_else(|| Instant::now() + busy_poll);
                let looks = ready.is_none() || backing_off.is_some();
                tokio::select! {
                    done = in_flight.join_next(), if !in_flight.is_empty() => {
                        if let Some(done) = done {
                            self.finished(done);
                        }
                        claim_more = true;
                    }
                    // A slot is free: the waiting batch starts at the top of the loop.
                    _ = slots.acquire(), if ready.is_some() && backing_off.is_none() => {}
                    // Without room to claim, only a finishing batch makes room.
                    () = tokio::time::sleep_until(next_look), if looks && room => claim_more = true,
                    // Blocked time is kept current in `<table>_relays`.
                    () = tokio::time::sleep_until(blocked_written.1 + IDLE_REFRESH), if backing_off.is_some() => {}
                    () = until_stopped(&mut stopped) => break Ok(()),
                }
                linger_until = Instant::now() + LINGER;
                continue;
            }
            fruitless = 0;

            // Nothing due and nothing in flight. Right after work, keep looking often for a
            // while: under steady traffic the relay stays awake and writers need not NOTIFY.
            claim_more = true;
            if Instant::now() < linger_until {
                tokio::select! {
                    () = run.wake.notify.notified() => {}
                    () = self.wait_due() => {}
                    () = until_stopped(&mut stopped) => break Ok(()),
                }
                continue;
            }

            // Idle. Without a LISTEN connection nothing wakes us: poll.
            if !run.wake.listening() {
                tokio::select! {
                    () = run.wake.notify.notified() => {}
                    () = tokio::time::sleep(inner.options.poll_interval) => {}
                    () = until_stopped(&mut stopped) => break 'run Ok(()),
                }
                continue;
            }
            // Ask for the wake lock (see `listener`), and wait for a wake-up, a change of the
            // lock's state, or the poll interval; every `break` below leads to a claim.
            if !marked_idle {
                marked_idle = self.mark_idle(run, true).await;
                idle_written = Instant::now();
            }
            run.wake.want_idle(true);
            let poll_at = Instant::now() + inner.options.poll_interval;
            loop {
                let watch = run.wake.watch();
                if watch != Watch::Watching {
                    watched_look = false;
                }
                match watch {
                    // Every writer that saw no idle relay has committed by now: look once.
                    Watch::Watching if !watched_look => {
                        watched_look = true;
                        break;
                    }
                    // Writers hold the lock, so their commits will not notify: look for them,
                    // every `WATCH_RETRY` (a due row the claim cannot take must not spin).
                    Watch::Contended if contended_look.elapsed() >= WATCH_RETRY => {
                        contended_look = Instant::now();
                        if self.probe(&run.stop).await {
                            break;
                        }
                    }
                    _ if !run.wake.listening() => break,
                    _ => {}
                }
                let refresh = (idle_written + IDLE_REFRESH).min(poll_at);
                let next = match watch {
                    Watch::Contended | Watch::Off => (Instant::now() + WATCH_RETRY).min(refresh),
                    Watch::Watching | Watch::Covered => refresh,
                };
                tokio::select! {
                    () = run.wake.notify.notified() => {
                        if run.wake.watch() == watch {
                            break; // a NOTIFY, or a reconnect: look
                        }
                        // The wake lock changed hands: think again.
                    }
                    () = tokio::time::sleep_until(next) => {
                        if Instant::now() >= poll_at {
                            break;
                        }
                        if Instant::now() >= idle_written + IDLE_REFRESH {
                            // Keep the record from lapsing.
                            self.mark_idle(run, true).await;
                            idle_written = Instant::now();
                        }
                    }
                    () = until_stopped(&mut stopped) => break 'run Ok(()),
                }
            }
        };
        // Shutdown: a batch still waiting is released; batches in flight drain (their tasks
        // saw `stop`), then are recorded, all within the drain timeout and a grace. On an
        // error the relay stops the same way.
        if result.is_err() {
            let _ = stopper.send(true);
        }
        if let Some(batch) = ready {
            if result.is_ok() {
                self.start(&mut in_flight, batch, (None, &slots), run, &stop);
            } else {
                // The relay stops on an error: give the waiting batch back untried.
                let outcomes: Vec<Outcome> = batch
                    .ready
                    .iter()
                    .map(|c| Outcome::release(&c.record, c.token))
                    .collect();
                self.record(&outcomes, Instant::now() + RECORD_GRACE, None)
                    .await;
            }
        }
        while let Some(done) = in_flight.join_next().await {
            self.finished(done);
        }
        // Housekeeping only: the record lapses by itself.
        let _ = tokio::time::timeout(Duration::from_millis(200), self.forget(run)).await;
        result
    }

    /// While lingering: returns once a cheap probe sees a due row, or the linger time is over.
    async fn wait_due(&self) {
        let until = Instant::now() + LINGER;
        while Instant::now() < until {
            tokio::time::sleep(LINGER_POLL).await;
            if self.due().await {
                return;
            }
        }
    }

    /// One cheap look for due work; true on an error too, to let the claim report it.
    async fn due(&self) -> bool {
        let looking = async {
            let mut conn = self.inner.pool.get().await?;
            self.inner.outbox.anything_due(&mut conn).await
        };
        looking.await.unwrap_or(true)
    }

    /// [`Relay::due`], giving up (false) once `stop` turns true.
    async fn probe(&self, stop: &watch::Receiver<bool>) -> bool {
        or_stop(stop, self.due()).await.unwrap_or(false)
    }

    /// Publishes a claimed batch and records its outcomes on a task of its own. The
    /// publishing slot is given back as soon as the publishes are over (or stall).
    fn start(
        &self,
        in_flight: &mut JoinSet<()>,
        batch: Batch,
        (permit, slots): (Option<OwnedSemaphorePermit>, &Arc<Semaphore>),
        run: &Run,
        stop: &watch::Receiver<bool>,
    ) {
        let this = self.clone();
        let stop = stop.clone();
        let slot = Slot::new(permit, Some(slots.clone()), run.stalled.clone());
        in_flight.spawn(async move {
            this.run_batch(batch, stop, slot).await;
        });
    }

    /// Reports a batch task that panicked (a bug of the relay: publisher panics are caught
    /// per record). Its rows stay leased: they are claimed again after the lease, and die
    /// if that keeps happening.
    fn finished(&self, done: std::result::Result<(), tokio::task::JoinError>) {
        if let Err(e) = done {
            tracing::error!(table = %self.inner.outbox.table(), error = %e, "publishing a batch panicked");
        }
    }

    /// Runs one cycle (claim, publish, record) and returns how many rows it claimed.
    /// Needs no LISTEN connection and starts no janitor.
    ///
    /// # Errors
    /// A database or pool error, or [`Error::NotMigrated`].
    pub async fn run_once(&self) -> Result<usize> {
        let batch = self.claim(None).await?;
        let claimed = batch.claimed();
        if claimed > 0 {
            let (_keep, never) = watch::channel(false);
            let slot = Slot::new(None, None, Arc::new(AtomicUsize::new(0)));
            self.run_batch(batch, never, slot).await;
        }
        Ok(claimed)
    }

    /// Claims up to `batch_size` due rows (none once `stop` is true: a claim that has not
    /// answered by then is given up, and what it may have claimed waits for its lease).
    async fn claim(&self, stop: Option<&watch::Receiver<bool>>) -> Result<Batch> {
        let inner = &self.inner;
        let started = Instant::now();
        let claiming = async {
            let mut conn = inner.pool.get().await?;
            inner.outbox.claim(&mut conn, &inner.options).await
        };
        let batch = match stop {
            None => claiming.await?,
            Some(stop) => match or_stop(stop, claiming).await {
                Some(batch) => batch?,
                None => Batch::default(),
            },
        };
        let claimed = batch.claimed();
        if claimed > 0 {
            inner.metrics.claimed(claimed);
            tracing::debug!(table = %inner.outbox.table(), claimed, took = ?started.elapsed(), "claimed");
        }
        Ok(batch)
    }

    /// Records outcomes, retrying until `by`, or until [`RECORD_GRACE`] after `stop` turns
    /// true: a row whose outcome is lost stays leased until its lease ends and is then
    /// published again.
    pub(super) async fn record(
        &self,
        outcomes: &[Outcome],
        by: Instant,
        stop: Option<watch::Receiver<bool>>,
    ) {
        if outcomes.is_empty() {
            return;
        }
        let inner = &self.inner;
        let started = Instant::now();
        let attempts = async {
            let mut delay = Duration::from_millis(50);
            let mut attempt = 0u32;
            loop {
                attempt += 1;
                let result = async {
                    let mut conn = inner.pool.get().await?;
                    inner.outbox.record_outcomes(&mut conn, outcomes).await
                }
                .await;
                match result {
                    Ok(fenced) => return Ok(fenced),
                    Err(e) => {
                        tracing::warn!(table = %inner.outbox.table(), error = %e, attempt, "recording outcomes failed; retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                }
            }
        };
        let shutdown = async {
            match stop {
                Some(mut stop) => {
                    until_stopped(&mut stop).await;
                    tokio::time::sleep(RECORD_GRACE).await;
                }
                None => std::future::pending().await,
            }
        };
        let bounded = async {
            tokio::select! {
                recorded = tokio::time::timeout_at(by, attempts) => recorded.ok(),
                () = shutdown => None,
            }
        };
        match bounded.await {
            Some(Ok::<usize, Error>(fenced)) => {
                tracing::debug!(table = %inner.outbox.table(), outcomes = outcomes.len(), took = ?started.elapsed(), "recorded");
                if fenced > 0 {
                    tracing::warn!(
                        table = %inner.outbox.table(), fenced,
                        "outcomes discarded: another relay took these rows over after our lease ended"
                    );
                    inner.metrics.fenced(fenced);
                }
            }
            Some(Err(_)) | None => {
                tracing::error!(
                    table = %inner.outbox.table(), rows = outcomes.len(),
                    "recording outcomes failed; the rows will be published again after their lease"
                );
            }
        }
    }
}
