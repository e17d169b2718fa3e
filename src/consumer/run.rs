//! The runner: takes deliveries from the source, hands each to a task of its own (one
//! aggregate's deliveries one after another), and in each task runs dedupe and the handler
//! in one transaction, then settles the delivery with the broker.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use diesel_async::{
    AnsiTransactionManager, AsyncPgConnection, SimpleAsyncConnection, TransactionManager,
};
use futures_util::FutureExt;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;

use super::source::{Incoming, Source};
use super::{ConsumerShared, Delivery, HandleError, Handler};
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::metrics::Consumed;
use crate::streak::{Loudness, Streak};

/// How the broker connection is retried after a failure.
const SOURCE_RETRY_MIN: Duration = Duration::from_millis(100);
const SOURCE_RETRY_MAX: Duration = Duration::from_secs(10);
/// How long an acknowledgement (or a reject) may take before it is given up: a broker that
/// no longer answers delivers the message again once its connection is gone.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);
/// The runner's loop turns at least this often, to show it is live.
pub(super) const HEARTBEAT: Duration = Duration::from_secs(1);
/// How a database out of reach is waited for: it costs a delivery none of its runs.
const DATABASE_RETRY_MIN: Duration = Duration::from_millis(100);
const DATABASE_RETRY_MAX: Duration = Duration::from_secs(5);

/// A delivery's end in its task.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    /// Applied (or found a duplicate) and acknowledged.
    Acked,
    /// Rejected, and why (for a source that keeps the reason with its dead letter).
    Rejected(String),
    /// Left unacknowledged (shutdown came first): the broker delivers it again.
    Left,
}

