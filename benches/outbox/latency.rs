//! (d) Commit-to-consumer latency, woken by NOTIFY and by polling only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel_outbox::Message;
use serde_json::json;

use crate::common::Alone;
use crate::fixture::Env;
use crate::measure::percentile;
use crate::{BoxResult, Figure, round};

pub(crate) async fn latency(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let rate = 500.0;
    let n = env.scale(5_000, 1_500);
    let mut figures = Vec::new();
    for notify in [true, false] {
        let name = if notify {
            "latency_notify"
        } else {
            "latency_poll"
        };
        let (exchange, queue) = env.queue(name).await?;
        let (outbox, relay) = env.with_relay(name, &exchange, notify).await?;
        // Start from a quiet relay: idle and, with notify, recorded as such for writers.
        env.wait_idle(&outbox).await?;

        // Both sides keyed by message: a delivery may reach the consumer before the writer
        // has noted its commit (the commit's reply and the delivery race), so latencies are
        // matched up afterwards, and one that arrived first counts as zero.
        let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
        let arrivals = env.arrivals(&queue, "latency", true).await?;
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut writer = diesel_outbox::establish(&env.database_url).await?;
        for i in 0..n {
            ticker.tick().await;
            let key = format!("l{i}");
            outbox
                .enqueue_alone(
                    &mut writer,
                    Message::new("bench.latency", "{}").key(key.clone()),
                )
                .await?;
            committed.lock().unwrap().insert(key, Instant::now());
        }
        arrivals.wait(n, Duration::from_secs(60)).await;
        let committed: Vec<(String, Instant)> = committed.lock().unwrap().drain().collect();
        let mut lat = arrivals.stop(&committed)?;
        relay.stop().await?;
        env.drop_queue(&queue).await?;
        let (p50, p95, p99) = (
            percentile(&mut lat, 50.0),
            percentile(&mut lat, 95.0),
            percentile(&mut lat, 99.0),
        );
        let params = json!({ "offered_msg_per_s": rate, "messages": n, "p50_ms": round(p50), "p95_ms": round(p95), "p99_ms": round(p99), "notify": notify });
        for (label, value, target) in [
            ("p50", p50, if notify { "<= 5 ms" } else { "-" }),
            ("p99", p99, if notify { "<= 25 ms" } else { "-" }),
        ] {
            let name: &'static str = match (notify, label) {
                (true, "p50") => "d. commit→consumer p50, notify",
                (true, _) => "d. commit→consumer p99, notify",
                (false, "p50") => "d. commit→consumer p50, polling only",
                (false, _) => "d. commit→consumer p99, polling only",
            };
            let f = Figure {
                name,
                value,
                unit: "ms",
                baseline: None,
                target,
                params: params.clone(),
            };
            f.emit();
            figures.push(f);
        }
        let _ = p95;
    }
    Ok(figures)
}
