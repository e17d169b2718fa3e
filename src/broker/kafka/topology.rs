//! Declaring on Kafka what a relay produces to: topics with their partitions.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::Producer;

use super::properties::check_topic;
use super::{
    Client, Observed, Properties, Sasl, Security, brokers, passthrough, producer, reachable,
};
use crate::error::{Error, Result};
use crate::publisher::PublishError;
use crate::tls::Tls;

/// How long declaring may take.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a broker has to answer before anything is declared: a cluster out of reach
/// (refused, a certificate that does not verify, a refused login) fails within it, with
/// the cause librdkafka reported.
const PROBE_TIMEOUT: Duration = crate::defaults::DELIVERY_TIMEOUT;

/// A topic as [`Topology::declare`] left it: created, or found as it was.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeclaredTopic {
    /// The topic's name.
    pub name: String,
    /// The partitions it has: those asked for when it was created, else those it was
    /// found with.
    pub partitions: u32,
    /// The partitions asked for.
    pub asked: u32,
    /// True when this call created it; false when it existed already (and was left as it
    /// is).
    pub created: bool,
}

impl DeclaredTopic {
    /// True when the topic has the partitions asked for.
    pub fn as_asked(&self) -> bool {
        self.partitions == self.asked
    }
}

/// The topics a relay produces to, declared in one call, each with its number of
/// partitions (one aggregate's messages stay in one partition, so more partitions spread
/// aggregates, never split one).
///
/// Declaring is idempotent: a topic that exists is left as it is, whatever its partitions
/// and configs; what [`Topology::declare`] returns says, for each topic, whether it was
/// created and how many partitions it has (a warning is logged for one found with other
/// partitions than asked for). Topic configs ([`Topology::topic_config`]) go with the
/// topics created.
///
/// ```no_run
/// use diesel_outbox::kafka::Topology;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// let declared = Topology::new()
///     .topic("outbox.order.created", 6)
///     .topic("outbox.order.paid", 6)
///     .topic_config("retention.ms", "604800000") // a week
///     .declare("127.0.0.1:9092")
///     .await?;
/// for topic in declared.iter().filter(|t| !t.as_asked()) {
///     eprintln!("{} has {} partitions, not {}", topic.name, topic.partitions, topic.asked);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct Topology {
    topics: Vec<(String, u32)>,
    replication: Option<u16>,
    configs: Vec<(String, String)>,
    security: Security,
    properties: Properties,
}

impl Topology {
    /// Nothing to declare yet.
    pub fn new() -> Self {
        Topology::default()
    }

    /// A topic named `name` (the relay's topic prefix + a record's topic) with
    /// `partitions` partitions.
    pub fn topic(mut self, name: impl Into<String>, partitions: u32) -> Self {
        self.topics.push((name.into(), partitions));
        self
    }

    /// The dead-letter topic `<name>.dlt` of every topic named so far, with as many
    /// partitions: where the consumer source sends the messages its handler rejected (see
    /// [`Source::dead_letter_topic`](crate::consumer::kafka::Source::dead_letter_topic)).
    pub fn dead_letter_topics(mut self) -> Self {
        let dead: Vec<(String, u32)> = self
            .topics
            .iter()
            .map(|(name, partitions)| (format!("{name}.dlt"), *partitions))
            .filter(|(dead, _)| !self.topics.iter().any(|(name, _)| name == dead))
            .collect();
        self.topics.extend(dead);
        self
    }

    /// How many replicas each partition has. Defaults to the cluster's own default.
    pub fn replication(mut self, replicas: u16) -> Self {
        self.replication = Some(replicas);
        self
    }

    /// The topic config `key` = `value` (`retention.ms`, `cleanup.policy`,
    /// `min.insync.replicas`, `max.message.bytes`, …) for every topic this call creates;
    /// later calls win for the same key. Defaults to the cluster's defaults.
    ///
    /// Hazard: a topic that exists is not altered: its configs stay what they are (change
    /// them with Kafka's own tools), and [`declare`](Self::declare) does not compare them.
    /// The cluster checks keys and values; a topic it refuses one for fails `declare`,
    /// naming the topic.
    pub fn topic_config(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let key = key.into();
        self.configs.retain(|(k, _)| *k != key);
        self.configs.push((key, value.into()));
        self
    }

