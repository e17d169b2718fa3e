//! How every pipelining broker publishes a batch: every record sent in order, then every
//! acknowledgement awaited, the whole batch within the publisher's timeout. A broker
//! supplies the steps ([`Pipelined`]): open the batch, send one record, fold in one
//! acknowledgement, and settle what is left when the wait ends;
//! [`pipelined_publisher!`](crate::broker::pipeline::pipelined_publisher) writes its
//! `Publisher` impl from them.

use std::future::{Future, IntoFuture};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::time::Instant;

use crate::publisher::{BatchResults, PublishError, Record};

/// One result per record of a batch, in the batch's order.
pub(crate) type Results = Vec<std::result::Result<(), PublishError>>;

/// A record the broker did not take.
pub(crate) struct Unsent {
    /// The record's own result.
    pub(crate) error: PublishError,
    /// Why the records after it cannot be sent either (the connection is gone, the writer
    /// is stuck), if so: each of them is released as an outage with this reason.
    pub(crate) rest: Option<String>,
}

impl Unsent {
    /// This record failed alone; the others go on.
    pub(crate) fn alone(error: PublishError) -> Self {
        Unsent { error, rest: None }
    }
}

/// How the wait for acknowledgements ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ended {
    /// Every acknowledgement came.
    pub(crate) complete: bool,
    /// A record stopped the rest of the batch from being sent (RabbitMQ then lends its
    /// channel to no other batch).
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) held: bool,
}

/// The steps of one broker's pipelined publish.
pub(crate) trait Pipelined: Sync {
    /// One batch's state: what it goes out on and what came back so far.
    type Batch: Send;
    /// An acknowledgement on its way.
    type Ack: IntoFuture<Output = Self::Acked, IntoFuture: Send + 'static> + Send;
    /// What an acknowledgement says.
    type Acked: Send;

    /// The longest a batch takes, connecting included.
    fn timeout(&self) -> std::time::Duration;

    /// Lowers a timeout the user left at its default to at most `max`
    /// ([`Publisher::fit_timeout`](crate::publisher::Publisher::fit_timeout)).
    fn fit_timeout(&mut self, max: std::time::Duration);

    /// Gets ready to send `n` records by `deadline`; `Err(reason)` releases all of them as
    /// an outage.
    fn open(
        &self,
        n: usize,
        deadline: Instant,
    ) -> impl Future<Output = Result<Self::Batch, String>> + Send;

    /// Sends one record (its encoding included), returning its acknowledgement to await.
    fn send(
        &self,
        batch: &Self::Batch,
        record: &Record,
    ) -> impl Future<Output = Result<Self::Ack, Unsent>> + Send;

    /// What a record whose sending outlasted the deadline gets.
    fn send_timed_out(&self, batch: &Self::Batch) -> Unsent;

    /// Completes when the batch's connection is lost, after which no acknowledgement can
    /// come: the wait ends at once. Never, unless the broker can tell.
    fn connection_lost(&self, _batch: &Self::Batch) -> impl Future<Output = ()> + Send + 'static {
        std::future::pending()
    }

    /// Record `i` was not sent.
    fn fail(&self, batch: &mut Self::Batch, i: usize, err: PublishError);

    /// Record `i`'s acknowledgement came.
    fn settle(&self, batch: &mut Self::Batch, i: usize, record: &Record, acked: Self::Acked);

    /// One result per record, once the wait has ended.
    fn finish(&self, batch: Self::Batch, records: &[Record], ended: Ended) -> Results;
}

