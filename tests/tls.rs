//! TLS and credentials against real servers, with the encryption proved from the server's
//! side: a PostgreSQL server of the test's own (its CA, its `pg_hba.conf`), RabbitMQ's own
//! TLS listener (set up by `.ci/run`), a nats-server the test starts with TLS and NKey
//! authentication, and a Tansu (Kafka) the test starts behind a TLS listener of its own.
#![cfg(feature = "cli")]

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::cluster::{Node, Scratch, free_ports};
use common::tls::{Ca, write};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Bool, Text};
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use diesel_outbox::{Message, Outbox, PgPool};

const BIN: &str = env!("CARGO_BIN_EXE_diesel-outbox");

/// A PostgreSQL server of the test's own with TLS on. Its certificate, from a CA of the
/// test's own, names `localhost` only. Roles: `postgres` (trust, any transport),
/// `tls_only` (a superuser `pg_hba.conf` admits over `hostssl` only) and `cert_user`
/// (admitted by client certificate only).
struct TlsPostgres {
    node: Node,
    scratch: Arc<Scratch>,
    /// The CA that signed the server's certificate.
    ca: PathBuf,
    /// Another CA, which signed nothing the server shows.
    other_ca: PathBuf,
    /// A client certificate for `cert_user`, and its key.
    client: (PathBuf, PathBuf),
}

impl TlsPostgres {
    fn start() -> TlsPostgres {
        let scratch = Scratch::new("outbox_tls");
        let ca = Ca::new("diesel-outbox test CA");
        let server = ca.server(&["localhost"]);
        let client = ca.client("cert_user");
        let files = (
            scratch.private_file("server.pem", server.cert.as_bytes()),
            scratch.private_file("server.key", server.key.as_bytes()),
            scratch.private_file("server-ca.pem", ca.cert().as_bytes()),
        );
        let [port] = free_ports();
        let hba = "local all all trust\n\
                   hostssl all tls_only 127.0.0.1/32 trust\n\
                   host all tls_only 127.0.0.1/32 reject\n\
                   hostssl all cert_user 127.0.0.1/32 cert\n\
                   host all cert_user 127.0.0.1/32 reject\n\
                   host all all 127.0.0.1/32 trust\n";
        let node = Node::init(
            &scratch,
            port,
            &format!(
                "ssl = on\nssl_cert_file = '{}'\nssl_key_file = '{}'\nssl_ca_file = '{}'\n",
                files.0.display(),
                files.1.display(),
                files.2.display()
            ),
            Some(hba),
        );
        node.psql("CREATE ROLE tls_only LOGIN SUPERUSER; CREATE ROLE cert_user LOGIN");
        let client_files = (
            write(&scratch.dir, "client.pem", &client.cert),
            scratch.private_file("client.key", client.key.as_bytes()),
        );
        TlsPostgres {
            ca: write(&scratch.dir, "ca.pem", &ca.cert()),
            other_ca: write(&scratch.dir, "other-ca.pem", &Ca::new("another CA").cert()),
            client: client_files,
            node,
            scratch,
        }
    }

    /// A URL for `user` at `host`, with `params`.
    fn url(&self, user: &str, host: &str, params: &str) -> String {
        format!(
            "postgres://{user}@{host}:{}/postgres?{params}",
            self.node.port
        )
    }

    /// The URL of `tls_only` at `localhost`, verified in full against the server's CA.
    fn verified(&self, extra: &str) -> String {
        self.url(
            "tls_only",
            "localhost",
            &format!(
                "sslmode=verify-full&sslrootcert={}{extra}",
                self.ca.display()
            ),
        )
    }
}

/// Backends of `application_name`, and how many of them are encrypted, from the
/// server's `pg_stat_ssl`.
async fn ssl_backends(conn: &mut AsyncPgConnection, application_name: &str) -> (i64, i64) {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        all: i64,
        #[diesel(sql_type = BigInt)]
        ssl: i64,
    }
    let count: Count = diesel::sql_query(
        "SELECT count(*) AS all, count(*) FILTER (WHERE s.ssl) AS ssl \
         FROM pg_stat_activity a JOIN pg_stat_ssl s ON s.pid = a.pid \
         WHERE a.application_name = $1",
    )
    .bind::<Text, _>(application_name)
    .get_result(conn)
    .await
    .unwrap();
    (count.all, count.ssl)
}

/// Whether this connection's own backend is encrypted.
async fn encrypted(conn: &mut AsyncPgConnection) -> bool {
    #[derive(QueryableByName)]
    struct Ssl {
        #[diesel(sql_type = Bool)]
        ssl: bool,
    }
    let row: Ssl = diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result(conn)
        .await
        .unwrap();
    row.ssl
}

