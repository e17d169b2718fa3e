//! (k) The relay to NATS JetStream against raw async-nats publishing the same messages
//! (1 KiB, `Nats-Msg-Id` set) with pipelined acknowledgements, both to one file-backed
//! stream, with the CPU of each process.

use std::time::Instant;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use diesel_async::SimpleAsyncConnection;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::json;

use crate::fixture::{Env, Keys};
use crate::{BoxResult, Figure, KIB};

pub(crate) async fn jetstream(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(50_000, 10_000);
    let batch = 512;
    let client = async_nats::connect(&env.nats_url).await?;
    let js = jetstream::new(client.clone());
    let name = crate::common::unique("bench");
    let stream_name = name.to_uppercase();
    let prefix = format!("{name}.");
    let create = |suffix: &str| stream::Config {
        name: format!("{stream_name}_{suffix}"),
        subjects: vec![format!("{prefix}{suffix}.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    };
    js.create_stream(create("raw")).await?;
    js.create_stream(create("relay")).await?;
    let payload = bytes::Bytes::from(vec![b'x'; KIB]);

    // Baseline: raw async-nats, up to `window` acknowledgements awaited at once.
    env.conn.batch_execute("CHECKPOINT").await?;
    let window = 512;
    let subject = format!("{prefix}raw.bench.event");
    let started = Instant::now();
    let raw_window = env.cpu(None);
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        if in_flight.len() >= window {
            in_flight.next().await.expect("an ack")?;
        }
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("raw{i}").as_str());
        let ack = js
            .publish_with_headers(subject.clone(), headers, payload.clone())
            .await?;
        in_flight.push(ack.into_future());
    }
    while let Some(ack) = in_flight.next().await {
        ack?;
    }
    let raw_rate = n as f64 / started.elapsed().as_secs_f64();
    let raw_cpu = raw_window.used(n);

    // The relay process, started on an empty table; the backlog arrives in one commit.
    let outbox = env.outbox("jetstream").await?;
    let relay_prefix = format!("{prefix}relay.");
    let batch_arg = batch.to_string();
    let nats_url = env.nats_url.clone();
    let relay = env
        .drain_by_relay_process(
            &outbox,
            &[
                "--broker",
                "nats",
                "--subject-prefix",
                &relay_prefix,
                "--batch-size",
                &batch_arg,
            ],
            &[("NATS_URL", &nats_url)],
            n,
            Keys::Unordered,
        )
        .await?;
    let stored = js
        .get_stream(format!("{stream_name}_relay"))
        .await?
        .info()
        .await?
        .state
        .messages;
    for suffix in ["raw", "relay"] {
        let _ = js.delete_stream(format!("{stream_name}_{suffix}")).await;
    }
    if stored != n as u64 {
        return Err(format!("the relay's stream holds {stored} messages, not {n}").into());
    }

    let params = json!({ "messages": n, "payload_bytes": KIB, "batch_size": batch, "raw_window": window, "storage": "file", "cpu_raw": raw_cpu.json(), "cpu_relay": relay.cpu.json() });
    let figure = Figure {
        name: "k. relay to JetStream vs raw async-nats",
        value: relay.rate,
        unit: "msg/s",
        baseline: Some(("raw async-nats, pipelined acks", raw_rate)),
        target: ">= 0.90 x",
        params,
    };
    figure.emit();
    Ok(vec![figure])
}
