//! (i) The backlog that built up while the broker was out of reach, drained once it is
//! back, against the same backlog drained without an outage.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::common::proxy::FaultProxy;
use crate::fixture::{Env, Keys, stop_process};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn after_outage(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(50_000, 10_000);
    let outage = Duration::from_secs(env.scale(60, 10) as u64);
    let max_attempts = 3;
    let max_attempts_arg = max_attempts.to_string();
    let (exchange, queue) = env.queue("outage").await?;
    // Both arms reach the broker through a proxy, so that the outage can be made without
    // touching the broker and the baseline pays the same forwarding.
    let upstream = tokio::net::lookup_host(crate::common::broker::amqp_authority())
        .await?
        .next()
        .ok_or("the broker's address does not resolve")?;
    let proxy = FaultProxy::start(upstream).await;
    let via_proxy = crate::common::broker::amqp_url_via(proxy.addr);
    let args = [
        "--exchange",
        &exchange,
        "--batch-size",
        "512",
        "--max-attempts",
        &max_attempts_arg,
    ];
    let envs = [("AMQP_URL", via_proxy.as_str())];

    // Baseline: (a)'s run through the proxy: the backlog committed at once, no outage.
    let outbox = env.outbox("outage_baseline").await?;
    let baseline = env
        .drain_by_relay_process(&outbox, &args, &envs, n, Keys::Unordered)
        .await?;
    env.purge(&queue).await?;

    // The outage: the relay is running when the broker goes away; writers go on committing
    // for the whole outage (each commit waking the relay), then the broker comes back.
    let outbox = env.outbox("after_outage").await?;
    let child = env.relay_process(&outbox, &args, &envs).await?;
    proxy.set_down(true);
    let steps = 500;
    let per_step = n / steps;
    let began = Instant::now();
    for step in 0..steps {
        env.enqueue_range(
            &outbox,
            step * per_step..(step + 1) * per_step,
            Keys::Unordered,
        )
        .await?;
        // Paced over the outage (a schedule, not a wait for a condition).
        tokio::time::sleep_until((began + outage.mul_f64((step + 1) as f64 / steps as f64)).into())
            .await;
    }
    let n = steps * per_step;
    proxy.set_down(false);
    let back = Instant::now();
    let window = env.cpu(Some(child.id()));
    let resumed = env
        .wait_until(
            &outbox,
            "EXISTS (SELECT 1 FROM {rows} WHERE status = 'sent')",
            Duration::from_secs(120),
        )
        .await?;
    let done = env.wait_drained(&outbox, Duration::from_secs(600)).await?;
    let cpu = window.used(n).json();
    stop_process(child)?;
    let stats = outbox.stats(&mut env.conn).await?;
    let retried = env.count(&outbox, "attempts > 1").await?;
    env.drop_queue(&queue).await?;
    drop(proxy);

    // The drain proper starts with the first publish; until then the relay waits out the
    // rest of its outage backoff (at most 5 s), shown apart.
    let drain_rate = n as f64 / (done - resumed).as_secs_f64();
    let from_back_rate = n as f64 / (done - back).as_secs_f64();
    let params = json!({
        "messages": n, "payload_bytes": KIB, "outage_s": outage.as_secs(), "max_attempts": max_attempts,
        "batch_size": 512, "dead_letters": stats.dead, "sent": stats.sent,
        "rows_with_more_than_one_attempt": retried,
        "resumed_after_ms": (resumed - back).as_millis() as u64,
        "cpu_after_outage": cpu, "cpu_baseline": baseline.cpu.json(),
        "baseline": "the same relay and proxy, the backlog committed at once (a's run)",
    });
    let baseline = Some(("no outage (a's run, same proxy)", baseline.rate));
    let figures = vec![
        Figure {
            name: "i. drain after a broker outage",
            value: drain_rate,
            unit: "msg/s",
            baseline,
            target: ">= 0.80 x",
            params: params.clone(),
        },
        Figure {
            name: "i. the same, timed from the broker's return",
            value: from_back_rate,
            unit: "msg/s",
            baseline,
            target: "-",
            params: params.clone(),
        },
        Figure {
            name: "i. dead letters after the outage",
            value: stats.dead as f64,
            unit: "rows",
            baseline: None,
            target: "0",
            params,
        },
    ];
    for f in &figures {
        f.emit();
    }
    Ok(figures)
}