/// A relay on a pool from [`diesel_outbox::connection_manager`] with `verify-full`: every
/// backend it opens, the LISTEN connection included, is encrypted, as the server's
/// `pg_stat_ssl` shows; and a message goes through.
#[tokio::test]
async fn verify_full_encrypts_every_connection_of_a_relay_listen_included() {
    if !common::services::needs(
        "verify_full_encrypts_every_connection_of_a_relay_listen_included",
        common::cluster::missing(),
    ) {
        return;
    }
    let pg = TlsPostgres::start();
    let app = "outbox_tls_relay";
    let url = pg.verified(&format!("&application_name={app}"));
    let pool: PgPool = PgPool::builder()
        .max_size(3)
        .build(diesel_outbox::connection_manager(url.clone()))
        .await
        .unwrap();
    let mut conn = diesel_outbox::establish(&pg.verified("")).await.unwrap();
    assert!(encrypted(&mut conn).await);
    let outbox = Outbox::new();
    outbox.migrate(&mut conn).await.unwrap();
    let recorder = common::fakes::Recorder::default();
    let relay = outbox
        .relay(pool, recorder.clone())
        .poll_interval(Duration::from_secs(60))
        .build()
        .unwrap();
    let (stop, task) = common::spawn_relay(relay.clone());
    common::eventually(common::DEADLINE, "the relay listening", || async {
        relay.listening().then_some(())
    })
    .await;
    conn.transaction(async |c| {
        outbox
            .enqueue(c, Message::new("tls.test", "x").key("over-tls"))
            .await
    })
    .await
    .unwrap();
    common::eventually(common::DEADLINE, "the message published", || async {
        (recorder.keys() == ["over-tls"]).then_some(())
    })
    .await;
    let (all, ssl) = ssl_backends(&mut conn, app).await;
    assert!(all >= 2, "the pool's and the LISTEN connection: {all}");
    assert_eq!(ssl, all, "every backend of the relay is encrypted");
    common::stop_relay(stop, task).await;
}

/// The binary, as a role `pg_hba.conf` admits over TLS only: `migrate`, `stats` and a relay
/// to RabbitMQ work end to end with `sslmode=verify-full`, every backend of the relay
/// encrypted; with `sslmode=disable` the same role is refused, and the error says so.
#[tokio::test]
async fn the_binary_works_as_a_role_admitted_over_tls_only() {
    if !common::services::needs(
        "the_binary_works_as_a_role_admitted_over_tls_only",
        common::cluster::missing(),
    ) {
        return;
    }
    let pg = TlsPostgres::start();
    let app = "outbox_tls_cli";
    let url = pg.verified(&format!("&application_name={app}"));
    let cli = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", &url)
            .env_remove("DATABASE_URL_FILE")
            .output()
            .unwrap()
    };
    let migrated = cli(&["migrate"]);
    assert!(migrated.status.success(), "{migrated:?}");
    let broker = common::broker::TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let mut relay = Command::new(BIN)
        .args(["relay", "--exchange", &broker.exchange])
        .env("DATABASE_URL", &url)
        .env("AMQP_URL", common::broker::amqp_url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut conn = diesel_outbox::establish(&pg.verified("")).await.unwrap();
    conn.transaction(async |c| {
        Outbox::new()
            .enqueue(c, Message::new("tls.cli", "x").key("cli-over-tls"))
            .await
    })
    .await
    .unwrap();
    let delivery = common::broker::next(&mut consumer, common::DEADLINE)
        .await
        .expect("the relay publishes");
    assert_eq!(common::broker::message_id(&delivery), "cli-over-tls");
    let (all, ssl) = ssl_backends(&mut conn, app).await;
    assert!(all >= 2, "the relay's pool and LISTEN connection: {all}");
    assert_eq!(ssl, all, "every backend of the relay process is encrypted");
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let status = relay.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let stats = cli(&["stats", "--json"]);
    assert!(stats.status.success(), "{stats:?}");
    assert!(String::from_utf8_lossy(&stats.stdout).contains("\"sent\":1"));

    let refused = Command::new(BIN)
        .args(["stats"])
        .env(
            "DATABASE_URL",
            pg.url("tls_only", "localhost", "sslmode=disable"),
        )
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{err}");
    assert!(
        err.contains("no encryption") && err.contains(&format!("localhost:{}", pg.node.port)),
        "{err}"
    );
}

