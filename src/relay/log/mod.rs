//! The log engine ([`Engine::Log`](crate::Engine::Log)): relays read committed rows in
//! commit order through snapshots, page by page, and finish each page with one
//! compare-and-set of the table's cursor; the rare failed or delayed message (and its
//! aggregate's later ones) is handed to the per-row engine, which runs beside it in the
//! same relay. ARCHITECTURE.md gives the protocol and why each invariant holds.
//!
//! Its parts:
//! - `statements.rs`: its statements, and [`PgLog`], which runs them on the pool;
//! - `cursor.rs`: what the relay knows of the cursor (its lease, the tick, the read
//!   position, the pages in flight), a value whose every decision is one call;
//! - `page.rs`: reading the next page, step by step;
//! - `finish.rs`: a page in its batch, and its finish;
//! - `lease.rs`: the heartbeat that keeps the cursor's lease, and a standby's wait for it.
//!
//! One relay holds the cursor at a time: its lease (the cursor lease, 5 s by default) is
//! renewed by a heartbeat apart from the pages, so a relay that dies loses it within a
//! lease and a standby takes over. Pages of one
//! tick are pipelined like per-row batches: each is read after the one before it, and
//! finished after the one before it finished, so the relay's finishes only move the cursor
//! forward, and only past pages whose every message was confirmed or handed over. A tick
//! is opened only once every page of the one before is finished. Where the database's
//! cursor is not where the relay left it, the relay reads on from the database's.

mod cursor;
mod finish;
mod lease;
mod page;
mod statements;
#[cfg(test)]
mod tests;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

use self::cursor::{Cursor, Look};
pub(crate) use self::statements::LogStatements;
use self::statements::{Advanced, CursorRow, Guard, HolderRow, Opened, PageRow, PgLog};
use super::options::Options;
use super::outcome::Outcome;
use super::per_row::PerRow;
use super::store::{Batch, Beat, Store};
use crate::connect::PgPool;
use crate::error::Result;
use crate::ops::Stats;

/// The log's side of the table, as the engine uses it: [`PgLog`] runs its statements on
/// the pool; the engine's unit tests script one in memory.
pub(crate) trait LogTable: Send + Sync + 'static {
    /// Takes the cursor's lease for `owner` (expired, given back, or already `owner`'s),
    /// or renews it: the cursor row, or `None` when the table has no cursor or another
    /// relay holds it.
    fn take<'a>(
        &'a self,
        owner: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<CursorRow>>>;
    /// Opens the tick after `at`'s, if the cursor is still `at` (done with its tick,
    /// under its token) and anything committed since; else the cursor as it is.
    fn open_tick<'a>(&'a self, at: &'a CursorRow, lease: Duration)
    -> BoxFuture<'a, Result<Opened>>;
    /// Up to `limit` rows of `at`'s tick after id `from`, in id order, cut at `max_bytes`
    /// (always one row), reading in proportion to them whatever the tick spans.
    fn read_page<'a>(
        &'a self,
        at: &'a CursorRow,
        from: i64,
        limit: usize,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<PageRow>>>;
    /// Those of `keys` that are aggregates with rows on the per-row side, other than the
    /// rows `besides`.
    fn pending_aggregates<'a>(
        &'a self,
        keys: Vec<String>,
        besides: Vec<i64>,
    ) -> BoxFuture<'a, Result<HashSet<String>>>;
    /// Moves the cursor from `guard` to `to` (with `page_attempts`, renewing the lease)
    /// and hands `hand_over` to the per-row side, in one transaction, committed
    /// synchronously; nothing is written when the guard matches no row.
    fn advance<'a>(
        &'a self,
        guard: Guard,
        to: i64,
        page_attempts: i32,
        hand_over: &'a [Outcome],
        lease: Duration,
    ) -> BoxFuture<'a, Result<Advanced>>;
    /// Whether anything committed since the snapshot `hi`.
    fn committed<'a>(&'a self, hi: &'a str) -> BoxFuture<'a, Result<bool>>;
    /// Gives the lease back (`owner`'s, under `token`), committed synchronously.
    fn give_back<'a>(&'a self, owner: &'a str, token: i64) -> BoxFuture<'a, Result<()>>;
    /// Who holds the cursor's lease and how long it has left (`None`: the table has no
    /// cursor).
    fn holder(&self) -> BoxFuture<'_, Result<Option<HolderRow>>>;
}

