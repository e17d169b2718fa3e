//! The steps of a pipelined batch on Kafka: every record produced, then every delivery
//! report awaited; each report told apart as a message's failure or an outage.

use std::future::Future;
use std::sync::RwLock;

use rdkafka::producer::future_producer::DeliveryFuture;
use rdkafka::producer::{FutureRecord, Producer};

use tokio::time::Instant;

use super::properties::{classify, outgoing, producer_spent};
use super::{KafkaProducer, KafkaPublisher};
use crate::broker::pipeline::{Ended, Pipelined, Results, Unsent};
use crate::publisher::{PublishError, Record};

/// One batch on its way: the producer it goes out through (and its number), and its
/// results so far.
pub(crate) struct Batch {
    number: u64,
    producer: KafkaProducer,
    results: Vec<Option<std::result::Result<(), PublishError>>>,
}

/// Every record produced to librdkafka's queue, then every delivery report awaited; the
/// whole batch within the delivery timeout (librdkafka's `message.timeout.ms` ends a bit
/// before, so its own report comes first).
impl Pipelined for KafkaPublisher {
    type Batch = Batch;
    type Ack = DeliveryFuture;
    type Acked = <DeliveryFuture as Future>::Output;

    fn timeout(&self) -> std::time::Duration {
        self.delivery_timeout
    }

    fn fit_timeout(&mut self, max: std::time::Duration) {
        if !self.delivery_timeout_set && self.delivery_timeout > max {
            match super::producer(&self.config, max, &self.observed) {
                Ok(producer) => {
                    let number = self.producer.get_mut().map_or(1, |slot| slot.0 + 1);
                    self.producer = RwLock::new((number, producer));
                    self.delivery_timeout = max;
                }
                Err(e) => {
                    tracing::warn!(endpoint = %self.endpoint, error = %e, "kept the Kafka producer's delivery timeout");
                }
            }
        }
    }

    async fn open(&self, n: usize, _deadline: Instant) -> Result<Batch, String> {
        let (number, producer) = self.live_producer()?;
        Ok(Batch {
            number,
            producer,
            results: (0..n).map(|_| None).collect(),
        })
    }

    async fn send(&self, batch: &Batch, record: &Record) -> Result<DeliveryFuture, Unsent> {
        let message = outgoing(record, &self.prefix, self.layout).map_err(Unsent::alone)?;
        let produced = FutureRecord::to(&message.topic)
            .key(&message.key)
            .payload(&record.payload)
            .headers(message.headers);
        batch.producer.send_result(produced).map_err(|(e, _)| {
            if producer_spent(&e) {
                self.mark_spent(batch.number);
            }
            let error = classify(&e, &self.endpoint);
            let rest = error
                .is_unavailable()
                .then(|| format!("not produced: Kafka at {} took no message", self.endpoint));
            Unsent { error, rest }
        })
    }

    fn send_timed_out(&self, _batch: &Batch) -> Unsent {
        // Producing only queues the message: it does not wait, so this is the deadline
        // passing between two records.
        Unsent {
            error: PublishError::unavailable(format!(
                "Kafka at {} took no message within {:?}",
                self.endpoint, self.delivery_timeout
            )),
            rest: Some("not produced: the batch's deadline passed".into()),
        }
    }

    fn fail(&self, batch: &mut Batch, i: usize, err: PublishError) {
        batch.results[i] = Some(Err(err));
    }

    fn settle(&self, batch: &mut Batch, i: usize, _: &Record, acked: Self::Acked) {
        batch.results[i] = Some(match acked {
            Ok(Ok(_)) => Ok(()),
            Ok(Err((e, _))) => {
                if producer_spent(&e) {
                    self.mark_spent(batch.number);
                }
                Err(classify(&e, &self.endpoint))
            }
            Err(_canceled) => Err(PublishError::unavailable(format!(
                "the producer for Kafka at {} closed before the delivery report",
                self.endpoint
            ))),
        });
    }

    fn finish(&self, batch: Batch, _records: &[Record], ended: Ended) -> Results {
        if !ended.complete {
            tracing::warn!(endpoint = %self.endpoint, timeout = ?self.delivery_timeout, "Kafka delivery timeout");
        }
        // Asked once, and only if a report is missing.
        let mut in_flight = None;
        batch
            .results
            .into_iter()
            .map(|r| {
                // librdkafka reports a message's own failure by itself: no report at all
                // means no broker answered (one that stopped responding keeps its
                // requests in flight), which is an outage.
                r.unwrap_or_else(|| {
                    let in_flight =
                        *in_flight.get_or_insert_with(|| batch.producer.in_flight_count());
                    Err(PublishError::unavailable(format!(
                        "Kafka at {} sent no delivery report within the delivery timeout \
                         ({:?}; {in_flight} messages still in flight)",
                        self.endpoint, self.delivery_timeout
                    )))
                })
            })
            .collect()
    }
}
