//! The consumer runner's Kafka source, public as `consumer::kafka::Source` (its docs are
//! there).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::BoxFuture;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaResult;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, ClientContext, Offset, TopicPartitionList};

use super::dead_letters::{DeadLetterProducer, DeadLetterTopic, Letter};
use super::properties::{CONTENT_TYPE_HEADER, MESSAGE_ID_HEADER, TOPIC_HEADER, check_topic};
use super::{Client, Observed, Properties, Sasl, Security, brokers, passthrough};
use crate::consumer::{Delivery, Incoming, Settle};
use crate::error::BoxError;
use crate::publisher::{AGGREGATE_HEADER, ATTEMPT_HEADER};
use crate::streak::{Loudness, Streak};
use crate::tls::Tls;

/// How long `verify` waits for the list of topics.
const VERIFY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Where a consumer group that has committed no offset for a partition starts reading it:
/// librdkafka's `auto.offset.reset`, which also applies when the committed offset is gone
/// (deleted by the topic's retention). Set with [`Source::start_from`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartFrom {
    /// At the partition's first message still kept: a new group consumes everything the
    /// topic holds, a group whose offset was deleted reads again what is kept (the dedupe
    /// absorbs what it applied before, within the inbox's retention). The default.
    #[default]
    Earliest,
    /// At the partition's end when the group joins: a new group consumes only messages
    /// produced after that.
    ///
    /// Hazard: messages produced before are never delivered to the group, those the relay
    /// published before the group's first start included, and so are those past a deleted
    /// offset.
    Latest,
}

impl StartFrom {
    fn name(self) -> &'static str {
        match self {
            StartFrom::Earliest => "earliest",
            StartFrom::Latest => "latest",
        }
    }
}

/// Kafka topics, consumed by a consumer group, as the source of a
/// [`Consumer`](crate::consumer::Consumer).
pub struct Source {
    brokers: String,
    group: String,
    topics: Vec<String>,
    prefix: String,
    start_from: StartFrom,
    security: Security,
    properties: Properties,
    offsets: Arc<Mutex<Offsets>>,
    consumer: Option<Arc<StreamConsumer<Tracked>>>,
    dead_letters: Arc<DeadLetterTopic>,
    producer: Option<DeadLetterProducer>,
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Source")
            .field(
                "brokers",
                &brokers(&self.brokers).unwrap_or_else(|_| "(not host:port)".into()),
            )
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("tls", &self.security.tls)
            .field("sasl", &self.security.sasl)
            .field("start_from", &self.start_from)
            .field("dead_letters", &self.dead_letters)
            .field("properties", &self.properties)
            .field("subscribed", &self.consumer.is_some())
            .finish_non_exhaustive()
    }
}

impl Source {
    /// Consumes `topics` on the Kafka cluster reached through `brokers` (`host:port`, or
    /// several separated by commas) as a member of consumer group `group`. A group that
    /// has committed nothing starts at the beginning of each partition, unless
    /// [`start_from`](Self::start_from) says otherwise.
    pub fn group(
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Source {
            brokers: brokers.into(),
            group: group.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            prefix: String::new(),
            start_from: StartFrom::default(),
            security: Security::default(),
            properties: Properties::default(),
            offsets: Arc::default(),
            consumer: None,
            dead_letters: Arc::default(),
            producer: None,
        }
    }