pub(super) async fn run<S: Source, H: Handler>(
    inner: Arc<ConsumerShared<H>>,
    source: &mut S,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    check_inbox(&inner).await?;
    source.verify().await.map_err(Error::NotDeclared)?;
    let table = inner.outbox.table().to_owned();
    let concurrency = inner.options.concurrency;
    let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
    tracing::info!(table = %table, consumer = %inner.name, options = ?inner.options, "consumer started");
    let _running = inner.vitals.running();
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    let (stopper, stop) = watch::channel(false);
    let mut shutdown = pin!(shutdown.fuse());
    let mut tasks: JoinSet<()> = JoinSet::new();
    // The aggregate of each task's delivery, by task, so that a task that ends any way
    // (even panicking) lets its aggregate's next delivery go.
    let mut task_aggregates: HashMap<tokio::task::Id, String> = HashMap::new();
    // Aggregates with a delivery in a task, and the deliveries queued behind it.
    let mut aggregates: HashMap<String, VecDeque<Incoming>> = HashMap::new();
    let mut queued = 0usize;
    let mut source_backoff = Backoff::new(SOURCE_RETRY_MIN, SOURCE_RETRY_MAX);
    let mut source_failures = Streak::default();
    // After a failure of the source, when it may be asked again.
    let mut retry_at: Option<Instant> = None;
    let group = source.consumer_group().map(str::to_owned);
    let spawn = |tasks: &mut JoinSet<()>,
                 task_aggregates: &mut HashMap<tokio::task::Id, String>,
                 incoming: Incoming| {
        let (inner, stop) = (inner.clone(), stop.clone());
        let span = process_span(&inner.name, group.as_deref(), &incoming.delivery);
        let aggregate = incoming.delivery.aggregate_key.clone();
        let task = tasks.spawn(settle_owned(inner, incoming, stop).instrument(span));
        if let Some(aggregate) = aggregate {
            task_aggregates.insert(task.id(), aggregate);
        }
    };
    loop {
        // The broker gives at most `prefetch` unacknowledged deliveries; this bound also
        // holds across a reconnect, while tasks of the old connection finish.
        let room = tasks.len() + queued < concurrency;
        let waiting_out = retry_at.is_some_and(|at| at > Instant::now());
        inner.vitals.turned();
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            _ = heartbeat.tick() => {}
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                let id = match done {
                    Ok((id, ())) => id,
                    Err(e) => {
                        tracing::error!(
                            table = %table, consumer = %inner.name, error = %e,
                            "a delivery's task failed; the broker delivers it again once this subscription closes"
                        );
                        e.id()
                    }
                };
                let aggregate = task_aggregates.remove(&id);
                // The aggregate's next delivery, if one waits.
                if let Some(key) = aggregate
                    && let Some(waiting) = aggregates.get_mut(&key)
                {
                    match waiting.pop_front() {
                        Some(next) => {
                            queued -= 1;
                            spawn(&mut tasks, &mut task_aggregates, next);
                        }
                        None => {
                            aggregates.remove(&key);
                        }
                    }
                }
            }
            () = tokio::time::sleep_until(retry_at.unwrap_or_else(Instant::now)), if waiting_out => {}
            incoming = source.next(prefetch), if room && !waiting_out => match incoming {
                Ok(incoming) => {
                    inner.vitals.broker(None);
                    source_backoff.reset();
                    if let Some(failed_for) = source_failures.ended() {
                        tracing::info!(table = %table, consumer = %inner.name, failed_for = ?failed_for, "consuming works again");
                    }
                    retry_at = None;
                    match incoming.delivery.aggregate_key.clone() {
                        Some(key) => match aggregates.get_mut(&key) {
                            Some(waiting) => {
                                waiting.push_back(incoming);
                                queued += 1;
                            }
                            None => {
                                aggregates.insert(key, VecDeque::new());
                                spawn(&mut tasks, &mut task_aggregates, incoming);
                            }
                        },
                        None => spawn(&mut tasks, &mut task_aggregates, incoming),
                    }
                }
                Err(e) => {
                    inner.vitals.broker(Some(e.to_string()));
                    let delay = source_backoff.failed();
                    match source_failures.failed() {
                        Loudness::First => tracing::warn!(
                            table = %table, consumer = %inner.name, error = %e, retry_in = ?delay,
                            "consuming failed; retrying (logged again each minute while it fails)"
                        ),
                        Loudness::Again(failing_for) => tracing::error!(
                            table = %table, consumer = %inner.name, error = %e,
                            failing_for = ?failing_for, retry_in = ?delay, "consuming still fails"
                        ),
                        Loudness::Quiet => tracing::debug!(
                            table = %table, consumer = %inner.name, error = %e, retry_in = ?delay,
                            "consuming failed again"
                        ),
                    }
                    retry_at = Some(Instant::now() + delay);
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
    if tokio::time::timeout(SETTLE_TIMEOUT, source.close())
        .await
        .is_err()
    {
        tracing::warn!(table = %table, consumer = %inner.name, "closing the subscription took too long; it is dropped");
    }
    tracing::info!(table = %table, consumer = %inner.name, "consumer stopped");
    Ok(())
}

/// The span of one delivery's handling, every run included: a child of the enqueuing span
/// whose trace context the message carries (with the `opentelemetry` feature). The
/// consumer's name (its dedupe records') is `outbox.consumer.name`; the broker's consumer
/// group, where the source has one (Kafka's), is `messaging.consumer.group.name`, absent
/// otherwise.
fn process_span(consumer: &str, group: Option<&str>, delivery: &Delivery) -> tracing::Span {
    let span = tracing::info_span!(
        target: "diesel_outbox",
        parent: None,
        "process",
        otel.name = %format_args!("process {}", delivery.topic),
        otel.kind = "consumer",
        messaging.operation.type = "process",
        messaging.destination.name = %delivery.topic,
        messaging.message.id = %delivery.key,
        messaging.consumer.group.name = group,
        outbox.consumer.name = %consumer,
    );
    crate::trace::continue_in(&span, &delivery.headers, true);
    span
}

/// Fails at start when the inbox table is missing (checked in a transaction that is
/// rolled back, so nothing is recorded), waiting up to the connect timeout for a database
/// it cannot reach.
async fn check_inbox<H>(inner: &ConsumerShared<H>) -> Result<()> {
    crate::until_reachable(
        "the consumer's start",
        inner.options.connect_timeout,
        || probe_inbox(inner),
    )
    .await
}

/// One try of [`check_inbox`], on a connection of its own: a pool's checkout would retry
/// until the pool's connection timeout and report no cause.
async fn probe_inbox<H>(inner: &ConsumerShared<H>) -> Result<()> {
    let mut conn = inner
        .pool
        .dedicated_connection()
        .await
        .map_err(|e| Error::Pool(Box::new(e)))?;
    AnsiTransactionManager::begin_transaction(&mut conn)
        .await
        .map_err(|e| inner.outbox.db_error(e))?;
    let probe = inner
        .outbox
        .dedupe(&mut conn, &inner.name, "diesel-outbox consumer start")
        .await;
    let rolled_back = AnsiTransactionManager::rollback_transaction(&mut conn).await;
    probe?;
    rolled_back.map_err(|e| inner.outbox.db_error(e))?;
    Ok(())
}

/// A delivery went through the database: a run of its failures, if any, is over.
fn database_answers<H>(inner: &ConsumerShared<H>) {
    let ended = inner
        .database_failures
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .ended();
    if let Some(failed_for) = ended {
        tracing::info!(
            table = %inner.outbox.table(), consumer = %inner.name, failed_for = ?failed_for,
            "the database answers again"
        );
    }
}

/// Why a run did not apply its delivery.
enum Failed {
    /// The handler failed (or panicked, or took too long): the run counts.
    Handler(HandleError),
    /// The database could not begin, record the key or commit: nobody's fault but the
    /// database's, so the run does not count (as when no connection can be had).
    Database(String),
}

/// [`settle`] on a task of its own.
async fn settle_owned<H: Handler>(
    inner: Arc<ConsumerShared<H>>,
    incoming: Incoming,
    stop: watch::Receiver<bool>,
) {
    settle(&inner, incoming, stop).await;
}

/// Runs a delivery until it is applied, found a duplicate, rejected, or left by shutdown,
/// and settles it with the broker.
async fn settle<H: Handler>(
    inner: &ConsumerShared<H>,
    incoming: Incoming,
    mut stop: watch::Receiver<bool>,
) {
    let Incoming { delivery, settle } = incoming;
    let options = &inner.options;
    let (table, name) = (inner.outbox.table(), &inner.name);
    let mut backoff = Backoff::new(options.backoff_min, options.backoff_max);
    let mut unreachable = Backoff::new(DATABASE_RETRY_MIN, DATABASE_RETRY_MAX);
    let mut runs = 0u32;
    let ended = loop {
        let started = Instant::now();
        let outcome = match crate::checkout(&inner.pool).await {
            Ok(mut conn) => apply(inner, &delivery, &mut conn).await,
            Err(e) => Err(Failed::Database(format!("no database connection: {}", e))),
        };
        let failure = match outcome {
            Ok(first) => {
                inner.vitals.database(None);
                database_answers(inner);
                inner.metrics.consumed(
                    &delivery.topic,
                    if first {
                        Consumed::Applied
                    } else {
                        Consumed::Duplicate
                    },
                );
                tracing::debug!(
                    table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                    duplicate = !first, took = ?started.elapsed(), "delivery applied"
                );
                break Ended::Acked;
            }
            Err(Failed::Database(why)) => {
                inner.vitals.database(Some(why.clone()));
                let delay = unreachable.failed();
                let loudness = inner
                    .database_failures
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .failed();
                match loudness {
                    Loudness::First => tracing::warn!(
                        table = %table, consumer = %name, key = %delivery.key, error = %why,
                        retry_in = ?delay,
                        "the database failed; deliveries wait, spending no run \
                         (logged again each minute while it fails)"
                    ),
                    Loudness::Again(failing_for) => tracing::error!(
                        table = %table, consumer = %name, error = %why,
                        failing_for = ?failing_for, "the database still fails; deliveries wait"
                    ),
                    Loudness::Quiet => tracing::debug!(
                        table = %table, consumer = %name, key = %delivery.key, error = %why,
                        retry_in = ?delay, "the database failed again; the delivery waits"
                    ),
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => continue,
                    () = crate::shutdown::until_stopped(&mut stop) => break Ended::Left,
                }
            }
            Err(Failed::Handler(e)) => e,
        };
        unreachable.reset();
        runs += 1;
        if failure.is_reject() || runs >= options.max_deliveries {
            inner.metrics.consumed(&delivery.topic, Consumed::Rejected);
            // The handler's error may quote what it could not read: only its kind is logged.
            let why = if failure.is_reject() {
                "rejected by its handler"
            } else {
                "rejected after max_deliveries runs"
            };
            tracing::error!(
                table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
                runs, error = %failure, "delivery {why}"
            );
            break Ended::Rejected(format!("{why}: {failure}"));
        }
        inner.metrics.consumed(&delivery.topic, Consumed::Retried);
        let delay = backoff.failed();
        tracing::warn!(
            table = %table, consumer = %name, key = %delivery.key, topic = %delivery.topic,
            runs, error = %failure, retry_in = ?delay, "delivery failed; running it again"
        );
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = crate::shutdown::until_stopped(&mut stop) => break Ended::Left,
        }
    };
    let settling = match ended {
        Ended::Acked => settle.ack(),
        Ended::Rejected(reason) => settle.reject_for(reason),
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
    inner: &ConsumerShared<H>,
    delivery: &Delivery,
    conn: &mut AsyncPgConnection,
) -> std::result::Result<bool, Failed> {
    let database =
        |e: diesel::result::Error| Failed::Database(inner.outbox.db_error(e).to_string());
    AnsiTransactionManager::begin_transaction(&mut *conn)
        .await
        .map_err(database)?;
    let applied = async {
        let first = match inner.outbox.dedupe(conn, &inner.name, &delivery.key).await {
            Ok(first) => first,
            // A key dedupe cannot take (empty, too long): no run can apply it.
            Err(e @ Error::InvalidMessage(_)) => {
                return Err(Failed::Handler(HandleError::reject(e)));
            }
            Err(e) => return Err(Failed::Database(e.to_string())),
        };
        if !first {
            return Ok(false);
        }
        let timeout = inner.options.handler_timeout;
        let handling = AssertUnwindSafe(inner.handler.handle(delivery, conn)).catch_unwind();
        match tokio::time::timeout(timeout, handling).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => return Err(Failed::Handler(e)),
            Ok(Err(_)) => return Err(Failed::Handler(HandleError::retry("the handler panicked"))),
            Err(_) => {
                return Err(Failed::Handler(HandleError::retry(format!(
                    "the handler took over {timeout:?} (handler_timeout)"
                ))));
            }
        }
        // A handler that swallowed an error of its own statement leaves the transaction
        // aborted, and PostgreSQL would answer the commit with a silent rollback: the
        // delivery would be acknowledged with no effect. This fails in that state.
        conn.batch_execute("SELECT 1").await.map_err(|_| {
            Failed::Handler(HandleError::retry(
                "the handler left its transaction aborted (an error it did not return)",
            ))
        })?;
        Ok(true)
    }
    .await;
    match applied {
        Ok(first) => {
            AnsiTransactionManager::commit_transaction(&mut *conn)
                .await
                .map_err(database)?;
            Ok(first)
        }
        Err(e) => {
            // Bounded: after a cut-off handler the connection may not answer; one left in
            // its transaction is discarded by the pool.
            let _ = tokio::time::timeout(
                SETTLE_TIMEOUT,
                AnsiTransactionManager::rollback_transaction(&mut *conn),
            )
            .await;
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::{Context, SubscriberExt};

    use super::*;

    /// The fields each new span was given, by name, their values as recorded.
    #[derive(Clone, Default)]
    struct Fields(Arc<Mutex<BTreeMap<String, String>>>);

    impl Visit for Fields {
        fn record_str(&mut self, field: &Field, value: &str) {
            let mut fields = self.0.lock().unwrap();
            fields.insert(field.name().to_owned(), value.to_owned());
        }

        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let mut fields = self.0.lock().unwrap();
            fields.insert(field.name().to_owned(), format!("{value:?}"));
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Fields {
        fn on_new_span(
            &self,
            attrs: &tracing::span::Attributes<'_>,
            _: &tracing::span::Id,
            _: Context<'_, S>,
        ) {
            attrs.record(&mut self.clone());
        }
    }

    fn fields_of(group: Option<&str>) -> BTreeMap<String, String> {
        let fields = Fields::default();
        let subscriber = tracing_subscriber::registry().with(fields.clone());
        tracing::subscriber::with_default(subscriber, || {
            let _span = process_span("billing", group, &Delivery::new("k1", "order.created", "x"));
        });
        fields.0.lock().unwrap().clone()
    }

    #[test]
    fn the_consumer_name_and_the_broker_group_have_attributes_of_their_own() {
        let without = fields_of(None);
        assert_eq!(
            without.get("outbox.consumer.name").map(String::as_str),
            Some("billing")
        );
        assert_eq!(
            without.get("messaging.consumer.group.name"),
            None,
            "no broker group, no attribute: {without:?}"
        );
        assert_eq!(
            without
                .get("messaging.destination.name")
                .map(String::as_str),
            Some("order.created")
        );
        let with = fields_of(Some("billing-workers"));
        assert_eq!(
            with.get("messaging.consumer.group.name")
                .map(String::as_str),
            Some("billing-workers")
        );
        assert_eq!(
            with.get("outbox.consumer.name").map(String::as_str),
            Some("billing")
        );
    }
}
