//! The broker side of the binary: how to reach a broker (its URL, TLS and login, shared by
//! `relay` and `declare`), and `declare`, which creates what the relay and its consumers
//! need there.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use diesel_outbox::nats::{self, Credentials};
use diesel_outbox::{Tls, kafka, rabbitmq};

use crate::output::Output;
use crate::secret::{self, Secret};
use crate::{Failure, USAGE};

/// The brokers the binary talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Broker {
    /// RabbitMQ: `--amqp-url` and `--exchange`.
    Rabbitmq,
    /// NATS JetStream: `--nats-url` and `--subject-prefix`.
    Nats,
    /// Kafka: `--kafka-brokers` and `--topic-prefix`.
    Kafka,
}

/// The SASL mechanisms of `--kafka-sasl-mechanism`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum SaslMechanism {
    /// `PLAIN`: the password as it is (use it with TLS).
    Plain,
    /// `SCRAM-SHA-256`.
    #[value(name = "scram-sha-256")]
    ScramSha256,
    /// `SCRAM-SHA-512`.
    #[value(name = "scram-sha-512")]
    ScramSha512,
}

/// How to reach the broker: its URL, TLS and login, from flags, the environment or files.
#[derive(Args)]
pub(crate) struct BrokerArgs {
    /// The broker.
    #[arg(long, value_enum, default_value_t = Broker::Rabbitmq, env = "OUTBOX_BROKER")]
    pub(crate) broker: Broker,
    /// RabbitMQ URL (with `--broker rabbitmq`): `amqp://`, or `amqps://` for TLS
    /// (`?auth_mechanism=external` logs in with the client certificate).
    #[arg(
        help_heading = "RabbitMQ",
        long,
        env = "AMQP_URL",
        hide_env_values = true
    )]
    pub(crate) amqp_url: Option<Secret>,
    /// A file holding the RabbitMQ URL, instead of `--amqp-url`.
    #[arg(help_heading = "RabbitMQ", long, env = "AMQP_URL_FILE", value_name = "PATH", value_parser = secret::read_file)]
    pub(crate) amqp_url_file: Option<Secret>,
    /// A PEM file of CAs to trust for `amqps://`, besides the platform's roots.
    #[arg(
        help_heading = "RabbitMQ",
        long,
        env = "AMQP_TLS_CA",
        value_name = "PATH"
    )]
    pub(crate) amqp_tls_ca: Option<PathBuf>,
    /// A PEM client certificate for `amqps://` (with `--amqp-tls-key`).
    #[arg(
        help_heading = "RabbitMQ",
        long,
        env = "AMQP_TLS_CERT",
        value_name = "PATH",
        requires = "amqp_tls_key"
    )]
    pub(crate) amqp_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--amqp-tls-cert`.
    #[arg(
        help_heading = "RabbitMQ",
        long,
        env = "AMQP_TLS_KEY",
        value_name = "PATH",
        requires = "amqp_tls_cert"
    )]
    pub(crate) amqp_tls_key: Option<PathBuf>,
    /// Kafka's bootstrap servers, `host:port` separated by commas (with `--broker kafka`).
    #[arg(help_heading = "Kafka", long, env = "KAFKA_BROKERS")]
    pub(crate) kafka_brokers: Option<String>,
    /// Connect to Kafka over TLS, verified against the platform's roots (and
    /// `--kafka-tls-ca`).
    #[arg(help_heading = "Kafka", long, env = "KAFKA_TLS", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) kafka_tls: bool,
    /// A PEM file of CAs to trust for Kafka, besides the platform's roots (implies
    /// `--kafka-tls`).
    #[arg(
        help_heading = "Kafka",
        long,
        env = "KAFKA_TLS_CA",
        value_name = "PATH"
    )]
    pub(crate) kafka_tls_ca: Option<PathBuf>,
    /// A PEM client certificate for Kafka (with `--kafka-tls-key`; implies `--kafka-tls`).
    #[arg(
        help_heading = "Kafka",
        long,
        env = "KAFKA_TLS_CERT",
        value_name = "PATH",
        requires = "kafka_tls_key"
    )]
    pub(crate) kafka_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--kafka-tls-cert`.
    #[arg(
        help_heading = "Kafka",
        long,
        env = "KAFKA_TLS_KEY",
        value_name = "PATH",
        requires = "kafka_tls_cert"
    )]
    pub(crate) kafka_tls_key: Option<PathBuf>,
    /// How to log in to Kafka with SASL (with `--kafka-user`).
    #[arg(
        help_heading = "Kafka",
        long,
        value_enum,
        env = "KAFKA_SASL_MECHANISM",
        requires = "kafka_user"
    )]
    pub(crate) kafka_sasl_mechanism: Option<SaslMechanism>,
    /// The SASL user (with `--kafka-sasl-mechanism` and a password).
    #[arg(
        help_heading = "Kafka",
        long,
        env = "KAFKA_USER",
        requires = "kafka_sasl_mechanism"
    )]
    pub(crate) kafka_user: Option<String>,
    /// The password of `--kafka-user`.
    #[arg(
        help_heading = "Kafka",
        long,
        env = "KAFKA_PASSWORD",
        hide_env_values = true,
        requires = "kafka_user"
    )]
    pub(crate) kafka_password: Option<Secret>,
    /// A file holding the password of `--kafka-user`, instead of `--kafka-password`.
    #[arg(help_heading = "Kafka", long, env = "KAFKA_PASSWORD_FILE", value_name = "PATH", value_parser = secret::read_file, requires = "kafka_user")]
    pub(crate) kafka_password_file: Option<Secret>,
    /// A librdkafka property for Kafka's clients (repeatable): a login the flags do not
    /// offer (OAUTHBEARER), `client.id`, `compression.type`, … Keys the crate sets for its
    /// guarantees (`acks`, `enable.idempotence`, `bootstrap.servers`, …) are refused. Values
    /// are never printed.
    #[arg(
        help_heading = "Kafka",
        long = "kafka-property",
        value_name = "KEY=VALUE"
    )]
    pub(crate) kafka_property: Vec<Secret>,
    /// A file of librdkafka properties, one `KEY=VALUE` a line (blank lines and lines
    /// starting with `#` are skipped), before those of `--kafka-property`: for secrets
    /// such as `sasl.oauthbearer.client.secret`.
    #[arg(help_heading = "Kafka", long, env = "KAFKA_PROPERTIES_FILE", value_name = "PATH", value_parser = secret::read_file)]
    pub(crate) kafka_properties_file: Option<Secret>,
    /// The properties of `--kafka-properties-file` and `--kafka-property`, in that order,
    /// as `resolve` parsed them.
    #[arg(skip)]
    pub(crate) kafka_properties: Vec<(String, Secret)>,
    /// NATS URL, or several comma-separated (with `--broker nats`); `tls://` for TLS.
    #[arg(help_heading = "NATS", long, env = "NATS_URL", hide_env_values = true)]
    pub(crate) nats_url: Option<Secret>,
    /// A file holding the NATS URL, instead of `--nats-url`.
    #[arg(help_heading = "NATS", long, env = "NATS_URL_FILE", value_name = "PATH", value_parser = secret::read_file)]
    pub(crate) nats_url_file: Option<Secret>,
    /// Connect to NATS over TLS, verified against the platform's roots (and
    /// `--nats-tls-ca`), whatever the URL says.
    #[arg(help_heading = "NATS", long, env = "NATS_TLS", value_parser = clap::builder::BoolishValueParser::new())]
    pub(crate) nats_tls: bool,
    /// A PEM file of CAs to trust for NATS, besides the platform's roots (implies
    /// `--nats-tls`).
    #[arg(help_heading = "NATS", long, env = "NATS_TLS_CA", value_name = "PATH")]
    pub(crate) nats_tls_ca: Option<PathBuf>,
    /// A PEM client certificate for NATS (with `--nats-tls-key`; implies `--nats-tls`).
    #[arg(
        help_heading = "NATS",
        long,
        env = "NATS_TLS_CERT",
        value_name = "PATH",
        requires = "nats_tls_key"
    )]
    pub(crate) nats_tls_cert: Option<PathBuf>,
    /// The PEM private key of `--nats-tls-cert`.
    #[arg(
        help_heading = "NATS",
        long,
        env = "NATS_TLS_KEY",
        value_name = "PATH",
        requires = "nats_tls_cert"
    )]
    pub(crate) nats_tls_key: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed).
    #[arg(help_heading = "NATS", long, env = "NATS_CREDS", value_name = "PATH")]
    pub(crate) nats_creds: Option<PathBuf>,
    /// An NKey seed to log in to NATS with.
    #[arg(help_heading = "NATS", long, env = "NATS_NKEY", hide_env_values = true)]
    pub(crate) nats_nkey: Option<Secret>,
    /// A file holding the NKey seed, instead of `--nats-nkey`.
    #[arg(help_heading = "NATS", long, env = "NATS_NKEY_FILE", value_name = "PATH", value_parser = secret::read_file)]
    pub(crate) nats_nkey_file: Option<Secret>,
    /// A token to log in to NATS with.
    #[arg(
        help_heading = "NATS",
        long,
        env = "NATS_TOKEN",
        hide_env_values = true
    )]
    pub(crate) nats_token: Option<Secret>,
    /// A file holding the token, instead of `--nats-token`.
    #[arg(help_heading = "NATS", long, env = "NATS_TOKEN_FILE", value_name = "PATH", value_parser = secret::read_file)]
    pub(crate) nats_token_file: Option<Secret>,
    /// A user to log in to NATS as (with `--nats-password` or `--nats-password-file`).
    #[arg(help_heading = "NATS", long, env = "NATS_USER")]
    pub(crate) nats_user: Option<String>,
    /// The password of `--nats-user`.
    #[arg(
        help_heading = "NATS",
        long,
        env = "NATS_PASSWORD",
        hide_env_values = true,
        requires = "nats_user"
    )]
    pub(crate) nats_password: Option<Secret>,
    /// A file holding the password of `--nats-user`, instead of `--nats-password`.
    #[arg(help_heading = "NATS", long, env = "NATS_PASSWORD_FILE", value_name = "PATH", value_parser = secret::read_file, requires = "nats_user")]
    pub(crate) nats_password_file: Option<Secret>,
}