    /// Sends every dead letter to `topic`, whatever topic it was consumed from. By default
    /// each goes to `<its topic>.dlt`.
    ///
    /// A dead letter is a message the handler rejected (or ran `max_deliveries` times
    /// without success), or one without the `x-outbox-message-id` header, which cannot be
    /// deduplicated. It is produced with the message's key, value and headers, plus
    /// `x-outbox-dlt-topic`, `x-outbox-dlt-partition`, `x-outbox-dlt-offset` (where it was
    /// consumed) and `x-outbox-dlt-reason` (why), by an idempotent producer with
    /// `acks=all`, and the message's offset is committed only once Kafka confirmed it. When
    /// that fails (no dead-letter topic on a cluster that creates none, say) the offset is
    /// not committed: the partition's commits stop there, and the message is delivered
    /// again after a restart or a rebalance. Create the topics first
    /// ([`Topology::dead_letter_topics`](crate::kafka::Topology::dead_letter_topics), or
    /// `diesel-outbox declare --broker kafka --dead-letter-topics`).
    ///
    /// Hazard: the reason holds the handler's error as text, which may quote the message.
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letters = Arc::new(DeadLetterTopic::Named(topic.into()));
        self
    }

    /// Sends no dead letters: a message the handler rejected is logged and skipped (its
    /// offset committed), as is one without an idempotency key.
    pub fn without_dead_letter_topic(mut self) -> Self {
        self.dead_letters = Arc::new(DeadLetterTopic::Off);
        self
    }

    /// The relay's topic prefix: taken off the front of each topic to give the delivery's
    /// topic (as the record had it). Defaults to none. A message published by aggregate
    /// type ([`Layout::ByAggregateType`](crate::kafka::Layout::ByAggregateType)) carries its
    /// topic in the `x-outbox-topic` header, which the delivery's topic is then taken from.
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Connects over TLS, as
    /// [`KafkaPublisherBuilder::tls`](crate::kafka::KafkaPublisherBuilder::tls) does.
    /// Defaults to plain TCP.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.security.tls = Some(tls);
        self
    }

    /// Logs in with SASL; see [`Sasl`]. Defaults to none.
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.security.sasl = Some(sasl);
        self
    }

    /// Where the group starts in a partition it has no committed offset for (a new group,
    /// or an offset the topic's retention deleted); see [`StartFrom`]. Defaults to
    /// [`StartFrom::Earliest`]. A group that has committed an offset resumes there either
    /// way.
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.start_from = start;
        self
    }

    /// Sets the librdkafka property `key` to `value` on the consumer, as
    /// [`KafkaPublisherBuilder::property`](crate::kafka::KafkaPublisherBuilder::property)
    /// does on the producer (an OAUTHBEARER login is shown there; `client.id` defaults to
    /// "diesel-outbox consumer"). The value never appears in `Debug`, logs or errors.
    ///
    /// The keys the crate owns are refused by the consumer's `build()` with
    /// [`Error::InvalidOption`](crate::Error::InvalidOption), naming the key and why:
    /// `group.id` (the `group` argument), `enable.auto.commit` and
    /// `enable.auto.offset.store` (offsets move only past settled messages),
    /// `auto.offset.reset` (use [`start_from`](Self::start_from)),
    /// `allow.auto.create.topics` (a missing topic is reported, never created),
    /// `enable.partition.eof`, `bootstrap.servers`, the verification of the brokers'
    /// certificates and names, and what [`tls`](Self::tls) and [`sasl`](Self::sasl) set
    /// once given.
    pub fn property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push(key, value);
        self
    }

    /// The consumer's settings, and the brokers as `host:port,…`.
    fn config(&self) -> Result<(ClientConfig, String), BoxError> {
        let endpoint = brokers(&self.brokers)?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &endpoint)
            .set("group.id", &self.group)
            .set("client.id", "diesel-outbox consumer")
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", self.start_from.name())
            // Subscribing to a topic that does not exist must not create it.
            .set("allow.auto.create.topics", "false");
        self.security.apply(&mut config)?;
        self.properties.check(Client::Consumer, &self.security)?;
        self.properties.apply(&mut config);
        Ok((config, endpoint))
    }

    fn subscribe(&mut self) -> Result<Arc<StreamConsumer<Tracked>>, BoxError> {
        if let Some(consumer) = &self.consumer {
            return Ok(consumer.clone());
        }
        let (config, endpoint) = self.config()?;
        let consumer: StreamConsumer<Tracked> = config
            .create_with_context(Tracked {
                offsets: self.offsets.clone(),
                observed: Observed::default(),
                commits: Mutex::default(),
            })
            .map_err(|e| {
                format!(
                    "the Kafka consumer for {endpoint}: {}",
                    passthrough::refused(&e, &config)
                )
            })?;
        if *self.dead_letters != DeadLetterTopic::Off && self.producer.is_none() {
            self.producer = Some(super::dead_letters::producer(
                &endpoint,
                &self.security,
                &self.properties,
            )?);
        }
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| format!("subscribing to {topics:?} on Kafka at {endpoint}: {e}"))?;
        let consumer = Arc::new(consumer);
        self.consumer = Some(consumer.clone());
        Ok(consumer)
    }

    /// The message as a delivery, or `None` when it has no idempotency key.
    fn delivery(&self, message: &BorrowedMessage<'_>) -> Option<Delivery> {
        let mut headers = BTreeMap::new();
        if let Some(all) = message.headers() {
            for header in all.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                headers.insert(header.key.to_owned(), value);
            }
        }
        let key = headers.remove(MESSAGE_ID_HEADER)?;
        // Published by aggregate type, the message's own topic is in a header.
        let topic = headers.remove(TOPIC_HEADER).unwrap_or_else(|| {
            let topic = message.topic();
            topic.strip_prefix(&self.prefix).unwrap_or(topic).to_owned()
        });
        Some(Delivery {
            key,
            topic,
            payload: message.payload().unwrap_or_default().to_vec(),
            content_type: headers.remove(CONTENT_TYPE_HEADER),
            attempt: headers
                .remove(ATTEMPT_HEADER)
                .and_then(|a| a.parse().ok())
                .unwrap_or(1),
            aggregate_key: headers.remove(AGGREGATE_HEADER),
            headers,
            redelivered: false,
        })
    }
}

