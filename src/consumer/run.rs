//! The runner: takes deliveries from the source, hands each to a task of its own (one
//! aggregate's deliveries one after another), and in each task runs dedupe and the handler
//! in one transaction, then settles the delivery with the broker.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use futures_util::FutureExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;

use super::source::{Incoming, Source};
use super::{Delivery, HandleError, Handler, Inner};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::metrics::Consumed;

/// How the broker connection is retried after a failure.
const SOURCE_RETRY_MIN: Duration = Duration::from_millis(100);
const SOURCE_RETRY_MAX: Duration = Duration::from_secs(10);
/// How long an acknowledgement (or a reject) may take before it is given up: a broker that
/// no longer answers delivers the message again once its connection is gone.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How a database out of reach is waited for: it costs a delivery none of its runs.
const DATABASE_RETRY_MIN: Duration = Duration::from_millis(100);
const DATABASE_RETRY_MAX: Duration = Duration::from_secs(5);

/// A delivery's end in its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Applied (or found a duplicate) and acknowledged.
    Acked,
    /// Rejected.
    Rejected,
    /// Left unacknowledged (shutdown came first): the broker delivers it again.
    Left,
}

pub(super) async fn run<S: Source, H: Handler>(
    inner: Arc<Inner<H>>,
    source: &mut S,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    check_inbox(&inner).await?;
    let table = inner.outbox.table().to_owned();
    let concurrency = inner.options.concurrency;
    let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
    tracing::info!(table = %table, consumer = %inner.name, options = ?inner.options, "consumer started");
    let (stopper, stop) = watch::channel(false);
    let mut shutdown = pin!(shutdown.fuse());
    let mut tasks: JoinSet<Option<String>> = JoinSet::new();
    // Aggregates with a delivery in a task, and the deliveries queued behind it.
    let mut aggregates: HashMap<String, VecDeque<Incoming>> = HashMap::new();
    let mut queued = 0usize;
    let mut source_backoff = Backoff::new(SOURCE_RETRY_MIN, SOURCE_RETRY_MAX);
    let spawn = |tasks: &mut JoinSet<Option<String>>, incoming: Incoming| {
        let (inner, stop) = (inner.clone(), stop.clone());
        let span = process_span(&inner, &incoming.delivery);
        tasks.spawn(
            async move {
                let aggregate = incoming.delivery.aggregate_key.clone();
                settle(&inner, incoming, stop).await;
                aggregate
            }
            .instrument(span),
        );
    };
    loop {
        // The broker gives at most `prefetch` unacknowledged deliveries; this bound also
        // holds across a reconnect, while tasks of the old connection finish.
        let room = tasks.len() + queued < concurrency;
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                let aggregate = match done {
                    Ok(aggregate) => aggregate,
                    Err(e) => {
                        tracing::error!(table = %table, consumer = %inner.name, error = %e, "a delivery's task panicked; it will be delivered again");
                        None
                    }
                };
                // The aggregate's next delivery, if one waits.
                if let Some(key) = aggregate
                    && let Some(waiting) = aggregates.get_mut(&key)
                {
                    match waiting.pop_front() {
                        Some(next) => {
                            queued -= 1;
                            spawn(&mut tasks, next);
                        }
                        None => {
                            aggregates.remove(&key);
                        }
                    }
                }
            }
            incoming = source.next(prefetch), if room => match incoming {
                Ok(incoming) => {
                    source_backoff.reset();
                    match incoming.delivery.aggregate_key.clone() {
                        Some(key) => match aggregates.get_mut(&key) {
                            Some(waiting) => {
                                waiting.push_back(incoming);
                                queued += 1;
                            }
                            None => {
                                aggregates.insert(key, VecDeque::new());
                                spawn(&mut tasks, incoming);
                            }
                        },
                        None => spawn(&mut tasks, incoming),
                    }
                }
                Err(e) => {
                    let delay = source_backoff.failed();
                    tracing::warn!(table = %table, consumer = %inner.name, error = %e, retry_in = ?delay, "consuming failed");
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = &mut shutdown => break,
                    }
                }
            },
        }
    }

    // Shutdown: nothing more is taken; what waits behind an aggregate is left for the
    // broker; tasks under way get the drain timeout.
    let _ = stopper.send(true);
    drop(aggregates);
    let drained = tokio::time::timeout(inner.options.drain_timeout, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            table = %table, consumer = %inner.name, cut_off = tasks.len(),
            "drain timeout: handlers still running are cut off; their deliveries will come again"
        );
        tasks.shutdown().await;
    }
    source.close().await;
    tracing::info!(table = %table, consumer = %inner.name, "consumer stopped");
    Ok(())
}

/// The span of one delivery's handling, every run included: a child of the enqueuing span
/// whose trace context the message carries (with the `opentelemetry` feature).
fn process_span<H>(inner: &Inner<H>, delivery: &Delivery) -> tracing::Span {
    let span = tracing::info_span!(
        target: "diesel_outbox",
        "process",
        otel.name = %format_args!("process {}", delivery.topic),
        otel.kind = "consumer",
        messaging.operation.type = "process",
        messaging.destination.name = %delivery.topic,
        messaging.message.id = %delivery.key,
        messaging.consumer.group.name = %inner.name,
    );
    crate::trace::continue_in(&span, &delivery.headers, true);
    span
}

