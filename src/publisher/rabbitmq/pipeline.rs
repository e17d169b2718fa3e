//! One batch published at once: every record written, then every confirm awaited, and the
//! broker's confirms and returns matched to their records in whatever order they come.

use std::collections::HashMap;
use std::future::Future;

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use lapin::Confirmation;
use lapin::options::BasicPublishOptions;
use tokio::time::Instant;

use super::RabbitMqPublisher;
use super::connection::{Lent, classify, closed_by_broker_side};
use super::properties::properties;
use crate::publisher::{PublishError, Record};

impl RabbitMqPublisher {
    /// Publishes every record, then awaits every confirm; the whole batch, connecting
    /// included, within the confirm timeout.
    pub(super) async fn publish_pipelined(
        &self,
        records: &[Record],
    ) -> Vec<std::result::Result<(), PublishError>> {
        let deadline = Instant::now() + self.confirm_timeout;
        let all = |err: &dyn Fn() -> PublishError| records.iter().map(|_| Err(err())).collect();
        let lent = match tokio::time::timeout_at(deadline, self.channel()).await {
            Ok(Ok(lent)) => lent,
            Ok(Err(why)) => return all(&|| PublishError::unavailable(why.clone())),
            Err(_) => {
                return all(&|| {
                    PublishError::unavailable(format!(
                        "no channel on RabbitMQ at {} within {:?}",
                        self.endpoint.name, self.confirm_timeout
                    ))
                });
            }
        };
        let Lent {
            channel,
            status,
            frame_max,
        } = lent;
        let blocked = || {
            PublishError::unavailable(format!(
                "RabbitMQ at {} blocked the connection (a resource alarm is on)",
                self.endpoint.name
            ))
        };
        if status.blocked() {
            return all(&blocked);
        }
        let mut confirms = Confirms::new(records);
        let options = BasicPublishOptions {
            mandatory: self.mandatory,
            immediate: false,
        };
        let pending = FuturesUnordered::new();
        let mut unwritten: Option<PublishError> = None;
        for (i, record) in records.iter().enumerate() {
            if let Some(why) = &unwritten {
                confirms.fail(i, PublishError::unavailable(why.to_string()));
                continue;
            }
            let (routing_key, properties) = match properties(record, frame_max) {
                Ok(p) => p,
                Err(e) => {
                    confirms.fail(i, e);
                    continue;
                }
            };
            let publish = channel.basic_publish(
                self.exchange.clone(),
                routing_key,
                options,
                &record.payload,
                properties,
            );
            match tokio::time::timeout_at(deadline, publish).await {
                Ok(Ok(confirm)) => pending.push(async move { (i, settled(confirm.await)) }),
                Ok(Err(e)) => {
                    // Not written: the channel or the connection is gone.
                    let err = classify(&e, format!("publish failed: {e}"));
                    if err.is_unavailable() {
                        unwritten = Some(PublishError::unavailable(format!("publish failed: {e}")));
                    }
                    confirms.fail(i, err);
                }
                Err(_) => {
                    // The writer is stuck: a blocked connection stops lapin writing (an
                    // outage); on a healthy one this record could not be written in time
                    // (charged, so a record that never goes through ends dead), and the
                    // rest is released.
                    let why = if status.blocked() {
                        blocked()
                    } else {
                        PublishError::transient(format!(
                            "RabbitMQ at {} took not all of this message's frames within {:?}",
                            self.endpoint.name, self.confirm_timeout
                        ))
                    };
                    unwritten = Some(PublishError::unavailable(format!(
                        "not written: an earlier message of the batch could not be written \
                         within {:?}",
                        self.confirm_timeout
                    )));
                    confirms.fail(i, why);
                }
            }
        }
        let complete = gather(pending, deadline, &mut confirms).await;
        if !complete {
            tracing::warn!(endpoint = %self.endpoint.name, timeout = ?self.confirm_timeout, "RabbitMQ confirm timeout");
        }
        let exchange = self.exchange.as_str();
        let timed_out = || {
            if status.blocked() {
                blocked()
            } else {
                PublishError::transient(format!(
                    "no confirm within the confirm timeout ({:?})",
                    self.confirm_timeout
                ))
            }
        };
        let results = confirms.finish(exchange, &timed_out);
        // A channel whose confirms did not all come may be stuck, and late returns would
        // land on the next batch: it is not reused.
        if complete && unwritten.is_none() {
            self.give_back(channel);
        }
        results
    }
}
/// What one confirm said, reduced to what the outcome needs.
#[derive(Debug)]
enum Settled {
    Ack,
    Nack,
    Failed(PublishError),
    /// The channel or connection went down after the record was written. lapin fails every
    /// confirm still awaited on it alike, so whose fault it was is not known: see
    /// [`Confirms::finish`].
    Lost {
        broker_side: bool,
        text: String,
    },
}