impl crate::consumer::Source for Source {
    async fn next(&mut self, _prefetch: u16) -> Result<Incoming, BoxError> {
        let consumer = self.subscribe()?;
        loop {
            // Cancel safe: a message is taken off librdkafka's queue only when returned.
            let message = consumer
                .recv()
                .await
                .map_err(|e| format!("Kafka consumer group {}: {e}", self.group))?;
            let (topic, partition, offset) = (
                message.topic().to_owned(),
                message.partition(),
                message.offset(),
            );
            let epoch = lock(&self.offsets).handed(&topic, partition, offset);
            let letter = self
                .producer
                .as_ref()
                .map(|producer| Letter::of(producer.clone(), self.dead_letters.clone(), &message));
            let settle = Box::new(Commit {
                consumer: consumer.clone(),
                offsets: self.offsets.clone(),
                topic,
                partition,
                offset,
                epoch,
                letter,
            });
            let Some(delivery) = self.delivery(&message) else {
                drop(message);
                // On a task of its own: `next` stays cancel safe (the runner may drop it
                // while the dead letter is produced).
                tokio::spawn(async move {
                    let reason =
                        format!("no {MESSAGE_ID_HEADER} header: it cannot be deduplicated");
                    let _ = settle.dead_letter(&reason).await;
                });
                continue;
            };
            return Ok(Incoming { delivery, settle });
        }
    }

