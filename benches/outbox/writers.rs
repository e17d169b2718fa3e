//! (c) Many concurrent writers: commit throughput with and without the outbox.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::Message;
use serde_json::json;

use crate::fixture::Env;
use crate::measure::mean;
use crate::{BoxResult, Figure};

pub(crate) async fn writers(env: &mut Env) -> BoxResult<Figure> {
    let clients = 8;
    let secs = env.scale(8, 3) as u64;
    let rounds = env.scale(2, 1);
    let (exchange, queue) = env.queue("writers").await?;
    let orders = format!("{}.orders_c", env.schema);
    env.conn
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {orders}; CREATE TABLE {orders} (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, customer text NOT NULL, total int NOT NULL)"
        ))
        .await?;
    let mut rates: HashMap<bool, Vec<f64>> = HashMap::new();
    for round in 0..rounds * 2 {
        let notify = round % 2 == 1;
        let (outbox, relay) = env
            .with_relay(&format!("writers_{round}"), &exchange, notify)
            .await?;
        let commits = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(secs);
        let mut tasks = Vec::new();
        for _ in 0..clients {
            let mut conn = diesel_outbox::establish(&env.database_url).await?;
            let outbox = outbox.clone();
            let commits = commits.clone();
            let insert = format!("INSERT INTO {orders} (customer, total) VALUES ('ada', 42)");
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let outbox = outbox.clone();
                    let insert = insert.as_str();
                    conn.transaction(async |c| {
                        diesel::sql_query(insert).execute(c).await?;
                        outbox
                            .enqueue(c, Message::new("order.created", "{}"))
                            .await?;
                        Ok::<_, diesel_outbox::Error>(())
                    })
                    .await?;
                    commits.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, diesel_outbox::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        rates
            .entry(notify)
            .or_default()
            .push(AtomicU64::load(&commits, Ordering::SeqCst) as f64 / secs as f64);
        relay.stop().await?;
        env.purge(&queue).await?;
    }
    env.drop_queue(&queue).await?;
    let on = mean(&rates[&true]);
    let off = mean(&rates[&false]);
    let f = Figure {
        name: "c. 8 writers, wake-on-commit",
        value: on,
        unit: "commits/s",
        baseline: Some(("same writers, notify off", off)),
        target: ">= 0.95 x",
        params: json!({ "clients": clients, "seconds_per_round": secs, "rounds_each": rounds, "relay": "running, RabbitMQ publisher" }),
    };
    f.emit();
    Ok(f)
}
