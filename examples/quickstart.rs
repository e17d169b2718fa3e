//! The whole path once: orders enqueue events in their own transactions (one is rolled
//! back), a relay ships them to RabbitMQ, and the consumer runner turns each into an
//! invoice exactly once, even when a message is delivered twice.
//!
//! ```sh
//! cargo run --example quickstart --features rabbitmq
//! ```
//!
//! Finds PostgreSQL and RabbitMQ as the tests do: `DATABASE_URL` and `AMQP_URL`, else the
//! local servers on 127.0.0.1, else containers in Docker, removed when it ends. Creates its
//! own tables (`quickstart_*`), exchange and queue.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::pooled_connection::AsyncDieselConnectionManager;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::consumer::{Consumer, Delivery, HandleError, handler_fn, rabbitmq};
use diesel_outbox::rabbitmq::{RabbitMqPublisher, Topology};
use diesel_outbox::{Consumed, Error, Message, Metrics, Outbox, PgPool};
use lapin::options::{BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

#[path = "../tests/common/services.rs"]
mod services;

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
    // Containers started for want of a server are removed when `_containers` drops.
    let (_containers, [database_url, amqp_url]) =
        services::urls([services::Service::Postgres, services::Service::RabbitMq])?;

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

    // Broker: an exchange, and a durable queue for the invoicing consumer with its dead
    // letters, created fresh on every run.
    let amqp = Connection::connect(&amqp_url, ConnectionProperties::default()).await?;
    let channel = amqp.create_channel().await?;
    for queue in [QUEUE, &format!("{QUEUE}.dead")] {
        channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await?;
    }
    Topology::exchange(EXCHANGE)
        .queue(QUEUE, "order.*")
        .declare(&amqp_url)
        .await?;

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
        .max_size(6)
        .test_on_check_out(false)
        .build(AsyncDieselConnectionManager::new(&database_url))
        .await?;
    let publisher = RabbitMqPublisher::builder(&amqp_url, EXCHANGE)
        .connect()
        .await?;
    let relay = outbox.relay(pool.clone(), publisher).build()?;
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(async move {
        relay
            .run_until(async {
                let _ = relay_stopped.await;
            })
            .await
    });

    // 3. The invoicing consumer: the crate's runner writes each invoice and its dedupe
    //    record in one transaction, and acknowledges the broker only after the commit.
    let tally = Tally::default();
    let consumer = Consumer::builder(outbox.clone(), pool, "invoicing")
        .source(rabbitmq::Source::queue(&amqp_url, QUEUE))
        .handler(handler_fn(|delivery, conn| {
            Box::pin(invoice(delivery, conn))
        }))
        .metrics(tally.clone())
        .build()?;
    let (stop_consumer, consumer_stopped) = tokio::sync::oneshot::channel::<()>();
    let consumer_task = tokio::spawn(async move {
        consumer
            .run_until(async {
                let _ = consumer_stopped.await;
            })
            .await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(&mut conn, "quickstart_invoices").await? < enqueued {
        if tokio::time::Instant::now() > deadline {
            return Err("timed out waiting for the invoices".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // One message is delivered a second time, as after a relay crash between the broker's
    // confirm and marking the row sent: same message id, same payload.
    redeliver(&channel, 1).await?;
    while tally.get(Consumed::Duplicate) < 1 {
        if tokio::time::Instant::now() > deadline {
            return Err("timed out waiting for the duplicate".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let _ = stop_consumer.send(());
    consumer_task.await??;
    let _ = stop_relay.send(());
    relay_task.await??;
    let stats = outbox.stats(&mut conn).await?;
    let applied = tally.get(Consumed::Applied);
    let duplicates = tally.get(Consumed::Duplicate);
    println!("orders attempted:    {}", ORDERS.len());
    println!("events enqueued:     {enqueued} (1 rolled back with its order)");
    println!("published (sent):    {}", stats.sent);
    println!("deliveries consumed: {}", applied + duplicates);
    println!("duplicates skipped:  {duplicates}");
    println!(
        "invoices written:    {}",
        count(&mut conn, "quickstart_invoices").await?
    );
    amqp.close(200, "done".into()).await?;
    Ok(())
}

/// The invoice for one `order.created` event, on the runner's connection and inside its
/// transaction: it commits together with the dedupe record, or not at all.
async fn invoice(delivery: &Delivery, conn: &mut AsyncPgConnection) -> Result<(), HandleError> {
    let event: serde_json::Value = delivery.json().map_err(HandleError::reject)?;
    let field = |name: &str| event[name].as_i64().and_then(|v| i32::try_from(v).ok());
    let (Some(order_id), Some(total)) = (field("order_id"), field("total")) else {
        return Err(HandleError::reject("not an order.created event"));
    };
    diesel::sql_query("INSERT INTO quickstart_invoices (order_id, total) VALUES ($1, $2)")
        .bind::<Integer, _>(order_id)
        .bind::<Integer, _>(total)
        .execute(conn)
        .await
        .map_err(HandleError::retry)?;
    Ok(())
}

/// Counts the consumer's deliveries by how they ended.
#[derive(Clone, Default)]
struct Tally(Arc<Mutex<HashMap<Consumed, u64>>>);

impl Tally {
    fn get(&self, result: Consumed) -> u64 {
        self.0.lock().unwrap().get(&result).copied().unwrap_or(0)
    }
}

impl Metrics for Tally {
    fn consumed(&self, _topic: &str, result: Consumed) {
        *self.0.lock().unwrap().entry(result).or_default() += 1;
    }
}

/// Publishes again the event of order `id`, with the same message id.
async fn redeliver(channel: &Channel, id: i32) -> Result<(), lapin::Error> {
    let (_, customer, total) = ORDERS[usize::try_from(id - 1).unwrap_or(0)];
    let event = serde_json::json!({ "order_id": id, "customer": customer, "total": total });
    channel
        .basic_publish(
            EXCHANGE.into(),
            "order.created".into(),
            BasicPublishOptions::default(),
            event.to_string().as_bytes(),
            BasicProperties::default().with_message_id(format!("order-{id}-created").into()),
        )
        .await?
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
