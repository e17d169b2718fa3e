//! One batch published at once: every record written, then every confirm awaited, and the
//! broker's confirms and returns matched to their records in whatever order they come.

use std::collections::HashMap;

use lapin::options::BasicPublishOptions;
use lapin::{Confirmation, PublisherConfirm};
use tokio::time::Instant;

use super::RabbitMqPublisher;
use super::connection::{Began, Lent, classify, closed_by_broker_side};
use super::properties::properties;
use crate::broker::pipeline::{Ended, Pipelined, Results, Unsent};
use crate::publisher::{PublishError, Record};

/// One batch on its way: the channel it is published on, what it noted of the broker's
/// alarm notices when it began, and its confirms so far.
pub(crate) struct Batch {
    lent: Lent,
    began: Began,
    confirms: Confirms,
}

impl RabbitMqPublisher {
    /// The connection is blocked by a resource alarm.
    fn blocked_reason(&self) -> String {
        format!(
            "RabbitMQ at {} blocked the connection (a resource alarm is on)",
            self.endpoint.name
        )
    }

    /// For a batch that ran out of time: an outage if a resource alarm held it up (it
    /// blocks the connection now, or [`Blocks::touched`](super::connection::Blocks::touched)
    /// the batch; the wake lasts one confirm timeout), else `None`.
    fn held_up(&self, lent: &Lent, began: Began) -> Option<PublishError> {
        (lent.blocked() || self.blocks.touched(began, self.confirm_timeout)).then(|| {
            PublishError::unavailable(format!(
                "RabbitMQ at {} held the batch up: a resource alarm blocked the connection",
                self.endpoint.name
            ))
        })
    }
}

/// Every record published, then every confirm awaited; the whole batch, connecting
/// included, within the confirm timeout.
impl Pipelined for RabbitMqPublisher {
    type Batch = Batch;
    type Ack = PublisherConfirm;
    type Acked = lapin::Result<Confirmation>;

    fn timeout(&self) -> std::time::Duration {
        self.confirm_timeout
    }

    fn fit_timeout(&mut self, max: std::time::Duration) {
        if !self.confirm_timeout_set {
            self.confirm_timeout = self.confirm_timeout.min(max);
        }
    }

    async fn open(&self, n: usize, deadline: Instant) -> Result<Batch, String> {
        // Noted before waiting for a channel: an alarm that holds up the wait is an
        // outage too, even when it clears before the channel comes.
        let began = self.blocks.begin();
        let lent = match tokio::time::timeout_at(deadline, self.channel()).await {
            Ok(Ok(lent)) => lent,
            Ok(Err(why)) => return Err(why),
            Err(_) => {
                return Err(format!(
                    "no channel on RabbitMQ at {} within {:?}",
                    self.endpoint.name, self.confirm_timeout
                ));
            }
        };
        if lent.blocked() {
            return Err(self.blocked_reason());
        }
        Ok(Batch {
            lent,
            began,
            confirms: Confirms::new(n),
        })
    }

    async fn send(&self, batch: &Batch, record: &Record) -> Result<PublisherConfirm, Unsent> {
        let (routing_key, properties) =
            properties(record, batch.lent.frame_max).map_err(Unsent::alone)?;
        let options = BasicPublishOptions {
            mandatory: self.mandatory,
            immediate: false,
        };
        let publish = batch.lent.channel.basic_publish(
            self.exchange.clone(),
            routing_key,
            options,
            &record.payload,
            properties,
        );
        publish.await.map_err(|e| {
            // Not written: the channel or the connection is gone.
            let error = classify(&e, format!("not written: {e}"));
            let rest = error.is_unavailable().then(|| format!("not written: {e}"));
            Unsent { error, rest }
        })
    }

    fn send_timed_out(&self, batch: &Batch) -> Unsent {
        // The writer is stuck: a blocked connection stops lapin writing (an outage, also
        // when the alarm cleared just before the deadline); on a healthy one this record
        // could not be written in time (charged, so a record that never goes through ends
        // dead), and the rest is released.
        let error = self.held_up(&batch.lent, batch.began).unwrap_or_else(|| {
            PublishError::transient(format!(
                "RabbitMQ at {} took not all of this message's frames within {:?}",
                self.endpoint.name, self.confirm_timeout
            ))
        });
        Unsent {
            error,
            rest: Some(format!(
                "not written: an earlier message of the batch could not be written within {:?}",
                self.confirm_timeout
            )),
        }
    }

