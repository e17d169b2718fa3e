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
use tokio::sync::{OwnedSemaphorePermit, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::store::{Batch, Claimed, Outcome};
use super::{RECORD_GRACE, Relay};
use crate::publisher::{PublishError, Publisher, Record};

/// A batch whose wave has run this long with nothing left to start is stalled: it gives its
/// publishing slot back and records what it knows at once (at most an eighth of the lease).
const STALL: Duration = Duration::from_secs(1);

/// The result of one record's publish; `None` when it was never started or was cut off.
type Published = Option<(Result<(), PublishError>, Duration)>;

/// A batch's place in the relay's pipeline.
pub(super) struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    stalled: Arc<AtomicUsize>,
    counted: bool,
}

impl Slot {
    pub(super) fn new(permit: Option<OwnedSemaphorePermit>, stalled: Arc<AtomicUsize>) -> Self {
        Slot {
            permit,
            stalled,
            counted: false,
        }
    }

    /// The batch waits only on slow publishes: let the relay start others meanwhile.
    fn stall(&mut self) {
        if self.permit.take().is_some() {
            self.stalled.fetch_add(1, Ordering::SeqCst);
            self.counted = true;
        }
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
/// come (each record statement on a task of its own, so publishing goes on meanwhile).
struct Outcomes<P> {
    relay: Relay<P>,
    pending: Vec<Outcome>,
    flushes: Vec<JoinHandle<()>>,
    stalled: bool,
    /// Recording keeps trying until then: a lease after the leases end (a late outcome
    /// still counts unless another relay took the rows over, when fencing discards it).
    record_by: Instant,
}

impl<P: Publisher> Outcomes<P> {
    fn push(&mut self, outcome: Outcome) {
        self.pending.push(outcome);
        if self.stalled {
            self.flush();
        }
    }

    fn stall(&mut self) {
        self.stalled = true;
        self.flush();
    }

    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let outcomes = std::mem::take(&mut self.pending);
        let relay = self.relay.clone();
        let by = self.record_by;
        self.flushes.push(tokio::spawn(async move {
            relay.record(&outcomes, by).await;
        }));
    }

    /// Records what is left and waits for earlier flushes, all by `by`.
    async fn finish(mut self, by: Instant) {
        let outcomes = std::mem::take(&mut self.pending);
        self.relay.record(&outcomes, by).await;
        for flush in self.flushes.drain(..) {
            let abort = flush.abort_handle();
            if tokio::time::timeout_at(by, flush).await.is_err() {
                abort.abort();
            }
        }
    }
}

/// What one wave needs to know of its batch.
struct Wave<'a> {
    claimed_at: Instant,
    drain: &'a mut Drain,
    slot: &'a mut Slot,
    /// Aggregates whose run stops here: a message failed, so its successors wait.
    blocked: &'a mut HashSet<String>,
    released: &'a mut usize,
}