/// Each bad input names its cause: a CA that did not sign the server's certificate, a name
/// the certificate is not for, a missing CA file, an unknown `sslmode`, `verify-full`
/// without a CA, and `require` against a server without TLS. The password never shows.
#[tokio::test]
async fn bad_tls_input_names_the_cause() {
    if !common::services::needs("bad_tls_input_names_the_cause", common::cluster::missing()) {
        return;
    }
    let pg = TlsPostgres::start();
    let fails = async |url: String| -> String {
        match diesel_outbox::establish(&url).await {
            Ok(_) => panic!("connected"),
            Err(e) => {
                let text = e.to_string();
                assert!(!text.contains("hunter2"), "{text}");
                text
            }
        }
    };
    let other = format!("sslmode=verify-ca&sslrootcert={}", pg.other_ca.display());
    let wrong_ca = fails(pg.url("tls_only:hunter2", "localhost", &other)).await;
    assert!(
        wrong_ca.contains("certificate verification failed") && wrong_ca.contains("UnknownIssuer"),
        "{wrong_ca}"
    );
    let full = format!("sslmode=verify-full&sslrootcert={}", pg.ca.display());
    let wrong_name = fails(pg.url("tls_only:hunter2", "127.0.0.1", &full)).await;
    assert!(
        wrong_name.contains("certificate verification failed")
            && wrong_name.contains("not valid for name \"127.0.0.1\""),
        "{wrong_name}"
    );
    // verify-ca checks the chain, not the name.
    let ca_only = format!("sslmode=verify-ca&sslrootcert={}", pg.ca.display());
    let mut conn = diesel_outbox::establish(&pg.url("tls_only", "127.0.0.1", &ca_only))
        .await
        .unwrap();
    assert!(encrypted(&mut conn).await);
    let missing = fails(pg.url(
        "tls_only:hunter2",
        "localhost",
        "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
    ))
    .await;
    assert!(
        missing.contains("cannot read the certificate file /nonexistent/ca.pem"),
        "{missing}"
    );
    let unknown = fails(pg.url("tls_only:hunter2", "localhost", "sslmode=verify")).await;
    assert!(unknown.contains("unknown sslmode \"verify\""), "{unknown}");
    let no_ca = fails(pg.url("tls_only:hunter2", "localhost", "sslmode=verify-full")).await;
    assert!(no_ca.contains("needs a root certificate"), "{no_ca}");

    // A server without TLS.
    let [port] = free_ports();
    let plain = Node::init(&pg.scratch, port, "ssl = off", None);
    let refused = fails(format!(
        "postgres://postgres:hunter2@127.0.0.1:{}/postgres?sslmode=require",
        plain.port
    ))
    .await;
    assert!(refused.contains("server does not support TLS"), "{refused}");
    // `prefer` (the default) connects to it in the clear.
    let mut prefer = diesel_outbox::establish(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        plain.port
    ))
    .await
    .unwrap();
    assert!(!encrypted(&mut prefer).await);
}

/// `sslcert` and `sslkey` log in a role that `pg_hba.conf` admits by certificate only.
#[tokio::test]
async fn a_client_certificate_logs_in() {
    if !common::services::needs("a_client_certificate_logs_in", common::cluster::missing()) {
        return;
    }
    let pg = TlsPostgres::start();
    let with_cert = format!(
        "sslmode=verify-full&sslrootcert={}&sslcert={}&sslkey={}",
        pg.ca.display(),
        pg.client.0.display(),
        pg.client.1.display()
    );
    #[derive(QueryableByName)]
    struct Who {
        #[diesel(sql_type = Text)]
        user: String,
    }
    let mut conn = diesel_outbox::establish(&pg.url("cert_user", "localhost", &with_cert))
        .await
        .unwrap();
    let who: Who = diesel::sql_query("SELECT current_user::text AS user")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(who.user, "cert_user");
    let without = format!("sslmode=verify-full&sslrootcert={}", pg.ca.display());
    let err = diesel_outbox::establish(&pg.url("cert_user", "localhost", &without))
        .await
        .err()
        .expect("no certificate, no login")
        .to_string();
    assert!(err.contains("requires a valid client certificate"), "{err}");
}

