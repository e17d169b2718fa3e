//! The shop of `axum_service` on Kafka: `POST /orders` writes the order and its
//! `order.created` event in one transaction; a relay, running as a task of the same
//! process, produces the events to Kafka; the consumer runner, another task, reads them as
//! a consumer group and writes each order's invoice exactly once. `/livez` and `/readyz`
//! answer a container's probes. SIGTERM (or Ctrl-C) stops taking requests, lets the relay
//! and the consumer drain, and exits.
//!
//! ```sh
//! cargo run --example kafka_service --features kafka
//! curl -si localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total": 1200}'
//! ```
//!
//! Configured by the environment: `DATABASE_URL` (libpq's TLS parameters work),
//! `KAFKA_BROKERS` (`127.0.0.1:9092`), `KAFKA_TLS_CA` (a PEM file of CAs: set, the service
//! talks TLS to Kafka, verifying the brokers' certificates and names against it and the
//! platform's roots), `LISTEN_ADDR` (`127.0.0.1:3000`; port 0 picks a free one, printed on
//! stdout), `TOPIC_PREFIX` (`shop.`: the events go to `shop.order.created`) and `GROUP`
//! (`shop.invoicing`). It creates its tables and declares the topic, with three partitions,
//! and its dead-letter topic `shop.order.created.dlt` if they are missing.
//!
//! It takes orders while Kafka is down, at start too: the publisher starts without the
//! cluster (`connect_lazy`), the topics are declared once a broker answers, the consumer
//! starts then, and the events wait in the outbox meanwhile. `/readyz` says so (503);
//! `/livez` stays 200. An order's events keep their order: the relay keys each by its
//! aggregate (`order-<id>`), so they share a partition.

#[path = "shop/mod.rs"]
mod shop;

use diesel_outbox::Tls;
use diesel_outbox::consumer::kafka;
use diesel_outbox::kafka::{KafkaPublisher, Topology};

use shop::env_or;

#[tokio::main]
async fn main() -> shop::Outcome<()> {
    shop::init_tracing();
    let database_url = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let brokers = env_or("KAFKA_BROKERS", "127.0.0.1:9092");
    let tls = std::env::var_os("KAFKA_TLS_CA").map(|ca| Tls::new().ca_file(ca));
    let listen_addr = env_or("LISTEN_ADDR", "127.0.0.1:3000");
    let prefix = env_or("TOPIC_PREFIX", "shop.");
    let group = env_or("GROUP", "shop.invoicing");
    let topic = format!("{prefix}order.created");

    let (outbox, pool) = shop::prepare(&database_url).await?;
    // Declared now if a broker answers, else as soon as one does; orders are taken
    // meanwhile, and their events wait in the outbox.
    let mut topology = Topology::new().topic(&topic, 3).dead_letter_topics();
    if let Some(tls) = &tls {
        topology = topology.tls(tls.clone());
    }
    let declared = shop::declare_when_up("topics", {
        let brokers = brokers.clone();
        move || {
            let (topology, brokers) = (topology.clone(), brokers.clone());
            async move { topology.declare(&brokers).await.map(|_| ()) }
        }
    });
    // Starts without the cluster when it is down: the relay then holds the events back
    // (spending no attempt) and reports the outage in its health.
    let mut publisher = KafkaPublisher::builder(&brokers).topic_prefix(&prefix);
    let mut source = kafka::Source::group(&brokers, &group, [&topic]).topic_prefix(&prefix);
    if let Some(tls) = tls {
        publisher = publisher.tls(tls.clone());
        source = source.tls(tls);
    }
    let relay = outbox
        .relay(pool.clone(), publisher.connect_lazy().await?)
        .build()?;
    let consumer = shop::invoicing(outbox, &pool, source)?;
    shop::serve(pool, relay, consumer, declared, &listen_addr).await
}