    /// Sets the librdkafka property `key` to `value` on the clients that declare, as
    /// [`KafkaPublisherBuilder::property`](crate::kafka::KafkaPublisherBuilder::property)
    /// does on the producer (an OAUTHBEARER login is shown there). The value never appears
    /// in `Debug`, logs or errors. Refused by [`declare`](Self::declare) with
    /// [`Error::InvalidOption`], naming the key and why: `bootstrap.servers`,
    /// `allow.auto.create.topics` (looking at a topic must not create it),
    /// `message.timeout.ms`, `delivery.timeout.ms` and `request.timeout.ms` (they follow
    /// declare's wait for a broker), the verification of the brokers' certificates and
    /// names, and what [`tls`](Self::tls) and [`sasl`](Self::sasl) set once given.
    pub fn property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push(key, value);
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

    /// Creates every topic that does not exist yet, and says for each topic (in the order
    /// given) whether it was created and how many partitions it has.
    ///
    /// A broker must answer a metadata request first, within 10 s: a cluster out of reach
    /// fails then, naming the cause librdkafka reported (a refused connection, a
    /// certificate that failed verification, a refused login).
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a broker list that is not `host:port[,…]`, a topic name
    /// Kafka refuses, zero partitions or replicas, a TLS file that cannot be read, an
    /// empty SASL user, an empty topic config key, or a [`property`](Self::property) the
    /// crate owns or librdkafka refuses (nothing is created then); [`Error::Publish`] when no broker answers
    /// (naming the cause) or the cluster refuses a topic (naming it and why).
    pub async fn declare(&self, brokers_list: &str) -> Result<Vec<DeclaredTopic>> {
        let endpoint = brokers(brokers_list).map_err(Error::InvalidOption)?;
        for (name, partitions) in &self.topics {
            check_topic(name).map_err(Error::InvalidOption)?;
            if *partitions == 0 || i32::try_from(*partitions).is_err() {
                return Err(Error::InvalidOption(format!(
                    "topic {name:?}: the partitions must be between 1 and {}",
                    i32::MAX
                )));
            }
        }
        if self.replication == Some(0) {
            return Err(Error::InvalidOption(
                "replication must be above zero".into(),
            ));
        }
        if self.configs.iter().any(|(key, _)| key.trim().is_empty()) {
            return Err(Error::InvalidOption(
                "a Kafka topic config has an empty key".into(),
            ));
        }
        self.properties
            .check(Client::Admin, &self.security)
            .map_err(Error::InvalidOption)?;
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &endpoint)
            .set("client.id", "diesel-outbox declare")
            // Looking at a topic must not create it.
            .set("allow.auto.create.topics", "false");
        self.security
            .apply(&mut config)
            .map_err(Error::InvalidOption)?;
        self.properties.apply(&mut config);
        let observed = Observed::default();
        // The admin client never reports its connections' errors; a producer (which polls
        // for them) asks first, as the publisher's connect does, so that a broker out of
        // reach fails with its cause rather than the admin request's timeout.
        let looking = producer(&config, PROBE_TIMEOUT, &observed).map_err(Error::InvalidOption)?;
        reachable(&looking, &observed, &endpoint, PROBE_TIMEOUT).await?;
        let admin: AdminClient<Observed> =
            config.create_with_context(observed.clone()).map_err(|e| {
                Error::InvalidOption(format!(
                    "the Kafka admin client: {}",
                    passthrough::refused(&e, &config)
                ))
            })?;
        let topics = self.new_topics();
        let options = AdminOptions::new().operation_timeout(Some(DECLARE_TIMEOUT));
        let results = tokio::time::timeout(DECLARE_TIMEOUT, admin.create_topics(&topics, &options))
            .await
            .map_err(|_| {
                let why = format!("no answer within {DECLARE_TIMEOUT:?}");
                unavailable(&endpoint, observed.explain(why))
            })?
            .map_err(|e| unavailable(&endpoint, observed.explain(e)))?;
        let mut found = Vec::new();
        for result in results {
            match result {
                Ok(name) => {
                    tracing::info!(endpoint = %endpoint, topic = %name, "declared Kafka topic")
                }
                Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => found.push(name),
                Err((name, code)) => {
                    return Err(Error::Publish(
                        format!("Kafka at {endpoint} did not create topic {name:?}: {code}").into(),
                    ));
                }
            }
        }
        let existing = partitions_of(&looking, &observed, &endpoint, found).await?;
        let mut declared = Vec::new();
        for (name, asked) in &self.topics {
            let topic = match existing.iter().find(|(n, _)| n == name) {
                Some((_, partitions)) => DeclaredTopic {
                    name: name.clone(),
                    partitions: *partitions,
                    asked: *asked,
                    created: false,
                },
                None => DeclaredTopic {
                    name: name.clone(),
                    partitions: *asked,
                    asked: *asked,
                    created: true,
                },
            };
            if !topic.as_asked() {
                tracing::warn!(
                    endpoint = %endpoint, topic = %topic.name, partitions = topic.partitions,
                    asked = topic.asked,
                    "the Kafka topic exists with other partitions than asked for: left as it is"
                );
            }
            declared.push(topic);
        }
        Ok(declared)
    }
}

