//! Publishing a claimed batch: in waves that keep each aggregate's order, each publish
//! within its deadline, with shutdown draining, and every outcome recorded as soon as it
//! need not wait for a slow neighbour.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::stream::{self, BoxStream};
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Relay;
use super::limits::{MAX_STALLED, RECORD_GRACE};
use super::outcome::{Claimed, Outcome};
use super::store::{Batch, End, Finish, LeaseEnd};
use crate::error::Error;
use crate::publisher::{BatchResults, PublishError, Publisher, Record};
use crate::shutdown::{retry_until, until_stopped};
use tracing::Instrument;

/// A batch whose wave has run this long with nothing left to start is stalled: it gives its
/// publishing slot back and records what it knows at once (at most an eighth of the lease).
pub(super) const STALL: Duration = Duration::from_secs(1);

/// The result of one record's publish; `None` when it was never started or was cut off.
type Published = Option<(Result<(), PublishError>, Duration)>;

/// The records of a wave, their fencing tokens, and which of them have an outcome.
struct Open<'a> {
    records: &'a [Record],
    tokens: &'a [i64],
    settled: Vec<bool>,
}

/// The leases a batch is published under: its rows' own, taken at `claimed_at`, and for a
/// page of the log the cursor's, which a heartbeat renews while the batch publishes.
#[derive(Clone)]
struct Leases {
    claimed_at: Instant,
    cursor: Option<LeaseEnd>,
}

/// What a wave's one-by-one publishes look at before each starts.
struct Started<'a> {
    stop: watch::Receiver<bool>,
    leases: Leases,
    /// Records whose turn has come (started, or skipped).
    begun: &'a AtomicUsize,
    /// Set once a publish of this wave found the broker unavailable.
    unavailable: &'a AtomicBool,
}

/// A pipelined batch's results, each with the time since the wave began; a panic in the
/// stream becomes one item with index `usize::MAX`.
fn all_results<'a>(
    pipelined: BatchResults<'a>,
    wave_start: Instant,
) -> BoxStream<'a, (usize, Published)> {
    AssertUnwindSafe(pipelined)
        .catch_unwind()
        .map(move |item| match item {
            Ok((i, r)) => (i, Some((r, wave_start.elapsed()))),
            Err(_) => (usize::MAX, None),
        })
        .boxed()
}

/// A batch's place in the relay's pipeline.
pub(super) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    /// Where a stalled batch takes a slot again before it starts another wave.
    slots: Option<Arc<Semaphore>>,
    stalled: Arc<AtomicUsize>,
    counted: bool,
}

impl Slot {
    pub(super) fn new(
        permit: Option<OwnedSemaphorePermit>,
        slots: Option<Arc<Semaphore>>,
        stalled: Arc<AtomicUsize>,
    ) -> Self {
        Slot {
            permit,
            slots,
            stalled,
            counted: false,
        }
    }