/// A message the broker returned (unroutable with `mandatory`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Returned {
    message_id: Option<String>,
    code: u16,
    text: String,
}

fn settled(confirmation: lapin::Result<Confirmation>) -> (Settled, Option<Returned>) {
    let returned = |message: lapin::message::BasicReturnMessage| Returned {
        message_id: message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string()),
        code: message.reply_code,
        text: message.reply_text.to_string(),
    };
    match confirmation {
        Ok(Confirmation::Ack(message)) => (Settled::Ack, message.map(returned)),
        // A nack can carry a return too: harvest it like one on an ack.
        Ok(Confirmation::Nack(message)) => (Settled::Nack, message.map(returned)),
        Ok(Confirmation::NotRequested) => (
            Settled::Failed(PublishError::transient(
                "the channel is not in confirm mode",
            )),
            None,
        ),
        Err(e) => {
            let broker_side = closed_by_broker_side(&e);
            (
                Settled::Lost {
                    broker_side,
                    text: format!("confirm failed: {e}"),
                },
                None,
            )
        }
    }
}

/// Awaits confirms until all are in or the deadline passes, then reads those that are in
/// already (they may carry a return). Returns whether every confirm came.
async fn gather<F>(
    mut pending: FuturesUnordered<F>,
    deadline: Instant,
    confirms: &mut Confirms<'_>,
) -> bool
where
    F: Future<Output = (usize, (Settled, Option<Returned>))>,
{
    let timer = tokio::time::sleep_until(deadline);
    tokio::pin!(timer);
    while !pending.is_empty() {
        tokio::select! {
            biased;
            Some((i, (settled, returned))) = pending.next() => confirms.settle(i, settled, returned),
            () = &mut timer => break,
        }
    }
    while let Some(Some((i, (settled, returned)))) = pending.next().now_or_never() {
        confirms.settle(i, settled, returned);
    }
    pending.is_empty()
}

/// The results of one pipelined batch, as its confirms and returns come in, in any order.
struct Confirms<'a> {
    records: &'a [Record],
    results: Vec<Option<std::result::Result<(), PublishError>>>,
    returned: Vec<Returned>,
    /// Records whose confirm failed because the channel went down: `(index, closed by the
    /// broker's side, error)`.
    lost: Vec<(usize, bool, String)>,
}

impl<'a> Confirms<'a> {
    fn new(records: &'a [Record]) -> Self {
        Confirms {
            records,
            results: records.iter().map(|_| None).collect(),
            returned: Vec::new(),
            lost: Vec::new(),
        }
    }

    /// Record `i` failed before anything was written.
    fn fail(&mut self, i: usize, err: PublishError) {
        self.results[i] = Some(Err(err));
    }

    /// Record `i`'s confirm arrived, perhaps with another record's return attached.
    fn settle(&mut self, i: usize, settled: Settled, returned: Option<Returned>) {
        self.returned.extend(returned);
        self.results[i] = Some(match settled {
            Settled::Ack => Ok(()),
            Settled::Nack => Err(PublishError::transient("the broker nacked the message")),
            Settled::Failed(err) => Err(err),
            Settled::Lost { broker_side, text } => {
                self.lost.push((i, broker_side, text));
                return;
            }
        });
    }

