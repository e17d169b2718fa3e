//! (e) One aggregate's backlog in strict order, against the strict-order ceiling.

use std::time::{Duration, Instant};

use lapin::options::ConfirmSelectOptions;
use serde_json::json;

use crate::fixture::{Env, Keys, RunningRelay, raw_publish};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn one_aggregate(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = 2_000;
    let (exchange, queue) = env.queue("aggregate").await?;
    let mut rates = Vec::new();
    let mut cpu = Vec::new();
    for (keys, name) in [
        (Keys::One("order-1"), "one_aggregate"),
        (Keys::Unordered, "unordered"),
    ] {
        let outbox = env.outbox(name).await?;
        env.fill(&outbox, n, keys).await?;
        let started = Instant::now();
        let window = env.cpu(None);
        let relay = RunningRelay::start(
            outbox
                .relay(env.pool.clone(), env.publisher(&exchange).await?)
                .batch_size(256)
                .build()?,
        );
        let (done, used) = env
            .wait_sent(&outbox, n as u64, Duration::from_secs(300), &window, n)
            .await?;
        cpu.push(used.json());
        rates.push(n as f64 / (done - started).as_secs_f64());
        relay.stop().await?;
        env.purge(&queue).await?;
    }

    // The ceiling of "one at a time": raw lapin, each publish awaiting its confirm.
    let channel = env.amqp.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let payload = vec![b'x'; KIB];
    let started = Instant::now();
    let window = env.cpu(None);
    for i in 0..n {
        raw_publish(&channel, &exchange, &payload, format!("one{i}"))
            .await?
            .await?;
    }
    let one_at_a_time = n as f64 / started.elapsed().as_secs_f64();
    let raw_cpu = window.used(n).json();
    env.drop_queue(&queue).await?;
    // The relay runs inside the benchmark process: its CPU is the `bench` column.
    let params = json!({ "messages": n, "payload_bytes": KIB, "publisher": "RabbitMQ", "batch_size": 256, "cpu_one_aggregate": cpu[0], "cpu_unordered": cpu[1], "cpu_raw_one_at_a_time": raw_cpu });
    let figures = vec![
        Figure {
            name: "e. one aggregate vs raw lapin one at a time",
            value: rates[0],
            unit: "msg/s",
            baseline: Some(("raw lapin, each publish awaits its confirm", one_at_a_time)),
            target: ">= 0.90 x",
            params: params.clone(),
        },
        Figure {
            name: "e. one aggregate vs 2,000 unordered",
            value: rates[0],
            unit: "msg/s",
            baseline: Some(("2,000 unordered", rates[1])),
            target: "-",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}