/// The log's state of one relay, shared by its batches.
pub(crate) struct Log {
    table: Arc<dyn LogTable>,
    /// The outbox table's name, for the logs.
    name: String,
    owner: String,
    cursor: Mutex<Cursor>,
    /// Serialises page reads (a relay's clones running at once share one `Log`).
    reader: tokio::sync::Mutex<()>,
    /// Runs of the relay (and its clones) under way: the last to end gives the cursor back.
    runs: std::sync::atomic::AtomicUsize,
    /// Signals every finish.
    finished: watch::Sender<()>,
    /// When a take next claims on the per-row side (see [`PerRowLooks`]).
    per_row: Mutex<PerRowLooks>,
    /// Held by a heartbeat's take and by the give-back, so that a take under way cannot
    /// take the cursor again once it was given back.
    beat: tokio::sync::Mutex<()>,
    /// The holder this relay last said it stands by for, so that it says so once.
    standing_by: Mutex<Option<String>>,
}

/// When the per-row side beside the log is worth a claim, for the relay that reads the
/// log. Most of the time it holds nothing, and a claim each take would double a steady
/// stream's round trips; rows come
/// to it from a hand-over (this relay's own: it claims once they are due), a redrive, a
/// relay that crashed with rows leased, or a table moved from the per-row engine, which a
/// claim each poll interval (and at the start of each run) finds.
#[derive(Debug, Clone, Copy)]
struct PerRowLooks {
    next: Instant,
}

impl PerRowLooks {
    fn due(&self, now: Instant) -> bool {
        self.next <= now
    }

    /// A claim at `now` took `found` rows: while it finds some, the next take claims
    /// again; else the next after `poll`.
    fn found(&mut self, now: Instant, found: usize, poll: Duration) {
        self.next = if found > 0 { now } else { now + poll };
    }

    /// Rows were handed over, the first due at `at`.
    fn handed(&mut self, at: Instant) {
        self.next = self.next.min(at);
    }
}

impl std::fmt::Debug for Log {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Log").field("owner", &self.owner).finish()
    }
}

impl Log {
    pub(crate) fn new(table: Arc<dyn LogTable>, name: String, owner: String) -> Arc<Self> {
        Arc::new(Log {
            table,
            name,
            owner,
            cursor: Mutex::new(Cursor::default()),
            reader: tokio::sync::Mutex::new(()),
            runs: std::sync::atomic::AtomicUsize::new(0),
            finished: watch::Sender::new(()),
            per_row: Mutex::new(PerRowLooks {
                next: Instant::now(),
            }),
            beat: tokio::sync::Mutex::new(()),
            standing_by: Mutex::new(None),
        })
    }

    fn per_row(&self) -> std::sync::MutexGuard<'_, PerRowLooks> {
        self.per_row.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rows this relay handed to the per-row side: the first is due at `at`.
    fn handed(&self, at: Instant) {
        self.per_row().handed(at);
    }

    fn cursor(&self) -> std::sync::MutexGuard<'_, Cursor> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.cursor.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes the cursor and wakes whoever waits on a page's finish.
    fn finished<T>(&self, change: impl FnOnce(&mut Cursor) -> T) -> T {
        let out = change(&mut self.cursor());
        self.finished.send_replace(());
        out
    }

    /// Waits until `ready` holds of the cursor (checked after every finish).
    async fn wait_until(&self, ready: impl Fn(&Cursor) -> bool) {
        let mut changes = self.finished.subscribe();
        loop {
            if ready(&self.cursor()) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }

    /// Whether the log may have work: pages of the open tick left, or commits since it.
    pub(crate) async fn has_work(&self) -> Result<bool> {
        let look = self.cursor().look(Instant::now());
        match look {
            Look::Yes => Ok(true),
            Look::No => Ok(false),
            Look::Committed(hi) => self.table.committed(&hi).await,
        }
    }

    /// A run begins: its first take claims on the per-row side too.
    pub(crate) fn join(&self) {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.handed(Instant::now());
    }

    /// A run ended: the last one gives the cursor's lease back, so another relay takes
    /// over at once. A run that ends while a clone's run goes on leaves the cursor to it:
    /// the clone's pages in flight stay good.
    pub(crate) async fn leave(&self) {
        let was = self
            .runs
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |n| Some(n.saturating_sub(1)),
            )
            .unwrap_or(0);
        if was <= 1 {
            self.give_back().await;
        }
    }

