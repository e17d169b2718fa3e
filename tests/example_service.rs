//! `examples/axum_service.rs`, run as a process and driven over HTTP: orders are created,
//! one is declined and rolled back with its event, every other order gets exactly one
//! invoice, `/readyz` answers, and SIGTERM drains the relay and the consumer and exits 0.
//! Started while its broker is down, it and `examples/kafka_service.rs` take orders and
//! invoice them once the broker is up.
//!
//! `cargo test` builds the examples before it runs the tests; run alone, these tests need
//! `cargo build --examples --all-features` first.
#![cfg(feature = "rabbitmq")]

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::Outbox;

/// The example `name`'s binary, beside the test binaries' folder.
fn example(name: &str) -> PathBuf {
    let deps = std::env::current_exe().expect("the test binary's path");
    let target = deps
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>");
    let path = target.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: cargo build --example {name} --all-features",
        path.display()
    );
    path
}

/// A database of the test's own, dropped at the end (the example's tables have fixed names).
struct Database {
    name: String,
    url: String,
}

impl Database {
    async fn create() -> Database {
        let name = common::unique("svc");
        let mut admin = common::connect().await;
        admin
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap();
        let base = common::database_url();
        let (server, params) = base
            .split_once('?')
            .map_or((base.as_str(), ""), |(s, p)| (s, p));
        let server = server.rsplit_once('/').expect("a database in the URL").0;
        let url = if params.is_empty() {
            format!("{server}/{name}")
        } else {
            format!("{server}/{name}?{params}")
        };
        Database { name, url }
    }

    async fn drop_it(self) {
        let mut admin = common::connect().await;
        admin
            .batch_execute(&format!("DROP DATABASE \"{}\" WITH (FORCE)", self.name))
            .await
            .unwrap();
    }
}

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn numbers(conn: &mut AsyncPgConnection, sql: &str) -> Vec<i64> {
    diesel::sql_query(sql)
        .load::<Row>(conn)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.n)
        .collect()
}

/// Starts `axum_service` on the broker at `amqp_url`; returns it with the address it
/// printed.
fn start(db: &Database, amqp_url: &str, exchange: &str) -> (Child, SocketAddr) {
    start_example(
        "axum_service",
        db,
        &[
            ("AMQP_URL", amqp_url.to_owned()),
            ("EXCHANGE", exchange.to_owned()),
            ("QUEUE", format!("{exchange}.invoicing")),
        ],
    )
}

/// Starts the example `name` on `db` with `env`; returns it with the address it printed.
fn start_example(name: &str, db: &Database, env: &[(&str, String)]) -> (Child, SocketAddr) {
    let mut child = Command::new(example(name))
        .env("DATABASE_URL", &db.url)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the example");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("the service said {line:?}"))
        .parse()
        .unwrap();
    (child, addr)
}

