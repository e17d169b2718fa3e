//! (j) The consumer runner against a hand-written lapin consumer doing the same per
//! delivery: a transaction, the dedupe insert, one effect insert, the commit, the ack.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel::sql_types::Text;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use diesel_outbox::Outbox;
use diesel_outbox::consumer::{Consumer, HandleError, handler_fn, rabbitmq};
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use serde_json::json;

use crate::fixture::{Env, message_key, raw_publish};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn consumer(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(10_000, 2_000);
    let outbox = env.outbox("consumer_j").await?;
    let effects = format!("{}.effects_j", env.schema);
    env.conn
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {effects}; CREATE TABLE {effects} (key text NOT NULL)"
        ))
        .await?;
    let (exchange, queue) = env.queue("consumer_j").await?;
    let payload = vec![b'x'; KIB];
    let mut figures = Vec::new();
    // Hand-written and the runner at the same concurrency take turns (so that neither gains
    // from running later on a warmer database), then the runner with eight at once; each
    // round on messages of its own.
    let rounds = [(false, 1), (true, 1), (false, 1), (true, 1), (true, 8)];
    let mut rates: Vec<(bool, usize, f64)> = Vec::new();
    // Each round's CPU per delivery (the consumers run inside the benchmark process).
    let mut cpu = Vec::new();
    for (round, (runs_runner, concurrency)) in rounds.into_iter().enumerate() {
        let mut confirms = Vec::with_capacity(n);
        for i in 0..n {
            confirms.push(
                raw_publish(&env.channel, &exchange, &payload, format!("j{round}-{i}")).await?,
            );
        }
        for confirm in confirms {
            confirm.await?;
        }
        let started = Instant::now();
        let window = env.cpu(None);
        if runs_runner {
            runner(env, &outbox, &queue, &effects, n, concurrency).await?;
        } else {
            by_hand(env, &outbox, &queue, &effects, n).await?;
        }
        rates.push((
            runs_runner,
            concurrency,
            n as f64 / started.elapsed().as_secs_f64(),
        ));
        let mut used = window.used(n).json();
        used["round"] = json!(if runs_runner {
            format!("runner x{concurrency}")
        } else {
            "hand-written".to_owned()
        });
        cpu.push(used);
    }
    let mean_of = |runner: bool, concurrency: usize| {
        let picked: Vec<f64> = rates
            .iter()
            .filter(|(r, c, _)| *r == runner && *c == concurrency)
            .map(|(_, _, rate)| *rate)
            .collect();
        picked.iter().sum::<f64>() / picked.len() as f64
    };
    let (by_hand_rate, runner_rate, runner8_rate) =
        (mean_of(false, 1), mean_of(true, 1), mean_of(true, 8));
    env.drop_queue(&queue).await?;
    let params = |concurrency: usize| json!({ "messages_per_round": n, "payload_bytes": KIB, "concurrency": concurrency, "per_delivery": "transaction, dedupe insert, effect insert, commit, ack", "rounds": "hand, runner, hand, runner (means), then runner x8", "cpu_by_round": cpu });
    for (name, value, target, concurrency) in [
        (
            "j. consumer runner vs hand-written",
            runner_rate,
            ">= 0.9 x",
            1,
        ),
        ("j. consumer runner, 8 at once", runner8_rate, "-", 8),
    ] {
        let f = Figure {
            name,
            value,
            unit: "msg/s",
            baseline: Some(("hand-written lapin consumer, one at a time", by_hand_rate)),
            target,
            params: params(concurrency),
        };
        f.emit();
        figures.push(f);
    }
    Ok(figures)
}

/// What a user writes without the runner: one delivery at a time, acked after the commit.
async fn by_hand(
    env: &Env,
    outbox: &Outbox,
    queue: &str,
    effects: &str,
    n: usize,
) -> BoxResult<()> {
    let channel = env.amqp.create_channel().await?;
    channel.basic_qos(1, BasicQosOptions::default()).await?;
    let mut deliveries = channel
        .basic_consume(
            queue.into(),
            "by-hand".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut conn = diesel_outbox::establish(&env.database_url).await?;
    let insert = format!("INSERT INTO {effects} (key) VALUES ($1)");
    for _ in 0..n {
        let delivery = tokio::time::timeout(Duration::from_secs(60), deliveries.next())
            .await?
            .ok_or("the subscription ended")??;
        let key = message_key(&delivery);
        let insert = insert.as_str();
        conn.transaction(async |c| {
            if outbox.dedupe(c, "by-hand", &key).await? {
                diesel::sql_query(insert)
                    .bind::<Text, _>(&key)
                    .execute(c)
                    .await?;
            }
            Ok::<_, diesel_outbox::Error>(())
        })
        .await?;
        delivery.ack(BasicAckOptions::default()).await?;
    }
    channel.close(200, "done".into()).await?;
    Ok(())
}

/// The same through the runner, until `n` effects are in.
async fn runner(
    env: &Env,
    outbox: &Outbox,
    queue: &str,
    effects: &str,
    n: usize,
    concurrency: usize,
) -> BoxResult<()> {
    let applied = Arc::new(AtomicU64::new(0));
    let (counted, table) = (applied.clone(), effects.to_owned());
    let consumer = Consumer::builder(outbox.clone(), env.pool.clone(), "runner")
        .source(rabbitmq::Source::queue(&env.amqp_url, queue))
        .handler(handler_fn(move |delivery, conn| {
            let (counted, table) = (counted.clone(), table.clone());
            Box::pin(async move {
                diesel::sql_query(format!("INSERT INTO {table} (key) VALUES ($1)"))
                    .bind::<Text, _>(&delivery.key)
                    .execute(conn)
                    .await
                    .map_err(HandleError::retry)?;
                counted.fetch_add(1, Ordering::Relaxed);
                Ok(())
            })
        }))
        .concurrency(concurrency)
        .build()?;
    let target = n as u64;
    let done = async {
        while AtomicU64::load(&applied, Ordering::Relaxed) < target {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(600), consumer.run_until(done)).await??;
    Ok(())
}
