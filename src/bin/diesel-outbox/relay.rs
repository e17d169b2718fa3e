//! `relay`: a relay to RabbitMQ, NATS JetStream or Kafka until SIGINT or SIGTERM, then a drain. Its options default
//! to the library's (`diesel_outbox::defaults`); its logs leave out what dependencies would
//! print of payloads and credentials.

use clap::Args;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_outbox::defaults;
use diesel_outbox::kafka::{KafkaPublisher, Layout};
use diesel_outbox::nats::JetStreamPublisher;
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Outbox, PgPool, Publisher, Relay, until_reachable};
use futures_util::FutureExt;

use crate::broker::{Broker, BrokerArgs};
use crate::buckets::Buckets;
use crate::durations::{Age, Period};
use crate::secret::Secret;
use crate::{CONNECTION, Failure, USAGE};

/// The Kafka topic layouts of `--kafka-layout`.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum KafkaLayout {
    /// The prefix + the message's topic.
    ByTopic,
    /// The prefix + the message's aggregate type, its topic in a header.
    ByAggregateType,
}

#[derive(Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// Exchange to publish to, which must exist (with `--broker rabbitmq`).
    #[arg(long, env = "OUTBOX_EXCHANGE", help_heading = "RabbitMQ")]
    exchange: Option<String>,
    /// Put in front of each topic to make its NATS subject, which a JetStream stream must
    /// capture (with `--broker nats`).
    #[arg(
        long,
        env = "OUTBOX_SUBJECT_PREFIX",
        default_value = "",
        help_heading = "NATS"
    )]
    subject_prefix: String,
    /// Put in front of each topic to make its Kafka topic (with `--broker kafka`).
    #[arg(
        long,
        env = "OUTBOX_TOPIC_PREFIX",
        default_value = "",
        help_heading = "Kafka"
    )]
    topic_prefix: String,
    /// Which Kafka topic each message goes to (with `--broker kafka`): the prefix + its
    /// topic, or the prefix + its aggregate type (its topic up to the last `.`, Debezium's
    /// outbox router layout), where every event of one aggregate, of any type, is in one
    /// partition in order.
    #[arg(
        long,
        value_enum,
        env = "OUTBOX_KAFKA_LAYOUT",
        default_value_t = KafkaLayout::ByTopic,
        help_heading = "Kafka"
    )]
    kafka_layout: KafkaLayout,
    /// Rows claimed per cycle.
    #[arg(long, default_value_t = defaults::BATCH_SIZE)]
    pub(crate) batch_size: usize,
    /// Publishes in flight for one-by-one publishing.
    #[arg(long, default_value_t = defaults::CONCURRENCY)]
    pub(crate) concurrency: usize,
    /// Claim lease.
    #[arg(long, default_value_t = Period(defaults::LEASE), allow_hyphen_values = true)]
    pub(crate) lease: Period,
    /// How long the log's cursor stays this relay's without a renewal (log engine): a
    /// heartbeat renews it every fifth of it, and a standby takes over this long after the
    /// holder dies [default: 5s, or the lease when that is shorter].
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) cursor_lease: Option<Period>,
    /// Poll interval when not woken.
    #[arg(long, default_value_t = Period(defaults::POLL_INTERVAL), allow_hyphen_values = true)]
    pub(crate) poll_interval: Period,
    /// Attempts before a message is dead-lettered.
    #[arg(long, default_value_t = defaults::MAX_ATTEMPTS)]
    pub(crate) max_attempts: u32,
    /// Smallest retry backoff.
    #[arg(long, default_value_t = Period(defaults::BACKOFF_MIN), allow_hyphen_values = true)]
    pub(crate) backoff_min: Period,
    /// Largest retry backoff.
    #[arg(long, default_value_t = Period(defaults::BACKOFF_MAX), allow_hyphen_values = true)]
    pub(crate) backoff_max: Period,
    /// How long publishes under way may finish on shutdown [default: 10s, or half the
    /// lease when that is shorter].
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) drain_timeout: Option<Period>,
    /// Poll only; do not LISTEN for wake-ups (LISTEN needs a session of its own).
    #[arg(long)]
    without_listen: bool,
    /// Purge sent rows older than this; `off` keeps them.
    #[arg(long, default_value_t = Age(Some(defaults::RETENTION)), allow_hyphen_values = true)]
    pub(crate) retention: Age,
    /// Purge inbox records older than this; `off` keeps them.
    #[arg(long, default_value_t = Age(Some(defaults::INBOX_RETENTION)), allow_hyphen_values = true)]
    pub(crate) inbox_retention: Age,
    /// The longest a batch may wait for the broker's confirms (RabbitMQ),
    /// acknowledgements (NATS) or delivery reports (Kafka) [default: 10s, or half the
    /// lease when that is shorter].
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) confirm_timeout: Option<Period>,
    /// The most payload and header bytes one claim takes (at least one row).
    #[arg(long, default_value_t = defaults::MAX_BATCH_BYTES)]
    pub(crate) max_batch_bytes: usize,
    /// How long the start waits for a database it cannot reach (a restart, or a server not
    /// up yet), trying again with each try logged, before it exits 3 with the cause; `0s`
    /// tries once. A refused login, a database that does not exist or a table not migrated
    /// fail at once.
    #[arg(long, default_value_t = Period(defaults::CONNECT_TIMEOUT), allow_hyphen_values = true)]
    pub(crate) connect_timeout: Period,
    /// Start even when the broker cannot be reached: the relay then holds the messages
    /// back as in any outage (no attempt spent; `/readyz` 503, "broker unavailable") until
    /// the broker answers. What only the broker can tell (a refused login, a missing
    /// exchange, stream or topic) then shows as that outage, not as exit 3 at start.
    #[arg(long)]
    start_without_broker: bool,
    /// Database connections in the relay's pool (plus one for LISTEN).
    #[arg(long, default_value_t = 4)]
    pool_size: u32,
    /// Serve, on this address (such as `127.0.0.1:9464`), the probes `/livez` and
    /// `/readyz` (200, or 503 with the reasons, as JSON) and at every other path the
    /// relay's metrics in the Prometheus text format.
    #[arg(long, visible_alias = "http-addr")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The upper bounds, in seconds and separated by commas, of the buckets of the metrics'
    /// histograms (publish durations, delivery lags) on `--metrics-addr`: positive, finite
    /// and strictly increasing.
    #[arg(
        long,
        value_name = "SECONDS,...",
        default_value_t = Buckets(defaults::HISTOGRAM_BUCKETS.to_vec()),
        requires = "metrics_addr",
        allow_hyphen_values = true
    )]
    metrics_buckets: Buckets,
}