    async fn verify(&mut self) -> Result<(), String> {
        let Ok((config, endpoint)) = self.config() else {
            return Ok(()); // `check` said why already
        };
        // The list of every topic: asking for the topics by name could create them on a
        // cluster that creates topics on first use.
        let listed = tokio::task::spawn_blocking(move || {
            // With the crate's context, so that librdkafka's own log lines go where the
            // source's do.
            let reader: BaseConsumer<Observed> = config
                .create_with_context(Observed::default())
                .map_err(|e| passthrough::refused(&e, &config))?;
            let metadata = reader
                .fetch_metadata(None, VERIFY_TIMEOUT)
                .map_err(|e| e.to_string())?;
            Ok::<_, String>(
                metadata
                    .topics()
                    .iter()
                    .filter(|t| t.error().is_none())
                    .map(|t| t.name().to_owned())
                    .collect::<BTreeSet<_>>(),
            )
        })
        .await;
        // Out of reach: the runner's loop waits for the broker.
        let Ok(Ok(listed)) = listed else {
            return Ok(());
        };
        let missing: Vec<&str> = self
            .topics
            .iter()
            .filter(|t| !listed.contains(*t))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(format!(
            "Kafka at {endpoint} has no topic {}: declare it (kafka::Topology, or \
             diesel-outbox declare --broker kafka) or fix the name",
            missing
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    fn check(&self) -> Result<(), BoxError> {
        brokers(&self.brokers)?;
        // The TLS files, the login and the properties, checked before the runner starts.
        self.security.apply(&mut ClientConfig::new())?;
        self.properties.check(Client::Consumer, &self.security)?;
        if self.group.is_empty() {
            return Err("the Kafka consumer group is empty".into());
        }
        if self.topics.is_empty() {
            return Err("the Kafka source needs at least one topic".into());
        }
        for topic in &self.topics {
            check_topic(topic)?;
            if let Some(dead) = self.dead_letters.of(topic) {
                check_topic(&dead).map_err(|why| format!("the dead-letter topic: {why}"))?;
            }
        }
        Ok(())
    }

    fn consumer_group(&self) -> Option<&str> {
        Some(&self.group)
    }

    async fn close(&mut self) {
        if let Some(consumer) = self.consumer.take() {
            consumer.unsubscribe();
            // librdkafka closes a consumer synchronously (leaving the group, talking to
            // the coordinator): off the runtime's threads, so it never stalls other tasks.
            let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
        }
        *lock(&self.offsets) = Offsets::default();
    }
}

fn lock(offsets: &Mutex<Offsets>) -> std::sync::MutexGuard<'_, Offsets> {
    offsets.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The offsets handed out and not settled yet, per partition this member holds: what may
/// be committed is the lowest of them (everything before it is settled), or past the last
/// one handed out when none is left.
#[derive(Default)]
struct Offsets {
    partitions: HashMap<(String, i32), Partition>,
    /// Numbers each partition's tracking, so that a settle from before the partition was
    /// revoked (and perhaps assigned again) commits nothing.
    epochs: u64,
}

struct Partition {
    epoch: u64,
    unsettled: BTreeSet<i64>,
    next: i64,
    committed: i64,
}

impl Offsets {
    /// `offset` was handed out; returns the partition's epoch.
    fn handed(&mut self, topic: &str, partition: i32, offset: i64) -> u64 {
        let epochs = &mut self.epochs;
        let part = self
            .partitions
            .entry((topic.to_owned(), partition))
            .or_insert_with(|| {
                *epochs += 1;
                Partition {
                    epoch: *epochs,
                    unsettled: BTreeSet::new(),
                    next: offset,
                    committed: offset,
                }
            });
        part.unsettled.insert(offset);
        part.next = part.next.max(offset + 1);
        part.epoch
    }

    /// `offset` is settled: the position to commit, if it moved.
    fn settled(&mut self, topic: &str, partition: i32, offset: i64, epoch: u64) -> Option<i64> {
        let part = self.partitions.get_mut(&(topic.to_owned(), partition))?;
        if part.epoch != epoch || !part.unsettled.remove(&offset) {
            return None;
        }
        let position = part.unsettled.first().copied().unwrap_or(part.next);
        (position > part.committed).then(|| {
            part.committed = position;
            position
        })
    }

    /// A commit of `position` failed: if it was the partition's latest, the next settle
    /// commits again (even at the same position), since the group may not have it.
    fn commit_failed(&mut self, topic: &str, partition: i32, position: i64) {
        if let Some(part) = self.partitions.get_mut(&(topic.to_owned(), partition))
            && part.committed == position
        {
            part.committed = i64::MIN;
        }
    }

    /// The partition went to another member: what was handed out here commits nothing.
    fn forget(&mut self, topic: &str, partition: i32) {
        self.partitions.remove(&(topic.to_owned(), partition));
    }
}

/// The consumer's context: forgets revoked partitions before they go, notes failed
/// commits (logged as a streak, and made again at the partition's next settle), and routes
/// librdkafka's log lines and errors as [`Observed`] does.
struct Tracked {
    offsets: Arc<Mutex<Offsets>>,
    observed: Observed,
    commits: Mutex<Streak>,
}

impl ClientContext for Tracked {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        self.observed.log(level, facility, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.observed.error(error, reason);
    }
}

impl ConsumerContext for Tracked {
    fn commit_callback(&self, result: KafkaResult<()>, committed: &TopicPartitionList) {
        let failed: Vec<_> = committed
            .elements()
            .into_iter()
            .filter(|e| result.is_err() || e.error().is_err())
            .collect();
        let mut streak = self.commits.lock().unwrap_or_else(PoisonError::into_inner);
        if failed.is_empty() {
            if let Some(failing_for) = streak.ended() {
                tracing::info!(failing_for = ?failing_for, "Kafka offset commits work again");
            }
            return;
        }
        {
            let mut offsets = lock(&self.offsets);
            for e in &failed {
                if let Some(position) = e.offset().to_raw() {
                    offsets.commit_failed(e.topic(), e.partition(), position);
                }
            }
        }
        let why = match &result {
            Err(e) => e.to_string(),
            Ok(()) => failed
                .iter()
                .find_map(|e| e.error().err())
                .map(|e| e.to_string())
                .unwrap_or_default(),
        };
        let partitions = failed.len();
        match streak.failed() {
            Loudness::First => tracing::warn!(
                error = %why, partitions,
                "a Kafka offset commit failed: the partition's next settled message commits \
                 again; until then a restart or rebalance delivers its messages again (the \
                 dedupe absorbs them)"
            ),
            Loudness::Again(failing_for) => tracing::error!(
                error = %why, partitions, failing_for = ?failing_for,
                "Kafka offset commits still fail"
            ),
            Loudness::Quiet => {
                tracing::debug!(error = %why, partitions, "a Kafka offset commit failed")
            }
        }
    }

    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            let mut offsets = lock(&self.offsets);
            for element in revoked.elements() {
                offsets.forget(element.topic(), element.partition());
            }
        }
    }
}

/// Settles one message: commits the partition's position once everything before it is
/// settled too.
struct Commit {
    consumer: Arc<StreamConsumer<Tracked>>,
    offsets: Arc<Mutex<Offsets>>,
    topic: String,
    partition: i32,
    offset: i64,
    epoch: u64,
    /// The message as its dead letter, unless the source sends none.
    letter: Option<Letter>,
}

impl Commit {
    /// The message is a dead letter, for `reason`: sent to the dead-letter topic (when
    /// the source has one) and, once Kafka confirmed it, its offset committed. When the
    /// produce fails, the offset is left uncommitted (an error, naming why).
    /// The reason is not logged: a handler's error may quote the message.
    async fn dead_letter(self: Box<Self>, reason: &str) -> Result<(), BoxError> {
        let Some(letter) = &self.letter else {
            tracing::warn!(
                topic = %self.topic, partition = self.partition, offset = self.offset,
                "a Kafka message is skipped (the source sends no dead letters)"
            );
            return self.commit();
        };
        if let Err(why) = letter.send(reason).await {
            tracing::error!(
                topic = %self.topic, partition = self.partition, offset = self.offset,
                error = %why,
                "a dead letter could not be produced: its offset stays uncommitted (the \
                 partition's commits stop there until a restart delivers it again)"
            );
            return Err(why.into());
        }
        tracing::warn!(
            topic = %self.topic, partition = self.partition, offset = self.offset,
            "a Kafka message went to the dead-letter topic"
        );
        self.commit()
    }

