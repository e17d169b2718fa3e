//! The seam between the relay loop and its table: what the loop and its batches ask of
//! the engine that keeps the table ([`Engine`](crate::Engine)), and nothing of how.
//!
//! Its moves: *take* work ([`Store::take`]: a batch of records to publish), *finish* it
//! (each record's outcome through [`Store::record`], or all of a part at once through the
//! batch's [`Finish`]), *give back* what is taken when a run ends ([`Batch::untried`] for a
//! batch never started, [`Store::leave`] for what the engine holds for the run), and
//! *report* ([`Store::due`], [`Store::stats`], and the run's presence in `<table>_relays`).
//!
//! Two engines implement it: the per-row engine (`per_row.rs`), which leases each claimed
//! row and records each outcome on it, and the log engine (`log/`), which reads pages of
//! the log in commit order, finishes each with one write of its cursor, and hands the rare
//! failed or delayed message to the per-row engine it runs beside. The loop's own unit
//! tests (`run.rs`) drive it on a table in memory.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;
use tokio::time::Instant;

use super::held::Hold;
use super::options::Options;
use super::outcome::{Claimed, Outcome};
use crate::connect::PgPool;
use crate::error::{Error, Result};
use crate::ops::Stats;
use crate::publisher::Record;

/// What the relay needs of its table, whichever engine keeps it.
pub(crate) trait Store: Send + Sync + 'static {
    /// Takes up to `batch_size` messages to publish, leaving the `held` rows (those this
    /// relay's own batches still hold, see `relay::held`) alone.
    fn take<'a>(&'a self, options: &'a Options, held: Vec<i64>) -> BoxFuture<'a, Result<Batch>>;
    /// Records outcomes of records the batch's [`Finish`] does not hold, each fenced by
    /// its token; returns how many were fenced off (another relay holds a newer claim).
    fn record<'a>(&'a self, outcomes: &'a [Outcome]) -> BoxFuture<'a, Result<usize>>;
    /// A cheap look: whether a take may find work now.
    fn due(&self) -> BoxFuture<'_, Result<bool>>;
    /// A run (of the relay or of one of its clones) begins to take work.
    fn join(&self) {}
    /// A run that [joined](Store::join) is over, every batch of it too: once no run of
    /// the relay is left, what the engine holds for them (the log's cursor) goes back.
    fn leave(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Whether the engine holds something for the relay that a [heartbeat](Store::heartbeat)
    /// must keep (the log's cursor).
    fn beats(&self) -> bool {
        false
    }
    /// Keeps what the engine holds for the relay (renews the log cursor's lease, or takes
    /// it when it is free), every [`Options::heartbeat`] while a run goes on.
    fn heartbeat<'a>(&'a self, _options: &'a Options) -> BoxFuture<'a, Result<Beat>> {
        Box::pin(async { Ok(Beat::Off) })
    }
    /// The table's gauges, for the metrics.
    fn stats(&self) -> BoxFuture<'_, Result<Stats>>;
    /// Upserts this run's record in `<table>_relays`.
    fn set_state<'a>(
        &'a self,
        relay_id: &'a str,
        idle: bool,
        ttl: Duration,
        blocked_for: Option<Duration>,
    ) -> BoxFuture<'a, Result<()>>;
    /// Removes this run's record (and every expired one).
    fn forget<'a>(&'a self, relay_id: &'a str) -> BoxFuture<'a, Result<()>>;
    /// The pool, for what keeps connections of its own (the LISTEN connection, the
    /// janitor); `None` for a store without a database.
    fn pool(&self) -> Option<&PgPool>;
}

/// What a [heartbeat](Store::heartbeat) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Beat {
    /// Nothing to keep (no cursor: the table is on the per-row engine).
    Off,
    /// The relay held it, and renewed it.
    Held,
    /// The relay took it (or found it elsewhere than it left it): the loop should look
    /// for work now.
    Took,
    /// Another relay holds it.
    Waiting(Holder),
}

/// The relay that holds the log's cursor, as a standby sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    /// Its name (host, process id and a random part).
    pub(crate) name: String,
    /// How long its lease has left unless it renews it.
    pub(crate) lease_left: Duration,
}

