//! (h) A backlog of many short aggregates against the same backlog without aggregate keys.

use serde_json::json;

use crate::fixture::{Env, Keys};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn many_aggregates(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let per_aggregate = 5;
    let aggregates = env.scale(10_000, 2_000);
    let n = aggregates * per_aggregate;
    let (exchange, queue) = env.queue("aggregates").await?;
    let mut rates = Vec::new();
    let mut cpu = Vec::new();
    // Each arm is the relay process of (a), on a table of its own.
    for (keys, name) in [
        (Keys::Spread(aggregates), "many_aggregates"),
        (Keys::Unordered, "many_unordered"),
    ] {
        let outbox = env.outbox(name).await?;
        let drained = env
            .drain_by_relay_process(
                &outbox,
                &["--exchange", &exchange, "--batch-size", "512"],
                &[("AMQP_URL", &env.amqp_url.clone())],
                n,
                keys,
            )
            .await?;
        rates.push(drained.rate);
        cpu.push(drained.cpu.json());
        env.purge(&queue).await?;
    }
    env.drop_queue(&queue).await?;
    let f = Figure {
        name: "h. 10,000 aggregates x 5 pending",
        value: rates[0],
        unit: "msg/s",
        baseline: Some(("the same messages without aggregate keys", rates[1])),
        target: ">= 0.80 x",
        params: json!({ "aggregates": aggregates, "per_aggregate": per_aggregate, "messages": n, "payload_bytes": KIB, "batch_size": 512, "order": "message i in aggregate i % aggregates, so each aggregate's messages are spread over the backlog", "cpu_aggregates": cpu[0], "cpu_unordered": cpu[1] }),
    };
    f.emit();
    Ok(vec![f])
}
