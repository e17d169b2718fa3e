//! A web service on the outbox. `POST /orders` writes the order and its `order.created`
//! event in one transaction; a relay, running as a task of the same process, ships the
//! events to RabbitMQ; the consumer runner, another task, writes each order's invoice
//! exactly once. `/livez` and `/readyz` answer a container's probes from the relay's and
//! the consumer's `health()`. SIGTERM (or Ctrl-C) stops taking requests, lets the relay
//! and the consumer drain, and exits.
//!
//! ```sh
//! cargo run --example axum_service --features rabbitmq
//! curl -si localhost:3000/orders -H 'content-type: application/json' \
//!      -d '{"customer": "ada", "total": 1200}'
//! ```
//!
//! A charge over 10,000 is declined after the order is written: the order and its event
//! roll back together (422), and no invoice ever appears for it.
//!
//! Configured by the environment: `DATABASE_URL` (libpq's TLS parameters work, as in
//! every connection the crate makes) and `AMQP_URL` (local defaults), `LISTEN_ADDR`
//! (`127.0.0.1:3000`; port 0 picks a free one, printed on stdout), `EXCHANGE` (`shop`) and
//! `QUEUE` (`shop.invoicing`). It creates its tables (`orders`, `invoices`, the outbox's)
//! and declares its exchange and queue if they are missing.
//!
//! It takes orders while RabbitMQ is down, at start too: the publisher starts without the
//! broker (`connect_lazy`), the topology is declared once the broker answers, and the
//! events wait in the outbox meanwhile. `/readyz` says so (503, "broker unavailable");
//! `/livez` stays 200.
//!
//! The shop itself (its tables, the handlers, the probes, the consumer's handler and the
//! run until SIGTERM) is `examples/shop/mod.rs`, which `kafka_service` shares.

#[path = "shop/mod.rs"]
mod shop;

use diesel_outbox::consumer::rabbitmq;
use diesel_outbox::rabbitmq::{RabbitMqPublisher, Topology};

use shop::env_or;

#[tokio::main]
async fn main() -> shop::Outcome<()> {
    shop::init_tracing();
    let database_url = env_or("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test");
    let amqp_url = env_or("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let listen_addr = env_or("LISTEN_ADDR", "127.0.0.1:3000");
    let exchange = env_or("EXCHANGE", "shop");
    let queue = env_or("QUEUE", "shop.invoicing");

    let (outbox, pool) = shop::prepare(&database_url).await?;
    // Declared now if the broker answers, else as soon as it does; orders are taken
    // meanwhile, and their events wait in the outbox.
    let topology = Topology::exchange(&exchange).queue(&queue, "order.*");
    let declared = shop::declare_when_up("exchange and queue", {
        let amqp_url = amqp_url.clone();
        move || {
            let (topology, amqp_url) = (topology.clone(), amqp_url.clone());
            async move { topology.declare(&amqp_url).await }
        }
    });
    // Starts without the broker when it is down: the relay then holds the events back
    // (spending no attempt) and reports the outage in its health.
    let publisher = RabbitMqPublisher::builder(&amqp_url, &exchange)
        .connect_lazy()
        .await?;
    let relay = outbox.relay(pool.clone(), publisher).build()?;
    let consumer = shop::invoicing(outbox, &pool, rabbitmq::Source::queue(&amqp_url, &queue))?;
    shop::serve(pool, relay, consumer, declared, &listen_addr).await
}