/// What one take returned.
#[derive(Debug)]
pub(crate) struct Batch {
    /// Taken just before the take ran: the leases end no earlier than `lease` after this.
    pub(crate) claimed_at: Instant,
    /// Records to publish, in id order.
    pub(crate) ready: Vec<Claimed>,
    /// Rows the take itself turned dead: claimed too often without an outcome.
    pub(crate) crash_looped: Vec<Record>,
    /// Rows that cannot be turned into a record; they die on their own.
    pub(crate) undecodable: Vec<(Record, Outcome)>,
    /// Keeps the relay's own claims off these rows until their outcomes are recorded.
    pub(crate) hold: Option<Hold>,
    /// The part of the batch whose outcomes are settled together when the batch is over
    /// (a page of the log); its rows are among `ready` and `undecodable`. Dropped
    /// unfinished, it is given back.
    pub(crate) finish: Option<Box<dyn Finish>>,
    /// Part of the take failed once the rest was taken (the log could not be read after
    /// the per-row claim): the relay reports it, and the rest goes out.
    pub(crate) trouble: Option<Error>,
}

impl Default for Batch {
    fn default() -> Self {
        Batch {
            claimed_at: Instant::now(),
            ready: Vec::new(),
            crash_looped: Vec::new(),
            undecodable: Vec::new(),
            hold: None,
            finish: None,
            trouble: None,
        }
    }
}

impl Batch {
    /// How many rows the take took, settled ones included.
    pub(crate) fn claimed(&self) -> usize {
        self.ready.len()
            + self.crash_looped.len()
            + self.undecodable.len()
            + self.finish.as_ref().map_or(0, |f| f.settled())
    }

    /// The rows whose outcomes are still to be recorded.
    pub(crate) fn unrecorded(&self) -> Vec<i64> {
        let ready = self.ready.iter().map(|c| c.record.id);
        ready
            .chain(self.undecodable.iter().map(|(r, _)| r.id))
            .collect()
    }

    /// For a batch given back without a publish: the release of each record whose outcome
    /// is recorded on its own (its attempt given back). What the [`Finish`] holds is given
    /// back when the batch drops.
    pub(crate) fn untried(&self) -> Vec<Outcome> {
        self.ready
            .iter()
            .filter(|c| !self.finish.as_ref().is_some_and(|f| f.holds(c.record.id)))
            .map(|c| Outcome::release(&c.record, c.token))
            .collect()
    }
}

/// Until when a lease that a heartbeat renews holds, as the relay knows it at each call
/// (`None`: the relay holds it no more).
pub(crate) type LeaseEnd = Arc<dyn Fn() -> Option<Instant> + Send + Sync>;

/// The part of a batch whose outcomes are settled together once the batch is over: a page
/// of the log, which moves its cursor past the page in one write.
pub(crate) trait Finish: Send + fmt::Debug {
    /// Whether the outcome of row `id` is this part's to settle.
    fn holds(&self, id: i64) -> bool;
    /// The end of the lease the part is published under, when it is not its rows' own (a
    /// page of the log: the cursor's). No publish of the batch starts near it, and those
    /// under way are cut off when it comes: past it another relay may publish the same
    /// messages.
    fn lease_end(&self) -> Option<LeaseEnd>;
    /// Rows it settled itself, without a publish (counted among the claimed).
    fn settled(&self) -> usize;
    /// Settles the part with the outcomes of its records (those known: a record without
    /// one was never published). Returns how many outcomes were fenced off because
    /// another relay took the part over.
    fn finish(self: Box<Self>, outcomes: Vec<Outcome>, end: End) -> BoxFuture<'static, usize>;
}

/// How a batch ended, for its [`Finish`].
#[derive(Debug, Clone)]
pub(crate) struct End {
    /// The broker was out of reach: what was not published is no message's fault.
    pub(crate) outage: bool,
    /// Settling keeps trying until then.
    pub(crate) by: Instant,
    /// Shutdown cuts settling short.
    pub(crate) stop: watch::Receiver<bool>,
}