/// Publishes `records` at once through `broker`'s steps.
pub(crate) async fn publish_all<B: Pipelined>(broker: &B, records: &[Record]) -> Results {
    let deadline = Instant::now() + broker.timeout();
    let mut batch = match broker.open(records.len(), deadline).await {
        Ok(batch) => batch,
        Err(why) => {
            return records
                .iter()
                .map(|_| Err(PublishError::unavailable(why.clone())))
                .collect();
        }
    };
    let lost = broker.connection_lost(&batch);
    let pending = FuturesUnordered::new();
    let mut held: Option<String> = None;
    for (i, record) in records.iter().enumerate() {
        if let Some(why) = &held {
            broker.fail(&mut batch, i, PublishError::unavailable(why.clone()));
            continue;
        }
        let unsent = match tokio::time::timeout_at(deadline, broker.send(&batch, record)).await {
            Ok(Ok(ack)) => {
                pending.push(ack.into_future().map(move |acked| (i, acked)));
                continue;
            }
            Ok(Err(unsent)) => unsent,
            Err(_) => broker.send_timed_out(&batch),
        };
        held = unsent.rest;
        broker.fail(&mut batch, i, unsent.error);
    }
    let complete = gather(broker, &mut batch, records, pending, deadline, lost).await;
    let ended = Ended {
        complete,
        held: held.is_some(),
    };
    broker.finish(batch, records, ended)
}

/// Awaits acknowledgements until all are in, the deadline passes or the connection is lost,
/// then reads those that are in already (a RabbitMQ confirm may carry another record's
/// return). Returns whether every acknowledgement came.
async fn gather<B: Pipelined, F>(
    broker: &B,
    batch: &mut B::Batch,
    records: &[Record],
    mut pending: FuturesUnordered<F>,
    deadline: Instant,
    lost: impl Future<Output = ()>,
) -> bool
where
    F: Future<Output = (usize, B::Acked)>,
{
    let timer = tokio::time::sleep_until(deadline);
    tokio::pin!(timer, lost);
    while !pending.is_empty() {
        tokio::select! {
            biased;
            Some((i, acked)) = pending.next() => broker.settle(batch, i, &records[i], acked),
            () = &mut lost => break,
            () = &mut timer => break,
        }
    }
    while let Some(Some((i, acked))) = pending.next().now_or_never() {
        broker.settle(batch, i, &records[i], acked);
    }
    pending.is_empty()
}

/// A batch whose results all come at once, when `results` is done.
pub(crate) fn all_at_once<'a>(
    results: impl Future<Output = Results> + Send + 'a,
) -> BatchResults<'a> {
    let results = async move { futures_util::stream::iter(results.await.into_iter().enumerate()) };
    Box::pin(futures_util::stream::once(results).flatten())
}