/// TLS composes with the pooler option and with a multi-host URL: the first host is
/// closed, the second (the server) is verified under its own name.
#[tokio::test]
async fn tls_holds_without_the_statement_cache_and_across_hosts() {
    if !common::services::needs(
        "tls_holds_without_the_statement_cache_and_across_hosts",
        common::cluster::missing(),
    ) {
        return;
    }
    let pg = TlsPostgres::start();
    let [closed] = free_ports();
    let url = format!(
        "postgres://tls_only@localhost:{closed},localhost:{}/postgres?sslmode=verify-full\
         &sslrootcert={}&target_session_attrs=read-write",
        pg.node.port,
        pg.ca.display()
    );
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(diesel_outbox::establish_without_statement_cache);
    let pool: PgPool = PgPool::builder()
        .max_size(1)
        .build(AsyncDieselConnectionManager::new_with_config(url, config))
        .await
        .unwrap();
    let mut conn = pool.get().await.unwrap();
    assert!(encrypted(&mut conn).await);
}

/// Keys handled by a consumer runner, in the order its handler saw them.
type Handled = Arc<std::sync::Mutex<Vec<String>>>;

/// A consumer runner of the test's own (dedupe in a schema of its own) whose handler
/// records each key it is given.
async fn consumer<S: diesel_outbox::consumer::Source>(
    schema: &common::TestSchema,
    source: S,
) -> (common::RunningRelay, Handled) {
    use diesel_outbox::consumer::{Consumer, handler_fn};
    let outbox = Outbox::builder()
        .table(schema.table("outbox"))
        .build()
        .unwrap();
    outbox.migrate(&mut schema.connect().await).await.unwrap();
    let handled: Handled = Arc::default();
    let seen = handled.clone();
    let consumer = Consumer::builder(outbox, common::pool(2).await, "tls")
        .source(source)
        .handler(handler_fn(move |delivery, _conn| {
            let seen = seen.clone();
            Box::pin(async move {
                seen.lock().unwrap().push(delivery.key.clone());
                Ok(())
            })
        }))
        .build()
        .unwrap();
    (common::spawn_consumer(consumer), handled)
}

async fn wait_handled(handled: &Handled, keys: &[&str]) {
    common::eventually(common::DEADLINE, "the keys handled", || async {
        (*handled.lock().unwrap() == keys).then_some(())
    })
    .await;
}

/// Over RabbitMQ's TLS listener: the publisher publishes, the consumer runner's source
/// consumes, and the broker lists both connections as TLS.
#[tokio::test]
async fn rabbitmq_publishes_and_consumes_over_tls() {
    if !common::services::needs(
        "rabbitmq_publishes_and_consumes_over_tls",
        common::broker::Amqps::missing(),
    ) {
        return;
    }
    use diesel_outbox::consumer::rabbitmq;
    use diesel_outbox::rabbitmq::RabbitMqPublisher;
    let amqps = common::broker::Amqps::local();
    let broker = common::broker::SharedQueue::new().await;
    let publisher = RabbitMqPublisher::builder(&amqps.url, &broker.exchange)
        .tls(amqps.tls())
        .connect()
        .await
        .unwrap();
    let schema = common::TestSchema::new().await;
    let source = rabbitmq::Source::queue(&amqps.url, &broker.queue).tls(amqps.tls());
    let ((stop, task), handled) = consumer(&schema, source).await;
    let record = diesel_outbox::Record::new("over-amqps", "tls.test", "x");
    diesel_outbox::Publisher::publish(&publisher, &record)
        .await
        .unwrap();
    wait_handled(&handled, &["over-amqps"]).await;
    for name in [
        format!("diesel-outbox publisher to {}", broker.exchange),
        format!("diesel-outbox consumer of {}", broker.queue),
    ] {
        assert_eq!(
            common::broker::connections_named(&name),
            [true],
            "{name}: listed once, over TLS"
        );
    }
    common::stop_relay(stop, task).await;
}

/// The EXTERNAL mechanism: no user or password, the client certificate logs in as the
/// user of its common name.
#[tokio::test]
async fn rabbitmq_logs_in_with_a_client_certificate() {
    if !common::services::needs(
        "rabbitmq_logs_in_with_a_client_certificate",
        common::broker::Amqps::missing(),
    ) {
        return;
    }
    use diesel_outbox::rabbitmq::RabbitMqPublisher;
    let amqps = common::broker::Amqps::local();
    let broker = common::broker::TestBroker::new("#").await;
    let mut consumer = broker.consumer().await;
    let tls = amqps
        .tls()
        .client_cert(&amqps.client_cert, &amqps.client_key);
    let publisher = RabbitMqPublisher::builder(amqps.external_url(), &broker.exchange)
        .tls(tls)
        .connect()
        .await
        .unwrap();
    let record = diesel_outbox::Record::new("by-certificate", "tls.test", "x");
    diesel_outbox::Publisher::publish(&publisher, &record)
        .await
        .unwrap();
    let delivery = common::broker::next(&mut consumer, common::DEADLINE)
        .await
        .unwrap();
    assert_eq!(common::broker::message_id(&delivery), "by-certificate");
    // Without the certificate the same URL has no way to log in.
    let refused = RabbitMqPublisher::builder(amqps.external_url(), &broker.exchange)
        .tls(amqps.tls())
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(refused, diesel_outbox::Error::Publish(_)),
        "{refused}"
    );
}

