//! The whole path once: orders enqueue events in their own transactions (one is rolled
//! back), a relay ships them to RabbitMQ, and an idempotent consumer turns each into an
//! invoice exactly once, even when a message is delivered twice.
//!
//! ```sh
//! cargo run --example quickstart --features rabbitmq
//! ```
//!
//! Uses `DATABASE_URL` (default: the local `test` database) and `AMQP_URL` (default: the
//! local broker). Creates its own tables (`quickstart_*`), exchange and queue.

use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::rabbitmq::RabbitMqPublisher;
use diesel_outbox::{Error, Message, Outbox, PgPool};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

const EXCHANGE: &str = "quickstart";
const QUEUE: &str = "quickstart.invoicing";
const ORDERS: [(i32, &str, i32); 5] = [
    (1, "ada", 1200),
    (2, "grace", 450),
    (3, "linus", 990), // payment declined: rolled back
    (4, "barbara", 3100),
    (5, "ken", 75),
];

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let database_url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());

    // Tables: the business table and the outbox, created fresh on every run.
    let outbox = Outbox::builder().table("quickstart_outbox").build()?;
    let mut conn = AsyncPgConnection::establish(&database_url).await?;
    let mut reset = outbox.down_sql();
    reset.push("DROP TABLE IF EXISTS quickstart_orders, quickstart_invoices".into());
    conn.batch_execute(&reset.join(";")).await?;
    conn.batch_execute(
        "CREATE TABLE quickstart_orders (id int PRIMARY KEY, customer text NOT NULL, total int NOT NULL);
         CREATE TABLE quickstart_invoices (order_id int PRIMARY KEY, total int NOT NULL)",
    )
    .await?;
    outbox.migrate(&mut conn).await?;

    // Broker: an exchange and a durable queue for the invoicing consumer.
    let amqp = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    declare(&channel).await?;

    // 1. Orders: the event is written in the order's own transaction.
    let mut enqueued = 0;
    for (id, customer, total) in ORDERS {
        let result = conn
            .transaction(async |c| {
                diesel::sql_query(
                    "INSERT INTO quickstart_orders (id, customer, total) VALUES ($1, $2, $3)",
                )
                .bind::<Integer, _>(id)
                .bind::<Text, _>(customer)
                .bind::<Integer, _>(total)
                .execute(c)
                .await?;
                let event =
                    serde_json::json!({ "order_id": id, "customer": customer, "total": total });
                let msg = Message::json("order.created", &event)?
                    .key(format!("order-{id}-created"))
                    .aggregate_key(format!("order-{id}"));
                outbox.enqueue(c, msg).await?;
                if id == 3 {
                    return Err(Error::InvalidMessage("payment declined".into()));
                }
                Ok::<_, Error>(())
            })
            .await;
        match result {
            Ok(()) => enqueued += 1,
            Err(e) => println!("order {id}: rolled back ({e}); its event is gone with it"),
        }
    }

    // 2. The relay ships committed rows to RabbitMQ.
    let pool: PgPool = PgPool::builder()
        .max_size(4)
        .test_on_check_out(false)
        .build(AsyncDieselConnectionManager::new(&database_url))
        .await?;
    let publisher = RabbitMqPublisher::builder(&amqp_url, EXCHANGE)
        .connect()
        .await?;
    let relay = outbox.relay(pool, publisher).build()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(async move {
        relay
            .run_until(async {
                let _ = stopped.await;
            })
            .await
    });

    // 3. The invoicing consumer (below) runs until every committed order is invoiced. One
    //    message is delivered a second time, as after a relay crash between the broker's
    //    confirm and marking the row sent.
    let mut consumer = channel
        .basic_consume(
            QUEUE.into(),
            "invoicing".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let (mut consumed, mut duplicates, mut redelivered) = (0, 0, false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(&mut conn, "quickstart_invoices").await? < enqueued || duplicates == 0 {
        let delivery = tokio::time::timeout_at(deadline, consumer.next())
            .await
            .map_err(|_| "timed out waiting for deliveries")?
            .ok_or("consumer closed")??;
        consumed += 1;
        if invoice(&mut conn, &outbox, &delivery).await? {
            if !redelivered {
                redeliver(&channel, &delivery).await?;
                redelivered = true;
            }
        } else {
            duplicates += 1;
        }
        // Ack only after the transaction committed: a crash before it means a redelivery,
        // which dedupe then recognises.
        delivery.ack(BasicAckOptions::default()).await?;
    }

    let _ = stop.send(());
    relay_task.await??;
    let stats = outbox.stats(&mut conn).await?;
    println!("orders attempted:    {}", ORDERS.len());
    println!("events enqueued:     {enqueued} (1 rolled back with its order)");
    println!("published (sent):    {}", stats.sent);
    println!("deliveries consumed: {consumed}");
    println!("duplicates skipped:  {duplicates}");
    println!(
        "invoices written:    {}",
        count(&mut conn, "quickstart_invoices").await?
    );
    amqp.close(200, "done".into()).await?;
    Ok(())
}

/// The idempotent consumer: dedupe and the effect in one transaction. Returns whether the
/// delivery was new.
async fn invoice(
    conn: &mut AsyncPgConnection,
    outbox: &Outbox,
    delivery: &lapin::message::Delivery,
) -> Result<bool, Error> {
    let key = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_default();
    let event: serde_json::Value = serde_json::from_slice(&delivery.data)
        .map_err(|e| Error::InvalidMessage(format!("bad event: {e}")))?;
    conn.transaction(async |c| {
        if !outbox.dedupe(c, "invoicing", &key).await? {
            return Ok(false);
        }
        diesel::sql_query("INSERT INTO quickstart_invoices (order_id, total) VALUES ($1, $2)")
            .bind::<Integer, _>(event["order_id"].as_i64().unwrap_or_default() as i32)
            .bind::<Integer, _>(event["total"].as_i64().unwrap_or_default() as i32)
            .execute(c)
            .await?;
        Ok(true)
    })
    .await
}

/// Publishes a copy of `delivery` with the same message id.
async fn redeliver(
    channel: &Channel,
    delivery: &lapin::message::Delivery,
) -> Result<(), lapin::Error> {
    channel
        .basic_publish(
            EXCHANGE.into(),
            delivery.routing_key.clone(),
            BasicPublishOptions::default(),
            &delivery.data,
            BasicProperties::default()
                .with_message_id(delivery.properties.message_id().clone().unwrap_or_default()),
        )
        .await?
        .await?;
    Ok(())
}

async fn declare(channel: &Channel) -> Result<(), lapin::Error> {
    channel
        .exchange_declare(
            EXCHANGE.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            QUEUE.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            QUEUE.into(),
            EXCHANGE.into(),
            "order.*".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_purge(QUEUE.into(), QueuePurgeOptions::default())
        .await?;
    Ok(())
}

async fn count(conn: &mut AsyncPgConnection, table: &str) -> Result<i64, diesel::result::Error> {
    Ok(
        diesel::sql_query(format!("SELECT count(*) AS n FROM {table}"))
            .get_result::<Count>(conn)
            .await?
            .n,
    )
}
