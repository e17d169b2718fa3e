//! (l) The relay to Kafka against raw rdkafka producing the same messages (1 KiB, keyed by
//! the idempotency key, with the relay's `x-outbox-message-id` and `x-outbox-attempt`
//! headers) with the same producer settings (idempotent, `acks=all`, `linger.ms=2`) and
//! delivery reports awaited 512 at a time, both to a topic of three partitions, with the
//! CPU of each process.

use std::time::{Duration, Instant};

use diesel_async::SimpleAsyncConnection;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;

use crate::fixture::{Env, Keys};
use crate::{BoxResult, Figure, KIB};

const PARTITIONS: u32 = 3;

pub(crate) async fn kafka(env: &mut Env) -> BoxResult<Vec<Figure>> {
    let n = env.scale(50_000, 10_000);
    let batch = 512;
    let brokers = crate::common::kafka::brokers();
    let name = crate::common::unique("bench");
    let raw_topic = format!("{name}.raw.bench.event");
    let relay_prefix = format!("{name}.relay.");
    let relay_topic = format!("{relay_prefix}bench.event");
    diesel_outbox::kafka::Topology::new()
        .topic(&raw_topic, PARTITIONS)
        .topic(&relay_topic, PARTITIONS)
        .declare(&brokers)
        .await?;
    let payload = vec![b'x'; KIB];

    // Baseline: raw rdkafka with the relay's producer settings (its message timeout is the
    // relay's default delivery timeout less its margin), `window` reports awaited at once.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("message.timeout.ms", "9000")
        .set("request.timeout.ms", "9000")
        .create()?;
    env.conn.batch_execute("CHECKPOINT").await?;
    let window = batch;
    let started = Instant::now();
    let raw_window = env.cpu(None);
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
        if in_flight.len() >= window {
            reported(in_flight.next().await)?;
        }
        let key = format!("raw{i}");
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: diesel_outbox::kafka::MESSAGE_ID_HEADER,
                value: Some(key.as_str()),
            })
            .insert(Header {
                key: "x-outbox-attempt",
                value: Some("1"),
            });
        let record = FutureRecord::to(&raw_topic)
            .key(&key)
            .payload(&payload)
            .headers(headers);
        let delivery = producer
            .send_result(record)
            .map_err(|(e, _)| format!("producing: {e}"))?;
        in_flight.push(delivery);
    }
    while !in_flight.is_empty() {
        reported(in_flight.next().await)?;
    }
    let raw_rate = n as f64 / started.elapsed().as_secs_f64();
    let raw_cpu = raw_window.used(n);
    drop(producer);

    // The relay process, started on an empty table; the backlog arrives in one commit.
    let outbox = env.outbox("kafka").await?;
    let batch_arg = batch.to_string();
    let relay = env
        .drain_by_relay_process(
            &outbox,
            &[
                "--broker",
                "kafka",
                "--topic-prefix",
                &relay_prefix,
                "--batch-size",
                &batch_arg,
            ],
            &[("KAFKA_BROKERS", &brokers)],
            n,
            Keys::Unordered,
        )
        .await?;
    let (raw_stored, relay_stored) = {
        let brokers = brokers.clone();
        tokio::task::spawn_blocking(move || {
            Ok::<_, String>((
                stored(&brokers, &raw_topic)?,
                stored(&brokers, &relay_topic)?,
            ))
        })
        .await??
    };
    for (topic, count) in [("raw", raw_stored), ("relay", relay_stored)] {
        if count != n as u64 {
            return Err(format!("the {topic} topic holds {count} messages, not {n}").into());
        }
    }

    let params = json!({ "messages": n, "payload_bytes": KIB, "batch_size": batch, "raw_window": window, "partitions": PARTITIONS, "broker": "Tansu (memory storage)", "cpu_raw": raw_cpu.json(), "cpu_relay": relay.cpu.json() });
    let figure = Figure {
        name: "l. relay to Kafka vs raw rdkafka",
        value: relay.rate,
        unit: "msg/s",
        baseline: Some(("raw rdkafka, idempotent, acks=all", raw_rate)),
        target: ">= 0.90 x",
        params,
    };
    figure.emit();
    Ok(vec![figure])
}

/// A delivery report, as an error unless it says stored.
fn reported(
    report: Option<<rdkafka::producer::DeliveryFuture as std::future::Future>::Output>,
) -> BoxResult<()> {
    match report {
        Some(Ok(Ok(_))) => Ok(()),
        Some(Ok(Err((e, _)))) => Err(format!("a delivery failed: {e}").into()),
        Some(Err(_)) | None => Err("a delivery report never came".into()),
    }
}

/// Messages in `topic`: the partitions' high watermarks, summed.
fn stored(brokers: &str, topic: &str) -> Result<u64, String> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| e.to_string())?;
    let mut total = 0;
    for partition in 0..PARTITIONS {
        let (low, high) = reader
            .fetch_watermarks(
                topic,
                i32::try_from(partition).unwrap_or(0),
                Duration::from_secs(10),
            )
            .map_err(|e| format!("watermarks of {topic}: {e}"))?;
        total += u64::try_from(high - low).unwrap_or(0);
    }
    Ok(total)
}