pub(crate) async fn run(
    outbox: &Outbox,
    database_url: &Secret,
    no_statement_cache: bool,
    args: RelayArgs,
) -> Result<(), Failure> {
    // Installed before anything else, so a signal during start-up stops the process cleanly
    // too (rather than killing it).
    let shutdown = shutdown_signal().shared();
    // A missing or mistaken broker address is a usage error, said before the database is
    // waited for.
    args.broker.check()?;
    let health = crate::serve::HealthSource::default();
    if let Some(addr) = args.metrics_addr {
        crate::serve::serve(addr, &args.metrics_buckets, health.clone()).await?;
    }
    let started = async {
        let pool = pool(outbox, database_url, no_statement_cache, &args).await?;
        let b = &args.broker;
        let relay = match b.broker {
            Broker::Rabbitmq => {
                let url = b.amqp_url()?;
                let Some(exchange) = &args.exchange else {
                    return Err(Failure::new(
                        USAGE,
                        "--broker rabbitmq needs --exchange (or OUTBOX_EXCHANGE)",
                    ));
                };
                let mut publisher = RabbitMqPublisher::builder(url.expose(), exchange);
                if let Some(timeout) = args.confirm_timeout {
                    publisher = publisher.confirm_timeout(timeout.0);
                }
                if let Some(tls) = b.amqp_tls() {
                    publisher = publisher.tls(tls);
                }
                let publisher = if args.start_without_broker {
                    publisher.connect_lazy().await?
                } else {
                    publisher.connect().await?
                };
                Running::Rabbitmq(build(outbox, pool, publisher, &args)?)
            }
            Broker::Nats => {
                let mut publisher = JetStreamPublisher::builder(b.nats_url()?.expose())
                    .subject_prefix(&args.subject_prefix);
                if let Some(timeout) = args.confirm_timeout {
                    publisher = publisher.ack_timeout(timeout.0);
                }
                if let Some(tls) = b.nats_tls() {
                    publisher = publisher.tls(tls);
                }
                if let Some(credentials) = b.nats_credentials() {
                    publisher = publisher.credentials(credentials);
                }
                let publisher = if args.start_without_broker {
                    publisher.connect_lazy().await?
                } else {
                    publisher.connect().await?
                };
                Running::Nats(build(outbox, pool, publisher, &args)?)
            }
            Broker::Kafka => {
                let mut publisher = KafkaPublisher::builder(b.kafka_brokers()?)
                    .topic_prefix(&args.topic_prefix)
                    .layout(match args.kafka_layout {
                        KafkaLayout::ByTopic => Layout::ByTopic,
                        KafkaLayout::ByAggregateType => Layout::ByAggregateType,
                    });
                if let Some(timeout) = args.confirm_timeout {
                    publisher = publisher.delivery_timeout(timeout.0);
                }
                if let Some(tls) = b.kafka_tls() {
                    publisher = publisher.tls(tls);
                }
                if let Some(sasl) = b.kafka_sasl() {
                    publisher = publisher.sasl(sasl);
                }
                for (key, value) in &b.kafka_properties {
                    publisher = publisher.property(key, value.expose());
                }
                let publisher = if args.start_without_broker {
                    publisher.connect_lazy().await?
                } else {
                    publisher.connect().await?
                };
                Running::Kafka(build(outbox, pool, publisher, &args)?)
            }
        };
        Ok(relay)
    };
    let relay = tokio::select! {
        relay = started => relay?,
        () = shutdown.clone() => return Ok(()),
    };
    let probe: Box<dyn Fn() -> diesel_outbox::Health + Send> = match &relay {
        Running::Rabbitmq(relay) => {
            let relay = relay.clone();
            Box::new(move || relay.health())
        }
        Running::Nats(relay) => {
            let relay = relay.clone();
            Box::new(move || relay.health())
        }
        Running::Kafka(relay) => {
            let relay = relay.clone();
            Box::new(move || relay.health())
        }
    };
    *health
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(probe);
    match relay {
        Running::Rabbitmq(relay) => relay.run_until(shutdown).await?,
        Running::Nats(relay) => relay.run_until(shutdown).await?,
        Running::Kafka(relay) => relay.run_until(shutdown).await?,
    }
    Ok(())
}