/// Fails at start when the inbox table is missing (checked in a transaction that is
/// rolled back, so nothing is recorded).
async fn check_inbox<H>(inner: &Inner<H>) -> Result<()> {
    let mut conn = inner.pool.get().await?;
    AnsiTransactionManager::begin_transaction(&mut *conn)
        .await
        .map_err(|e| inner.outbox.db_error(e))?;
    let probe = inner
        .outbox
        .dedupe(&mut conn, &inner.name, "diesel-outbox consumer start")
        .await;
    let rolled_back = AnsiTransactionManager::rollback_transaction(&mut *conn).await;
    probe?;
    rolled_back.map_err(|e| inner.outbox.db_error(e))?;
    Ok(())
}

/// Runs a delivery until it is applied, found a duplicate, rejected, or left by shutdown,
/// and settles it with the broker.
async fn settle<H: Handler>(inner: &Inner<H>, incoming: Incoming, mut stop: watch::Receiver<bool>) {
    let Incoming { delivery, settle } = incoming;
    let options = &inner.options;
    let (table, name) = (inner.outbox.table(), &inner.name);
    let mut backoff = Backoff::new(options.backoff_min, options.backoff_max);
    let mut unreachable = Backoff::new(DATABASE_RETRY_MIN, DATABASE_RETRY_MAX);
    let mut runs = 0u32;
    let ended = loop {
        let started = Instant::now();
        let mut conn = match inner.pool.get().await {
            Ok(conn) => conn,
            Err(e) => {
                let delay = unreachable.failed();
                tracing::warn!(
                    table = %table, consumer = %name, error = %Error::from(e), retry_in = ?delay,
                    "no database connection; the delivery waits"
                );
                tokio::select! {
                    () = tokio::time::sleep(delay) => continue,
                    () = crate::relay::until_stopped(&mut stop) => break Ended::Left,
                }
            }
        };
        unreachable.reset();
        runs += 1;
        let result = apply(inner, &delivery, &mut conn).await;
        drop(conn);
        let consumed = match &result {
            Ok(true) => Consumed::Applied,
            Ok(false) => Consumed::Duplicate,
            Err(e) if e.is_reject() || runs >= options.max_deliveries => Consumed::Rejected,
            Err(_) => Consumed::Retried,
        };
        inner.metrics.consumed(&delivery.topic, consumed);
        match result {
            Ok(first) => {
                tracing::debug!(
                    table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                    duplicate = !first, took = ?started.elapsed(), "delivery applied"
                );
                break Ended::Acked;
            }
            Err(e) if e.is_reject() => {
                tracing::error!(
                    table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                    error = %e, "delivery rejected by its handler"
                );
                break Ended::Rejected;
            }
            Err(e) if runs >= options.max_deliveries => {
                tracing::error!(
                    table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                    runs, error = %e, "delivery rejected after max_deliveries runs"
                );
                break Ended::Rejected;
            }
            Err(e) => {
                let delay = backoff.failed();
                tracing::warn!(
                    table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                    runs, error = %e, retry_in = ?delay, "delivery failed; running it again"
                );
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = crate::relay::until_stopped(&mut stop) => break Ended::Left,
                }
            }
        }
    };
    let settling = match ended {
        Ended::Acked => settle.ack(),
        Ended::Rejected => settle.reject(),
        Ended::Left => return,
    };
    let settled = tokio::time::timeout(SETTLE_TIMEOUT, settling)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {SETTLE_TIMEOUT:?}").into()));
    if let Err(e) = settled {
        tracing::warn!(
            table = %table, consumer = %name, key = %delivery.key, error = %e,
            "settling a delivery failed; the broker will deliver it again and dedupe will know it"
        );
    }
}

/// One run: dedupe and the handler in one transaction. `Ok(true)` when applied, `Ok(false)`
/// for a duplicate.
async fn apply<H: Handler>(
    inner: &Inner<H>,
    delivery: &Delivery,
    conn: &mut AsyncPgConnection,
) -> std::result::Result<bool, HandleError> {
    AnsiTransactionManager::begin_transaction(conn)
        .await
        .map_err(HandleError::retry)?;
    let applied = async {
        let first = match inner.outbox.dedupe(conn, &inner.name, &delivery.key).await {
            Ok(first) => first,
            // A key dedupe cannot take (empty, too long): no run can apply it.
            Err(e @ Error::InvalidMessage(_)) => return Err(HandleError::reject(e)),
            Err(e) => return Err(HandleError::retry(e)),
        };
        if first {
            inner.handler.handle(delivery, conn).await?;
        }
        Ok(first)
    }
    .await;
    match applied {
        Ok(first) => {
            AnsiTransactionManager::commit_transaction(conn)
                .await
                .map_err(HandleError::retry)?;
            Ok(first)
        }
        Err(e) => {
            let _ = AnsiTransactionManager::rollback_transaction(conn).await;
            Err(e)
        }
    }
}