impl<P: Publisher> Relay<P> {
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
        } = batch;
        let record_by = claimed_at + 2 * inner.options.lease;
        let mut outcomes = Outcomes {
            relay: self.clone(),
            pending: Vec::with_capacity(ready.len() + undecodable.len()),
            flushes: Vec::new(),
            stalled: false,
            record_by,
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
        self.publish(ready, claimed_at, &mut drain, &mut slot, &mut outcomes)
            .await;
        slot.release();
        // At shutdown, recording gets a moment after the drain.
        let by = if drain.stopping() {
            let drained = drain.deadline.unwrap_or_else(Instant::now);
            (drained.max(Instant::now()) + RECORD_GRACE).min(record_by.max(Instant::now()))
        } else {
            record_by
        };
        outcomes.finish(by).await;
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
        claimed_at: Instant,
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
            // Later waves wait for earlier ones (and a batch may wait for a publishing slot);
            // once half the lease is gone, the rest is released rather than risk publishing
            // it after another relay took it over.
            let late = claimed_at.elapsed() > inner.options.lease / 2;
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
                outcomes.push(Outcome::release(&c.record, c.token));
            }
            if go.is_empty() {
                continue;
            }
            let mut wave = Wave {
                claimed_at,
                drain,
                slot,
                blocked: &mut blocked,
                released: &mut released,
            };
            self.publish_wave(go, &mut wave, outcomes).await;
        }
        tracing::debug!(table = %inner.outbox.table(), records = count, took = ?started.elapsed(), "published");
        if released > 0 {
            tracing::info!(table = %inner.outbox.table(), released, "released unpublished claims");
            inner.metrics.released(released);
        }
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
        let mut settled = vec![false; records.len()];
        let wave_start = Instant::now();
        // A publish may take half the lease, and must end a margin before the lease does.
        let half = options.lease / 2;
        let hard = wave.claimed_at + options.lease - options.lease / 10;
        let stall_after = STALL.min(options.lease / 8);
        let begun = AtomicUsize::new(0);
        // Set once a publish of this wave found the broker unavailable: start no more.
        let unavailable = AtomicBool::new(false);
        let pipelined =
            std::panic::catch_unwind(AssertUnwindSafe(|| inner.publisher.publish_batch(&records)));
        let (mut stream, wave_deadline): (BoxStream<'_, (usize, Published)>, Option<Instant>) =
            match pipelined {
                Ok(Some(pipelined)) => {
                    begun.store(records.len(), Ordering::SeqCst);
                    let stream = AssertUnwindSafe(pipelined)
                        .catch_unwind()
                        .map(move |item| match item {
                            Ok((i, r)) => (i, Some((r, wave_start.elapsed()))),
                            Err(_) => (usize::MAX, None),
                        })
                        .boxed();
                    (stream, Some((wave_start + half).min(hard)))
                }
                Ok(None) => {
                    let stop = wave.drain.stop.clone();
                    let (begun, unavailable) = (&begun, &unavailable);
                    let stream = stream::iter(records.iter().enumerate())
                        .map(move |(i, record)| {
                            let stop = stop.clone();
                            async move {
                                // Futures start when first polled: a record whose turn comes
                                // after shutdown or during an outage is never started.
                                let stopping = *stop.borrow();
                                if stopping || unavailable.load(Ordering::SeqCst) {
                                    return (i, None);
                                }
                                begun.fetch_add(1, Ordering::SeqCst);
                                let started = Instant::now();
                                let deadline = (started + half).min(hard).max(started);
                                let publish = AssertUnwindSafe(inner.publisher.publish(record))
                                    .catch_unwind();
                                let result = match tokio::time::timeout_at(deadline, publish).await
                                {
                                    Ok(Ok(result)) => result,
                                    Ok(Err(_)) => Err(panicked()),
                                    Err(_) => Err(timed_out(deadline - started)),
                                };
                                (i, Some((result, started.elapsed())))
                            }
                        })
                        .buffer_unordered(options.concurrency)
                        .boxed();
                    (stream, None)
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
            tokio::select! {
                item = stream.next() => match item {
                    Some((usize::MAX, _)) => {
                        // The pipelined stream panicked: what has no result failed with it.
                        for (i, done) in settled.iter_mut().enumerate() {
                            if !*done {
                                *done = true;
                                let failed = Some((Err(panicked()), wave_start.elapsed()));
                                self.settle(&records[i], tokens[i], failed, wave, outcomes);
                            }
                        }
                        break;
                    }
                    Some((i, result)) => {
                        if let Some((Err(e), _)) = &result && e.is_unavailable() {
                            unavailable.store(true, Ordering::SeqCst);
                        }
                        if i < records.len() && !settled[i] {
                            settled[i] = true;
                            self.settle(&records[i], tokens[i], result, wave, outcomes);
                        }
                    }
                    None => break,
                },
                () = tokio::time::sleep_until(wave_deadline.unwrap_or_else(far)), if wave_deadline.is_some() => {
                    let after = wave_deadline.unwrap_or(wave_start) - wave_start;
                    for (i, done) in settled.iter_mut().enumerate() {
                        if !*done {
                            *done = true;
                            self.settle(&records[i], tokens[i], Some((Err(timed_out(after)), after)), wave, outcomes);
                        }
                    }
                    break;
                }
                _ = stall_check.tick(), if !outcomes.stalled => {
                    if begun.load(Ordering::SeqCst) >= records.len() {
                        tracing::debug!(table = %inner.outbox.table(), "a publish is slow: recording the others and freeing the batch's slot");
                        wave.slot.stall();
                        outcomes.stall();
                    }
                }
                () = super::until_stopped(&mut stop), if wave.drain.deadline.is_none() => {
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
        for (i, done) in settled.iter().enumerate() {
            if !*done {
                self.settle(&records[i], tokens[i], None, wave, outcomes);
            }
        }
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
                inner.outage.recovered(table, &*inner.metrics);
                inner.metrics.published(&record.topic, record.attempt, took);
                outcomes.push(Outcome::sent(record, token));
                return;
            }
            None => {
                *wave.released += 1;
                Outcome::release(record, token)
            }
            Some((Err(err), _)) if err.is_unavailable() => {
                tracing::debug!(table = %table, key = %record.key, topic = %record.topic, error = %err, "broker unavailable: released");
                inner
                    .outage
                    .report(table, &err, &inner.options, &*inner.metrics);
                *wave.released += 1;
                Outcome::release(record, token)
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
    PublishError::transient(format!(
        "publish timed out after {after:?} (half the lease); abandoned"
    ))
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