/// A CA that did not sign the broker's certificate, a CA file that is not there, and TLS
/// settings for an `amqp://` URL: each fails with its cause, never the password.
#[tokio::test]
async fn rabbitmq_tls_mistakes_name_their_cause() {
    if !common::services::needs(
        "rabbitmq_tls_mistakes_name_their_cause",
        common::broker::Amqps::missing(),
    ) {
        return;
    }
    use diesel_outbox::rabbitmq::RabbitMqPublisher;
    let amqps = common::broker::Amqps::local();
    let dir = tempdir();
    let other = write(&dir, "other-ca.pem", &Ca::new("another CA").cert());
    let url = amqps.url.replacen("guest:guest@", "guest:hunter2@", 1);
    let wrong_ca = RabbitMqPublisher::builder(&url, "x")
        .tls(diesel_outbox::Tls::new().ca_file(&other))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        wrong_ca.contains("UnknownIssuer") && !wrong_ca.contains("hunter2"),
        "{wrong_ca}"
    );
    let missing = RabbitMqPublisher::builder(&url, "x")
        .tls(diesel_outbox::Tls::new().ca_file("/nonexistent/ca.pem"))
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&missing, diesel_outbox::Error::InvalidOption(m)
            if m.contains("cannot read the certificate file /nonexistent/ca.pem")),
        "{missing}"
    );
    // An `amqps://` URL without TLS settings: the platform's roots, which lack the CA.
    let platform = RabbitMqPublisher::builder(&url, "x")
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        platform.contains("UnknownIssuer") && !platform.contains("hunter2"),
        "{platform}"
    );
    let plain = RabbitMqPublisher::builder("amqp://guest:hunter2@localhost:5672/%2f", "x")
        .tls(amqps.tls())
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        plain.contains("need an amqps:// URL") && !plain.contains("hunter2"),
        "{plain}"
    );
}