/// The `Publisher` impl of a pipelining broker, from its [`Pipelined`] steps: one record is a
/// batch of one.
macro_rules! pipelined_publisher {
    ($broker:ty) => {
        impl $crate::publisher::Publisher for $broker {
            async fn publish(
                &self,
                record: &$crate::publisher::Record,
            ) -> std::result::Result<(), $crate::publisher::PublishError> {
                $crate::broker::pipeline::publish_all(self, std::slice::from_ref(record))
                    .await
                    .pop()
                    .expect("one result per record")
            }

            fn publish_batch<'a>(
                &'a self,
                records: &'a [$crate::publisher::Record],
            ) -> Option<$crate::publisher::BatchResults<'a>> {
                Some($crate::broker::pipeline::all_at_once(
                    $crate::broker::pipeline::publish_all(self, records),
                ))
            }

            fn timeout(&self) -> Option<std::time::Duration> {
                Some($crate::broker::pipeline::Pipelined::timeout(self))
            }

            fn fit_timeout(&mut self, max: std::time::Duration) {
                $crate::broker::pipeline::Pipelined::fit_timeout(self, max)
            }
        }
    };
}
pub(crate) use pipelined_publisher;

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use futures_util::future::BoxFuture;
    use tokio::sync::oneshot;

    use super::*;

    /// A broker whose records say how they fare: any key is acked at once, `slow` never,
    /// `late` at the very instant the deadline passes; `bad` is refused alone, `stuck` holds
    /// up the rest. The connection is lost when the test says.
    struct Scripted {
        lost: Mutex<Option<oneshot::Receiver<()>>>,
    }

    impl Scripted {
        fn new() -> (Self, oneshot::Sender<()>) {
            let (lost_tx, lost) = oneshot::channel();
            let broker = Scripted {
                lost: Mutex::new(Some(lost)),
            };
            (broker, lost_tx)
        }
    }

    impl Pipelined for Scripted {
        type Batch = Vec<Option<std::result::Result<(), PublishError>>>;
        type Ack = BoxFuture<'static, bool>;
        type Acked = bool;

        fn timeout(&self) -> Duration {
            Duration::from_millis(200)
        }

        fn fit_timeout(&mut self, _max: Duration) {}

        async fn open(&self, n: usize, _deadline: Instant) -> Result<Self::Batch, String> {
            Ok((0..n).map(|_| None).collect())
        }

        async fn send(&self, _: &Self::Batch, record: &Record) -> Result<Self::Ack, Unsent> {
            match record.key.as_str() {
                "bad" => Err(Unsent::alone(PublishError::permanent("too big"))),
                "stuck" => Err(Unsent {
                    error: PublishError::transient("stuck"),
                    rest: Some("held".into()),
                }),
                "slow" => Ok(Box::pin(std::future::pending())),
                "late" => Ok(Box::pin(async {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    true
                })),
                _ => Ok(Box::pin(async { true })),
            }
        }

        fn send_timed_out(&self, _: &Self::Batch) -> Unsent {
            Unsent::alone(PublishError::transient("send timed out"))
        }

        fn connection_lost(&self, _: &Self::Batch) -> impl Future<Output = ()> + Send + 'static {
            let lost = self.lost.lock().unwrap().take().unwrap();
            async move {
                if lost.await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }

        fn fail(&self, batch: &mut Self::Batch, i: usize, err: PublishError) {
            batch[i] = Some(Err(err));
        }

        fn settle(&self, batch: &mut Self::Batch, i: usize, _: &Record, acked: bool) {
            batch[i] = Some(if acked {
                Ok(())
            } else {
                Err(PublishError::transient("nacked"))
            });
        }

        fn finish(&self, batch: Self::Batch, _: &[Record], ended: Ended) -> Results {
            let missing = format!("complete {} held {}", ended.complete, ended.held);
            batch
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(PublishError::transient(missing.clone()))))
                .collect()
        }
    }

    fn records(keys: &[&str]) -> Vec<Record> {
        keys.iter()
            .map(|k| Record::new(*k, "t", Vec::new()))
            .collect()
    }

    fn shown(results: &Results) -> Vec<String> {
        results
            .iter()
            .map(|r| match r {
                Ok(()) => "sent".into(),
                Err(e) => e.to_string(),
            })
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_refused_alone_costs_only_itself_and_one_that_holds_up_the_rest_releases_them()
    {
        let (broker, _lost) = Scripted::new();
        let results = publish_all(&broker, &records(&["a", "bad", "b", "stuck", "c"])).await;
        assert_eq!(
            shown(&results),
            [
                "sent",
                "permanent publish failure: too big",
                "sent",
                "transient publish failure: stuck",
                "broker unavailable: held",
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_at_the_deadline_and_acknowledgements_already_in_are_read() {
        let (broker, _lost) = Scripted::new();
        // `late` is acked as the deadline's timer fires: it still counts.
        let results = publish_all(&broker, &records(&["a", "slow", "late"])).await;
        assert_eq!(
            shown(&results),
            [
                "sent",
                "transient publish failure: complete false held false",
                "sent"
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_connection_ends_the_wait_at_once() {
        let (broker, lost) = Scripted::new();
        let batch = records(&["a", "slow"]);
        let started = Instant::now();
        let publishing = tokio::spawn(async move { publish_all(&broker, &batch).await });
        tokio::time::sleep(Duration::from_millis(10)).await;
        lost.send(()).unwrap();
        let results = publishing.await.unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            shown(&results),
            [
                "sent",
                "transient publish failure: complete false held false"
            ]
        );
    }
}
