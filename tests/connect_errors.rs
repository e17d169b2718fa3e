//! Connection failures say where and why: the host and port tried and the cause, never a
//! password, a seed or a URL (PostgreSQL, RabbitMQ, NATS and Kafka); a pool that times out says why no connection came; and the
//! binary prints one error line for one failure.
#![cfg(feature = "cli")]

mod common;

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use common::cluster::{Node, Scratch, free_ports};
use diesel_outbox::consumer::{Consumer, handler_fn, rabbitmq};
use diesel_outbox::nats::{Credentials, JetStreamPublisher};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Outbox, PgPool};

const BIN: &str = env!("CARGO_BIN_EXE_diesel-outbox");
/// Every secret a test hands over; none may show.
const SECRET: &str = "hunter2";

/// A PostgreSQL server of the test's own that asks `app` for its password (SCRAM) and
/// trusts `postgres`.
struct PasswordPostgres {
    node: Node,
    _scratch: Arc<Scratch>,
}

impl PasswordPostgres {
    fn start() -> PasswordPostgres {
        let scratch = Scratch::new("outbox_password");
        let [port] = free_ports();
        let hba = "local all all trust\n\
                   host all postgres 127.0.0.1/32 trust\n\
                   host all all 127.0.0.1/32 scram-sha-256\n";
        let node = Node::init(
            &scratch,
            port,
            "password_encryption = 'scram-sha-256'",
            Some(hba),
        );
        node.psql("CREATE ROLE app LOGIN PASSWORD 'the-right-one'");
        PasswordPostgres {
            node,
            _scratch: scratch,
        }
    }

    /// `app`'s URL with the wrong password.
    fn wrong_password(&self) -> String {
        format!(
            "postgres://app:{SECRET}@127.0.0.1:{}/postgres?sslmode=disable",
            self.node.port
        )
    }
}

/// The binary with `args` and `env`, its database and brokers set by them alone.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args);
    for var in [
        "DATABASE_URL",
        "DATABASE_URL_FILE",
        "AMQP_URL",
        "AMQP_URL_FILE",
        "NATS_URL",
        "NATS_URL_FILE",
        "NATS_NKEY",
        "NATS_NKEY_FILE",
        "KAFKA_BROKERS",
        "KAFKA_USER",
        "KAFKA_PASSWORD",
        "KAFKA_PASSWORD_FILE",
        "KAFKA_SASL_MECHANISM",
        "RUST_LOG",
    ] {
        command.env_remove(var);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("run the binary")
}