    /// The batch waits only on slow publishes: let the relay start others meanwhile (unless
    /// [`MAX_STALLED`] batches already wait so; then it keeps its slot).
    fn stall(&mut self) {
        if self.permit.is_none() {
            return;
        }
        let counted = self
            .stalled
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_STALLED).then_some(n + 1)
            })
            .is_ok();
        if counted {
            self.permit = None;
            self.counted = true;
        }
    }

    /// Whether the batch holds a slot it could give back.
    fn holds(&self) -> bool {
        self.permit.is_some()
    }

    /// Before a new wave: a batch that stalled takes a slot again, so stalled batches do
    /// not publish beside a full pipeline. Known outcomes are recorded while it waits, and
    /// it gives up (false) once `late` says the wave may no longer start.
    async fn regain<P: Publisher>(
        &mut self,
        outcomes: &mut Outcomes<P>,
        late: impl Fn() -> bool,
    ) -> bool {
        if !self.counted {
            return true;
        }
        let Some(slots) = self.slots.clone() else {
            return true;
        };
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let acquire = slots.acquire_owned();
        tokio::pin!(acquire);
        let regained = loop {
            tokio::select! {
                permit = &mut acquire => break permit.ok(),
                _ = tick.tick() => {
                    outcomes.flush_if_idle();
                    if late() {
                        break None;
                    }
                }
            }
        };
        let Some(permit) = regained else {
            return false;
        };
        self.permit = Some(permit);
        self.stalled.fetch_sub(1, Ordering::SeqCst);
        self.counted = false;
        true
    }

    /// Publishing is over.
    fn release(&mut self) {
        self.permit = None;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.counted {
            self.stalled.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Shutdown state across the waves of one batch.
struct Drain {
    /// True once shutdown was asked for: records not yet started stay unstarted.
    stop: watch::Receiver<bool>,
    /// When publishes still under way are cut off.
    deadline: Option<Instant>,
}

impl Drain {
    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }
}

/// A batch's outcomes, recorded at the end of the batch or, once it has stalled, as they
/// come: one record statement at a time on a task of its own (so publishing goes on
/// meanwhile), taking everything known by then.
struct Outcomes<P> {
    relay: Relay<P>,
    pending: Vec<Outcome>,
    /// The part of the batch settled all at once when the batch is over (a page of the
    /// log), and the outcomes of its records.
    finish: Option<Box<dyn Finish>>,
    kept: Vec<Outcome>,
    flushing: Option<JoinHandle<()>>,
    stalled: bool,
    /// Recording keeps trying until then: a lease after the leases end (a late outcome
    /// still counts unless another relay took the rows over, when fencing discards it).
    record_by: Instant,
    /// Shutdown cuts recording short (see [`Relay::record`]).
    stop: watch::Receiver<bool>,
}

impl<P: Publisher> Outcomes<P> {
    fn push(&mut self, outcome: Outcome) {
        if self.finish.as_ref().is_some_and(|f| f.holds(outcome.id)) {
            self.kept.push(outcome);
        } else {
            self.pending.push(outcome);
        }
    }

    fn stall(&mut self) {
        self.stalled = true;
        self.flush_if_idle();
    }

    /// Once stalled: starts recording what is pending, unless a record statement of this
    /// batch is still running (what is pending then waits for the next call).
    fn flush_if_idle(&mut self) {
        if !self.stalled || self.pending.is_empty() {
            return;
        }
        if self
            .flushing
            .as_ref()
            .is_some_and(|running| !running.is_finished())
        {
            return;
        }
        let outcomes = std::mem::take(&mut self.pending);
        let relay = self.relay.clone();
        let (by, stop) = (self.record_by, self.stop.clone());
        self.flushing = Some(tokio::spawn(async move {
            relay.record(&outcomes, by, Some(stop)).await;
        }));
    }

    /// Records what is left and waits for a flush still running (recording gives way to
    /// shutdown by itself, see [`Relay::record`]).
    async fn finish(mut self) {
        let outcomes = std::mem::take(&mut self.pending);
        self.relay
            .record(&outcomes, self.record_by, Some(self.stop.clone()))
            .await;
        if let Some(flush) = self.flushing.take() {
            let _ = flush.await;
        }
        if let Some(finish) = self.finish.take() {
            let end = End {
                outage: self.relay.inner.outage.since().is_some(),
                by: self.record_by,
                stop: self.stop.clone(),
            };
            let fenced = finish.finish(std::mem::take(&mut self.kept), end).await;
            if fenced > 0 {
                self.relay.inner.metrics.fenced(fenced);
            }
        }
    }
}

/// What one wave needs to know of its batch.
struct Wave<'a> {
    leases: &'a Leases,
    drain: &'a mut Drain,
    slot: &'a mut Slot,
    /// Aggregates whose run stops here: a message failed, so its successors wait.
    blocked: &'a mut HashSet<String>,
    released: &'a mut usize,
    /// The first publish of this wave that found the broker unavailable.
    unavailable: Option<PublishError>,
}