/// A relay built for one broker or the other.
enum Running {
    Rabbitmq(Relay<RabbitMqPublisher>),
    Nats(Relay<JetStreamPublisher>),
    Kafka(Relay<KafkaPublisher>),
}

/// The relay's pool, checked against the table (failing fast when it is missing rather
/// than on the first cycle), tried again for `--connect-timeout` while the database cannot
/// be reached.
async fn pool(
    outbox: &Outbox,
    database_url: &Secret,
    no_statement_cache: bool,
    args: &RelayArgs,
) -> Result<PgPool, Failure> {
    let started = until_reachable("the relay's start", args.connect_timeout.0, || {
        checked_pool(outbox, database_url, no_statement_cache, args)
    })
    .await;
    started.map_err(|e| match e {
        Error::InvalidOption(why) => {
            Failure::new(USAGE, format!("cannot connect to the database: {why}"))
        }
        // The timeout's end, a refused login: `until_reachable` returns no other
        // connection failure.
        Error::Pool(why) => Failure::new(
            CONNECTION,
            format!(
                "cannot start the relay (the database at {}): {why}",
                host(database_url)
            ),
        ),
        e => e.into(),
    })
}

/// One try of [`pool`]: a connection of its own first, for a failure's cause (the pool's
/// would only time out), then the pool and the table's stats through it.
async fn checked_pool(
    outbox: &Outbox,
    database_url: &Secret,
    no_statement_cache: bool,
    args: &RelayArgs,
) -> Result<PgPool, Error> {
    let establish = if no_statement_cache {
        diesel_outbox::establish_without_statement_cache
    } else {
        diesel_outbox::establish
    };
    establish(database_url.expose())
        .await
        .map_err(|e| match e {
            diesel::ConnectionError::InvalidConnectionUrl(why) => Error::InvalidOption(why),
            e => Error::Pool(e.to_string().into()),
        })?;
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(establish);
    // A database out of reach shows (in the logs, and in `/readyz`) within seconds.
    let pool = PgPool::builder()
        .max_size(args.pool_size.max(1))
        .connection_timeout(std::time::Duration::from_secs(5))
        .test_on_check_out(false)
        .build(AsyncDieselConnectionManager::new_with_config(
            database_url.expose(),
            config,
        ))
        .await
        .map_err(|e| Error::Pool(format!("cannot build the pool: {e}").into()))?;
    {
        let mut conn = diesel_outbox::checkout(&pool).await?;
        outbox.stats(&mut conn).await?;
    }
    Ok(pool)
}

/// Where the database URL points (its hosts and ports, or "PostgreSQL" for a URL that
/// names none): never its user, password or parameters.
fn host(database_url: &Secret) -> String {
    let url = database_url.expose();
    let after_scheme = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = after_scheme.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    if hosts.is_empty() {
        "PostgreSQL".to_owned()
    } else {
        hosts.to_owned()
    }
}

/// The relay with the command's options.
fn build<P: Publisher>(
    outbox: &Outbox,
    pool: PgPool,
    publisher: P,
    args: &RelayArgs,
) -> Result<Relay<P>, Failure> {
    let mut builder = outbox
        .relay(pool, publisher)
        .batch_size(args.batch_size)
        .concurrency(args.concurrency)
        .lease(args.lease.0)
        .poll_interval(args.poll_interval.0)
        .max_attempts(args.max_attempts)
        .backoff(args.backoff_min.0, args.backoff_max.0)
        .retention(args.retention.0)
        .inbox_retention(args.inbox_retention.0)
        .max_batch_bytes(args.max_batch_bytes);
    if let Some(lease) = &args.cursor_lease {
        builder = builder.cursor_lease(lease.0);
    }
    if args.metrics_addr.is_some() {
        builder = builder.metrics(diesel_outbox::FacadeMetrics::new(outbox.table()));
    }
    if args.without_listen {
        builder = builder.without_listen();
    }
    if let Some(drain) = args.drain_timeout {
        builder = builder.drain_timeout(drain.0);
    }
    Ok(builder.build()?)
}

/// Completes on SIGINT or SIGTERM. The handlers are installed when this is called, not when
/// the future is first polled.
fn shutdown_signal() -> futures_util::future::BoxFuture<'static, ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        Box::pin(async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            tracing::info!("shutdown signal received");
        })
    }
    #[cfg(not(unix))]
    {
        Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
            tracing::info!("shutdown signal received");
        })
    }
}