impl BrokerArgs {
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
        pick(
            ("kafka_password", &mut self.kafka_password),
            ("kafka_password_file", &mut self.kafka_password_file),
        )?;
        self.kafka_properties =
            kafka_properties(self.kafka_properties_file.as_ref(), &self.kafka_property)?;
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

impl BrokerArgs {
    /// The RabbitMQ URL, or a usage error saying how to give one (and, for an address of
    /// another broker, that `--broker` picks the broker).
    pub(crate) fn amqp_url(&self) -> Result<&Secret, Failure> {
        let Some(url) = self.amqp_url.as_ref() else {
            return Err(Failure::new(
                USAGE,
                format!(
                    "RabbitMQ needs --amqp-url (or AMQP_URL, --amqp-url-file, \
                     AMQP_URL_FILE){}",
                    self.other_broker_given()
                ),
            ));
        };
        let scheme = scheme(url.expose());
        if matches!(scheme.as_deref(), Some("amqp" | "amqps")) {
            return Ok(url);
        }
        let (looks, flags) = match scheme.as_deref() {
            Some("kafka") => ("a Kafka address", "--broker kafka with --kafka-brokers"),
            None if host_and_ports(url.expose()) => {
                ("a Kafka address", "--broker kafka with --kafka-brokers")
            }
            Some("nats" | "tls") => ("a NATS URL", "--broker nats with --nats-url"),
            _ => return Ok(url),
        };
        Err(Failure::new(
            USAGE,
            format!(
                "the RabbitMQ URL (--amqp-url or AMQP_URL; not shown) is not amqp:// or \
                 amqps://: it looks like {looks}. The broker is RabbitMQ unless --broker \
                 (or OUTBOX_BROKER) says otherwise: for another one pass {flags}"
            ),
        ))
    }

