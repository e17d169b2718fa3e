//! (l) The relay to Kafka against raw rdkafka producing the same messages (1 KiB, keyed by
//! the idempotency key, with the relay's `x-outbox-message-id` and `x-outbox-attempt`
//! headers) with the same producer settings (idempotent, `acks=all`, `linger.ms=2`), every
//! message handed to librdkafka at once and the delivery reports awaited after (the raw
//! client's ceiling: librdkafka batches as it likes), both to a topic of three partitions,
//! with the CPU of each process. A second line gives the rate the relay's CPU per message
//! (every process of the run together) would allow with every core busy.

use std::time::Instant;

use diesel_async::SimpleAsyncConnection;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::json;

use crate::fixture::{Env, Keys};
use crate::round;
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
    // relay's default delivery timeout less its margin), every message produced before the
    // reports are awaited.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "2")
        .set("message.timeout.ms", "9000")
        .set("request.timeout.ms", "9000")
        .create()?;
    // Connected, the producer id taken and the topic's partitions known before the clock
    // starts, as the relay process is.
    let warm_up = producer
        .send_result(FutureRecord::to(&raw_topic).key("warm-up").payload("x"))
        .map_err(|(e, _)| format!("producing: {e}"))?;
    reported(Some(warm_up.await))?;
    env.conn.batch_execute("CHECKPOINT").await?;
    let started = Instant::now();
    let raw_window = env.cpu(None);
    let mut in_flight = FuturesUnordered::new();
    for i in 0..n {
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
    // Read back (Tansu's high watermarks undercount what it stores): every key once.
    // The raw topic holds the warm-up message too.
    for (topic, prefix, stored) in [(&raw_topic, "raw", n + 1), (&relay_topic, "m", n)] {
        let topics = [topic.clone()];
        let read = crate::common::kafka::read(&brokers, &topics, PARTITIONS as i32, stored).await;
        let keys: std::collections::HashSet<_> = read
            .iter()
            .filter_map(|r| r.key.as_deref())
            .filter(|k| k.starts_with(prefix))
            .collect();
        if keys.len() != n {
            return Err(format!("{topic} holds {} of the {n} keys", keys.len()).into());
        }
    }

    // Every process of the run shares the machine's cores: the rate each side's CPU per
    // message allows with all of them busy says whether a rate is held by CPU or by waiting.
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as f64;
    let ceiling =
        |cpu: &crate::measure::CpuUse| cores * 1e6 / cpu.total_us().max(f64::MIN_POSITIVE);
    let params = json!({
        "messages": n, "payload_bytes": KIB, "batch_size": batch, "raw_in_flight": "all",
        "partitions": PARTITIONS, "broker": "Tansu (memory storage)",
        "cpu_raw": raw_cpu.json(), "cpu_relay": relay.cpu.json(), "cores": cores,
        "cores_busy_raw": round(raw_cpu.total_cores()), "cores_busy_relay": round(relay.cpu.total_cores()),
        "us_per_msg_raw": round(raw_cpu.total_us()), "us_per_msg_relay": round(relay.cpu.total_us()),
    });
    let figure = Figure {
        name: "l. relay to Kafka vs raw rdkafka",
        value: relay.rate,
        unit: "msg/s",
        baseline: Some(("raw rdkafka, idempotent, acks=all", raw_rate)),
        target: ">= 0.90 x",
        params: params.clone(),
    };
    figure.emit();
    // What the relay's CPU per message (its process, its PostgreSQL sessions, the broker
    // and the benchmark's process together) would allow with every core busy, against the
    // raw client's measured rate: the most that reading more in parallel could give here.
    let mut params = params;
    params["raw_ceiling"] = json!(round(ceiling(&raw_cpu)));
    let bound = Figure {
        name: "l. the rate the relay's CPU allows, all cores busy",
        value: ceiling(&relay.cpu),
        unit: "msg/s",
        baseline: Some(("raw rdkafka, idempotent, acks=all", raw_rate)),
        target: ">= 0.5 x",
        params,
    };
    bound.emit();
    Ok(vec![figure, bound])
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