/// The one line the binary printed on stderr for its failure, after checking that there
/// is exactly one, that it exits with `code`, and that no secret shows.
fn one_error_line(output: &Output, code: i32) -> String {
    let err = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(output.status.code(), Some(code), "{err}");
    assert_eq!(lines.len(), 1, "one failure, one line:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(!err.contains(SECRET), "{err}");
    lines[0].to_owned()
}

/// `text` says the connection to `port` was refused, and shows no secret.
fn assert_refused(text: &str, port: u16) {
    assert!(
        text.contains(&format!("127.0.0.1:{port}"))
            && text.contains("Connection refused")
            && !text.contains(SECRET),
        "{text}"
    );
}

/// A schema of the test's own with a migrated outbox table: the relay's own table is
/// there, so what fails is the broker.
async fn migrated() -> (common::TestSchema, String, Outbox) {
    let schema = common::TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    outbox.migrate(&mut schema.connect().await).await.unwrap();
    (schema, table, outbox)
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let [port] = free_ports();
    port
}

#[tokio::test]
async fn postgres_failures_name_the_server_and_the_cause_never_the_password() {
    if !common::services::needs(
        "postgres_failures_name_the_server_and_the_cause_never_the_password",
        common::cluster::missing(),
    ) {
        return;
    }
    let pg = PasswordPostgres::start();
    let place = format!("127.0.0.1:{}", pg.node.port);
    let wrong = diesel_outbox::establish(&pg.wrong_password())
        .await
        .err()
        .expect("a wrong password is refused")
        .to_string();
    assert!(
        wrong.contains(&place)
            && wrong.contains("password authentication failed for user \"app\"")
            && !wrong.contains(SECRET),
        "{wrong}"
    );

    let port = closed_port();
    let refused = diesel_outbox::establish(&format!(
        "postgres://app:{SECRET}@127.0.0.1:{port}/postgres"
    ))
    .await
    .err()
    .expect("nothing listens")
    .to_string();
    assert_refused(&refused, port);

    // A pool gives up after its timeout; `checkout` says why.
    let pool: PgPool = PgPool::builder()
        .connection_timeout(Duration::from_secs(1))
        .build(diesel_outbox::connection_manager(pg.wrong_password()))
        .await
        .unwrap();
    let timed_out = diesel_outbox::checkout(&pool)
        .await
        .err()
        .expect("no connection");
    assert!(matches!(timed_out, Error::Pool(_)), "{timed_out:?}");
    let timed_out = timed_out.to_string();
    assert!(
        timed_out.contains("no connection within the pool's timeout")
            && timed_out.contains(&place)
            && timed_out.contains("password authentication failed")
            && !timed_out.contains(SECRET),
        "{timed_out}"
    );

    // The binary: one line, exit code 3 (connection), for a command and for the relay.
    let url = pg.wrong_password();
    let stats = one_error_line(&cli(&["stats"], &[("DATABASE_URL", &url)]), 3);
    assert!(
        stats.contains(&place) && stats.contains("password authentication failed"),
        "{stats}"
    );
    let relay = one_error_line(
        &cli(
            &["relay", "--exchange", "amq.topic"],
            &[
                ("DATABASE_URL", &url),
                ("AMQP_URL", &common::broker::amqp_url()),
            ],
        ),
        3,
    );
    assert!(relay.contains(&place), "{relay}");
}

/// A pool whose connections are all taken says so, rather than blaming the database.
#[tokio::test]
async fn a_pool_with_every_connection_taken_says_so() {
    let pool: PgPool = PgPool::builder()
        .max_size(1)
        .connection_timeout(Duration::from_millis(300))
        .build(diesel_outbox::connection_manager(common::database_url()))
        .await
        .unwrap();
    let held = diesel_outbox::checkout(&pool).await.unwrap();
    let busy = diesel_outbox::checkout(&pool)
        .await
        .err()
        .expect("the only connection is held")
        .to_string();
    assert!(
        busy.contains("all 1 connections of the pool were in use"),
        "{busy}"
    );
    drop(held);
    diesel_outbox::checkout(&pool).await.expect("free again");
}

#[tokio::test]
async fn rabbitmq_failures_name_the_broker_and_the_cause_never_the_password() {
    let broker = common::broker::amqp_authority();
    let url = format!("amqp://guest:{SECRET}@{broker}/%2f");
    let wrong = RabbitMqPublisher::builder(&url, "amq.topic")
        .connect()
        .await
        .expect_err("a wrong password is refused")
        .to_string();
    assert!(
        wrong.contains(&broker) && wrong.contains("ACCESS_REFUSED") && !wrong.contains(SECRET),
        "{wrong}"
    );
    let port = closed_port();
    let refused = RabbitMqPublisher::builder(
        format!("amqp://guest:{SECRET}@127.0.0.1:{port}/%2f"),
        "amq.topic",
    )
    .connect()
    .await
    .expect_err("nothing listens")
    .to_string();
    assert_refused(&refused, port);

    // A consumer keeps trying (the password may be rotated in), and its health says why.
    let (_schema, table, outbox) = migrated().await;
    let consumer = Arc::new(
        Consumer::builder(outbox, common::pool(2).await, "refused")
            .source(rabbitmq::Source::queue(&url, "no-matter"))
            .handler(handler_fn(|_, _| Box::pin(async { Ok(()) })))
            .build()
            .unwrap(),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn({
        let consumer = consumer.clone();
        async move {
            consumer
                .run_until(async {
                    let _ = stopped.await;
                })
                .await
        }
    });
    let reasons = common::eventually(common::DEADLINE, "the consumer says why", || {
        let health = consumer.health();
        async move {
            (!health.ready && health.reasons.iter().any(|r| r.contains("ACCESS_REFUSED")))
                .then_some(health.reasons)
        }
    })
    .await;
    let said = reasons.join("; ");
    assert!(said.contains(&broker) && !said.contains(SECRET), "{said}");
    let _ = stop.send(());
    running.await.unwrap().unwrap();

    // The binary: one line (lapin's own account of the refusal is not repeated).
    let relay = one_error_line(
        &cli(
            &["relay", "--table", &table, "--exchange", "amq.topic"],
            &[
                ("DATABASE_URL", &common::database_url()),
                ("AMQP_URL", &url),
            ],
        ),
        3,
    );
    assert!(
        relay.contains(&broker) && relay.contains("ACCESS_REFUSED"),
        "{relay}"
    );
}

#[tokio::test]
async fn nats_failures_name_the_server_and_the_cause_never_the_credentials() {
    let port = closed_port();
    let refused = JetStreamPublisher::builder(format!("nats://127.0.0.1:{port}"))
        .credentials(Credentials::user_and_password("app", SECRET))
        .connect()
        .await
        .expect_err("nothing listens")
        .to_string();
    assert!(
        refused.contains(&format!("127.0.0.1:{port}")) && !refused.contains(SECRET),
        "{refused}"
    );
    if !common::services::needs(
        "nats_failures_name_the_server_and_the_cause_never_the_credentials",
        common::nats::TlsNats::missing(),
    ) {
        return;
    }
    // A server that knows one NKey user; this seed is another user's.
    let nats = common::nats::TlsNats::start();
    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let place = nats.url.trim_start_matches("tls://").to_owned();
    let wrong = JetStreamPublisher::builder(&nats.url)
        .tls(diesel_outbox::Tls::new().ca_file(&nats.ca))
        .credentials(Credentials::nkey_seed(&stranger))
        .connect()
        .await
        .expect_err("an unknown NKey is refused")
        .to_string();
    assert!(
        wrong.contains(&place)
            && wrong.to_lowercase().contains("authorization")
            && !wrong.contains(&stranger),
        "{wrong}"
    );

    let (_schema, table, _outbox) = migrated().await;
    let ca = nats.ca.display().to_string();
    let relay = cli(
        &[
            "relay",
            "--table",
            &table,
            "--broker",
            "nats",
            "--nats-tls-ca",
            &ca,
        ],
        &[
            ("DATABASE_URL", &common::database_url()),
            ("NATS_URL", &nats.url),
            ("NATS_NKEY", &stranger),
        ],
    );
    let line = one_error_line(&relay, 3);
    assert!(line.contains(&place) && !line.contains(&stranger), "{line}");
}

#[tokio::test]
async fn kafka_failures_name_the_brokers_and_the_cause_never_the_password() {
    use diesel_outbox::kafka::{KafkaPublisher, Sasl};
    let port = closed_port();
    let refused = KafkaPublisher::builder(format!("127.0.0.1:{port}"))
        .sasl(Sasl::plain("app", SECRET))
        .delivery_timeout(Duration::from_secs(2))
        .connect()
        .await
        .expect_err("nothing listens")
        .to_string();
    assert_refused(&refused, port);

    let (_schema, table, _outbox) = migrated().await;
    let brokers = format!("127.0.0.1:{port}");
    let relay = cli(
        &[
            "relay",
            "--table",
            &table,
            "--broker",
            "kafka",
            "--kafka-sasl-mechanism",
            "scram-sha-256",
            "--kafka-user",
            "app",
            "--confirm-timeout",
            "2s",
        ],
        &[
            ("DATABASE_URL", &common::database_url()),
            ("KAFKA_BROKERS", &brokers),
            ("KAFKA_PASSWORD", SECRET),
        ],
    );
    assert_refused(&one_error_line(&relay, 3), port);
}
