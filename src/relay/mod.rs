//! The relay: its public handle and builder. The machinery is in the submodules, the loop in
//! `run`; ARCHITECTURE.md says which does what.

mod gauges;
mod heartbeat;
mod held;
mod janitor;
mod limits;
pub(crate) mod listener;
pub(crate) mod log;
mod options;
mod outage;
mod outcome;
mod pace;
pub(crate) mod per_row;
pub(crate) mod presence;
mod publish;
mod run;
mod store;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::connect::PgPool;
use tokio::sync::watch;

use crate::error::Result;
use crate::health::{Health, Vitals};
use crate::metrics::{Metrics, NoMetrics};
use crate::outbox::Outbox;
use crate::publisher::Publisher;

use self::held::Held;
use self::log::LogEngine;
use self::options::Options;
use self::outage::Outage;
use self::per_row::PerRow;
use self::publish::Slot;
use self::store::Store;

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

    /// How long the log's cursor stays this relay's without a renewal, on a table on the
    /// log engine (100 ms to 1 day): a heartbeat renews it every fifth of it, apart from
    /// the relay's work. A relay killed while it holds the cursor stalls the table's log
    /// for at most this long (plus a heartbeat) before a standby relay takes over. A
    /// relay cut off from the database for longer loses the cursor: the relay that takes
    /// it over reads the pages it had in flight again, so what both published reaches the
    /// broker twice (consumers dedupe it). Defaults to 5 s, or the lease if that is
    /// shorter.
    pub fn cursor_lease(mut self, lease: Duration) -> Self {
        self.options.cursor_lease = lease;
        self.options.cursor_lease_set = true;
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
    /// 10 s, or half the lease when that is shorter.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.options.drain_timeout = timeout;
        self.options.drain_timeout_set = true;
        self
    }

    /// Do not LISTEN for wake-ups: find work by polling only. Use it where the pool cannot
    /// give the relay a session of its own, which LISTEN needs. Defaults to listening on a
    /// dedicated connection.
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
    /// On the log engine a row of the log counts from its enqueue (see
    /// [`Outbox::purge_sent`]). Defaults to 7 days.
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
    /// confirm timeout) and the `drain_timeout` must each be at most half the lease. Those
    /// the user left at their defaults are lowered to fit (see
    /// [`Publisher::fit_timeout`]); only a value set explicitly that does not fit is an
    /// error.
    ///
    /// # Errors
    /// [`Error::InvalidOption`](crate::Error::InvalidOption) naming the option and its valid range.
    pub fn build(self) -> Result<Relay<P>> {
        let per_row = PerRow {
            outbox: self.outbox.clone(),
            pool: self.pool.clone(),
        };
        let store = Arc::new(LogEngine::new(per_row, holder_name()));
        self.build_on(store)
    }

    /// [`RelayBuilder::build`] on another store than the pool's (the relay's unit tests use
    /// one in memory).
    fn build_on(mut self, store: Arc<dyn Store>) -> Result<Relay<P>> {
        self.options.fit_to_lease();
        self.publisher.fit_timeout(self.options.publish_bound());
        self.options.validate(self.publisher.timeout())?;
        // The loop turns at least every poll interval when idle; busy, it may wait for a
        // batch as long as that batch's recording may take.
        let vitals = Arc::new(Vitals::new(
            2 * self.options.lease + self.options.poll_interval,
        ));
        Ok(Relay {
            inner: Arc::new(RelayShared {
                outbox: self.outbox,
                store,
                publisher: self.publisher,
                options: self.options,
                metrics: self.metrics,
                outage: Outage::default(),
                vitals,
                held: Arc::default(),
                listening: Arc::new(AtomicUsize::new(0)),
                take_trouble: std::sync::Mutex::default(),
            }),
        })
    }
}