/// A directory of the test's own, removed when the process ends... or left in the temp
/// directory, which holds nothing secret.
fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(common::unique("outbox_tls_files"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Over TLS to a nats-server that admits one NKey user: the publisher publishes (a key
/// published twice is stored once), the consumer runner's source consumes, and the
/// server's `/connz` shows both connections with their TLS version.
#[tokio::test]
async fn nats_publishes_dedupes_and_consumes_over_tls_with_an_nkey() {
    if !common::services::needs(
        "nats_publishes_dedupes_and_consumes_over_tls_with_an_nkey",
        common::nats::TlsNats::missing(),
    ) {
        return;
    }
    use diesel_outbox::consumer::nats::Source;
    use diesel_outbox::nats::{Credentials, JetStreamPublisher};
    let nats = common::nats::TlsNats::start();
    let js = nats.stream("TLS", "tls.", "tls").await;
    let tls = diesel_outbox::Tls::new().ca_file(&nats.ca);
    let publisher = JetStreamPublisher::builder(&nats.url)
        .subject_prefix("tls.")
        .tls(tls.clone())
        .credentials(Credentials::nkey_seed(&nats.seed))
        .connect()
        .await
        .unwrap();
    let record = diesel_outbox::Record::new("over-nats-tls", "order.created", "x");
    for _ in 0..2 {
        diesel_outbox::Publisher::publish(&publisher, &record)
            .await
            .unwrap();
    }
    let mut stream = js.get_stream("TLS").await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        1,
        "stored once"
    );
    let schema = common::TestSchema::new().await;
    let source = Source::durable(&nats.url, "TLS", "tls")
        .subject_prefix("tls.")
        .tls(tls)
        .credentials(Credentials::nkey_seed(&nats.seed));
    let ((stop, task), handled) = consumer(&schema, source).await;
    wait_handled(&handled, &["over-nats-tls"]).await;
    for name in ["diesel-outbox relay", "diesel-outbox consumer"] {
        let versions = nats.tls_versions(name);
        assert_eq!(versions.len(), 1, "{name}: {versions:?}");
        assert!(versions[0].starts_with("1."), "{name}: {versions:?}");
    }
    common::stop_relay(stop, task).await;
}

/// A CA that did not sign the server's certificate, no credentials, an NKey seed that is
/// not one, and credentials given twice: each fails with its cause, never the secret.
#[tokio::test]
async fn nats_tls_and_credential_mistakes_name_their_cause() {
    if !common::services::needs(
        "nats_tls_and_credential_mistakes_name_their_cause",
        common::nats::TlsNats::missing(),
    ) {
        return;
    }
    use diesel_outbox::Error;
    use diesel_outbox::nats::{Credentials, JetStreamPublisher};
    let nats = common::nats::TlsNats::start();
    let dir = tempdir();
    let other = write(&dir, "other-ca.pem", &Ca::new("another CA").cert());
    let connect = async |tls: diesel_outbox::Tls, credentials: Option<Credentials>| {
        let mut builder = JetStreamPublisher::builder(&nats.url)
            .tls(tls)
            .ack_timeout(Duration::from_secs(2));
        if let Some(credentials) = credentials {
            builder = builder.credentials(credentials);
        }
        builder.connect().await.map(|_| ())
    };
    let seed = Credentials::nkey_seed(&nats.seed);
    let wrong_ca = connect(
        diesel_outbox::Tls::new().ca_file(&other),
        Some(seed.clone()),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(wrong_ca.contains("UnknownIssuer"), "{wrong_ca}");
    // A `tls://` URL without TLS settings: the platform's roots, which lack the test's CA.
    let platform = JetStreamPublisher::builder(&nats.url)
        .credentials(seed.clone())
        .ack_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(platform.contains("UnknownIssuer"), "{platform}");
    let tls = diesel_outbox::Tls::new().ca_file(&nats.ca);
    let anonymous = connect(tls.clone(), None).await.unwrap_err().to_string();
    assert!(
        anonymous.to_lowercase().contains("authorization"),
        "{anonymous}"
    );
    let bad_seed = connect(tls.clone(), Some(Credentials::nkey_seed("SUAhunter2")))
        .await
        .unwrap_err();
    assert!(
        matches!(&bad_seed, Error::InvalidOption(m) if m.contains("NKey seed is not valid")),
        "{bad_seed}"
    );
    assert!(!bad_seed.to_string().contains("hunter2"));
    let twice = JetStreamPublisher::builder(nats.url.replacen("tls://", "tls://tok:hunter2@", 1))
        .credentials(seed)
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        twice.contains("given twice") && !twice.contains("hunter2"),
        "{twice}"
    );
}

/// The binary with `--nats-tls-ca` and the NKey seed from a file (`NATS_NKEY_FILE`):
/// relays to the TLS server, and the seed never reaches its logs, even at trace.
#[tokio::test]
async fn the_binary_relays_to_nats_over_tls_with_its_seed_from_a_file() {
    if !common::services::needs(
        "the_binary_relays_to_nats_over_tls_with_its_seed_from_a_file",
        common::nats::TlsNats::missing(),
    ) {
        return;
    }
    let nats = common::nats::TlsNats::start();
    let js = nats.stream("CLI", "cli.", "cli").await;
    let schema = common::TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    let seed_file = write(&tempdir(), "seed", &format!("{}\n", nats.seed));
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "nats"])
        .args(["--nats-url", &nats.url, "--subject-prefix", "cli."])
        .arg("--nats-tls-ca")
        .arg(&nats.ca)
        .env("NATS_NKEY_FILE", &seed_file)
        .env("DATABASE_URL", common::database_url())
        .env("RUST_LOG", "trace")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read the log as it is written: at trace it fills a pipe, which would block the relay.
    let mut stderr = relay.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut log = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
        log
    });
    conn.transaction(async |c| {
        outbox
            .enqueue(c, Message::new("order.created", "x").key("cli-nats-tls"))
            .await
    })
    .await
    .unwrap();
    common::eventually(common::DEADLINE, "the message in the stream", || async {
        let mut stream = js.get_stream("CLI").await.ok()?;
        (stream.info().await.ok()?.state.messages == 1).then_some(())
    })
    .await;
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let status = relay.wait().unwrap();
    assert!(status.success(), "{status:?}");
    let log = log.join().unwrap();
    assert!(log.contains("relay stopped"), "{log}");
    assert!(!log.contains(&nats.seed), "the seed in the logs");
}