    fn commit(&self) -> Result<(), BoxError> {
        let position =
            lock(&self.offsets).settled(&self.topic, self.partition, self.offset, self.epoch);
        let Some(position) = position else {
            return Ok(());
        };
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&self.topic, self.partition, Offset::Offset(position))?;
        self.consumer.commit(&list, CommitMode::Async)?;
        Ok(())
    }
}

impl Settle for Commit {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { self.commit() })
    }

    fn reject(self: Box<Self>) -> BoxFuture<'static, Result<(), BoxError>> {
        self.reject_for("rejected by its handler".to_owned())
    }

    fn reject_for(self: Box<Self>, reason: String) -> BoxFuture<'static, Result<(), BoxError>> {
        Box::pin(async move { self.dead_letter(&reason).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_names_its_consumer_group_for_the_spans() {
        use crate::consumer::Source as _;
        let source = Source::group("127.0.0.1:9092", "billing-workers", ["orders"]);
        assert_eq!(source.consumer_group(), Some("billing-workers"));
    }

    #[test]
    fn a_new_group_starts_at_the_beginning_unless_told_otherwise() {
        let reset = |source: Source| {
            let (config, _) = source.config().unwrap();
            config.get("auto.offset.reset").map(str::to_owned)
        };
        let source = || Source::group("k:9092", "g", ["t"]);
        assert_eq!(reset(source()).as_deref(), Some("earliest"));
        assert_eq!(
            reset(source().start_from(StartFrom::Earliest)).as_deref(),
            Some("earliest")
        );
        assert_eq!(
            reset(source().start_from(StartFrom::Latest)).as_deref(),
            Some("latest")
        );
        // Through a property it is refused, by build() as by the look at the settings.
        let owned = source().property("auto.offset.reset", "latest");
        let err = crate::consumer::Source::check(&owned)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`auto.offset.reset`") && err.contains("start_from"),
            "{err}"
        );
        assert!(owned.config().is_err());
        let taken = source().property("client.id", "billing");
        crate::consumer::Source::check(&taken).unwrap();
        assert_eq!(taken.config().unwrap().0.get("client.id"), Some("billing"));
    }

    #[test]
    fn the_position_moves_only_past_what_is_settled() {
        let mut offsets = Offsets::default();
        let epoch = offsets.handed("t", 0, 10);
        offsets.handed("t", 0, 11);
        offsets.handed("t", 0, 12);
        // 11 and 12 settle first: 10 is still open, nothing may be committed.
        assert_eq!(offsets.settled("t", 0, 11, epoch), None);
        assert_eq!(offsets.settled("t", 0, 12, epoch), None);
        // Then 10: everything up to 12 is done, the position is 13.
        assert_eq!(offsets.settled("t", 0, 10, epoch), Some(13));
        // A partition revoked and assigned again: a late settle commits nothing.
        offsets.handed("t", 0, 13);
        offsets.forget("t", 0);
        let again = offsets.handed("t", 0, 13);
        assert_ne!(again, epoch);
        assert_eq!(offsets.settled("t", 0, 13, epoch), None);
        assert_eq!(offsets.settled("t", 0, 13, again), Some(14));
    }

    #[test]
    fn a_failed_commit_is_made_again_at_the_next_settle() {
        let mut offsets = Offsets::default();
        let epoch = offsets.handed("t", 0, 10);
        offsets.handed("t", 0, 11);
        offsets.handed("t", 0, 12);
        assert_eq!(offsets.settled("t", 0, 10, epoch), Some(11));
        // An older commit failing says nothing once a later one was asked for.
        assert_eq!(offsets.settled("t", 0, 11, epoch), Some(12));
        offsets.commit_failed("t", 0, 11);
        // The latest failing: the next settle commits, though 12 is still open.
        offsets.commit_failed("t", 0, 12);
        offsets.handed("t", 0, 13);
        assert_eq!(offsets.settled("t", 0, 13, epoch), Some(12));
        assert_eq!(offsets.settled("t", 0, 12, epoch), Some(14));
        // A partition this member no longer holds: nothing to note.
        offsets.forget("t", 0);
        offsets.commit_failed("t", 0, 14);
        assert!(offsets.partitions.is_empty());
    }
}