    /// Gives the cursor's lease back.
    async fn give_back(&self) {
        let _beat = self.beat.lock().await;
        let Some(token) = self.cursor().token() else {
            return;
        };
        if self.table.give_back(&self.owner, token).await.is_ok() {
            self.cursor().lose();
        }
    }
}

/// A relay's engine on a table: the per-row engine for what is pending (handed over, or
/// left from the per-row engine), and the log beside it when the table has a cursor.
pub(crate) struct LogEngine {
    per_row: PerRow,
    log: Arc<Log>,
}

impl LogEngine {
    pub(crate) fn new(per_row: PerRow, owner: String) -> Self {
        let log = Log::new(
            Arc::new(PgLog {
                outbox: per_row.outbox.clone(),
                pool: per_row.pool.clone(),
            }),
            per_row.outbox.table().to_owned(),
            owner,
        );
        LogEngine { per_row, log }
    }
}

impl Store for LogEngine {
    /// The per-row side's claim (when it is worth one, see [`PerRowLooks`]), then a page
    /// of the log in the room it left.
    fn take<'a>(&'a self, options: &'a Options, held: Vec<i64>) -> BoxFuture<'a, Result<Batch>> {
        Box::pin(async move {
            let now = Instant::now();
            // Off the log (a table on the per-row engine, or another relay holds the
            // cursor), the per-row side is all there is: claim on it each take.
            let reading = self.log.cursor().token().is_some();
            let mut batch = if !reading || self.log.per_row().due(now) {
                let batch = self.per_row.take(options, held).await?;
                self.log
                    .per_row()
                    .found(now, batch.claimed(), options.poll_interval);
                batch
            } else {
                Batch::default()
            };
            let room = options.batch_size.saturating_sub(batch.claimed());
            if room == 0 {
                return Ok(batch);
            }
            // The per-row rows of this batch go out first, so the page's messages of
            // their aggregates may follow them in the same batch (see `Log::sort`).
            match self.log.next_page(options, room, batch.unrecorded()).await {
                Ok(Some(read)) => {
                    batch.ready.extend(read.ready);
                    batch.ready.sort_by_key(|c| c.record.id);
                    batch.undecodable.extend(read.undecodable);
                    batch.finish = Some(Box::new(read.page));
                }
                Ok(None) => {}
                // What the per-row side claimed goes out all the same: dropped, its rows
                // would stay leased with an attempt spent.
                Err(e) if batch.claimed() > 0 => batch.trouble = Some(e),
                Err(e) => return Err(e),
            }
            Ok(batch)
        })
    }

    fn record<'a>(&'a self, outcomes: &'a [Outcome]) -> BoxFuture<'a, Result<usize>> {
        self.per_row.record(outcomes)
    }

    fn due(&self) -> BoxFuture<'_, Result<bool>> {
        Box::pin(async move { Ok(self.per_row.due().await? || self.log.has_work().await?) })
    }

    fn beats(&self) -> bool {
        true
    }

    fn heartbeat<'a>(&'a self, options: &'a Options) -> BoxFuture<'a, Result<Beat>> {
        Box::pin(self.log.keep(options))
    }

    fn join(&self) {
        self.log.join();
    }

    fn leave(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.log.leave())
    }

    fn stats(&self) -> BoxFuture<'_, Result<Stats>> {
        self.per_row.stats()
    }

    fn set_state<'a>(
        &'a self,
        relay_id: &'a str,
        idle: bool,
        ttl: Duration,
        blocked_for: Option<Duration>,
    ) -> BoxFuture<'a, Result<()>> {
        self.per_row.set_state(relay_id, idle, ttl, blocked_for)
    }

    fn forget<'a>(&'a self, relay_id: &'a str) -> BoxFuture<'a, Result<()>> {
        self.per_row.forget(relay_id)
    }

    fn pool(&self) -> Option<&PgPool> {
        self.per_row.pool()
    }
}