    /// The NATS URL, or a usage error saying how to give one (and, for a URL of another
    /// broker, that `--broker` picks the broker).
    pub(crate) fn nats_url(&self) -> Result<&Secret, Failure> {
        let Some(url) = self.nats_url.as_ref() else {
            return Err(Failure::new(
                USAGE,
                "NATS needs --nats-url (or NATS_URL, --nats-url-file, NATS_URL_FILE)",
            ));
        };
        let (looks, flags) = match scheme(url.expose()).as_deref() {
            Some("amqp" | "amqps") => ("a RabbitMQ URL", "--broker rabbitmq with --amqp-url"),
            Some("kafka") => ("a Kafka address", "--broker kafka with --kafka-brokers"),
            _ => return Ok(url),
        };
        Err(Failure::new(
            USAGE,
            format!(
                "the NATS URL (--nats-url or NATS_URL; not shown) looks like {looks}: for \
                 that broker pass {flags}"
            ),
        ))
    }

    /// Kafka's bootstrap servers, or a usage error saying how to give them (and, for a URL
    /// of another broker, that `--broker` picks the broker).
    pub(crate) fn kafka_brokers(&self) -> Result<&str, Failure> {
        let Some(brokers) = self.kafka_brokers.as_deref() else {
            return Err(Failure::new(
                USAGE,
                "Kafka needs --kafka-brokers (or KAFKA_BROKERS)",
            ));
        };
        let (looks, flags) = match scheme(brokers).as_deref() {
            Some("amqp" | "amqps") => ("a RabbitMQ URL", "--broker rabbitmq with --amqp-url"),
            Some("nats" | "tls") => ("a NATS URL", "--broker nats with --nats-url"),
            Some("kafka") => {
                return Err(Failure::new(
                    USAGE,
                    "Kafka's brokers (--kafka-brokers or KAFKA_BROKERS; not shown) must be \
                     `host:port` separated by commas, without a kafka:// scheme",
                ));
            }
            _ => return Ok(brokers),
        };
        Err(Failure::new(
            USAGE,
            format!(
                "Kafka's brokers (--kafka-brokers or KAFKA_BROKERS; not shown) must be \
                 `host:port` separated by commas, and look like {looks}: for that broker \
                 pass {flags}"
            ),
        ))
    }