/// Ships committed outbox rows to a [`Publisher`], at least once.
///
/// Cheap to clone: clones share the configuration, the publisher and the metrics. Each call
/// of [`Relay::run_until`] is a relay of its own (its own id, LISTEN connection and row
/// leases), so running two clones at once gives two relays; on the log engine they share
/// this relay's hold on the log's cursor, and the last of them to stop gives it back. Run
/// one or many relays (in one process or many) on the same table; leases and fencing keep
/// them from publishing a row twice except after a lease expiry or a crash.
pub struct Relay<P> {
    inner: Arc<RelayShared<P>>,
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

struct RelayShared<P> {
    outbox: Outbox,
    store: Arc<dyn Store>,
    publisher: P,
    options: Options,
    metrics: Arc<dyn Metrics>,
    /// Whether the broker is reachable; shared by every run, as the publisher is.
    outage: Outage,
    /// The rows this relay's batches hold until their outcomes are recorded.
    held: Arc<Held>,
    /// What [`Relay::health`] reports.
    vitals: Arc<Vitals>,
    /// Runs holding their LISTEN connection.
    listening: Arc<AtomicUsize>,
    /// Takes that claimed on the per-row side but could not read the log, in a row.
    take_trouble: std::sync::Mutex<crate::streak::Streak>,
}

impl<P> Relay<P> {
    /// True while a run of this relay holds its LISTEN connection (so a commit wakes it at
    /// once).
    pub fn listening(&self) -> bool {
        self.inner.listening.load(Ordering::SeqCst) > 0
    }

    /// Whether the relay is live (a run of it is going, and its loop has turned within
    /// twice the lease and a poll interval) and ready (its last look at the database
    /// succeeded, and the broker is not out of reach), with the reasons when it is not:
    /// what a container's liveness and readiness probes want. `diesel-outbox relay` serves
    /// it at `/livez` and `/readyz`.
    pub fn health(&self) -> Health {
        self.inner
            .vitals
            .health("the relay", self.inner.outage.down())
    }

    /// The most rows one run of this relay holds claimed at once, whatever it is doing
    /// with them (publishing, waiting on a slow publish, recording, or waiting for a
    /// publishing slot): a bound on what a crash of the relay can publish twice.
    pub fn max_claimed_rows(&self) -> usize {
        self.inner.options.batch_size * limits::MAX_BATCHES
    }
}

impl<P: Publisher> Relay<P> {
    /// Runs until `shutdown` completes, then drains and returns.
    ///
    /// After `shutdown` the relay claims nothing more. Publishes under way get the
    /// `drain_timeout` and their outcomes are recorded; claimed records not yet started,
    /// and publishes cut off by the timeout, are released at once with their attempt
    /// restored. A claim the database is making when `shutdown` completes is awaited (for
    /// at most the drain timeout) and its rows released too; only one the database does
    /// not answer within the drain timeout is given up, and what it claimed waits for its
    /// lease. It returns within the drain timeout and about a second more, whether or
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
    /// [`Error::NotMigrated`](crate::Error::NotMigrated) when the table does not exist.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        self.run_until_shutdown(shutdown).await
    }

    /// Runs one cycle (claim, publish, record) and returns how many rows it claimed.
    /// Needs no LISTEN connection and starts no janitor. On the log engine it holds the
    /// log's cursor for the cycle only and gives it back at the end, as a run gives it back
    /// at shutdown, so any relay may run the next cycle (unless a clone of this relay is
    /// running: the cursor stays with it).
    ///
    /// # Errors
    /// A database or pool error, or [`Error::NotMigrated`](crate::Error::NotMigrated).
    pub async fn run_once(&self) -> Result<usize> {
        self.inner.store.join();
        let claimed = self.one_cycle().await;
        self.inner.store.leave().await;
        claimed
    }

    async fn one_cycle(&self) -> Result<usize> {
        let batch = self.claim(None).await?;
        let claimed = batch.claimed();
        if claimed > 0 {
            let (_keep, never) = watch::channel(false);
            let slot = Slot::new(None, None, Arc::new(AtomicUsize::new(0)));
            self.run_batch(batch, never, slot).await;
        }
        Ok(claimed)
    }
}

/// This relay's name as the holder of a log cursor's lease: its host, its process and a
/// random part (relays of one process differ in that).
fn holder_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".to_owned());
    let random = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}:{}:{}", std::process::id(), &random[..8])
}