impl Topology {
    /// Each topic as the request that creates it: its partitions, its replicas (`-1`: the
    /// cluster's default) and the topic configs.
    fn new_topics(&self) -> Vec<NewTopic<'_>> {
        let replicas = self.replication.map_or(-1, i32::from);
        self.topics
            .iter()
            .map(|(name, partitions)| {
                self.configs.iter().fold(
                    NewTopic::new(
                        name,
                        i32::try_from(*partitions).unwrap_or(1),
                        TopicReplication::Fixed(replicas),
                    ),
                    |topic, (key, value)| topic.set(key.trim(), value),
                )
            })
            .collect()
    }
}

/// The partitions of each topic of `names` (topics that exist), from the cluster's
/// metadata.
async fn partitions_of(
    client: &super::KafkaProducer,
    observed: &Observed,
    endpoint: &str,
    names: Vec<String>,
) -> Result<Vec<(String, u32)>> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let asking = client.clone();
    let asked = tokio::task::spawn_blocking(move || {
        let mut found = Vec::new();
        for name in names {
            let metadata = asking.client().fetch_metadata(Some(&name), PROBE_TIMEOUT)?;
            let partitions = metadata
                .topics()
                .iter()
                .find(|t| t.name() == name)
                .map_or(0, |t| t.partitions().len());
            found.push((name, u32::try_from(partitions).unwrap_or(u32::MAX)));
        }
        Ok::<_, rdkafka::error::KafkaError>(found)
    })
    .await
    .map_err(|e| unavailable(endpoint, e.to_string()))?;
    asked.map_err(|e| {
        unavailable(
            endpoint,
            observed.explain(format!("the partitions of the topics found: {e}")),
        )
    })
}

fn unavailable(endpoint: &str, why: String) -> Error {
    Error::Publish(PublishError::unavailable(format!("Kafka at {endpoint}: {why}")).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_configs_go_with_every_topic_created() {
        let topology = Topology::new()
            .topic("a", 3)
            .topic("b", 1)
            .replication(2)
            .topic_config("retention.ms", "1")
            .topic_config("cleanup.policy", "compact")
            .topic_config("retention.ms", "604800000");
        let topics = topology.new_topics();
        assert_eq!(topics.len(), 2);
        for topic in &topics {
            assert_eq!(
                topic.config,
                [("cleanup.policy", "compact"), ("retention.ms", "604800000")]
            );
        }
        assert_eq!((topics[0].name, topics[0].num_partitions), ("a", 3));
        assert!(matches!(topics[1].replication, TopicReplication::Fixed(2)));
        assert!(
            Topology::new().topic("a", 1).new_topics()[0]
                .config
                .is_empty()
        );
    }

    #[tokio::test]
    async fn refused_properties_and_empty_config_keys_fail_before_connecting() {
        // Nothing listens on port 1: a check that passed would fail on the connection.
        let err = Topology::new()
            .topic("a", 1)
            .property("allow.auto.create.topics", "true")
            .declare("127.0.0.1:1")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidOption(m) if m.contains("`allow.auto.create.topics`")),
            "{err}"
        );
        let err = Topology::new()
            .topic("a", 1)
            .topic_config(" ", "x")
            .declare("127.0.0.1:1")
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidOption(m) if m.contains("empty key")),
            "{err}"
        );
    }
}
