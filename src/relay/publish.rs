//! Publishing a claimed batch: in waves that keep each aggregate's order, with shutdown
//! draining, turning every result into an outcome.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::{self, BoxStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::Relay;
use super::store::{Batch, Claimed, Outcome};
use crate::publisher::{PublishError, Publisher, Record};

/// The result of one record's publish; `None` when it was never started or was cut off.
type Published = Option<(Result<(), PublishError>, Duration)>;

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

impl<P: Publisher> Relay<P> {
    /// Turns a claimed batch into outcomes: dead letters for rows that cannot be published,
    /// and the publish results of the rest.
    pub(super) async fn process(&self, batch: Batch, stop: watch::Receiver<bool>) -> Vec<Outcome> {
        let inner = &self.inner;
        let table = inner.outbox.table();
        let Batch {
            claimed_at,
            ready,
            crash_looped,
            undecodable,
        } = batch;
        for record in &crash_looped {
            tracing::error!(
                table = %table, key = %record.key, topic = %record.topic, attempts = record.attempt,
                "dead letter: claimed again and again without an outcome (relay crashing or hanging on it)"
            );
            inner.metrics.dead_lettered(&record.topic, record.attempt);
        }
        let mut outcomes = Vec::with_capacity(ready.len() + undecodable.len());
        for (record, outcome) in undecodable {
            tracing::error!(
                table = %table, key = %record.key, topic = %record.topic,
                error = outcome.error.as_deref().unwrap_or_default(),
                "dead letter: row cannot be decoded"
            );
            inner.metrics.dead_lettered(&record.topic, record.attempt);
            outcomes.push(outcome);
        }
        outcomes.extend(self.publish(ready, claimed_at, stop).await);
        outcomes
    }

    /// Publishes in waves: a claim holds at most a run of consecutive messages per
    /// aggregate, so wave `n` holds the `n`-th of each run (and wave 0 everything without an
    /// aggregate). All of a wave may go out at once; a message goes out only after its
    /// predecessor was confirmed, so each aggregate is published one at a time, in order.
    /// After a failure the rest of that aggregate's run is released, untried.
    async fn publish(
        &self,
        ready: Vec<Claimed>,
        claimed_at: Instant,
        stop: watch::Receiver<bool>,
    ) -> Vec<Outcome> {
        let inner = &self.inner;
        let mut drain = Drain {
            stop,
            deadline: None,
        };
        let started = Instant::now();
        let mut outcomes = Vec::with_capacity(ready.len());
        let mut blocked: HashSet<String> = HashSet::new();
        let mut released = 0;
        for wave in waves(ready) {
            // Later waves wait for earlier ones (and a batch may wait for a publishing slot);
            // once half the lease is gone, the rest is released rather than risk publishing
            // it after another relay took it over.
            let late = claimed_at.elapsed() > inner.options.lease / 2;
            let (go, held): (Vec<Claimed>, Vec<Claimed>) = wave.into_iter().partition(|c| {
                !drain.stopping()
                    && !late
                    && c.record
                        .aggregate_key
                        .as_ref()
                        .is_none_or(|a| !blocked.contains(a))
            });
            released += held.len();
            outcomes.extend(held.iter().map(|c| Outcome::release(&c.record, c.token)));
            if go.is_empty() {
                continue;
            }
            let (records, tokens): (Vec<Record>, Vec<i64>) =
                go.into_iter().map(|c| (c.record, c.token)).unzip();
            let results = self.publish_wave(&records, &mut drain).await;
            for ((record, token), result) in records.iter().zip(tokens).zip(results) {
                let outcome = match result {
                    None => {
                        released += 1;
                        Outcome::release(record, token)
                    }
                    Some((Ok(()), took)) => {
                        tracing::trace!(key = %record.key, topic = %record.topic, attempt = record.attempt, ?took, "published");
                        inner.metrics.published(&record.topic, record.attempt, took);
                        outcomes.push(Outcome::sent(record, token));
                        continue;
                    }
                    Some((Err(err), _)) => self.failure(record, token, &err),
                };
                if let Some(aggregate) = &record.aggregate_key {
                    blocked.insert(aggregate.clone());
                }
                outcomes.push(outcome);
            }
        }
        tracing::debug!(table = %inner.outbox.table(), outcomes = outcomes.len(), took = ?started.elapsed(), "published");
        if released > 0 {
            tracing::info!(table = %inner.outbox.table(), released, "released unpublished claims");
            inner.metrics.released(released);
        }
        outcomes
    }

    /// Publishes one wave (pipelined, or one by one up to `concurrency`), honouring
    /// shutdown: unstarted records stay unstarted, and publishes still running at the drain
    /// deadline are cut off.
    async fn publish_wave(&self, records: &[Record], drain: &mut Drain) -> Vec<Published> {
        let inner = &self.inner;
        let mut results: Vec<Published> = records.iter().map(|_| None).collect();
        let started = Instant::now();
        let mut stream: BoxStream<'_, (usize, Option<Result<(), PublishError>>)> =
            match inner.publisher.publish_batch(records) {
                Some(pipelined) => pipelined.map(|(i, r)| (i, Some(r))).boxed(),
                None => stream::iter(records.iter().enumerate())
                    .map(|(i, record)| {
                        let stop = drain.stop.clone();
                        async move {
                            // Futures start when first polled: a record whose turn comes
                            // after shutdown is never started.
                            let stopping = *stop.borrow();
                            if stopping {
                                return (i, None);
                            }
                            (i, Some(inner.publisher.publish(record).await))
                        }
                    })
                    .buffer_unordered(inner.options.concurrency)
                    .boxed(),
            };
        let mut stop = drain.stop.clone();
        loop {
            let deadline = drain
                .deadline
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
            tokio::select! {
                item = stream.next() => match item {
                    Some((i, result)) => results[i] = result.map(|r| (r, started.elapsed())),
                    None => break,
                },
                () = super::until_stopped(&mut stop), if drain.deadline.is_none() => {
                    drain.deadline = Some(Instant::now() + inner.options.drain_timeout);
                    tracing::info!(
                        table = %inner.outbox.table(), drain_timeout = ?inner.options.drain_timeout,
                        "relay shutting down: draining publishes under way"
                    );
                }
                () = tokio::time::sleep_until(deadline), if drain.deadline.is_some() => {
                    tracing::warn!(table = %inner.outbox.table(), "drain timeout: releasing unfinished publishes");
                    break;
                }
            }
        }
        results
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
