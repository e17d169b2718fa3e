//! `FacadeMetrics` through a real `metrics` recorder, after a relay run with successes,
//! failures and a dead letter, and a consumer run with a duplicate. One test: the recorder
//! is process-wide.
#![cfg(all(feature = "metrics", feature = "rabbitmq"))]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::broker::{SharedQueue, amqp_url};
use common::fakes::Recorder;
use common::{DEADLINE, eventually, fixture, spawn_consumer, spawn_relay, stop_relay};
use diesel_outbox::consumer::{Consumer, handler_fn, rabbitmq};
use diesel_outbox::{FacadeMetrics, Message, PublishError};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// What the recorder has seen so far. Its snapshots drain it (counters and gauges read
/// zero afterwards, histograms empty), so readings are merged here: counters and histogram
/// samples add up, gauges keep their last value.
#[derive(Default)]
struct Seen {
    counters: HashMap<String, u64>,
    gauges: HashMap<String, f64>,
    samples: HashMap<String, usize>,
}

impl Seen {
    /// Merges a new snapshot; series are named `name{label=value,...}` without `table`.
    fn read(&mut self, snapshotter: &Snapshotter) -> &Self {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<String> = key
                .labels()
                .filter(|l| l.key() != "table")
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            labels.sort();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            match value {
                DebugValue::Counter(n) => *self.counters.entry(name).or_default() += n,
                DebugValue::Gauge(v) => {
                    self.gauges.insert(name, v.into_inner());
                }
                DebugValue::Histogram(v) => *self.samples.entry(name).or_default() += v.len(),
            }
        }
        self
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }

    fn gauge(&self, name: &str) -> Option<f64> {
        self.gauges.get(name).copied()
    }

    fn samples(&self, name: &str) -> usize {
        self.samples.get(name).copied().unwrap_or(0)
    }
}

#[tokio::test]
async fn the_facade_reports_a_relay_run_and_a_consumer_run() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this binary");

    let mut f = fixture().await;
    for i in 0..3 {
        f.enqueue(Message::new("ok", "x").key(format!("ok{i}")))
            .await;
    }
    f.enqueue(Message::new("flaky", "x").key("flaky")).await;
    f.enqueue(Message::new("bad", "x").key("bad")).await;
    // Pending, but not due for an hour: the pending gauge counts it, the lag does not.
    f.enqueue(
        Message::new("later", "x")
            .key("later")
            .delay(Duration::from_secs(3600)),
    )
    .await;
    let flaked = Arc::new(AtomicBool::new(false));
    let publisher = {
        let flaked = flaked.clone();
        Recorder::default().failing(move |record| match record.topic.as_str() {
            "bad" => Some(PublishError::permanent("the broker can never take it")),
            "flaky" if !flaked.swap(true, Ordering::SeqCst) => {
                Some(PublishError::transient("a nack"))
            }
            _ => None,
        })
    };
    let relay = f
        .outbox
        .relay(f.pool.clone(), publisher)
        .backoff(Duration::from_millis(50), Duration::from_millis(50))
        .metrics(FacadeMetrics::new(f.outbox.table()).stats_interval(Duration::from_millis(100)))
        .build()
        .unwrap();
    let (stop, task) = spawn_relay(relay);
    f.wait_rows("status = 'sent'", 4).await;
    f.wait_rows("status = 'dead'", 1).await;
    // The gauges catch up within a few refreshes. (A snapshot resets them, so all four
    // must be seen in one reading: the values of one refresh.)
    let seen = Mutex::new(Seen::default());
    eventually(DEADLINE, "the gauges", || async {
        let mut seen = seen.lock().unwrap();
        let now = seen.read(&snapshotter);
        let refreshed = now.gauge("outbox_dead{}") == Some(1.0)
            && now.gauge("outbox_pending{}") == Some(1.0)
            && now.gauge("outbox_oldest_pending_age_seconds{}") == Some(0.0)
            && now.gauge("outbox_relay_blocked{}") == Some(0.0);
        seen.gauges.clear();
        refreshed.then_some(())
    })
    .await;
    stop_relay(stop, task).await;

    let mut seen = seen.into_inner().unwrap();
    let all = seen.read(&snapshotter);
    assert_eq!(all.counter("outbox_published_total{topic=ok}"), 3);
    assert_eq!(all.counter("outbox_published_total{topic=flaky}"), 1);
    assert_eq!(all.counter("outbox_failed_total{topic=flaky}"), 1);
    assert_eq!(all.counter("outbox_failed_total{topic=bad}"), 1);
    assert_eq!(all.counter("outbox_dead_lettered_total{topic=bad}"), 1);
    assert_eq!(
        all.counter("outbox_claimed_total{}"),
        6,
        "5 rows, the flaky one twice"
    );
    assert_eq!(all.samples("outbox_publish_duration_seconds{topic=ok}"), 3);
    assert_eq!(all.samples("outbox_delivery_lag_seconds{topic=ok}"), 3);

    // The consumer: two messages, one of them delivered twice.
    let broker = SharedQueue::new().await;
    for key in ["c1", "c2", "c1"] {
        broker.publish(key, "t", b"x", None).await;
    }
    let applied = Arc::new(Mutex::new(0));
    let counted = applied.clone();
    let consumer = Consumer::builder(f.outbox.clone(), f.pool.clone(), "metrics")
        .source(rabbitmq::Source::queue(amqp_url(), &broker.queue))
        .handler(handler_fn(move |_, _| {
            let counted = counted.clone();
            Box::pin(async move {
                *counted.lock().unwrap() += 1;
                Ok(())
            })
        }))
        .concurrency(1)
        .metrics(FacadeMetrics::new(f.outbox.table()))
        .build()
        .unwrap();
    let (tx, task) = spawn_consumer(consumer);
    let seen = Mutex::new(Seen::default());
    eventually(DEADLINE, "three deliveries", || async {
        let mut seen = seen.lock().unwrap();
        let seen = seen.read(&snapshotter);
        let ended = seen.counter("outbox_consumed_total{result=applied}")
            + seen.counter("outbox_consumed_total{result=duplicate}");
        (ended == 3).then_some(())
    })
    .await;
    stop_relay(tx, task).await;
    let mut seen = seen.into_inner().unwrap();
    let all = seen.read(&snapshotter);
    assert_eq!(all.counter("outbox_consumed_total{result=applied}"), 2);
    assert_eq!(all.counter("outbox_consumed_total{result=duplicate}"), 1);
    assert_eq!(*applied.lock().unwrap(), 2);
}