impl<P: Publisher> Relay<P> {
    /// Records outcomes, retrying until `by` (or for [`RECORD_GRACE`], when `by` has
    /// passed already), or until [`RECORD_GRACE`] after `stop` turns true: a row whose
    /// outcome is lost stays leased until its lease ends and is then published again.
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
        // A batch past its deadline (its relay was paused, say) still gets one try: if no
        // relay took its rows over, its outcomes count; if one did, fencing discards them.
        let recorded = retry_until(
            by,
            RECORD_GRACE,
            stop,
            || inner.store.record(outcomes),
            |e: &Error, attempt| {
                tracing::warn!(table = %inner.outbox.table(), error = %e, attempt, "recording outcomes failed; retrying");
            },
        );
        match recorded.await {
            Some(fenced) => {
                tracing::debug!(table = %inner.outbox.table(), outcomes = outcomes.len(), took = ?started.elapsed(), "recorded");
                if fenced > 0 {
                    tracing::warn!(
                        table = %inner.outbox.table(), fenced,
                        "outcomes discarded: another relay took these rows over after our lease ended"
                    );
                    inner.metrics.fenced(fenced);
                }
            }
            None => {
                tracing::error!(
                    table = %inner.outbox.table(), rows = outcomes.len(),
                    "recording outcomes failed; the rows will be published again after their lease"
                );
            }
        }
    }

    /// Publishes a claimed batch and records its outcomes: dead letters for rows that cannot
    /// be published, and the publish results of the rest.
    pub(super) async fn run_batch(
        &self,
        batch: Batch,
        stop: watch::Receiver<bool>,
        mut slot: Slot,
    ) {
        let inner = &self.inner;
        let table = inner.outbox.table();
        let Batch {
            claimed_at,
            ready,
            crash_looped,
            undecodable,
            hold,
            finish,
            trouble: _,
        } = batch;
        let record_by = claimed_at + 2 * inner.options.lease;
        let leases = Leases {
            claimed_at,
            cursor: finish.as_ref().and_then(|f| f.lease_end()),
        };
        let mut outcomes = Outcomes {
            relay: self.clone(),
            pending: Vec::with_capacity(ready.len() + undecodable.len()),
            finish,
            kept: Vec::new(),
            flushing: None,
            stalled: false,
            record_by,
            stop: stop.clone(),
        };
        for record in &crash_looped {
            tracing::error!(
                table = %table, key = %record.key, topic = %record.topic, attempts = record.attempt,
                "dead letter: claimed again and again without an outcome (relay crashing or hanging on it)"
            );
            inner.metrics.dead_lettered(&record.topic, record.attempt);
        }
        for (record, outcome) in undecodable {
            tracing::error!(
                table = %table, key = %record.key, topic = %record.topic,
                error = outcome.error.as_deref().unwrap_or_default(),
                "dead letter: row cannot be decoded"
            );
            inner.metrics.dead_lettered(&record.topic, record.attempt);
            outcomes.push(outcome);
        }
        let mut drain = Drain {
            stop,
            deadline: None,
        };
        self.publish(ready, &leases, &mut drain, &mut slot, &mut outcomes)
            .await;
        slot.release();
        outcomes.finish().await;
        // Only now may the relay's own claims take these rows again.
        drop(hold);
    }

    /// Publishes in waves: a claim holds at most a run of consecutive messages per
    /// aggregate, so wave `n` holds the `n`-th of each run (and wave 0 everything without an
    /// aggregate). All of a wave may go out at once; a message goes out only after its
    /// predecessor was confirmed, so each aggregate is published one at a time, in order.
    /// After a failure the rest of that aggregate's run is released, untried; while the
    /// broker is unavailable, everything not yet started is.
    async fn publish(
        &self,
        ready: Vec<Claimed>,
        leases: &Leases,
        drain: &mut Drain,
        slot: &mut Slot,
        outcomes: &mut Outcomes<P>,
    ) {
        let inner = &self.inner;
        let started = Instant::now();
        let mut blocked: HashSet<String> = HashSet::new();
        let mut released = 0;
        let count = ready.len();
        for wave in waves(ready) {
            // What is known is recorded before this batch may wait for a slot again.
            outcomes.flush_if_idle();
            let regained =
                drain.stopping() || slot.regain(outcomes, || self.too_late(leases)).await;
            // Later waves wait for earlier ones (and a batch may wait for a publishing slot);
            // once half the lease is gone, or too little of it is left for the publisher's
            // own timeout, the rest is released rather than risk publishing it after another
            // relay took it over.
            let late = !regained || self.too_late(leases);
            // The broker went away while this batch was publishing: keep the rest.
            let unavailable = inner.outage.since().is_some_and(|since| since >= started);
            let (go, held): (Vec<Claimed>, Vec<Claimed>) = wave.into_iter().partition(|c| {
                !drain.stopping()
                    && !late
                    && !unavailable
                    && c.record
                        .aggregate_key
                        .as_ref()
                        .is_none_or(|a| !blocked.contains(a))
            });
            released += held.len();
            for c in &held {
                // A held message holds back the rest of its run.
                if let Some(aggregate) = &c.record.aggregate_key {
                    blocked.insert(aggregate.clone());
                }
                outcomes.push(Outcome::release(&c.record, c.token));
            }
            if go.is_empty() {
                continue;
            }
            let mut wave = Wave {
                leases,
                drain,
                slot,
                blocked: &mut blocked,
                released: &mut released,
                unavailable: None,
            };
            let wave_started = Instant::now();
            self.publish_wave(go, &mut wave, outcomes).await;
            if let Some(err) = wave.unavailable.take() {
                inner.outage.report(
                    inner.outbox.table(),
                    wave_started,
                    &err,
                    &inner.options,
                    &*inner.metrics,
                );
            }
        }
        tracing::debug!(table = %inner.outbox.table(), records = count, took = ?started.elapsed(), "published");
        if released > 0 {
            tracing::info!(table = %inner.outbox.table(), released, "released unpublished claims");
            inner.metrics.released(released);
        }
    }

    /// Whether it is too late to start a publish of a batch under `leases`: half the rows'
    /// lease is gone, or what is left before the deadline ([`Relay::hard_deadline`]) is
    /// shorter than the publisher's own timeout (and a twentieth of the lease to report);
    /// or the cursor's lease, for a page of the log, is no longer held or has less than a
    /// tenth of it left (it is renewed every fifth, so only a relay whose renewals stopped
    /// reaching the database gets there).
    fn too_late(&self, leases: &Leases) -> bool {
        let options = &self.inner.options;
        let lease = options.lease;
        if leases.claimed_at.elapsed() > lease / 2 {
            return true;
        }
        if let Some(cursor) = &leases.cursor
            && cursor().is_none_or(|end| Instant::now() + options.cursor_lease / 10 >= end)
        {
            return true;
        }
        let left = self
            .hard_deadline(leases.claimed_at)
            .saturating_duration_since(Instant::now());
        self.inner
            .publisher
            .timeout()
            .is_some_and(|timeout| left < timeout + lease / 20)
    }

    /// When publishes under `leases` with the deadline `by` are cut off, as known now: at
    /// `by`, or a twentieth of the cursor's lease before it ends (at once, the batch's
    /// claim being past, once the relay no longer holds it). Renewals move it on, so a
    /// wait on it looks again when it comes.
    fn cut_off(&self, leases: &Leases, by: Instant) -> Instant {
        let Some(cursor) = &leases.cursor else {
            return by;
        };
        let margin = self.inner.options.cursor_lease / 20;
        cursor()
            .map_or(leases.claimed_at, |end| {
                end.checked_sub(margin).unwrap_or(end)
            })
            .min(by)
    }

    /// Runs `publish` until it ends or is cut off at [`Relay::cut_off`] of `by`: `None`.
    async fn within<T>(
        &self,
        leases: &Leases,
        by: Instant,
        publish: impl std::future::Future<Output = T>,
    ) -> Option<T> {
        tokio::pin!(publish);
        loop {
            let cut = self.cut_off(leases, by);
            if let Ok(out) = tokio::time::timeout_at(cut, &mut publish).await {
                return Some(out);
            }
            if Instant::now() >= self.cut_off(leases, by) {
                return None;
            }
        }
    }

    /// No publish of a batch claimed at `claimed_at` may run past this: a tenth of the lease
    /// before it ends, so its outcome is recorded while the lease holds.
    fn hard_deadline(&self, claimed_at: Instant) -> Instant {
        let lease = self.inner.options.lease;
        claimed_at + lease - lease / 10
    }

    /// Publishes one wave (pipelined, or one by one up to `concurrency`), each publish
    /// within its deadline, a panicking publish failing only its own record. Honours
    /// shutdown: unstarted records stay unstarted, and publishes still running at the drain
    /// deadline are cut off.
    async fn publish_wave(
        &self,
        go: Vec<Claimed>,
        wave: &mut Wave<'_>,
        outcomes: &mut Outcomes<P>,
    ) {
        let inner = &self.inner;
        let options = &inner.options;
        let (records, tokens): (Vec<Record>, Vec<i64>) =
            go.into_iter().map(|c| (c.record, c.token)).unzip();
        let mut open = Open {
            records: &records,
            tokens: &tokens,
            settled: vec![false; records.len()],
        };
        let wave_start = Instant::now();
        let stall_after = STALL.min(options.lease / 8);
        // Records whose turn has come (started, or skipped): once all have, only slow
        // publishes can keep the wave going.
        let begun = AtomicUsize::new(0);
        // Set once a publish of this wave found the broker unavailable: start no more.
        let unavailable = AtomicBool::new(false);
        let pipelined =
            std::panic::catch_unwind(AssertUnwindSafe(|| inner.publisher.publish_batch(&records)));
        // A pipelined batch publishes its records together: their spans last the wave.
        // (One by one, each record's span covers its own publish, below.)
        let _spans: Vec<tracing::Span> = match &pipelined {
            Ok(Some(_)) if cfg!(feature = "opentelemetry") => {
                records.iter().map(|r| self.publish_span(r)).collect()
            }
            _ => Vec::new(),
        };
        let (mut stream, wave_deadline): (BoxStream<'_, (usize, Published)>, Option<Instant>) =
            match pipelined {
                Ok(Some(pipelined)) => {
                    begun.store(records.len(), Ordering::SeqCst);
                    let deadline = (wave_start + self.own_timeout())
                        .min(self.hard_deadline(wave.leases.claimed_at));
                    (all_results(pipelined, wave_start), Some(deadline))
                }
                Ok(None) => {
                    let started = Started {
                        stop: wave.drain.stop.clone(),
                        leases: wave.leases.clone(),
                        begun: &begun,
                        unavailable: &unavailable,
                    };
                    (self.one_by_one(&records, started), None)
                }
                Err(_) => {
                    // `publish_batch` itself panicked: every record of the wave fails.
                    let failed = (0..records.len())
                        .map(|i| (i, Some((Err(panicked()), Duration::ZERO))))
                        .collect::<Vec<_>>();
                    (stream::iter(failed).boxed(), None)
                }
            };
        let mut stop = wave.drain.stop.clone();
        let mut stall_check = tokio::time::interval_at(wave_start + stall_after, stall_after);
        let far = || Instant::now() + Duration::from_secs(86_400);
        loop {
            // Looked at anew each time round: a renewal of the cursor's lease moves it on.
            let cut = wave_deadline.map(|by| self.cut_off(wave.leases, by));
            tokio::select! {
                item = stream.next() => {
                    let more = self.take_ready(item, &mut stream, &mut open, &unavailable, wave, outcomes, wave_start);
                    if !more {
                        break;
                    }
                    outcomes.flush_if_idle();
                }
                () = tokio::time::sleep_until(cut.unwrap_or_else(far)), if cut.is_some() => {
                    let by = wave_deadline.unwrap_or(wave_start);
                    let now = Instant::now();
                    if now < self.cut_off(wave.leases, by) {
                        continue;
                    }
                    if now < by {
                        // The cursor's lease ran out: what is still open is left unpublished.
                        self.cursor_lost(open.settled.iter().filter(|done| !**done).count());
                        self.settle_open(&mut open, || None, wave, outcomes);
                    } else {
                        let after = by - wave_start;
                        self.settle_open(&mut open, || Some((Err(timed_out(after)), after)), wave, outcomes);
                    }
                    break;
                }
                _ = stall_check.tick() => {
                    if wave.slot.holds() && begun.load(Ordering::SeqCst) >= records.len() {
                        tracing::debug!(table = %inner.outbox.table(), "a publish is slow: recording the others and freeing the batch's slot");
                        wave.slot.stall();
                        outcomes.stall();
                    } else {
                        outcomes.flush_if_idle();
                    }
                }
                () = until_stopped(&mut stop), if wave.drain.deadline.is_none() => {
                    wave.drain.deadline = Some(Instant::now() + options.drain_timeout);
                    tracing::info!(
                        table = %inner.outbox.table(), drain_timeout = ?options.drain_timeout,
                        "relay shutting down: draining publishes under way"
                    );
                }
                () = tokio::time::sleep_until(wave.drain.deadline.unwrap_or_else(far)), if wave.drain.deadline.is_some() => {
                    tracing::warn!(table = %inner.outbox.table(), "drain timeout: releasing unfinished publishes");
                    break;
                }
            }
        }
        drop(stream);
        // Cut off by the drain deadline, or never started.
        self.settle_open(&mut open, || None, wave, outcomes);
        outcomes.flush_if_idle();
    }

    /// How long a publish may take: half the lease, or past the publisher's own timeout, so
    /// that it reports first (the RabbitMQ publisher yields every result only once all are
    /// in).
    fn own_timeout(&self) -> Duration {
        let lease = self.inner.options.lease;
        let half = lease / 2;
        self.inner
            .publisher
            .timeout()
            .map_or(half, |t| half.max(t + lease / 20))
    }

    /// The wave's records published one by one, up to `concurrency` at a time, each within
    /// its deadline, a panic failing only its own record.
    fn one_by_one<'a>(
        &'a self,
        records: &'a [Record],
        started: Started<'a>,
    ) -> BoxStream<'a, (usize, Published)> {
        let started = Arc::new(started);
        stream::iter(records.iter().enumerate())
            .map(move |(i, record)| {
                let started = started.clone();
                async move { (i, self.publish_one(record, &started).await) }
            })
            .buffer_unordered(self.inner.options.concurrency)
            .boxed()
    }

    /// Says that `publishes` under way were cut off because the cursor's lease ran out
    /// under them.
    fn cursor_lost(&self, publishes: usize) {
        tracing::warn!(
            table = %self.inner.outbox.table(), publishes,
            "the log cursor's lease ran out while this relay published from it: publishes \
             cut off, left to whichever relay takes the cursor next"
        );
    }

    /// One record's publish. Futures start when first polled: a record whose turn comes
    /// after shutdown, during an outage, or too late in the lease is never started (`None`:
    /// it is released).
    async fn publish_one(&self, record: &Record, wave: &Started<'_>) -> Published {
        wave.begun.fetch_add(1, Ordering::SeqCst);
        let stopping = *wave.stop.borrow();
        if stopping || wave.unavailable.load(Ordering::SeqCst) || self.too_late(&wave.leases) {
            return None;
        }
        let started = Instant::now();
        let hard = self.hard_deadline(wave.leases.claimed_at);
        let deadline = (started + self.own_timeout()).min(hard).max(started);
        // The call itself may panic, not only its future.
        let publish =
            std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.publisher.publish(record)));
        let result = match publish {
            Err(_) => Err(panicked()),
            Ok(publish) => {
                let publish = AssertUnwindSafe(publish)
                    .catch_unwind()
                    .instrument(self.publish_span(record));
                match self.within(&wave.leases, deadline, publish).await {
                    Some(Ok(result)) => result,
                    Some(Err(_)) => Err(panicked()),
                    None if Instant::now() < deadline => {
                        self.cursor_lost(1);
                        return None;
                    }
                    None => Err(timed_out(deadline - started)),
                }
            }
        };
        Some((result, started.elapsed()))
    }

    /// Settles `item` and every result that is ready behind it, so a stalled batch records
    /// them in one statement. Returns whether the wave goes on.
    #[allow(clippy::too_many_arguments)]
    fn take_ready(
        &self,
        mut item: Option<(usize, Published)>,
        stream: &mut BoxStream<'_, (usize, Published)>,
        open: &mut Open<'_>,
        unavailable: &AtomicBool,
        wave: &mut Wave<'_>,
        outcomes: &mut Outcomes<P>,
        wave_start: Instant,
    ) -> bool {
        loop {
            match item {
                Some((usize::MAX, _)) => {
                    // The pipelined stream panicked: what has no result failed.
                    let failed = || Some((Err(panicked()), wave_start.elapsed()));
                    self.settle_open(open, failed, wave, outcomes);
                    return false;
                }
                Some((i, result)) => {
                    if let Some((Err(e), _)) = &result
                        && e.is_unavailable()
                    {
                        unavailable.store(true, Ordering::SeqCst);
                    }
                    if i < open.records.len() && !open.settled[i] {
                        open.settled[i] = true;
                        self.settle(&open.records[i], open.tokens[i], result, wave, outcomes);
                    }
                }
                None => return false,
            }
            match stream.next().now_or_never() {
                Some(next) => item = next,
                None => return true,
            }
        }
    }

    /// Settles every record of the wave still without an outcome with `published()`.
    fn settle_open(
        &self,
        open: &mut Open<'_>,
        published: impl Fn() -> Published,
        wave: &mut Wave<'_>,
        outcomes: &mut Outcomes<P>,
    ) {
        for (i, done) in open.settled.iter_mut().enumerate() {
            if !*done {
                *done = true;
                self.settle(
                    &open.records[i],
                    open.tokens[i],
                    published(),
                    wave,
                    outcomes,
                );
            }
        }
    }

    /// The span of one record's publish: a child of the enqueuing span on the first
    /// attempt, linked to it on a retry (with the `opentelemetry` feature).
    /// Without that feature it is none: a span per message would be work on the relay's
    /// hot path that nothing reads.
    fn publish_span(&self, record: &Record) -> tracing::Span {
        if !cfg!(feature = "opentelemetry") {
            return tracing::Span::none();
        }
        // A root unless the message carries a trace: never a child of whatever span the
        // relay happens to run in.
        let span = tracing::info_span!(
            target: "diesel_outbox",
            parent: None,
            "publish",
            otel.name = %format_args!("publish {}", record.topic),
            otel.kind = "producer",
            messaging.operation.type = "send",
            messaging.destination.name = %record.topic,
            messaging.message.id = %record.key,
            outbox.table = %self.inner.outbox.table(),
            outbox.attempt = record.attempt,
        );
        crate::trace::continue_in(&span, &record.headers, record.attempt == 1);
        span
    }

    /// Turns one record's publish result into its outcome.
    fn settle(
        &self,
        record: &Record,
        token: i64,
        result: Published,
        wave: &mut Wave<'_>,
        outcomes: &mut Outcomes<P>,
    ) {
        let inner = &self.inner;
        let table = inner.outbox.table();
        let outcome = match result {
            Some((Ok(()), took)) => {
                tracing::trace!(key = %record.key, topic = %record.topic, attempt = record.attempt, ?took, "published");
                let started = Instant::now()
                    .checked_sub(took)
                    .unwrap_or_else(Instant::now);
                inner.outage.recovered(table, started, &*inner.metrics);
                inner.metrics.published(&record.topic, record.attempt, took);
                if let Ok(lag) = (chrono::Utc::now() - record.created_at).to_std() {
                    inner.metrics.delivered(&record.topic, lag);
                }
                outcomes.push(Outcome::sent(record, token));
                return;
            }
            None => {
                *wave.released += 1;
                Outcome::release(record, token)
            }
            Some((Err(err), _)) if err.is_unavailable() => {
                tracing::debug!(table = %table, key = %record.key, topic = %record.topic, error = %err, "broker unavailable: released");
                *wave.released += 1;
                let outcome = Outcome::release(record, token);
                wave.unavailable.get_or_insert(err);
                outcome
            }
            Some((Err(err), _)) => self.failure(record, token, &err),
        };
        if let Some(aggregate) = &record.aggregate_key {
            wave.blocked.insert(aggregate.clone());
        }
        outcomes.push(outcome);
    }

    fn failure(&self, record: &Record, token: i64, err: &PublishError) -> Outcome {
        let inner = &self.inner;
        inner.metrics.failed(&record.topic, record.attempt, err);
        if err.is_permanent() || record.attempt >= inner.options.max_attempts {
            tracing::error!(
                table = %inner.outbox.table(), key = %record.key, topic = %record.topic,
                attempts = record.attempt, error = %err, "dead letter"
            );
            inner.metrics.dead_lettered(&record.topic, record.attempt);
            Outcome::dead(record, token, err)
        } else {
            let delay = inner.options.backoff(record.attempt);
            tracing::warn!(
                table = %inner.outbox.table(), key = %record.key, topic = %record.topic,
                attempt = record.attempt, retry_in = ?delay, error = %err, "publish failed; will retry"
            );
            Outcome::retry(record, token, delay, err)
        }
    }
}