    /// Checks that the broker chosen has the address it needs, and that the address is
    /// that broker's, before anything connects.
    pub(crate) fn check(&self) -> Result<(), Failure> {
        match self.broker {
            Broker::Rabbitmq => self.amqp_url().map(drop),
            Broker::Nats => self.nats_url().map(drop),
            Broker::Kafka => self.kafka_brokers().map(drop),
        }
    }

    /// For RabbitMQ given no URL: the other brokers' addresses that are given, as a hint
    /// that `--broker` was forgotten (or nothing).
    fn other_broker_given(&self) -> String {
        let mut given = Vec::new();
        if self.kafka_brokers.is_some() {
            given.push("--kafka-brokers is given: for Kafka pass --broker kafka");
        }
        if self.nats_url.is_some() {
            given.push("--nats-url is given: for NATS pass --broker nats");
        }
        if given.is_empty() {
            String::new()
        } else {
            format!(
                ". The broker is RabbitMQ unless --broker (or OUTBOX_BROKER) says otherwise; \
                 {}",
                given.join("; ")
            )
        }
    }

    /// RabbitMQ's TLS settings, if any file is given.
    pub(crate) fn amqp_tls(&self) -> Option<Tls> {
        tls(&self.amqp_tls_ca, &self.amqp_tls_cert, &self.amqp_tls_key)
    }

    /// NATS's TLS settings: given files, or `--nats-tls` alone.
    pub(crate) fn nats_tls(&self) -> Option<Tls> {
        tls(&self.nats_tls_ca, &self.nats_tls_cert, &self.nats_tls_key)
            .or_else(|| self.nats_tls.then(Tls::new))
    }

