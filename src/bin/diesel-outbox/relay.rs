//! `relay`: a relay to RabbitMQ or NATS JetStream until SIGINT or SIGTERM, then a drain. Its options default
//! to the library's (`diesel_outbox::defaults`); its logs leave out what dependencies would
//! print of payloads and credentials.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_outbox::defaults;
use diesel_outbox::nats::{Credentials, JetStreamPublisher};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Outbox, PgPool, Publisher, Relay, Tls};
use futures_util::FutureExt;

use crate::durations::{Age, Period};
use crate::secret::{self, Secret};
use crate::{CONNECTION, Failure, USAGE};

/// The brokers a relay can publish to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Broker {
    /// RabbitMQ: `--amqp-url` and `--exchange`.
    Rabbitmq,
    /// NATS JetStream: `--nats-url` and `--subject-prefix`.
    Nats,
}

#[derive(Args)]
pub(crate) struct RelayArgs {
    /// The broker to publish to.
    #[arg(long, value_enum, default_value_t = Broker::Rabbitmq, env = "OUTBOX_BROKER")]
    broker: Broker,
    /// RabbitMQ URL (with `--broker rabbitmq`): `amqp://`, or `amqps://` for TLS
    /// (`?auth_mechanism=external` logs in with the client certificate).
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    amqp_url: Option<Secret>,
    /// A file holding the RabbitMQ URL, instead of `--amqp-url`.
    #[arg(long, env = "AMQP_URL_FILE", value_name = "PATH", value_parser = secret::read_file)]
    amqp_url_file: Option<Secret>,
    /// A PEM file of CAs to trust for `amqps://`, besides the platform's roots.
    #[arg(long, env = "AMQP_TLS_CA", value_name = "PATH")]
    amqp_tls_ca: Option<PathBuf>,
    /// A PEM client certificate for `amqps://` (with `--amqp-tls-key`).
    #[arg(
        long,
        env = "AMQP_TLS_CERT",
        value_name = "PATH",
        requires = "amqp_tls_key"
    )]
    amqp_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--amqp-tls-cert`.
    #[arg(
        long,
        env = "AMQP_TLS_KEY",
        value_name = "PATH",
        requires = "amqp_tls_cert"
    )]
    amqp_tls_key: Option<PathBuf>,
    /// Exchange to publish to, which must exist (with `--broker rabbitmq`).
    #[arg(long, env = "OUTBOX_EXCHANGE")]
    exchange: Option<String>,
    /// NATS URL, or several comma-separated (with `--broker nats`); `tls://` for TLS.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats_url: Option<Secret>,
    /// A file holding the NATS URL, instead of `--nats-url`.
    #[arg(long, env = "NATS_URL_FILE", value_name = "PATH", value_parser = secret::read_file)]
    nats_url_file: Option<Secret>,
    /// Connect to NATS over TLS, verified against the platform's roots (and
    /// `--nats-tls-ca`), whatever the URL says.
    #[arg(long, env = "NATS_TLS", value_parser = clap::builder::BoolishValueParser::new())]
    nats_tls: bool,
    /// A PEM file of CAs to trust for NATS, besides the platform's roots (implies
    /// `--nats-tls`).
    #[arg(long, env = "NATS_TLS_CA", value_name = "PATH")]
    nats_tls_ca: Option<PathBuf>,
    /// A PEM client certificate for NATS (with `--nats-tls-key`; implies `--nats-tls`).
    #[arg(
        long,
        env = "NATS_TLS_CERT",
        value_name = "PATH",
        requires = "nats_tls_key"
    )]
    nats_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--nats-tls-cert`.
    #[arg(
        long,
        env = "NATS_TLS_KEY",
        value_name = "PATH",
        requires = "nats_tls_cert"
    )]
    nats_tls_key: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed).
    #[arg(long, env = "NATS_CREDS", value_name = "PATH")]
    nats_creds: Option<PathBuf>,
    /// An NKey seed to log in to NATS with.
    #[arg(long, env = "NATS_NKEY", hide_env_values = true)]
    nats_nkey: Option<Secret>,
    /// A file holding the NKey seed, instead of `--nats-nkey`.
    #[arg(long, env = "NATS_NKEY_FILE", value_name = "PATH", value_parser = secret::read_file)]
    nats_nkey_file: Option<Secret>,
    /// A token to log in to NATS with.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    nats_token: Option<Secret>,
    /// A file holding the token, instead of `--nats-token`.
    #[arg(long, env = "NATS_TOKEN_FILE", value_name = "PATH", value_parser = secret::read_file)]
    nats_token_file: Option<Secret>,
    /// A user to log in to NATS as (with `--nats-password` or `--nats-password-file`).
    #[arg(long, env = "NATS_USER")]
    nats_user: Option<String>,
    /// The password of `--nats-user`.
    #[arg(
        long,
        env = "NATS_PASSWORD",
        hide_env_values = true,
        requires = "nats_user"
    )]
    nats_password: Option<Secret>,
    /// A file holding the password of `--nats-user`, instead of `--nats-password`.
    #[arg(long, env = "NATS_PASSWORD_FILE", value_name = "PATH", value_parser = secret::read_file, requires = "nats_user")]
    nats_password_file: Option<Secret>,
    /// Put in front of each topic to make its NATS subject, which a JetStream stream must
    /// capture (with `--broker nats`).
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX", default_value = "")]
    subject_prefix: String,
    /// Rows claimed per cycle.
    #[arg(long, default_value_t = defaults::BATCH_SIZE)]
    pub(crate) batch_size: usize,
    /// Publishes in flight for one-by-one publishing.
    #[arg(long, default_value_t = defaults::CONCURRENCY)]
    pub(crate) concurrency: usize,
    /// Claim lease.
    #[arg(long, default_value_t = Period(defaults::LEASE), allow_hyphen_values = true)]
    pub(crate) lease: Period,
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
    /// The longest a batch may wait for the broker's confirms (RabbitMQ) or
    /// acknowledgements (NATS) [default: 10s, or half the lease when that is shorter].
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) confirm_timeout: Option<Period>,
    /// The most payload and header bytes one claim takes (at least one row).
    #[arg(long, default_value_t = defaults::MAX_BATCH_BYTES)]
    pub(crate) max_batch_bytes: usize,
    /// Database connections in the relay's pool (plus one for LISTEN).
    #[arg(long, default_value_t = 4)]
    pool_size: u32,
    /// Serve, on this address (such as `127.0.0.1:9464`), the probes `/livez` and
    /// `/readyz` (200, or 503 with the reasons, as JSON) and at every other path the
    /// relay's metrics in the Prometheus text format.
    #[arg(long, visible_alias = "http-addr")]
    metrics_addr: Option<std::net::SocketAddr>,
}

impl RelayArgs {
    /// Each secret given both as a value and as a file, settled (see [`secret::pick`]).
    pub(crate) fn resolve(&mut self, matches: &clap::ArgMatches) -> Result<(), String> {
        let pick = |value: (&str, &mut Option<Secret>), file: (&str, &mut Option<Secret>)| {
            let chosen = secret::pick(matches, (value.0, value.1.take()), (file.0, file.1.take()))?;
            *value.1 = chosen;
            Ok::<_, String>(())
        };
        pick(
            ("amqp_url", &mut self.amqp_url),
            ("amqp_url_file", &mut self.amqp_url_file),
        )?;
        pick(
            ("nats_url", &mut self.nats_url),
            ("nats_url_file", &mut self.nats_url_file),
        )?;
        pick(
            ("nats_nkey", &mut self.nats_nkey),
            ("nats_nkey_file", &mut self.nats_nkey_file),
        )?;
        pick(
            ("nats_token", &mut self.nats_token),
            ("nats_token_file", &mut self.nats_token_file),
        )?;
        pick(
            ("nats_password", &mut self.nats_password),
            ("nats_password_file", &mut self.nats_password_file),
        )?;
        let logins = [
            self.nats_creds.is_some(),
            self.nats_nkey.is_some(),
            self.nats_token.is_some(),
            self.nats_user.is_some(),
        ];
        if logins.iter().filter(|given| **given).count() > 1 {
            return Err(
                "give one NATS login: --nats-creds, --nats-nkey, --nats-token or --nats-user"
                    .into(),
            );
        }
        Ok(())
    }
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
    let health = crate::serve::HealthSource::default();
    if let Some(addr) = args.metrics_addr {
        crate::serve::serve(addr, health.clone()).await?;
    }
    let started = async {
        let pool = pool(outbox, database_url, no_statement_cache, &args).await?;
        let relay = match args.broker {
            Broker::Rabbitmq => {
                let (Some(url), Some(exchange)) = (&args.amqp_url, &args.exchange) else {
                    return Err(Failure::new(
                        USAGE,
                        "--broker rabbitmq needs --amqp-url (or AMQP_URL, --amqp-url-file, \
                         AMQP_URL_FILE) and --exchange (or OUTBOX_EXCHANGE)",
                    ));
                };
                let mut publisher = RabbitMqPublisher::builder(url.expose(), exchange);
                if let Some(timeout) = args.confirm_timeout {
                    publisher = publisher.confirm_timeout(timeout.0);
                }
                if let Some(tls) = tls(&args.amqp_tls_ca, &args.amqp_tls_cert, &args.amqp_tls_key) {
                    publisher = publisher.tls(tls);
                }
                let publisher = publisher.connect().await?;
                Running::Rabbitmq(build(outbox, pool, publisher, &args)?)
            }
            Broker::Nats => {
                let Some(url) = &args.nats_url else {
                    return Err(Failure::new(
                        USAGE,
                        "--broker nats needs --nats-url (or NATS_URL, --nats-url-file, \
                         NATS_URL_FILE)",
                    ));
                };
                let mut publisher =
                    JetStreamPublisher::builder(url.expose()).subject_prefix(&args.subject_prefix);
                if let Some(timeout) = args.confirm_timeout {
                    publisher = publisher.ack_timeout(timeout.0);
                }
                let files = tls(&args.nats_tls_ca, &args.nats_tls_cert, &args.nats_tls_key);
                if let Some(tls) = files.or_else(|| args.nats_tls.then(Tls::new)) {
                    publisher = publisher.tls(tls);
                }
                if let Some(credentials) = nats_credentials(&args) {
                    publisher = publisher.credentials(credentials);
                }
                let publisher = publisher.connect().await?;
                Running::Nats(build(outbox, pool, publisher, &args)?)
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
    };
    *health
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(probe);
    match relay {
        Running::Rabbitmq(relay) => relay.run_until(shutdown).await?,
        Running::Nats(relay) => relay.run_until(shutdown).await?,
    }
    Ok(())
}

/// TLS settings from a CA file and a client certificate, if either is given.
fn tls(ca: &Option<PathBuf>, cert: &Option<PathBuf>, key: &Option<PathBuf>) -> Option<Tls> {
    let mut tls = None;
    if let Some(ca) = ca {
        tls = Some(Tls::new().ca_file(ca));
    }
    if let (Some(cert), Some(key)) = (cert, key) {
        tls = Some(tls.unwrap_or_default().client_cert(cert, key));
    }
    tls
}

/// The NATS credentials of the options ([`RelayArgs::resolve`] lets at most one through).
fn nats_credentials(args: &RelayArgs) -> Option<Credentials> {
    if let Some(path) = &args.nats_creds {
        return Some(Credentials::file(path));
    }
    if let Some(seed) = &args.nats_nkey {
        return Some(Credentials::nkey_seed(seed.expose()));
    }
    if let Some(token) = &args.nats_token {
        return Some(Credentials::token(token.expose()));
    }
    let user = args.nats_user.as_ref()?;
    let password = args.nats_password.as_ref().map_or("", Secret::expose);
    Some(Credentials::user_and_password(user, password))
}

/// A relay built for one broker or the other.
enum Running {
    Rabbitmq(Relay<RabbitMqPublisher>),
    Nats(Relay<JetStreamPublisher>),
}

/// The relay's pool, checked against the table (failing fast when it is missing rather
/// than on the first cycle).
async fn pool(
    outbox: &Outbox,
    database_url: &Secret,
    no_statement_cache: bool,
    args: &RelayArgs,
) -> Result<PgPool, Failure> {
    let mut config = ManagerConfig::default();
    config.custom_setup = if no_statement_cache {
        Box::new(diesel_outbox::establish_without_statement_cache)
    } else {
        Box::new(diesel_outbox::establish)
    };
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
        .map_err(|e| Failure::new(CONNECTION, format!("cannot build the pool: {e}")))?;
    // Fail fast when the table is missing rather than on the first cycle.
    {
        let mut conn = pool.get().await.map_err(Error::from)?;
        outbox.stats(&mut conn).await?;
    }
    Ok(pool)
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