fn panicked() -> PublishError {
    PublishError::transient("publisher panicked")
}

fn timed_out(after: Duration) -> PublishError {
    PublishError::transient(format!("publish timed out after {after:?}; abandoned"))
}

/// Splits a batch (in id order) into waves: the `n`-th claimed message of each aggregate
/// goes to wave `n`; messages without an aggregate go to wave 0.
fn waves(ready: Vec<Claimed>) -> Vec<Vec<Claimed>> {
    let mut depth: HashMap<String, usize> = HashMap::new();
    let mut waves: Vec<Vec<Claimed>> = Vec::new();
    for claimed in ready {
        let wave = match &claimed.record.aggregate_key {
            Some(aggregate) => {
                let d = depth.entry(aggregate.clone()).or_default();
                *d += 1;
                *d - 1
            }
            None => 0,
        };
        if waves.len() <= wave {
            waves.resize_with(wave + 1, Vec::new);
        }
        waves[wave].push(claimed);
    }
    waves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claimed(id: i64, aggregate: Option<&str>) -> Claimed {
        Claimed {
            record: Record {
                id,
                key: format!("k{id}"),
                topic: "t".into(),
                aggregate_key: aggregate.map(str::to_owned),
                payload: Vec::new(),
                content_type: None,
                headers: Default::default(),
                attempt: 1,
                created_at: chrono::Utc::now(),
            },
            token: 1,
        }
    }

    #[test]
    fn each_aggregate_gets_one_message_per_wave_in_order() {
        let batch = vec![
            claimed(1, Some("a")),
            claimed(2, None),
            claimed(3, Some("a")),
            claimed(4, Some("b")),
            claimed(5, Some("a")),
            claimed(6, None),
        ];
        let ids: Vec<Vec<i64>> = waves(batch)
            .into_iter()
            .map(|w| w.into_iter().map(|c| c.record.id).collect())
            .collect();
        assert_eq!(ids, vec![vec![1, 2, 4, 6], vec![3], vec![5]]);
    }
}