    /// Kafka's TLS settings: given files, or `--kafka-tls` alone.
    pub(crate) fn kafka_tls(&self) -> Option<Tls> {
        tls(
            &self.kafka_tls_ca,
            &self.kafka_tls_cert,
            &self.kafka_tls_key,
        )
        .or_else(|| self.kafka_tls.then(Tls::new))
    }

    /// Kafka's SASL login, if a mechanism and user are given.
    pub(crate) fn kafka_sasl(&self) -> Option<kafka::Sasl> {
        let user = self.kafka_user.as_ref()?;
        let password = self.kafka_password.as_ref().map_or("", Secret::expose);
        Some(match self.kafka_sasl_mechanism? {
            SaslMechanism::Plain => kafka::Sasl::plain(user, password),
            SaslMechanism::ScramSha256 => kafka::Sasl::scram_sha256(user, password),
            SaslMechanism::ScramSha512 => kafka::Sasl::scram_sha512(user, password),
        })
    }

    /// The NATS credentials of the options ([`BrokerArgs::resolve`] lets at most one
    /// through).
    pub(crate) fn nats_credentials(&self) -> Option<Credentials> {
        if let Some(path) = &self.nats_creds {
            return Some(Credentials::file(path));
        }
        if let Some(seed) = &self.nats_nkey {
            return Some(Credentials::nkey_seed(seed.expose()));
        }
        if let Some(token) = &self.nats_token {
            return Some(Credentials::token(token.expose()));
        }
        let user = self.nats_user.as_ref()?;
        let password = self.nats_password.as_ref().map_or("", Secret::expose);
        Some(Credentials::user_and_password(user, password))
    }
}

/// The `KEY=VALUE` pairs of `file` (one a line; blank lines and `#` comments skipped), then
/// those of `flags`, each key and value without the whitespace around them. A malformed
/// one (no `=`, or an empty key) is a usage error that says where it is, never what it
/// holds.
pub(crate) fn kafka_properties(
    file: Option<&Secret>,
    flags: &[Secret],
) -> Result<Vec<(String, Secret)>, String> {
    let pair = |text: &str| {
        let (key, value) = text.split_once('=')?;
        let key = key.trim();
        let value = value
            .trim()
            .parse::<Secret>()
            .unwrap_or_else(|e| match e {});
        (!key.is_empty()).then(|| (key.to_owned(), value))
    };
    let mut properties = Vec::new();
    if let Some(file) = file {
        for (number, line) in file.expose().lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            properties.push(pair(line).ok_or_else(|| {
                format!(
                    "--kafka-properties-file: line {} is not KEY=VALUE (not shown)",
                    number + 1
                )
            })?);
        }
    }
    for (number, flag) in flags.iter().enumerate() {
        properties.push(pair(flag.expose()).ok_or_else(|| {
            format!(
                "--kafka-property takes KEY=VALUE: the {} given is not (not shown)",
                ordinal(number + 1)
            )
        })?);
    }
    Ok(properties)
}

/// `1st`, `2nd`, `3rd`, `4th`, … `11th`, `21st`.
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// The scheme of `url` in lower case (`amqp` of `amqp://…`), or `None` when it has none
/// (as `host:port`). Never more of the URL than that.
fn scheme(url: &str) -> Option<String> {
    let (scheme, _) = url.trim().split_once("://")?;
    let plain = !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    plain.then(|| scheme.to_ascii_lowercase())
}