    /// One result per record: a returned record failed whatever its own confirm said; a
    /// record without a confirm failed with `unconfirmed()`. Of the records whose channel
    /// went down under them, the first written is charged a transient failure (it may be the
    /// one that brought the channel down; a message that does so every time must end dead,
    /// not be retried forever) and the others are released as an outage; a close on the
    /// broker's side (a missing exchange, a broker shutting down) is an outage for all.
    fn finish(
        mut self,
        exchange: &str,
        unconfirmed: &dyn Fn() -> PublishError,
    ) -> Vec<std::result::Result<(), PublishError>> {
        self.lost.sort_by_key(|(i, _, _)| *i);
        let mut charged = false;
        for (i, broker_side, text) in std::mem::take(&mut self.lost) {
            let err = if broker_side || charged {
                PublishError::unavailable(text)
            } else {
                charged = true;
                PublishError::transient(text)
            };
            self.results[i] = Some(Err(err));
        }
        let index: HashMap<&str, usize> = self
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.key.as_str(), i))
            .collect();
        for returned in &self.returned {
            if let Some(&i) = returned.message_id.as_deref().and_then(|id| index.get(id)) {
                self.results[i] = Some(Err(PublishError::transient(format!(
                    "unroutable: exchange {exchange:?} returned topic {:?} ({} {})",
                    self.records[i].topic, returned.code, returned.text
                ))));
            }
        }
        self.results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(unconfirmed())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(key: &str) -> Record {
        Record::new(key, "t", Vec::new())
    }

    fn returned(key: &str) -> Option<Returned> {
        Some(Returned {
            message_id: Some(key.into()),
            code: 312,
            text: "NO_ROUTE".into(),
        })
    }

    fn outcome(results: &[std::result::Result<(), PublishError>]) -> Vec<String> {
        results
            .iter()
            .map(|r| match r {
                Ok(()) => "sent".into(),
                Err(e) if e.to_string().contains("unroutable") => "returned".into(),
                Err(e) => e.to_string(),
            })
            .collect()
    }

    #[test]
    fn a_return_fails_its_own_record_whichever_confirm_carries_it_and_in_any_order() {
        let records = [record("a"), record("b"), record("c")];
        let unconfirmed = || PublishError::transient("no confirm");
        // b's return rides on a's ack, which comes before b's own ack...
        let mut early = Confirms::new(&records);
        early.settle(0, Settled::Ack, returned("b"));
        early.settle(1, Settled::Ack, None);
        early.settle(2, Settled::Ack, None);
        assert_eq!(
            outcome(&early.finish("x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // ...or after it, on c's ack.
        let mut late = Confirms::new(&records);
        late.settle(1, Settled::Ack, None);
        late.settle(0, Settled::Ack, None);
        late.settle(2, Settled::Ack, returned("b"));
        assert_eq!(
            outcome(&late.finish("x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // A return attached to a nack is not lost.
        let mut nacked = Confirms::new(&records);
        nacked.settle(0, Settled::Ack, None);
        nacked.settle(2, Settled::Nack, returned("b"));
        nacked.settle(1, Settled::Ack, None);
        let results = nacked.finish("x", &unconfirmed);
        assert_eq!(outcome(&results)[..2], ["sent", "returned"]);
        assert!(
            results[2]
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("nacked")
        );
    }

    #[test]
    fn a_channel_lost_under_a_batch_charges_only_its_first_written_record() {
        let records = [record("a"), record("b"), record("c"), record("d")];
        let lost = |broker_side| Settled::Lost {
            broker_side,
            text: "confirm failed: channel closed".into(),
        };
        let mut closed = Confirms::new(&records);
        closed.settle(0, Settled::Ack, None);
        closed.settle(3, lost(false), None);
        closed.settle(1, lost(false), None);
        closed.settle(2, lost(false), None);
        let results = closed.finish("x", &|| PublishError::transient("no confirm"));
        assert!(results[0].is_ok());
        let b = results[1].as_ref().unwrap_err();
        assert!(!b.is_unavailable() && !b.is_permanent(), "{b}");
        assert!(results[2].as_ref().unwrap_err().is_unavailable());
        assert!(results[3].as_ref().unwrap_err().is_unavailable());

        let mut missing = Confirms::new(&records);
        for i in 0..4 {
            missing.settle(i, lost(true), None);
        }
        let results = missing.finish("x", &|| PublishError::transient("no confirm"));
        assert!(
            results
                .iter()
                .all(|r| r.as_ref().unwrap_err().is_unavailable())
        );
    }

    #[tokio::test]
    async fn confirms_already_in_at_the_deadline_are_still_read() {
        let records = [record("a"), record("b"), record("c")];
        let mut confirms = Confirms::new(&records);
        type Confirm =
            futures_util::future::BoxFuture<'static, (usize, (Settled, Option<Returned>))>;
        let pending: FuturesUnordered<Confirm> = FuturesUnordered::new();
        // c's confirm carries b's return and is ready; b's own confirm never comes.
        pending.push(Box::pin(async { (0, (Settled::Ack, None)) }));
        pending.push(Box::pin(std::future::pending()));
        pending.push(Box::pin(async { (2, (Settled::Ack, returned("b"))) }));
        // The deadline has passed before anything was awaited.
        let complete = gather(pending, Instant::now(), &mut confirms).await;
        assert!(!complete);
        let results = confirms.finish("x", &|| PublishError::transient("no confirm"));
        assert_eq!(outcome(&results), ["sent", "returned", "sent"]);
    }
}