    fn fail(&self, batch: &mut Batch, i: usize, err: PublishError) {
        batch.confirms.fail(i, err);
    }

    fn settle(&self, batch: &mut Batch, i: usize, _: &Record, acked: lapin::Result<Confirmation>) {
        let (settled, returned) = settled(acked);
        batch.confirms.settle(i, settled, returned);
    }

    fn finish(&self, batch: Batch, records: &[Record], ended: Ended) -> Results {
        if !ended.complete {
            tracing::warn!(endpoint = %self.endpoint.name, timeout = ?self.confirm_timeout, "RabbitMQ confirm timeout");
        }
        let Batch {
            lent,
            began,
            confirms,
        } = batch;
        let timed_out = || {
            self.held_up(&lent, began).unwrap_or_else(|| {
                PublishError::transient(format!(
                    "no confirm within the confirm timeout ({:?})",
                    self.confirm_timeout
                ))
            })
        };
        let results = confirms.finish(records, self.exchange.as_str(), &timed_out);
        // A channel whose confirms did not all come may be stuck, and late returns would
        // land on the next batch: it is not reused.
        if ended.complete && !ended.held {
            self.give_back(lent.channel);
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

/// The results of one pipelined batch, as its confirms and returns come in, in any order.
struct Confirms {
    results: Vec<Option<std::result::Result<(), PublishError>>>,
    returned: Vec<Returned>,
    /// Records whose confirm failed because the channel went down: `(index, closed by the
    /// broker's side, error)`.
    lost: Vec<(usize, bool, String)>,
}

impl Confirms {
    fn new(n: usize) -> Self {
        Confirms {
            results: (0..n).map(|_| None).collect(),
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
        records: &[Record],
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
        let index: HashMap<&str, usize> = records
            .iter()
            .enumerate()
            .map(|(i, r)| (r.key.as_str(), i))
            .collect();
        for returned in &self.returned {
            if let Some(&i) = returned.message_id.as_deref().and_then(|id| index.get(id)) {
                self.results[i] = Some(Err(PublishError::transient(format!(
                    "unroutable: exchange {exchange:?} returned topic {:?} ({} {})",
                    records[i].topic, returned.code, returned.text
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
        let mut early = Confirms::new(records.len());
        early.settle(0, Settled::Ack, returned("b"));
        early.settle(1, Settled::Ack, None);
        early.settle(2, Settled::Ack, None);
        assert_eq!(
            outcome(&early.finish(&records, "x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // ...or after it, on c's ack.
        let mut late = Confirms::new(records.len());
        late.settle(1, Settled::Ack, None);
        late.settle(0, Settled::Ack, None);
        late.settle(2, Settled::Ack, returned("b"));
        assert_eq!(
            outcome(&late.finish(&records, "x", &unconfirmed)),
            ["sent", "returned", "sent"]
        );
        // A return attached to a nack is not lost.
        let mut nacked = Confirms::new(records.len());
        nacked.settle(0, Settled::Ack, None);
        nacked.settle(2, Settled::Nack, returned("b"));
        nacked.settle(1, Settled::Ack, None);
        let results = nacked.finish(&records, "x", &unconfirmed);
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
        let mut closed = Confirms::new(records.len());
        closed.settle(0, Settled::Ack, None);
        closed.settle(3, lost(false), None);
        closed.settle(1, lost(false), None);
        closed.settle(2, lost(false), None);
        let results = closed.finish(&records, "x", &|| PublishError::transient("no confirm"));
        assert!(results[0].is_ok());
        let b = results[1].as_ref().unwrap_err();
        assert!(!b.is_unavailable() && !b.is_permanent(), "{b}");
        assert!(results[2].as_ref().unwrap_err().is_unavailable());
        assert!(results[3].as_ref().unwrap_err().is_unavailable());

        let mut missing = Confirms::new(records.len());
        for i in 0..4 {
            missing.settle(i, lost(true), None);
        }
        let results = missing.finish(&records, "x", &|| PublishError::transient("no confirm"));
        assert!(
            results
                .iter()
                .all(|r| r.as_ref().unwrap_err().is_unavailable())
        );
    }
}