/// True when `value` is `host:port`, or several separated by commas (a Kafka broker list).
fn host_and_ports(value: &str) -> bool {
    value.split(',').map(str::trim).all(|entry| {
        entry.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && !host.contains(['/', '@', '?'])
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
    })
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

/// `declare`: what a relay publishes to and its consumers consume from.
#[derive(Args)]
pub(crate) struct DeclareArgs {
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// RabbitMQ: the topic exchange the relay publishes to.
    #[arg(long, env = "OUTBOX_EXCHANGE")]
    exchange: Option<String>,
    /// RabbitMQ: a queue for a consumer, bound to the exchange (repeatable), with a
    /// dead-letter exchange and queue `<queue>.dead`.
    #[arg(long)]
    queue: Vec<String>,
    /// RabbitMQ: the routing key pattern that binds the queues (`#`: every topic).
    #[arg(long, default_value = "#")]
    binding: String,
    /// RabbitMQ: queues without dead-letter exchanges and queues.
    #[arg(long)]
    without_dead_letters: bool,
    /// NATS: the stream that captures the relay's subjects.
    #[arg(long)]
    stream: Option<String>,
    /// NATS: the relay's subject prefix (ending with a dot); the stream captures
    /// `<prefix>>`.
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX")]
    subject_prefix: Option<String>,
    /// NATS: a durable pull consumer of the stream for a consumer (repeatable).
    #[arg(long)]
    durable: Vec<String>,
    /// Kafka: a topic to create (repeatable): the relay's topic prefix + a record's topic.
    #[arg(long)]
    topic: Vec<String>,
    /// Kafka: the partitions of each topic created.
    #[arg(long, default_value_t = 1)]
    partitions: u32,
    /// Kafka: the replicas of each partition (defaults to the cluster's default).
    #[arg(long)]
    replication: Option<u16>,
    /// Kafka: with each topic, its dead-letter topic `<topic>.dlt` (as many partitions),
    /// where the consumer runner's source sends the messages its handler rejected.
    #[arg(long)]
    dead_letter_topics: bool,
}

/// Declares the topology on the broker, idempotently.
pub(crate) async fn declare(args: DeclareArgs, out: &mut Output<'_>) -> Result<(), Failure> {
    let b = &args.broker;
    b.check()?;
    let mut kafka_topics = None;
    let declared = match b.broker {
        Broker::Rabbitmq => {
            let Some(exchange) = &args.exchange else {
                return Err(Failure::new(
                    USAGE,
                    "declare --broker rabbitmq needs --exchange",
                ));
            };
            let mut topology = rabbitmq::Topology::exchange(exchange);
            for queue in &args.queue {
                topology = topology.queue(queue, &args.binding);
            }
            if args.without_dead_letters {
                topology = topology.without_dead_letters();
            }
            if let Some(tls) = b.amqp_tls() {
                topology = topology.tls(tls);
            }
            topology.declare(b.amqp_url()?.expose()).await?;
            let mut names = vec![format!("exchange {exchange}")];
            for queue in &args.queue {
                names.push(format!("queue {queue} (binding {})", args.binding));
                if !args.without_dead_letters {
                    names.push(format!("dead letters {queue}.dead"));
                }
            }
            names
        }
        Broker::Nats => {
            let (Some(stream), Some(prefix)) = (&args.stream, &args.subject_prefix) else {
                return Err(Failure::new(
                    USAGE,
                    "declare --broker nats needs --stream and --subject-prefix",
                ));
            };
            let mut topology = nats::Topology::stream(stream, prefix);
            for durable in &args.durable {
                topology = topology.durable(durable);
            }
            if let Some(tls) = b.nats_tls() {
                topology = topology.tls(tls);
            }
            if let Some(credentials) = b.nats_credentials() {
                topology = topology.credentials(credentials);
            }
            topology.declare(b.nats_url()?.expose()).await?;
            let mut names = vec![format!("stream {stream} ({prefix}>)")];
            names.extend(args.durable.iter().map(|d| format!("durable consumer {d}")));
            names
        }
        Broker::Kafka => {
            if args.topic.is_empty() {
                return Err(Failure::new(
                    USAGE,
                    "declare --broker kafka needs --topic (one or more)",
                ));
            }
            let mut topology = kafka::Topology::new();
            for topic in &args.topic {
                topology = topology.topic(topic, args.partitions);
            }
            if args.dead_letter_topics {
                topology = topology.dead_letter_topics();
            }
            if let Some(replicas) = args.replication {
                topology = topology.replication(replicas);
            }
            if let Some(tls) = b.kafka_tls() {
                topology = topology.tls(tls);
            }
            if let Some(sasl) = b.kafka_sasl() {
                topology = topology.sasl(sasl);
            }
            for (key, value) in &b.kafka_properties {
                topology = topology.property(key, value.expose());
            }
            let topics = topology.declare(b.kafka_brokers()?).await?;
            let names = topics.iter().map(described).collect();
            kafka_topics = Some(
                topics
                    .iter()
                    .map(|t| {
                        serde_json::json!({
                            "name": t.name,
                            "partitions": t.partitions,
                            "partitions_asked": t.asked,
                            "created": t.created,
                        })
                    })
                    .collect::<Vec<_>>(),
            );
            names
        }
    };
    let mut json = serde_json::json!({ "declared": declared });
    if let Some(topics) = kafka_topics {
        json["topics"] = topics.into();
    }
    out.print(json, || {
        format!("declared (or found as they were): {}", declared.join(", "))
    })
}

/// What `declare` did with a Kafka topic, in words: created, found as asked, or found with
/// other partitions (which it leaves as they are).
fn described(topic: &kafka::DeclaredTopic) -> String {
    let name = &topic.name;
    let (has, asked) = (topic.partitions, topic.asked);
    if topic.created {
        format!("topic {name} (created with {has} partitions)")
    } else if topic.as_asked() {
        format!("topic {name} (found with {has} partitions)")
    } else {
        format!("topic {name} (found with {has} partitions, not the {asked} asked for)")
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    /// The arguments parsed and resolved as `main` does: `Err` is the usage error printed.
    fn resolved(args: &[&str]) -> Result<Vec<(String, String)>, String> {
        let argv = [
            "diesel-outbox",
            "declare",
            "--broker",
            "kafka",
            "--topic",
            "t",
        ];
        let matches = crate::Cli::command()
            .try_get_matches_from(argv.iter().chain(args).copied())
            .expect("valid arguments");
        let cli = crate::Cli::from_arg_matches(&matches)
            .unwrap()
            .resolve(&matches)?;
        let crate::Command::Declare(args) = cli.command else {
            panic!("declare");
        };
        Ok(args
            .broker
            .kafka_properties
            .iter()
            .map(|(k, v)| (k.clone(), v.expose().to_owned()))
            .collect())
    }

    #[test]
    fn kafka_properties_are_key_value_pairs() {
        let dir = std::env::temp_dir().join(format!("outbox-props-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("kafka.properties");
        std::fs::write(
            &file,
            "# the login\nsasl.mechanism = OAUTHBEARER\n\nsasl.oauthbearer.client.secret=a=b\n",
        )
        .unwrap();
        let parsed = resolved(&[
            "--kafka-properties-file",
            file.to_str().unwrap(),
            "--kafka-property",
            "client.id=billing",
            "--kafka-property",
            "linger.ms=",
        ])
        .unwrap();
        assert_eq!(
            parsed,
            [
                ("sasl.mechanism".to_owned(), "OAUTHBEARER".to_owned()),
                ("sasl.oauthbearer.client.secret".into(), "a=b".into()),
                ("client.id".into(), "billing".into()),
                ("linger.ms".into(), String::new()),
            ]
        );
        std::fs::write(&file, "client.id=x\nsasl.password hunter2\n").unwrap();
        let err = resolved(&["--kafka-properties-file", file.to_str().unwrap()]).unwrap_err();
        assert_eq!(
            err,
            "--kafka-properties-file: line 2 is not KEY=VALUE (not shown)"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_malformed_kafka_property_is_a_usage_error_that_never_shows_it() {
        for (args, said) in [
            (
                &["--kafka-property", "sasl.password:hunter2"][..],
                "the 1st given",
            ),
            (
                &["--kafka-property", "a=b", "--kafka-property", "=hunter2"],
                "the 2nd given",
            ),
            (&["--kafka-property", "hunter2"], "the 1st given"),
        ] {
            let err = resolved(args).unwrap_err();
            assert!(err.starts_with("--kafka-property takes KEY=VALUE"), "{err}");
            assert!(err.contains(said), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
        assert_eq!(ordinal(3), "3rd");
        assert_eq!(ordinal(12), "12th");
        assert_eq!(ordinal(22), "22nd");
    }
}
