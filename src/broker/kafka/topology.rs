//! Declaring on Kafka what a relay produces to: topics with their partitions.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;

use super::properties::check_topic;
use super::{Observed, Sasl, Security, brokers};
use crate::error::{Error, Result};
use crate::publisher::PublishError;
use crate::tls::Tls;

/// How long declaring may take.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(30);

/// The topics a relay produces to, declared in one call, each with its number of
/// partitions (one aggregate's messages stay in one partition, so more partitions spread
/// aggregates, never split one).
///
/// Declaring is idempotent: a topic that exists is left as it is, whatever its partitions.
///
/// ```no_run
/// use diesel_outbox::kafka::Topology;
///
/// # async fn run() -> Result<(), diesel_outbox::Error> {
/// Topology::new()
///     .topic("outbox.order.created", 6)
///     .topic("outbox.order.paid", 6)
///     .declare("127.0.0.1:9092")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct Topology {
    topics: Vec<(String, u32)>,
    replication: Option<u16>,
    security: Security,
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

    /// How many replicas each partition has. Defaults to the cluster's own default.
    pub fn replication(mut self, replicas: u16) -> Self {
        self.replication = Some(replicas);
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

    /// Creates every topic that does not exist yet.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for a broker list that is not `host:port[,…]`, a topic name
    /// Kafka refuses, zero partitions or replicas, a TLS file that cannot be read or an
    /// empty SASL user (nothing is created then); [`Error::Publish`] when no broker answers
    /// or the cluster refuses a topic (naming it and why).
    pub async fn declare(&self, brokers_list: &str) -> Result<()> {
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
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &endpoint)
            .set("client.id", "diesel-outbox declare");
        self.security
            .apply(&mut config)
            .map_err(Error::InvalidOption)?;
        let observed = Observed::default();
        let admin: AdminClient<Observed> = config
            .create_with_context(observed.clone())
            .map_err(|e| Error::InvalidOption(format!("the Kafka admin client: {e}")))?;
        let replicas = self.replication.map_or(-1, i32::from);
        let topics: Vec<NewTopic<'_>> = self
            .topics
            .iter()
            .map(|(name, partitions)| {
                NewTopic::new(
                    name,
                    i32::try_from(*partitions).unwrap_or(1),
                    TopicReplication::Fixed(replicas),
                )
            })
            .collect();
        let options = AdminOptions::new().operation_timeout(Some(DECLARE_TIMEOUT));
        let results = tokio::time::timeout(DECLARE_TIMEOUT, admin.create_topics(&topics, &options))
            .await
            .map_err(|_| {
                let why = format!("no answer within {DECLARE_TIMEOUT:?}");
                unavailable(&endpoint, observed.explain(why))
            })?
            .map_err(|e| unavailable(&endpoint, observed.explain(e)))?;
        for result in results {
            match result {
                Ok(name) => {
                    tracing::info!(endpoint = %endpoint, topic = %name, "declared Kafka topic")
                }
                Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(Error::Publish(
                        PublishError::transient(format!(
                            "Kafka at {endpoint} did not create topic {name:?}: {code}"
                        ))
                        .into(),
                    ));
                }
            }
        }
        Ok(())
    }
}

fn unavailable(endpoint: &str, why: String) -> Error {
    Error::Publish(PublishError::unavailable(format!("Kafka at {endpoint}: {why}")).into())
}
