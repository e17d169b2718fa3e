//! (f) The claim on a table with a long history of sent rows.

use std::time::{Duration, Instant};

use diesel_async::SimpleAsyncConnection;
use diesel_outbox::{PublishError, Publisher, Record};
use serde_json::json;

use crate::fixture::{Env, Keys, RunningRelay};
use crate::{BoxResult, Figure};

/// Acks at once: isolates the database side of claim and mark.
struct Ack;

impl Publisher for Ack {
    async fn publish(&self, _: &Record) -> Result<(), PublishError> {
        Ok(())
    }
}

pub(crate) async fn history(env: &mut Env) -> BoxResult<Figure> {
    let history_rows = env.scale(1_000_000, 200_000);
    let n = env.scale(20_000, 10_000);
    let mut rates = Vec::new();
    let mut cpu = Vec::new();
    for with_history in [true, false] {
        let outbox = env
            .outbox(if with_history { "history" } else { "fresh" })
            .await?;
        if with_history {
            env.conn
                .batch_execute(&format!(
                    "INSERT INTO {t} (idempotency_key, topic, payload, status, attempts, fencing_token, sent_at, created_at) \
                     SELECT 'h' || g, 'bench.event', '\\x00'::bytea, 'sent', 1, 1, now() - interval '1 hour', now() - interval '1 hour' \
                     FROM generate_series(1, {history_rows}) g",
                    t = outbox.table()
                ))
                .await?;
            // History that has been there a while: vacuumed and analysed, as autovacuum
            // would leave it, rather than vacuumed in the middle of the measurement.
            env.conn
                .batch_execute(&format!("VACUUM (ANALYZE) {}", outbox.table()))
                .await?;
        }
        env.fill(&outbox, n, Keys::Unordered).await?;
        // Both runs start from a fresh checkpoint, so neither pays for the other's writes.
        env.conn.batch_execute("CHECKPOINT").await?;
        let started = Instant::now();
        let window = env.cpu(None);
        let relay = RunningRelay::start(
            outbox
                .relay(env.pool.clone(), Ack)
                .batch_size(256)
                .retention(None)
                .inbox_retention(None)
                .build()?,
        );
        let total = n as u64 + if with_history { history_rows as u64 } else { 0 };
        let (done, used) = env
            .wait_sent(&outbox, total, Duration::from_secs(300), &window, n)
            .await?;
        cpu.push(used.json());
        rates.push(n as f64 / (done - started).as_secs_f64());
        relay.stop().await?;
    }
    let f = Figure {
        name: "f. claim+mark with sent-row history",
        value: rates[0],
        unit: "msg/s",
        baseline: Some(("empty history", rates[1])),
        target: ">= 0.90 x",
        params: json!({ "history_rows": history_rows, "messages": n, "publisher": "acks at once (database side only)", "cpu_with_history": cpu[0], "cpu_empty_history": cpu[1] }),
    };
    f.emit();
    Ok(f)
}