/// Over TLS to Kafka: topics declared, a record produced, consumed by the consumer
/// runner's source; the TLS listener in front of the broker made a handshake for each
/// client, and no client spoke anything but TLS to it.
#[tokio::test]
async fn kafka_declares_publishes_and_consumes_over_tls() {
    if !common::services::needs(
        "kafka_declares_publishes_and_consumes_over_tls",
        common::kafka::Tansu::missing(),
    ) {
        return;
    }
    use diesel_outbox::consumer::kafka::Source;
    use diesel_outbox::kafka::{KafkaPublisher, Topology};
    let kafka = common::kafka::TlsTansu::start(&[]);
    let tls = diesel_outbox::Tls::new().ca_file(&kafka.ca);
    let topic = common::unique("tls");
    Topology::new()
        .topic(&topic, 1)
        .tls(tls.clone())
        .declare(&kafka.brokers)
        .await
        .unwrap();
    let publisher = KafkaPublisher::builder(&kafka.brokers)
        .tls(tls.clone())
        .connect()
        .await
        .unwrap();
    let record = diesel_outbox::Record::new("over-kafka-tls", &topic, "x");
    diesel_outbox::Publisher::publish(&publisher, &record)
        .await
        .unwrap();
    let schema = common::TestSchema::new().await;
    let source = Source::group(&kafka.brokers, common::unique("tls"), [topic]).tls(tls);
    let ((stop, task), handled) = consumer(&schema, source).await;
    wait_handled(&handled, &["over-kafka-tls"]).await;
    common::stop_relay(stop, task).await;
    let (made, plaintext) = (kafka.handshakes(), kafka.plaintext());
    // The admin client, the producer and the consumer: each at least once.
    assert!(made >= 3, "{made} TLS handshakes");
    assert_eq!(plaintext, 0, "a client did not speak TLS");
}

/// A CA that did not sign the broker's certificate, the platform's roots alone, a refused
/// SASL login, an empty user and a CA file that is not there: each fails with its cause,
/// never the password.
#[tokio::test]
async fn kafka_tls_and_sasl_mistakes_name_their_cause() {
    if !common::services::needs(
        "kafka_tls_and_sasl_mistakes_name_their_cause",
        common::kafka::Tansu::missing(),
    ) {
        return;
    }
    use diesel_outbox::Error;
    use diesel_outbox::kafka::{KafkaPublisher, Sasl};
    let kafka = common::kafka::TlsTansu::start(&["--authentication"]);
    let other = write(&tempdir(), "other-ca.pem", &Ca::new("another CA").cert());
    let connect = async |tls: diesel_outbox::Tls, sasl: Option<Sasl>| {
        let mut builder = KafkaPublisher::builder(&kafka.brokers)
            .tls(tls)
            .delivery_timeout(Duration::from_secs(3));
        if let Some(sasl) = sasl {
            builder = builder.sasl(sasl);
        }
        builder.connect().await.map(|_| ())
    };
    for tls in [
        diesel_outbox::Tls::new().ca_file(&other),
        diesel_outbox::Tls::new(),
    ] {
        let err = connect(tls, None).await.unwrap_err().to_string();
        assert!(
            err.contains("certificate verify failed") && err.contains(&kafka.brokers),
            "{err}"
        );
    }
    assert!(kafka.failed_handshakes() > 0);
    let tls = diesel_outbox::Tls::new().ca_file(&kafka.ca);
    let refused = connect(tls.clone(), Some(Sasl::scram_sha256("nobody", "hunter2")))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("SASL") && refused.contains("authentication"),
        "{refused}"
    );
    assert!(!refused.contains("hunter2"), "{refused}");
    let empty = connect(tls, Some(Sasl::plain("", "hunter2")))
        .await
        .unwrap_err();
    assert!(
        matches!(&empty, Error::InvalidOption(m) if m.contains("user is empty")),
        "{empty}"
    );
    let missing = connect(
        diesel_outbox::Tls::new().ca_file("/nonexistent/kafka-ca.pem"),
        None,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&missing, Error::InvalidOption(m) if m.contains("/nonexistent/kafka-ca.pem")),
        "{missing}"
    );
}

