//! A service that consumes `order.created` events and writes each invoice exactly once, on
//! the crate's consumer runner, until Ctrl-C.
//!
//! ```sh
//! cargo run --example consumer --features rabbitmq
//! ```
//!
//! Uses `DATABASE_URL` and `AMQP_URL` (local defaults). Declares the queue `invoicing`
//! bound to `order.*` on the exchange `events`, with a dead-letter queue
//! `invoicing.dead`; creates the table `invoices` and the outbox tables it dedupes in.

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{Consumer, Delivery, HandleError, handler_fn, rabbitmq};
use diesel_outbox::rabbitmq::Topology;
use diesel_outbox::{Outbox, PgPool};

#[derive(serde::Deserialize)]
struct OrderCreated {
    order_id: i64,
    total: i64,
}

/// The effect: one invoice per order, written on the runner's connection, in the
/// transaction that also records the delivery's key.
async fn invoice(delivery: &Delivery, conn: &mut AsyncPgConnection) -> Result<(), HandleError> {
    // A payload that is not an order can never be applied: to the dead-letter queue.
    let order: OrderCreated = delivery.json().map_err(HandleError::reject)?;
    diesel::sql_query("INSERT INTO invoices (order_id, total, event_key) VALUES ($1, $2, $3)")
        .bind::<BigInt, _>(order.order_id)
        .bind::<BigInt, _>(order.total)
        .bind::<Text, _>(&delivery.key)
        .execute(conn)
        .await
        // The database is having a bad moment: roll back, run it again after a backoff.
        .map_err(HandleError::retry)?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,lapin=error".into()),
        )
        .init();
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());

    let outbox = Outbox::new();
    let mut conn = AsyncPgConnection::establish(&database_url).await?;
    outbox.migrate(&mut conn).await?;
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS invoices (order_id bigint PRIMARY KEY, total bigint NOT NULL, \
         event_key text NOT NULL)",
    )
    .await?;
    // The exchange `events`, the queue `invoicing` bound to `order.*`, and its dead letters
    // (`invoicing.dead`); what exists already is left as it is.
    Topology::exchange("events")
        .queue("invoicing", "order.*")
        .declare(&amqp_url)
        .await?;

    let pool = PgPool::builder()
        .max_size(8)
        .build(AsyncDieselConnectionManager::new(&database_url))
        .await?;
    let consumer = Consumer::builder(outbox, pool, "invoicing")
        .source(rabbitmq::Source::queue(&amqp_url, "invoicing"))
        .handler(handler_fn(|delivery, conn| {
            Box::pin(invoice(delivery, conn))
        }))
        .concurrency(8)
        .max_deliveries(5)
        .backoff(Duration::from_millis(200), Duration::from_secs(30))
        .build()?;
    consumer
        .run_until(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