#[tokio::test]
async fn the_example_service_takes_orders_and_invoices_each_exactly_once() {
    let db = Database::create().await;
    let exchange = common::unique("svc");
    let (service, addr) = start(&db, &common::broker::amqp_url(), &exchange);
    let (code, body) = common::eventually(common::DEADLINE, "/readyz to answer 200", || async {
        common::http::get(addr, "/readyz").filter(|(code, _)| *code == 200)
    })
    .await;
    assert!(body.contains("\"ok\":true"), "{code} {body}");
    assert_eq!(common::http::get(addr, "/livez").unwrap().0, 200);

    // Five orders; the third is over the charge limit and declined after it was written.
    let orders = [
        ("ada", 1200),
        ("grace", 450),
        ("linus", 99_000),
        ("barbara", 3100),
        ("ken", 75),
    ];
    let mut created = Vec::new();
    for (customer, total) in orders {
        let body = format!(r#"{{"customer": "{customer}", "total": {total}}}"#);
        let (code, answer) =
            common::http::request(addr, "POST", "/orders", Some(&body)).expect("an answer");
        if total > 10_000 {
            assert_eq!(
                (code, answer.as_str()),
                (422, r#"{"error":"payment declined"}"#)
            );
        } else {
            assert_eq!(code, 201, "{answer}");
            let id: serde_json::Value = serde_json::from_str(&answer).unwrap();
            created.push(id["id"].as_i64().expect("an id"));
        }
    }
    let (bad, _) = common::http::request(
        addr,
        "POST",
        "/orders",
        Some(r#"{"customer": "", "total": 5}"#),
    )
    .unwrap();
    assert_eq!(bad, 400);

    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    let invoiced = loop {
        let invoiced = numbers(&mut conn, "SELECT order_id AS n FROM invoices ORDER BY 1").await;
        if invoiced.len() >= created.len() {
            break invoiced;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {invoiced:?} invoiced of {created:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    created.sort_unstable();
    assert_eq!(invoiced, created, "exactly one invoice per created order");
    let stored = numbers(&mut conn, "SELECT id AS n FROM orders ORDER BY 1").await;
    assert_eq!(stored, created, "the declined order rolled back");
    let stats = Outbox::new().stats(&mut conn).await.unwrap();
    assert_eq!(
        (stats.pending, stats.sent, stats.dead),
        (0, 4, 0),
        "the declined order's event rolled back with it"
    );

    // SIGTERM: the server stops, the relay forgets its record, the process exits 0.
    terminate(service).await;
    let relays = numbers(&mut conn, "SELECT count(*) AS n FROM outbox_relays").await;
    assert_eq!(relays, [0], "the relay drained and removed its record");
    assert!(
        common::http::get(addr, "/readyz").is_none(),
        "nothing listens any more"
    );
    let again = numbers(&mut conn, "SELECT count(*) AS n FROM invoices").await;
    assert_eq!(again, [4]);
    drop(conn);

    forget(&exchange).await;
    db.drop_it().await;
}

/// Deletes the exchange and queues the service declared for `exchange`.
async fn forget(exchange: &str) {
    let mq = common::broker::connect().await;
    let channel = mq.create_channel().await.unwrap();
    for queue in [
        format!("{exchange}.invoicing"),
        format!("{exchange}.invoicing.dead"),
    ] {
        let _ = channel
            .queue_delete(queue.as_str().into(), Default::default())
            .await;
    }
    let _ = channel
        .exchange_delete(exchange.into(), Default::default())
        .await;
}

/// Sends SIGTERM and waits for a clean exit.
async fn terminate(mut service: Child) {
    let pid = service.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = common::eventually(common::DEADLINE, "the service to exit", || {
        let status = service.try_wait().unwrap();
        async move { status }
    })
    .await;
    assert!(status.success(), "{status:?}");
}

/// A service started while its broker is down (behind `proxy`): it takes an order, and
/// `/readyz` answers 503 saying "broker unavailable" and `says` while `/livez` stays 200;
/// once the broker is up, the order is invoiced exactly once `within` and `/readyz` turns
/// 200; SIGTERM ends it cleanly.
async fn broker_down_at_start(
    service: Child,
    addr: SocketAddr,
    proxy: &common::proxy::FaultProxy,
    db: &Database,
    says: &str,
    within: Duration,
) {
    let (_, answer) = common::eventually(common::DEADLINE, "an order taken", || async {
        common::http::request(
            addr,
            "POST",
            "/orders",
            Some(r#"{"customer": "ada", "total": 1200}"#),
        )
        .filter(|(code, _)| *code == 201)
    })
    .await;
    let id: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let id = id["id"].as_i64().unwrap_or_else(|| panic!("{answer}"));
    let (_, body) = common::eventually(common::DEADLINE, "/readyz to say why", || async {
        common::http::get(addr, "/readyz")
            .filter(|(code, body)| *code == 503 && body.contains("broker unavailable"))
    })
    .await;
    assert!(body.contains(says), "{body}");
    assert_eq!(common::http::get(addr, "/livez").unwrap().0, 200);

    proxy.set_down(false);
    let mut conn = AsyncPgConnection::establish(&db.url).await.unwrap();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let invoiced = numbers(&mut conn, "SELECT order_id AS n FROM invoices").await;
        if invoiced == [id] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "invoiced {invoiced:?}, not [{id}], after the broker came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    common::eventually(within, "/readyz to answer 200", || async {
        common::http::get(addr, "/readyz").filter(|(code, _)| *code == 200)
    })
    .await;
    terminate(service).await;
}

/// Started while RabbitMQ is down, the service takes orders, says in `/readyz` that the
/// broker is unavailable, and invoices them once the broker is up.
// Two worker threads: the fault proxy answers while `start` waits for the service's line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_service_takes_orders_while_the_broker_is_down() {
    let db = Database::create().await;
    let exchange = common::unique("svc");
    let proxy = common::proxy::FaultProxy::down_before(&common::broker::amqp_authority()).await;
    let (service, addr) = start(&db, &common::broker::amqp_url_via(proxy.addr), &exchange);
    broker_down_at_start(service, addr, &proxy, &db, "\"ok\":false", common::DEADLINE).await;
    forget(&exchange).await;
    db.drop_it().await;
}

/// `kafka_service`, started while Kafka is down: it takes an order, `/readyz` says why it
/// is not ready while `/livez` stays 200, and once Kafka is up it declares its topics,
/// starts its consumer and invoices the order exactly once.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kafka_service_takes_orders_while_kafka_is_down() {
    let test = "the_kafka_service_takes_orders_while_kafka_is_down";
    if !common::services::needs(
        test,
        common::kafka::missing().or_else(common::kafka::Tansu::missing),
    ) {
        return;
    }
    let db = Database::create().await;
    let proxy = common::proxy::FaultProxy::down_before(&common::kafka::brokers()).await;
    let prefix = format!("{}.", common::unique("shop"));
    let (service, addr) = start_example(
        "kafka_service",
        &db,
        &[
            ("KAFKA_BROKERS", proxy.addr.to_string()),
            ("TOPIC_PREFIX", prefix),
            ("GROUP", common::unique("invoicing")),
        ],
    );
    // A consumer group takes a while to form.
    broker_down_at_start(
        service,
        addr,
        &proxy,
        &db,
        "waiting for its queue or topic",
        3 * common::DEADLINE,
    )
    .await;
    db.drop_it().await;
}