/// The binary over TLS to Kafka: `declare` and `relay` with `--kafka-tls-ca` (the row is
/// marked sent only once the broker reported it stored); and with a SASL login the broker
/// refuses, with its password from a file, `relay` fails at start naming the cause, and
/// the password never reaches its log, even at trace.
#[tokio::test]
async fn the_binary_relays_to_kafka_over_tls() {
    if !common::services::needs(
        "the_binary_relays_to_kafka_over_tls",
        common::kafka::Tansu::missing(),
    ) {
        return;
    }
    let kafka = common::kafka::TlsTansu::start(&[]);
    let topic = common::unique("cli_tls");
    let declared = Command::new(BIN)
        .args(["declare", "--broker", "kafka", "--topic", &topic])
        .args(["--kafka-brokers", &kafka.brokers, "--kafka-tls-ca"])
        .arg(&kafka.ca)
        .output()
        .unwrap();
    assert!(declared.status.success(), "{declared:?}");
    let schema = common::TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    let mut conn = schema.connect().await;
    outbox.migrate(&mut conn).await.unwrap();
    conn.transaction(async |c| {
        outbox
            .enqueue(c, Message::new(topic.as_str(), "x").key("cli-kafka-tls"))
            .await
    })
    .await
    .unwrap();
    let mut relay = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "kafka"])
        .args(["--kafka-brokers", &kafka.brokers, "--kafka-tls-ca"])
        .arg(&kafka.ca)
        .env("DATABASE_URL", common::database_url())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    common::eventually(common::DEADLINE, "the row sent", || async {
        #[derive(QueryableByName)]
        struct Sent {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        let sent: Sent = diesel::sql_query(format!(
            "SELECT count(*) AS n FROM {table} WHERE status = 'sent'"
        ))
        .get_result(&mut schema.connect().await)
        .await
        .ok()?;
        (sent.n == 1).then_some(())
    })
    .await;
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    assert!(relay.wait().unwrap().success());

    let guarded = common::kafka::TlsTansu::start(&["--authentication"]);
    let password = write(&tempdir(), "password", "hunter2\n");
    let refused = Command::new(BIN)
        .args(["--table", &table, "relay", "--broker", "kafka"])
        .args(["--kafka-brokers", &guarded.brokers, "--kafka-tls-ca"])
        .arg(&guarded.ca)
        .args([
            "--kafka-sasl-mechanism",
            "scram-sha-512",
            "--kafka-user",
            "nobody",
        ])
        .args(["--confirm-timeout", "3s"])
        .env("KAFKA_PASSWORD_FILE", &password)
        .env("DATABASE_URL", common::database_url())
        .env("RUST_LOG", "trace")
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{log}");
    assert!(
        log.contains("SASL") && log.contains("authentication"),
        "{log}"
    );
    assert!(!log.contains("hunter2"), "the password in the logs");
}

/// A Kafka listener whose certificate names another host than the one connected to:
/// `Topology::declare`, and the binary's `declare` and `relay` with the same flags, each
/// fail naming the cause librdkafka reported (the certificate failed verification) and the
/// broker, within the probe's 10 s rather than after the admin request's 30 s; the binary
/// says the cause once, exits 3, and its message does not call a declare a publish.
#[tokio::test]
async fn kafka_declare_names_a_certificate_for_another_host() {
    if !common::services::needs(
        "kafka_declare_names_a_certificate_for_another_host",
        common::kafka::Tansu::missing(),
    ) {
        return;
    }
    use diesel_outbox::kafka::Topology;
    let kafka = common::kafka::TlsTansu::start_for(&[], &["elsewhere.example"]);
    let topic = common::unique("tls_name");
    let started = std::time::Instant::now();
    let err = Topology::new()
        .topic(&topic, 1)
        .tls(diesel_outbox::Tls::new().ca_file(&kafka.ca))
        .declare(&kafka.brokers)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("certificate verify failed") && err.contains(&kafka.brokers),
        "{err}"
    );
    assert!(!err.contains("no answer within"), "{err}");
    assert!(!err.starts_with("publish failed"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "took {:?}",
        started.elapsed()
    );
    assert!(kafka.failed_handshakes() > 0);

    let schema = common::TestSchema::new().await;
    let table = schema.table("outbox");
    let outbox = Outbox::builder().table(&table).build().unwrap();
    outbox.migrate(&mut schema.connect().await).await.unwrap();
    let ca = kafka.ca.to_str().unwrap();
    let flags = ["--kafka-brokers", &kafka.brokers, "--kafka-tls-ca", ca];
    for command in [
        &["declare", "--broker", "kafka", "--topic", &topic][..],
        &["--table", &table, "relay", "--broker", "kafka"],
    ] {
        let out = Command::new(BIN)
            .args(command)
            .args(flags)
            .env("DATABASE_URL", common::database_url())
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{command:?}: {stderr}");
        let error = common::error_line(&command, &stderr);
        assert_eq!(
            error.matches("certificate verify failed").count(),
            1,
            "{command:?}: {error}"
        );
        assert!(error.contains(&kafka.brokers), "{command:?}: {error}");
        assert!(!error.contains("no answer within"), "{command:?}: {error}");
        assert!(
            !error.starts_with("error: publish failed"),
            "{command:?}: {error}"
        );
    }
}
